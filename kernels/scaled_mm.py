"""Triton scaled GEMM shared by W8A8 int8, W8A8 FP8 and weight-only W8A16.

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


_CUDA_CONFIGS = [
    triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
    for bn, bk, w, s in [
        (64, 64, 4, 3),
        (128, 64, 4, 3),
        (64, 128, 4, 4),
        (128, 128, 8, 3),
    ]
]
_scaled_mm_kernel_tuned = triton.autotune(
    configs=_CUDA_CONFIGS, key=["N", "K", "k_per_split", "BLOCK_M", "IS_INT", "B_TO_A"]
)(_scaled_mm_kernel)
_FIXED = {"BLOCK_N": 64, "BLOCK_K": 64}


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
    block_n = 128 if device.type == "cuda" else _FIXED["BLOCK_N"]
    tiles = triton.cdiv(N, block_n)
    return max(1, min(triton.cdiv(2 * sms, tiles), triton.cdiv(K, 256), 32))


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

    block_m = block_m_for(M)
    gran = 128 if a.is_cuda else _FIXED["BLOCK_K"]
    if split_k is None:
        split_k = split_k_for(M, N, K, a.device)
    k_per_split = triton.cdiv(triton.cdiv(K, split_k), gran) * gran
    split_k = triton.cdiv(K, k_per_split)
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
        BLOCK_M=block_m,
    )
    if a.is_cuda:

        def grid(meta: dict) -> tuple[int, int, int]:
            return (triton.cdiv(M, block_m), triton.cdiv(N, meta["BLOCK_N"]), split_k)

        _scaled_mm_kernel_tuned[grid](*args, **meta)
    else:
        grid = (triton.cdiv(M, block_m), triton.cdiv(N, _FIXED["BLOCK_N"]), split_k)
        _scaled_mm_kernel[grid](*args, **meta, **_FIXED)
    if not split:
        return out[0]
    res = out.sum(dim=0).to(torch.float32)  # int32 partials sum exactly
    if a_scale is not None:
        res = res * a_s.reshape(-1, 1)
    res = res * b_s.reshape(1, -1)
    if bias is not None:
        res = res + bias.to(torch.float32)
    return res.to(out_dtype)
