"""Clients that go away abort their requests and give every KV block back; the others finish."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, RunningServer

NUM_STREAMS = 16
KEPT_TOKENS = 32
DROPPED_MAX_TOKENS = 400  # far more than is generated before the drop
CHUNKS_BEFORE_DROP = 3
TIMEOUT_S = 60


async def _kept(server: RunningServer, i: int) -> tuple[str, int]:
    async with server.async_client(timeout=TIMEOUT_S) as client:
        stream = await client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": f"Story number {i}"}],
            max_tokens=KEPT_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = [chunk async for chunk in stream]
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    return finish[-1], chunks[-1].usage.completion_tokens


async def _dropped(server: RunningServer, i: int) -> int:
    async with server.async_client(timeout=TIMEOUT_S) as client:
        stream = await client.completions.create(
            model=MODEL_NAME,
            prompt=f"Chapter {i}. The whale",
            max_tokens=DROPPED_MAX_TOKENS,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        received = 0
        async for _ in stream:
            received += 1
            if received == CHUNKS_BEFORE_DROP:
                break
        await stream.close()  # closes the connection mid-stream
    return received


async def _mixed(server: RunningServer) -> tuple[list[tuple[str, int]], list[int]]:
    kept = [_kept(server, i) for i in range(0, NUM_STREAMS, 2)]
    dropped = [_dropped(server, i) for i in range(1, NUM_STREAMS, 2)]
    results = await asyncio.wait_for(asyncio.gather(*kept, *dropped), TIMEOUT_S)
    return results[: len(kept)], results[len(kept) :]


def test_dropped_streams_free_their_blocks(server: RunningServer) -> None:
    before = server.metrics()
    kept, dropped = asyncio.run(_mixed(server))
    assert kept == [("length", KEPT_TOKENS)] * (NUM_STREAMS // 2)
    assert dropped == [CHUNKS_BEFORE_DROP] * (NUM_STREAMS // 2)
    after = server.wait_all_blocks_free()
    assert after["qserve:kv_cache_free_blocks"] == after["qserve:kv_cache_num_blocks"]
    assert after["qserve:num_requests_running"] == after["qserve:num_requests_waiting"] == 0
    # Only the kept ones finished; the dropped ones were aborted long before 400 tokens.
    finished = after["qserve:e2e_request_latency_seconds_count"]
    assert finished - before["qserve:e2e_request_latency_seconds_count"] == NUM_STREAMS // 2
    generated = after["qserve:generation_tokens_total"] - before["qserve:generation_tokens_total"]
    assert generated < NUM_STREAMS // 2 * (KEPT_TOKENS + DROPPED_MAX_TOKENS // 2)
    assert server.server.engine.engine.requests == {}


def test_non_streaming_client_that_times_out_is_aborted(server: RunningServer) -> None:
    body = {"model": MODEL_NAME, "prompt": "The whale", "max_tokens": DROPPED_MAX_TOKENS,
            "ignore_eos": True}  # fmt: skip
    with pytest.raises(httpx.ReadTimeout):
        server.http.post("/v1/completions", json=body, headers=server.auth, timeout=0.5)
    after = server.wait_all_blocks_free()
    assert after["qserve:kv_cache_free_blocks"] == after["qserve:kv_cache_num_blocks"]
    assert server.server.engine.engine.requests == {}
