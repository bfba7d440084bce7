"""Triton int8 ops (activation quant, W8A8, W8A16) against the torch references."""

import pytest
import torch

from qserve.kernels.int8 import int8_scaled_mm, scaled_int8_quant, w8a8_int8_linear, w8a16_gemm
from qserve.kernels.int8_ref import (
    int8_scaled_mm_ref,
    scaled_int8_quant_ref,
    w8a8_int8_linear_ref,
    w8a16_gemm_ref,
)

from ._helpers import assert_out_close


@pytest.mark.parametrize("M,K", [(1, 64), (3, 300), (17, 1100)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_scaled_int8_quant_dynamic_exact(M, K, dtype, device) -> None:
    x = torch.randn(M, K, dtype=dtype) * 3
    q, s = scaled_int8_quant(x.to(device))
    q_ref, s_ref = scaled_int8_quant_ref(x)
    assert torch.equal(s.cpu(), s_ref)
    assert torch.equal(q.cpu(), q_ref)


def test_scaled_int8_quant_ties_and_zero_rows(device) -> None:
    # scale = 127 / 127 = 1: x / scale lands on .5 ties; a zero row keeps a finite scale
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -2.5, -0.5, 3.5, -126.5], [0.0] * 8])
    q, s = scaled_int8_quant(x.to(device))
    q_ref, s_ref = scaled_int8_quant_ref(x)
    assert q_ref[0].tolist() == [127, 0, 2, 2, -2, 0, 4, -126]
    assert torch.equal(q.cpu(), q_ref) and torch.equal(s.cpu(), s_ref)
    assert torch.isfinite(s).all()


def test_scaled_int8_quant_static(device) -> None:
    x = torch.randn(5, 70) * 4
    scale = torch.tensor([0.02])
    q, s = scaled_int8_quant(x.to(device), scale.to(device))
    q_ref, _ = scaled_int8_quant_ref(x, scale)
    assert torch.equal(q.cpu(), q_ref) and q_ref.min() == -128 and q_ref.max() == 127


@pytest.mark.parametrize("M,K,N", [(1, 256, 128), (3, 200, 72), (17, 96, 64), (64, 130, 48)])
@pytest.mark.parametrize("per_channel", [True, False])
def test_int8_scaled_mm(M, K, N, per_channel, device) -> None:
    x_q = torch.randint(-128, 128, (M, K), dtype=torch.int8)
    w_q = torch.randint(-128, 128, (N, K), dtype=torch.int8)
    xs = torch.rand(M, 1) * 0.01 + 1e-3
    ws = torch.rand(N, 1) * 0.01 + 1e-3 if per_channel else torch.tensor([0.004])
    bias = torch.randn(N).half()
    args = (x_q, w_q, xs, ws)
    out = int8_scaled_mm(*(t.to(device) for t in args), torch.float16, bias.to(device))
    assert_out_close(out.cpu(), int8_scaled_mm_ref(*args, torch.float16, bias))
    # the int32 accumulation is exact: in fp32 output the only error is the scaling
    out32 = int8_scaled_mm(*(t.to(device) for t in args), torch.float32)
    ref32 = int8_scaled_mm_ref(*args, torch.float32)
    torch.testing.assert_close(out32.cpu(), ref32, rtol=1e-6, atol=1e-6 * ref32.abs().max().item())


@pytest.mark.parametrize("split_k", [1, 3])
def test_int8_scaled_mm_split_k(split_k, device) -> None:
    x_q = torch.randint(-128, 128, (2, 500), dtype=torch.int8)
    w_q = torch.randint(-128, 128, (40, 500), dtype=torch.int8)
    xs, ws = torch.rand(2, 1) * 0.01, torch.rand(40, 1) * 0.01
    args = (x_q, w_q, xs, ws)
    out = int8_scaled_mm(*(t.to(device) for t in args), torch.float32, split_k=split_k)
    torch.testing.assert_close(
        out.cpu(), int8_scaled_mm_ref(*args, torch.float32), rtol=1e-6, atol=1e-4
    )


@pytest.mark.parametrize("M", [1, 17])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_w8a8_int8_linear(M, static, dtype, device) -> None:
    K, N = 160, 64
    x = torch.randn(M, K, dtype=dtype)
    w_q = torch.randint(-127, 128, (N, K), dtype=torch.int8)
    ws = torch.rand(N, 1) * 0.01
    s_in = (x.float().abs().amax() / 127).reshape(1) if static else None
    bias = torch.randn(N, dtype=dtype)
    dev = [t.to(device) if t is not None else None for t in (x, w_q, ws, s_in, bias)]
    out = w8a8_int8_linear(*dev)
    assert_out_close(out.cpu(), w8a8_int8_linear_ref(x, w_q, ws, s_in, bias))


@pytest.mark.parametrize("M,K,N", [(1, 256, 128), (3, 200, 72), (17, 64, 64), (64, 96, 32)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_w8a16_gemm(M, K, N, dtype, device) -> None:
    x = torch.randn(M, K, dtype=dtype)
    w_q = torch.randint(-128, 128, (N, K), dtype=torch.int8)
    ws = torch.rand(N, 1) * 0.01
    out = w8a16_gemm(x.to(device), w_q.to(device), ws.to(device))
    assert_out_close(out.cpu(), w8a16_gemm_ref(x, w_q, ws))
