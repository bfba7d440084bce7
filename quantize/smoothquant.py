"""SmoothQuant (Xiao et al., 2022) and symmetric INT8 weights for W8A8.

    s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)         per input channel j

where max|W_j| is over every linear fed by X (q/k/v share one s). X / s is easier to quantize per
token, W * s per output channel; the norm before absorbs 1/s (qserve.quantize.fold.apply_scales).
Weights: int8 [N, K] with a per-output-channel scale [N, 1] = max|w_n| / 127; activations are
quantized dynamically per token at run time (or statically with an `input_scale`).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "activation_absmax",
    "smooth_scales",
    "quantize_int8",
    "dequantize_int8",
    "int8_input_scale",
]


def activation_absmax(X: Tensor) -> Tensor:
    """max |x| per input channel of X [..., K] -> [K]."""
    return X.reshape(-1, X.shape[-1]).abs().amax(dim=0).float()


def smooth_scales(x_absmax: Tensor, Ws: list[Tensor], alpha: float = 0.5) -> Tensor:
    """s [K] from the calibration max |X_j| [K] and the linears Ws ([N_i, K]) that read X."""
    w_absmax = torch.cat([w.abs().float() for w in Ws], dim=0).amax(dim=0)
    s = x_absmax.clamp(min=1e-5).pow(alpha) / w_absmax.clamp(min=1e-5).pow(1 - alpha)
    return s.clamp(min=1e-5)


def quantize_int8(W: Tensor, strategy: str = "channel") -> tuple[Tensor, Tensor]:
    """Symmetric int8: (Q int8 [N, K], scale fp32 [N, 1] for "channel" or [1] for "tensor")."""
    W = W.float()
    if strategy == "channel":
        scale = W.abs().amax(dim=1, keepdim=True) / 127
    elif strategy == "tensor":
        scale = W.abs().amax().reshape(1) / 127
    else:
        raise ValueError(f"strategy must be 'channel' or 'tensor', got {strategy!r}")
    scale = scale.clamp(min=1e-12)
    Q = torch.clamp(torch.round(W / scale), -128, 127).to(torch.int8)
    return Q, scale


def dequantize_int8(Q: Tensor, scale: Tensor) -> Tensor:
    """W [N, K] fp32 = Q * scale."""
    return Q.float() * scale.float()


def int8_input_scale(x_absmax: Tensor) -> Tensor:
    """Static per-tensor activation scale [1] from the calibration max |x|."""
    return (x_absmax.float().max() / 127).clamp(min=1e-12).reshape(1)
