"""Pure-torch references for FP8 W8A8 (float8_e4m3fn weights and activations).

    x_scale   = max(max_k |x[m, k]|, 1e-10) / 448   per token (dynamic), or a static scale [1]
    x_q       = clamp(x / x_scale, -448, 448) -> float8_e4m3fn        (E4M3 saturates at 448)
    out[m, n] = (sum_k x_q[m, k] * w_q[n, k] in fp32) * x_scale[m] * w_scale[n]  (+ bias)

Weight scale is [N, 1] (per channel) or [1] (per tensor); all scales fp32.
"""

from __future__ import annotations

import torch

from qserve.kernels.int8_ref import per_token_scale, scaled_output

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


def scaled_fp8_quant_ref(
    x: torch.Tensor, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_q float8_e4m3fn [M, K], scale fp32). Per-token dynamic when scale is None."""
    if scale is None:
        scale = per_token_scale(x, FP8_MAX)  # [M, 1]
    scale = scale.to(torch.float32)
    q = (x.to(torch.float32) / scale).clamp(-FP8_MAX, FP8_MAX)
    return q.to(FP8_DTYPE), scale


def quantize_weight_fp8_ref(
    w: torch.Tensor, per_channel: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (w_q float8_e4m3fn [N, K], w_scale fp32 [N, 1] or [1])."""
    if per_channel:
        return scaled_fp8_quant_ref(w)
    scale = (w.to(torch.float32).abs().max().clamp(min=1e-10) / FP8_MAX).reshape(1)
    return scaled_fp8_quant_ref(w, scale)


def fp8_scaled_mm_ref(
    x_q: torch.Tensor,
    w_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp8 x_q [M, K] x fp8 w_q [N, K] -> [M, N] in out_dtype, fp32 accumulation."""
    acc = x_q.to(torch.float32) @ w_q.to(torch.float32).t()  # [M, N]
    return scaled_output(acc, x_scale, w_scale, out_dtype, bias)


def w8a8_fp8_linear_ref(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    input_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Quantize x to FP8 (dynamic per token, or static with input_scale), then fp8_scaled_mm."""
    x_q, x_scale = scaled_fp8_quant_ref(x, input_scale)
    return fp8_scaled_mm_ref(x_q, w_q, x_scale, w_scale, x.dtype, bias)
