"""Pure-torch references for int8: dynamic per-token activation quantization, W8A8, W8A16.

Symmetric int8 (compressed-tensors "int-quantized", SmoothQuant):

    x_scale[m] = max(max_k |x[m, k]|, 1e-10) / 127             (dynamic, per token)
    x_q[m, k]  = clamp(round_half_even(x[m, k] / x_scale), -128, 127)
    out[m, n]  = (sum_k x_q[m, k] * w_q[n, k]  as int32) * x_scale[m] * w_scale[n]  (+ bias)

A static activation scale is one number ([1]); a weight scale is [N, 1] (per channel) or [1]
(per tensor). Scales are fp32. The scale and output helpers here serve `fp8_ref` and `w4a16_ref`
too.
"""

from __future__ import annotations

import torch

INT8_MAX = 127
INT8_MIN = -128
MIN_ABSMAX = 1e-10


def per_token_scale(x: torch.Tensor, qmax: float) -> torch.Tensor:
    """Dynamic per-token scale fp32 [M, 1] = max(|x| row max, MIN_ABSMAX) / qmax."""
    absmax = x.to(torch.float32).abs().amax(dim=-1, keepdim=True)
    return absmax.clamp(min=MIN_ABSMAX) / qmax


def scaled_int8_quant_ref(
    x: torch.Tensor, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_q int8 [M, K], scale fp32). Per-token dynamic when scale is None."""
    if scale is None:
        scale = per_token_scale(x, INT8_MAX)  # [M, 1]
    scale = scale.to(torch.float32)
    q = torch.round(x.to(torch.float32) / scale).clamp(INT8_MIN, INT8_MAX)
    return q.to(torch.int8), scale


def col_scale(w_scale: torch.Tensor) -> torch.Tensor:
    """Weight scale [N, 1], [N] or [1] -> row vector [1, N] (or [1, 1])."""
    return w_scale.to(torch.float32).reshape(1, -1)


def row_scale(x_scale: torch.Tensor) -> torch.Tensor:
    """Activation scale [M, 1], [M] or [1] -> column [M, 1] (or [1, 1])."""
    return x_scale.to(torch.float32).reshape(-1, 1)


def scaled_output(
    acc: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """acc [M, N] (int32 or fp32) * x_scale[m] * w_scale[n] (+ bias), in fp32 -> out_dtype."""
    out = acc.to(torch.float32) * row_scale(x_scale) * col_scale(w_scale)
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(out_dtype)


def linear_fp32(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ w [N, K].T (+ bias) in fp32 -> [M, N] in x's dtype."""
    out = x.to(torch.float32) @ w.to(torch.float32).t()
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(x.dtype)


def int8_scaled_mm_ref(
    x_q: torch.Tensor,
    w_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """int8 x_q [M, K] x int8 w_q [N, K] -> [M, N] in out_dtype, int32 accumulation."""
    acc = x_q.to(torch.int32) @ w_q.to(torch.int32).t()  # [M, N] int32, exact
    return scaled_output(acc, x_scale, w_scale, out_dtype, bias)


def w8a8_int8_linear_ref(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    input_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Quantize x (dynamic per token, or static with input_scale), then int8_scaled_mm."""
    x_q, x_scale = scaled_int8_quant_ref(x, input_scale)
    return int8_scaled_mm_ref(x_q, w_q, x_scale, w_scale, x.dtype, bias)


def w8a16_gemm_ref(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Weight-only int8: x [M, K] (fp16/bf16) @ (w_q [N, K] * w_scale).T -> [M, N] in x's dtype."""
    w = w_q.to(torch.float32) * w_scale.to(torch.float32).reshape(-1, 1)  # [N, K]
    return linear_fp32(x, w, bias)
