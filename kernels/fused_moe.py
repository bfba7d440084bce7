"""Triton fused mixture-of-experts GEMM (vLLM's fused_moe kernel): dense, W4A16 GPTQ and W8A16.

NOT RUN ON A GPU YET: tested under the Triton interpreter (the fp32 dot path) against
`fused_moe_ref`, and its CUDA variants only compiled for sm_90 (tests/kernels/test_cuda_compile).
The model's MoE blocks on CUDA call it through `ops.fused_experts` (`qserve.model.moe_fused`;
tests/kernels/test_moe_fused.py checks the tiny MoE models' logits against the per-expert path).

The token-expert pairs (p = t * top_k + j) are sorted by expert and each expert's run padded to a
multiple of BLOCK_M (`fused_moe_ref.moe_align_block_size`), so a BLOCK_M tile of the sorted list
belongs to one expert. Program (b, n) takes tile b: it gathers the x rows of its pairs (row
p // TOP_K; TOP_K = 1 when x already holds one row per pair, as the down projection's input
does), multiplies them by a [BLOCK_N] column tile of expert expert_ids[b]'s weight, K tile by K
tile, optionally scales by the pair's routing weight and scatters to output row p:

    out[p, n] = sum_k x[p // TOP_K, k] * W[e, n, k]   (* topk_weights.flat[p])   [pairs, N]

Padding entries (the sentinel p = pairs) are masked off. Tiles past num_tokens_post_padded exit
at once, so fixed-size (CUDA-graph) sorted/expert buffers work as well as exact ones.

Weights (layouts in `fused_moe_ref`): dense [E, N, K] loaded as they are; GPTQ codes unpacked and
dequantized inside the K loop as in `w4a16` (one scale/zero row per tile for consecutive groups
when BLOCK_K divides the group size, a gather through g_idx otherwise); W8 (int8 or
float8_e4m3fn) converted in registers, the per-channel scale applied to the fp32 accumulator
once at the end. On CUDA the dot runs on the activation dtype; under the interpreter and for
fp32 activations it runs in fp32 (input_precision="ieee"). Autotuned on CUDA only.

    moe_gemm(x, weight, topk_ids, topk_weights=None)   pairs [T * k, N]  (aligns, then the kernel)
    moe_linear(x, weight, topk_weights, topk_ids)      [T, N], summed over k
    fused_experts(x, w13, w2, topk_weights, topk_ids)  SwiGLU experts: gate_up, silu_and_mul,
                                                       down weighted, summed over k
    invoke_fused_moe_kernel(...)                       one launch over already-aligned pairs
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qserve.kernels.fused_moe_ref import MoEWeight, moe_align_block_size, sum_pairs
from qserve.kernels.model_ops_ref import silu_and_mul_ref
from qserve.kernels.packing import gptq_group_size, pack_factor
from qserve.kernels.scaled_mm import CUDA_CONFIGS, _load_zero, block_m_for, launch_tiles

# W_KIND
DENSE = tl.constexpr(0)
GPTQ = tl.constexpr(1)
W8 = tl.constexpr(2)


@triton.jit
def _gptq_tile(
    qw_ptr,
    qz_ptr,
    s_ptr,
    g_ptr,
    k0,
    K,
    N,
    offs_n,
    mask_n,
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One expert's dequantized GPTQ tile W.T[k0:k0+BLOCK_K, offs_n] in fp32 (0 where masked).
    Pointers are at the expert's qweight [K/P, N], qzeros [G, N/P], scales [G, N], g_idx [K]."""
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    ONE_GROUP: tl.constexpr = (GROUP_SIZE > 0) and (GROUP_SIZE % BLOCK_K == 0)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    mask_kn = mask_k[:, None] & mask_n[None, :]
    j = tl.arange(0, PACK)
    shifts = j * BITS
    # zeros are packed along N: word c holds columns P * c + j
    pid_n = tl.program_id(1)
    offs_nw = pid_n * (BLOCK_N // PACK) + tl.arange(0, BLOCK_N // PACK)
    mask_nw = offs_nw < N // PACK

    offs_kw = k0 // PACK + tl.arange(0, BLOCK_K // PACK)
    words = tl.load(
        qw_ptr + offs_kw[:, None] * N + offs_n[None, :],
        mask=(offs_kw < K // PACK)[:, None] & mask_n[None, :],
        other=0,
    )  # [BLOCK_K / P, BLOCK_N]
    q = (words[:, None, :] >> shifts[None, :, None]) & MASK  # [BK / P, P, BN]
    q = tl.reshape(q, (BLOCK_K, BLOCK_N))
    if ONE_GROUP:
        g = k0 // GROUP_SIZE
        z_words = tl.load(qz_ptr + g * (N // PACK) + offs_nw, mask=mask_nw, other=0)
        z = tl.reshape((z_words[None, :, None] >> shifts[None, None, :]) & MASK, (1, BLOCK_N))
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
        z = tl.reshape((z_words[:, :, None] >> shifts[None, None, :]) & MASK, (BLOCK_K, BLOCK_N))
        s = tl.load(s_ptr + g[:, None] * N + offs_n[None, :], mask=mask_kn, other=0.0)
    w = (q - (z + 1)).to(tl.float32) * s.to(tl.float32)  # GPTQ v1 stores zero - 1
    return tl.where(mask_kn, w, 0.0)


@triton.jit
def _fused_moe_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    qz_ptr,
    g_ptr,
    topk_w_ptr,
    out_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_post_pad_ptr,
    N,
    K,
    num_pairs,
    stride_xm,
    stride_om,
    stride_we,
    stride_se,
    stride_ze,
    TOP_K: tl.constexpr,
    MUL_ROUTED: tl.constexpr,
    W_KIND: tl.constexpr,
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    FLOAT_W: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    num_post_pad = tl.load(num_post_pad_ptr)
    if pid_m * BLOCK_M >= num_post_pad:
        return
    offs_s = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_s, mask=offs_s < num_post_pad, other=num_pairs)
    mask_m = pair < num_pairs
    row = (pair // TOP_K).to(tl.int64)
    e = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    w_base = w_ptr + e * stride_we

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(
            x_ptr + row[:, None] * stride_xm + offs_k[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        if W_KIND == GPTQ:
            w = _gptq_tile(
                w_base,
                qz_ptr + e * stride_ze,
                s_ptr + e * stride_se,
                g_ptr + e * K,
                k0,
                K,
                N,
                offs_n,
                mask_n,
                BITS,
                GROUP_SIZE,
                BLOCK_N,
                BLOCK_K,
            )
        else:  # [N, K] rows, read as a [BLOCK_K, BLOCK_N] tile
            w_ptrs = w_base + offs_n[None, :] * K + offs_k[:, None]
            w = _load_zero(w_ptrs, mask_k[:, None] & mask_n[None, :], FLOAT_W)
        if DOT_F32:
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))

    if W_KIND == W8:
        acc *= tl.load(s_ptr + e * stride_se + offs_n, mask=mask_n, other=0.0)[None, :]
    if MUL_ROUTED:
        acc *= tl.load(topk_w_ptr + pair, mask=mask_m, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + pair.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


_fused_moe_kernel_tuned = triton.autotune(
    configs=CUDA_CONFIGS, key=["N", "K", "BLOCK_M", "W_KIND", "BITS", "GROUP_SIZE", "FLOAT_W"]
)(_fused_moe_kernel)


# ------------------------------------------------------------------------------- launchers

_FLOAT = (torch.float16, torch.bfloat16, torch.float32)
_W8 = (torch.int8, torch.float8_e4m3fn)


def moe_block_m(num_pairs: int, num_experts: int) -> int:
    """BLOCK_M (and the alignment block) from the mean number of pairs per expert: 16 at decode,
    up to 64 for long prompts."""
    return block_m_for(triton.cdiv(num_pairs, max(num_experts, 1)))


def _weight_args(weight: MoEWeight, K: int) -> tuple[tuple, dict]:
    """(w, s, qz, g, stride_we, stride_se, stride_ze), meta for one projection, checked."""
    w = weight.weight.contiguous()
    E, N = weight.num_experts, weight.out_features
    if weight.in_features != K:
        raise ValueError(f"weight has {weight.in_features} input features, x has {K}")
    if weight.kind == "dense":
        if w.dim() != 3 or w.dtype not in _FLOAT:
            raise ValueError(f"dense weight must be float [E, N, K], got {w.dtype} {w.shape}")
        meta = dict(W_KIND=DENSE.value, BITS=8, GROUP_SIZE=0, FLOAT_W=True)
        return (w, w, w, w, N * K, 0, 0), meta
    if weight.kind == "w8":
        if w.dim() != 3 or w.dtype not in _W8:
            raise ValueError(f"w8 weight must be int8/fp8 [E, N, K], got {w.dtype} {w.shape}")
        s = weight.scales.to(torch.float32)
        if s.numel() not in (E, E * N):
            raise ValueError(f"w8 scales must be [E, N] or [E], got {tuple(s.shape)}")
        s = s.reshape(E, -1).expand(E, N).contiguous()
        meta = dict(W_KIND=W8.value, BITS=8, GROUP_SIZE=0, FLOAT_W=w.dtype != torch.int8)
        return (w, s, w, w, N * K, N, 0), meta
    return _gptq_args(weight, w, E, N, K)


def _gptq_args(weight: MoEWeight, qw: torch.Tensor, E: int, N: int, K: int) -> tuple[tuple, dict]:
    per = pack_factor(weight.bits)
    s, qz = weight.scales.contiguous(), weight.qzeros.contiguous()
    G = s.shape[1] if s.dim() == 3 else 0
    if qw.dtype != torch.int32 or qw.shape != (E, K // per, N) or K % per:
        raise ValueError(f"qweight must be int32 [E, K/{per}, N], got {tuple(qw.shape)}")
    if s.shape != (E, G, N) or s.dtype not in _FLOAT:
        raise ValueError(f"scales must be float [{E}, G, {N}], got {s.dtype} {tuple(s.shape)}")
    if qz.dtype != torch.int32 or qz.shape != (E, G, N // per) or N % per:
        raise ValueError(f"qzeros must be int32 [{E}, {G}, {N}/{per}], got {tuple(qz.shape)}")
    if weight.g_idx is None:
        group_size, g = gptq_group_size(K, G), qw
    elif weight.g_idx.shape != (E, K):
        raise ValueError(f"g_idx must be [{E}, {K}], got {tuple(weight.g_idx.shape)}")
    else:
        group_size, g = 0, weight.g_idx.to(torch.int32).contiguous()
    meta = dict(W_KIND=GPTQ.value, BITS=weight.bits, GROUP_SIZE=group_size, FLOAT_W=False)
    return (qw, s, qz, g, K // per * N, G * N, G * N // per), meta


def _check_aligned(sorted_ids: torch.Tensor, expert_ids: torch.Tensor, num_post_pad: torch.Tensor):
    for name, t in ("sorted_token_ids", sorted_ids), ("expert_ids", expert_ids):
        if t.dtype != torch.int32 or t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous int32 [n], got {t.dtype} {t.shape}")
    if num_post_pad.dtype != torch.int32 or num_post_pad.numel() != 1:
        raise ValueError("num_tokens_post_padded must be int32 [1]")


def invoke_fused_moe_kernel(
    x: torch.Tensor,
    weight: MoEWeight,
    sorted_token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor,
    top_k: int,
    block_m: int,
    topk_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """One launch over pairs aligned to block_m (`moe_align_block_size`, or fixed-size buffers
    with sorted_token_ids [>= num_post_padded], expert_ids [>= num_post_padded / block_m]):
    x [R, K] -> out [R * top_k, N] in x's dtype, row p = x[p // top_k] @ W[e_p].T, times
    topk_weights.flat[p] when given. Rows of pairs absent from sorted_token_ids stay unset."""
    if x.dim() != 2 or x.dtype not in _FLOAT:
        raise ValueError(f"x must be float [R, K], got {x.dtype} {tuple(x.shape)}")
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of 2 >= 16, got {block_m}")
    _check_aligned(sorted_token_ids, expert_ids, num_tokens_post_padded)
    R, K = x.shape
    (w, s, qz, g, *strides), meta = _weight_args(weight, K)
    if weight.kind == "dense" and w.dtype != x.dtype:
        raise ValueError(f"dense weight {w.dtype} must match x {x.dtype}")
    num_pairs, N = R * top_k, weight.out_features
    if topk_weights is not None:
        if topk_weights.numel() != num_pairs or not topk_weights.is_floating_point():
            raise ValueError(f"topk_weights must have {num_pairs} float elements")
        topk_weights = topk_weights.reshape(-1).contiguous()
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty((num_pairs, N), device=x.device, dtype=x.dtype)
    if num_pairs == 0 or expert_ids.numel() == 0:
        return out
    tw = topk_weights if topk_weights is not None else s
    args = (x, w, s, qz, g, tw, out, sorted_token_ids, expert_ids, num_tokens_post_padded)
    args += (N, K, num_pairs, x.stride(0), out.stride(0), *strides)
    meta.update(TOP_K=top_k, MUL_ROUTED=topk_weights is not None, BLOCK_M=block_m)
    meta["DOT_F32"] = not x.is_cuda or x.dtype == torch.float32
    rows = expert_ids.numel() * block_m
    launch_tiles(_fused_moe_kernel, _fused_moe_kernel_tuned, args, meta, rows, N, 1)
    return out


def moe_gemm(
    x: torch.Tensor,
    weight: MoEWeight,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor | None = None,
    block_m: int | None = None,
) -> torch.Tensor:
    """x [T, K] -> pairs [T * k, N]: row t * k + j = x[t] @ W[topk_ids[t, j]].T (times
    topk_weights[t, j] when given). Aligns the pairs (one host sync), then one launch."""
    num_pairs = topk_ids.numel()
    block_m = block_m or moe_block_m(num_pairs, weight.num_experts)
    aligned = moe_align_block_size(topk_ids, block_m, weight.num_experts)
    return invoke_fused_moe_kernel(x, weight, *aligned, topk_ids.shape[1], block_m, topk_weights)


def moe_linear(
    x: torch.Tensor, weight: MoEWeight, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """x [T, K] -> [T, N]: out[t] = sum_j topk_weights[t, j] * x[t] @ W[topk_ids[t, j]].T."""
    return sum_pairs(moe_gemm(x, weight, topk_ids, topk_weights), topk_ids.shape[1])


def fused_experts(
    x: torch.Tensor,
    w13: MoEWeight,
    w2: MoEWeight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """SwiGLU experts x [T, H] -> [T, H] (as `fused_moe_ref.fused_experts_ref`): w13 [E, 2I, H]
    gate over up, w2 [E, H, I]. One alignment for both GEMMs; silu_and_mul in torch."""
    T, H = x.shape
    if w13.out_features != 2 * w2.in_features or w2.out_features != H:
        raise ValueError(f"w13 must be [E, 2I, {H}] and w2 [E, {H}, I]")
    if w13.num_experts != w2.num_experts or topk_weights.shape != topk_ids.shape:
        raise ValueError("w13/w2 expert counts or topk_weights/topk_ids shapes differ")
    top_k = topk_ids.shape[1]
    block_m = moe_block_m(topk_ids.numel(), w13.num_experts)
    aligned = moe_align_block_size(topk_ids, block_m, w13.num_experts)
    gate_up = invoke_fused_moe_kernel(x, w13, *aligned, top_k, block_m)  # [T * k, 2I]
    act = silu_and_mul_ref(gate_up)  # [T * k, I]
    pairs = invoke_fused_moe_kernel(act, w2, *aligned, 1, block_m, topk_weights)
    return sum_pairs(pairs, top_k)
