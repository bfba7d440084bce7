"""KV capacity: how many of the throughput workload's requests run at once in a fixed KV budget.

    python benchmarks/kv_capacity.py [--model smollm2-135m] [--kv-cache-memory 256MiB]
        [--num-requests 256] [--seed 0] [--block-size 16] [--num-threads 2]
        [--sweep 128MiB 512MiB] [--no-validate] [--full-validation] [--quick]
        [--output benchmarks/results/kv_capacity.json]

Requests: the throughput benchmark's workload (benchmarks/workload.py: 32-512 prompt tokens,
16-256 output tokens, EOS ignored; its first 64 lengths are the throughput run's), 256 of them so
that no layout runs out of requests (a count equal to --num-requests is flagged as a lower bound).

Capacity of a layout = the largest N such that the workload's first N requests, submitted together
with max_num_seqs = N, all run to completion with no preemption (and so does every N' <= N).

- paged bf16 / paged fp8_e4m3: the engine's own Scheduler and KVCacheManager with the number of
  blocks `KVCacheSpec.from_memory` gives for the budget, on the requests' token counts (the
  generated tokens are stand-ins: block use depends on counts only). The table also gives the
  step at which N + 1 requests first preempt.
- contiguous max-length: a static allocation (a preallocated [N, max_len] cache, as transformers'
  static cache) where every slot reserves max_len = the longest prompt + output among the N
  requests: N * max_len tokens must fit.
- contiguous max_model_len: the same static allocation as a server must size it before any
  request arrives: every slot reserves the workload's bound, max prompt + max output tokens
  (512 + 256 = 768, the max_model_len such a server is configured with).
- contiguous per request: each request reserves exactly prompt + max_tokens (an allocator that
  knows every output length in advance): an upper bound for any contiguous scheme.

Validation (default on): the real engine (real model in bf16, real pages of the layout's dtype,
the same budget) must report the simulated number of blocks; it then runs the N requests at once
and must match the simulation step for step (running requests, free blocks, no preemption)
through the step of peak KV use plus a margin, where the cache is fullest. The rest of the run
only releases blocks, so it is skipped unless --full-validation (bf16 prefill is slow on CPUs
without native bf16). --sweep repeats the simulation (not the validation) at other budgets.

Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.results_file import write_results  # noqa: E402
from benchmarks.workload import QUICK, BenchRequest, WorkloadConfig, make_workload  # noqa: E402
from qserve.config import EngineConfig, parse_memory  # noqa: E402
from qserve.engine.kv_cache_manager import KVCacheManager  # noqa: E402
from qserve.engine.model_runner import KVCacheSpec  # noqa: E402
from qserve.engine.request import Request  # noqa: E402
from qserve.engine.sampling_params import SamplingParams  # noqa: E402
from qserve.engine.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from qserve.model.config import ModelConfig  # noqa: E402

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "kv_capacity.json"
PAGE_DTYPES = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}
MAX_BATCHED_TOKENS = EngineConfig.max_num_batched_tokens  # the engine's default
VALIDATION_MARGIN_STEPS = 8  # steps run past the simulated peak

# One engine step as the scheduler leaves it: (running requests, free blocks, preemptions so far).
StepState = tuple[int, int, int]


@dataclass
class Capacity:
    layout: str
    num_seqs: int  # capacity N
    kv_tokens: int  # tokens the budget holds in this layout
    tokens_reserved: int  # peak tokens the N requests hold (paged: in blocks) or reserve
    capped: bool = False  # N is every request there is: a lower bound
    num_blocks: int | None = None  # paged layouts
    next_preempts_at_step: int | None = None  # paged: first preemption with N + 1 requests
    validated: dict[str, Any] | None = None


@dataclass
class Simulation:
    """The scheduler's run of a batch of requests submitted together."""

    trace: list[StepState] = field(default_factory=list)
    stuck: bool = False  # a request could never start

    @property
    def preemptions(self) -> int:
        return self.trace[-1][2] if self.trace else 0

    @property
    def fits(self) -> bool:
        return not self.stuck and self.preemptions == 0

    @property
    def first_preemption_step(self) -> int | None:
        return next((i for i, s in enumerate(self.trace) if s[2] > 0), None)

    @property
    def peak_step(self) -> int:
        """The step after which the fewest blocks were free."""
        return min(range(len(self.trace)), key=lambda i: self.trace[i][1])


# ------------------------------------------------------------------------------------- paged


def make_request(r: BenchRequest, max_model_len: int) -> Request:
    params = SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True)
    return Request(r.request_id, r.prompt_token_ids, params, [], max_model_len)


def simulate(requests: list[BenchRequest], spec: KVCacheSpec, max_model_len: int) -> Simulation:
    """The engine's scheduler and block manager on `requests` with stand-in output tokens."""
    kv = KVCacheManager(spec.num_blocks, spec.block_size, enable_caching=True)
    scheduler = Scheduler(SchedulerConfig(len(requests), MAX_BATCHED_TOKENS, max_model_len), kv)
    for r in requests:
        scheduler.add_request(make_request(r, max_model_len))
    sim = Simulation()
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        if out.is_empty:
            sim.stuck = True
            break
        sampled = {s.request.request_id: 0 for s in out.scheduled if s.needs_logits}
        scheduler.update_from_output(out, sampled)
        sim.trace.append(step_state(scheduler))
    return sim


def step_state(scheduler: Scheduler) -> StepState:
    free = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    return len(scheduler.running), free, scheduler.num_preemptions


def largest_prefix(fits: Callable[[int], bool], limit: int) -> int:
    """The largest N <= limit with fits(n) for every n <= N."""
    n = 0
    while n < limit and fits(n + 1):
        n += 1
    return n


def paged_capacity(
    requests: list[BenchRequest], spec: KVCacheSpec, max_model_len: int, name: str
) -> tuple[Capacity, Simulation]:
    """The layout's capacity and the simulation of its N requests (for the validation)."""

    def fits(k: int) -> bool:
        return simulate(requests[:k], spec, max_model_len).fits

    n = largest_prefix(fits, len(requests))
    sim = simulate(requests[:n], spec, max_model_len)
    peak_blocks = spec.num_blocks - min((s[1] for s in sim.trace), default=spec.num_blocks)
    row = Capacity(f"paged {name}", n, spec.num_tokens, peak_blocks * spec.block_size)
    row.capped, row.num_blocks = n == len(requests), spec.num_blocks
    if not row.capped:
        row.next_preempts_at_step = simulate(
            requests[: n + 1], spec, max_model_len
        ).first_preemption_step
    return row, sim


# -------------------------------------------------------------------------------- contiguous


def total_len(r: BenchRequest) -> int:
    return r.prompt_len + r.max_tokens


def contiguous_max_len(requests: list[BenchRequest], budget_tokens: int) -> Capacity:
    def fits(k: int) -> bool:
        return k * max(total_len(r) for r in requests[:k]) <= budget_tokens

    n = largest_prefix(fits, len(requests))
    reserved = n * max((total_len(r) for r in requests[:n]), default=0)
    return Capacity("contiguous max-length", n, budget_tokens, reserved, n == len(requests))


def contiguous_model_len(
    requests: list[BenchRequest], budget_tokens: int, model_len: int
) -> Capacity:
    n = min(budget_tokens // model_len, len(requests))
    return Capacity("contiguous max_model_len", n, budget_tokens, n * model_len, n == len(requests))


def contiguous_per_request(requests: list[BenchRequest], budget_tokens: int) -> Capacity:
    def fits(k: int) -> bool:
        return sum(total_len(r) for r in requests[:k]) <= budget_tokens

    n = largest_prefix(fits, len(requests))
    reserved = sum(total_len(r) for r in requests[:n])
    return Capacity("contiguous per request", n, budget_tokens, reserved, n == len(requests))


# -------------------------------------------------------------------------------- validation


def validation_steps(sim: Simulation, full: bool) -> int:
    """Steps of the real run to compare: through the peak plus a margin, or all of them."""
    if full or not sim.trace:
        return len(sim.trace)
    return min(len(sim.trace), sim.peak_step + 1 + VALIDATION_MARGIN_STEPS)


def make_engine(model: str, args: argparse.Namespace, kv: str, num_seqs: int) -> Any:
    from qserve.engine.llm import LLM

    return LLM(
        model,
        dtype="bfloat16",
        kv_cache_memory=args.kv_cache_memory,
        kv_cache_dtype="auto" if kv == "bf16" else kv,
        block_size=args.block_size,
        max_num_seqs=max(num_seqs, 1),
        num_threads=args.num_threads,
    ).engine


def validate(
    model: str, requests: list[BenchRequest], sim: Simulation, args: argparse.Namespace, kv: str
) -> dict[str, Any]:
    """Run the real engine on `requests` at once and compare it with the simulation."""
    engine = make_engine(model, args, kv, len(requests))
    for r in requests:
        params = SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True)
        engine.add_request(r.request_id, r.prompt_token_ids, params)
    start, steps = time.perf_counter(), validation_steps(sim, args.full_validation)
    trace = []
    while len(trace) < steps and engine.has_unfinished_requests():
        engine.step()
        trace.append(step_state(engine.scheduler))
    seconds = time.perf_counter() - start
    engine.abort_request([r.request_id for r in requests])
    return validation_report(engine, sim, trace, seconds)


def validation_report(
    engine: Any, sim: Simulation, trace: list[StepState], seconds: float
) -> dict[str, Any]:
    mismatch = next((i for i, (a, b) in enumerate(zip(trace, sim.trace)) if a != b), None)
    return {
        "num_blocks": engine.model_runner.kv_spec.num_blocks,
        "kv_dtype": str(engine.model_runner.kv_spec.dtype).removeprefix("torch."),
        "steps_run": len(trace),
        "steps_simulated": len(sim.trace),
        "peak_step": sim.peak_step if sim.trace else None,
        "peak_running": max((s[0] for s in trace), default=0),
        "min_free_blocks": min((s[1] for s in trace), default=None),
        "preemptions": engine.scheduler.num_preemptions,
        "matches_simulation": mismatch is None and len(trace) > 0,
        "first_mismatch_step": mismatch,
        "seconds": round(seconds, 1),
    }


# -------------------------------------------------------------------------------------- main


def capacities(
    requests: list[BenchRequest],
    config: ModelConfig,
    budget: int,
    block_size: int,
    workload: WorkloadConfig,
) -> tuple[list[Capacity], dict[str, Simulation], dict[str, KVCacheSpec]]:
    """Every layout's capacity at one budget; the paged simulations and specs by page dtype."""
    max_model_len = min(config.max_context_len, max(total_len(r) for r in requests))
    specs = {
        name: KVCacheSpec.from_memory(config, budget, block_size, dtype)
        for name, dtype in PAGE_DTYPES.items()
    }
    rows, sims = [], {}
    for name, spec in specs.items():
        row, sims[name] = paged_capacity(requests, spec, max_model_len, name)
        rows.append(row)
    tokens = specs["bf16"].num_tokens  # contiguous caches are bf16, like the pages
    model_len = min(config.max_context_len, workload.max_prompt_len + workload.max_output_len)
    rows += [
        contiguous_max_len(requests, tokens),
        contiguous_model_len(requests, tokens, model_len),
        contiguous_per_request(requests, tokens),
    ]
    return rows, sims, specs


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from qserve.model.loader import load_tokenizer
    from qserve.model.resolve import resolve_model

    torch.set_num_threads(args.num_threads)
    path = resolve_model(args.model)
    config = ModelConfig.from_pretrained(path)
    workload = workload_config(args)
    requests = make_workload(load_tokenizer(path), workload)
    budget = parse_memory(args.kv_cache_memory)
    rows, sims, specs = capacities(requests, config, budget, args.block_size, workload)
    if args.validate:
        for row, name in zip(rows, sims):  # the paged rows come first, in PAGE_DTYPES order
            print(f"validating {row.layout}: {row.num_seqs} requests on the real engine ...")
            batch = requests[: row.num_seqs]
            row.validated = validate(str(path), batch, sims[name], args, name)
    summary = summarize(rows, args.kv_cache_memory, args, specs, len(requests))
    summary["sweep"] = [sweep_point(requests, config, m, args) for m in args.sweep]
    return summary


def sweep_point(
    requests: list[BenchRequest], config: ModelConfig, memory: str, args: argparse.Namespace
) -> dict[str, Any]:
    workload = workload_config(args)
    rows, _, specs = capacities(requests, config, parse_memory(memory), args.block_size, workload)
    return summarize(rows, memory, args, specs, len(requests))


def summarize(
    rows: list[Capacity],
    memory: str,
    args: argparse.Namespace,
    specs: dict[str, KVCacheSpec],
    n: int,
) -> dict[str, Any]:
    by = {row.layout: row.num_seqs for row in rows}
    ratio = lambda a, b: round(by[a] / by[b], 2) if by[b] else None  # noqa: E731
    return {
        "model": args.model,
        "kv_cache_memory": memory,
        "block_size": args.block_size,
        "num_requests": n,
        "bytes_per_token": {k: s.bytes_per_block // s.block_size for k, s in specs.items()},
        "rows": [asdict(row) for row in rows],
        "fp8_over_bf16_paged": ratio("paged fp8_e4m3", "paged bf16"),
        "bf16_paged_over_contiguous_max_length": ratio("paged bf16", "contiguous max-length"),
        "bf16_paged_over_contiguous_max_model_len": ratio("paged bf16", "contiguous max_model_len"),
        "bf16_paged_over_contiguous_per_request": ratio("paged bf16", "contiguous per request"),
    }


def format_table(summary: dict[str, Any]) -> str:
    lines = [
        f"KV budget {summary['kv_cache_memory']}, block size {summary['block_size']}: the "
        f"largest N such that the first N of {summary['num_requests']} workload requests, "
        "submitted together, finish with no preemption",
        f"{'layout':<24} {'seqs':>5} {'blocks':>7} {'KV tokens':>10} {'peak held':>10} "
        f"{'N+1 preempts':>13}  real engine",
    ]
    for row in summary["rows"]:
        lines.append(format_row(row))
    lines.append(format_ratios(summary))
    for point in summary.get("sweep", []):
        counts = ", ".join(f"{r['layout']} {r['num_seqs']}{cap(r)}" for r in point["rows"])
        lines.append(f"sweep {point['kv_cache_memory']} (simulated): {counts}")
        lines.append("  " + format_ratios(point))
    return "\n".join(lines)


def cap(row: dict[str, Any]) -> str:
    return "+" if row["capped"] else ""


def format_row(row: dict[str, Any]) -> str:
    blocks = "" if row["num_blocks"] is None else row["num_blocks"]
    step = row["next_preempts_at_step"]
    nxt = "" if step is None else f"step {step}"
    return (
        f"{row['layout']:<24} {str(row['num_seqs']) + cap(row):>5} {blocks:>7} "
        f"{row['kv_tokens']:>10} {row['tokens_reserved']:>10} {nxt:>13}  "
        f"{format_validation(row['validated'])}"
    )


def format_validation(v: dict[str, Any] | None) -> str:
    if v is None:
        return ""
    same = "matches the simulation" if v["matches_simulation"] else "DIFFERS from the simulation"
    return (
        f"{v['num_blocks']} blocks {v['kv_dtype']}, {v['preemptions']} preemptions, "
        f"{v['peak_running']} running, {same} over steps 0-{v['steps_run'] - 1} "
        f"(peak {v['peak_step']}, of {v['steps_simulated']}), {v['seconds']} s"
    )


def format_ratios(summary: dict[str, Any]) -> str:
    return (
        f"paged fp8 / paged bf16: {summary['fp8_over_bf16_paged']}x; paged bf16 / contiguous "
        f"max-length: {summary['bf16_paged_over_contiguous_max_length']}x; / contiguous "
        f"max_model_len: {summary['bf16_paged_over_contiguous_max_model_len']}x; / contiguous "
        f"per request: {summary['bf16_paged_over_contiguous_per_request']}x"
    )


def workload_config(args: argparse.Namespace) -> WorkloadConfig:
    base = QUICK if args.quick else WorkloadConfig()
    fields = {**asdict(base), "seed": args.seed}
    fields["num_requests"] = args.num_requests or (base.num_requests if args.quick else 256)
    return WorkloadConfig(**fields)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--kv-cache-memory", default=None, help="256MiB (4MiB with --quick)")
    p.add_argument("--num-requests", type=int, default=None, help="256 (8 with --quick)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument(
        "--sweep",
        nargs="*",
        default=None,
        metavar="MEM",
        help="other budgets, simulated only (128MiB 512MiB; none with --quick)",
    )
    p.add_argument("--no-validate", dest="validate", action="store_false")
    p.add_argument(
        "--full-validation", action="store_true", help="run the real engine to completion"
    )
    p.add_argument("--quick", action="store_true", help="8 short requests: a smoke run")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = p.parse_args(argv)
    if args.kv_cache_memory is None:
        args.kv_cache_memory = "4MiB" if args.quick else "256MiB"
    if args.sweep is None:
        args.sweep = [] if args.quick else ["128MiB", "512MiB"]
    for memory in [args.kv_cache_memory, *args.sweep]:
        parse_memory(memory)  # fail here, not after minutes of work
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    summary = measure(args)
    print(format_table(summary))
    write_results(args.output, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
