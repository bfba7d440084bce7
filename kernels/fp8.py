"""Triton FP8 W8A8 ops: activation quantization to float8_e4m3fn and the scaled GEMM.

Definitions in `fp8_ref`:

    x_scale[m] = max(max_k |x[m, k]|, 1e-10) / 448     dynamic, per token (or one static scale)
    x_q        = clamp(x / x_scale, -448, 448) -> float8_e4m3fn

The fp32 -> fp8 cast in `_quant_fp8_kernel` is only right on CUDA (the Triton interpreter rounds
it wrong and does not saturate): its interpreter tests check the scales, the values on CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qserve.kernels.scaled_mm import scaled_mm

FP8_MAX = 448.0


@triton.jit
def _quant_fp8_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    K,
    stride_xm,
    stride_qm,
    STATIC: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0)
    x_row = x_ptr + row * stride_xm
    if STATIC:
        scale = tl.load(scale_ptr)
    else:
        absmax = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            absmax = tl.maximum(absmax, tl.abs(x))
        scale = tl.div_rn(tl.maximum(tl.max(absmax, axis=0), 1e-10), 448.0)
        tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        y = tl.minimum(tl.maximum(tl.div_rn(x, scale), -448.0), 448.0)
        tl.store(q_ptr + row * stride_qm + offs, y.to(q_ptr.dtype.element_ty), mask=offs < K)


def scaled_fp8_quant(
    x: torch.Tensor, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_q float8_e4m3fn [M, K], scale fp32 [M, 1], or the static scale [1])."""
    if x.dim() != 2 or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be a 2-D float tensor, got {tuple(x.shape)} {x.dtype}")
    M, K = x.shape
    x = x.contiguous()
    q = torch.empty((M, K), device=x.device, dtype=torch.float8_e4m3fn)
    if scale is None:
        out_scale = torch.empty((M, 1), device=x.device, dtype=torch.float32)
    else:
        if scale.numel() != 1:
            raise ValueError("a static activation scale is one number")
        out_scale = scale.to(device=x.device, dtype=torch.float32).reshape(1)
    block_k = min(triton.next_power_of_2(K), 1024 if x.is_cuda else 256)
    _quant_fp8_kernel[(M,)](
        x, q, out_scale, K, x.stride(0), q.stride(0), STATIC=scale is not None, BLOCK_K=block_k
    )
    return q, out_scale


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
