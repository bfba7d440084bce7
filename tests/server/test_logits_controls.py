"""logit_bias (OpenAI), allowed_token_ids and bad_words (vLLM's extras) through the server, on
the tiny random model with SmolLM2's tokenizer (greedy, it repeats the prompt's last token)."""

from __future__ import annotations

import openai
import pytest
from transformers import AutoTokenizer

from tests.server.conftest import MODEL_NAME, RunningServer

NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def token_id(tokenizer, text: str) -> int:
    (token,) = tokenizer.encode(text, add_special_tokens=False)
    return token


def completion_tokens(client: openai.OpenAI, prompt: str, **kw: object) -> list[str]:
    extra_body = {**NO_EOS, **kw.pop("extra_body", {})}  # type: ignore[dict-item]
    result = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=8, logprobs=0, extra_body=extra_body, **kw
    )
    return result.choices[0].logprobs.tokens


def test_logit_bias_forces_and_bans(client: openai.OpenAI, tokenizer) -> None:
    the = token_id(tokenizer, " the")
    forced = completion_tokens(client, "Call me Ishmael.", temperature=0, logit_bias={the: 100})
    assert forced == [" the"] * 8
    assert completion_tokens(client, "hi", temperature=0) == ["hi"] * 8
    banned = completion_tokens(
        client, "hi", temperature=0, logit_bias={str(token_id(tokenizer, "hi")): -100}
    )
    assert "hi" not in banned


def test_allowed_token_ids(client: openai.OpenAI, tokenizer) -> None:
    words = [" the", " whale", " sea", "!"]
    allowed = [token_id(tokenizer, w) for w in words]
    seen: set[str] = set()
    for seed in range(4):
        tokens = completion_tokens(client, "Call me Ishmael.", temperature=1.0, seed=seed,
                                   extra_body={"allowed_token_ids": allowed})  # fmt: skip
        assert set(tokens) <= set(words), tokens
        seen.update(tokens)
    assert len(seen) > 1
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
        temperature=1.0, seed=0, logprobs=True, extra_body={**NO_EOS, "allowed_token_ids": allowed},
    )  # fmt: skip
    assert {entry.token for entry in chat.choices[0].logprobs.content} <= set(words)


def test_bad_words(client: openai.OpenAI) -> None:
    # one token ("hi" and " hi" are one token each): never sampled
    tokens = completion_tokens(client, "hi", temperature=0, extra_body={"bad_words": ["hi"]})
    assert "hi" not in tokens and " hi" not in tokens
    # two tokens ("hi" "hi"): the second "hi" is banned after a first one
    text = "".join(completion_tokens(client, "hi", temperature=0))
    assert "hihi" in text
    tokens = completion_tokens(client, "hi", temperature=0, extra_body={"bad_words": ["hihi"]})
    assert tokens[0] == "hi" and "hihi" not in "".join(tokens)


BAD = [
    ("bias-too-large", {"logit_bias": {"50": 150}}, "logit_bias"),
    ("bias-too-small", {"logit_bias": {"50": -100.5}}, "logit_bias"),
    ("bias-key-not-an-id", {"logit_bias": {"whale": 1}}, "logit_bias"),
    ("bias-key-negative", {"logit_bias": {"-3": 1}}, "logit_bias"),
    ("bias-out-of-vocab", {"logit_bias": {"10000000": 1}}, "logit_bias"),
    ("bias-not-a-number", {"logit_bias": {"50": "high"}}, "logit_bias.50"),
    ("allowed-empty", {"allowed_token_ids": []}, "allowed_token_ids"),
    ("allowed-out-of-vocab", {"allowed_token_ids": [5, 10**7]}, "allowed_token_ids"),
    ("allowed-negative", {"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ("allowed-not-a-list", {"allowed_token_ids": 5}, "allowed_token_ids"),
    ("bad-words-empty-string", {"bad_words": [""]}, "bad_words"),
    ("bad-words-a-string", {"bad_words": "whale"}, "bad_words"),
    ("bad-words-too-many", {"bad_words": [f"w{i}" for i in range(200)]}, "bad_words"),
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("extra, param", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_controls_are_a_400_naming_the_field(
    server: RunningServer, path: str, extra: dict, param: str
) -> None:
    if path == "/v1/completions":
        body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, **extra}
    else:
        messages = [{"role": "user", "content": "hi"}]
        body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 2, **extra}
    response = server.http.post(path, headers=server.auth, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    metrics = server.wait_all_blocks_free()
    assert metrics["qserve:kv_cache_free_blocks"] == metrics["qserve:kv_cache_num_blocks"]
