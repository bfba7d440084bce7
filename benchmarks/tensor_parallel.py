"""Tensor and pipeline parallelism on one machine's CPU (issue 24): decode and a short workload
at TP=1, TP=2 and PP=2, with the weight memory each rank holds, in one run.

    python benchmarks/tensor_parallel.py [--model qwen2.5-coder-0.5b] [--dtype float32]
        [--batch-sizes 1 8] [--prompt-len 64] [--steps 16] [--num-requests 16]
        [--prefill-prompts 8] [--prefill-len 128]
        [--output benchmarks/results/tensor_parallel.json]

Rows: TP=1 with one thread, TP=1 with two threads (the whole machine in one process), TP=2 and
PP=2 with one thread per rank (gloo between two processes), PP=2 with its stages in turn and
with each step cut into 2 and 4 micro-batches (`--pipeline-micro-batches`). Decode: B
requests of --prompt-len tokens, stepped once each is past its prompt, the median of --steps
steps (`throughput.py`'s steady-state measurement). Workload: --num-requests requests of
32-256 prompt and 16-64 output tokens added at once, output tokens/s to completion. Prefill:
--prefill-prompts prompts of --prefill-len tokens and one output token each, seconds (the
median of 3; where pipeline micro-batches overlap the stages). Weights:
the bytes of rank 0's parameters and buffers (every TP rank holds the same; PP stage 0 holds
the most layers). NCCL on GPUs is not built: CPU only. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import throughput  # noqa: E402
from benchmarks.results_file import run_and_report, run_arguments  # noqa: E402
from benchmarks.workload import WorkloadConfig, make_workload  # noqa: E402

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "tensor_parallel.json"
# (label, tensor-parallel size, pipeline-parallel size, threads per rank, micro-batches)
CONFIGS = [
    ("TP=1, 1 thread", 1, 1, 1, None),
    ("TP=1, 2 threads", 1, 1, 2, None),
    ("TP=2, 1 thread/rank", 2, 1, 1, None),
    ("PP=2, in turn", 1, 2, 1, 1),
    ("PP=2, 2 micro-batches", 1, 2, 1, 2),
    ("PP=2, 4 micro-batches", 1, 2, 1, 4),
]


def weight_mb(model: torch.nn.Module) -> float:
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values()) / 1e6


def make_llm(
    model: str, dtype: str, tp: int, pp: int, threads: int, micro: int | None, max_num_seqs: int
) -> Any:
    from qserve import LLM

    return LLM(model, dtype=dtype, tensor_parallel_size=tp, pipeline_parallel_size=pp,
               pipeline_micro_batches=micro, num_threads=threads, max_num_seqs=max_num_seqs,
               kv_cache_memory="512MiB")  # fmt: skip


def decode_ms(llm: Any, prompts: list[list[int]], steps: int) -> float:
    engine = llm.engine
    throughput.start_decode(engine, prompts, throughput.DECODE_WARMUP_STEPS + steps + 8)
    for _ in range(throughput.DECODE_WARMUP_STEPS):
        throughput.timed_step(engine, len(prompts))
    times = [throughput.timed_step(engine, len(prompts))[0] for _ in range(steps)]
    for request_id in list(engine.requests):
        engine.abort_request(request_id)
    return 1e3 * statistics.median(times)


def prefill_s(llm: Any, prompts: list[list[int]], repeats: int = 3) -> float:
    """Seconds to prefill every prompt and sample one token (the median of `repeats`, each on
    prompts shifted so that no prefix is cached)."""
    from qserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    times = []
    for i in range(repeats):
        shifted = [[t + i for t in p] for p in prompts]
        start = time.perf_counter()
        llm.generate(shifted, params)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def workload_tokens_per_s(llm: Any, requests: list[Any]) -> float:
    from qserve import SamplingParams

    engine, tokens = llm.engine, 0
    start = time.perf_counter()
    for r in requests:
        params = SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True)
        engine.add_request(f"tp-{r.request_id}", r.prompt_token_ids, params)
    while engine.has_unfinished_requests():
        tokens += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
    return tokens / (time.perf_counter() - start)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from qserve.model.loader import load_tokenizer
    from qserve.model.resolve import resolve_model

    path = resolve_model(args.model)
    tokenizer = load_tokenizer(path)
    requests = make_workload(tokenizer, WorkloadConfig(args.num_requests, 32, 256, 16, 64, 0))
    gen = torch.Generator().manual_seed(0)
    top = min(20000, len(tokenizer)) - 3  # ids of real tokens, shifted by up to 2 (prefill_s)
    prefill_prompts = [torch.randint(3, top, (args.prefill_len,), generator=gen).tolist()
                       for _ in range(args.prefill_prompts)]  # fmt: skip
    rows = []
    for label, tp, pp, threads, micro in CONFIGS:
        print(f"{label} ...", flush=True)
        torch.set_num_threads(threads)
        llm = make_llm(str(path), args.dtype, tp, pp, threads, micro, max(args.batch_sizes))
        try:
            mb = weight_mb(llm.engine.model_runner.model)
            row: dict[str, Any] = {"label": label, "tp": tp, "pp": pp, "threads_per_rank": threads,
                                   "micro_batches": micro, "weight_mb_per_rank": mb}  # fmt: skip
            for b in args.batch_sizes:
                prompts = throughput.decode_prompts(tokenizer, _decode_args(args), b)
                row[f"decode_ms_b{b}"] = decode_ms(llm, prompts, args.steps)
            row["prefill_s"] = prefill_s(llm, prefill_prompts)
            row["workload_tokens_per_s"] = workload_tokens_per_s(llm, requests)
        finally:
            llm.engine.close()
        rows.append(row)
    return {"model": args.model, "settings": run_arguments(args), "rows": rows}


def _decode_args(args: argparse.Namespace) -> argparse.Namespace:
    return argparse.Namespace(decode_prompt_len=args.prompt_len, seed=0)


def format_table(summary: dict[str, Any]) -> str:
    batches = summary["settings"]["batch_sizes"]
    head = f"{'config':<24}{'weights MB/rank':>16}" + "".join(
        f"{f'B={b} ms/step':>15}" for b in batches
    )
    head += f"{'prefill s':>11}{'workload tok/s':>16}"
    lines = [head, "-" * len(head)]
    for r in summary["rows"]:
        line = f"{r['label']:<24}{r['weight_mb_per_rank']:>16.1f}"
        line += "".join(f"{r[f'decode_ms_b{b}']:>15.1f}" for b in batches)
        lines.append(line + f"{r['prefill_s']:>11.2f}{r['workload_tokens_per_s']:>16.1f}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8], metavar="B")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--prefill-prompts", type=int, default=8)
    p.add_argument("--prefill-len", type=int, default=128)
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = p.parse_args(argv)
    sizes = (min(args.batch_sizes), args.steps, args.prompt_len, args.prefill_prompts,
             args.prefill_len)  # fmt: skip
    if min(sizes) < 1:
        p.error("batch sizes, --steps, --prompt-len and the prefill sizes must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    return run_and_report(argv, parse_args, run, format_table)


if __name__ == "__main__":
    sys.exit(main())
