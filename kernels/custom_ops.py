"""The C++ CPU kernels as torch custom ops, `torch.ops.qserve.*`, so torch.compile sees them.

A ctypes call is opaque to torch.compile (a graph break); a dispatcher op with a fake (meta)
implementation is one node in the graph, with its output shapes known and, for the in-place
ops, its mutations declared in the schema (`Tensor(a!)`), so functionalization handles them.

Registered with `torch.library.Library` + `impl(..., "CPU")` + `register_fake`, not
`torch.library.custom_op`: both give the same op, but custom_op's Python autograd and device
wrappers cost ~6 us a call over the bare ctypes call against ~3 us here (rms_norm on [1, 576],
ARCHITECTURE.md section 5), and batch-1 decode is dispatch-bound. The ops are inference-only:
the Autograd key falls through (no autograd formula, outputs never require grad, no cost).

The module's functions (`rms_norm`, ...) call the op only while torch.compile traces; eager
calls go straight to the CPU implementation, without the dispatcher's cost.

Each CPU implementation is the existing ctypes wrapper in `cpu_model_ops` / `cpu_paged_attention`
/ `cpu_w4a16`, looked up at call time (tests patch them). The ops assume the caller checked the
arguments (`*_usable`) and that the library built; `ops` keeps the torch references for
everything else. Importing this module registers the schemas only; nothing compiles.

    rms_norm(x, weight, eps) -> out
    fused_add_rms_norm(x, residual!, weight, eps) -> out       residual += x, in place
    rope_neox(q!, k!, positions, cos_sin_cache, head_dim)      rotates q and k in place
    reshape_and_cache(key, value, kv_cache!, slot_mapping, k_scale, v_scale)
    paged_attention(query, kv_cache, block_tables, seq_lens, query_start_loc, scale,
                    k_scale, v_scale, sliding_window) -> out   (prompt chunks: torch inside)
    silu_and_mul(x) -> out
    w4a16_gemm(x, codes, scales, zs, perm, bias, group_size) -> out     (`cpu_w4a16` layout)
    w4a16_dequantize(codes, scales, zs, group_size, dtype) -> W.T
    bf16_gemv(x, weight, bias) -> out                                   (`cpu_dense`)
"""

from __future__ import annotations

import torch

from qserve.kernels import cpu_dense, cpu_model_ops, cpu_paged_attention, cpu_w4a16

NAMESPACE = "qserve"
_LIB = torch.library.Library(NAMESPACE, "DEF")

SCHEMAS = {
    "rms_norm": "rms_norm(Tensor x, Tensor weight, float eps) -> Tensor",
    "fused_add_rms_norm": (
        "fused_add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor"
    ),
    "rope_neox": (
        "rope_neox(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos_sin_cache, "
        "int head_dim) -> ()"
    ),
    "reshape_and_cache": (
        "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping, "
        "Tensor k_scale, Tensor v_scale) -> ()"
    ),
    "paged_attention": (
        "paged_attention(Tensor query, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, "
        "Tensor query_start_loc, float scale, Tensor k_scale, Tensor v_scale, "
        "int? sliding_window) -> Tensor"
    ),
    "silu_and_mul": "silu_and_mul(Tensor x) -> Tensor",
    "w4a16_gemm": (
        "w4a16_gemm(Tensor x, Tensor codes, Tensor scales, Tensor zs, Tensor? perm, "
        "Tensor? bias, int group_size) -> Tensor"
    ),
    "bf16_gemv": "bf16_gemv(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
    "w4a16_dequantize": (
        "w4a16_dequantize(Tensor codes, Tensor scales, Tensor zs, int group_size, "
        "ScalarType dtype) -> Tensor"
    ),
}


def _register(name: str, cpu_impl, fake_impl) -> None:
    """Define `qserve::<name>`, its CPU kernel, its fake (shape/dtype only) kernel and an
    Autograd fallthrough (inference only: outputs do not require grad)."""
    _LIB.define(SCHEMAS[name])
    _LIB.impl(name, cpu_impl, "CPU")
    _LIB.impl(name, torch.library.fallthrough_kernel, "Autograd")
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake_impl, lib=_LIB)


# ------------------------------------------------------------------------------ RMSNorm


def _rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return cpu_model_ops.rms_norm_unchecked(x, weight, eps)


def _fused_add_rms_norm_cpu(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    return cpu_model_ops.rms_norm_unchecked(x, weight, eps, residual)[0]


def _rms_norm_fake(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x.new_empty(x.shape)


def _fused_add_rms_norm_fake(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    return x.new_empty(x.shape)


# --------------------------------------------------------------------------------- RoPE


def _rope_neox_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
) -> None:
    cpu_model_ops.rope_neox(q, k, positions, cos_sin_cache, head_dim)


def _rope_neox_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
) -> None:
    return None


# -------------------------------------------------------------------------- KV cache write


def _reshape_and_cache_cpu(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> None:
    cpu_model_ops.reshape_and_cache(key, value, kv_cache, slot_mapping, k_scale, v_scale)


def _reshape_and_cache_fake(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> None:
    return None


# ---------------------------------------------------------------------- paged attention


def _paged_attention_cpu(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    sliding_window: int | None,
) -> torch.Tensor:
    return cpu_paged_attention.paged_attention(
        query, kv_cache, block_tables, seq_lens, query_start_loc, scale, k_scale, v_scale,
        sliding_window,
    )  # fmt: skip


def _paged_attention_fake(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    sliding_window: int | None,
) -> torch.Tensor:
    return torch.empty_like(query)


# --------------------------------------------------------------------------- activation


def _silu_and_mul_cpu(x: torch.Tensor) -> torch.Tensor:
    return cpu_model_ops.silu_and_mul_unchecked(x)


def _silu_and_mul_fake(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], x.shape[1] // 2)


# --------------------------------------------------------------------------------- W4A16


def _w4a16_gemm_cpu(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    zs: torch.Tensor,
    perm: torch.Tensor | None,
    bias: torch.Tensor | None,
    group_size: int,
) -> torch.Tensor:
    w = cpu_w4a16.W4PackedCPU(codes, scales, zs, group_size, perm)
    return cpu_w4a16.w4_gemv_ctypes(x, w, bias)


def _w4a16_gemm_fake(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    zs: torch.Tensor,
    perm: torch.Tensor | None,
    bias: torch.Tensor | None,
    group_size: int,
) -> torch.Tensor:
    return x.new_empty(x.shape[0], codes.shape[0] * 8)


def _w4a16_dequantize_cpu(
    codes: torch.Tensor, scales: torch.Tensor, zs: torch.Tensor, group_size: int, dtype
) -> torch.Tensor:
    w = cpu_w4a16.W4PackedCPU(codes, scales, zs, group_size, None)
    return cpu_w4a16.w4_dequantize_t_ctypes(w, dtype)


def _w4a16_dequantize_fake(
    codes: torch.Tensor, scales: torch.Tensor, zs: torch.Tensor, group_size: int, dtype
) -> torch.Tensor:
    return codes.new_empty(codes.shape[1] * 8, codes.shape[0] * 8, dtype=dtype)


# ------------------------------------------------------------------------------ bf16 GEMV


def _bf16_gemv_cpu(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return cpu_dense.bf16_gemv_ctypes(x, weight, bias)


def _bf16_gemv_fake(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


_register("rms_norm", _rms_norm_cpu, _rms_norm_fake)
_register("fused_add_rms_norm", _fused_add_rms_norm_cpu, _fused_add_rms_norm_fake)
_register("rope_neox", _rope_neox_cpu, _rope_neox_fake)
_register("reshape_and_cache", _reshape_and_cache_cpu, _reshape_and_cache_fake)
_register("paged_attention", _paged_attention_cpu, _paged_attention_fake)
_register("silu_and_mul", _silu_and_mul_cpu, _silu_and_mul_fake)
_register("w4a16_gemm", _w4a16_gemm_cpu, _w4a16_gemm_fake)
_register("w4a16_dequantize", _w4a16_dequantize_cpu, _w4a16_dequantize_fake)
_register("bf16_gemv", _bf16_gemv_cpu, _bf16_gemv_fake)


def _compiled_or_direct(op: torch._ops.OpOverload, impl):  # noqa: ANN001, ANN202
    """`op` while torch.compile traces (one node in its graph), its CPU implementation called
    directly otherwise: eager steps skip the dispatcher's ~3 us a call (batch-1 decode makes
    about 300 of these calls a step)."""

    def call(*args):  # noqa: ANN002, ANN202
        if torch.compiler.is_compiling():
            return op(*args)
        return impl(*args)

    call.op = op  # type: ignore[attr-defined]  (the OpOverload, for opcheck and callers)
    call.__name__ = op.__name__
    call.__doc__ = f"torch.ops.qserve.{op.__name__}, or its CPU implementation when eager."
    return call


_ops = torch.ops.qserve
rms_norm = _compiled_or_direct(_ops.rms_norm.default, _rms_norm_cpu)
fused_add_rms_norm = _compiled_or_direct(_ops.fused_add_rms_norm.default, _fused_add_rms_norm_cpu)
rope_neox = _compiled_or_direct(_ops.rope_neox.default, _rope_neox_cpu)
reshape_and_cache = _compiled_or_direct(_ops.reshape_and_cache.default, _reshape_and_cache_cpu)
paged_attention = _compiled_or_direct(_ops.paged_attention.default, _paged_attention_cpu)
silu_and_mul = _compiled_or_direct(_ops.silu_and_mul.default, _silu_and_mul_cpu)
w4a16_gemm = _compiled_or_direct(_ops.w4a16_gemm.default, _w4a16_gemm_cpu)
w4a16_dequantize = _compiled_or_direct(_ops.w4a16_dequantize.default, _w4a16_dequantize_cpu)
bf16_gemv = _compiled_or_direct(_ops.bf16_gemv.default, _bf16_gemv_cpu)
