"""Triton W4A16 GEMM (GPTQ / AWQ layouts) against the torch references."""

import pytest
import torch

from qserve.kernels import packing as P
from qserve.kernels.w4a16 import awq_gemm, gptq_gemm
from qserve.kernels.w4a16_ref import awq_gemm_ref, gptq_gemm_ref


def _assert_gemm_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Kernel and reference differ by fp32 summation order and one output rounding."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    eps = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 1e-5}[ref.dtype]
    # on CUDA the dequantized tile is rounded to the activation dtype before the dot
    atol = 2 * eps * ref.float().abs().max().item()
    torch.testing.assert_close(out.float(), ref.float(), rtol=2 * eps, atol=atol)


def _gptq_case(K, N, bits, group_size, sym, act_order, dtype, device):
    gs = K if group_size == -1 else group_size
    G = -(-K // gs)
    q = torch.randint(0, 2**bits, (K, N), dtype=torch.int32)
    if sym:
        zeros = torch.full((G, N), 2 ** (bits - 1), dtype=torch.int32)
    else:
        zeros = torch.randint(1, 2**bits, (G, N), dtype=torch.int32)
    scales = (torch.rand(G, N) * 0.02 + 0.002).to(dtype)
    g_idx = P.gptq_g_idx(K, group_size, torch.randperm(K) if act_order else None)
    qweight, qzeros = P.pack_gptq_qweight(q, bits), P.pack_gptq_qzeros(zeros, bits)
    return [t.to(device) for t in (qweight, qzeros, scales, g_idx)]


# M in {1, 3, 17, 64}; K not a multiple of the 64 block (200) where the format allows it.
@pytest.mark.parametrize(
    "M,K,N,group_size,sym,act_order",
    [
        (1, 256, 128, 128, True, False),
        (3, 200, 72, 32, False, False),
        (17, 192, 64, 64, False, True),
        (64, 128, 96, -1, True, False),
        (1, 200, 64, 64, False, True),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gptq_gemm_4bit(M, K, N, group_size, sym, act_order, dtype, device) -> None:
    qweight, qzeros, scales, g_idx = _gptq_case(K, N, 4, group_size, sym, act_order, dtype, device)
    x = torch.randn(M, K, dtype=dtype, device=device)
    bias = torch.randn(N, dtype=dtype, device=device)
    # without act-order the kernel takes g_idx=None (consecutive groups, one scale row per tile)
    out = gptq_gemm(x, qweight, qzeros, scales, g_idx if act_order else None, 4, bias)
    ref = gptq_gemm_ref(
        x.cpu(), qweight.cpu(), qzeros.cpu(), scales.cpu(), g_idx.cpu(), 4, bias.cpu()
    )
    _assert_gemm_close(out.cpu(), ref)


@pytest.mark.parametrize("M,act_order", [(1, True), (17, False)])
def test_gptq_gemm_8bit(M, act_order, device) -> None:
    K, N = 160, 64
    qweight, qzeros, scales, g_idx = _gptq_case(
        K, N, 8, 32, False, act_order, torch.float16, device
    )
    x = torch.randn(M, K, dtype=torch.float16, device=device)
    out = gptq_gemm(x, qweight, qzeros, scales, g_idx if act_order else None, 8)
    ref = gptq_gemm_ref(x.cpu(), qweight.cpu(), qzeros.cpu(), scales.cpu(), g_idx.cpu(), 8)
    _assert_gemm_close(out.cpu(), ref)


@pytest.mark.parametrize("split_k", [1, 3])
def test_gptq_split_k_matches(split_k, device) -> None:
    """Also the g_idx gather path with a trivial (non-act-order) g_idx."""
    qweight, qzeros, scales, g_idx = _gptq_case(320, 64, 4, 64, False, False, torch.float16, device)
    x = torch.randn(3, 320, dtype=torch.float16, device=device)
    bias = torch.randn(64, dtype=torch.float16, device=device)
    out = gptq_gemm(x, qweight, qzeros, scales, g_idx, 4, bias, split_k=split_k)
    ref = gptq_gemm_ref(
        x.cpu(), qweight.cpu(), qzeros.cpu(), scales.cpu(), g_idx.cpu(), 4, bias.cpu()
    )
    _assert_gemm_close(out.cpu(), ref)


@pytest.mark.parametrize(
    "M,K,N,group_size",
    [(1, 256, 128, 128), (3, 200, 72, 64), (17, 96, 64, 32), (64, 128, 64, -1)],
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_awq_gemm(M, K, N, group_size, dtype, device) -> None:
    gs = K if group_size == -1 else group_size
    G = -(-K // gs)
    q = torch.randint(0, 16, (K, N), dtype=torch.int32)
    z = torch.randint(0, 16, (G, N), dtype=torch.int32)
    scales = (torch.rand(G, N) * 0.02 + 0.002).to(dtype)
    qweight, qzeros = P.pack_awq_qweight(q), P.pack_awq_qzeros(z)
    x = torch.randn(M, K, dtype=dtype)
    out = awq_gemm(*(t.to(device) for t in (x, qweight, qzeros, scales)), group_size)
    _assert_gemm_close(out.cpu(), awq_gemm_ref(x, qweight, qzeros, scales, group_size))


def test_w4a16_rejects_bad_shapes(device) -> None:
    qweight, qzeros, scales, g_idx = _gptq_case(64, 32, 4, 32, True, False, torch.float16, device)
    x = torch.randn(2, 72, dtype=torch.float16, device=device)
    with pytest.raises(ValueError):
        gptq_gemm(x, qweight, qzeros, scales, g_idx)
    with pytest.raises(ValueError):
        awq_gemm(x[:, :64], qweight, qzeros, scales, 32)


def test_gptq_fp16_scales_bf16_activations(device) -> None:
    """GPTQ checkpoints carry fp16 scales; the engine may run bf16 activations."""
    qweight, qzeros, scales, g_idx = _gptq_case(128, 64, 4, 32, False, True, torch.float16, device)
    x = torch.randn(3, 128, dtype=torch.bfloat16, device=device)
    out = gptq_gemm(x, qweight, qzeros, scales, g_idx)
    ref = gptq_gemm_ref(*(t.cpu() for t in (x, qweight, qzeros, scales, g_idx)))
    _assert_gemm_close(out.cpu(), ref)
