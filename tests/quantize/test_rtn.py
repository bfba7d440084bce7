import pytest
import torch

from qserve.quantize import rtn
from qserve.quantize.rtn import compute_qparams, quantize_codes, rtn_quantize


@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("bits", [3, 4, 8])
@pytest.mark.parametrize("sym", [True, False])
def test_shapes_ranges_and_error_bound(group_size: int, bits: int, sym: bool) -> None:
    torch.manual_seed(0)
    W = torch.randn(48, 256)
    qw = rtn_quantize(W, bits, group_size, sym)
    G = 1 if group_size == -1 else 256 // group_size
    assert qw.Q.shape == (48, 256) and qw.Q.dtype == torch.int32
    assert qw.scales.shape == (G, 48) and qw.zeros.shape == (G, 48)
    assert qw.g_idx.tolist() == [k // (256 if group_size == -1 else group_size) for k in range(256)]
    assert int(qw.Q.min()) >= 0 and int(qw.Q.max()) <= 2**bits - 1
    if sym:
        assert torch.all(qw.zeros == 2 ** (bits - 1))
    # Round to nearest: every weight is within half a step of its grid point (sym 4-bit may clip
    # the positive end by one step, since the grid is [-8, 7] * scale).
    err = (qw.dequantize() - W).abs()
    step = qw.scales[qw.g_idx.long()].t()
    assert torch.all(err <= step * (1.0 if sym else 0.5) + 1e-6)


def test_grid_points_are_exact() -> None:
    scale = torch.tensor([0.25, 0.5])
    Q = torch.randint(0, 16, (2, 32))
    W = (Q - 8).float() * scale[:, None]
    W[:, 0] = -8 * scale  # the full range is present in each row
    W[:, 1] = 7 * scale
    qw = rtn_quantize(W, 4, -1, sym=False)
    assert torch.equal(qw.dequantize(), W)


def test_qparams_conventions() -> None:
    W = torch.tensor([[-1.0, 0.5, 2.0], [0.0, 0.0, 0.0], [1.0, 2.0, 3.0]])
    scale, zero = compute_qparams(W, 4, sym=True)
    assert torch.allclose(scale, torch.tensor([4 / 15, 2 / 15, 6 / 15]))
    assert zero.tolist() == [8, 8, 8]
    scale, zero = compute_qparams(W, 4, sym=False)
    assert torch.allclose(scale, torch.tensor([3 / 15, 2 / 15, 3 / 15]))
    # The range always contains 0 (all-positive row: zero 0); an all-zero row gets [-1, 1].
    assert zero.tolist() == [5, 7, 0]
    _, zero = compute_qparams(W, 4, sym=False, min_zero=1)
    assert zero.tolist() == [5, 7, 1]


def test_ragged_last_group() -> None:
    W = torch.randn(8, 80)
    qw = rtn_quantize(W, 4, 32, sym=True)
    assert qw.scales.shape == (3, 8)
    assert qw.g_idx[-1] == 2
    assert (qw.dequantize() - W).abs().max() < qw.scales.max()


def _search_one_factor_at_a_time(W, bits, sym, min_zero, grid=100, max_shrink=0.8, norm=2.4):
    """The MSE range search as GPTQ's reference quantizer writes it: a loop over the factors."""
    best_scale, best_zero = compute_qparams(W, bits, sym, min_zero)
    best = torch.full((W.shape[0],), float("inf"))
    lo, hi = W.min(dim=1).values.clamp(max=0), W.max(dim=1).values.clamp(min=0)
    for i in range(int(max_shrink * grid)):
        p = 1 - i / grid
        scale, zero = compute_qparams(torch.stack([p * lo, p * hi], dim=1), bits, sym, min_zero)
        err = scale[:, None] * (quantize_codes(W, scale, zero, bits) - zero[:, None]) - W
        err = err.abs().pow(norm).sum(dim=1)
        better = err < best
        best = torch.where(better, err, best)
        best_scale = torch.where(better, scale, best_scale)
        best_zero = torch.where(better, zero, best_zero)
    return best_scale, best_zero


@pytest.mark.parametrize("bits,sym,min_zero", [(4, True, 0), (4, False, 1), (8, True, 0)])
@pytest.mark.parametrize("elements", [1 << 22, 5000])  # all factors at once; a few at a time
def test_search_qparams_is_the_loop_over_factors(bits, sym, min_zero, elements, monkeypatch):
    monkeypatch.setattr(rtn, "SEARCH_ELEMENTS", elements)
    torch.manual_seed(bits + min_zero)
    W = torch.randn(96, 64) * (torch.rand(96, 1) + 0.1)
    W[:, :3] *= 8  # outliers: clipping them pays
    W[5] = 0  # a row of zeros
    want = _search_one_factor_at_a_time(W, bits, sym, min_zero)
    got = rtn.search_qparams(W, bits, sym, min_zero)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert not torch.equal(got[0], compute_qparams(W, bits, sym, min_zero)[0])  # it searched
