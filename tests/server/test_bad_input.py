"""Malformed requests get the right 4xx with an OpenAI error body; the server keeps serving."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.conftest import MODEL_NAME, RunningServer
from tests.server.tiny_model import MAX_POSITION_EMBEDDINGS

OK_COMPLETION = {"model": MODEL_NAME, "prompt": "Call me Ishmael.", "max_tokens": 4}
OK_CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
HUGE_PROMPT = "whale " * (2 * MAX_POSITION_EMBEDDINGS)


def completion(**changes: object) -> dict[str, object]:
    return {**OK_COMPLETION, **changes}


def chat(**changes: object) -> dict[str, object]:
    return {**OK_CHAT, **changes}


def without(body: dict[str, object], key: str) -> dict[str, object]:
    return {k: v for k, v in body.items() if k != key}


# (case id, path, JSON body or raw bytes, expected status, expected `param` or None to skip)
CASES = [
    ("invalid-json", "/v1/completions", b'{"model": ', 400, None),
    ("empty-body", "/v1/completions", b"", 400, None),
    ("body-is-a-list", "/v1/completions", b"[1, 2]", 400, None),
    ("missing-prompt", "/v1/completions", without(OK_COMPLETION, "prompt"), 400, "prompt"),
    ("prompt-wrong-type", "/v1/completions", completion(prompt=5), 400, "prompt"),
    ("empty-prompt", "/v1/completions", completion(prompt=""), 400, "prompt"),
    ("empty-prompt-list", "/v1/completions", completion(prompt=[]), 400, "prompt"),
    ("token-out-of-vocab", "/v1/completions", completion(prompt=[1, 10**7]), 400, "prompt"),
    ("max-tokens-string", "/v1/completions", completion(max_tokens="10"), 400, "max_tokens"),
    ("max-tokens-negative", "/v1/completions", completion(max_tokens=-1), 400, "max_tokens"),
    ("max-tokens-zero", "/v1/completions", completion(max_tokens=0), 400, "max_tokens"),
    ("max-tokens-float", "/v1/completions", completion(max_tokens=2.5), 400, "max_tokens"),
    ("temperature-negative", "/v1/completions", completion(temperature=-0.5), 400, "temperature"),
    ("temperature-string", "/v1/completions", completion(temperature="hot"), 400, "temperature"),
    ("top-p-above-one", "/v1/completions", completion(top_p=1.5), 400, "top_p"),
    ("top-k-below-minus-one", "/v1/completions", completion(top_k=-5), 400, "top_k"),
    ("min-p-above-one", "/v1/completions", completion(min_p=2.0), 400, "min_p"),
    ("n-zero", "/v1/completions", completion(n=0), 400, "n"),
    ("n-string", "/v1/completions", completion(n="two"), 400, "n"),
    ("n-huge", "/v1/completions", completion(n=10_000), 400, "n"),
    (
        "presence-penalty",
        "/v1/completions",
        completion(presence_penalty=3),
        400,
        "presence_penalty",
    ),
    (
        "frequency-penalty",
        "/v1/completions",
        completion(frequency_penalty=-3),
        400,
        "frequency_penalty",
    ),  # fmt: skip
    (
        "repetition-penalty",
        "/v1/completions",
        completion(repetition_penalty=0),
        400,
        "repetition_penalty",
    ),  # fmt: skip
    ("stop-number", "/v1/completions", completion(stop=5), 400, "stop"),
    ("stop-empty-string", "/v1/completions", completion(stop=[""]), 400, "stop"),
    ("logprobs-too-many", "/v1/completions", completion(logprobs=50), 400, "logprobs"),
    (
        "echo-logprobs-too-many",
        "/v1/completions",
        completion(echo=True, logprobs=21),
        400,
        "logprobs",
    ),
    (
        "prompt-logprobs-too-many",
        "/v1/completions",
        completion(prompt_logprobs=21),
        400,
        "prompt_logprobs",
    ),
    (
        "prompt-logprobs-negative",
        "/v1/completions",
        completion(prompt_logprobs=-1),
        400,
        "prompt_logprobs",
    ),
    (
        "prompt-logprobs-stream",
        "/v1/completions",
        completion(prompt_logprobs=1, stream=True),
        400,
        "prompt_logprobs",
    ),
    (
        "echo-token-out-of-vocab",
        "/v1/completions",
        completion(prompt=[[1, 10**7]], echo=True, logprobs=1, max_tokens=1),
        400,
        "prompt",
    ),
    (
        "echo-max-tokens-zero-out-of-vocab",
        "/v1/completions",
        completion(prompt=[5, -3], echo=True, max_tokens=0),
        400,
        "prompt",
    ),
    (
        "max-tokens-zero-logprobs",
        "/v1/completions",
        completion(max_tokens=0, logprobs=1),
        400,
        "max_tokens",
    ),
    ("seed-string", "/v1/completions", completion(seed="x"), 400, "seed"),
    ("logit-bias", "/v1/completions", completion(logit_bias={"50": 101}), 400, "logit_bias"),
    (
        "stream-options-type",
        "/v1/completions",
        completion(stream_options=True),
        400,
        "stream_options",
    ),  # fmt: skip
    ("huge-prompt", "/v1/completions", completion(prompt=HUGE_PROMPT), 400, "prompt"),
    (
        "prompt-plus-max-tokens",
        "/v1/completions",
        completion(max_tokens=MAX_POSITION_EMBEDDINGS),
        400,
        "max_tokens",
    ),  # fmt: skip
    ("unknown-model", "/v1/completions", completion(model="gpt-4"), 404, "model"),
    ("empty-messages", "/v1/chat/completions", chat(messages=[]), 400, "messages"),
    ("missing-messages", "/v1/chat/completions", without(OK_CHAT, "messages"), 400, "messages"),
    ("messages-not-a-list", "/v1/chat/completions", chat(messages="hi"), 400, "messages"),
    (
        "unknown-role",
        "/v1/chat/completions",
        chat(messages=[{"role": "robot", "content": "x"}]),
        400,
        "messages.0.role",
    ),  # fmt: skip
    (
        "image-content",
        "/v1/chat/completions",
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        400,
        None,
    ),  # fmt: skip
    (
        "top-logprobs-without-logprobs",
        "/v1/chat/completions",
        chat(top_logprobs=2),
        400,
        "top_logprobs",
    ),  # fmt: skip
    (
        "chat-top-logprobs-too-many",
        "/v1/chat/completions",
        chat(logprobs=True, top_logprobs=21),
        400,
        "logprobs",
    ),  # fmt: skip
    ("chat-unknown-model", "/v1/chat/completions", chat(model="nope"), 404, "model"),
    ("detokenize-out-of-vocab", "/detokenize", {"tokens": [-1]}, 400, "tokens"),
]


def _post(
    server: RunningServer, path: str, body: object, headers: dict[str, str]
) -> httpx.Response:
    if isinstance(body, bytes):  # malformed JSON, sent as JSON
        headers = {**headers, "Content-Type": "application/json"}
        return server.http.post(path, headers=headers, content=body)
    return server.http.post(path, headers=headers, json=body)


def _assert_error_body(response: httpx.Response, status: int) -> dict[str, object]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    return error


@pytest.mark.parametrize(("path", "body", "status", "param"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])  # fmt: skip
def test_bad_request_gets_an_error_body(
    server: RunningServer, path: str, body: object, status: int, param: str | None
) -> None:
    error = _assert_error_body(_post(server, path, body, server.auth), status)
    if param is not None:
        assert error["param"] == param, error


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "x"}])
def test_api_key_is_required(server: RunningServer, headers: dict[str, str]) -> None:
    error = _assert_error_body(_post(server, "/v1/completions", OK_COMPLETION, headers), 401)
    assert error["code"] == "invalid_api_key"
    _assert_error_body(server.http.get("/v1/models", headers=headers), 401)


def test_health_needs_no_key_and_metrics_does(server: RunningServer) -> None:
    assert server.http.get("/health").status_code == 200
    error = _assert_error_body(server.http.get("/metrics"), 401)
    assert error["code"] == "invalid_api_key"
    assert server.http.get("/metrics", headers=server.auth).status_code == 200


def test_unknown_route_and_method(server: RunningServer) -> None:
    _assert_error_body(server.http.get("/v1/nothing", headers=server.auth), 404)
    _assert_error_body(server.http.get("/v1/completions", headers=server.auth), 405)


def test_openai_client_raises_typed_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL_NAME, prompt="x", temperature=-1)
    assert bad.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.AuthenticationError):
        client.with_options(api_key="wrong").models.list()


def test_server_still_serves_after_bad_input(client: openai.OpenAI, server: RunningServer) -> None:
    for _, path, body, _, _ in CASES:  # all of them once more, back to back
        _post(server, path, body, server.auth)
    result = client.completions.create(model=MODEL_NAME, prompt="Call me Ishmael.", max_tokens=4)
    assert result.choices[0].text
    metrics = server.wait_all_blocks_free()
    assert metrics["qserve:kv_cache_free_blocks"] == metrics["qserve:kv_cache_num_blocks"]
