"""Fused MoE: the align helper against a naive loop, the references against a naive per-token
loop, and the Triton kernel (under the interpreter without CUDA) against the references for
dense, W4A16 GPTQ and W8 (int8 / fp8) experts."""

import pytest
import torch
import torch.nn.functional as F

from qserve.kernels import ops
from qserve.kernels import packing as P
from qserve.kernels.fp8_ref import quantize_weight_fp8_ref
from qserve.kernels.fused_moe import fused_experts, invoke_fused_moe_kernel, moe_gemm, moe_linear
from qserve.kernels.fused_moe_ref import (
    MoEWeight,
    fused_experts_ref,
    moe_align_block_size,
    moe_gemm_ref,
    moe_linear_ref,
)

E = 8


def _close(out: torch.Tensor, ref: torch.Tensor, scale: float = 1.0) -> None:
    """Kernel against reference: fp32 summation order and one output rounding apart."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    eps = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 1e-5}[ref.dtype] * scale
    atol = 2 * eps * ref.float().abs().max().item()
    torch.testing.assert_close(out.cpu().float(), ref.float(), rtol=2 * eps, atol=atol)


def _routing(T: int, k: int, empty: tuple[int, ...] = (0, 5)) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights fp32 [T, k] summing to 1, topk_ids int64 [T, k]): k distinct experts per
    token, never one in `empty` (so those experts get no tokens)."""
    scores = torch.rand(T, E)
    scores[:, list(empty)] = -1.0
    weights, ids = scores.topk(k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), ids


def _dense(N: int, K: int, dtype: torch.dtype) -> MoEWeight:
    return MoEWeight.dense((torch.randn(E, N, K) * K**-0.5).to(dtype))


def _gptq(N: int, K: int, bits: int, group_size: int, act_order: bool) -> MoEWeight:
    gs = K if group_size == -1 else group_size
    G = -(-K // gs)
    parts: list[list[torch.Tensor]] = [[], [], [], []]
    for _ in range(E):
        q = torch.randint(0, 2**bits, (K, N), dtype=torch.int32)
        z = torch.randint(1, 2**bits, (G, N), dtype=torch.int32)
        parts[0].append(P.pack_gptq_qweight(q, bits))
        parts[1].append(P.pack_gptq_qzeros(z, bits))
        parts[2].append((torch.rand(G, N) * 0.02 + 0.002).half())
        parts[3].append(P.gptq_g_idx(K, group_size, torch.randperm(K) if act_order else None))
    qw, qz, s, g = (torch.stack(p) for p in parts)
    return MoEWeight.gptq(qw, qz, s, g if act_order else None, bits)


def _w8(N: int, K: int, fp8: bool, per_channel: bool) -> MoEWeight:
    if fp8:
        pairs = [quantize_weight_fp8_ref(torch.randn(N, K) * 0.05, per_channel) for _ in range(E)]
        w_q = torch.stack([w for w, _ in pairs])
        scales = torch.stack([s.reshape(-1) for _, s in pairs])  # [E, N] or [E, 1]
    else:
        w_q = torch.randint(-128, 128, (E, N, K), dtype=torch.int8)
        scales = torch.rand(E, N if per_channel else 1) * 0.01 + 1e-3
    return MoEWeight.w8(w_q, scales if per_channel else scales.reshape(E))


# ------------------------------------------------------------------------------------ naive


def _naive_align(topk_ids: torch.Tensor, block: int) -> tuple[list[int], list[int]]:
    flat = topk_ids.reshape(-1).tolist()
    sorted_ids: list[int] = []
    expert_ids: list[int] = []
    for e in range(E):
        run = [p for p, pe in enumerate(flat) if pe == e]
        pad = -len(run) % block
        sorted_ids += run + [len(flat)] * pad
        expert_ids += [e] * ((len(run) + pad) // block)
    return sorted_ids, expert_ids


def _naive_weight(weight: MoEWeight, e: int) -> torch.Tensor:
    """W[e] [N, K] in fp64, from the unpacked codes (GPTQ: exact, not rounded to the scales'
    dtype)."""
    if weight.kind == "dense":
        return weight.weight[e].double()
    if weight.kind == "w8":
        return weight.weight[e].double() * weight.scales.reshape(E, -1)[e].double()[:, None]
    q = P.unpack_gptq_qweight(weight.weight[e], weight.bits)  # [K, N]
    z = P.unpack_gptq_qzeros(weight.qzeros[e], weight.bits)  # [G, N]
    K = q.shape[0]
    g_idx = weight.g_idx[e] if weight.g_idx is not None else None
    if g_idx is None:
        g_idx = P.gptq_g_idx(K, P.gptq_group_size(K, z.shape[0]))
    g = g_idx.long()
    s = weight.scales[e]
    return ((q - z[g]).double() * s[g].double()).t()


def _naive_linear(x, weight, topk_weights, topk_ids) -> torch.Tensor:
    out = torch.zeros(x.shape[0], weight.out_features, dtype=torch.float64)
    for t, (ids, ws) in enumerate(zip(topk_ids.tolist(), topk_weights.tolist())):
        for e, w in zip(ids, ws):
            out[t] += w * (x[t].double() @ _naive_weight(weight, e).t())
    return out


# ------------------------------------------------------------------------------------ align


@pytest.mark.parametrize(
    "T,k,block", [(0, 2, 16), (1, 1, 16), (1, 2, 16), (3, 2, 16), (17, 2, 16), (64, 4, 32)]
)
def test_align_matches_naive(T, k, block) -> None:
    _, topk_ids = _routing(T, k)
    sorted_ids, expert_ids, num_post_pad = moe_align_block_size(topk_ids, block, E)
    want_sorted, want_experts = _naive_align(topk_ids, block)
    assert sorted_ids.dtype == expert_ids.dtype == num_post_pad.dtype == torch.int32
    assert sorted_ids.tolist() == want_sorted
    assert expert_ids.tolist() == want_experts
    assert num_post_pad.tolist() == [len(want_sorted)]
    assert 0 not in want_experts and 5 not in want_experts  # experts without tokens: no block


def test_align_every_pair_once() -> None:
    topk_ids = torch.randint(0, E, (40, 3))
    sorted_ids, expert_ids, _ = moe_align_block_size(topk_ids, 16, E)
    real = sorted_ids[sorted_ids < topk_ids.numel()].sort().values
    assert torch.equal(real, torch.arange(topk_ids.numel(), dtype=torch.int32))
    block_expert = expert_ids.repeat_interleave(16).long()
    valid = sorted_ids < topk_ids.numel()
    assert torch.equal(topk_ids.reshape(-1)[sorted_ids[valid].long()], block_expert[valid])


# ------------------------------------------------------------------------------ references


@pytest.mark.parametrize("kind", ["dense", "gptq4_act", "gptq8", "int8", "fp8"])
@pytest.mark.parametrize("T,k", [(1, 1), (3, 2), (17, 2)])
def test_refs_match_per_token_loop(kind, T, k) -> None:
    K, N = 64, 32
    weight = {
        "dense": lambda: _dense(N, K, torch.float32),
        "gptq4_act": lambda: _gptq(N, K, 4, 16, True),
        "gptq8": lambda: _gptq(N, K, 8, 32, False),
        "int8": lambda: _w8(N, K, False, True),
        "fp8": lambda: _w8(N, K, True, False),
    }[kind]()
    x = torch.randn(T, K)
    topk_weights, topk_ids = _routing(T, k)
    want = _naive_linear(x, weight, topk_weights, topk_ids)
    out = moe_linear_ref(x, weight, topk_weights, topk_ids)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    pairs = moe_gemm_ref(x, weight, topk_ids).double().view(T, k, N)
    for j in range(k):  # unweighted pair rows are the per-expert products
        w = [_naive_weight(weight, int(topk_ids[t, j])) for t in range(T)]
        row = torch.stack([x[t].double() @ w[t].t() for t in range(T)])
        torch.testing.assert_close(pairs[:, j], row, rtol=1e-5, atol=1e-5 * row.abs().max().item())


# ---------------------------------------------------------------------------------- kernel


def _run_gemm(x, weight, topk_ids, topk_weights, device) -> None:
    """moe_gemm on `device` against moe_gemm_ref on CPU."""
    tw = topk_weights.to(device) if topk_weights is not None else None
    out = moe_gemm(x.to(device), weight.to(device), topk_ids.to(device), tw)
    _close(out, moe_gemm_ref(x, weight, topk_ids, topk_weights))


# T = 1, 3, 17; top-k 1 and 2; experts 0 and 5 never chosen; K = 200 not a multiple of BLOCK_K
@pytest.mark.parametrize("T,k", [(1, 1), (1, 2), (3, 2), (17, 1), (17, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("weighted", [False, True])
def test_moe_gemm_dense(T, k, dtype, weighted, device) -> None:
    K, N = 200, 72
    weight = _dense(N, K, dtype)
    x = torch.randn(T, K).to(dtype)
    topk_weights, topk_ids = _routing(T, k)
    _run_gemm(x, weight, topk_ids, topk_weights if weighted else None, device)


@pytest.mark.parametrize(
    "bits,group_size,act_order",
    [(4, 64, False), (4, 32, False), (4, 64, True), (4, -1, False), (8, 32, True)],
)
@pytest.mark.parametrize("T,k", [(1, 2), (17, 2)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_moe_gemm_gptq(bits, group_size, act_order, T, k, dtype, device) -> None:
    """group 64 = BLOCK_K: one scale row per tile; 32 and act-order: the per-channel gather."""
    K, N = 200, 64
    weight = _gptq(N, K, bits, group_size, act_order)
    x = torch.randn(T, K).to(dtype)
    topk_weights, topk_ids = _routing(T, k)
    _run_gemm(x, weight, topk_ids, topk_weights, device)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("T,k", [(1, 1), (3, 2), (17, 2)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_moe_gemm_w8(fp8, per_channel, T, k, dtype, device) -> None:
    K, N = 200, 72
    weight = _w8(N, K, fp8, per_channel)
    x = torch.randn(T, K).to(dtype)
    topk_weights, topk_ids = _routing(T, k)
    _run_gemm(x, weight, topk_ids, topk_weights, device)


def test_fixed_size_buffers(device) -> None:
    """vLLM-sized (CUDA-graph) buffers: blocks past num_tokens_post_padded exit at once, and
    their junk expert ids are never read."""
    T, k, K, N, block = 17, 2, 96, 64, 16
    weight = _dense(N, K, torch.float32)
    x = torch.randn(T, K)
    topk_weights, topk_ids = _routing(T, k)
    sorted_ids, expert_ids, num_post_pad = moe_align_block_size(topk_ids, block, E)
    extra = topk_ids.numel() + E * (block - 1) - sorted_ids.numel()
    sorted_ids = torch.cat([sorted_ids, torch.full((extra,), 1 << 30, dtype=torch.int32)])
    blocks = -(-sorted_ids.numel() // block)
    expert_ids = torch.cat([expert_ids, torch.full((blocks - len(expert_ids),), 1 << 20)])
    args = [t.to(device) for t in (sorted_ids, expert_ids.int(), num_post_pad)]
    out = invoke_fused_moe_kernel(x.to(device), weight.to(device), *args, k, block)
    _close(out, moe_gemm_ref(x, weight, topk_ids))


@pytest.mark.parametrize("block_m", [16, 32])
def test_moe_linear(block_m, device) -> None:
    T, k, K, N = 17, 2, 128, 48
    weight = _gptq(N, K, 4, 32, False)
    x = torch.randn(T, K, dtype=torch.float16)
    topk_weights, topk_ids = _routing(T, k)
    out = moe_linear(x.to(device), weight.to(device), topk_weights.to(device), topk_ids.to(device))
    _close(out, moe_linear_ref(x, weight, topk_weights, topk_ids))
    pairs = moe_gemm(x.to(device), weight.to(device), topk_ids.to(device), block_m=block_m)
    _close(pairs, moe_gemm_ref(x, weight, topk_ids))


# ------------------------------------------------------------------------ SwiGLU experts


def _swiglu(H: int, inter: int, dtype: torch.dtype) -> tuple[MoEWeight, MoEWeight]:
    return _dense(2 * inter, H, dtype), _dense(H, inter, dtype)


@pytest.mark.parametrize("T,k", [(1, 2), (3, 1), (17, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_experts_dense(T, k, dtype, device) -> None:
    H, inter = 96, 40
    w13, w2 = _swiglu(H, inter, dtype)
    x = torch.randn(T, H).to(dtype)
    topk_weights, topk_ids = _routing(T, k)
    d = [t.to(device) for t in (x, topk_weights, topk_ids)]
    out = fused_experts(d[0], w13.to(device), w2.to(device), d[1], d[2])
    # bf16: a gate/up element rounded the other way moves the down output by ~one rounding more
    _close(out, fused_experts_ref(x, w13, w2, topk_weights, topk_ids), scale=2.0)


def test_fused_experts_quantized(device) -> None:
    """GPTQ gate/up with an int8 down projection."""
    T, k, H, inter = 17, 2, 128, 64
    w13, w2 = _gptq(2 * inter, H, 4, 64, False), _w8(H, inter, False, True)
    x = torch.randn(T, H, dtype=torch.float16)
    topk_weights, topk_ids = _routing(T, k)
    d = [t.to(device) for t in (x, topk_weights, topk_ids)]
    out = fused_experts(d[0], w13.to(device), w2.to(device), d[1], d[2])
    _close(out, fused_experts_ref(x, w13, w2, topk_weights, topk_ids), scale=2.0)


@pytest.mark.parametrize("T", [1, 17])
def test_fused_experts_matches_model_fused_moe(T, device) -> None:
    """The kernel path against qserve.model.moe.fused_moe over per-expert SwiGLU callables
    (imported here: a model-code import error fails this test only)."""
    from qserve.model.moe import fused_moe

    H, inter, k = 64, 32, 2
    w13, w2 = _swiglu(H, inter, torch.float32)
    gate, up = w13.weight.chunk(2, dim=1)

    def expert(e: int):
        return lambda h: F.linear(F.silu(F.linear(h, gate[e])) * F.linear(h, up[e]), w2.weight[e])

    x = torch.randn(T, H)
    topk_weights, topk_ids = _routing(T, k)
    want = fused_moe(x, topk_weights, topk_ids, [expert(e) for e in range(E)])
    d = [t.to(device) for t in (x, topk_weights, topk_ids)]
    out = fused_experts(d[0], w13.to(device), w2.to(device), d[1], d[2])
    _close(out, want)
    _close(ops.fused_experts(x, w13, w2, topk_weights, topk_ids), want)  # CPU: the reference


def test_rejects_bad_inputs(device) -> None:
    x = torch.randn(3, 64, device=device)
    topk_weights, topk_ids = (t.to(device) for t in _routing(3, 2))
    dense = _dense(32, 64, torch.float32).to(device)
    with pytest.raises(ValueError):  # K mismatch
        moe_gemm(x[:, :48], dense, topk_ids)
    with pytest.raises(ValueError):  # dense weight dtype differs from x
        moe_gemm(x.half(), dense, topk_ids)
    with pytest.raises(ValueError):  # topk_weights of the wrong size
        moe_gemm(x, dense, topk_ids, topk_weights[:2])
    bad_scales = MoEWeight.w8(torch.zeros(E, 32, 64, dtype=torch.int8), torch.ones(E, 3))
    with pytest.raises(ValueError):
        moe_gemm(x, bad_scales.to(device), topk_ids)
    with pytest.raises(ValueError):  # w13 must be [E, 2I, H] for w2 [E, H, I]
        fused_experts(x, dense, _dense(64, 32, torch.float32).to(device), topk_weights, topk_ids)
    with pytest.raises(ValueError):
        MoEWeight("awq", x)
