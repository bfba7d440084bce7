"""The torch references against plain dense math (dequantize, then x @ W.T)."""

import pytest
import torch

from qserve.kernels import packing as P
from qserve.kernels.fp8_ref import (
    FP8_MAX,
    fp8_scaled_mm_ref,
    quantize_weight_fp8_ref,
    scaled_fp8_quant_ref,
    w8a8_fp8_linear_ref,
)
from qserve.kernels.int8_ref import (
    int8_scaled_mm_ref,
    scaled_int8_quant_ref,
    w8a8_int8_linear_ref,
    w8a16_gemm_ref,
)
from qserve.kernels.w4a16_ref import awq_gemm_ref, gptq_gemm_ref


def _dense(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.double() @ w.double().t()).float()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_gemm_ref(bits: int, act_order: bool) -> None:
    M, K, N, gs = 3, 64, 32, 16
    G = K // gs
    q = torch.randint(0, 2**bits, (K, N), dtype=torch.int32)
    zeros = torch.randint(1, 2**bits, (G, N), dtype=torch.int32)
    scales = (torch.rand(G, N) * 0.02 + 0.005).half()
    g_idx = P.gptq_g_idx(K, gs, torch.randperm(K) if act_order else None)
    x = torch.randn(M, K).half()
    bias = torch.randn(N).half()
    out = gptq_gemm_ref(
        x, P.pack_gptq_qweight(q, bits), P.pack_gptq_qzeros(zeros, bits), scales, g_idx, bits, bias
    )
    g = g_idx.long()
    w = (scales[g].float() * (q - zeros[g]).float()).t()  # [N, K], the format's definition
    expect = _dense(x.float(), w) + bias.float()
    assert out.dtype == torch.float16 and out.shape == (M, N)
    atol = 2e-3 * expect.abs().max().item()  # fp16 output rounding, relative to the output scale
    torch.testing.assert_close(out.float(), expect, rtol=2e-3, atol=atol)


def test_awq_gemm_ref() -> None:
    M, K, N, gs = 5, 64, 16, 32
    G = K // gs
    q = torch.randint(0, 16, (K, N), dtype=torch.int32)
    z = torch.randint(0, 16, (G, N), dtype=torch.int32)
    scales = (torch.rand(G, N) * 0.02 + 0.005).half()
    x = torch.randn(M, K).half()
    out = awq_gemm_ref(x, P.pack_awq_qweight(q), P.pack_awq_qzeros(z), scales, gs)
    g = torch.arange(K) // gs
    w = (scales[g].float() * (q - z[g]).float()).t()
    torch.testing.assert_close(out.float(), _dense(x.float(), w), rtol=2e-3, atol=2e-3)


def test_scaled_int8_quant_ref_per_token() -> None:
    x = torch.randn(7, 33).to(torch.bfloat16)
    q, s = scaled_int8_quant_ref(x)
    assert q.dtype == torch.int8 and s.shape == (7, 1) and s.dtype == torch.float32
    xf = x.float()
    assert torch.equal(s, xf.abs().amax(1, keepdim=True) / 127)
    assert q.abs().max() == 127  # the row max maps to +-127
    assert ((q.float() * s - xf).abs() <= s / 2 + 1e-6).all()  # round to nearest


def test_scaled_int8_quant_ref_static_clamps() -> None:
    x = torch.randn(4, 16) * 10
    q, s = scaled_int8_quant_ref(x, torch.tensor([0.01]))
    assert q.min() == -128 and q.max() == 127


def test_int8_scaled_mm_ref_int32_accumulation() -> None:
    M, K, N = 3, 256, 8
    x_q = torch.randint(-128, 128, (M, K), dtype=torch.int8)
    w_q = torch.randint(-128, 128, (N, K), dtype=torch.int8)
    xs, ws = torch.rand(M, 1) * 0.01, torch.rand(N, 1) * 0.01
    out = int8_scaled_mm_ref(x_q, w_q, xs, ws, torch.float32)
    xl, wl = x_q.tolist(), w_q.tolist()
    dot = lambda a, b: sum(i * j for i, j in zip(a, b, strict=True))  # noqa: E731
    exact = torch.tensor([[dot(xr, wr) for wr in wl] for xr in xl])
    torch.testing.assert_close(out, exact.float() * xs * ws.t(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("per_tensor", [False, True])
def test_w8a8_int8_linear_ref_close_to_dense(per_tensor: bool) -> None:
    M, K, N = 17, 128, 24
    x, w = torch.randn(M, K), torch.randn(N, K) * 0.05
    w_scale = (w.abs().amax() if per_tensor else w.abs().amax(1, keepdim=True)) / 127
    w_scale = w_scale.reshape(-1, 1) if not per_tensor else w_scale.reshape(1)
    w_q = torch.round(w / w_scale.reshape(-1, 1)).clamp(-127, 127).to(torch.int8)
    out = w8a8_int8_linear_ref(x, w_q, w_scale)
    # exactly the dense product of the dequantized operands
    x_q, xs = scaled_int8_quant_ref(x)
    deq = _dense(x_q.float() * xs, w_q.float() * w_scale.reshape(-1, 1))
    torch.testing.assert_close(out, deq, rtol=1e-5, atol=1e-5)
    # and close to the unquantized product (int8 error)
    ref = _dense(x, w)
    assert (out - ref).abs().max() < 0.05 * ref.abs().max()
    # static per-tensor activation scale
    s_in = (x.abs().amax() / 127).reshape(1)
    out_s = w8a8_int8_linear_ref(x, w_q, w_scale, input_scale=s_in)
    assert (out_s - ref).abs().max() < 0.05 * ref.abs().max()


def test_w8a16_gemm_ref() -> None:
    M, K, N = 3, 64, 16
    x = torch.randn(M, K).half()
    w_q = torch.randint(-128, 128, (N, K), dtype=torch.int8)
    ws = (torch.rand(N, 1) * 0.01).float()
    out = w8a16_gemm_ref(x, w_q, ws)
    torch.testing.assert_close(
        out.float(), _dense(x.float(), w_q.float() * ws), rtol=2e-3, atol=2e-3
    )


def test_scaled_fp8_quant_ref() -> None:
    x = torch.randn(5, 40)
    x[0, 3] = 1000.0
    q, s = scaled_fp8_quant_ref(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (5, 1)
    assert q.float().abs().amax(1).eq(FP8_MAX).all()
    # static scale saturates at +-448 instead of producing NaN
    q2, _ = scaled_fp8_quant_ref(x, torch.tensor([0.001]))
    assert not q2.float().isnan().any() and q2.float().abs().max() == FP8_MAX
    rel = ((q.float() * s - x).abs() / x.abs().clamp(min=1e-3)).median()
    assert rel < 0.07  # e4m3 has 3 mantissa bits


@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("static", [False, True])
def test_w8a8_fp8_linear_ref(per_channel: bool, static: bool) -> None:
    M, K, N = 3, 96, 16
    x, w = torch.randn(M, K).to(torch.bfloat16), torch.randn(N, K) * 0.05
    w_q, w_scale = quantize_weight_fp8_ref(w, per_channel)
    assert w_scale.shape == ((N, 1) if per_channel else (1,))
    s_in = (x.float().abs().amax() / FP8_MAX).reshape(1) if static else None
    out = w8a8_fp8_linear_ref(x, w_q, w_scale, s_in)
    assert out.dtype == torch.bfloat16
    x_q, xs = scaled_fp8_quant_ref(x, s_in)
    deq = _dense(x_q.float() * xs.reshape(-1, 1), w_q.float() * w_scale.reshape(-1, 1))
    torch.testing.assert_close(out.float(), deq, rtol=1e-2, atol=1e-2)
    ref = _dense(x.float(), w)
    assert (out.float() - ref).abs().max() < 0.1 * ref.abs().max()
    torch.testing.assert_close(
        fp8_scaled_mm_ref(x_q, w_q, xs, w_scale, torch.float32), deq, rtol=1e-5, atol=1e-5
    )
