"""Decode attention with a sliding window vs full causal attention over the same long context.

    python benchmarks/sliding_window.py [--context 4096] [--windows 512 128] [--batch 8]
        [--heads 32 8] [--head-dim 128] [--dtype bfloat16] [--num-threads 2] [--repeats 20]
        [--output benchmarks/results/sliding_window.json]

One decode row per sequence, every sequence `--context` tokens long, pages of 16 tokens
shuffled over the cache. Each path (the C++ CPU kernel, the torch reference; the Triton kernel
too when CUDA is there) runs full attention and each window in one process, a warm-up first,
then the median of `--repeats` calls; the ratio is full / windowed time. A windowed decode reads
only its last W keys, so the ratio should approach context / W where reading K/V dominates.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.results_file import run_arguments, write_results  # noqa: E402

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "sliding_window.json"
BLOCK_SIZE = 16


def make_inputs(args: argparse.Namespace, device: str) -> tuple:
    """(query, kv_cache, block_tables, seq_lens, query_start_loc, scale) for the decode batch."""
    num_heads, num_kv_heads = args.heads
    dtype = getattr(torch, args.dtype)
    blocks_per_seq = -(-args.context // BLOCK_SIZE)
    num_blocks = args.batch * blocks_per_seq
    kv_cache = torch.randn(2, num_blocks, BLOCK_SIZE, num_kv_heads, args.head_dim).to(dtype)
    tables = torch.randperm(num_blocks).view(args.batch, blocks_per_seq).to(torch.int32)
    seq_lens = torch.full((args.batch,), args.context, dtype=torch.int32)
    qsl = torch.arange(args.batch + 1, dtype=torch.int32)
    query = torch.randn(args.batch, num_heads, args.head_dim).to(dtype)
    tensors = (query, kv_cache, tables, seq_lens, qsl)
    return (*(t.to(device) for t in tensors), args.head_dim**-0.5)


def median_us(fn: Callable[[], object], repeats: int, cuda: bool) -> float:
    fn()  # warm-up (and, on the first call, the C++ build or the Triton compile)
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def paths() -> dict[str, tuple[str, Callable[..., torch.Tensor]]]:
    """name -> (device, paged_attention-like function)."""
    from qserve.kernels import cpu_paged_attention
    from qserve.kernels.attention_ref import paged_attention_ref

    out = {"torch reference (CPU)": ("cpu", paged_attention_ref)}
    if cpu_paged_attention.usable(torch.zeros(1, 1, 64), torch.zeros(2, 1, 1, 1, 64)):
        out["C++ kernel (CPU)"] = ("cpu", cpu_paged_attention.paged_attention)
    if torch.cuda.is_available():
        from qserve.kernels.paged_attention import paged_attention

        out["Triton (CUDA)"] = ("cuda", paged_attention)
    return out


def measure(args: argparse.Namespace) -> list[dict]:
    rows = []
    for name, (device, fn) in paths().items():
        inputs = make_inputs(args, device)
        times = {}
        for w in [None, *args.windows]:
            call = functools.partial(fn, *inputs, sliding_window=w)
            times[w] = median_us(call, args.repeats, device == "cuda")
            rows.append({"path": name, "window": w, "median_us": times[w]})
            rows[-1]["speedup"] = times[None] / times[w]
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--windows", type=int, nargs="+", default=[512, 128])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--heads", type=int, nargs=2, default=[32, 8], metavar=("Q", "KV"))
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = p.parse_args(argv)
    torch.set_num_threads(args.num_threads)

    rows = measure(args)
    print(f"decode, {args.batch} x {args.context} tokens, heads {args.heads}, {args.dtype}")
    print(f"{'path':<24}{'window':>8}{'median (us)':>14}{'full / this':>13}")
    for r in rows:
        window = "full" if r["window"] is None else str(r["window"])
        print(f"{r['path']:<24}{window:>8}{r['median_us']:>14.1f}{r['speedup']:>12.2f}x")
    write_results(args.output, {"args": run_arguments(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
