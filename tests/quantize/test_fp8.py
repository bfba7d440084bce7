import torch

from qserve.quantize.fp8 import FP8_MAX, dequantize_fp8, fp8_input_scale, quantize_fp8


def test_per_channel() -> None:
    torch.manual_seed(0)
    W = torch.randn(16, 64) * torch.logspace(-2, 2, 16)[:, None]
    Q, scale = quantize_fp8(W)
    assert FP8_MAX == 448.0
    assert Q.dtype == torch.float8_e4m3fn and Q.shape == (16, 64) and scale.shape == (16, 1)
    torch.testing.assert_close(scale, W.abs().amax(dim=1, keepdim=True) / 448)
    assert torch.all(Q.float().abs().amax(dim=1) == 448)
    # E4M3 has 3 mantissa bits: relative error at most 2^-4 for normal values.
    rel = (dequantize_fp8(Q, scale) - W).abs() / W.abs().clamp(min=scale * 2**-6)
    assert float(rel.max()) <= 2**-4 + 1e-6


def test_per_tensor_and_saturation() -> None:
    W = torch.tensor([[1.0, -2.0], [0.5, 4.0]])
    Q, scale = quantize_fp8(W, "tensor")
    assert scale.shape == (1,) and torch.equal(scale, torch.tensor([4.0]) / 448)
    assert float(Q.float().max()) == 448.0 and not torch.isnan(Q.float()).any()
    assert fp8_input_scale(torch.tensor([3.0, 896.0])).tolist() == [2.0]
