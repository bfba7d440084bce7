import torch
from torch import nn

from qserve.quantize.fold import apply_scales
from qserve.quantize.smoothquant import (
    activation_absmax,
    dequantize_int8,
    int8_input_scale,
    quantize_int8,
    smooth_scales,
)


def test_smooth_scales_formula() -> None:
    x_absmax = torch.tensor([4.0, 1.0, 9.0])
    Ws = [torch.tensor([[1.0, -2.0, 0.5]]), torch.tensor([[-4.0, 1.0, 0.25]])]
    s = smooth_scales(x_absmax, Ws, alpha=0.5)
    w_absmax = torch.tensor([4.0, 2.0, 0.5])
    torch.testing.assert_close(s, x_absmax.sqrt() / w_absmax.sqrt())


def test_int8_weights() -> None:
    W = torch.randn(16, 64)
    Q, scale = quantize_int8(W)
    assert Q.dtype == torch.int8 and scale.shape == (16, 1)
    assert torch.all(Q.abs().amax(dim=1) == 127)
    assert torch.all((dequantize_int8(Q, scale) - W).abs() <= scale / 2 + 1e-6)
    Q, scale = quantize_int8(W, "tensor")
    assert scale.shape == (1,) and int(Q.abs().max()) == 127


def _fake_quant_per_token(x: torch.Tensor) -> torch.Tensor:
    s = x.abs().amax(dim=-1, keepdim=True) / 127
    return torch.round(x / s) * s


@torch.no_grad()
def test_smoothing_lowers_w8a8_error_with_outlier_channels() -> None:
    torch.manual_seed(0)
    norm, lin = nn.LayerNorm(64), nn.Linear(64, 32, bias=False)
    x = torch.randn(256, 64)
    x[:, [3, 30]] = x[:, [3, 30]] * 50 + 20  # outlier channels survive the norm
    ref = lin(norm(x))

    def w8a8_err() -> float:
        h = _fake_quant_per_token(norm(x))
        Q, scale = quantize_int8(lin.weight.data)
        return float((h @ dequantize_int8(Q, scale).t() - ref).pow(2).mean())

    before = w8a8_err()
    s = smooth_scales(activation_absmax(norm(x)), [lin.weight.data], alpha=0.5)
    apply_scales(norm, [lin], s)
    torch.testing.assert_close(lin(norm(x)), ref, rtol=1e-4, atol=1e-4)  # same function
    assert w8a8_err() < 0.5 * before


def test_input_scale() -> None:
    assert int8_input_scale(torch.tensor([1.0, 254.0])).tolist() == [2.0]
