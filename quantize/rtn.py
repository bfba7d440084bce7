"""Round-to-nearest (RTN) quantization per group: the integer grid every other method shares.

Conventions (K = in_features, N = out_features, G = ceil(K / group_size); group_size -1 = one
group of K columns, i.e. per output channel). Weights are in nn.Linear layout W [N, K].

    Q       int32 [N, K]   codes in [0, 2**bits - 1]
    scales  fp32  [G, N]
    zeros   int32 [G, N]   integer zero points in [0, 2**bits - 1] (sym: always 2**(bits-1))
    g_idx   int32 [K]      group of each ORIGINAL input channel (GPTQ meaning)

    W[n, k] ~= scales[g_idx[k], n] * (Q[n, k] - zeros[g_idx[k], n])

Symmetric: scale = 2 * max|w| / (2**bits - 1), zero = 2**(bits-1) (the GPTQ convention, so a
symmetric 4-bit qzeros word is 0x77777777 on disk). Asymmetric: the range [min(w, 0), max(w, 0)]
is split into 2**bits - 1 steps, zero = round(-min / scale).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "QuantizedWeight",
    "compute_qparams",
    "search_qparams",
    "quantize_codes",
    "fake_quantize",
    "rtn_quantize",
    "num_groups",
]


@dataclass(frozen=True)
class QuantizedWeight:
    """Integer codes plus per-group affine parameters (shapes in the module docstring)."""

    Q: Tensor
    scales: Tensor
    zeros: Tensor
    g_idx: Tensor
    bits: int
    group_size: int
    sym: bool

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.Q.shape)  # type: ignore[return-value]

    def dequantize(self) -> Tensor:
        """W [N, K] fp32."""
        g = self.g_idx.long()
        s = self.scales[g].t()  # [N, K]
        z = self.zeros[g].t()
        return s * (self.Q - z).float()


def num_groups(K: int, group_size: int) -> int:
    gs = K if group_size == -1 else group_size
    return -(-K // gs)


def compute_qparams(W: Tensor, bits: int, sym: bool, min_zero: int = 0) -> tuple[Tensor, Tensor]:
    """Scale and zero [N] for the rows of W [N, k] (one group). Zero is integer-valued float.

    `min_zero=1` keeps asymmetric zeros representable in the GPTQ v1 format (stored as zero - 1).
    """
    maxq = 2**bits - 1
    W = W.float()
    xmin = W.min(dim=1).values.clamp(max=0)
    xmax = W.max(dim=1).values.clamp(min=0)
    if sym:
        xmax = torch.maximum(xmin.abs(), xmax)
        xmin = -xmax
    dead = (xmin == 0) & (xmax == 0)
    xmin = torch.where(dead, -1.0, xmin)
    xmax = torch.where(dead, 1.0, xmax)
    scale = (xmax - xmin) / maxq
    if sym:
        zero = torch.full_like(scale, (maxq + 1) // 2)
    else:
        zero = torch.round(-xmin / scale).clamp(min_zero, maxq)
    return scale, zero


SEARCH_ELEMENTS = 1 << 22  # weights x factors per step of search_qparams (16 MiB of fp32)


def search_qparams(
    W: Tensor,
    bits: int,
    sym: bool,
    min_zero: int = 0,
    grid: int = 100,
    max_shrink: float = 0.8,
    norm: float = 2.4,
) -> tuple[Tensor, Tensor]:
    """compute_qparams with the range of each row shrunk to the factor p in
    {1, 1 - 1/grid, ..., 1 - max_shrink} that minimises sum |q(w) - w|^norm (the MSE grid search
    of GPTQ's reference quantizer): clipping a few large weights buys a finer grid for the rest.
    The factors are tried SEARCH_ELEMENTS at a time, the first best kept (as a loop over p
    with a strict improvement would)."""
    W = W.float()
    best_scale, best_zero = compute_qparams(W, bits, sym, min_zero)
    best = torch.full((W.shape[0],), float("inf"), device=W.device)
    lo, hi = W.min(dim=1).values.clamp(max=0), W.max(dim=1).values.clamp(min=0)
    shrink = [1 - i / grid for i in range(int(max_shrink * grid))]
    chunk = max(1, SEARCH_ELEMENTS // max(W.numel(), 1))
    rows = torch.arange(W.shape[0], device=W.device)
    for start in range(0, len(shrink), chunk):
        p = torch.tensor(shrink[start : start + chunk], device=W.device)[:, None]  # [P, 1] fp32
        scale, zero = compute_qparams(torch.stack([p * lo, p * hi], dim=2).flatten(0, 1), bits,
                                      sym, min_zero)  # fmt: skip
        scale, zero = scale.view(len(p), -1, 1), zero.view(len(p), -1, 1)
        codes = quantize_codes(W.expand(len(p), -1, -1), scale, zero, bits)  # [P, N, k]
        err, i = (scale * (codes - zero) - W).abs().pow(norm).sum(dim=2).min(dim=0)
        better = err < best
        best = torch.where(better, err, best)
        best_scale = torch.where(better, scale[i, rows, 0], best_scale)
        best_zero = torch.where(better, zero[i, rows, 0], best_zero)
    return best_scale, best_zero


def quantize_codes(w: Tensor, scale: Tensor, zero: Tensor, bits: int) -> Tensor:
    """Codes of w [N, k] (or [N]) with per-row scale/zero [N]: clamp(round(w / s) + z)."""
    if w.dim() == 2:
        scale, zero = scale[:, None], zero[:, None]
    return torch.clamp(torch.round(w / scale) + zero, 0, 2**bits - 1)


def fake_quantize(W: Tensor, bits: int, group_size: int, sym: bool) -> Tensor:
    """RTN quantize-dequantize of W [N, K]: the pseudo-quantization AWQ's searches use."""
    return rtn_quantize(W, bits, group_size, sym).dequantize()


def rtn_quantize(
    W: Tensor, bits: int = 4, group_size: int = 128, sym: bool = True, min_zero: int = 0
) -> QuantizedWeight:
    """Round every group of `group_size` input columns of W [N, K] to the nearest grid point."""
    if bits not in (2, 3, 4, 8):
        raise ValueError(f"bits must be 2, 3, 4 or 8, got {bits}")
    W = W.float()
    N, K = W.shape
    gs = K if group_size == -1 else group_size
    G = num_groups(K, group_size)
    Q = torch.empty(N, K, dtype=torch.int32, device=W.device)
    scales = torch.empty(G, N, device=W.device)
    zeros = torch.empty(G, N, dtype=torch.int32, device=W.device)
    for g in range(G):
        cols = slice(g * gs, min((g + 1) * gs, K))
        scale, zero = compute_qparams(W[:, cols], bits, sym, min_zero)
        Q[:, cols] = quantize_codes(W[:, cols], scale, zero, bits).to(torch.int32)
        scales[g], zeros[g] = scale, zero.to(torch.int32)
    g_idx = torch.arange(K, dtype=torch.int32, device=W.device) // gs
    return QuantizedWeight(Q, scales, zeros, g_idx, bits, group_size, sym)
