"""Compile the CUDA code paths of every kernel for sm_90 (H100/H200) without a GPU.

The interpreter runs only the DOT_F32 branches; this ahead-of-time compile (Triton's bundled
ptxas) catches type and lowering errors in the fp16/bf16/fp8/int8 tensor-core paths that only a
GPU run would execute. Run in a subprocess: the compiler needs real `@triton.jit` functions, and
the test session has TRITON_INTERPRET=1 set.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

I32 = "i32"
H100_SMEM = 232448  # max shared memory per block on sm_90 (227 KiB)
# compiled by the test (about 5 s each when not cached); `python <this file> --all` does every one
CORE = {
    "w4a16_gptq4_fp16_actorder",
    "w4a16_gptq4_bf16_g128",
    "w4a16_awq_bf16_splitk_g32",
    "scaled_mm_int8",
    "scaled_mm_fp8",
    "scaled_mm_w8a16_bf16",
    "quant_fp8_staticFalse",
    "paged_attention_fp8e4_bf16",
    "paged_attention_fp16_decode",
    "paged_attention_bf16_prefill_sliding",
    "paged_attention_fp8e5_fp16_sliding",
    "cache_write_fp8e4",
    "fused_moe_dense_bf16",
    "fused_moe_gptq4_bf16_actorder",
    "fused_moe_w8_fp8_fp16",
}


def _variants() -> list[tuple[str, object, dict[str, str], dict[str, object], dict[str, int]]]:
    from qserve.kernels import cache_write, paged_attention, scaled_mm, w4a16

    out = []
    w4_ptrs = dict(qw_ptr="*i32", qz_ptr="*i32", g_ptr="*i32")
    for name, act, awq, bits, split, gs in [
        ("gptq4_fp16_actorder", "fp16", False, 4, False, 0),
        ("gptq4_bf16_g128", "bf16", False, 4, False, 128),
        ("gptq8_bf16_splitk", "bf16", False, 8, True, 128),
        ("awq_fp16", "fp16", True, 4, False, 128),
        ("awq_bf16_splitk_g32", "bf16", True, 4, True, 32),
    ]:
        ptrs = dict(w4_ptrs, x_ptr=f"*{act}", s_ptr=f"*{act}", bias_ptr=f"*{act}")
        ptrs["out_ptr"] = "*fp32" if split else f"*{act}"
        const = dict(AWQ=awq, BITS=bits, HAS_BIAS=not split, DOT_F32=False, BLOCK_M=16)
        const["GROUP_SIZE"] = gs
        const.update(BLOCK_N=128, BLOCK_K=128)
        out.append((f"w4a16_{name}", w4a16._w4a16_kernel, ptrs, const, dict(num_stages=3)))
    for name, a, b, o, is_int, b_to_a in [
        ("int8", "i8", "i8", "fp16", True, False),
        ("int8_split", "i8", "i8", "i32", True, False),
        ("fp8", "fp8e4nv", "fp8e4nv", "bf16", False, False),
        ("w8a16_bf16", "bf16", "i8", "bf16", False, True),
        ("w8a16_fp16", "fp16", "i8", "fp16", False, True),
    ]:
        ptrs = dict(a_ptr=f"*{a}", b_ptr=f"*{b}", a_scale_ptr="*fp32", b_scale_ptr="*fp32")
        ptrs.update(bias_ptr="*fp16", out_ptr=f"*{o}")
        const = dict(IS_INT=is_int, B_TO_A=b_to_a, A_SCALE_PER_ROW=True, HAS_A_SCALE=not b_to_a)
        const.update(B_SCALE_PER_COL=True, HAS_BIAS=True, SPLIT="split" in name, DOT_F32=False)
        const.update(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128)
        out.append((f"scaled_mm_{name}", scaled_mm._scaled_mm_kernel, ptrs, const, {}))
    for name, q, qmin, qmax, rnd in [
        ("int8", "i8", -128.0, 127.0, True),
        ("fp8", "fp8e4nv", -448.0, 448.0, False),
    ]:
        for static in (False, True):
            ptrs = dict(x_ptr="*bf16", q_ptr=f"*{q}", scale_ptr="*fp32")
            const = dict(STATIC=static, QMIN=qmin, QMAX=qmax, ROUND=rnd, BLOCK_K=1024)
            kern = scaled_mm._quant_kernel
            out.append((f"quant_{name}_static{static}", kern, ptrs, const, {}))
    for name, qd, kv, fp, group, d, bm, split, sliding in [
        ("fp16_decode", "fp16", "fp16", False, 4, 128, 16, True, False),
        ("bf16_prefill", "bf16", "bf16", False, 4, 128, 64, False, False),
        ("bf16_prefill_sliding", "bf16", "bf16", False, 4, 128, 64, False, True),
        ("fp8e4_bf16", "bf16", "fp8e4nv", True, 3, 64, 64, False, False),
        ("fp8e5_fp16", "fp16", "fp8e5", True, 8, 128, 16, True, False),
        ("fp8e5_fp16_sliding", "fp16", "fp8e5", True, 8, 128, 16, True, True),
    ]:
        ptrs = dict(q_ptr=f"*{qd}", kv_ptr=f"*{kv}", block_tables_ptr="*i32", seq_lens_ptr="*i32")
        ptrs.update(qsl_ptr="*i32", k_scale_ptr="*fp32", v_scale_ptr="*fp32", out_ptr=f"*{qd}")
        ptrs.update(part_acc_ptr="*fp32", part_ml_ptr="*fp32")
        ptrs["scale"] = "fp32"
        gp = 1 << (group - 1).bit_length()
        const = dict(BLOCK_SIZE=16, GROUP=group, GROUP_P=gp, HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=64)
        const.update(KV_FP8=fp, DOT_F32=False, SPLIT_KV=split, SLIDING=sliding)
        kern = paged_attention._paged_attention_kernel
        out.append((f"paged_attention_{name}", kern, ptrs, const, dict(num_stages=2)))
    for name, kd, kv, fp, fmax in [
        ("fp16", "fp16", "fp16", False, 0.0),
        ("fp8e4", "bf16", "fp8e4nv", True, 448.0),
        ("fp8e5", "fp16", "fp8e5", True, 57344.0),
    ]:
        ptrs = dict(k_ptr=f"*{kd}", v_ptr=f"*{kd}", kv_ptr=f"*{kv}", slot_ptr="*i64")
        ptrs.update(k_scale_ptr="*fp32", v_scale_ptr="*fp32")
        const = dict(BLOCK_SIZE=16, HEAD_DIM=128, BLOCK_H=8, KV_FP8=fp, FMAX=fmax)
        out.append((f"cache_write_{name}", cache_write._cache_write_kernel, ptrs, const, {}))
    out += _autotune_variants(w4a16, scaled_mm)
    return out + _fused_moe_variants()


def _fused_moe_variants() -> list:
    """The MoE grouped GEMM: each weight kind, then every autotune config (dense bf16, the
    largest tiles in shared memory) at decode and prefill BLOCK_M."""
    from qserve.kernels import fused_moe

    out = []
    idx = dict(sorted_ids_ptr="*i32", expert_ids_ptr="*i32", num_post_pad_ptr="*i32")
    for name, act, w, s, kind, bits, gs, float_w, bm in [
        ("dense_bf16", "bf16", "bf16", "bf16", 0, 8, 0, True, 64),
        ("dense_fp16", "fp16", "fp16", "fp16", 0, 8, 0, True, 16),
        ("gptq4_fp16_g128", "fp16", "i32", "fp16", 1, 4, 128, False, 16),
        ("gptq4_bf16_actorder", "bf16", "i32", "fp16", 1, 4, 0, False, 64),
        ("gptq8_bf16_g32", "bf16", "i32", "bf16", 1, 8, 32, False, 16),
        ("w8_int8_bf16", "bf16", "i8", "fp32", 2, 8, 0, False, 64),
        ("w8_fp8_fp16", "fp16", "fp8e4nv", "fp32", 2, 8, 0, True, 16),
    ]:
        ptrs = dict(idx, x_ptr=f"*{act}", w_ptr=f"*{w}", s_ptr=f"*{s}", qz_ptr="*i32")
        ptrs.update(g_ptr="*i32", topk_w_ptr="*fp32", out_ptr=f"*{act}")
        const = dict(TOP_K=2, MUL_ROUTED=True, W_KIND=kind, BITS=bits, GROUP_SIZE=gs)
        const.update(FLOAT_W=float_w, DOT_F32=False, BLOCK_M=bm, BLOCK_N=128, BLOCK_K=128)
        kern = fused_moe._fused_moe_kernel
        out.append((f"fused_moe_{name}", kern, ptrs, const, dict(num_stages=3)))
    ptrs = dict(idx, x_ptr="*bf16", w_ptr="*bf16", s_ptr="*bf16", qz_ptr="*i32", g_ptr="*i32")
    ptrs.update(topk_w_ptr="*fp32", out_ptr="*bf16")
    for i, cfg in enumerate(fused_moe.CUDA_CONFIGS):
        for bm in (16, 64):
            const = dict(TOP_K=1, MUL_ROUTED=False, W_KIND=0, BITS=8, GROUP_SIZE=0)
            const.update(FLOAT_W=True, DOT_F32=False, BLOCK_M=bm, **cfg.kwargs)
            opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
            kern = fused_moe._fused_moe_kernel
            out.append((f"tune_fused_moe_{i}_m{bm}", kern, ptrs, const, opts))
    return out


def _autotune_variants(w4a16, scaled_mm) -> list:
    """Every CUDA autotune config at decode and prefill BLOCK_M (shared memory must fit)."""
    out = []
    w4_ptrs = dict(x_ptr="*bf16", s_ptr="*fp16", bias_ptr="*bf16", out_ptr="*bf16")
    w4_ptrs.update(qw_ptr="*i32", qz_ptr="*i32", g_ptr="*i32")
    mm_ptrs = dict(a_ptr="*fp8e4nv", b_ptr="*fp8e4nv", a_scale_ptr="*fp32", b_scale_ptr="*fp32")
    mm_ptrs.update(bias_ptr="*bf16", out_ptr="*bf16")
    for i, cfg in enumerate(w4a16.CUDA_CONFIGS):
        for bm in (16, 64):
            const = dict(AWQ=False, BITS=4, HAS_BIAS=True, DOT_F32=False, BLOCK_M=bm)
            const["GROUP_SIZE"] = 128
            const.update(cfg.kwargs)
            opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
            out.append((f"tune_w4a16_{i}_m{bm}", w4a16._w4a16_kernel, w4_ptrs, const, opts))
    for i, cfg in enumerate(scaled_mm.CUDA_CONFIGS):
        for bm in (16, 64):
            const = dict(IS_INT=False, B_TO_A=False, A_SCALE_PER_ROW=True, HAS_A_SCALE=True)
            const.update(B_SCALE_PER_COL=True, HAS_BIAS=True, SPLIT=False, DOT_F32=False)
            const.update(BLOCK_M=bm, **cfg.kwargs)
            opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
            out.append(
                (f"tune_fp8_mm_{i}_m{bm}", scaled_mm._scaled_mm_kernel, mm_ptrs, const, opts)
            )
    return out


def compile_all(names: set[str] | None = None) -> int:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    failed = 0
    for name, kernel, ptrs, const, opts in _variants():
        if names is not None and name not in names:
            continue
        sig = {a: "constexpr" if a in const else ptrs.get(a, I32) for a in kernel.arg_names}
        try:
            src = ASTSource(kernel, sig, const)
            options = {"num_warps": 4, **opts}
            k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
            if k.metadata.shared > H100_SMEM:
                raise RuntimeError(f"needs {k.metadata.shared} B of shared memory")
            print(f"ok   {name} (shared {k.metadata.shared} B)", flush=True)
        except Exception as e:  # noqa: BLE001 - report every variant
            failed += 1
            print(f"FAIL {name}: {type(e).__name__}: {str(e)[-1500:]}", flush=True)
    return failed


def test_kernels_compile_for_sm90() -> None:
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


if __name__ == "__main__":
    sys.exit(1 if compile_all(None if "--all" in sys.argv else CORE) else 0)
