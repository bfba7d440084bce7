"""The C++ CPU model ops (qserve.kernels.cpu_model_ops) against their torch references.

RoPE and the cache write must be bit-identical (the C++ code rounds where torch rounds).
RMSNorm sums x^2 in another order than torch: its fp32 result differs by rounding, and a 16-bit
output may then land one unit in the last place away, rarely. The fp8 cache write is checked
against torch's cast on every bf16 bit pattern but NaN (finite values and both infinities),
divided by per-tensor and per-head scales. silu_and_mul uses its own exp (about 1 ulp off
torch's): fp32 to rounding, 16 bit within one unit in the last place.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from qserve.kernels import cpu_model_ops, ops
from qserve.kernels.attention_ref import reshape_and_cache_ref
from qserve.kernels.model_ops_ref import rms_norm_ref, rope_neox_ref, silu_and_mul_ref
from tests.kernels._helpers import require_built

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def _built() -> None:
    require_built(cpu_model_ops.load_library(), "CPU model ops")


def norm_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """fp32 to rounding; 16 bit: at most one ulp apart, in under 1% of the values."""
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
        return
    ulps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
    assert int(ulps.max()) <= 1 and float((ulps > 0).float().mean()) < 0.01


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 3, 17])
def test_rms_norm(dtype, M):
    gen = torch.Generator().manual_seed(M)
    x = (torch.randn(M, 576, generator=gen) * 3).to(dtype)
    weight = (torch.rand(576, generator=gen) + 0.5).to(dtype)
    norm_close(cpu_model_ops.rms_norm(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_updates_the_residual_in_place(dtype):
    gen = torch.Generator().manual_seed(1)
    x, residual = (torch.randn(5, 64, generator=gen).to(dtype) for _ in range(2))
    weight = torch.rand(64, generator=gen).to(dtype)
    want_out, want_sum = rms_norm_ref(x, weight, 1e-6, residual.clone())
    out, new_residual = cpu_model_ops.rms_norm(x, weight, 1e-6, residual)
    assert new_residual.data_ptr() == residual.data_ptr()
    assert torch.equal(residual, want_sum)
    norm_close(out, want_out, dtype)


def test_rms_norm_strided_rows():
    x = torch.randn(4, 128)[:, :64]  # rows 128 apart
    weight = torch.rand(64)
    norm_close(ops.rms_norm(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rope_matches_reference_bit_for_bit(dtype, head_dim):
    from qserve.model.rotary import rope_inv_freq

    gen = torch.Generator().manual_seed(head_dim)
    inv_freq = rope_inv_freq(head_dim, 10000.0, None)
    freqs = torch.arange(4096).float()[:, None] * inv_freq[None, :]
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).contiguous()
    T = 7
    q = torch.randn(T, 9 * head_dim, generator=gen).to(dtype)
    k = torch.randn(T, 3 * head_dim, generator=gen).to(dtype)
    positions = torch.randint(0, 4096, (T,), generator=gen)
    want_q, want_k = rope_neox_ref(q, k, positions, cache, head_dim)
    got_q, got_k = cpu_model_ops.rope_neox(q.clone(), k.clone(), positions, cache, head_dim)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def test_rope_rejects_positions_outside_the_cache():
    cache = torch.zeros(16, 64)
    q, k = torch.randn(1, 64), torch.randn(1, 64)
    with pytest.raises(ValueError, match="position"):
        cpu_model_ops.rope_neox(q, k, torch.tensor([16]), cache, 64)


def all_bf16_values() -> torch.Tensor:
    """Every bf16 bit pattern as fp32 [65536] (finite values, +-inf, NaNs)."""
    return torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()


def write_both(key, value, cache_dtype, num_blocks, slots, k_scale=1.0, v_scale=1.0):
    T, Hk, D = key.shape
    want = torch.zeros(2, num_blocks, 4, Hk, D, dtype=cache_dtype)
    got = want.clone()
    reshape_and_cache_ref(key, value, want, slots, k_scale, v_scale)
    cpu_model_ops.reshape_and_cache(key, value, got, slots, k_scale, v_scale)
    return got, want


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.element_size() == 1:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a.view(torch.int16 if a.element_size() == 2 else torch.int32),
                       b.view(torch.int16 if b.element_size() == 2 else torch.int32))  # fmt: skip


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_cast_of_every_bf16_value(cache_dtype):
    """Every bf16 bit pattern, divided by scales that are and are not powers of two."""
    values = all_bf16_values()
    values = values[~values.isnan()]  # torch's NaN encodings are not pinned down here
    values = torch.cat([values, torch.zeros(-values.numel() % 256)])
    key = values.reshape(-1, 4, 64)  # [T, 4 kv heads, 64]
    T = key.shape[0]
    slots = torch.randperm(T * 2)[:T]
    for k_scale in (1.0, 0.37, torch.tensor([0.5, 1.0, 3.3, 1e-3])):
        got, want = write_both(key, -key, cache_dtype, T * 2 // 4, slots, k_scale, 2.0)
        assert same_bits(got, want), f"k_scale {k_scale}"


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("key_dtype", DTYPES)
def test_cache_write_plain_pages(cache_dtype, key_dtype):
    gen = torch.Generator().manual_seed(0)
    key = (torch.randn(9, 2, 64, generator=gen) * 5).to(key_dtype)
    value = torch.randn(9, 2, 64, generator=gen).to(key_dtype)
    slots = torch.tensor([3, -1, 7, 0, 12, -1, 30, 31, 15])  # -1: not written
    got, want = write_both(key, value, cache_dtype, 8, slots)
    assert same_bits(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,D", [(1, 1536), (3, 13), (17, 64)])
def test_silu_and_mul(dtype, M, D):
    gen = torch.Generator().manual_seed(M * D)
    x = (torch.randn(M, 2 * D, generator=gen) * 4).to(dtype)
    x[0, :4] = torch.tensor([-100.0, -30.0, 30.0, 100.0]).to(dtype)  # exp's clamped ends
    got, want = cpu_model_ops.silu_and_mul(x), silu_and_mul_ref(x)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    else:
        torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-3)  # one 16-bit ulp


def test_silu_and_mul_strided_rows_and_dispatch():
    x = torch.randn(4, 256)[:, :128]  # rows 256 apart: gate = cols 0-63, up = 64-127
    torch.testing.assert_close(ops.silu_and_mul(x), silu_and_mul_ref(x), rtol=1e-6, atol=1e-7)


def test_cache_write_rejects_a_slot_outside_the_cache():
    key = torch.randn(1, 1, 64)
    cache = torch.zeros(2, 2, 4, 1, 64)
    with pytest.raises(ValueError, match="slot"):
        cpu_model_ops.reshape_and_cache(key, key, cache, torch.tensor([8]))


def test_kernels_off_takes_the_references(monkeypatch):
    monkeypatch.setenv("QSERVE_CPU_KERNELS", "0")
    q, k = torch.randn(2, 64), torch.randn(2, 64)
    assert not cpu_model_ops.rope_usable(q, k)
    assert not cpu_model_ops.rms_norm_usable(q, torch.ones(64))
    assert not cpu_model_ops.usable(q)


def test_import_compiles_nothing():
    code = (
        "import sys\n"
        "import qserve, qserve.model.llama\n"
        "from qserve.kernels import cpu_model_ops as c\n"
        "assert c.load_library.cache_info().currsize == 0\n"
        "assert 'torch.utils.cpp_extension' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
