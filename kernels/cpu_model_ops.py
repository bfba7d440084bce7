"""C++ versions of the decoder's small per-layer ops on CPU (csrc/model_ops_cpu.cpp).

At decode sizes each of these is 6-12 torch ops whose dispatch costs more than their
arithmetic (~0.35 ms per layer on SmolLM2 at batch 1, a fifth of a step); one C call each
computes the same numbers: RoPE and the cache write bit-identical to `model_ops_ref` /
`reshape_and_cache_ref` (fp8 included), RMSNorm up to its sum's order (a 16-bit output is
rarely one unit in the last place off). Compiled on first use like the other
CPU kernels (`cpu_build`); `usable` is False when QSERVE_CPU_KERNELS=0, off CPU, for layouts
they do not take, or when the build failed, and callers take the torch references.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from qserve.kernels import cpu_build
from qserve.kernels.attention_ref import Scale
from qserve.kernels.cpu_paged_attention import head_scales

SOURCE = cpu_build.CSRC / "model_ops_cpu.cpp"
DTYPES = cpu_build.DTYPE_CODES
PAGE_DTYPES = cpu_build.PAGE_DTYPE_CODES
STATUS = {1: "unsupported dtype", 2: "bad shape or position", 3: "a slot outside the cache"}

_i32, _i64, _ptr, _f32 = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
_SYMBOLS = {
    "qserve_rms_norm": ([_ptr, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _f32, _i32], _i32),
    "qserve_rope_neox": (
        [_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _i64, _i64, _i64, _i32],
        _i32,
    ),
    "qserve_reshape_and_cache": (
        [_ptr, _ptr, _i64, _i32, _ptr, _i32, _i64, _ptr, _i64, _i64, _i64, _ptr, _ptr],
        _i32,
    ),
    "qserve_silu_and_mul": ([_ptr, _i64, _ptr, _i64, _i64, _i64, _i32], _i32),
}


@functools.cache
def load_library() -> cpu_build.KernelLibrary | None:
    """Compile (first call on this machine, a few seconds) and load; None, with one warning,
    if that fails. -ffp-contract=off: no fused multiply-add where torch rounds in between."""
    return cpu_build.build_library(
        "cpu_model_ops", SOURCE, _SYMBOLS, "CPU model ops", ("-ffp-contract=off",)
    )


def _rows(t: torch.Tensor) -> bool:
    """A CPU tensor of rows [M, H] with a contiguous last dim."""
    return t.is_cpu and t.dim() == 2 and t.stride(-1) == 1


@cpu_build.constant_while_tracing
def ready() -> bool:
    """Enabled and compiled (compiles on the first call). torch.compile calls this once while
    tracing and bakes the answer into the graph (no os / ctypes calls in the traced code)."""
    return cpu_build.enabled() and load_library() is not None


def usable(*tensors: torch.Tensor) -> bool:
    """Enabled, on CPU, in a dtype the C++ ops take, and compiled. Cheap: called per op."""
    for t in tensors:
        if not t.is_cpu or t.dtype not in DTYPES:
            return False
    return ready()


def rms_norm_usable(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None
) -> bool:
    """`rms_norm` takes these: rows with a contiguous last dim, one dtype."""
    dtype = x.dtype
    if x.stride(-1) != 1 or weight.dtype != dtype or weight.dim() != 1:
        return False
    if not weight.is_contiguous():
        return False
    if residual is not None and (
        residual.dtype != dtype or residual.shape != x.shape or not residual.is_contiguous()
    ):
        return False
    return usable(x, weight)


def rope_usable(q: torch.Tensor, k: torch.Tensor) -> bool:
    """`rope_neox` takes these: rows [T, heads * D] of one dtype, contiguous last dim."""
    return (
        q.dim() == 2 and k.dim() == 2 and q.dtype == k.dtype and q.shape[0] == k.shape[0]
        and q.stride(-1) == 1 and k.stride(-1) == 1 and usable(q, k)
    )  # fmt: skip


def _check(status: int, what: str) -> None:
    if status:
        raise ValueError(f"{what}: {STATUS.get(status, status)}")


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `rms_norm_ref`; with `residual`, the sum is written into `residual`
    in place and returned as the new residual."""
    if not rms_norm_usable(x, weight, residual):
        raise ValueError(
            "rms_norm: rows with a contiguous last dim; weight and residual of x's dtype"
        )
    return rms_norm_unchecked(x, weight, eps, residual)


def rms_norm_unchecked(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`rms_norm` for arguments `rms_norm_usable` accepted (the dispatcher checks once)."""
    H = x.shape[-1]
    x2 = x if x.dim() == 2 else x.reshape(-1, H)
    r2 = None if residual is None else residual.view(-1, H)
    out = torch.empty(x2.shape, dtype=x.dtype)
    status = load_library().qserve_rms_norm(
        x2.data_ptr(), x2.stride(0),
        None if r2 is None else r2.data_ptr(), 0 if r2 is None else r2.stride(0),
        weight.data_ptr(), out.data_ptr(), out.stride(0), x2.shape[0], H, eps, DTYPES[x.dtype],
    )  # fmt: skip
    _check(status, "rms_norm")
    out = out if x.dim() == 2 else out.view(x.shape)
    return out if residual is None else (out, residual)


def silu_and_mul_usable(x: torch.Tensor) -> bool:
    """`silu_and_mul` takes this: CPU rows [M, 2D] with a contiguous last dim."""
    return _rows(x) and x.shape[1] % 2 == 0 and usable(x)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Same contract as `silu_and_mul_ref`: x [M, 2D] (gate | up) -> [M, D]; exp differs from
    torch's by about 1 ulp, so an output can be one unit in the last place off."""
    if not silu_and_mul_usable(x):
        raise ValueError("silu_and_mul: CPU rows [M, 2D] with a contiguous last dim")
    return silu_and_mul_unchecked(x)


def silu_and_mul_unchecked(x: torch.Tensor) -> torch.Tensor:
    """`silu_and_mul` for an x `silu_and_mul_usable` accepted (the dispatcher checks once)."""
    M, D = x.shape[0], x.shape[1] // 2
    out = torch.empty(M, D, dtype=x.dtype)
    status = load_library().qserve_silu_and_mul(
        x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0), M, D, DTYPES[x.dtype]
    )
    _check(status, "silu_and_mul")
    return out


def rope_neox(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `rope_neox_ref`, rotating q [T, Hq * D] and k [T, Hk * D] in place."""
    if not (_rows(q) and _rows(k)) or k.dtype != q.dtype or q.shape[0] != k.shape[0]:
        raise ValueError("rope_neox: q and k rows of one dtype with a contiguous last dim")
    if cos_sin_cache.dtype != torch.float32 or not cos_sin_cache.is_contiguous():
        raise ValueError("rope_neox: cos_sin_cache must be contiguous fp32")
    pos = positions if positions.dtype == torch.int64 else positions.to(torch.int64)
    pos = pos.contiguous()
    status = load_library().qserve_rope_neox(
        q.data_ptr(), q.stride(0), q.shape[1] // head_dim,
        k.data_ptr(), k.stride(0), k.shape[1] // head_dim,
        pos.data_ptr(), cos_sin_cache.data_ptr(), cos_sin_cache.shape[0],
        q.shape[0], head_dim, DTYPES[q.dtype],
    )  # fmt: skip
    _check(status, "rope_neox")
    return q, k


def cache_write_usable(key: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """The C++ cache write takes these (CPU, contiguous pages, rows of K/V)."""
    return (
        kv_cache.dtype in PAGE_DTYPES
        and kv_cache.is_cpu
        and kv_cache.is_contiguous()
        and key.dim() == 3
        and usable(key)
    )


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: Scale = 1.0,
    v_scale: Scale = 1.0,
) -> None:
    """Same contract as `reshape_and_cache_ref`: key/value [T, Hk, D] into their slots."""
    T, Hk, D = key.shape
    if value.shape != key.shape or value.dtype != key.dtype:
        raise ValueError("reshape_and_cache: key and value differ in shape or dtype")
    if kv_cache.shape[0] != 2 or kv_cache.shape[3:] != (Hk, D):
        raise ValueError(f"reshape_and_cache: pages {tuple(kv_cache.shape)} do not fit K/V")
    k2, v2 = key.reshape(T, Hk * D), value.reshape(T, Hk * D)
    if k2.stride(-1) != 1 or v2.stride(0) != k2.stride(0):
        k2, v2 = k2.contiguous(), v2.contiguous()
    slots = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.to(torch.int64)
    slots = slots.contiguous()
    status = load_library().qserve_reshape_and_cache(
        k2.data_ptr(), v2.data_ptr(), k2.stride(0), DTYPES[key.dtype],
        kv_cache.data_ptr(), PAGE_DTYPES[kv_cache.dtype], kv_cache.shape[1] * kv_cache.shape[2],
        slots.data_ptr(), T, Hk, D,
        head_scales(k_scale, Hk).data_ptr(), head_scales(v_scale, Hk).data_ptr(),
    )  # fmt: skip
    _check(status, "reshape_and_cache")
