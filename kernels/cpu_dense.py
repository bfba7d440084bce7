"""16-bit dense linears on CPUs without native bf16/fp16 matmul (no AMX, no AVX-512 BF16).

There, torch's bf16 matmul costs about M separate matrix-vector products: at M = 64 rows,
SmolLM2's lm_head (49152 x 576) takes ~420 ms in bf16 against ~55 ms for the same product in
fp32 with the weight converted a chunk of rows at a time (each chunk stays in cache, so the
fp32 copy never goes to memory). For M >= `UPCAST_MIN_ROWS` this computes
y = dtype(fp32(x) @ fp32(W).T + b): one rounding of an fp32-accumulated product, as torch's
16-bit matmul. Smaller M (decode at batch 1) keeps a 16-bit product, which reads half the
bytes of fp32.

bf16 batches of at most `GEMV_MAX_ROWS` rows take `bf16_gemv` (csrc/dense_cpu.cpp) on every
CPU: torch's bf16 matmul at M = 1 reads the weight at about half the memory's speed, the C++ loop
(AVX-512 BF16 dot products, or bf16 widened to fp32 by a shift elsewhere) near its speed. Same
math as F.linear: exact products, an fp32 sum, one rounding to bf16.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from qserve.kernels import cpu_build, custom_ops
from qserve.platform import native_half_matmul

SOURCE = cpu_build.CSRC / "dense_cpu.cpp"
HALF_DTYPES = (torch.bfloat16, torch.float16)
GEMV_MAX_ROWS = 3  # bf16 rows the C++ loop takes; more: torch (AMX) or `upcast_linear`
UPCAST_MIN_ROWS = 4  # measured crossover on an AVX2 EPYC: 2-4 rows (lm_head and MLP shapes)
CHUNK_BYTES = 2 << 20  # fp32 weight rows converted at a time (fits in L2/L3)


def use_upcast(x: torch.Tensor) -> bool:
    """A 16-bit CPU batch of at least UPCAST_MIN_ROWS rows on a CPU without native 16-bit
    matmul: `upcast_linear` is several times faster than F.linear."""
    return (
        x.is_cpu
        and x.dtype in HALF_DTYPES
        and x.dim() == 2
        and x.shape[0] >= UPCAST_MIN_ROWS
        and not _native_half()
    )


@cpu_build.constant_while_tracing
def _native_half() -> bool:
    """`native_half_matmul()` (this module's name, which tests patch), a constant while
    torch.compile traces (dynamo does not trace torch.cpu's CPU feature probes)."""
    return native_half_matmul()


def upcast_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T (+ bias) accumulated in fp32, rounded once to x's dtype; the
    weight is converted to fp32 a chunk of rows at a time."""
    M, N = x.shape[0], weight.shape[0]
    rows = max(64, CHUNK_BYTES // (4 * weight.shape[1]))
    x32 = x.float()
    out = torch.empty(M, N, dtype=x.dtype)
    for n0 in range(0, N, rows):
        b = None if bias is None else bias[n0 : n0 + rows].float()
        out[:, n0 : n0 + rows] = F.linear(x32, weight[n0 : n0 + rows].float(), b)
    return out


_i32, _i64, _ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
_SYMBOLS = {
    "qserve_bf16_gemv": ([_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _ptr, _i64, _i32], _i32),
    "qserve_bf16_gemv_native": ([], _i32),
}


@functools.cache
def load_library() -> cpu_build.KernelLibrary | None:
    """Compile (first call on this machine, a few seconds) and load; None, with one warning,
    if that fails."""
    return cpu_build.build_library("cpu_dense", SOURCE, _SYMBOLS, "CPU bf16 GEMV")


@cpu_build.constant_while_tracing
def _gemv_ready() -> bool:
    return cpu_build.enabled() and load_library() is not None


def use_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """A bf16 CPU batch of at most GEMV_MAX_ROWS rows (last dim contiguous) against a
    contiguous bf16 weight, with the C++ loop built."""
    return (
        x.is_cpu
        and x.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and x.dim() == 2
        and x.shape[0] <= GEMV_MAX_ROWS
        and x.stride(-1) == 1
        and weight.is_contiguous()
        and weight.is_cpu
        and _gemv_ready()
    )


def bf16_gemv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T (+ bias) -> bf16 [M, N] for arguments `use_gemv` accepted
    (through the custom op `torch.ops.qserve.bf16_gemv`, so torch.compile sees it)."""
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} does not fit a weight {tuple(weight.shape)}")
    return custom_ops.bf16_gemv(x, weight, bias)


def bf16_gemv_ctypes(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`bf16_gemv`'s C call itself (the custom op's CPU kernel)."""
    (M, K), N = x.shape, weight.shape[0]
    y = torch.empty(M, N, dtype=torch.bfloat16)
    b = None if bias is None else bias.to(torch.float32).contiguous()
    status = load_library().qserve_bf16_gemv(
        x.data_ptr(), x.stride(0), weight.data_ptr(), None if b is None else b.data_ptr(),
        M, K, N, y.data_ptr(), y.stride(0), torch.get_num_threads(),
    )  # fmt: skip
    if status:
        raise ValueError(f"bf16_gemv: status {status} for x {tuple(x.shape)}, W [{N}, {K}]")
    return y
