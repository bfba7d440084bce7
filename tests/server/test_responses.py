"""The response models and the logprobs builders, without a server: what the JSON looks like."""

from __future__ import annotations

import json

from qserve.engine.sampler import Logprobs
from qserve.server.logprobs import chat_logprobs, completion_logprobs
from qserve.server.protocol import APIError
from qserve.server.responses import (
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    DeltaMessage,
    UsageInfo,
    sse,
)

TEXTS = {1: "a", 2: "bc", 3: "a", 4: "\ufffd"}  # 1 and 3 decode alike


def text(token_id: int) -> str:
    return TEXTS[token_id]


def bytes_of(token_id: int) -> list[int]:
    return [0xF0] if token_id == 4 else list(TEXTS[token_id].encode())


ENTRIES = [
    Logprobs(sampled_token_id=2, logprob=-0.5, rank=2, top_token_ids=[1, 2, 3],
             top_logprobs=[-0.25, -0.5, -3.0]),
    Logprobs(sampled_token_id=4, logprob=-1e-05, rank=9, top_token_ids=[1, 3],
             top_logprobs=[-0.125, -2.0]),
]  # fmt: skip


def test_completion_logprobs_are_columns_with_text_offsets() -> None:
    logprobs, end = completion_logprobs(ENTRIES, 2, 10, text)
    assert logprobs is not None and end == 13  # "bc" + "\ufffd" after offset 10
    assert logprobs.model_dump() == {
        "tokens": ["bc", "\ufffd"],
        "token_logprobs": [-0.5, -1e-05],
        # top-k by text, the later of two alike texts winning; the sampled token added last
        "top_logprobs": [{"a": -0.25, "bc": -0.5}, {"a": -2.0, "\ufffd": -1e-05}],
        "text_offset": [10, 12],
    }
    assert completion_logprobs(ENTRIES, None, 10, text) == (None, 10)
    assert completion_logprobs(None, 2, 10, text) == (None, 10)


def test_chat_logprobs_are_entries_with_bytes() -> None:
    logprobs = chat_logprobs(ENTRIES[1:], 1, text, bytes_of)
    assert logprobs is not None
    assert json.dumps(logprobs.model_dump(), ensure_ascii=False) == (
        '{"content": [{"token": "\ufffd", "logprob": -1e-05, "bytes": [240], '
        '"top_logprobs": [{"token": "a", "logprob": -0.125, "bytes": [97]}]}]}'
    )
    assert chat_logprobs(None, 1, text, bytes_of) is None


def _chunk(choices: list, **usage: UsageInfo | None) -> ChatCompletionStreamResponse:
    return ChatCompletionStreamResponse(
        id="chatcmpl-1", object="chat.completion.chunk", created=7, model="m", choices=choices,
        **usage,
    )  # fmt: skip


def test_a_stream_chunk_has_the_fields_it_was_given() -> None:
    role = ChatCompletionResponseStreamChoice(
        index=0, delta=DeltaMessage(role="assistant", content=""), logprobs=None,
        finish_reason=None,
    )  # fmt: skip
    assert sse(_chunk([role])) == (
        '{"id":"chatcmpl-1","object":"chat.completion.chunk","created":7,"model":"m","choices":'
        '[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
        '"finish_reason":null}]}'
    )
    last = ChatCompletionResponseStreamChoice(
        index=0, delta=DeltaMessage(), logprobs=None, finish_reason="length", stop_reason=None
    )
    payload = json.loads(sse(_chunk([last], usage=None)))
    assert payload["choices"][0]["delta"] == {} and payload["usage"] is None
    assert payload["choices"][0]["stop_reason"] is None
    counts = UsageInfo(prompt_tokens=3, completion_tokens=2, total_tokens=5)
    assert sse(_chunk([], usage=counts)).endswith(
        '"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}'
    )


def test_error_body() -> None:
    error = APIError("no", 404, param="model", code="model_not_found")
    assert error.body() == {
        "error": {
            "message": "no",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    assert sse(error.response()) == json.dumps(error.body(), separators=(",", ":"))
