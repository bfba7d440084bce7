import pytest
import torch
from torch import nn

from qserve.errors import QServeError
from qserve.quantize.awq import (
    AWQResult,
    activation_mean,
    apply_awq,
    clip_weight,
    output_error,
    rescale_stats,
    search_clip,
    search_scale,
)
from qserve.quantize.fold import apply_scales
from qserve.quantize.gptq import accumulate_hessian
from qserve.quantize.rtn import fake_quantize


def _inputs(n: int = 1024, K: int = 128, seed: int = 0) -> torch.Tensor:
    """Activations with a few salient (outlier) channels, as in real LLMs."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, K, generator=g)
    X[:, [5, 40, 99]] *= 20
    return X


def _err(X: torch.Tensor, W: torch.Tensor, Wq: torch.Tensor) -> float:
    return float(((X @ (W - Wq).t()) ** 2).mean())


def _stats(X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return activation_mean(X), accumulate_hessian(None, 0, X)[0]


def test_output_error_is_the_mean_squared_output() -> None:
    X, dW = _inputs(n=256), torch.randn(8, 128) * 0.01
    per_channel = ((X @ dW.t()) ** 2).mean(dim=0)
    torch.testing.assert_close(output_error(dW, _stats(X)[1]), per_channel, rtol=1e-4, atol=0)


def test_rescale_stats_match_scaled_inputs() -> None:
    X, s = _inputs(n=64), torch.rand(128) + 0.5
    x_mean, H = rescale_stats(*_stats(X), s)
    x_mean2, H2 = _stats(X / s)
    torch.testing.assert_close(x_mean, x_mean2)
    torch.testing.assert_close(H, H2, rtol=1e-4, atol=1e-4)


def test_scale_search_beats_rtn() -> None:
    X = _inputs()
    Ws = [torch.randn(64, 128), torch.randn(32, 128)]
    s, alpha, errors = search_scale(*_stats(X), Ws, bits=4, group_size=32)
    assert len(errors) == 20 and 0 < alpha < 1
    W = torch.cat(Ws)
    rtn = _err(X, W, fake_quantize(W, 4, 32, sym=False))
    awq = _err(X, W, fake_quantize(W * s, 4, 32, sym=False) / s)
    assert errors[0] == pytest.approx(rtn, rel=1e-4)  # alpha = 0 is s = 1: plain RTN
    assert awq == pytest.approx(min(errors), rel=1e-4) and awq < 0.8 * rtn
    # Salient channels get the largest scales; s is normalised around 1.
    assert set(torch.topk(s, 3).indices.tolist()) == {5, 40, 99}
    torch.testing.assert_close(s.max() * s.min(), torch.tensor(1.0))


def test_activation_mean() -> None:
    X = torch.tensor([[[1.0, -2.0]], [[-3.0, 4.0]]])
    assert activation_mean(X).tolist() == [2.0, 3.0]


def test_clip_search_lowers_error() -> None:
    X = _inputs(seed=1)
    W = torch.randn(64, 128)
    max_val = search_clip(_stats(X)[1], W, bits=4, group_size=32)
    assert max_val.shape == (4, 64)
    org = W.abs().reshape(64, 4, 32).amax(-1).t()
    assert torch.all(max_val <= org) and torch.all(max_val >= 0.55 * org - 1e-6)
    Wc = clip_weight(W, max_val, 32)
    assert _err(X, W, fake_quantize(Wc, 4, 32, False)) < _err(X, W, fake_quantize(W, 4, 32, False))


def _norm_then_linears() -> tuple[nn.Module, nn.Linear, nn.Linear]:
    torch.manual_seed(0)
    norm = nn.LayerNorm(16, elementwise_affine=True)
    nn.init.uniform_(norm.weight, 0.5, 1.5)
    return norm, nn.Linear(16, 8), nn.Linear(16, 4)


def test_fold_into_norm_keeps_the_function() -> None:
    norm, a, b = _norm_then_linears()
    x = torch.randn(5, 16)
    ref = torch.cat([a(norm(x)), b(norm(x))], 1)
    apply_scales(norm, [a, b], torch.rand(16) + 0.5)
    torch.testing.assert_close(torch.cat([a(norm(x)), b(norm(x))], 1), ref)


def test_fold_into_a_gemma_norm_keeps_the_function() -> None:
    """Gemma's norms scale by (1 + w): the fold keeps 1 + w' = (1 + w) / s."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    torch.manual_seed(0)
    norm, a = Gemma3RMSNorm(16), nn.Linear(16, 8)
    nn.init.uniform_(norm.weight, -0.5, 0.5)
    x = torch.randn(5, 16)
    ref = a(norm(x))
    apply_scales(norm, [a], torch.rand(16) + 0.5)
    torch.testing.assert_close(a(norm(x)), ref)


def test_fold_into_previous_linear_rows_keeps_the_function() -> None:
    torch.manual_seed(0)
    v, o = nn.Linear(16, 12), nn.Linear(12, 16)  # v_proj -> o_proj (attention is linear in v)
    x = torch.randn(5, 16)
    ref = o(v(x))
    apply_scales(v, [o], torch.rand(12) + 0.5)
    torch.testing.assert_close(o(v(x)), ref)


def test_result_save_load_replay(tmp_path) -> None:
    norm, a, b = _norm_then_linears()
    model = nn.ModuleDict({"norm": norm, "a": a, "b": b})
    s = torch.rand(16) + 0.5
    result = AWQResult(
        scales={"norm": s}, clips={"a": torch.full((1, 8), 0.1)}, linears={"norm": ["a", "b"]}
    )
    result.save(tmp_path / "awq.safetensors")
    loaded = AWQResult.load(tmp_path / "awq.safetensors")
    assert loaded.linears == {"norm": ["a", "b"]}
    assert torch.equal(loaded.scales["norm"], s)
    w_b = b.weight.detach().clone()
    apply_awq(model, loaded, group_size=-1)
    torch.testing.assert_close(b.weight.detach(), w_b * s)
    assert float(a.weight.detach().abs().max()) <= 0.1 + 1e-7


def test_duo_scaling_also_beats_rtn() -> None:
    X = _inputs(seed=2)
    W = torch.randn(64, 128)
    s, _, errors = search_scale(*_stats(X), [W], bits=4, group_size=32, duo_scaling=True)
    rtn = _err(X, W, fake_quantize(W, 4, 32, sym=False))
    awq = _err(X, W, fake_quantize(W * s, 4, 32, sym=False) / s)
    assert awq == pytest.approx(min(errors), rel=1e-4) and awq < rtn


def test_replay_on_the_wrong_model_is_refused() -> None:
    result = AWQResult(scales={"model.layers.0.input_layernorm": torch.ones(4)})
    with pytest.raises(QServeError, match="no module model.layers.0.input_layernorm"):
        apply_awq(nn.Linear(4, 4), result, group_size=-1)
