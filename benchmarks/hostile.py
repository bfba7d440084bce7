"""Hostile clients for the serving benchmark: what each one tries, sent in a loop until stopped.

    async with hostile_clients(base_url, model, count=6) as report:  # while the block runs
        ...the normal workload...
    report -> {kind: {"done": N, "statuses": {"400": N, ...}}}

They run in a process of their own, so that building and sending their bodies does not slow the
measured clients' event loop (which would show up as server latency).

The kinds (client i runs kinds[i % len(kinds)], all of KINDS unless given):
    wide          one request of n=128 x 64 tokens (fair admission keeps it from starving others)
    huge_body     a body just under the default 8 MiB limit whose text prompt cannot fit the
                  context (refused before tokenizing) and one over it (413)
    tokenize      /tokenize of a 200 kB text (tokenized on the tokenizer thread)
    stop_strings  5,000 stop strings (400)
    slow_reader   a stream whose client reads nothing (cut off after --stream-timeout)
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx

MIB = 2**20
WARMUP_S = 2.0
KINDS = ("wide", "huge_body", "tokenize", "stop_strings", "slow_reader")
Report = dict[str, dict[str, Any]]


async def _wide(client: httpx.AsyncClient, model: str) -> list[int]:
    body = {"model": model, "prompt": "Call me Ishmael.", "n": 128, "max_tokens": 64,
            "ignore_eos": True}  # fmt: skip
    return [(await client.post("/v1/completions", json=body)).status_code]


async def _huge_body(client: httpx.AsyncClient, model: str) -> list[int]:
    statuses = []
    for size in (8 * MIB - 4096, 8 * MIB + 4096):
        content = b'{"model": "%s", "prompt": "' % model.encode() + b"a " * (size // 2) + b'"}'
        headers = {"Content-Type": "application/json"}
        response = await client.post("/v1/completions", content=content, headers=headers)
        statuses.append(response.status_code)
    return statuses


async def _tokenize(client: httpx.AsyncClient, model: str) -> list[int]:
    body = {"model": model, "prompt": "the whale " * 20_000}
    return [(await client.post("/tokenize", json=body)).status_code]


async def _stop_strings(client: httpx.AsyncClient, model: str) -> list[int]:
    body = {"model": model, "prompt": "a", "stop": [f"s{i}" for i in range(5000)]}
    return [(await client.post("/v1/completions", json=body)).status_code]


async def _slow_reader(client: httpx.AsyncClient, model: str) -> list[int]:
    body = {"model": model, "prompt": "Call me Ishmael.", "max_tokens": 200, "n": 8,
            "stream": True, "ignore_eos": True}  # fmt: skip
    async with client.stream("POST", "/v1/completions", json=body) as response:
        await asyncio.sleep(30)  # read nothing
        return [response.status_code]


ATTACKS: dict[str, Callable[[httpx.AsyncClient, str], Awaitable[list[int]]]] = {
    "wide": _wide,
    "huge_body": _huge_body,
    "tokenize": _tokenize,
    "stop_strings": _stop_strings,
    "slow_reader": _slow_reader,
}


async def _loop(base_url: str, model: str, kind: str, tally: Counter[str]) -> None:
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        while True:
            try:
                statuses = await ATTACKS[kind](client, model)
            except httpx.HTTPError as exc:  # a cut-off slow reader, a closed connection
                statuses = [type(exc).__name__]
            tally.update(str(s) for s in statuses)
            tally["done"] += 1


async def _attack_until(
    ready: Any, stop: Any, base_url: str, model: str, count: int, kinds: tuple[str, ...]
) -> Report:
    kinds = tuple(kinds[i % len(kinds)] for i in range(count))
    tallies = [Counter() for _ in kinds]
    tasks = [asyncio.ensure_future(_loop(base_url, model, k, t)) for k, t in zip(kinds, tallies)]
    await asyncio.sleep(WARMUP_S)  # every attack under way before the measured run starts
    ready.set()
    await asyncio.to_thread(stop.wait)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    report: Report = {}
    for kind, tally in zip(kinds, tallies):
        entry = report.setdefault(kind, {"done": 0, "statuses": {}})
        entry["done"] += tally.pop("done", 0)
        entry["statuses"] = dict(Counter(entry["statuses"]) + tally)
    return report


def _attack_process(ready: Any, stop: Any, results: Any, *args: Any) -> None:
    results.put(asyncio.run(_attack_until(ready, stop, *args)))


@contextlib.asynccontextmanager
async def hostile_clients(
    base_url: str, model: str, count: int, kinds: tuple[str, ...] = KINDS
) -> AsyncIterator[Report]:
    """`count` hostile clients (in another process) hammering the server while the block runs;
    the report fills in when the block ends."""
    unknown = set(kinds) - set(KINDS)
    if unknown or not kinds:
        raise ValueError(f"hostile kinds must be some of {', '.join(KINDS)}, got {kinds}")
    report: Report = {}
    if count == 0:
        yield report
        return
    context = multiprocessing.get_context("spawn")
    ready, stop, results = context.Event(), context.Event(), context.Queue()
    process = context.Process(
        target=_attack_process,
        args=(ready, stop, results, base_url, model, count, kinds),
        daemon=True,
    )
    process.start()
    await asyncio.to_thread(ready.wait, 120)
    try:
        yield report
    finally:
        stop.set()
        report.update(await asyncio.to_thread(results.get, True, 120))
        process.join(30)
