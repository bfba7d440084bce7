"""KV capacity: how many of the throughput workload's requests run at once in a fixed KV budget.

    python benchmarks/kv_capacity.py [--model smollm2-135m] [--kv-cache-memory 128MiB]
        [--num-requests 64] [--seed 0] [--block-size 16] [--no-validate] [--quick]
        [--output benchmarks/results/kv_capacity.json]

Capacity of a layout = the largest N such that the workload's first N requests (benchmarks/
workload.py: 32-512 prompt tokens, 16-256 output tokens, EOS ignored), submitted together with
max_num_seqs = N, all run to completion with no preemption. For every N' <= N too.

- paged bf16 / paged fp8_e4m3: the engine's own Scheduler and KVCacheManager with the number of
  blocks `KVCacheSpec.from_memory` gives for the budget; the model's tokens are stand-ins (block
  use depends on token counts only). `--validate` (default) then runs the real engine, real model,
  on those N requests and reports its preemptions (expected 0), steps and time.
- contiguous max-length: a static allocation (a preallocated [N, max_len] cache, as transformers'
  static cache) where every slot reserves max_len = the longest prompt + output among the N
  requests: N * max_len tokens must fit.
- contiguous per request: each request reserves exactly prompt + max_tokens (an allocator that
  knows every output length in advance): an upper bound for any contiguous scheme.

Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workload import QUICK, BenchRequest, WorkloadConfig, make_workload  # noqa: E402
from qserve.config import parse_memory  # noqa: E402
from qserve.engine.kv_cache_manager import KVCacheManager  # noqa: E402
from qserve.engine.model_runner import KVCacheSpec  # noqa: E402
from qserve.engine.request import Request  # noqa: E402
from qserve.engine.sampling_params import SamplingParams  # noqa: E402
from qserve.engine.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from qserve.model.config import ModelConfig  # noqa: E402

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "kv_capacity.json"
PAGE_DTYPES = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}
MAX_BATCHED_TOKENS = 2048


@dataclass
class Capacity:
    layout: str
    num_seqs: int  # capacity N
    kv_tokens: int  # tokens the budget holds in this layout
    tokens_reserved: int  # peak tokens the N requests hold (paged: in blocks) or reserve
    validated: dict[str, Any] | None = None


# ------------------------------------------------------------------------------------- paged


def run_paged(
    requests: list[BenchRequest], spec: KVCacheSpec, max_model_len: int
) -> tuple[int, int]:
    """The engine's scheduler and block manager on `requests` with stand-in tokens; returns
    (preemptions, peak tokens in held blocks); preemptions -1 if a request cannot start."""
    kv = KVCacheManager(spec.num_blocks, spec.block_size, enable_caching=True)
    config = SchedulerConfig(len(requests), MAX_BATCHED_TOKENS, max_model_len)
    scheduler = Scheduler(config, kv)
    for r in requests:
        params = SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True)
        scheduler.add_request(Request(r.request_id, r.prompt_token_ids, params, [], max_model_len))
    peak = 0.0
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        if out.is_empty:
            return -1, 0
        peak = max(peak, kv.usage)
        sampled = {s.request.request_id: 0 for s in out.scheduled if s.samples}
        scheduler.update_from_output(out, sampled)
    return scheduler.num_preemptions, round(peak * spec.num_tokens)


def largest_prefix(fits: Callable[[int], bool], limit: int) -> int:
    """The largest N <= limit with fits(n) for every n <= N."""
    n = 0
    while n < limit and fits(n + 1):
        n += 1
    return n


def paged_capacity(
    requests: list[BenchRequest], spec: KVCacheSpec, max_model_len: int, name: str
) -> Capacity:
    def fits(k: int) -> bool:
        return run_paged(requests[:k], spec, max_model_len)[0] == 0

    n = largest_prefix(fits, len(requests))
    peak = run_paged(requests[:n], spec, max_model_len)[1]
    return Capacity(f"paged {name}", n, spec.num_tokens, peak)


# -------------------------------------------------------------------------------- contiguous


def total_len(r: BenchRequest) -> int:
    return r.prompt_len + r.max_tokens


def contiguous_max_len(requests: list[BenchRequest], budget_tokens: int) -> Capacity:
    def fits(k: int) -> bool:
        return k * max(total_len(r) for r in requests[:k]) <= budget_tokens

    n = largest_prefix(fits, len(requests))
    reserved = n * max((total_len(r) for r in requests[:n]), default=0)
    return Capacity("contiguous max-length", n, budget_tokens, reserved)


def contiguous_per_request(requests: list[BenchRequest], budget_tokens: int) -> Capacity:
    def fits(k: int) -> bool:
        return sum(total_len(r) for r in requests[:k]) <= budget_tokens

    n = largest_prefix(fits, len(requests))
    reserved = sum(total_len(r) for r in requests[:n])
    return Capacity("contiguous per request", n, budget_tokens, reserved)


# -------------------------------------------------------------------------------- validation


def validate(model: str, requests: list[BenchRequest], args: argparse.Namespace, kv: str):
    """Run the real engine (real model) on `requests` at once; its preemptions, steps, time."""
    from qserve.engine.llm import LLM

    llm = LLM(
        model,
        dtype="bfloat16",
        kv_cache_memory=args.kv_cache_memory,
        kv_cache_dtype="auto" if kv == "bf16" else kv,
        block_size=args.block_size,
        max_num_seqs=max(len(requests), 1),
        num_threads=args.threads,
    )
    engine = llm.engine
    for r in requests:
        params = SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True)
        engine.add_request(r.request_id, r.prompt_token_ids, params)
    start, steps, peak = time.perf_counter(), 0, 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        peak = max(peak, len(engine.scheduler.running))
    return {
        "preemptions": engine.scheduler.num_preemptions,
        "peak_running": peak,
        "steps": steps,
        "seconds": round(time.perf_counter() - start, 2),
        "num_blocks": engine.model_runner.kv_spec.num_blocks,
    }


# -------------------------------------------------------------------------------------- main


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from qserve.model.loader import load_tokenizer
    from qserve.model.resolve import resolve_model

    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    config = ModelConfig.from_pretrained(path)
    requests = make_workload(load_tokenizer(path), workload_config(args))
    budget = parse_memory(args.kv_cache_memory)
    max_model_len = min(config.max_context_len, max(total_len(r) for r in requests))
    specs = {
        name: KVCacheSpec.from_memory(config, budget, args.block_size, dtype)
        for name, dtype in PAGE_DTYPES.items()
    }
    rows = [paged_capacity(requests, spec, max_model_len, name) for name, spec in specs.items()]
    tokens = specs["bf16"].num_tokens  # contiguous caches are bf16, like the pages
    rows += [contiguous_max_len(requests, tokens), contiguous_per_request(requests, tokens)]
    if args.validate:
        for row, name in zip(rows, specs):
            print(f"validating {row.layout}: {row.num_seqs} requests on the real engine ...")
            row.validated = validate(str(path), requests[: row.num_seqs], args, name)
    return summarize(rows, args, specs, len(requests))


def summarize(
    rows: list[Capacity], args: argparse.Namespace, specs: dict[str, KVCacheSpec], n: int
) -> dict[str, Any]:
    by = {row.layout: row.num_seqs for row in rows}
    ratio = lambda a, b: round(by[a] / by[b], 2) if by[b] else None  # noqa: E731
    return {
        "model": args.model,
        "kv_cache_memory": args.kv_cache_memory,
        "block_size": args.block_size,
        "num_requests": n,
        "bytes_per_token": {k: s.bytes_per_block // s.block_size for k, s in specs.items()},
        "rows": [asdict(row) for row in rows],
        "fp8_over_bf16_paged": ratio("paged fp8_e4m3", "paged bf16"),
        "bf16_paged_over_contiguous_max_length": ratio("paged bf16", "contiguous max-length"),
        "bf16_paged_over_contiguous_per_request": ratio("paged bf16", "contiguous per request"),
    }


def format_table(summary: dict[str, Any]) -> str:
    lines = [
        f"KV budget {summary['kv_cache_memory']}, block size {summary['block_size']}, "
        f"first N of {summary['num_requests']} workload requests, no preemption",
        f"{'layout':<24} {'seqs':>5} {'KV tokens':>10} {'peak held':>10}  real engine run",
    ]
    for row in summary["rows"]:
        v = row["validated"]
        real = "" if v is None else f"{v['preemptions']} preemptions, {v['seconds']} s"
        lines.append(
            f"{row['layout']:<24} {row['num_seqs']:>5} {row['kv_tokens']:>10} "
            f"{row['tokens_reserved']:>10}  {real}"
        )
    lines.append(
        f"paged fp8 / paged bf16: {summary['fp8_over_bf16_paged']}x; paged bf16 / contiguous "
        f"max-length: {summary['bf16_paged_over_contiguous_max_length']}x; / contiguous per "
        f"request: {summary['bf16_paged_over_contiguous_per_request']}x"
    )
    return "\n".join(lines)


def workload_config(args: argparse.Namespace) -> WorkloadConfig:
    base = QUICK if args.quick else WorkloadConfig()
    fields = {**asdict(base), "seed": args.seed}
    if args.num_requests:
        fields["num_requests"] = args.num_requests
    return WorkloadConfig(**fields)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--kv-cache-memory", default="128MiB")
    p.add_argument("--num-requests", type=int, default=None, help="64 (8 with --quick)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-validate", dest="validate", action="store_false")
    p.add_argument("--quick", action="store_true", help="8 short requests: a smoke run")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    summary = measure(args)
    print(format_table(summary))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
