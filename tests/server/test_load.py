"""200 requests, 32 at a time, over loopback: no errors, every output complete, no leaked block."""

from __future__ import annotations

import asyncio
import random

import openai

from tests.server.conftest import MODEL_NAME, RunningServer

NUM_REQUESTS = 200
CONCURRENCY = 32
TIMEOUT_S = 120
WORDS = "call me ishmael some years ago never mind how long precisely having little money".split()


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 60)))


async def _one(client: openai.AsyncOpenAI, i: int, max_tokens: int, prompt: str) -> int:
    """Send request i (completion or chat, streamed or not); return its completion tokens."""
    extra = {"ignore_eos": True}
    if i % 2 == 0:
        messages = [{"role": "user", "content": prompt}]
        if i % 4 == 0:
            stream = await client.chat.completions.create(
                model=MODEL_NAME, messages=messages, max_tokens=max_tokens, stream=True,
                stream_options={"include_usage": True}, extra_body=extra,
            )  # fmt: skip
            return [c async for c in stream][-1].usage.completion_tokens
        result = await client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=max_tokens, extra_body=extra
        )
        return result.usage.completion_tokens
    result = await client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, extra_body=extra, seed=i
    )
    return result.usage.completion_tokens


async def _load(server: RunningServer) -> tuple[list[int], list[int | BaseException]]:
    rng = random.Random(0)
    wanted = [rng.randint(4, 16) for _ in range(NUM_REQUESTS)]
    prompts = [_prompt(rng) for _ in range(NUM_REQUESTS)]
    semaphore = asyncio.Semaphore(CONCURRENCY)
    async with server.async_client(timeout=TIMEOUT_S) as client:

        async def bounded(i: int) -> int:
            async with semaphore:
                return await _one(client, i, wanted[i], prompts[i])

        tasks = [bounded(i) for i in range(NUM_REQUESTS)]
        got = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), TIMEOUT_S)
    return wanted, got


def test_load_has_no_errors_and_no_leaks(server: RunningServer) -> None:
    before = server.metrics()
    wanted, got = asyncio.run(_load(server))
    errors = [g for g in got if isinstance(g, BaseException)]
    assert errors == []
    assert got == wanted
    after = server.wait_all_blocks_free()
    assert after["qserve:kv_cache_free_blocks"] == after["qserve:kv_cache_num_blocks"]
    assert after["qserve:num_requests_running"] == after["qserve:num_requests_waiting"] == 0
    assert server.server.engine.engine.requests == {}
    assert server.server.engine.num_requests == 0
    finished = after["qserve:e2e_request_latency_seconds_count"]
    assert finished - before["qserve:e2e_request_latency_seconds_count"] == NUM_REQUESTS
