"""Time each Triton kernel against its memory-bandwidth floor (CUDA only).

    python benchmarks/kernels.py [--json out/kernels.json] [--bandwidth-tbs 4.8]

For every case: median time of repeats (`triton.testing.do_bench`), the bytes the op must move at
least (packed weights + scales + activations in + results out; K/V pages for attention), the
floor = bytes / peak bandwidth (4.8 TB/s on an H200), and floor / time (the fraction of peak
bandwidth reached). A dense fp16 torch matmul of the same shape runs beside each GEMM, for ratios
within one run. Prints a table and writes JSON. Without CUDA it says so and exits 0.

`--smoke` runs every case once on tiny shapes on the CPU under the Triton interpreter (no
timings worth reading): a check that the script itself works before spending GPU time on it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial

import torch


@dataclass
class Row:
    name: str
    shape: str
    median_us: float
    bytes: int
    floor_us: float
    frac_of_peak_bw: float
    dense_fp16_us: float | None = None


DEV = "cuda"
SMOKE = False


def _bench(fn: Callable[[], object]) -> float:
    if SMOKE:  # do_bench does not run under the interpreter
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")) * 1e3


def _row(name, shape, fn, nbytes, bw, dense=None) -> Row:
    us = _bench(fn)
    floor = nbytes / bw * 1e6
    dense_us = _bench(dense) if dense is not None else None
    return Row(name, shape, us, int(nbytes), floor, floor / us, dense_us)


def gemm_rows(bw: float, Ms: list[int], K: int, N: int) -> list[Row]:
    from qserve.kernels import packing as P
    from qserve.kernels.fp8 import fp8_scaled_mm, scaled_fp8_quant
    from qserve.kernels.int8 import int8_scaled_mm, scaled_int8_quant, w8a16_gemm
    from qserve.kernels.w4a16 import awq_gemm, gptq_gemm

    dev, gs = DEV, 128
    G = K // gs
    q = torch.randint(0, 16, (K, N), dtype=torch.int32)
    z = torch.randint(1, 16, (G, N), dtype=torch.int32)
    scales = (torch.rand(G, N) * 0.01).half().to(dev)
    g_idx = P.gptq_g_idx(K, gs, torch.randperm(K)).to(dev)  # act-order
    gq = (P.pack_gptq_qweight(q, 4).to(dev), P.pack_gptq_qzeros(z, 4).to(dev), scales)
    aq = (P.pack_awq_qweight(q).to(dev), P.pack_awq_qzeros(z).to(dev), scales)
    w16 = torch.randn(N, K, device=dev, dtype=torch.float16)
    w8 = torch.randint(-127, 128, (N, K), dtype=torch.int8, device=dev)
    ws = torch.rand(N, 1, device=dev) * 0.01
    wf8 = (torch.randn(N, K, device=dev) * 10).to(torch.float8_e4m3fn)
    rows = []
    for M in Ms:
        x = torch.randn(M, K, device=dev, dtype=torch.float16)
        io = M * K * 2 + M * N * 2  # activations in, fp16 out
        shape = f"M={M} K={K} N={N}"

        dense = partial(torch.matmul, x, w16.t())

        w4_bytes = K * N // 2 + G * N * 2 + G * N // 2
        gptq = partial(gptq_gemm, x, *gq)
        rows.append(_row("gptq_w4a16_g128", shape, partial(gptq, None), w4_bytes + io, bw, dense))
        rows.append(
            _row(
                "gptq_w4a16_g128_act_order", shape, partial(gptq, g_idx), w4_bytes + K * 4 + io, bw
            )
        )
        rows.append(
            _row("awq_w4a16_g128", shape, partial(awq_gemm, x, *aq, gs), w4_bytes + io, bw, dense)
        )
        rows.append(
            _row("w8a16", shape, partial(w8a16_gemm, x, w8, ws), K * N + N * 4 + io, bw, dense)
        )
        xq, xs = scaled_int8_quant(x)
        rows.append(
            _row(
                "int8_scaled_mm",
                shape,
                partial(int8_scaled_mm, xq, w8, xs, ws, torch.float16),
                K * N + M * K + M * N * 2 + (M + N) * 4,
                bw,
                dense,
            )
        )
        rows.append(
            _row(
                "int8_quant_per_token",
                f"M={M} K={K}",
                partial(scaled_int8_quant, x),
                M * K * 3 + M * 4,
                bw,
            )
        )
        fq, fs = scaled_fp8_quant(x)
        rows.append(
            _row(
                "fp8_scaled_mm",
                shape,
                partial(fp8_scaled_mm, fq, wf8, fs, ws, torch.float16),
                K * N + M * K + M * N * 2 + (M + N) * 4,
                bw,
                dense,
            )
        )
        rows.append(
            _row(
                "fp8_quant_per_token",
                f"M={M} K={K}",
                partial(scaled_fp8_quant, x),
                M * K * 3 + M * 4,
                bw,
            )
        )
    return rows


def attention_rows(bw: float) -> list[Row]:
    from qserve.kernels.cache_write import reshape_and_cache
    from qserve.kernels.paged_attention import paged_attention

    dev, heads, kv_heads, D, bs = DEV, 32, 8, 128, 16
    cases = [(32, 2048, 1), (64, 1024, 1), (1, 2048, 2048), (4, 2048, 512)]
    T = 4096
    if SMOKE:
        heads, kv_heads, D, cases, T = 4, 2, 64, [(2, 64, 1), (1, 64, 64)], 64
    rows = []
    for cache_dtype in (torch.float16, torch.float8_e4m3fn):
        elt = torch.finfo(cache_dtype).bits // 8
        for num_seqs, seq_len, q_len in cases:
            blocks_per_seq = seq_len // bs
            num_blocks = num_seqs * blocks_per_seq
            kv = torch.randn(2, num_blocks, bs, kv_heads, D, device=dev).to(cache_dtype)
            bt = torch.randperm(num_blocks, device=dev).view(num_seqs, blocks_per_seq).int()
            sl = torch.full((num_seqs,), seq_len, device=dev, dtype=torch.int32)
            qsl = torch.arange(num_seqs + 1, device=dev, dtype=torch.int32) * q_len
            query = torch.randn(num_seqs * q_len, heads, D, device=dev, dtype=torch.float16)
            kv_bytes = 2 * num_seqs * seq_len * kv_heads * D * elt
            nbytes = kv_bytes + 2 * query.numel() * 2
            name = f"paged_attn_{'decode' if q_len == 1 else 'prefill'}_{str(cache_dtype)[6:]}"
            shape = f"seqs={num_seqs} len={seq_len} q={q_len} H={heads}/{kv_heads} D={D}"
            rows.append(
                _row(
                    name,
                    shape,
                    partial(paged_attention, query, kv, bt, sl, qsl, D**-0.5, 0.5, 0.5),
                    nbytes,
                    bw,
                )
            )
        key = torch.randn(T, kv_heads, D, device=dev, dtype=torch.float16)
        kv = torch.zeros(2, T // bs, bs, kv_heads, D, device=dev).to(cache_dtype)
        slots = torch.randperm(T, device=dev)
        nbytes = 2 * T * kv_heads * D * (2 + elt)
        rows.append(
            _row(
                f"cache_write_{str(cache_dtype)[6:]}",
                f"tokens={T} kv_heads={kv_heads} D={D}",
                partial(reshape_and_cache, key, key, kv, slots, 0.5, 0.5),
                nbytes,
                bw,
            )
        )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="out/bench_kernels.json")
    ap.add_argument("--bandwidth-tbs", type=float, default=4.8, help="peak HBM TB/s (H200: 4.8)")
    ap.add_argument("--K", type=int, default=4096)
    ap.add_argument("--N", type=int, default=4096)
    ap.add_argument("--M", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, CPU interpreter, no timing")
    args = ap.parse_args()
    if args.smoke:
        global DEV, SMOKE
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
        DEV, SMOKE = "cpu", True
        args.M, args.K, args.N = [1, 17], 256, 128
    elif not torch.cuda.is_available():
        print("benchmarks/kernels.py needs CUDA (the Triton kernels are timed on a GPU); skipping.")
        return 0
    bw = args.bandwidth_tbs * 1e12
    torch.manual_seed(0)
    rows = gemm_rows(bw, args.M, args.K, args.N) + attention_rows(bw)
    hdr = f"{'kernel':<34} {'shape':<42} {'median us':>10} {'floor us':>9} {'of peak':>8}"
    hdr += f" {'fp16 us':>8}"
    device_name = "CPU (smoke run)" if SMOKE else torch.cuda.get_device_name()
    print(f"# {device_name}  peak {args.bandwidth_tbs} TB/s")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        dense = f"{r.dense_fp16_us:8.1f}" if r.dense_fp16_us is not None else f"{'':>8}"
        print(
            f"{r.name:<34} {r.shape:<42} {r.median_us:10.1f} {r.floor_us:9.1f} "
            f"{r.frac_of_peak_bw:8.1%} {dense}"
        )
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(
            {
                "device": device_name,
                "bandwidth_tbs": args.bandwidth_tbs,
                "rows": [asdict(r) for r in rows],
            },
            f,
            indent=2,
        )
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
