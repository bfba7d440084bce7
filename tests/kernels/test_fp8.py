"""Triton FP8 W8A8 ops against the torch references.

The interpreter's fp32 -> fp8 cast is wrong (ARCHITECTURE.md 5): activation quantization values are
compared on CUDA only; elsewhere the fp8 operands are made in torch.
"""

import pytest
import torch

from qserve.kernels.fp8 import fp8_scaled_mm, scaled_fp8_quant, w8a8_fp8_linear
from qserve.kernels.fp8_ref import (
    fp8_scaled_mm_ref,
    quantize_weight_fp8_ref,
    scaled_fp8_quant_ref,
    w8a8_fp8_linear_ref,
)

from ._helpers import assert_out_close


@pytest.mark.parametrize("M,K", [(1, 64), (17, 300)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_scaled_fp8_quant_scales(M, K, dtype, device) -> None:
    x = torch.randn(M, K, dtype=dtype) * 5
    _, s = scaled_fp8_quant(x.to(device))
    _, s_ref = scaled_fp8_quant_ref(x)
    assert torch.equal(s.cpu(), s_ref)


@pytest.mark.cuda
@pytest.mark.parametrize("M,K", [(1, 64), (17, 300), (64, 4096)])
@pytest.mark.parametrize("static", [False, True])
def test_scaled_fp8_quant_values_cuda(M, K, static) -> None:
    x = torch.randn(M, K, dtype=torch.bfloat16) * 5
    scale = torch.tensor([0.002]) if static else None  # static: saturates at +-448
    q, s = scaled_fp8_quant(x.cuda(), scale.cuda() if static else None)
    q_ref, s_ref = scaled_fp8_quant_ref(x, scale)
    assert torch.equal(s.cpu().reshape(-1), s_ref.reshape(-1))
    assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("M,K,N", [(1, 256, 128), (3, 200, 72), (17, 96, 64), (64, 130, 48)])
@pytest.mark.parametrize("per_channel", [True, False])
def test_fp8_scaled_mm(M, K, N, per_channel, device) -> None:
    x_q, xs = scaled_fp8_quant_ref(torch.randn(M, K))
    w_q, ws = quantize_weight_fp8_ref(torch.randn(N, K) * 0.05, per_channel)
    bias = torch.randn(N).to(torch.bfloat16)
    args = (x_q, w_q, xs, ws)
    out = fp8_scaled_mm(*(t.to(device) for t in args), torch.bfloat16, bias.to(device))
    assert_out_close(out.cpu(), fp8_scaled_mm_ref(*args, torch.bfloat16, bias))
    out32 = fp8_scaled_mm(*(t.to(device) for t in args), torch.float32)
    ref32 = fp8_scaled_mm_ref(*args, torch.float32)
    torch.testing.assert_close(out32.cpu(), ref32, rtol=1e-5, atol=1e-5 * ref32.abs().max().item())


@pytest.mark.parametrize("M", [1, 3, 17])
@pytest.mark.parametrize("static", [False, True])
def test_w8a8_fp8_linear(M, static, device) -> None:
    K, N = 192, 64
    x = torch.randn(M, K, dtype=torch.float16)
    w_q, ws = quantize_weight_fp8_ref(torch.randn(N, K) * 0.05)
    s_in = (x.float().abs().amax() / 448).reshape(1) if static else None
    dev = [t.to(device) if t is not None else None for t in (x, w_q, ws, s_in)]
    out = w8a8_fp8_linear(*dev)
    assert_out_close(out.cpu(), w8a8_fp8_linear_ref(x, w_q, ws, s_in))
