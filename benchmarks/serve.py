"""Online serving: a load generator for `qserve serve` over loopback, reported like vLLM's bench.

    python benchmarks/serve.py [--model smollm2-135m] [--base-url http://127.0.0.1:8000]
        [--num-requests 200] [--request-rate inf --request-rate 8 ...] [--max-concurrency 32]
        [--min-prompt-len 32 --max-prompt-len 512 --min-output-len 16 --max-output-len 256]
        [--quick] [--server-arg=--dtype=float32 ...] [--output benchmarks/results/serve.json]
        [--hostile 5 [--hostile-kinds wide,huge_body,tokenize,stop_strings,slow_reader]]

Without --base-url it starts `qserve serve MODEL` on a free loopback port (its own process, so
client and server do not share a GIL) and stops it at the end. The workload is the throughput
benchmark's (benchmarks/workload.py: seeded Moby-Dick prompts, exact output lengths, EOS ignored),
sent as token ids to /v1/completions with `stream: true`. For each request rate (Poisson
arrivals; `inf` sends everything at once), at most --max-concurrency requests are in flight.

Per request: TTFT (send to first token), ITL (gaps between streamed chunks), TPOT ((latency -
TTFT) / (output tokens - 1)), end-to-end latency. Per run: request throughput, output and total
tok/s, mean / median / p99 of each latency, errors, and whether every KV block went back to the
free pool (from /metrics). Prints a table per rate and writes JSON.

With --hostile N, each rate runs a second time with N hostile clients hammering the server
(benchmarks/hostile.py: wide n=128 requests, huge bodies, big /tokenize texts, thousands of stop
strings, streams nobody reads), and a table puts the normal requests' TTFT and ITL of both runs
side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.hostile import KINDS, hostile_clients  # noqa: E402
from benchmarks.results_file import write_results  # noqa: E402
from benchmarks.workload import QUICK, BenchRequest, WorkloadConfig, make_workload  # noqa: E402

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "serve.json"
REPO = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT_S = 300
REQUEST_TIMEOUT_S = 600


@dataclass
class RequestResult:
    prompt_len: int
    ok: bool = False
    error: str = ""
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


# -- the client ----------------------------------------------------------------------------------


async def send(client: httpx.AsyncClient, model: str, request: BenchRequest) -> RequestResult:
    """Stream one completion; time its first token and every chunk after it."""
    result = RequestResult(request.prompt_len)
    body = {
        "model": model,
        "prompt": request.prompt_token_ids,
        "max_tokens": request.max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                payload = _data(line)
                if payload is None:
                    continue
                if payload.get("usage"):
                    result.output_tokens = payload["usage"]["completion_tokens"]
                if not payload.get("choices"):
                    continue
                now = time.perf_counter()
                if result.ttft == 0.0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
        result.latency = time.perf_counter() - start
        result.ok = result.output_tokens == request.max_tokens
        result.error = "" if result.ok else f"got {result.output_tokens} tokens"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def _data(line: str) -> dict[str, Any] | None:
    if not line.startswith("data:"):
        return None
    data = line[len("data:") :].strip()
    return None if data == "[DONE]" else json.loads(data)


async def run_rate(
    base_url: str,
    model: str,
    requests: list[BenchRequest],
    rate: float,
    max_concurrency: int,
    seed: int,
) -> tuple[list[RequestResult], float]:
    """All requests at Poisson arrivals of `rate` per second; (results, wall seconds)."""
    rng = random.Random(seed)
    semaphore = asyncio.Semaphore(max_concurrency)
    limits = httpx.Limits(
        max_connections=max_concurrency, max_keepalive_connections=max_concurrency
    )
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout) as client:

        async def bounded(request: BenchRequest) -> RequestResult:
            async with semaphore:
                return await send(client, model, request)

        start = time.perf_counter()
        tasks = []
        for request in requests:
            tasks.append(asyncio.ensure_future(bounded(request)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start


# -- the report ----------------------------------------------------------------------------------


def summarize(results: list[RequestResult], seconds: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_len for r in ok)
    summary: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": seconds,
        "total_input_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / seconds,
        "output_throughput": output_tokens / seconds,
        "total_token_throughput": (prompt_tokens + output_tokens) / seconds,
    }
    for name, values in (
        ("ttft", [r.ttft for r in ok]),
        ("tpot", [r.tpot for r in ok if r.tpot is not None]),
        ("itl", [gap for r in ok for gap in r.itl]),
        ("e2el", [r.latency for r in ok]),
    ):
        summary.update(_stats_ms(name, values))
    return summary


def _stats_ms(name: str, values: list[float]) -> dict[str, float]:
    if not values:
        return {f"{k}_{name}_ms": float("nan") for k in ("mean", "median", "p99")}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
    return {
        f"mean_{name}_ms": statistics.fmean(values) * 1e3,
        f"median_{name}_ms": statistics.median(values) * 1e3,
        f"p99_{name}_ms": p99 * 1e3,
    }


def format_table(rate: float, max_concurrency: int, s: dict[str, Any]) -> str:
    rows = [
        ("Successful requests", f"{s['completed']}"),
        ("Failed requests", f"{s['failed']}"),
        ("Leaked KV blocks", f"{s.get('leaked_blocks', 'n/a')}"),
        ("Benchmark duration (s)", f"{s['duration_s']:.2f}"),
        ("Total input tokens", f"{s['total_input_tokens']}"),
        ("Total generated tokens", f"{s['total_output_tokens']}"),
        ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{s['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{s['total_token_throughput']:.2f}"),
    ]
    titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
              "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}  # fmt: skip
    lines = [f"{'=' * 18} Serving Benchmark Result {'=' * 18}"]
    lines.append(f"{'Request rate (req/s)':<44}{rate:>17}")
    lines.append(f"{'Max concurrency':<44}{max_concurrency:>17}")
    lines += [f"{label:<44}{value:>17}" for label, value in rows]
    for key, title in titles.items():
        lines.append(f"{' ' + title + ' ':-^61}")
        for stat in ("mean", "median", "p99"):
            label = f"{stat.capitalize() if stat != 'p99' else 'P99'} {key.upper()} (ms)"
            lines.append(f"{label:<44}{s[f'{stat}_{key}_ms']:>17.2f}")
    lines.append("=" * 61)
    return "\n".join(lines)


# -- the server ----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(model: str, port: int, served_name: str, extra: list[str]) -> subprocess.Popen:
    command = [sys.executable, "-m", "qserve.cli", "serve", model, "--port", str(port),
               "--served-model-name", served_name, *extra]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    process = subprocess.Popen(command, env=env)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    process.kill()
    raise SystemExit(f"qserve serve did not become healthy (exit code {process.poll()})")


def stop_server(process: subprocess.Popen) -> int:
    process.terminate()
    try:
        return process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait(10)


def kv_blocks(base_url: str) -> tuple[float, float]:
    """(free, all) KV blocks from /metrics, after the server had up to 10 s to settle."""
    from prometheus_client.parser import text_string_to_metric_families

    deadline, free, total = time.monotonic() + 10, 0.0, -1.0
    while time.monotonic() < deadline and free != total:
        text = httpx.get(f"{base_url}/metrics", timeout=10).text
        values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        free, total = values["qserve:kv_cache_free_blocks"], values["qserve:kv_cache_num_blocks"]
        time.sleep(0.1)
    return free, total


# -- main ----------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--model", default="smollm2-135m", help="served model; its tokenizer cuts prompts"
    )
    p.add_argument("--base-url", default=None, help="an already running server (else start one)")
    p.add_argument("--served-model-name", default="bench-model")
    p.add_argument("--server-arg", action="append", default=[], help="extra `qserve serve` option")
    p.add_argument("--num-requests", type=int, default=None, help="200 (8 with --quick)")
    p.add_argument("--request-rate", type=float, action="append", default=None, help="inf")
    p.add_argument("--max-concurrency", type=int, default=32)
    p.add_argument("--min-prompt-len", type=int, default=32)
    p.add_argument("--max-prompt-len", type=int, default=512)
    p.add_argument("--min-output-len", type=int, default=16)
    p.add_argument("--max-output-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="8 short requests: a smoke run")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    p.add_argument("--hostile", type=int, default=0, help="hostile clients in a second run")
    p.add_argument("--hostile-kinds", default=",".join(KINDS), help="what they try (all)")
    return p.parse_args(argv)


def workload_config(args: argparse.Namespace) -> WorkloadConfig:
    if args.quick:
        return WorkloadConfig(**{**asdict(QUICK), "seed": args.seed})
    return WorkloadConfig(
        num_requests=args.num_requests or 200,
        min_prompt_len=args.min_prompt_len,
        max_prompt_len=args.max_prompt_len,
        min_output_len=args.min_output_len,
        max_output_len=args.max_output_len,
        seed=args.seed,
    )


def load_tokenizer(model: str) -> Any:
    from qserve.model.loader import load_tokenizer as load
    from qserve.model.resolve import resolve_model

    return load(resolve_model(model))


def run(args: argparse.Namespace, base_url: str, requests: list[BenchRequest]) -> list[dict]:
    """Warm up, then one run per request rate (and with --hostile, one more beside hostile
    clients); each run's summary with its KV leak check."""
    asyncio.run(run_rate(base_url, args.served_model_name, requests[:2], math.inf, 2, args.seed))
    runs = []
    for rate in args.request_rate or [math.inf]:
        for hostile in sorted({0, args.hostile}):
            summary = _one_run(args, base_url, requests, rate, hostile)
            print(format_table(rate, args.max_concurrency, summary), flush=True)
            runs.append(summary)
        if args.hostile:
            print(format_hostile(runs[-2], runs[-1]), flush=True)
    return runs


def _one_run(
    args: argparse.Namespace, base_url: str, requests: list[BenchRequest], rate: float, hostile: int
) -> dict[str, Any]:
    async def measured() -> tuple[list[RequestResult], float, dict]:
        kinds = tuple(args.hostile_kinds.split(","))
        async with hostile_clients(base_url, args.served_model_name, hostile, kinds) as report:
            results, seconds = await run_rate(
                base_url, args.served_model_name, requests, rate, args.max_concurrency, args.seed
            )
        return results, seconds, report

    results, seconds, report = asyncio.run(measured())
    summary = summarize(results, seconds)
    free, total = kv_blocks(base_url)
    summary.update(request_rate=rate, max_concurrency=args.max_concurrency, hostile_clients=hostile,
                   hostile=report, leaked_blocks=int(total - free))  # fmt: skip
    return summary


def format_hostile(plain: dict[str, Any], hostile: dict[str, Any]) -> str:
    """The normal requests' latencies without and with the hostile clients, side by side."""
    keys = [("completed", "{:.0f}"), ("failed", "{:.0f}"), ("output_throughput", "{:.1f}"),
            ("median_ttft_ms", "{:.0f}"), ("p99_ttft_ms", "{:.0f}"), ("median_itl_ms", "{:.1f}"),
            ("p99_itl_ms", "{:.1f}")]  # fmt: skip
    n = hostile["hostile_clients"]
    lines = [f"{'normal requests':<24}{'alone':>14}{f'+{n} hostile':>14}{'ratio':>9}"]
    for key, fmt in keys:
        a, b = plain[key], hostile[key]
        ratio = f"{b / a:.2f}x" if a else ""
        lines.append(f"{key:<24}{fmt.format(a):>14}{fmt.format(b):>14}{ratio:>9}")
    for kind, entry in hostile["hostile"].items():
        lines.append(f"  hostile {kind}: {entry['done']} done, statuses {entry['statuses']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = workload_config(args)
    requests = make_workload(load_tokenizer(args.model), config)
    process = None
    base_url = args.base_url
    if base_url is None:
        port = free_port()
        process = start_server(args.model, port, args.served_model_name, args.server_arg)
        base_url = f"http://127.0.0.1:{port}"
    try:
        runs = run(args, base_url, requests)
    finally:
        exit_code = stop_server(process) if process is not None else None
    report = {"model": args.model, "workload": asdict(config), "server_args": args.server_arg,
              "server_exit_code": exit_code, "runs": runs}  # fmt: skip
    write_results(args.output, report)
    return 0 if all(r["failed"] == 0 and r["leaked_blocks"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
