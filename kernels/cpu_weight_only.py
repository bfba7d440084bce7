"""Fast CPU weight-only GEMMs on torch's own int4 / int8 kernels (bf16 activations).

The torch references dequantize the whole weight on every call; on CPU, torch ships packed
weight-only kernels that are ~3x faster than a dense bf16 matmul at decode sizes (ARCHITECTURE.md
section 5).
Convert once at load time, then call per step:

    w = int4pack_from_gptq(qweight, qzeros, scales, g_idx)      # or int4pack_from_awq(...)
    y = int4pack_mm(x, w, bias)                                  # x [..., K] -> [..., N]
    y = int8pack_mm(x, w_q, w_scale, bias)                       # W8A16, w_q int8 [N, K]

torch's int4 kernel computes W[n, k] = (q[k, n] - 8) * scale[g, n] + zero[g, n] with groups of
consecutive input channels, so a zero point z becomes zero' = scale * (8 - z):

    scales_and_zeros [G, N, 2] = stack(scale, scale * (8 - z))

Act-order GPTQ (g_idx a permutation of groups) is handled by sorting the input channels so that
groups are consecutive again: x[:, perm] @ W[:, perm].T == x @ W.T. torch needs N % 16 == 0 and
K % group_size == 0 with group_size in {32, 64, 128, 256}: K is zero-padded up to a multiple of
the group, and per-channel weights use groups of 128 with the scale repeated.

torch 2.13's int8 kernel segfaults on AVX-512 CPUs when x or the weight does not start on a
64-byte boundary (a tensor loaded from safetensors at an odd offset, a row slice): `aligned`
copies such a tensor (torch's allocator aligns to 64 bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qserve.kernels.packing import (
    unpack_awq_qweight,
    unpack_awq_qzeros,
    unpack_gptq_qweight,
    unpack_gptq_qzeros,
)

TORCH_GROUP_SIZES = (32, 64, 128, 256)
ALIGNMENT = 64  # bytes: what torch's CPU allocator gives and its vector kernels assume


def aligned(t: torch.Tensor) -> torch.Tensor:
    """`t` contiguous and starting on an ALIGNMENT-byte boundary (copied only if not)."""
    t = t.contiguous()
    return t if t.data_ptr() % ALIGNMENT == 0 else t.clone()


@dataclass(frozen=True)
class Int4PackedCPU:
    """A 4-bit weight in torch's CPU int4pack layout, ready for `int4pack_mm`."""

    packed: torch.Tensor  # uint8, torch's opaque [N, K_pad / 2] layout
    scales_and_zeros: torch.Tensor  # [G, N, 2] in the activation dtype
    group_size: int
    in_features: int  # K before padding
    perm: torch.Tensor | None  # act-order: input channel order, applied to x

    @property
    def padded_in_features(self) -> int:
        return self.scales_and_zeros.shape[0] * self.group_size


def _pack(
    q: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    perm: torch.Tensor | None,
    dtype: torch.dtype,
) -> Int4PackedCPU:
    """q [K, N] in [0, 15] with groups of `group_size` consecutive rows; scales/zeros [G, N]."""
    K, N = q.shape
    if N % 16:
        raise ValueError(f"torch's int4 CPU kernel needs out_features % 16 == 0, got {N}")
    if scales.shape[0] == 1 and group_size >= K:  # per channel: repeat over groups of 128
        group_size = 128
        G = -(-K // group_size)
        scales, zeros = scales.expand(G, N), zeros.expand(G, N)
    if group_size not in TORCH_GROUP_SIZES:
        raise ValueError(f"group_size must be one of {TORCH_GROUP_SIZES}, got {group_size}")
    G = scales.shape[0]
    k_pad = G * group_size
    if k_pad < K:
        raise ValueError(f"{G} groups of {group_size} do not cover {K} input channels")
    q = F.pad(q.to(torch.int32), (0, 0, 0, k_pad - K), value=8)  # padded rows meet x = 0
    packed = torch._convert_weight_to_int4pack_for_cpu(q.t().contiguous(), 1)
    s = scales.to(torch.float32)
    sz = torch.stack([s, s * (8 - zeros.to(torch.float32))], dim=-1).to(dtype).contiguous()
    return Int4PackedCPU(packed, sz, group_size, K, perm)


def int4pack_from_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
    bits: int = 4,
) -> Int4PackedCPU:
    """4-bit (or 3-bit: its codes are 4-bit codes too) GPTQ tensors (see `packing`) -> torch
    int4pack. Raises ValueError if unsupported."""
    if bits not in (3, 4):
        raise ValueError(f"torch's int4 kernel takes 3- and 4-bit codes, got {bits}-bit")
    q = unpack_gptq_qweight(qweight, bits)  # [K, N]
    zeros = unpack_gptq_qzeros(qzeros, bits)  # [G, N], 1 added back
    K = q.shape[0]
    g_idx = g_idx.to(torch.long)
    group_size = int(torch.bincount(g_idx).max())
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], torch.arange(K) // group_size):
        raise ValueError("g_idx does not form groups of equal size")
    if torch.equal(perm, torch.arange(K)):
        perm = None
    else:
        q = q[perm]
    return _pack(q, scales, zeros, group_size, perm, dtype)


def int4pack_from_awq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    dtype: torch.dtype = torch.bfloat16,
) -> Int4PackedCPU:
    """AWQ tensors (see `packing`) -> torch int4pack. Raises ValueError if unsupported."""
    q = unpack_awq_qweight(qweight)  # [K, N]
    gs = q.shape[0] if group_size == -1 else group_size
    return _pack(q, scales, unpack_awq_qzeros(qzeros), gs, None, dtype)


def int4pack_mm(
    x: torch.Tensor, w: Int4PackedCPU, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] @ W.T -> [..., N] in x's dtype (computed in the packed weight's dtype)."""
    lead, K = x.shape[:-1], x.shape[-1]
    if K != w.in_features:
        raise ValueError(f"x has {K} input features, the weight {w.in_features}")
    x2 = x.reshape(-1, K).to(w.scales_and_zeros.dtype)
    if w.perm is not None:
        x2 = x2[:, w.perm]
    if w.padded_in_features > K:
        x2 = F.pad(x2, (0, w.padded_in_features - K))
    out = torch._weight_int4pack_mm_for_cpu(
        x2.contiguous(), w.packed, w.group_size, w.scales_and_zeros
    )
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out.to(x.dtype).reshape(*lead, -1)


def int8pack_mm(
    x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Weight-only int8: x [..., K] @ (w_q [N, K] * w_scale [N, 1] or [1]).T -> [..., N]."""
    N, K = w_q.shape
    scale = w_scale.reshape(-1).to(x.dtype).expand(N).contiguous()
    out = torch._weight_int8pack_mm(aligned(x.reshape(-1, K)), aligned(w_q), scale)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out.reshape(*x.shape[:-1], N)
