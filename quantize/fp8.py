"""FP8 E4M3 weights (and static activation scales) for FP8 W8A8.

    scale = max|w| / 448            per output channel ([N, 1]) or per tensor ([1])
    Q     = clamp(W / scale, -448, 448) cast to float8_e4m3fn          [N, K]
    W    ~= Q * scale

Activations: dynamic per token at run time, or static per tensor: input_scale = max|x| / 448
over the calibration data.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["FP8_MAX", "quantize_fp8", "dequantize_fp8", "fp8_input_scale"]

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448.0


def quantize_fp8(W: Tensor, strategy: str = "channel") -> tuple[Tensor, Tensor]:
    """(Q float8_e4m3fn [N, K], scale fp32 [N, 1] for "channel" or [1] for "tensor")."""
    W = W.float()
    if strategy == "channel":
        scale = W.abs().amax(dim=1, keepdim=True) / FP8_MAX
    elif strategy == "tensor":
        scale = W.abs().amax().reshape(1) / FP8_MAX
    else:
        raise ValueError(f"strategy must be 'channel' or 'tensor', got {strategy!r}")
    scale = scale.clamp(min=1e-12)
    Q = torch.clamp(W / scale, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return Q, scale


def dequantize_fp8(Q: Tensor, scale: Tensor) -> Tensor:
    """W [N, K] fp32 = Q * scale."""
    return Q.float() * scale.float()


def fp8_input_scale(x_absmax: Tensor) -> Tensor:
    """Static per-tensor activation scale [1] from the calibration max |x|."""
    return (x_absmax.float().max() / FP8_MAX).clamp(min=1e-12).reshape(1)
