"""torch's CPU int4/int8 weight-only kernels, fed our formats, against the torch references."""

import pytest
import torch

from qserve.kernels import packing as P
from qserve.kernels.cpu_weight_only import (
    int4pack_from_awq,
    int4pack_from_gptq,
    int4pack_mm,
    int8pack_mm,
)
from qserve.kernels.int8_ref import w8a16_gemm_ref
from qserve.kernels.w4a16_ref import awq_gemm_ref, gptq_gemm_ref


def _assert_bf16_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    atol = 1e-2 * ref.float().abs().max().item()  # bf16 scales/zeros and activations
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=atol)


@pytest.mark.parametrize(
    "K,group_size,act_order",
    [(256, 128, False), (192, 64, True), (200, 64, False), (576, 128, True), (160, -1, False)],
)
def test_int4pack_gptq(K, group_size, act_order) -> None:
    N = 48
    gs = K if group_size == -1 else group_size
    G = -(-K // gs)
    q = torch.randint(0, 16, (K, N), dtype=torch.int32)
    zeros = torch.randint(1, 16, (G, N), dtype=torch.int32)
    scales = (torch.rand(G, N) * 0.02 + 0.002).half()
    g_idx = P.gptq_g_idx(K, group_size, torch.randperm(K) if act_order else None)
    packed = (P.pack_gptq_qweight(q, 4), P.pack_gptq_qzeros(zeros, 4), scales, g_idx)
    w = int4pack_from_gptq(*packed)
    assert (w.perm is not None) == act_order
    x = torch.randn(2, 3, K, dtype=torch.bfloat16)
    bias = torch.randn(N, dtype=torch.bfloat16)
    out = int4pack_mm(x, w, bias)
    ref = gptq_gemm_ref(x.reshape(6, K), *packed, 4, bias).reshape(2, 3, N)
    _assert_bf16_close(out, ref)


@pytest.mark.parametrize("K,group_size", [(128, 32), (200, 128), (96, -1)])
def test_int4pack_awq(K, group_size) -> None:
    N = 32
    gs = K if group_size == -1 else group_size
    G = -(-K // gs)
    q = torch.randint(0, 16, (K, N), dtype=torch.int32)
    z = torch.randint(0, 16, (G, N), dtype=torch.int32)
    scales = (torch.rand(G, N) * 0.02 + 0.002).half()
    packed = (P.pack_awq_qweight(q), P.pack_awq_qzeros(z), scales)
    x = torch.randn(5, K, dtype=torch.bfloat16)
    out = int4pack_mm(x, int4pack_from_awq(*packed, group_size))
    _assert_bf16_close(out, awq_gemm_ref(x, *packed, group_size))


def test_int4pack_rejects_unsupported() -> None:
    q = torch.randint(0, 16, (64, 24), dtype=torch.int32)  # N % 16 != 0
    z = torch.randint(0, 16, (2, 24), dtype=torch.int32)
    with pytest.raises(ValueError):
        int4pack_from_awq(P.pack_awq_qweight(q), P.pack_awq_qzeros(z), torch.rand(2, 24), 32)
    q = torch.randint(0, 16, (96, 16), dtype=torch.int32)  # group size 48 not supported
    z = torch.randint(0, 16, (2, 16), dtype=torch.int32)
    with pytest.raises(ValueError):
        int4pack_from_awq(P.pack_awq_qweight(q), P.pack_awq_qzeros(z), torch.rand(2, 16), 48)


@pytest.mark.parametrize("per_channel", [True, False])
def test_int8pack_mm(per_channel) -> None:
    N, K = 32, 96
    x = torch.randn(3, K, dtype=torch.bfloat16)
    w_q = torch.randint(-128, 128, (N, K), dtype=torch.int8)
    ws = torch.rand(N, 1) * 0.01 if per_channel else torch.tensor([0.004])
    bias = torch.randn(N, dtype=torch.bfloat16)
    _assert_bf16_close(int8pack_mm(x, w_q, ws, bias), w8a16_gemm_ref(x, w_q, ws, bias))


def test_int8pack_mm_takes_tensors_at_any_offset() -> None:
    """torch's int8 kernel crashes on AVX-512 CPUs when x or the weight starts off a 64-byte
    boundary (e.g. a weight read from safetensors at an odd offset): both are realigned."""
    N, K, M = 64, 64, 49
    w_buf = torch.randint(-128, 128, (N * K + 1,), dtype=torch.int8)
    x_buf = torch.randn(M * K + 1, dtype=torch.bfloat16)
    w_q, x = w_buf[1:].view(N, K), x_buf[1:].view(M, K)
    assert w_q.data_ptr() % 64 and x.data_ptr() % 64
    ws = torch.rand(N, 1) * 0.01
    _assert_bf16_close(int8pack_mm(x, w_q, ws), w8a16_gemm_ref(x, w_q, ws, None))
