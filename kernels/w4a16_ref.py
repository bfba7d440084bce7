"""Pure-torch references for the W4A16 GEMMs (GPTQ and AWQ layouts; GPTQ also at 8 bit).

Dequantize the packed weight to W [N, K] (see `packing` for the layouts), then multiply in fp32:

    out[M, N] = x[M, K] @ W[N, K].T (+ bias)        output in x's dtype
"""

from __future__ import annotations

import torch

from qserve.kernels.int8_ref import linear_fp32
from qserve.kernels.packing import dequantize_awq, dequantize_gptq


def gptq_gemm_ref(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    bits: int = 4,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ dequantized GPTQ weight -> [M, N]. g_idx may be an act-order permutation,
    or None for consecutive groups."""
    w = dequantize_gptq(qweight, qzeros, scales, g_idx, bits)  # [N, K]
    return linear_fp32(x, w, bias)


def awq_gemm_ref(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ dequantized AWQ weight -> [M, N]."""
    w = dequantize_awq(qweight, qzeros, scales, group_size)  # [N, K]
    return linear_fp32(x, w, bias)


def quantize_activations_ref(x: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    """x [M, K] rounded as the CPU W4 loop rounds 16-bit activations (`cpu_w4a16.
    int8_activations`), returned in fp32: per row and group (g_idx [K], each channel's group),
    round(x * (127 / max |x|)) * (max |x| / 127), all-zero groups staying zero."""
    x = x.float()
    M, K = x.shape
    index = g_idx.long().expand(M, K)
    amax = torch.zeros(M, int(g_idx.max()) + 1).scatter_reduce(1, index, x.abs(), "amax")
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    xi = torch.round(x * inv.gather(1, index))
    return xi * (amax / 127.0).gather(1, index)
