"""16-bit dense linears on CPUs without native bf16 (qserve.kernels.cpu_dense, ops.linear)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qserve.kernels import cpu_dense, ops


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
