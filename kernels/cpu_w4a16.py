"""C++ 4-bit weight-only matmul on CPU (csrc/w4a16_cpu.cpp), compiled on first use.

Same function as `w4a16_ref.gptq_gemm_ref` / `awq_gemm_ref`: y = x @ dequantize(W).T in fp32,
output in x's dtype (except bf16 batches on CPUs with native bf16 matmuls, below). Repack once
at load time, then call per step:

    w = w4_from_gptq(qweight, qzeros, scales, g_idx)   # or w4_from_awq(qweight, qzeros, ...)
    y = w4_mm(x, w, bias)                               # x [..., K] -> [..., N]

Decode-sized batches (M <= `GEMV_MAX_ROWS`) run the C++ loop, which dequantizes codes in
registers and reads 4 bits per weight; larger M dequantizes the weight to fp32 once per call
(in C++) and runs torch's fp32 GEMM, which is faster than any loop here once the weight is
reused across many rows (on AVX2 CPUs an fp32 GEMM is also 4-5x faster than a bf16 one).
Where the CPU has native bf16 matmuls (AMX, AVX-512 BF16) and x is bf16 (and does not go
through int8, below, which runs the loop up to `INT8_LOOP_MAX_ROWS`), batches of
`NATIVE_BF16_GEMM_MIN_ROWS` rows or more dequantize to bf16 instead and run torch's bf16 GEMM:
the weight is then rounded to bf16 once more (2^-9 relative) before an fp32-accumulated product.

16-bit x (bf16, fp16) at decode sizes goes through int8 on x86 CPUs with AVX2 (`int8_activations`),
as llama.cpp runs its 4-bit formats: each group of x is rounded to int8 on a grid of max |x| / 127
(`w4a16_ref.quantize_activations_ref`), and int8 dot products (AVX-512 VNNI / AVX-VNNI vpdpbusd,
or AVX2 vpmaddubsw) take four 4-bit codes of 8 outputs per instruction: about 8x fewer
instructions per weight than converting each code to fp32, so the loop reads the codes at memory
speed. The rounding adds about 0.3% of an output's scale, below bf16's own rounding of x and y.
fp32 x keeps the exact loop.

Layout (`W4PackedCPU`): codes uint32 [N/8, K/8, 8], GPTQ's packing along K blocked over groups
of 8 output channels; scales and scale * zero fp32 [N/8, G, 8]. Act-order GPTQ sorts the input
channels by group (x is read through `perm`). Needs K and N multiples of 8 and groups of a
multiple of 8 consecutive channels (after sorting); `w4_from_*` raise ValueError otherwise.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from qserve.kernels import cpu_build, custom_ops
from qserve.kernels.packing import (
    unpack_awq_qweight,
    unpack_awq_qzeros,
    unpack_gptq_qweight,
    unpack_gptq_qzeros,
)
from qserve.platform import native_half_matmul

SOURCE = cpu_build.CSRC / "w4a16_cpu.cpp"
GEMV_MAX_ROWS = 32  # larger M: dequantize + fp32 GEMM, faster there on an AVX2 EPYC
# bf16 x on a CPU with native bf16 matmuls (AMX): dequantize to bf16 + bf16 GEMM from this M on
NATIVE_BF16_GEMM_MIN_ROWS = 16  # measured on a 2-core AMX Xeon: 1.2-1.5x at 16, ~2x at 32+
# 16-bit x through int8 (`int8_activations`): the loop up to this M, 3-6x faster than the bf16
# dequantize + GEMM at 16-64 rows on SmolLM2's and 2048x8192 shapes (2-core AMX Xeon)
INT8_LOOP_MAX_ROWS = 64
DEQUANT_CHUNK_BYTES = 2 << 20  # fp32 weight dequantized at a time for the GEMM
X_DTYPES = cpu_build.DTYPE_CODES
STATUS = {1: "unsupported dtype", 2: "K, N and group size must be multiples of 8"}

_i32, _i64, _ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
_GEMM_ARGS = [_ptr, _i32, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _ptr, _i64]
_DEQUANT_ARGS = [_ptr, _ptr, _ptr, _i64, _i64, _i64, _ptr, _i32, _i32]


@functools.cache
def load_library() -> cpu_build.KernelLibrary | None:
    """Compile (first call on this machine, a few seconds) and load; None, with one warning,
    if that fails."""
    symbols = {
        "qserve_w4_gemm": ([*_GEMM_ARGS, _i32], _i32),
        "qserve_w4_dequantize": (_DEQUANT_ARGS, _i32),
        "qserve_w4a8_gemm": ([*_GEMM_ARGS, _i32], _i32),
        "qserve_w4a8_supported": ([], _i32),
    }
    return cpu_build.build_library("cpu_w4a16", SOURCE, symbols, "CPU W4A16")


def available() -> bool:
    """Enabled (QSERVE_CPU_KERNELS) and compiled (compiles on the first call)."""
    return cpu_build.enabled() and load_library() is not None


@dataclass(frozen=True)
class W4PackedCPU:
    """A 4-bit weight in the C++ kernel's layout (see the module docstring)."""

    codes: torch.Tensor  # int32 [N/8, K/8, 8] (the kernel reads uint32)
    scales: torch.Tensor  # fp32 [N/8, G, 8]
    zs: torch.Tensor  # fp32 [N/8, G, 8]: scale * zero
    group_size: int
    perm: torch.Tensor | None  # int64 [K]: act-order input channel order, read from x

    @property
    def in_features(self) -> int:
        return self.codes.shape[1] * 8

    @property
    def out_features(self) -> int:
        return self.codes.shape[0] * 8


def concat(weights: list[W4PackedCPU]) -> W4PackedCPU:
    """One weight whose output channels are those of `weights` in order (fused q/k/v or
    gate/up: one call instead of several). The blocks of 8 outputs are the outermost dim, so
    this is a concatenation. Raises ValueError unless they share K, groups and perm."""
    first = weights[0]
    for w in weights[1:]:
        same_perm = (w.perm is None and first.perm is None) or (
            w.perm is not None and first.perm is not None and torch.equal(w.perm, first.perm)
        )
        if w.codes.shape[1] != first.codes.shape[1] or w.group_size != first.group_size:
            raise ValueError("W4 weights with different K or group size do not concatenate")
        if not same_perm:
            raise ValueError("W4 weights with different act-order permutations do not concatenate")
    return W4PackedCPU(
        torch.cat([w.codes for w in weights]),
        torch.cat([w.scales for w in weights]),
        torch.cat([w.zs for w in weights]),
        first.group_size,
        first.perm,
    )


def split(w: W4PackedCPU, out_features: list[int]) -> list[W4PackedCPU]:
    """Views of `w`, one per consecutive range of output channels (multiples of 8)."""
    blocks = [n // 8 for n in out_features]
    parts = zip(*(t.split(blocks) for t in (w.codes, w.scales, w.zs)), strict=True)
    return [W4PackedCPU(c, s, z, w.group_size, w.perm) for c, s, z in parts]


def _blocked(t: torch.Tensor) -> torch.Tensor:
    """[R, N] -> [N/8, R, 8] contiguous."""
    R, N = t.shape
    return t.reshape(R, N // 8, 8).permute(1, 0, 2).contiguous()


def w4_from_codes(
    q: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    perm: torch.Tensor | None = None,
) -> W4PackedCPU:
    """q [K, N] in [0, 15] (rows in the order x is read through `perm`) with groups of
    `group_size` consecutive rows; scales, zeros [G, N]: W[n, k] = scale * (q - zero)."""
    K, N = q.shape
    G = scales.shape[0]
    if K % 8 or N % 8 or group_size % 8 or G * group_size != K:
        raise ValueError(
            f"W4 CPU kernel needs K, N and the group size multiples of 8 and K = groups x group "
            f"size; got K={K}, N={N}, {G} groups of {group_size}"
        )
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    words = (q.to(torch.int64).reshape(K // 8, 8, N) << shifts[None, :, None]).sum(dim=1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # [K/8, N]
    s = scales.to(torch.float32)
    zs = s * zeros.to(torch.float32)
    return W4PackedCPU(_blocked(words), _blocked(s), _blocked(zs), group_size, perm)


def w4_from_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    bits: int = 4,
) -> W4PackedCPU:
    """4-bit (or 3-bit: its codes are 4-bit codes too) GPTQ tensors (see `packing`; g_idx int
    [K], act-order allowed when every group has the same size) -> the kernel's layout. Raises
    ValueError if unsupported."""
    if bits not in (3, 4):
        raise ValueError(f"the W4A16 kernel takes 3- and 4-bit codes, got {bits}-bit")
    q = unpack_gptq_qweight(qweight, bits)  # [K, N]
    zeros = unpack_gptq_qzeros(qzeros, bits)  # [G, N], 1 added back
    K = q.shape[0]
    g_idx = g_idx.to(torch.int64)
    group_size = K // scales.shape[0]
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], torch.arange(K) // group_size):
        raise ValueError("g_idx does not form groups of equal size")
    if torch.equal(perm, torch.arange(K)):
        return w4_from_codes(q, scales, zeros, group_size)
    return w4_from_codes(q[perm], scales, zeros, group_size, perm.contiguous())


def w4_from_awq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> W4PackedCPU:
    """AWQ gemm tensors (see `packing`) -> the kernel's layout. Raises ValueError if unsupported."""
    q = unpack_awq_qweight(qweight)  # [K, N]
    gs = q.shape[0] if group_size == -1 else group_size
    return w4_from_codes(q, scales, unpack_awq_qzeros(qzeros), gs)


def _library() -> cpu_build.KernelLibrary:
    lib = load_library()
    if lib is None:
        raise RuntimeError("the CPU W4A16 kernel failed to compile")
    return lib


def _check(status: int, what: str) -> None:
    if status:
        raise ValueError(f"{what}: {STATUS.get(status, status)}")


def w4_gemv(x: torch.Tensor, w: W4PackedCPU, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (fp32/bf16/fp16, last dim contiguous) -> [M, N] in x's dtype, on the C++ loop
    (through the custom op `torch.ops.qserve.w4a16_gemm`, so torch.compile sees it)."""
    K = x.shape[1]
    if K != w.in_features or x.dtype not in X_DTYPES or x.stride(-1) != 1 or not x.is_cpu:
        raise ValueError(f"x {x.dtype} {tuple(x.shape)} does not fit a W4 weight with K={K}")
    return custom_ops.w4a16_gemm(x, w.codes, w.scales, w.zs, w.perm, bias, w.group_size)


def w4_gemv_ctypes(
    x: torch.Tensor, w: W4PackedCPU, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`w4_gemv`'s C call itself, for arguments it checked (the custom op's CPU kernel)."""
    M, K = x.shape
    dtype_code = X_DTYPES[x.dtype]
    N = w.codes.shape[0] * 8
    y = torch.empty(M, N, dtype=x.dtype)
    b = None if bias is None else bias.to(torch.float32).contiguous()
    lib = _library()
    gemm = lib.qserve_w4a8_gemm if int8_activations(x.dtype) else lib.qserve_w4_gemm
    status = gemm(
        x.data_ptr(), dtype_code, x.stride(0),
        None if w.perm is None else w.perm.data_ptr(),
        w.codes.data_ptr(), w.scales.data_ptr(), w.zs.data_ptr(),
        None if b is None else b.data_ptr(), M, K, N, w.group_size,
        y.data_ptr(), y.stride(0), torch.get_num_threads(),
    )  # fmt: skip
    _check(status, "w4_gemv")
    return y


def int8_activations(dtype: torch.dtype) -> bool:
    """Whether the C++ loop takes x of this dtype through int8 (16-bit x on x86 with AVX2:
    `qserve_w4a8_gemm`); fp32 x, and other CPUs, keep the exact loop."""
    return dtype != torch.float32 and _w4a8_ready()


@cpu_build.constant_while_tracing
def _w4a8_ready() -> bool:
    """Enabled and built with the int8 loop (a constant while torch.compile traces)."""
    return cpu_build.enabled() and _w4a8_built()


@functools.cache
def _w4a8_built() -> bool:
    lib = load_library()
    return lib is not None and bool(lib.qserve_w4a8_supported())


def w4_dequantize_t(w: W4PackedCPU, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W.T [K, N] in fp32 or bf16 (rounded to nearest even), input channels in the order the
    codes are stored (sorted by group for act-order: multiply x[:, perm] by it). Through the
    custom op `torch.ops.qserve.w4a16_dequantize`."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"W4 dequantizes to float32 or bfloat16, not {dtype}")
    return custom_ops.w4a16_dequantize(w.codes, w.scales, w.zs, w.group_size, dtype)


def w4_dequantize_t_ctypes(w: W4PackedCPU, dtype: torch.dtype) -> torch.Tensor:
    """`w4_dequantize_t`'s C call itself (the custom op's CPU kernel)."""
    out = torch.empty(w.in_features, w.out_features, dtype=dtype)
    status = _library().qserve_w4_dequantize(
        w.codes.data_ptr(), w.scales.data_ptr(), w.zs.data_ptr(), w.in_features,
        w.out_features, w.group_size, out.data_ptr(), cpu_build.DTYPE_CODES[dtype],
        torch.get_num_threads(),
    )  # fmt: skip
    _check(status, "w4_dequantize")
    return out


def w4_mm(x: torch.Tensor, w: W4PackedCPU, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W.T (+ bias) -> [..., N] in x's dtype: the C++ loop in fp32 for decode-sized
    batches, else a GEMM on the dequantized weight (bf16 where x is bf16 and the CPU has native
    bf16 matmuls, `_native_bf16`; fp32 otherwise)."""
    if x.dim() == 2 and _gemv_rows(x) and x.stride(-1) == 1:  # decode: lean
        return w4_gemv(x, w, bias)
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x if x.dim() == 2 else x.reshape(-1, K)
    if _gemv_rows(x2):
        out = w4_gemv(x2 if x2.stride(-1) == 1 else x2.contiguous(), w, bias)
    else:
        xs = x2 if w.perm is None else x2[:, w.perm]
        native = _native_bf16(x2)
        out = _dequantized_mm(xs if native else xs.to(torch.float32), w, bias).to(x.dtype)
    return out if x.dim() == 2 else out.reshape(*lead, w.out_features)


def _native_bf16(x: torch.Tensor) -> bool:
    return x.dtype == torch.bfloat16 and _native_half()


@cpu_build.constant_while_tracing
def _native_half() -> bool:
    """`native_half_matmul()` (this module's name, which tests patch), a constant while
    torch.compile traces (dynamo does not trace torch.cpu's CPU feature probes)."""
    return native_half_matmul()


def _gemv_rows(x: torch.Tensor) -> bool:
    """Whether the C++ loop takes x's rows: up to INT8_LOOP_MAX_ROWS through int8, else fewer
    on CPUs where a bf16 GEMM is native."""
    if int8_activations(x.dtype):
        limit = INT8_LOOP_MAX_ROWS
    elif _native_bf16(x):
        limit = NATIVE_BF16_GEMM_MIN_ROWS - 1
    else:
        limit = GEMV_MAX_ROWS
    return x.shape[0] <= limit


def _dequantized_mm(x: torch.Tensor, w: W4PackedCPU, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T (+ bias) in x's dtype (fp32 or bf16), W dequantized DEQUANT_CHUNK_BYTES of fp32
    at a time into x's dtype: a chunk stays in cache, so a large weight (an lm_head) never goes
    to memory dequantized."""
    N = w.out_features
    out = torch.empty(x.shape[0], N, dtype=x.dtype)
    blocks = max(1, DEQUANT_CHUNK_BYTES // (4 * 8 * w.in_features))
    n0 = 0
    for part in split(w, [8 * b for b in _chunks(N // 8, blocks)]):
        n1 = n0 + part.out_features
        torch.mm(x, w4_dequantize_t(part, x.dtype), out=out[:, n0:n1])
        n0 = n1
    if bias is not None:
        out += bias.to(out.dtype)
    return out


def _chunks(total: int, size: int) -> list[int]:
    return [min(size, total - i) for i in range(0, total, size)]
