"""Triton kernels shared by W8A8 int8, W8A8 FP8 and weight-only W8A16: activation quantization
and the scaled GEMM (the torch references are in `int8_ref` and `fp8_ref`).

    x_scale[m] = max(max_k |x[m, k]|, 1e-10) / QMAX        dynamic, per token (or one static scale)
    x_q        = clamp(x / x_scale, QMIN, QMAX)            int8: rounded half to even first

    out[M, N] = (a[M, K] @ b[N, K].T) * a_scale[m] * b_scale[n] (+ bias)   in out_dtype

    a int8,  b int8            -> int32 accumulation (exact), scales applied once at the end
    a fp8,   b fp8 (e4m3fn)    -> fp32 accumulation
    a fp16/bf16, b int8        -> b converted to a's dtype in registers (exact), fp32
                                  accumulation, no a_scale (weight-only W8A16)

a_scale is [M, 1] (per token) or [1] (per tensor) or absent; b_scale is [N, 1] (per channel)
or [1] (per tensor). b is the weight in nn.Linear layout [N, K], read as [BLOCK_K, BLOCK_N] tiles.

For M <= 16 the launcher splits K (split-K): programs store unscaled partial accumulators
[SPLIT_K, M, N] (int32 for int8, else fp32) that are summed and scaled afterwards.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_FLOAT_ACT = (torch.float16, torch.bfloat16, torch.float32)
# quantized activation dtype -> (QMIN, QMAX); E4M3 saturates at +-448
_Q_RANGE = {torch.int8: (-128.0, 127.0), torch.float8_e4m3fn: (-448.0, 448.0)}


@triton.jit
def _round_half_even(y):
    """rint() from floor(): ties go to the even neighbour, as torch.round does."""
    r = tl.floor(y + 0.5)
    tie = (r - y) == 0.5
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(tie & odd, r - 1.0, r)


@triton.jit
def _quant_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    K,
    stride_xm,
    stride_qm,
    STATIC: tl.constexpr,
    QMIN: tl.constexpr,
    QMAX: tl.constexpr,
    ROUND: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0)
    x_row = x_ptr + row * stride_xm
    if STATIC:
        scale = tl.load(scale_ptr)
    else:
        absmax = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            absmax = tl.maximum(absmax, tl.abs(x))
        scale = tl.div_rn(tl.maximum(tl.max(absmax, axis=0), 1e-10), QMAX)
        tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        y = tl.div_rn(x, scale)
        if ROUND:
            y = _round_half_even(y)
        y = tl.minimum(tl.maximum(y, QMIN), QMAX)
        tl.store(q_ptr + row * stride_qm + offs, y.to(q_ptr.dtype.element_ty), mask=offs < K)


def scaled_quant(
    x: torch.Tensor, scale: torch.Tensor | None, q_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_q [M, K] in q_dtype (int8 or float8_e4m3fn), scale fp32 [M, 1], or the
    static scale [1])."""
    if x.dim() != 2 or x.dtype not in _FLOAT_ACT:
        raise ValueError(f"x must be a 2-D float tensor, got {tuple(x.shape)} {x.dtype}")
    qmin, qmax = _Q_RANGE[q_dtype]
    M, K = x.shape
    x = x.contiguous()
    q = torch.empty((M, K), device=x.device, dtype=q_dtype)
    if scale is None:
        out_scale = torch.empty((M, 1), device=x.device, dtype=torch.float32)
    else:
        if scale.numel() != 1:
            raise ValueError("a static activation scale is one number")
        out_scale = scale.to(device=x.device, dtype=torch.float32).reshape(1)
    block_k = min(triton.next_power_of_2(K), 1024 if x.is_cuda else 256)
    meta = dict(STATIC=scale is not None, QMIN=qmin, QMAX=qmax, ROUND=q_dtype == torch.int8)
    _quant_kernel[(M,)](x, q, out_scale, K, x.stride(0), q.stride(0), **meta, BLOCK_K=block_k)
    return q, out_scale


@triton.jit
def _load_zero(ptrs, mask, IS_FLOAT: tl.constexpr):
    """Masked load filling 0 (the fill literal must match the dtype: int 0 won't cast to fp8)."""
    if IS_FLOAT:
        return tl.load(ptrs, mask=mask, other=0.0)
    else:
        return tl.load(ptrs, mask=mask, other=0)


@triton.jit
def _scaled_mm_kernel(
    a_ptr,
    b_ptr,
    a_scale_ptr,
    b_scale_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_om,
    stride_os,
    k_per_split,
    IS_INT: tl.constexpr,
    B_TO_A: tl.constexpr,
    A_SCALE_PER_ROW: tl.constexpr,
    HAS_A_SCALE: tl.constexpr,
    B_SCALE_PER_COL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    if IS_INT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_end
        a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
        b_ptrs = b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None]
        a = _load_zero(a_ptrs, mask_m[:, None] & mask_k[None, :], not IS_INT)  # [BLOCK_M, BLOCK_K]
        b = _load_zero(b_ptrs, mask_k[:, None] & mask_n[None, :], not (IS_INT or B_TO_A))
        if IS_INT:
            acc += tl.dot(a, b, out_dtype=tl.int32)
        elif DOT_F32:
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        elif B_TO_A:
            acc += tl.dot(a, b.to(a.dtype))
        else:
            acc += tl.dot(a, b)

    out_ptrs = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    mask_out = mask_m[:, None] & mask_n[None, :]
    if SPLIT:
        tl.store(out_ptrs, acc, mask=mask_out)
    else:
        res = acc.to(tl.float32)
        if HAS_A_SCALE:
            if A_SCALE_PER_ROW:
                a_s = tl.load(a_scale_ptr + offs_m, mask=mask_m, other=0.0)
                res = res * a_s[:, None]
            else:
                res = res * tl.load(a_scale_ptr)
        if B_SCALE_PER_COL:
            b_s = tl.load(b_scale_ptr + offs_n, mask=mask_n, other=0.0)
            res = res * b_s[None, :]
        else:
            res = res * tl.load(b_scale_ptr)
        if HAS_BIAS:
            res += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptrs, res.to(out_ptr.dtype.element_ty), mask=mask_out)


# Shared with `w4a16`: one tile space, so both kernels split K the same way.
CUDA_CONFIGS = [
    triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
    for bn, bk, w, s in [
        (64, 64, 4, 3),
        (128, 64, 4, 3),
        (64, 128, 4, 4),
        (128, 128, 8, 3),
    ]
]
# Under the interpreter (and as the fixed config): small tiles keep the numpy emulation quick.
FIXED = {"BLOCK_N": 64, "BLOCK_K": 64}
_scaled_mm_kernel_tuned = triton.autotune(
    configs=CUDA_CONFIGS, key=["N", "K", "k_per_split", "BLOCK_M", "IS_INT", "B_TO_A"]
)(_scaled_mm_kernel)


def block_m_for(M: int) -> int:
    """BLOCK_M from M: 16 for decode-sized batches (tl.dot needs >= 16), up to 64."""
    return 16 if M <= 16 else 32 if M <= 32 else 64


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_k_for(M: int, N: int, K: int, device: torch.device) -> int:
    """Programs along K for M <= 16: enough to fill the SMs, at least 2 K tiles of 128 each."""
    if M > 16:
        return 1
    sms = _num_sms(device)
    block_n = 128 if device.type == "cuda" else FIXED["BLOCK_N"]
    tiles = triton.cdiv(N, block_n)
    return max(1, min(triton.cdiv(2 * sms, tiles), triton.cdiv(K, 256), 32))


def k_splits(M: int, N: int, K: int, device: torch.device, split_k: int | None) -> tuple[int, int]:
    """(split_k, k_per_split): None picks split_k from M; each split is a multiple of the largest
    BLOCK_K any config uses (so splits align to every config), and none is empty."""
    gran = 128 if device.type == "cuda" else FIXED["BLOCK_K"]
    if split_k is None:
        split_k = split_k_for(M, N, K, device)
    k_per_split = triton.cdiv(triton.cdiv(K, split_k), gran) * gran
    return triton.cdiv(K, k_per_split), k_per_split


def launch_tiles(kernel, tuned, args: tuple, meta: dict, M: int, N: int, split_k: int) -> None:
    """Run a GEMM kernel over (M / BLOCK_M, N / BLOCK_N, split_k) programs: `tuned` (its
    autotuned form) on CUDA, `kernel` with FIXED tiles elsewhere. args[0] is the activation."""
    block_m = meta["BLOCK_M"]
    if args[0].is_cuda:

        def grid(cfg: dict) -> tuple[int, int, int]:
            return (triton.cdiv(M, block_m), triton.cdiv(N, cfg["BLOCK_N"]), split_k)

        tuned[grid](*args, **meta)
    else:
        grid = (triton.cdiv(M, block_m), triton.cdiv(N, FIXED["BLOCK_N"]), split_k)
        kernel[grid](*args, **meta, **FIXED)


def _scale_vec(scale: torch.Tensor, n: int, what: str) -> torch.Tensor:
    if scale.numel() not in (1, n):
        raise ValueError(f"{what} must have 1 or {n} elements, got shape {tuple(scale.shape)}")
    return scale.reshape(-1).to(torch.float32).contiguous()


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor | None,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """(a [M, K] @ b [N, K].T) * a_scale * b_scale (+ bias) -> [M, N] in out_dtype.

    int8 x int8, fp8 x fp8, or fp16/bf16 x int8 (weight-only; a_scale must be None).
    """
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"need a [M, K] and b [N, K], got {tuple(a.shape)}, {tuple(b.shape)}")
    is_int = a.dtype == torch.int8 and b.dtype == torch.int8
    b_to_a = a.dtype in _FLOAT_ACT and b.dtype == torch.int8
    if not (is_int or b_to_a or (a.dtype in _FP8 and b.dtype == a.dtype)):
        raise TypeError(f"unsupported operand dtypes {a.dtype} x {b.dtype}")
    if b_to_a and a_scale is not None:
        raise ValueError("weight-only (float activations) takes no a_scale")
    M, K = a.shape
    N = b.shape[0]
    a, b = a.contiguous(), b.contiguous()
    b_s = _scale_vec(b_scale, N, "b_scale")
    a_s = _scale_vec(a_scale, M, "a_scale") if a_scale is not None else b_s
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"bias must be [{N}], got {tuple(bias.shape)}")

    split_k, k_per_split = k_splits(M, N, K, a.device, split_k)
    split = split_k > 1
    buf_dtype = (torch.int32 if is_int else torch.float32) if split else out_dtype
    out = torch.empty((split_k, M, N), device=a.device, dtype=buf_dtype)
    args = (a, b, a_s, b_s, bias if bias is not None else b_s, out, M, N, K)
    args += (a.stride(0), b.stride(0), out.stride(1), out.stride(0), k_per_split)
    meta = dict(
        IS_INT=is_int,
        B_TO_A=b_to_a,
        A_SCALE_PER_ROW=a_s.numel() > 1,
        HAS_A_SCALE=a_scale is not None,
        B_SCALE_PER_COL=b_s.numel() > 1,
        HAS_BIAS=bias is not None,
        SPLIT=split,
        DOT_F32=not a.is_cuda or a.dtype == torch.float32,
        BLOCK_M=block_m_for(M),
    )
    launch_tiles(_scaled_mm_kernel, _scaled_mm_kernel_tuned, args, meta, M, N, split_k)
    if not split:
        return out[0]
    res = out.sum(dim=0).to(torch.float32)  # int32 partials sum exactly
    if a_scale is not None:
        res = res * a_s.reshape(-1, 1)
    res = res * b_s.reshape(1, -1)
    if bias is not None:
        res = res + bias.to(torch.float32)
    return res.to(out_dtype)
