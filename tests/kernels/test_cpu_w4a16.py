"""The C++ CPU W4A16 kernel (qserve.kernels.cpu_w4a16) against the torch references.

Fresh random codes, zero points and scales (never zeros) in the GPTQ and AWQ layouts; the
references dequantize in fp32 and multiply densely (`w4a16_ref`), on x rounded to int8 where
the loop takes 16-bit x so. Rows M cover the register loop (1, 3, 17: single row, several row
tiles and a remainder), 64 (the int8 loop's last, else the dequantize-then-GEMM path) and 70
(that path everywhere); N covers 1 to 5 blocks of 8 outputs (every tail of the 4-block tile).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from qserve.kernels import cpu_w4a16, packing
from qserve.kernels.w4a16_ref import awq_gemm_ref, gptq_gemm_ref, quantize_activations_ref
from tests.kernels._helpers import require_built

# max |out - ref| / max |ref|: fp32 differs from the reference in summation order only; bf16
# and fp16 round the output (and bf16 the input, the same for both sides) to 8 / 11 bits.
TOL = {torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}
ROWS = [1, 3, 17, 64, 70]


@pytest.fixture(autouse=True)
def _built() -> None:
    torch.set_num_threads(1)
    require_built(cpu_w4a16.load_library(), "CPU W4A16")


def gptq_tensors(K: int, N: int, group: int, act_order: bool, sym: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    gs = K if group == -1 else group
    G = K // gs
    q = torch.randint(0, 16, (K, N), generator=gen)
    zeros = torch.full((G, N), 8) if sym else torch.randint(1, 16, (G, N), generator=gen)
    scales = (torch.rand(G, N, generator=gen) * 0.02 + 0.001).half()
    perm = torch.randperm(K, generator=gen) if act_order else None
    g_idx = packing.gptq_g_idx(K, gs, perm)
    return packing.pack_gptq_qweight(q, 4), packing.pack_gptq_qzeros(zeros, 4), scales, g_idx


def as_the_loop_reads(x: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    """x as the C++ loop multiplies it: rounded to int8 per group where it takes 16-bit x
    through int8 (`int8_activations`), else unchanged."""
    if cpu_w4a16._gemv_rows(x) and cpu_w4a16.int8_activations(x.dtype):
        return quantize_activations_ref(x, g_idx)
    return x


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize(
    ("K", "N", "group", "act_order", "sym"),
    [
        (128, 64, 32, False, False),
        (128, 64, 32, True, False),
        (192, 40, 64, True, True),  # 5 blocks: a 4-block tile and a 1-block tail
        (256, 24, 128, False, True),  # 3 blocks
        (96, 16, -1, False, False),  # per channel, 2 blocks
        (72, 8, 24, False, False),  # a group torch's kernel does not take, 1 block
    ],
)
def test_gptq_matches_reference(K, N, group, act_order, sym, M, dtype):
    qweight, qzeros, scales, g_idx = gptq_tensors(K, N, group, act_order, sym, seed=K * N + M)
    w = cpu_w4a16.w4_from_gptq(qweight, qzeros, scales, g_idx)
    assert (w.perm is not None) == act_order
    x = torch.randn(M, K).to(dtype)
    bias = torch.randn(N)
    out = cpu_w4a16.w4_mm(x, w, bias)
    ref = gptq_gemm_ref(as_the_loop_reads(x, g_idx), qweight, qzeros, scales.float(), g_idx, 4,
                        bias)  # fmt: skip
    assert out.shape == (M, N) and out.dtype == dtype
    assert rel_err(out, ref) <= TOL[dtype]


@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize(("K", "N", "group"), [(128, 64, 32), (256, 48, 128), (64, 8, -1)])
def test_awq_matches_reference(K, N, group, M):
    gen = torch.Generator().manual_seed(M + K)
    gs = K if group == -1 else group
    q = torch.randint(0, 16, (K, N), generator=gen)
    zeros = torch.randint(0, 16, (K // gs, N), generator=gen)
    scales = (torch.rand(K // gs, N, generator=gen) * 0.02 + 0.001).half()
    qweight, qzeros = packing.pack_awq_qweight(q), packing.pack_awq_qzeros(zeros)
    w = cpu_w4a16.w4_from_awq(qweight, qzeros, scales, group)
    x = torch.randn(M, K, dtype=torch.bfloat16)
    out = cpu_w4a16.w4_mm(x, w)
    x_read = as_the_loop_reads(x, torch.arange(K) // gs)
    ref = awq_gemm_ref(x_read, qweight, qzeros, scales.float(), group)
    assert rel_err(out, ref) <= TOL[torch.bfloat16]


@pytest.mark.parametrize("M", [1, 40])
@pytest.mark.parametrize("act_order", [False, True])
def test_concat_runs_the_weights_side_by_side(M, act_order):
    """Fused q/k/v: one call on the concatenated weight equals the separate calls, and the
    split views are the separate weights again."""
    gen = torch.Generator().manual_seed(7)
    perm = torch.randperm(128, generator=gen) if act_order else None
    sizes = [64, 16, 16]
    weights = []
    for N in sizes:  # q, k, v share the input channels' order (one Hessian)
        q = torch.randint(0, 16, (128, N), generator=gen)
        zeros = torch.randint(1, 16, (4, N), generator=gen)
        scales = torch.rand(4, N, generator=gen) * 0.02 + 0.001
        g_idx = packing.gptq_g_idx(128, 32, perm)
        tensors = (packing.pack_gptq_qweight(q, 4), packing.pack_gptq_qzeros(zeros, 4))
        weights.append(cpu_w4a16.w4_from_gptq(*tensors, scales.half(), g_idx))
    fused = cpu_w4a16.concat(weights)
    x = torch.randn(M, 128)
    want = torch.cat([cpu_w4a16.w4_mm(x, w) for w in weights], dim=1)
    assert torch.equal(cpu_w4a16.w4_mm(x, fused), want)
    for part, w in zip(cpu_w4a16.split(fused, sizes), weights, strict=True):
        assert torch.equal(part.codes, w.codes) and torch.equal(part.zs, w.zs)
        assert part.codes.data_ptr() != w.codes.data_ptr()  # views into the fused weight


def test_large_batches_dequantize_in_chunks(monkeypatch):
    qweight, qzeros, scales, g_idx = gptq_tensors(128, 200, 32, True, False, seed=3)
    w = cpu_w4a16.w4_from_gptq(qweight, qzeros, scales, g_idx)
    x, bias = torch.randn(40, 128), torch.randn(200)
    whole = cpu_w4a16.w4_mm(x, w, bias)
    monkeypatch.setattr(cpu_w4a16, "DEQUANT_CHUNK_BYTES", 4 * 8 * 128 * 3)  # 24 outputs a chunk
    chunked = cpu_w4a16.w4_mm(x, w, bias)
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6)
    ref = gptq_gemm_ref(x, qweight, qzeros, scales.float(), g_idx, 4, bias)
    assert rel_err(chunked, ref) <= TOL[torch.float32]


def test_bf16_dequantize_rounds_as_torch():
    qweight, qzeros, scales, g_idx = gptq_tensors(128, 40, 32, False, False, seed=5)
    w = cpu_w4a16.w4_from_gptq(qweight, qzeros, scales, g_idx)
    bf16 = cpu_w4a16.w4_dequantize_t(w, torch.bfloat16)
    assert bf16.dtype == torch.bfloat16
    assert torch.equal(bf16, cpu_w4a16.w4_dequantize_t(w).to(torch.bfloat16))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_w4a16.w4_dequantize_t(w, torch.float16)


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("M", [15, 16, 40])
def test_bf16_batches_take_a_bf16_gemm_where_it_is_native(monkeypatch, native: bool, M: int):
    """With native bf16 matmuls, bf16 batches of NATIVE_BF16_GEMM_MIN_ROWS rows or more
    dequantize to bf16 (elsewhere: the C++ loop up to GEMV_MAX_ROWS, then fp32), where 16-bit
    x does not go through int8."""
    monkeypatch.setattr(cpu_w4a16, "native_half_matmul", lambda: native)
    monkeypatch.setattr(cpu_w4a16, "int8_activations", lambda dtype: False)
    dtypes = _record_dequantize(monkeypatch)
    qweight, qzeros, scales, g_idx = gptq_tensors(128, 48, 32, True, False, seed=M)
    w = cpu_w4a16.w4_from_gptq(qweight, qzeros, scales, g_idx)
    x, bias = torch.randn(M, 128).to(torch.bfloat16), torch.randn(48)
    out = cpu_w4a16.w4_mm(x, w, bias)
    ref = gptq_gemm_ref(as_the_loop_reads(x, g_idx), qweight, qzeros, scales.float(), g_idx, 4,
                        bias)  # fmt: skip
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) <= TOL[torch.bfloat16]
    gemm = M >= (cpu_w4a16.NATIVE_BF16_GEMM_MIN_ROWS if native else cpu_w4a16.GEMV_MAX_ROWS + 1)
    assert dtypes == ([torch.bfloat16 if native else torch.float32] if gemm else [])


def _record_dequantize(monkeypatch) -> list[torch.dtype]:
    """The dtypes w4_mm dequantizes to from now on (none: the C++ loop ran)."""
    dtypes: list[torch.dtype] = []
    dequantize = cpu_w4a16.w4_dequantize_t
    monkeypatch.setattr(
        cpu_w4a16,
        "w4_dequantize_t",
        lambda w, d=torch.float32: dtypes.append(d) or dequantize(w, d),
    )
    return dtypes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("act_order", [False, True])
def test_int8_activations_cost_little_against_exact_math(dtype, act_order):
    """Where 16-bit x goes through int8, the result stays within 1% of the exact product's
    scale (the rounding of x itself, not only of the output, is what the loop adds)."""
    if not cpu_w4a16.int8_activations(dtype):
        pytest.skip("this CPU keeps the exact loop for 16-bit x")
    qweight, qzeros, scales, g_idx = gptq_tensors(512, 64, 128, act_order, False, seed=11)
    w = cpu_w4a16.w4_from_gptq(qweight, qzeros, scales, g_idx)
    x = torch.randn(4, 512).to(dtype)
    exact = gptq_gemm_ref(x, qweight, qzeros, scales.float(), g_idx, 4)
    out = cpu_w4a16.w4_mm(x, w)
    assert rel_err(out, exact) <= 1e-2
    assert rel_err(quantize_activations_ref(x, g_idx), x) <= 1 / 254 + 1e-6


def test_int8_activations_keep_all_zero_groups_zero():
    x = torch.zeros(2, 64)
    x[1, 32:] = torch.linspace(-1, 1, 32)
    out = quantize_activations_ref(x, torch.arange(64) // 32)
    assert torch.equal(out[:, :32], torch.zeros(2, 32)) and torch.equal(out[0], torch.zeros(64))


@pytest.mark.parametrize("M", [16, 64, 65])
def test_int8_activations_run_the_loop_up_to_its_row_limit(monkeypatch, M: int):
    if not cpu_w4a16.int8_activations(torch.bfloat16):
        pytest.skip("this CPU keeps the exact loop for 16-bit x")
    dtypes = _record_dequantize(monkeypatch)
    qweight, qzeros, scales, g_idx = gptq_tensors(128, 48, 32, True, False, seed=M)
    w = cpu_w4a16.w4_from_gptq(qweight, qzeros, scales, g_idx)
    x = torch.randn(M, 128).to(torch.bfloat16)
    out = cpu_w4a16.w4_mm(x, w)
    ref = gptq_gemm_ref(as_the_loop_reads(x, g_idx), qweight, qzeros, scales.float(), g_idx, 4)
    assert rel_err(out, ref) <= TOL[torch.bfloat16]
    assert (dtypes == []) == (M <= cpu_w4a16.INT8_LOOP_MAX_ROWS)


def test_concat_refuses_different_groups():
    a = cpu_w4a16.w4_from_codes(
        torch.zeros(64, 8, dtype=torch.int64), torch.ones(2, 8), torch.zeros(2, 8), 32
    )
    b = cpu_w4a16.w4_from_codes(
        torch.zeros(64, 8, dtype=torch.int64), torch.ones(1, 8), torch.zeros(1, 8), 64
    )
    with pytest.raises(ValueError, match="group size"):
        cpu_w4a16.concat([a, b])


def test_reference_is_plain_dense_math():
    """The packed weight dequantizes to scale * (q - zero) per the GPTQ definition."""
    K, N, gs = 64, 16, 32
    qweight, qzeros, scales, g_idx = gptq_tensors(K, N, gs, True, False, seed=3)
    w = cpu_w4a16.w4_from_gptq(qweight, qzeros, scales, g_idx)
    q = packing.unpack_gptq_qweight(qweight, 4)
    zeros = packing.unpack_gptq_qzeros(qzeros, 4)
    g = g_idx.long()
    dense = (scales.float()[g] * (q - zeros[g]).float()).t()  # [N, K], original channel order
    torch.testing.assert_close(cpu_w4a16.w4_dequantize_t(w).t(), dense[:, w.perm])
    x = torch.randn(3, K)
    torch.testing.assert_close(cpu_w4a16.w4_mm(x, w), x @ dense.t(), rtol=1e-5, atol=1e-5)


def test_strided_rows_and_leading_dims():
    qweight, qzeros, scales, g_idx = gptq_tensors(64, 32, 32, False, False, seed=5)
    w = cpu_w4a16.w4_from_gptq(qweight, qzeros, scales, g_idx)
    x = torch.randn(2, 3, 128)[..., :64]  # rows 128 apart
    out = cpu_w4a16.w4_mm(x, w)
    ref = gptq_gemm_ref(x.reshape(-1, 64), qweight, qzeros, scales.float(), g_idx, 4)
    assert out.shape == (2, 3, 32)
    assert rel_err(out.reshape(-1, 32), ref) <= TOL[torch.float32]


def test_threads_give_the_same_result():
    qweight, qzeros, scales, g_idx = gptq_tensors(128, 96, 32, False, False, seed=9)
    w = cpu_w4a16.w4_from_gptq(qweight, qzeros, scales, g_idx)
    x = torch.randn(5, 128)
    one = cpu_w4a16.w4_mm(x, w)
    torch.set_num_threads(2)
    torch.testing.assert_close(cpu_w4a16.w4_mm(x, w), one, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("K", "N", "group"), [(64, 12, 32), (60, 16, 20), (64, 16, 12)], ids=["N", "K", "group"]
)
def test_shapes_the_kernel_does_not_take_raise(K, N, group):
    q = torch.randint(0, 16, (K, N))
    G = K // group
    with pytest.raises(ValueError, match="multiples of 8"):
        cpu_w4a16.w4_from_codes(q, torch.rand(G, N), torch.full((G, N), 8), group)


def test_wrong_input_width_raises():
    qweight, qzeros, scales, g_idx = gptq_tensors(64, 16, 32, False, False, seed=1)
    w = cpu_w4a16.w4_from_gptq(qweight, qzeros, scales, g_idx)
    with pytest.raises(ValueError, match="does not fit"):
        cpu_w4a16.w4_gemv(torch.randn(1, 72), w)


def test_import_compiles_nothing():
    code = (
        "import sys\n"
        "import qserve, qserve.model.quant\n"
        "from qserve.kernels import cpu_w4a16 as c\n"
        "assert c.load_library.cache_info().currsize == 0\n"
        "assert 'torch.utils.cpp_extension' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
