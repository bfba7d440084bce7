"""Triton FP8 W8A8 ops: activation quantization to float8_e4m3fn and the scaled GEMM.

Definitions in `fp8_ref`:

    x_scale[m] = max(max_k |x[m, k]|, 1e-10) / 448     dynamic, per token (or one static scale)
    x_q        = clamp(x / x_scale, -448, 448) -> float8_e4m3fn

Both run the shared kernels in `scaled_mm`. The fp32 -> fp8 cast in its `_quant_kernel` is only
right on CUDA (the Triton interpreter rounds it wrong and does not saturate): its interpreter
tests check the scales, the values on CUDA.
"""

from __future__ import annotations

import torch

from qserve.kernels.scaled_mm import scaled_mm, scaled_quant


def scaled_fp8_quant(
    x: torch.Tensor, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_q float8_e4m3fn [M, K], scale fp32 [M, 1], or the static scale [1])."""
    return scaled_quant(x, scale, torch.float8_e4m3fn)


def fp8_scaled_mm(
    x_q: torch.Tensor,
    w_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """fp8 x_q [M, K] x fp8 w_q [N, K] -> [M, N]: fp32 accumulation, then the scales."""
    if x_q.dtype != torch.float8_e4m3fn or w_q.dtype != torch.float8_e4m3fn:
        raise TypeError(f"fp8_scaled_mm needs float8_e4m3fn operands, got {x_q.dtype}, {w_q.dtype}")
    return scaled_mm(x_q, w_q, x_scale, w_scale, out_dtype, bias, split_k)


def w8a8_fp8_linear(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    input_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Quantize x to FP8 (dynamic per token, or static input_scale), then fp8_scaled_mm.

    Under the Triton interpreter the activation cast is wrong: quantize in torch there."""
    if x.is_cuda:
        x_q, x_scale = scaled_fp8_quant(x, input_scale)
    else:
        from qserve.kernels.fp8_ref import scaled_fp8_quant_ref

        x_q, x_scale = scaled_fp8_quant_ref(x, input_scale)
    return fp8_scaled_mm(x_q, w_q, x_scale, w_scale, x.dtype, bias)
