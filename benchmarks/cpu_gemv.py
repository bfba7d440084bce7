"""The CPU W4 loop at decode sizes against the memory-bandwidth floor (issue 22), in one run.

    python benchmarks/cpu_gemv.py [--shapes 2048x8192 8192x2048 576x1536] [--rows 1 4 16]
        [--group-size 128] [--num-threads 2] [--output benchmarks/results/cpu_gemv.json]

For each layer K x N (input x output features) and each batch of M rows: the median time of
`cpu_w4a16.w4_mm` (groups of `--group-size`, 64 where that does not divide K) with fp32 x (the
exact loop, codes converted to fp32) and with bf16 x (codes against int8 activations,
`int8_activations`), and dense bf16 and fp32: torch's `x @ W.T`, and qserve's `ops.linear`
(the C++ bf16 GEMV up to `cpu_dense.GEMV_MAX_ROWS` rows, torch above). Each is read as
weight GB/s (the bytes its weight holds: codes, scales and zeros for W4) and as a fraction of
the read bandwidth measured in the same run (`decode.read_bandwidth`). Calls cycle through
copies of the weight totalling at least `--footprint-mb`, so every call reads its weight from
memory, not from a cache the previous call warmed.
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.decode import read_bandwidth  # noqa: E402
from benchmarks.results_file import run_and_report, run_arguments  # noqa: E402
from qserve.kernels import cpu_w4a16, ops  # noqa: E402

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "cpu_gemv.json"


def w4_weight(K: int, N: int, group_size: int, seed: int) -> cpu_w4a16.W4PackedCPU:
    gen = torch.Generator().manual_seed(seed)
    G = K // group_size
    codes = torch.randint(0, 16, (K, N), generator=gen, dtype=torch.int32)
    zeros = torch.randint(1, 16, (G, N), generator=gen, dtype=torch.int32)
    scales = torch.rand(G, N, generator=gen) * 0.02 + 0.001
    return cpu_w4a16.w4_from_codes(codes, scales, zeros, group_size)


def weight_bytes(w: Any) -> int:
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    return sum(t.numel() * t.element_size() for t in (w.codes, w.scales, w.zs))


def median_us(call: Callable[[Any], object], weights: list[Any], repeats: int) -> float:
    for w in weights:  # warm-up: page in every copy
        call(w)
    times = []
    for i in range(repeats):
        w = weights[i % len(weights)]
        t = time.perf_counter()
        call(w)
        times.append(time.perf_counter() - t)
    return 1e6 * statistics.median(times)


def copies(make: Callable[[int], Any], nbytes: int, footprint: int) -> list[Any]:
    return [make(i) for i in range(max(2, -(-footprint // nbytes)))]


def shape_rows(K: int, N: int, rows: list[int], args: argparse.Namespace, bw: float) -> list[dict]:
    footprint = args.footprint_mb << 20
    gs = args.group_size if K % args.group_size == 0 else 64  # SmolLM2's 576: group 64
    first = w4_weight(K, N, gs, 0)
    w4 = [first] + copies(lambda i: w4_weight(K, N, gs, i + 1),
                          weight_bytes(first), footprint)[1:]  # fmt: skip
    dense = {dt: copies(lambda i, dt=dt: torch.randn(N, K).to(dt), N * K * dt.itemsize, footprint)
             for dt in (torch.bfloat16, torch.float32)}  # fmt: skip
    out = []
    loop = "int8" if cpu_w4a16.int8_activations(torch.bfloat16) else "exact"
    for M in rows:
        x, xb = torch.randn(M, K), torch.randn(M, K).bfloat16()
        cases = [
            ("w4 fp32 x (exact loop)", w4, lambda w, x=x: cpu_w4a16.w4_mm(x, w)),
            (f"w4 bf16 x ({loop} loop)", w4, lambda w, x=xb: cpu_w4a16.w4_mm(x, w)),
            ("dense bf16 (torch)", dense[torch.bfloat16], lambda w, x=xb: x @ w.T),
            ("dense bf16 (ops.linear)", dense[torch.bfloat16], lambda w, x=xb: ops.linear(x, w)),
            ("dense fp32 (torch)", dense[torch.float32], lambda w, x=x: x @ w.T),
        ]
        for label, weights, call in cases:
            us = median_us(call, weights, args.repeats)
            gbs = weight_bytes(weights[0]) / us / 1e3
            out.append({"shape": f"{K}x{N}", "M": M, "case": label, "median_us": us,
                        "weight_mb": weight_bytes(weights[0]) / 1e6, "weight_gb_s": gbs,
                        "frac_of_read_bw": gbs / bw})  # fmt: skip
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.num_threads)
    bw = read_bandwidth(args.num_threads)
    rows = []
    for shape in args.shapes:
        K, N = (int(v) for v in shape.split("x"))
        rows += shape_rows(K, N, args.rows, args, bw)
    return {"settings": run_arguments(args), "read_gb_s": bw, "rows": rows}


def format_table(summary: dict[str, Any]) -> str:
    lines = [f"read bandwidth {summary['read_gb_s']:.1f} GB/s",
             "| layer K x N | M | case | us | weight GB/s | of read bandwidth |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for r in summary["rows"]:
        lines.append(f"| {r['shape']} | {r['M']} | {r['case']} | {r['median_us']:.0f} | "
                     f"{r['weight_gb_s']:.1f} | {100 * r['frac_of_read_bw']:.0f}% |")  # fmt: skip
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", default=["2048x8192", "8192x2048", "576x1536"])
    p.add_argument("--rows", nargs="+", type=int, default=[1, 4, 16])
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--footprint-mb", type=int, default=512)
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return run_and_report(argv, parse_args, run, format_table)


if __name__ == "__main__":
    raise SystemExit(main())
