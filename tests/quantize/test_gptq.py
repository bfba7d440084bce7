import pytest
import torch

from qserve.kernels.packing import gptq_g_idx
from qserve.quantize.fp8 import dequantize_fp8, quantize_fp8
from qserve.quantize.gptq import (
    accumulate_dxxt,
    accumulate_hessian,
    gptq_quantize,
    gptq_w8_quantize,
    group_aware_order,
)
from qserve.quantize.rtn import compute_qparams, quantize_codes, rtn_quantize, search_qparams
from qserve.quantize.smoothquant import dequantize_int8, quantize_int8


def _layer(K: int = 256, N: int = 64, n: int = 2048, seed: int = 0):
    """Weights and correlated, unevenly scaled inputs (as real activations are)."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(N, K, generator=g)
    mix = torch.randn(K, K, generator=g) / K**0.5 + torch.eye(K)
    X = (torch.randn(n, K, generator=g) @ mix) * torch.linspace(0.2, 3.0, K)
    H, _ = accumulate_hessian(None, 0, X)
    return W, X, H


def _out_err(X: torch.Tensor, W: torch.Tensor, Wq: torch.Tensor) -> float:
    return float(((X @ (W - Wq).t()) ** 2).mean())


def test_hessian_streaming_equals_batch() -> None:
    X = torch.randn(3, 100, 32)
    H, n = None, 0
    for x in X:
        H, n = accumulate_hessian(H, n, x)
    flat = X.reshape(-1, 32)
    assert n == 300
    torch.testing.assert_close(H, 2 / 300 * flat.t() @ flat, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("desc_act", [False, True])
def test_gptq_output_error_below_rtn(group_size: int, sym: bool, desc_act: bool) -> None:
    W, X, H = _layer()
    rtn = rtn_quantize(W, 4, group_size, sym)
    q = gptq_quantize(W, H, 4, group_size, sym, desc_act=desc_act)
    assert _out_err(X, W, q.dequantize()) < 0.8 * _out_err(X, W, rtn.dequantize())


def test_gptq_8bit_below_rtn() -> None:
    W, X, H = _layer(seed=1)
    q = gptq_quantize(W, H, 8, 128, True)
    assert int(q.Q.max()) <= 255 and torch.all(q.zeros == 128)
    assert _out_err(X, W, q.dequantize()) < _out_err(X, W, rtn_quantize(W, 8, 128).dequantize())


def test_desc_act_g_idx_is_group_of_original_channel() -> None:
    W, X, H = _layer(K=128, N=16)
    q = gptq_quantize(W, H, 4, 32, True, desc_act=True)
    perm = torch.argsort(torch.diag(H), descending=True)
    assert torch.equal(q.g_idx, gptq_g_idx(128, 32, perm))
    assert sorted(torch.bincount(q.g_idx).tolist()) == [32, 32, 32, 32]
    # The highest-variance channel is visited first: it is in group 0.
    assert q.g_idx[int(torch.argmax(torch.diag(H)))] == 0
    # Codes are stored in original column order: dequantize via g_idx reproduces the weight.
    assert (q.dequantize() - W).abs().max() < q.scales.max() * 8


def test_static_groups_keep_natural_g_idx() -> None:
    W, X, H = _layer(K=128, N=16)
    q = gptq_quantize(W, H, 4, 32, True, desc_act=True, static_groups=True)
    assert q.g_idx.tolist() == [k // 32 for k in range(128)]
    # Static group parameters are those of RTN on the unmodified weights.
    torch.testing.assert_close(q.scales, rtn_quantize(W, 4, 32, True).scales)
    assert _out_err(X, W, q.dequantize()) < _out_err(X, W, rtn_quantize(W, 4, 32).dequantize())


def test_group_aware_order_keeps_groups_whole() -> None:
    diag = torch.tensor([1.0, 5.0, 2.0, 0.5, 9.0, 3.0, 4.0, 0.1])  # groups of 2
    # group maxima 5, 2, 9, 4 -> groups 2, 0, 3, 1; inside each, descending diag
    assert group_aware_order(diag, 2).tolist() == [4, 5, 1, 0, 6, 7, 2, 3]


def test_act_group_aware_keeps_consecutive_groups_and_beats_natural_order() -> None:
    W, X, H = _layer(seed=4)
    perm = torch.randperm(256, generator=torch.Generator().manual_seed(0))
    X, H = X[:, perm], H[perm][:, perm]  # important channels scattered over K
    W = W[:, perm]
    natural = gptq_quantize(W, H, 4, 32, True)
    gar = gptq_quantize(W, H, 4, 32, True, act_group_aware=True)
    assert gar.g_idx.tolist() == [k // 32 for k in range(256)]  # no act-order permutation
    assert _out_err(X, W, gar.dequantize()) < _out_err(X, W, natural.dequantize())
    # desc_act takes precedence; per-channel has nothing to reorder
    both = gptq_quantize(W, H, 4, 32, True, desc_act=True, act_group_aware=True)
    assert torch.equal(both.Q, gptq_quantize(W, H, 4, 32, True, desc_act=True).Q)
    chan = gptq_quantize(W, H, 4, -1, True, act_group_aware=True)
    assert torch.equal(chan.Q, gptq_quantize(W, H, 4, -1, True).Q)


def test_dead_columns_get_zero_weight() -> None:
    W, X, _ = _layer(K=64, N=8)
    X[:, [3, 17]] = 0
    H, _ = accumulate_hessian(None, 0, X)
    q = gptq_quantize(W, H, 4, 32, sym=True)
    assert torch.all(q.dequantize()[:, [3, 17]] == 0)


def test_block_size_does_not_change_the_math() -> None:
    W, _, H = _layer(K=256, N=16)
    a = gptq_quantize(W, H, 4, 32, True, block_size=128)
    b = gptq_quantize(W, H, 4, 32, True, block_size=32)
    # Lazy batch updates are a reordering of the same sums: codes agree up to fp rounding.
    assert (a.Q != b.Q).float().mean() < 0.01


def test_damping_grows_when_h_is_singular() -> None:
    # Rank-deficient H (fewer tokens than columns) and no damping: one retry at 1% fixes it.
    torch.manual_seed(0)
    W = torch.randn(8, 64)
    X = torch.randn(16, 64)
    X[:, 10] = X[:, 11]
    H, _ = accumulate_hessian(None, 0, X)
    q = gptq_quantize(W, H, 4, 32, True, damp_percent=0.0)
    assert torch.isfinite(q.dequantize()).all()


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_gptq_w8_below_plain_rounding_in_the_same_format(fmt: str, strategy: str) -> None:
    W, X, H = _layer(seed=2)
    Q, scale = gptq_w8_quantize(W, H, fmt, strategy)
    quant, dequant = (
        (quantize_int8, dequantize_int8) if fmt == "int8" else (quantize_fp8, dequantize_fp8)
    )
    Q0, scale0 = quant(W, strategy)
    assert Q.dtype == Q0.dtype and Q.shape == W.shape
    torch.testing.assert_close(scale, scale0, rtol=0, atol=0)  # only the rounding changes
    err = _out_err(X, W, dequant(Q, scale))
    assert err < 0.8 * _out_err(X, W, dequant(Q0, scale0))
    # Error feedback moves weights by a fraction of their range, never to a far code.
    assert (dequant(Q, scale) - W).abs().max() < 0.25 * W.abs().max()


def test_mse_range_search_lowers_the_error_further() -> None:
    W, X, H = _layer(seed=3)
    W[:, 5] *= 6  # a few large weights: the min / max range wastes most of the grid on them
    plain = gptq_quantize(W, H, 4, 64, True)
    searched = gptq_quantize(W, H, 4, 64, True, mse=True)
    assert _out_err(X, W, searched.dequantize()) < _out_err(X, W, plain.dequantize())


def test_search_qparams_never_worse_than_min_max() -> None:
    W = torch.randn(32, 128) * torch.rand(32, 1)
    for sym in (True, False):
        s0, z0 = compute_qparams(W, 4, sym)
        s1, z1 = search_qparams(W, 4, sym)
        err0 = (s0[:, None] * (quantize_codes(W, s0, z0, 4) - z0[:, None]) - W).abs().pow(2.4)
        err1 = (s1[:, None] * (quantize_codes(W, s1, z1, 4) - z1[:, None]) - W).abs().pow(2.4)
        assert torch.all(err1.sum(1) <= err0.sum(1) * (1 + 1e-6))


def _drifted(X: torch.Tensor, seed: int = 3) -> torch.Tensor:
    """What the inputs X look like after quantized layers: X plus correlated noise."""
    g = torch.Generator().manual_seed(seed)
    return X + 0.3 * torch.randn(X.shape, generator=g) * X.std(dim=0)


def test_dxxt_streaming_equals_batch() -> None:
    X_fp = torch.randn(3, 100, 32)
    X = X_fp + 0.1 * torch.randn(3, 100, 32)
    D, n = None, 0
    for x, x_fp in zip(X, X_fp, strict=True):
        D, n = accumulate_dxxt(D, n, x, x_fp)
    a, b = X.reshape(-1, 32), X_fp.reshape(-1, 32)
    torch.testing.assert_close(D, 2 / 300 * (b - a).t() @ a, rtol=1e-5, atol=1e-5)


def test_gptaq_with_no_drift_is_gptq() -> None:
    W, X, H = _layer(K=128, N=32)
    D, _ = accumulate_dxxt(None, 0, X, X)
    plain = gptq_quantize(W, H, 4, 32, True, act_group_aware=True)
    asym = gptq_quantize(W, H, 4, 32, True, act_group_aware=True, dXXT=D)
    assert torch.equal(plain.Q, asym.Q) and torch.equal(plain.scales, asym.scales)


@pytest.mark.parametrize("desc_act", [False, True])
def test_gptaq_fits_the_full_precision_output_better(desc_act: bool) -> None:
    """From drifted inputs X~, GPTAQ's Q X~ is closer to the float model's W X than GPTQ's."""
    W, X_fp, _ = _layer(K=128, N=64)
    X = _drifted(X_fp)
    H, _ = accumulate_hessian(None, 0, X)
    D, _ = accumulate_dxxt(None, 0, X, X_fp)
    ref = X_fp @ W.t()

    def err(q) -> float:
        return float(((X @ q.dequantize().t() - ref) ** 2).mean())

    plain = gptq_quantize(W, H, 4, 32, True, desc_act=desc_act, act_group_aware=True)
    asym = gptq_quantize(W, H, 4, 32, True, desc_act=desc_act, act_group_aware=True, dXXT=D)
    assert err(asym) < 0.99 * err(plain)


def test_gptaq_block_size_does_not_change_the_math() -> None:
    W, X_fp, _ = _layer(K=256, N=16)
    X = _drifted(X_fp)
    H, _ = accumulate_hessian(None, 0, X)
    D, _ = accumulate_dxxt(None, 0, X, X_fp)
    a = gptq_quantize(W, H, 4, 32, True, block_size=128, dXXT=D)
    b = gptq_quantize(W, H, 4, 32, True, block_size=32, dXXT=D)
    assert (a.Q != b.Q).float().mean() < 0.01
