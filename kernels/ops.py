"""One function per op: the Triton launcher for CUDA tensors, the torch reference otherwise.

Model code calls these and never picks an implementation itself. Triton is imported only when a
CUDA tensor arrives, so this module imports (and the CPU path runs) without triton installed.
On CPU, paged attention's decode rows, the KV cache write, RMSNorm, RoPE and SiLU-and-mul run
C++ kernels compiled on first use (`cpu_paged_attention`, `cpu_model_ops`; QSERVE_CPU_KERNELS=0
turns them off), called as the torch custom ops `torch.ops.qserve.*` (`custom_ops`) so that
torch.compile sees them. RMSNorm and RoPE have no Triton kernel: torch on CUDA.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch
import torch.nn.functional as F

from qserve.kernels import (
    cpu_build,
    cpu_dense,
    cpu_model_ops,
    cpu_paged_attention,
    custom_ops,
)
from qserve.kernels.attention_ref import Scale, paged_attention_ref, reshape_and_cache_ref
from qserve.kernels.fp8_ref import fp8_scaled_mm_ref, scaled_fp8_quant_ref, w8a8_fp8_linear_ref
from qserve.kernels.fused_moe_ref import MoEWeight, fused_experts_ref
from qserve.kernels.int8_ref import (
    int8_scaled_mm_ref,
    scaled_int8_quant_ref,
    w8a8_int8_linear_ref,
    w8a16_gemm_ref,
)
from qserve.kernels.model_ops_ref import rms_norm_ref, rope_neox_ref, silu_and_mul_ref
from qserve.kernels.w4a16_ref import awq_gemm_ref, gptq_gemm_ref


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(t: torch.Tensor) -> bool:
    """Triton kernels serve CUDA tensors; everything else takes the torch path."""
    return t.is_cuda and triton_available()


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _pick(t: torch.Tensor, ref: Callable[_P, _R], launcher: str) -> Callable[_P, _R]:
    """The Triton launcher `qserve.kernels.<launcher>` ("module.function", imported on first use)
    when use_triton(t), else the torch reference (same signature)."""
    if not use_triton(t):
        return ref
    module, name = launcher.split(".")
    return getattr(importlib.import_module(f"qserve.kernels.{module}"), name)


def cpu_kernel_paths() -> dict[str, str]:
    """What runs each group of CPU ops: "C++" (compiled now, on the first call on this
    machine) or "torch" with the reason. The W4 matmul's path is in each layer's kernel name."""
    libraries = {
        "paged attention": cpu_paged_attention.load_library,
        "model ops": cpu_model_ops.load_library,
    }
    if not cpu_build.enabled():
        return {name: f"torch ({cpu_build.ENV_VAR}=0)" for name in libraries}
    return {name: "C++" if load() else "torch (build failed)" for name, load in libraries.items()}


# ------------------------------------------------------------------------------- attention


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: Scale = 1.0,
    v_scale: Scale = 1.0,
) -> None:
    """Write new K/V [num_tokens, num_kv_heads, head_dim] into the pages at slot_mapping."""
    if key.is_cpu and cpu_model_ops.cache_write_usable(key, kv_cache):
        Hk = key.shape[1]
        custom_ops.reshape_and_cache(
            key,
            value,
            kv_cache,
            slot_mapping,
            _scale_tensor(k_scale, Hk),
            _scale_tensor(v_scale, Hk),
        )
        return
    _pick(key, reshape_and_cache_ref, "cache_write.reshape_and_cache")(
        key, value, kv_cache, slot_mapping, k_scale, v_scale
    )


def _scale_tensor(scale: Scale, num_kv_heads: int) -> torch.Tensor:
    """A KV page scale as the custom ops take it: a tensor as is (1 or num_kv_heads values,
    read inside the op), a number as a cached fp32 [num_kv_heads]."""
    if isinstance(scale, torch.Tensor):
        return scale
    if torch.compiler.is_compiling():  # a constant of the graph; the cache is for eager calls
        return torch.full((num_kv_heads,), float(scale), dtype=torch.float32)
    return cpu_paged_attention.head_scales(scale, num_kv_heads)


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    k_scale: Scale = 1.0,
    v_scale: Scale = 1.0,
    sliding_window: int | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """Attention of a flat varlen batch of queries over paged K/V (see attention_ref): Triton
    on CUDA, the C++ decode kernel on CPU (falls back to the reference itself), else torch.
    `sliding_window` W: each query sees the last W positions up to itself (None = all).
    `max_query_len` / `max_seq_len`: host-known bounds the Triton launcher sizes its grid by
    instead of reading the device tensors (None: it reads them)."""
    if query.is_cpu and cpu_paged_attention.usable(query, kv_cache):
        Hk = kv_cache.shape[3]
        return custom_ops.paged_attention(
            query, kv_cache, block_tables, seq_lens, query_start_loc, scale,
            _scale_tensor(k_scale, Hk), _scale_tensor(v_scale, Hk), sliding_window,
        )  # fmt: skip
    args = (query, kv_cache, block_tables, seq_lens, query_start_loc, scale, k_scale, v_scale)
    if not use_triton(query):
        return paged_attention_ref(*args, sliding_window=sliding_window)
    from qserve.kernels.paged_attention import paged_attention as launch

    return launch(
        *args, max_query_len=max_query_len, max_seq_len=max_seq_len, sliding_window=sliding_window
    )


# ---------------------------------------------------------------------------------- linear


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, except on CPU: bf16 decode rows take the C++ GEMV, and 16-bit batches on CPUs
    without native 16-bit matmul accumulate in fp32 with the weight upcast a chunk at a time
    (`cpu_dense`: several times faster)."""
    if cpu_dense.use_gemv(x, weight):
        return cpu_dense.bf16_gemv(x, weight, bias)
    if cpu_dense.use_upcast(x):
        return cpu_dense.upcast_linear(x, weight, bias)
    return F.linear(x, weight, bias)


# ---------------------------------------------------------------------------- norm / RoPE


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x (see model_ops_ref.rms_norm_ref); with `residual`, of x + residual, also
    returning that sum (on CPU the C++ op writes it into `residual` in place)."""
    if cpu_model_ops.rms_norm_usable(x, weight, residual):
        if residual is None:
            return custom_ops.rms_norm(x, weight, eps)
        return custom_ops.fused_add_rms_norm(x, residual, weight, eps), residual
    return rms_norm_ref(x, weight, eps, residual)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [M, 2D] (the fused gate/up output) -> silu(x[:, :D]) * x[:, D:], vLLM's activation:
    the C++ op on CPU, torch elsewhere (no Triton kernel: torch on CUDA)."""
    if cpu_model_ops.silu_and_mul_usable(x):
        return custom_ops.silu_and_mul(x)
    return silu_and_mul_ref(x)


def rope_neox(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
    cos_sin: Callable[[torch.dtype], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE of q [T, Hq * D] and k [T, Hk * D] (see model_ops_ref.rope_neox_ref);
    the C++ op on CPU rotates them in place. `cos_sin(dtype)`: the torch path's cos/sin for
    these positions, if the caller caches them."""
    if cpu_model_ops.rope_usable(q, k):
        custom_ops.rope_neox(q, k, positions, cos_sin_cache, head_dim)
        return q, k
    gathered = None if cos_sin is None else cos_sin(q.dtype)
    return rope_neox_ref(q, k, positions, cos_sin_cache, head_dim, gathered)


# ------------------------------------------------------------------------ weight-only GEMMs


def gptq_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    bits: int = 4,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ GPTQ-packed weight -> [M, N] (layouts in `packing`).

    Pass g_idx=None when the groups are consecutive (no desc_act): the kernel is faster."""
    return _pick(x, gptq_gemm_ref, "w4a16.gptq_gemm")(x, qweight, qzeros, scales, g_idx, bits, bias)


def awq_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ AWQ-packed weight -> [M, N] (layouts in `packing`)."""
    return _pick(x, awq_gemm_ref, "w4a16.awq_gemm")(x, qweight, qzeros, scales, group_size, bias)


def w8a16_gemm(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Weight-only int8: x [M, K] @ (w_q [N, K] * w_scale).T -> [M, N]."""
    return _pick(x, w8a16_gemm_ref, "int8.w8a16_gemm")(x, w_q, w_scale, bias)


# ---------------------------------------------------------------------------- int8 W8A8


def scaled_int8_quant(
    x: torch.Tensor, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 [M, K], fp32 scale [M, 1] dynamic per token, or the static scale)."""
    return _pick(x, scaled_int8_quant_ref, "int8.scaled_int8_quant")(x, scale)


def int8_scaled_mm(
    x_q: torch.Tensor,
    w_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """int8 [M, K] x int8 [N, K] -> [M, N]: int32 accumulation, per-token x per-channel scales."""
    return _pick(x_q, int8_scaled_mm_ref, "int8.int8_scaled_mm")(
        x_q, w_q, x_scale, w_scale, out_dtype, bias
    )


def w8a8_int8_linear(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    input_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Quantize x to int8 (dynamic per token or static), then int8_scaled_mm."""
    return _pick(x, w8a8_int8_linear_ref, "int8.w8a8_int8_linear")(
        x, w_q, w_scale, input_scale, bias
    )


# ----------------------------------------------------------------------------- FP8 W8A8


def scaled_fp8_quant(
    x: torch.Tensor, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8_e4m3fn [M, K], fp32 scale [M, 1] dynamic per token, or static)."""
    return _pick(x, scaled_fp8_quant_ref, "fp8.scaled_fp8_quant")(x, scale)


def fp8_scaled_mm(
    x_q: torch.Tensor,
    w_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp8 [M, K] x fp8 [N, K] -> [M, N] with fp32 accumulation and the scales."""
    return _pick(x_q, fp8_scaled_mm_ref, "fp8.fp8_scaled_mm")(
        x_q, w_q, x_scale, w_scale, out_dtype, bias
    )


def w8a8_fp8_linear(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    input_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Quantize x to FP8 (dynamic per token or static), then fp8_scaled_mm."""
    return _pick(x, w8a8_fp8_linear_ref, "fp8.w8a8_fp8_linear")(x, w_q, w_scale, input_scale, bias)


# ------------------------------------------------------------------------ mixture of experts


# Tests monkeypatch this to run the Triton kernel on CPU tensors (under the interpreter), as
# `quant_linear._on_triton` does for the linears; CUDA tensors take it anyway.
def _fused_moe_on_triton(t: torch.Tensor) -> bool:
    return use_triton(t)


def fused_experts_path(t: torch.Tensor) -> str:
    """What `fused_experts` runs for activations like `t`: "triton" or "torch"."""
    return "triton" if _fused_moe_on_triton(t) else "torch"


def fused_experts(
    x: torch.Tensor,
    w13: MoEWeight,
    w2: MoEWeight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """SwiGLU experts over stacked (dense, GPTQ or W8) weights: x [T, H] -> sum_k topk_weights
    * down[e](silu(gate[e](x)) * up[e](x)) (see fused_moe_ref). The Triton grouped GEMM on CUDA
    (not yet run on a GPU), the torch reference elsewhere. The model's fused MoE blocks call
    this (`qserve.model.moe_fused`)."""
    if _fused_moe_on_triton(x):
        from qserve.kernels.fused_moe import fused_experts as launcher

        return launcher(x, w13, w2, topk_weights, topk_ids)
    return fused_experts_ref(x, w13, w2, topk_weights, topk_ids)
