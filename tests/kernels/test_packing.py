"""Pack/unpack round trips and dequantization against the formats' element-wise definitions."""

import pytest
import torch

from qserve.kernels import packing as P


@pytest.mark.parametrize("bits", [3, 4, 8])
def test_gptq_qweight_round_trip(bits: int) -> None:
    K, N = 64, 24
    q = torch.randint(0, 2**bits, (K, N), dtype=torch.int32)
    qweight = P.pack_gptq_qweight(q, bits)
    assert qweight.dtype == torch.int32 and qweight.shape == (K * bits // 32, N)
    assert torch.equal(P.unpack_gptq_qweight(qweight, bits), q)


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_qweight_field_order(bits: int) -> None:
    K, N = 32, 5
    q = torch.randint(0, 2**bits, (K, N), dtype=torch.int32)
    qweight = P.pack_gptq_qweight(q, bits)
    per = 32 // bits
    for r in range(K // per):
        for n in range(N):
            word = int(qweight[r, n]) & 0xFFFFFFFF
            expect = sum(int(q[per * r + j, n]) << (bits * j) for j in range(per))
            assert word == expect


def test_gptq_sign_bit_words() -> None:
    # Nibble 7 = 0xF sets the sign bit: every field must survive the round trip.
    q = torch.full((8, 3), 15, dtype=torch.int32)
    qweight = P.pack_gptq_qweight(q, 4)
    assert int(qweight[0, 0]) == -1  # 0xFFFFFFFF as int32
    assert torch.equal(P.unpack_gptq_qweight(qweight, 4), q)
    q[7, 1] = 8
    q[0, 2] = 0
    assert torch.equal(P.unpack_gptq_qweight(P.pack_gptq_qweight(q, 4), 4), q)


@pytest.mark.parametrize("bits", [3, 4, 8])
def test_gptq_qzeros_round_trip(bits: int) -> None:
    G, N = 3, 64
    zeros = torch.randint(1, 2**bits + 1, (G, N), dtype=torch.int32)
    qzeros = P.pack_gptq_qzeros(zeros, bits)
    assert qzeros.dtype == torch.int32 and qzeros.shape == (G, N * bits // 32)
    assert torch.equal(P.unpack_gptq_qzeros(qzeros, bits), zeros)
    if bits == 3:
        return  # the stream layout: test_gptq_3bit_autogptq_layout
    # stored value is zero - 1, packed along N with the same field order
    per = 32 // bits
    word = int(qzeros[1, 2]) & 0xFFFFFFFF
    assert word == sum((int(zeros[1, 2 * per + j]) - 1) << (bits * j) for j in range(per))


def test_gptq_symmetric_qzeros_word() -> None:
    zeros = torch.full((2, 16), 8, dtype=torch.int32)
    qzeros = P.pack_gptq_qzeros(zeros, 4)
    assert (qzeros == 0x77777777).all()
    qzeros8 = P.pack_gptq_qzeros(torch.full((2, 8), 128, dtype=torch.int32), 8)
    assert (qzeros8 == 0x7F7F7F7F).all()


def test_gptq_rejects_unrepresentable() -> None:
    with pytest.raises(ValueError):
        P.pack_gptq_qzeros(torch.zeros(1, 8, dtype=torch.int32), 4)
    with pytest.raises(ValueError):
        P.pack_gptq_qweight(torch.full((8, 1), 16, dtype=torch.int32), 4)
    with pytest.raises(ValueError):
        P.pack_gptq_qweight(torch.ones(6, 1, dtype=torch.int32), 4)
    with pytest.raises(ValueError):  # 3 bit packs runs of 32 values
        P.pack_gptq_qweight(torch.ones(8, 1, dtype=torch.int32), 3)
    with pytest.raises(ValueError):
        P.pack_gptq_qweight(torch.ones(32, 1, dtype=torch.int32), 5)


def _autogptq_pack_3bit(intweight: list[int]) -> list[int]:
    """AutoGPTQ's own 3-bit packing loop (its QuantLinear.pack), for one column of 32 * R
    values: the layout vLLM's and GPTQModel's 3-bit kernels read."""
    out, i = [], 0
    while i < len(intweight):
        w0 = w1 = w2 = 0
        for j in range(10):
            w0 |= intweight[i + j] << (3 * j)
        i += 10
        w0 |= (intweight[i] << 30) & 0xFFFFFFFF
        w1 |= (intweight[i] >> 2) & 1
        i += 1
        for j in range(10):
            w1 |= intweight[i + j] << (3 * j + 1)
        i += 10
        w1 |= (intweight[i] << 31) & 0xFFFFFFFF
        w2 |= (intweight[i] >> 1) & 0x3
        i += 1
        for j in range(10):
            w2 |= intweight[i + j] << (3 * j + 2)
        i += 10
        out += [w0, w1, w2]
    return out


def test_gptq_3bit_autogptq_layout() -> None:
    K, N = 64, 3
    q = torch.randint(0, 8, (K, N), dtype=torch.int32)
    q[10, 0], q[21, 0] = 7, 7  # the values that straddle words
    qweight = P.pack_gptq_qweight(q, 3)
    assert qweight.shape == (6, N)
    for n in range(N):
        words = [int(w) & 0xFFFFFFFF for w in qweight[:, n]]
        assert words == _autogptq_pack_3bit([int(v) for v in q[:, n]])
    zeros = torch.randint(1, 9, (2, 32), dtype=torch.int32)
    qzeros = P.pack_gptq_qzeros(zeros, 3)
    for g in range(2):
        words = [int(w) & 0xFFFFFFFF for w in qzeros[g]]
        assert words == _autogptq_pack_3bit([int(z) - 1 for z in zeros[g]])
    assert P.pack_block(3) == (32, 3) and P.pack_block(4) == (8, 1)


@pytest.mark.parametrize("bits", [3, 4, 8])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dequantize_gptq_definition(bits: int, act_order: bool, dtype: torch.dtype) -> None:
    K, N, gs = 64, 32, 16
    G = K // gs
    q = torch.randint(0, 2**bits, (K, N), dtype=torch.int32)
    zeros = torch.randint(1, 2**bits, (G, N), dtype=torch.int32)
    scales = (torch.rand(G, N) * 0.1 + 0.01).to(dtype)
    perm = torch.randperm(K) if act_order else None
    g_idx = P.gptq_g_idx(K, gs, perm)
    W = P.dequantize_gptq(
        P.pack_gptq_qweight(q, bits), P.pack_gptq_qzeros(zeros, bits), scales, g_idx, bits
    )
    assert W.shape == (N, K) and W.dtype == dtype
    qzero_stored = zeros - 1
    for k in range(K):
        g = int(g_idx[k])
        for n in range(N):
            expect = scales[g, n] * (q[k, n] - (qzero_stored[g, n] + 1)).to(dtype)
            assert W[n, k] == expect, (k, n)


def test_gptq_g_idx() -> None:
    assert torch.equal(
        P.gptq_g_idx(8, 4), torch.tensor([0, 0, 0, 0, 1, 1, 1, 1], dtype=torch.int32)
    )
    assert torch.equal(P.gptq_g_idx(4, -1), torch.zeros(4, dtype=torch.int32))
    perm = torch.tensor([3, 0, 2, 1])
    # channels visited in order 3, 0 (group 0), then 2, 1 (group 1)
    assert P.gptq_g_idx(4, 2, perm).tolist() == [0, 1, 1, 0]


def test_awq_interleave_hand_built_word() -> None:
    # channels 0..7 hold values 1..8: nibble i holds channel AWQ_ORDER[i]
    q = torch.arange(1, 9, dtype=torch.int32).reshape(1, 8)
    word = int(P.pack_awq_qweight(q)[0, 0]) & 0xFFFFFFFF
    assert word == 0x86427531
    assert torch.equal(
        P.unpack_awq_qweight(torch.tensor([[0x86427531 - 2**32]], dtype=torch.int32)), q
    )
    # a word with the sign bit set: channel 7 (nibble 7) = 0xF
    q2 = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 15]], dtype=torch.int32)
    w2 = P.pack_awq_qweight(q2)
    assert int(w2[0, 0]) & 0xFFFFFFFF == 0xF5316420
    assert int(w2[0, 0]) < 0
    assert torch.equal(P.unpack_awq_qweight(w2), q2)


def test_awq_round_trip() -> None:
    K, N, G = 16, 32, 2
    q = torch.randint(0, 16, (K, N), dtype=torch.int32)
    z = torch.randint(0, 16, (G, N), dtype=torch.int32)
    qweight, qzeros = P.pack_awq_qweight(q), P.pack_awq_qzeros(z)
    assert qweight.shape == (K, N // 8) and qzeros.shape == (G, N // 8)
    assert qweight.dtype == qzeros.dtype == torch.int32
    assert torch.equal(P.unpack_awq_qweight(qweight), q)
    assert torch.equal(P.unpack_awq_qzeros(qzeros), z)
    # qzeros: same interleave, no minus one
    assert torch.equal(qzeros, P.pack_awq_qweight(z))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dequantize_awq_definition(dtype: torch.dtype) -> None:
    K, N, gs = 64, 16, 32
    G = K // gs
    q = torch.randint(0, 16, (K, N), dtype=torch.int32)
    z = torch.randint(0, 16, (G, N), dtype=torch.int32)
    scales = (torch.rand(G, N) * 0.1 + 0.01).to(dtype)
    W = P.dequantize_awq(P.pack_awq_qweight(q), P.pack_awq_qzeros(z), scales, gs)
    assert W.shape == (N, K) and W.dtype == dtype
    for k in range(K):
        for n in range(N):
            assert W[n, k] == scales[k // gs, n] * (q[k, n] - z[k // gs, n]).to(dtype), (k, n)


def test_gptq_group_size_inference() -> None:
    assert P.gptq_group_size(256, 2) == 128
    assert P.gptq_group_size(200, 4) == 64  # last group partial
    assert P.gptq_group_size(200, 1) == 200  # per channel
    with pytest.raises(ValueError):
        P.gptq_group_size(256, 3)


def test_dequantize_gptq_without_g_idx() -> None:
    K, N, gs = 200, 8, 64
    q = torch.randint(0, 16, (K, N), dtype=torch.int32)
    zeros = torch.randint(1, 16, (4, N), dtype=torch.int32)
    scales = torch.rand(4, N).half()
    packed = (P.pack_gptq_qweight(q, 4), P.pack_gptq_qzeros(zeros, 4), scales)
    expect = P.dequantize_gptq(*packed, P.gptq_g_idx(K, gs), 4)
    assert torch.equal(P.dequantize_gptq(*packed, None, 4), expect)
