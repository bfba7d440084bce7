"""16-bit dense linears on CPUs without native bf16 (qserve.kernels.cpu_dense, ops.linear)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qserve.kernels import cpu_dense, ops
from tests.kernels._helpers import require_built


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("M", "N", "K"), [(4, 3000, 576), (64, 70, 96), (5, 1, 8)])
def test_upcast_linear_is_one_rounding_of_the_fp32_product(dtype, M, N, K, monkeypatch):
    monkeypatch.setattr(cpu_dense, "CHUNK_BYTES", 4 * K * 100)  # chunks of 100 rows: a tail
    gen = torch.Generator().manual_seed(M * N)
    x = torch.randn(M, K, generator=gen).to(dtype)
    weight = torch.randn(N, K, generator=gen).to(dtype)
    bias = torch.randn(N, generator=gen).to(dtype)
    want = F.linear(x.double(), weight.double(), bias.double())
    got = cpu_dense.upcast_linear(x, weight, bias)
    assert got.dtype == dtype and got.shape == (M, N)
    torch.testing.assert_close(got.double(), want, rtol=2**-7, atol=1e-2)  # the output rounding
    assert torch.equal(got, cpu_dense.upcast_linear(x, weight, bias))


def test_dispatch_by_rows_dtype_and_cpu(monkeypatch):
    monkeypatch.setattr(cpu_dense, "native_half_matmul", lambda: False)
    rows = cpu_dense.UPCAST_MIN_ROWS
    assert cpu_dense.use_upcast(torch.zeros(rows, 8, dtype=torch.bfloat16))
    assert not cpu_dense.use_upcast(torch.zeros(rows - 1, 8, dtype=torch.bfloat16))  # decode
    assert not cpu_dense.use_upcast(torch.zeros(rows, 8))  # fp32 already
    monkeypatch.setattr(cpu_dense, "native_half_matmul", lambda: True)  # AMX: torch's bf16
    assert not cpu_dense.use_upcast(torch.zeros(rows, 8, dtype=torch.bfloat16))


def test_ops_linear_matches_f_linear(monkeypatch):
    monkeypatch.setattr(cpu_dense, "native_half_matmul", lambda: False)
    x, weight = torch.randn(16, 32).bfloat16(), torch.randn(24, 32).bfloat16()
    torch.testing.assert_close(ops.linear(x, weight), F.linear(x, weight), rtol=2**-7, atol=1e-2)
    x32, w32 = x.float(), weight.float()
    assert torch.equal(ops.linear(x32, w32), F.linear(x32, w32))


# ---------------------------------------------------------------------------- bf16 GEMV


@pytest.fixture
def gemv_built() -> None:
    require_built(cpu_dense.load_library(), "CPU bf16 GEMV")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    ("M", "N", "K"),
    [(1, 1536, 576), (2, 7, 64), (3, 13, 577), (1, 4, 31), (1, 49152 // 64, 576)],
    ids=["mlp", "rows-tail", "k-tail", "short-k", "head-slice"],
)
def test_bf16_gemv_is_one_rounding_of_the_fp32_product(gemv_built, M, N, K, bias):
    """Exact products summed in fp32, rounded once: equal to the fp64 product rounded to bf16
    up to the fp32 sum's order (a bf16 ulp at most, where the sum sits on a rounding edge)."""
    gen = torch.Generator().manual_seed(M * N + K)
    x = torch.randn(M, K, generator=gen).bfloat16()
    weight = torch.randn(N, K, generator=gen).bfloat16()
    b = torch.randn(N, generator=gen).bfloat16() if bias else None
    got = cpu_dense.bf16_gemv(x, weight, b)
    want = F.linear(x.double(), weight.double(), None if b is None else b.double())
    assert got.dtype == torch.bfloat16 and got.shape == (M, N)
    torch.testing.assert_close(got.double(), want, rtol=2**-7, atol=1e-5)
    assert (got != want.bfloat16()).float().mean() < 0.02


def test_bf16_gemv_reads_strided_rows(gemv_built):
    x = torch.randn(3, 200).bfloat16()[:, :96]  # rows 200 apart
    weight = torch.randn(40, 96).bfloat16()
    strided = cpu_dense.bf16_gemv(x, weight)
    torch.testing.assert_close(strided, cpu_dense.bf16_gemv(x.contiguous(), weight), rtol=0, atol=0)


def test_ops_linear_takes_the_gemv_for_bf16_decode_rows(gemv_built, monkeypatch):
    calls = []
    gemv = cpu_dense.bf16_gemv
    monkeypatch.setattr(cpu_dense, "bf16_gemv", lambda *a: calls.append(a[0].shape[0]) or gemv(*a))
    weight = torch.randn(24, 32).bfloat16()
    for M in (1, cpu_dense.GEMV_MAX_ROWS, cpu_dense.GEMV_MAX_ROWS + 1):
        ops.linear(torch.randn(M, 32).bfloat16(), weight)
    ops.linear(torch.randn(1, 32), weight.float())  # fp32: torch
    ops.linear(torch.randn(1, 32).bfloat16(), weight.t().contiguous().t())  # strided weight
    assert calls == [1, cpu_dense.GEMV_MAX_ROWS]


def test_bf16_gemv_refuses_a_width_mismatch(gemv_built):
    with pytest.raises(ValueError, match="does not fit"):
        cpu_dense.bf16_gemv(torch.zeros(1, 8).bfloat16(), torch.zeros(4, 16).bfloat16())
