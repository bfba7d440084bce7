"""The C++ CPU paged-attention kernel (decode rows) against the torch reference."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

from qserve.errors import QServeError
from qserve.kernels import cpu_build, ops
from qserve.kernels import cpu_paged_attention as cpa
from qserve.kernels.attention_ref import paged_attention_ref, quantize_to_cache
from tests.kernels._helpers import assert_out_close, require_built


@pytest.fixture(scope="module")
def compiled() -> None:
    """Wherever a C++ compiler is found, the kernel must build (ninja comes with qserve)."""
    require_built(cpa.load_library(), "CPU paged-attention")


needs_kernel = pytest.mark.usefixtures("compiled")


def make_cache(num_blocks, block_size, num_kv_heads, head_dim, cache_dtype, scales):
    """Random pages (every slot filled, never zeros), quantized with the FP8 scales."""
    x = torch.randn(2 * num_blocks * block_size, num_kv_heads, head_dim)
    k = quantize_to_cache(x[: len(x) // 2], cache_dtype, scales[0])
    v = quantize_to_cache(x[len(x) // 2 :], cache_dtype, scales[1])
    return torch.stack([k, v]).view(2, num_blocks, block_size, num_kv_heads, head_dim)


def make_batch(seq_lens, query_lens, block_size, extra_blocks=3):
    """Shuffled block tables (one spare column), seq_lens and query_start_loc as int32."""
    need = [-(-n // block_size) for n in seq_lens]
    perm = torch.randperm(sum(need) + extra_blocks)
    tables = torch.zeros(len(seq_lens), max(need) + 1, dtype=torch.int32)
    used = 0
    for i, nb in enumerate(need):
        tables[i, :nb] = perm[used : used + nb]
        used += nb
    qsl = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32)
    return tables, torch.tensor(seq_lens, dtype=torch.int32), qsl, len(perm)


def fp8_scales(kind, num_kv_heads):
    if kind == "tensor":
        return 0.02, 0.03
    if kind == "head":
        return torch.rand(num_kv_heads) * 0.03 + 0.01, torch.rand(num_kv_heads) * 0.03 + 0.01
    return 1.0, 1.0


def run_both(
    seq_lens,
    query_lens,
    heads=(8, 2),
    head_dim=64,
    block_size=16,
    dtype=torch.float32,
    cache_dtype=None,
    scales="none",
):
    num_heads, num_kv_heads = heads
    tables, lens, qsl, num_blocks = make_batch(seq_lens, query_lens, block_size)
    k_scale, v_scale = fp8_scales(scales, num_kv_heads)
    cache = make_cache(
        num_blocks, block_size, num_kv_heads, head_dim, cache_dtype or dtype, (k_scale, v_scale)
    )
    query = (2 * torch.randn(int(qsl[-1]), num_heads, head_dim)).to(dtype)
    args = (query, cache, tables, lens, qsl, head_dim**-0.5, k_scale, v_scale)
    return ops.paged_attention(*args), paged_attention_ref(*args)


RAGGED = [1, 17, 16, 33, 100, 5, 64, 250]  # 1, exact blocks, partial last blocks


@needs_kernel
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 2), (8, 1)])
def test_decode_fp32_matches_reference(head_dim, block_size, heads) -> None:
    out, ref = run_both(RAGGED, [1] * len(RAGGED), heads, head_dim, block_size)
    assert_out_close(out, ref)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_decode_half_precision_pages_and_queries(dtype, head_dim) -> None:
    out, ref = run_both(RAGGED, [1] * len(RAGGED), (8, 2), head_dim, 16, dtype)
    assert_out_close(out, ref)


@needs_kernel
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("scales", ["tensor", "head"])
@pytest.mark.parametrize("dtype,head_dim,block_size", [(torch.float32, 64, 16),
                                                       (torch.float32, 128, 32),
                                                       (torch.bfloat16, 64, 32),
                                                       (torch.bfloat16, 256, 16)])  # fmt: skip
def test_decode_fp8_pages_with_scales(cache_dtype, scales, dtype, head_dim, block_size) -> None:
    out, ref = run_both(
        RAGGED, [1] * len(RAGGED), (9, 3), head_dim, block_size, dtype, cache_dtype, scales
    )
    assert_out_close(out, ref)


@needs_kernel
@pytest.mark.parametrize(
    "cache_dtype,scales",
    [(torch.float32, "none"), (torch.bfloat16, "none"), (torch.float8_e4m3fn, "head")],
)
def test_mixed_decode_and_prefill_batch_through_ops(cache_dtype, scales, monkeypatch) -> None:
    """Decodes, a full prompt, a chunk after cached context and an idle sequence in one batch:
    decode rows go through the kernel, the rest through the reference."""
    calls = []
    decode = cpa.paged_attention_decode
    monkeypatch.setattr(cpa, "paged_attention_decode", lambda *a: calls.append(1) or decode(*a))
    seq_lens, query_lens = [40, 1, 23, 70, 9, 129], [1, 1, 23, 30, 0, 1]
    dtype = torch.bfloat16 if cache_dtype == torch.bfloat16 else torch.float32
    out, ref = run_both(seq_lens, query_lens, (6, 2), 64, 16, dtype, cache_dtype, scales)
    assert calls == [1]
    assert_out_close(out, ref)


@needs_kernel
def test_decode_leaves_other_rows_untouched() -> None:
    seq_lens, query_lens = [20, 7, 33], [1, 3, 1]
    tables, lens, qsl, num_blocks = make_batch(seq_lens, query_lens, 16)
    cache = make_cache(num_blocks, 16, 2, 64, torch.float32, (1.0, 1.0))
    query = torch.randn(5, 4, 64)
    out = torch.full_like(query, 7.0)
    cpa.paged_attention_decode(out, query, cache, tables, lens, qsl, 0.125)
    assert (out[1:4] == 7.0).all()
    ref = paged_attention_ref(query, cache, tables, lens, qsl, 0.125)
    assert_out_close(out[[0, 4]], ref[[0, 4]])


@needs_kernel
def test_strided_query_and_int64_indices() -> None:
    """A query that is a view of a wider projection output; int64 tables and lengths."""
    tables, lens, qsl, num_blocks = make_batch([30, 3, 47], [1, 1, 1], 16)
    cache = make_cache(num_blocks, 16, 2, 64, torch.float32, (1.0, 1.0))
    qkv = torch.randn(3, 12, 64)
    query = qkv[:, :8]  # [3, 8, 64], token stride 12 * 64
    out = torch.empty_like(query)
    cpa.paged_attention_decode(out, query, cache, tables.long(), lens.long(), qsl.long(), 0.125)
    assert_out_close(out, paged_attention_ref(query, cache, tables, lens, qsl, 0.125))


@needs_kernel
def test_bad_block_ids_and_lengths_raise() -> None:
    tables, lens, qsl, num_blocks = make_batch([20, 5], [1, 1], 16)
    cache = make_cache(num_blocks, 16, 1, 64, torch.float32, (1.0, 1.0))
    query = torch.randn(2, 2, 64)
    out = torch.empty_like(query)
    bad = tables.clone()
    bad[0, 1] = num_blocks
    with pytest.raises(ValueError, match="block id"):
        cpa.paged_attention_decode(out, query, cache, bad, lens, qsl, 0.125)
    too_long = torch.tensor([20, 16 * tables.shape[1] + 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="seq_len"):
        cpa.paged_attention_decode(out, query, cache, tables, too_long, qsl, 0.125)
    for bad_qsl in ([0, 1, 3], [-1, 0, 2], [0, 2, 1]):  # past the rows, negative, falling
        with pytest.raises(ValueError, match="query_start_loc"):
            bad = torch.tensor(bad_qsl, dtype=torch.int32)
            cpa.paged_attention_decode(out, query, cache, tables, lens, bad, 0.125)


def test_unsupported_head_dim_and_env_var_take_the_reference(monkeypatch) -> None:
    def boom(*args):
        raise AssertionError("the C++ kernel must not run here")

    monkeypatch.setattr(cpa, "paged_attention_decode", boom)
    out, ref = run_both([10, 3], [1, 1], (4, 2), head_dim=32)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    monkeypatch.setenv(cpa.ENV_VAR, "0")
    out, ref = run_both([10, 3], [1, 1], (4, 2), head_dim=64)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_failed_compile_warns_once_and_falls_back(monkeypatch, caplog) -> None:
    from torch.utils import cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    cpa.load_library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="qserve"):
            for _ in range(2):
                out, ref = run_both([10, 3], [1, 1], (4, 2))
                torch.testing.assert_close(out, ref, rtol=0, atol=0)
        warnings = [r for r in caplog.records if "torch path" in r.message]
        assert len(warnings) == 1
    finally:
        cpa.load_library.cache_clear()


def test_required_kernels_make_a_failed_build_an_error(monkeypatch) -> None:
    """QSERVE_CPU_KERNELS=require (CI's wheel check): no fallback, a one-line QServeError."""
    from torch.utils import cpp_extension

    def broken_build(*args, **kwargs):
        raise RuntimeError("cpu_vec.h: No such file or directory")

    monkeypatch.setenv(cpa.ENV_VAR, "require")
    monkeypatch.setattr(cpp_extension, "load", broken_build)
    cpa.load_library.cache_clear()
    try:
        with pytest.raises(QServeError, match=r"cpu_vec.h: No such file.*=require"):
            cpa.load_library()
        monkeypatch.setenv("CXX", "no-such-compiler-here")
        with pytest.raises(QServeError, match=r"no C\+\+ compiler \(no-such-compiler-here\)"):
            cpa.load_library()
    finally:
        cpa.load_library.cache_clear()


def test_startup_names_the_cpu_kernel_paths(monkeypatch) -> None:
    from torch.utils import cpp_extension

    monkeypatch.setenv(cpa.ENV_VAR, "0")
    assert set(ops.cpu_kernel_paths().values()) == {"torch (QSERVE_CPU_KERNELS=0)"}
    monkeypatch.setenv(cpa.ENV_VAR, "1")
    if cpu_build.compiler() is not None:
        assert ops.cpu_kernel_paths() == {"paged attention": "C++", "model ops": "C++"}
    monkeypatch.setattr(cpp_extension, "load", lambda *a, **k: 1 / 0)
    cpa.load_library.cache_clear()
    try:
        assert ops.cpu_kernel_paths()["paged attention"] == "torch (build failed)"
    finally:
        cpa.load_library.cache_clear()


def test_import_compiles_nothing() -> None:
    code = (
        "import sys\n"
        "import qserve, qserve.kernels.ops, qserve.model.attention\n"
        "from qserve.kernels import cpu_paged_attention as c\n"
        "assert c.load_library.cache_info().currsize == 0\n"
        "assert 'torch.utils.cpp_extension' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
