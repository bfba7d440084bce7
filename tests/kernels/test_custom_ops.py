"""The C++ CPU kernels as torch custom ops (qserve.kernels.custom_ops).

Each op passes `torch.library.opcheck` (schema and mutation annotations, fake tensor kernel,
autograd registration, AOT dispatch) on small CPU inputs, and one decoder layer's op sequence
through `ops` compiles with fullgraph=True (no graph break) and matches eager bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from qserve.kernels import (
    cpu_build,
    cpu_dense,
    cpu_model_ops,
    cpu_paged_attention,
    cpu_w4a16,
    custom_ops,
    ops,
)
from tests.kernels._helpers import require_built

DTYPES = [torch.float32, torch.bfloat16]
HQ, HK, D, BLOCK, NUM_BLOCKS = 4, 2, 64, 16, 4


@pytest.fixture(autouse=True)
def _built() -> None:
    require_built(cpu_model_ops.load_library(), "CPU model ops")
    require_built(cpu_paged_attention.load_library(), "CPU paged attention")
    require_built(cpu_w4a16.load_library(), "CPU W4A16")


def opcheck(op, args: tuple, grad: bool = True, schema: bool = True) -> None:
    """opcheck with every check; `grad=False` drops the autograd one (no float input that
    the op does not mutate, so none can require grad); `schema=False` the schema one, whose
    mutation detection does arithmetic that torch lacks for fp8 tensors."""
    utils = ["test_faketensor", "test_aot_dispatch_dynamic"]
    if schema:
        utils.append("test_schema")
    if grad:
        utils.append("test_autograd_registration")
    torch.library.opcheck(getattr(op, "op", op), args, test_utils=utils)


def rand(*shape: int, dtype: torch.dtype = torch.float32, grad: bool = False) -> torch.Tensor:
    return torch.randn(*shape).to(dtype).requires_grad_(grad)


def paged_inputs(dtype: torch.dtype, num_seqs: int = 2) -> dict[str, torch.Tensor]:
    """A filled cache and decode metadata: sequence i holds 5 + 9 i tokens in block i."""
    seq_lens = torch.tensor([5 + 9 * i for i in range(num_seqs)], dtype=torch.int32)
    return {
        "kv_cache": rand(2, NUM_BLOCKS, BLOCK, HK, D, dtype=dtype),
        "block_tables": torch.arange(num_seqs, dtype=torch.int32).reshape(num_seqs, 1),
        "seq_lens": seq_lens,
        "query_start_loc": torch.arange(num_seqs + 1, dtype=torch.int32),
        "slot_mapping": torch.arange(num_seqs) * BLOCK + seq_lens.long() - 1,
    }


def cos_sin_cache(max_pos: int = 64) -> torch.Tensor:
    freqs = torch.outer(torch.arange(max_pos).float(), torch.rand(D // 2))
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


# ------------------------------------------------------------------------------ opcheck


@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck_norms_and_activation(dtype):
    x, w = rand(3, 64, dtype=dtype), rand(64, dtype=dtype, grad=True)
    opcheck(custom_ops.rms_norm, (x, w, 1e-6))
    opcheck(custom_ops.fused_add_rms_norm, (x, rand(3, 64, dtype=dtype), w, 1e-6))
    opcheck(custom_ops.silu_and_mul, (rand(3, 96, dtype=dtype, grad=True),))


@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck_rope_on_views_of_one_qkv(dtype):
    qkv = rand(3, (HQ + 2 * HK) * D, dtype=dtype)
    q, k, _ = qkv.split([HQ * D, HK * D, HK * D], dim=-1)
    args = (q, k, torch.tensor([0, 7, 30]), cos_sin_cache(), D)
    opcheck(custom_ops.rope_neox, args, grad=False)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_opcheck_cache_write_and_attention(cache_dtype):
    p = paged_inputs(torch.bfloat16)
    kv_cache = p["kv_cache"].to(cache_dtype)
    key, value = rand(2, HK, D, dtype=torch.bfloat16), rand(2, HK, D, dtype=torch.bfloat16)
    k_scale, v_scale = torch.full((HK,), 0.5), torch.tensor(2.0)
    write = (key, value, kv_cache, p["slot_mapping"], k_scale, v_scale)
    fp8 = cache_dtype == torch.float8_e4m3fn
    opcheck(custom_ops.reshape_and_cache, write, grad=False, schema=not fp8)
    query = rand(2, HQ, D, dtype=torch.bfloat16, grad=True)
    meta = (p["block_tables"], p["seq_lens"], p["query_start_loc"])
    for window in (None, 4):
        args = (query, kv_cache, *meta, D**-0.5, k_scale, v_scale, window)
        opcheck(custom_ops.paged_attention, args, schema=not fp8)


def test_opcheck_bf16_gemv():
    require_built(cpu_dense.load_library(), "CPU bf16 GEMV")
    x, weight = rand(2, 64, dtype=torch.bfloat16), rand(12, 64, dtype=torch.bfloat16)
    opcheck(custom_ops.bf16_gemv, (x, weight, rand(12)))
    opcheck(custom_ops.bf16_gemv, (x.requires_grad_(True), weight, None))


def test_opcheck_w4a16():
    gen = torch.Generator().manual_seed(0)
    K, N, G = 64, 32, 2
    q = torch.randint(0, 16, (K, N), generator=gen)
    w = cpu_w4a16.w4_from_codes(q, torch.rand(G, N) + 0.1, torch.full((G, N), 8.0), K // G)
    for x, bias in ((rand(3, K, grad=True), None), (rand(1, K, dtype=torch.bfloat16), rand(N))):
        args = (x, w.codes, w.scales, w.zs, w.perm, bias, w.group_size)
        opcheck(custom_ops.w4a16_gemm, args, grad=x.requires_grad)
    for dtype in (torch.float32, torch.bfloat16):
        args = (w.codes, w.scales, w.zs, w.group_size, dtype)
        opcheck(custom_ops.w4a16_dequantize, args, grad=False)


# ------------------------------------------------------------------------- torch.compile


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 40])
def test_w4_matmul_compiles_without_graph_breaks(dtype, M):
    """M = 1: the C++ loop (`w4a16_gemm`); M = 40: the dequantize op and a GEMM."""
    gen = torch.Generator().manual_seed(M)
    K, N, G = 64, 32, 2
    q = torch.randint(0, 16, (K, N), generator=gen)
    w = cpu_w4a16.w4_from_codes(q, torch.rand(G, N) + 0.1, torch.full((G, N), 8.0), K // G)
    bias = rand(N)

    def f(x: torch.Tensor) -> torch.Tensor:
        return cpu_w4a16.w4_mm(x, w, bias)

    x = rand(M, K, dtype=dtype)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(f, fullgraph=True, backend="aot_eager")(x), f(x))


def decoder_layer_ops(
    hidden: torch.Tensor,
    residual: torch.Tensor,
    norm_w: torch.Tensor,
    qkv_w: torch.Tensor,
    up_w: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder layer's op sequence through `ops` (dense projections, tiny shapes)."""
    x, residual = ops.rms_norm(hidden, norm_w, 1e-6, residual)
    T = x.shape[0]
    q, k, v = (x @ qkv_w).split([HQ * D, HK * D, HK * D], dim=-1)
    q, k = ops.rope_neox(q, k, positions, cos_sin, D)
    ops.reshape_and_cache(k.view(T, HK, D), v.view(T, HK, D), kv_cache, slot_mapping)
    attn = ops.paged_attention(
        q.view(T, HQ, D), kv_cache, block_tables, seq_lens, query_start_loc, D**-0.5
    )
    h = ops.rms_norm(attn.reshape(T, HQ * D), norm_w[: HQ * D].contiguous(), 1e-6)
    return ops.silu_and_mul(h @ up_w), residual


@pytest.mark.parametrize("dtype", DTYPES)
def test_decoder_layer_compiles_without_graph_breaks_and_matches_eager(dtype):
    H = HQ * D
    p = paged_inputs(dtype)
    inputs = [
        rand(2, H, dtype=dtype),
        rand(2, H, dtype=dtype),
        rand(H, dtype=dtype),
        rand(H, (HQ + 2 * HK) * D, dtype=dtype) * 0.05,
        rand(H, 2 * 96, dtype=dtype) * 0.05,
        p["seq_lens"].long() - 1,
        cos_sin_cache(),
        p["kv_cache"],
        p["slot_mapping"],
        p["block_tables"],
        p["seq_lens"],
        p["query_start_loc"],
    ]
    eager_in = [t.clone() for t in inputs]
    want = decoder_layer_ops(*eager_in)
    torch._dynamo.reset()
    compiled = torch.compile(decoder_layer_ops, fullgraph=True, backend="aot_eager")
    got = compiled(*inputs)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    assert torch.equal(inputs[1], eager_in[1])  # the residual, updated in place
    assert torch.equal(inputs[7], eager_in[7])  # the cache, written in place


def test_constant_while_tracing_sets_the_marker_of_assume_constant_result():
    def probe() -> bool:
        return True

    marked = torch.compiler.assume_constant_result(probe)
    markers = {k for k, v in vars(marked).items() if v is True}
    assert markers and markers <= set(vars(cpu_build.constant_while_tracing(lambda: True)))


def test_compiled_graph_holds_the_custom_ops():
    seen: list[str] = []

    def backend(gm: torch.fx.GraphModule, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    def f(x, w, residual):
        out, residual = ops.rms_norm(x, w, 1e-6, residual)
        return ops.silu_and_mul(ops.rms_norm(out, w, 1e-6)), residual

    torch._dynamo.reset()
    x, w, residual = rand(1, 64), rand(64), rand(1, 64)
    torch.compile(f, fullgraph=True, backend=backend)(x, w, residual)
    assert "qserve.fused_add_rms_norm.default" in seen
    assert "qserve.rms_norm.default" in seen
    assert "qserve.silu_and_mul.default" in seen
