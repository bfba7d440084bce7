"""Triton W4A16 GEMM for the GPTQ (4 and 8 bit, act-order g_idx) and AWQ layouts.

    out[M, N] = x[M, K] @ W[N, K].T (+ bias),  W dequantized tile by tile inside the K loop

Each K tile loads only its packed words ([BLOCK_K / P, BLOCK_N] for GPTQ, [BLOCK_K, BLOCK_N / 8]
for AWQ) and unpacks them in registers; the full-precision weight never reaches memory. With
consecutive groups (AWQ; GPTQ without act-order) and BLOCK_K dividing the group size, scales and
zeros are one row per tile; act-order gathers them per input channel through g_idx.
Layouts (see `packing` for the diagrams):

    GPTQ  qweight [K/P, N]   q[k, n] = qweight[k // P, n] >> (BITS * (k % P)) & MASK
          qzeros  [G, N/P]   z[g, n] = (qzeros[g, n // P] >> (BITS * (n % P)) & MASK) + 1
          g = g_idx[k], or k // group_size without act-order  (P = 32 // BITS)
    AWQ   qweight [K, N/8]   q[k, n] = qweight[k, n // 8] >> (4 * REV[n % 8]) & 0xF
          qzeros  [G, N/8]   z[g, n] likewise, no +1;  g = k // group_size
          REV = [0, 4, 1, 5, 2, 6, 3, 7]  i.e.  REV[j] = j // 2 + 4 * (j % 2)

    W[n, k] = scales[g, n] * (q[k, n] - z[g, n])

Accumulation is fp32. For M <= 16 (decode) the launcher splits K over programs (split-K): each
writes an fp32 partial [SPLIT_K, M, N] that is summed afterwards (deterministic, no atomics).
On CUDA the dot runs on fp16/bf16 operands; under the Triton interpreter (bf16 arithmetic is
wrong there) and for fp32 activations it runs in fp32 with input_precision="ieee" (no tf32).
Autotuning is used on CUDA only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qserve.kernels.packing import gptq_group_size, pack_factor
from qserve.kernels.scaled_mm import CUDA_CONFIGS, block_m_for, k_splits, launch_tiles


@triton.jit
def _unpack_cols(words, shifts, MASK: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Words packed along N, [ROWS, COLS / P] -> values [ROWS, COLS]; field shifts[j] holds
    column P * c + j of word c."""
    vals = (words[:, :, None] >> shifts[None, None, :]) & MASK  # [ROWS, COLS / P, P]
    return tl.reshape(vals, (ROWS, COLS))


@triton.jit
def _w4a16_kernel(
    x_ptr,
    qw_ptr,
    qz_ptr,
    s_ptr,
    g_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    stride_os,
    k_per_split,
    AWQ: tl.constexpr,
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    # one group per K tile: scales and zeros are one row per tile instead of a gather per k
    ONE_GROUP: tl.constexpr = (GROUP_SIZE > 0) and (GROUP_SIZE % BLOCK_K == 0)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    # words packed along N (AWQ qweight, both formats' qzeros): [BLOCK_N / PACK] per row
    offs_nw = pid_n * (BLOCK_N // PACK) + tl.arange(0, BLOCK_N // PACK)
    mask_nw = offs_nw < N // PACK
    j = tl.arange(0, PACK)
    if AWQ:
        n_shift = (j // 2 + (j % 2) * 4) * 4  # nibble of channel 8c + j
    else:
        n_shift = j * BITS

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_end
        mask_kn = mask_k[:, None] & mask_n[None, :]
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        if AWQ:
            words = tl.load(
                qw_ptr + offs_k[:, None] * (N // 8) + offs_nw[None, :],
                mask=mask_k[:, None] & mask_nw[None, :],
                other=0,
            )  # [BLOCK_K, BLOCK_N / 8]
            q = _unpack_cols(words, n_shift, MASK, BLOCK_K, BLOCK_N)
        else:
            offs_kw = k0 // PACK + tl.arange(0, BLOCK_K // PACK)
            words = tl.load(
                qw_ptr + offs_kw[:, None] * N + offs_n[None, :],
                mask=(offs_kw < k_end // PACK)[:, None] & mask_n[None, :],
                other=0,
            )  # [BLOCK_K / PACK, BLOCK_N]
            q = (words[:, None, :] >> (j * BITS)[None, :, None]) & MASK  # [BK / P, P, BN]
            q = tl.reshape(q, (BLOCK_K, BLOCK_N))
        if ONE_GROUP:
            g = k0 // GROUP_SIZE
            z_words = tl.load(qz_ptr + g * (N // PACK) + offs_nw, mask=mask_nw, other=0)
            z = _unpack_cols(z_words[None, :], n_shift, MASK, 1, BLOCK_N)  # [1, BLOCK_N]
            s = tl.load(s_ptr + g * N + offs_n, mask=mask_n, other=0.0)[None, :]
        else:
            if GROUP_SIZE > 0:
                g = offs_k // GROUP_SIZE
            else:
                g = tl.load(g_ptr + offs_k, mask=mask_k, other=0)  # act-order g_idx
            z_words = tl.load(
                qz_ptr + g[:, None] * (N // PACK) + offs_nw[None, :],
                mask=mask_k[:, None] & mask_nw[None, :],
                other=0,
            )
            z = _unpack_cols(z_words, n_shift, MASK, BLOCK_K, BLOCK_N)
            s = tl.load(s_ptr + g[:, None] * N + offs_n[None, :], mask=mask_kn, other=0.0)
        if not AWQ:
            z = z + 1  # GPTQ v1 stores zero - 1
        w = (q - z).to(tl.float32) * s.to(tl.float32)  # [BLOCK_K, BLOCK_N]
        w = tl.where(mask_kn, w, 0.0)
        if DOT_F32:
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))

    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


_w4a16_kernel_tuned = triton.autotune(
    configs=CUDA_CONFIGS, key=["N", "K", "k_per_split", "BLOCK_M", "AWQ", "BITS", "GROUP_SIZE"]
)(_w4a16_kernel)


def _launch(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    group_size: int,  # 0: groups from g_idx (act-order)
    bias: torch.Tensor | None,
    N: int,
    awq: bool,
    bits: int,
    split_k: int | None,
) -> torch.Tensor:
    M, K = x.shape
    x = x.contiguous()
    split_k, k_per_split = k_splits(M, N, K, x.device, split_k)
    if split_k == 1:
        out = torch.empty((1, M, N), device=x.device, dtype=x.dtype)
    else:
        out = torch.empty((split_k, M, N), device=x.device, dtype=torch.float32)
    args = (
        x,
        qweight,
        qzeros,
        scales,
        g_idx if g_idx is not None else qzeros,  # unused by the AWQ branch
        bias if bias is not None else scales,  # unused without HAS_BIAS
        out,
        M,
        N,
        K,
        x.stride(0),
        out.stride(1),
        out.stride(0),
        k_per_split,
    )
    meta = dict(
        AWQ=awq,
        BITS=bits,
        GROUP_SIZE=group_size,
        HAS_BIAS=bias is not None and split_k == 1,
        DOT_F32=not x.is_cuda or x.dtype == torch.float32,
        BLOCK_M=block_m_for(M),
    )
    launch_tiles(_w4a16_kernel, _w4a16_kernel_tuned, args, meta, M, N, split_k)
    if split_k == 1:
        return out[0]
    res = out.sum(dim=0)
    if bias is not None:
        res += bias.to(torch.float32)
    return res.to(x.dtype)


def _check_common(x: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K], got {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"x must be fp16/bf16/fp32, got {x.dtype}")
    if not scales.is_contiguous():
        raise ValueError("scales must be contiguous")
    if bias is not None and bias.shape != (scales.shape[1],):
        raise ValueError(f"bias must be [N], got {tuple(bias.shape)}")


def gptq_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    bits: int = 4,
    bias: torch.Tensor | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """x [M, K] @ GPTQ weight (qweight [K*bits/32, N], qzeros [G, N*bits/32], scales [G, N],
    g_idx [K]) -> [M, N] in x's dtype. split_k None picks it from M (split-K for M <= 16).

    g_idx None means consecutive groups (no act-order; see `packing.gptq_group_size`): the
    kernel then loads one scale/zero row per K tile instead of a gather per input channel.
    """
    per = pack_factor(bits)
    _check_common(x, scales, bias)
    M, K = x.shape
    G, N = scales.shape
    if qweight.dtype != torch.int32 or qweight.shape != (K // per, N) or K % per:
        raise ValueError(f"qweight must be int32 [{K}/{per}, {N}], got {tuple(qweight.shape)}")
    if qzeros.dtype != torch.int32 or qzeros.shape != (G, N // per) or N % per:
        raise ValueError(f"qzeros must be int32 [{G}, {N}/{per}], got {tuple(qzeros.shape)}")
    if g_idx is None:
        group_size = gptq_group_size(K, G)
    elif g_idx.shape != (K,):
        raise ValueError(f"g_idx must be [{K}], got {tuple(g_idx.shape)}")
    else:
        group_size, g_idx = 0, g_idx.to(torch.int32).contiguous()
    return _launch(
        x,
        qweight.contiguous(),
        qzeros.contiguous(),
        scales,
        g_idx,
        group_size,
        bias,
        N,
        False,
        bits,
        split_k,
    )


def awq_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """x [M, K] @ AWQ weight (qweight [K, N/8], qzeros [G, N/8], scales [G, N]) -> [M, N]."""
    _check_common(x, scales, bias)
    M, K = x.shape
    G, N = scales.shape
    gs = K if group_size == -1 else group_size
    if qweight.dtype != torch.int32 or qweight.shape != (K, N // 8) or N % 8:
        raise ValueError(f"qweight must be int32 [{K}, {N}/8], got {tuple(qweight.shape)}")
    if qzeros.dtype != torch.int32 or qzeros.shape != (G, N // 8) or G != triton.cdiv(K, gs):
        raise ValueError(f"qzeros must be int32 [ceil({K}/{gs}), {N}/8], got {qzeros.shape}")
    return _launch(
        x, qweight.contiguous(), qzeros.contiguous(), scales, None, gs, bias, N, True, 4, split_k
    )
