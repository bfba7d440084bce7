"""A mixture-of-experts layer's decode step on CPU: grouped by expert vs a per-token loop.

    python benchmarks/moe_decode.py [--hidden 512] [--intermediate 1024] [--experts 8]
        [--top-k 2] [--batches 1 8 32] [--dtype float32] [--num-threads 2] [--repeats 50]
        [--output benchmarks/results/moe_decode.json]

One Mixtral-style SparseMoeBlock (random weights, each expert's gate/up merged as the engine
merges them after loading) runs a decode step of `--batches` tokens (one per sequence): the
router, then the experts either grouped by expert (`qserve.model.moe.fused_moe`: each chosen
expert once over all its tokens) or in a Python loop over tokens and their top-k
(`fused_moe_per_token`, the naive reference). Both run in one process, alternating, after a
warm-up; the medians of `--repeats` calls and their ratio (loop / grouped) are reported.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.results_file import run_arguments, write_results  # noqa: E402

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "moe_decode.json"


def make_block(args: argparse.Namespace) -> torch.nn.Module:
    """A random SparseMoeBlock of the benchmark's shape, experts' gate/up merged."""
    from qserve.model.config import ModelConfig
    from qserve.model.llama import Linear
    from qserve.model.moe import SparseMoeBlock

    config = ModelConfig.from_dict({
        "architectures": ["MixtralForCausalLM"], "hidden_size": args.hidden,
        "intermediate_size": args.intermediate, "num_local_experts": args.experts,
        "num_experts_per_tok": args.top_k, "num_hidden_layers": 1, "num_attention_heads": 8,
        "vocab_size": 32, "max_position_embeddings": 128,
    })  # fmt: skip
    torch.manual_seed(0)
    block = SparseMoeBlock(config, Linear).requires_grad_(False)
    for param in block.parameters():
        torch.nn.init.normal_(param, std=args.hidden**-0.5)
    block = block.to(getattr(torch, args.dtype))
    block.merge()
    return block


def per_token_step(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The same step with the experts run token by token (the naive reference)."""
    from qserve.model.moe import fused_moe_per_token, select_experts

    topk_weights, topk_ids = select_experts(block.gate(x), block.top_k, block.renormalize)
    return fused_moe_per_token(x, topk_weights, topk_ids, list(block.experts))


def median_us(calls: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median microseconds of each call, the calls alternating (one warm-up each first)."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():
        call()
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


def measure_batch(block: torch.nn.Module, batch: int, args: argparse.Namespace) -> dict:
    """One table row: both executions of a `batch`-token step (checked equal first)."""
    x = torch.randn(batch, args.hidden).to(getattr(torch, args.dtype))
    with torch.inference_mode():
        torch.testing.assert_close(block(x), per_token_step(block, x), atol=1e-2, rtol=1e-2)
        calls = {"grouped": lambda: block(x), "loop": lambda: per_token_step(block, x)}
        us = median_us(calls, args.repeats)
        experts_run = block.gate(x).topk(args.top_k).indices.unique().numel()
    return {
        "batch": batch,
        "experts_run": int(experts_run),
        "grouped_us": us["grouped"],
        "per_token_loop_us": us["loop"],
        "speedup": us["loop"] / us["grouped"],
    }


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    print(
        f"MoE decode step: hidden {args.hidden}, {args.experts} experts of {args.intermediate}, "
        f"top-{args.top_k}, {args.dtype}, {args.num_threads} threads"
    )
    print(
        f"{'tokens':>6}{'experts run':>13}{'grouped (us)':>14}{'loop (us)':>12}"
        + f"{'loop / grouped':>16}"
    )
    for r in rows:
        print(f"{r['batch']:>6}{r['experts_run']:>13}{r['grouped_us']:>14.1f}"
              f"{r['per_token_loop_us']:>12.1f}{r['speedup']:>15.2f}x")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = p.parse_args(argv)
    torch.set_num_threads(args.num_threads)

    block = make_block(args)
    rows = [measure_batch(block, batch, args) for batch in args.batches]
    print_table(rows, args)
    write_results(args.output, {"args": run_arguments(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
