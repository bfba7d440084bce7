"""vLLM's `use_beam_search`, `length_penalty` and `n` on /v1/completions and
/v1/chat/completions: the best n beams, as the engine's own beam search returns them."""

from __future__ import annotations

from qserve.engine.beam_search import BeamSearchParams
from tests.server.conftest import MODEL_NAME, RunningServer, tiny_engine

PROMPT = "The whale swam through the"
MESSAGES = [{"role": "user", "content": "Tell me about whales."}]


def engine_beams(model_dir, prompt_ids: list[int], params: BeamSearchParams) -> list[str]:
    engine = tiny_engine(model_dir)
    engine.add_beam_search_request("r", prompt_ids, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    (output,) = outputs
    return [c.text for c in output.outputs]


def test_completion_beam_search_returns_the_best_n(server: RunningServer, tiny_model_dir):
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 6, "n": 3,
            "use_beam_search": True, "length_penalty": 0.5, "ignore_eos": True}  # fmt: skip
    response = server.http.post("/v1/completions", headers=server.auth, json=body)
    assert response.status_code == 200, response.text
    result = response.json()
    assert [c["index"] for c in result["choices"]] == [0, 1, 2]
    assert all(c["finish_reason"] == "length" for c in result["choices"])
    assert result["usage"]["completion_tokens"] == 18
    prompt_ids = server.server.engine.engine.tokenizer.encode(PROMPT)
    params = BeamSearchParams(3, 6, ignore_eos=True, temperature=1.0, length_penalty=0.5)
    want = engine_beams(tiny_model_dir, prompt_ids, params)
    assert [c["text"] for c in result["choices"]] == want
    assert len(set(want)) == 3  # three different beams
    server.wait_all_blocks_free()


def test_chat_beam_search(server: RunningServer) -> None:
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 5, "n": 2,
            "use_beam_search": True}  # fmt: skip
    response = server.http.post("/v1/chat/completions", headers=server.auth, json=body)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert all(c["message"]["role"] == "assistant" for c in choices)
    metrics = server.wait_all_blocks_free()
    assert metrics["qserve:kv_cache_free_blocks"] == metrics["qserve:kv_cache_num_blocks"]


def test_beam_search_with_stream_is_a_400(server: RunningServer) -> None:
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4, "n": 2,
            "use_beam_search": True, "stream": True}  # fmt: skip
    response = server.http.post("/v1/completions", headers=server.auth, json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "stream"
