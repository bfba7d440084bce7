"""Scoring through /v1/completions as lm-eval's `local-completions` does it: `echo` with `logprobs`
(vLLM's shape: the prompt's tokens and logprobs first, the first null), `max_tokens: 0` with
echo, and vLLM's `prompt_logprobs` field, against transformers' log_softmax in fp32."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.server.conftest import MODEL_NAME, RunningServer

ATOL = 1e-4


@pytest.fixture(scope="module")
def prompt_ids(server: RunningServer) -> list[list[int]]:
    text = "Call me Ishmael. Some years ago, never mind how long precisely, having little money"
    ids = server.http.post("/tokenize", headers=server.auth, json={"prompt": text}).json()
    tokens = ids["tokens"]
    return [tokens, tokens[:7], [5]]


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path, prompt_ids) -> list[torch.Tensor]:
    """log p(token i | tokens before it) for i >= 1, from transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for ids in prompt_ids:
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1], -1)
            out.append(logprobs.gather(1, torch.tensor(ids[1:]).unsqueeze(1))[:, 0])
    return out


def post(server: RunningServer, **body: object) -> dict:
    response = server.http.post(
        "/v1/completions", headers=server.auth, json={"model": MODEL_NAME, **body}
    )
    assert response.status_code == 200, response.text
    return response.json()


def test_lm_eval_loglikelihood_request(server, prompt_ids, reference):
    """What lm-eval sends for each (context, continuation): the prompt's own logprobs come
    back first, then the one generated token's."""
    body = post(server, prompt=prompt_ids, max_tokens=1, logprobs=1, echo=True, temperature=0,
                seed=1234)  # fmt: skip
    for choice, ids, want in zip(body["choices"], prompt_ids, reference):
        logprobs = choice["logprobs"]
        assert len(logprobs["token_logprobs"]) == len(ids) + 1
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        got = torch.tensor(logprobs["token_logprobs"][1 : len(ids)])
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        assert logprobs["text_offset"][0] == 0
        assert logprobs["text_offset"] == sorted(logprobs["text_offset"])
        for top, token, lp in zip(logprobs["top_logprobs"][1:], logprobs["tokens"][1:],
                                  logprobs["token_logprobs"][1:]):  # fmt: skip
            assert top[token] == pytest.approx(lp) and len(top) in (1, 2)
        assert choice["text"].startswith(logprobs["tokens"][0])
    assert body["usage"]["completion_tokens"] == len(prompt_ids)


def test_max_tokens_zero_scores_the_prompt_alone(server, prompt_ids, reference):
    body = post(server, prompt=prompt_ids[0], max_tokens=0, logprobs=0, echo=True)
    [choice] = body["choices"]
    text = server.http.post("/detokenize", headers=server.auth,
                            json={"tokens": prompt_ids[0]}).json()["prompt"]  # fmt: skip
    assert choice["text"] == text
    assert choice["finish_reason"] == "length"
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(prompt_ids[0])
    assert "".join(logprobs["tokens"]) == text
    torch.testing.assert_close(torch.tensor(logprobs["token_logprobs"][1:]), reference[0],
                               atol=ATOL, rtol=0)  # fmt: skip
    assert body["usage"]["completion_tokens"] == 0
    assert body["usage"]["prompt_tokens"] == len(prompt_ids[0])


def test_prompt_logprobs_field(server, prompt_ids, reference):
    body = post(server, prompt=prompt_ids[1], max_tokens=2, prompt_logprobs=3, temperature=0)
    [choice] = body["choices"]
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(prompt_ids[1]) and entries[0] is None
    for entry, token, want in zip(entries[1:], prompt_ids[1][1:], reference[1]):
        assert entry[str(token)]["logprob"] == pytest.approx(float(want), abs=ATOL)
        assert 3 <= len(entry) <= 4  # the top 3, and the prompt token if not among them
        ranks = sorted(e["rank"] for e in entry.values())
        assert ranks[:3] == [1, 2, 3] if len(entry) == 4 else ranks[0] == 1
    assert choice["logprobs"] is None  # no echo: no legacy columns


def test_stream_echo_with_logprobs_equals_the_whole_response(server, prompt_ids):
    body = dict(prompt=prompt_ids[0], max_tokens=3, logprobs=2, echo=True, temperature=0)
    whole = post(server, **body)["choices"][0]
    with server.http.stream("POST", "/v1/completions", headers=server.auth,
                            json={"model": MODEL_NAME, "stream": True, **body}) as r:  # fmt: skip
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(e)["choices"][0] for e in events if e != "[DONE]"]
    columns = {key: [] for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    for chunk in chunks:
        for key in columns:
            columns[key] += (chunk["logprobs"] or {}).get(key, [])
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert columns == whole["logprobs"]


def test_stream_max_tokens_zero(server, prompt_ids):
    body = dict(prompt=prompt_ids[1], max_tokens=0, logprobs=1, echo=True, stream=True)
    with server.http.stream("POST", "/v1/completions", headers=server.auth,
                            json={"model": MODEL_NAME, **body}) as r:  # fmt: skip
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(e)["choices"][0] for e in events if e != "[DONE]"]
    tokens = [t for c in chunks for t in (c["logprobs"] or {}).get("tokens", [])]
    assert len(tokens) == len(prompt_ids[1])
    assert chunks[-1]["finish_reason"] == "length"
