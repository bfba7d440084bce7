"""The official openai client against the real server: every endpoint and parameter."""

from __future__ import annotations

import json
import math

import openai

from tests.server.conftest import MODEL_NAME, RunningServer

PROMPT = "The whale swam through the"
MESSAGES = [{"role": "user", "content": "Tell me about whales."}]
# The random model rarely samples EOS, but "full output" must not depend on luck.
NO_EOS = {"ignore_eos": True}


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert models[0].object == "model"


def test_health(server: RunningServer) -> None:
    assert server.http.get("/health").status_code == 200


def test_completion_returns_text_and_usage(client: openai.OpenAI, server: RunningServer) -> None:
    result = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0, extra_body=NO_EOS
    )
    choice = result.choices[0]
    assert result.object == "text_completion"
    assert choice.finish_reason == "length" and choice.text
    tokens = server.server.engine.engine.tokenizer.encode(PROMPT)
    assert result.usage.prompt_tokens == len(tokens)
    assert result.usage.completion_tokens == 8
    assert result.usage.total_tokens == len(tokens) + 8


def test_greedy_completion_equals_token_id_prompt(
    client: openai.OpenAI, server: RunningServer
) -> None:
    tokens = server.server.engine.engine.tokenizer.encode(PROMPT)
    by_text = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0
    )
    by_ids = client.completions.create(model=MODEL_NAME, prompt=tokens, max_tokens=6, temperature=0)
    assert by_text.choices[0].text == by_ids.choices[0].text


def test_batch_of_prompts_and_echo(client: openai.OpenAI) -> None:
    prompts = ["Call me Ishmael.", "Some years ago"]
    result = client.completions.create(
        model=MODEL_NAME, prompt=prompts, max_tokens=4, n=2, echo=True, temperature=0
    )
    assert [c.index for c in sorted(result.choices, key=lambda c: c.index)] == [0, 1, 2, 3]
    for choice in result.choices:
        assert choice.text.startswith(prompts[choice.index // 2])
    assert result.usage.completion_tokens <= 16


def test_chat_completion(client: openai.OpenAI, server: RunningServer) -> None:
    result = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=8, extra_body=NO_EOS
    )
    message = result.choices[0].message
    assert result.object == "chat.completion"
    assert message.role == "assistant" and message.content
    tokenizer = server.server.engine.engine.tokenizer
    prompt = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert result.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
    assert result.usage.completion_tokens == 8


def test_streaming_chat_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
        temperature=0,
        extra_body=NO_EOS,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and finishes.count("length") == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])
    whole = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=10, temperature=0, extra_body=NO_EOS
    )
    assert text == whole.choices[0].message.content


def test_streaming_completion_ends_with_done(server: RunningServer) -> None:
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 5, "stream": True}
    with server.http.stream("POST", "/v1/completions", json=body, headers=server.auth) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]"
    assert len(lines) >= 2


def test_n_samples(client: openai.OpenAI) -> None:
    result = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=8, n=2, seed=1, extra_body=NO_EOS
    )
    assert sorted(c.index for c in result.choices) == [0, 1]
    assert result.choices[0].text != result.choices[1].text
    assert result.usage.completion_tokens == 16


def test_streaming_n_samples(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=6, n=2, stream=True, extra_body=NO_EOS
    )
    finished = [c.choices[0].index for c in stream if c.choices and c.choices[0].finish_reason]
    assert sorted(finished) == [0, 1]


def test_stop_string_cuts_the_output(client: openai.OpenAI) -> None:
    full = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0, extra_body=NO_EOS
    )
    text = full.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]
    assert stop not in cut.choices[0].text


def test_seed_reproducible(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        result = client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=seed,
            extra_body=NO_EOS,
        )  # fmt: skip
        return result.choices[0].text

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_sampling_parameters_are_accepted(client: openai.OpenAI) -> None:
    result = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0.7,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        user="test-user",
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.2, "unknown_field": 1},
    )
    assert result.choices[0].finish_reason in ("length", "stop")


def test_completion_logprobs(client: openai.OpenAI) -> None:
    result = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=5, logprobs=3, temperature=0, extra_body=NO_EOS
    )
    logprobs = result.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 5
    assert "".join(logprobs.tokens) == result.choices[0].text
    for token, lp, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert lp <= 0 and len(top) == 3
        assert math.isclose(max(top.values()), lp, abs_tol=1e-4)  # greedy: the top token
        assert top[token] == lp
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(5)]


def test_chat_logprobs(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
        extra_body=NO_EOS,
    )
    content = result.choices[0].logprobs.content
    assert len(content) == 4
    assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in content)
    assert all(entry.bytes == list(entry.token.encode()) for entry in content)


def test_tokenize_and_detokenize(server: RunningServer) -> None:
    tokens = server.http.post("/tokenize", json={"prompt": PROMPT}, headers=server.auth).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    detokenize = {"tokens": tokens["tokens"]}
    text = server.http.post("/detokenize", json=detokenize, headers=server.auth).json()
    assert text == {"prompt": PROMPT}


def test_metrics_parse_and_counters_move(client: openai.OpenAI, server: RunningServer) -> None:
    before = server.metrics()
    client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=7, extra_body=NO_EOS)
    after = server.metrics()
    assert after["qserve:generation_tokens_total"] - before["qserve:generation_tokens_total"] == 7
    assert after["qserve:prompt_tokens_total"] > before["qserve:prompt_tokens_total"]
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert after[f"qserve:{name}_count"] == before[f"qserve:{name}_count"] + 1
    assert after["qserve:inter_token_latency_seconds_count"] >= (
        before["qserve:inter_token_latency_seconds_count"] + 6
    )
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                  "prefix_cache_hit_rate", "num_preemptions_total"):  # fmt: skip
        assert f"qserve:{gauge}" in after


def test_streaming_batch_matches_whole_response(client: openai.OpenAI) -> None:
    prompts = ["Call me Ishmael.", "Some years ago"]
    kw = dict(model=MODEL_NAME, prompt=prompts, max_tokens=6, n=2, seed=3, extra_body=NO_EOS)
    whole = client.completions.create(**kw)
    chunks = list(
        client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    texts: dict[int, str] = {}
    finished: list[int] = []
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        if choice.finish_reason:
            finished.append(choice.index)
    assert sorted(finished) == [0, 1, 2, 3]
    assert texts == {c.index: c.text for c in whole.choices}
    assert chunks[-1].usage == whole.usage


def test_tokenize_messages_uses_the_chat_template(server: RunningServer) -> None:
    tokenizer = server.server.engine.engine.tokenizer
    prompt = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    got = server.http.post("/tokenize", json={"messages": MESSAGES}, headers=server.auth).json()
    assert got["tokens"] == tokenizer.encode(prompt, add_special_tokens=False)
    both = {"messages": MESSAGES, "prompt": PROMPT}
    assert server.http.post("/tokenize", json=both, headers=server.auth).status_code == 400


def test_logprob_bytes_are_the_tokens_own_bytes(server: RunningServer) -> None:
    """An emoji is several byte-level tokens; each token's `bytes` are its bytes, not the
    U+FFFD its lone text decodes to."""
    serving = server.server.chat
    ids = serving.tokenizer.encode("😀 é", add_special_tokens=False)
    assert len(ids) > 2 and "\ufffd" in serving.token_text(ids[0])
    joined = b"".join(bytes(serving.token_bytes(i)) for i in ids)
    assert joined == "😀 é".encode()
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "logprobs": True,
            "temperature": 0}  # fmt: skip
    response = server.http.post("/v1/chat/completions", json=body, headers=server.auth).json()
    entries = response["choices"][0]["logprobs"]["content"]
    text = b"".join(bytes(e["bytes"]) for e in entries).decode("utf-8", errors="replace")
    assert text == response["choices"][0]["message"]["content"]


def test_text_offsets_agree_between_stream_and_whole_response(server: RunningServer) -> None:
    body = {"prompt": "😀 The whale", "max_tokens": 24, "logprobs": 2, "temperature": 0,
            "stop": ["never-seen-stop-string"],
            "ignore_eos": True}  # fmt: skip
    whole = server.http.post("/v1/completions", json=body, headers=server.auth).json()
    offsets: list[int] = []
    with server.http.stream("POST", "/v1/completions", json={**body, "stream": True},
                            headers=server.auth) as response:  # fmt: skip
        for line in response.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line.removeprefix("data: "))["choices"][0]
                offsets += (choice["logprobs"] or {}).get("text_offset", [])
    assert offsets == whole["choices"][0]["logprobs"]["text_offset"]
    assert len(offsets) == 24
