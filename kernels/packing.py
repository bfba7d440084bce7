"""Bit packing for the on-disk quantized formats: the one module that owns it.

The exporters in `qserve.quantize` and the kernels both call these functions, so the two cannot
disagree. K = in_features, N = out_features, G = number of groups. Integer tensors in, int32 out.

GPTQ (AutoGPTQ / GPTQModel "gptq" v1 format), `bits` in {3, 4, 8}, P = 32 // bits values per word::

    qweight int32 [K // P, N]   packed along the input dim (rows):
        qweight[r, n] bits (b*j .. b*j+b-1)  =  q[P*r + j, n]          j = 0 .. P-1

        4 bit, one word:  | q[8r+7] | q[8r+6] | ... | q[8r+1] | q[8r+0] |
                          bit 31                              bit 0

    qzeros  int32 [G, N // P]   packed along the output dim (columns), same field order,
        and stores zero - 1 (the v1 quirk; readers add 1 back). Symmetric 4 bit: zero 8 is
        stored as 7, so every word is 0x77777777. Zeros must lie in [1, 2**bits]: a zero of 0
        would be stored as -1 and cannot be represented.

    3 bit (AutoGPTQ's and GPTQModel's layout, read by vLLM's GPTQ kernels): 3 bits do not
    divide a word, so each run of 32 values fills 3 words as one 96-bit little-endian stream,
    value j at stream bits 3j .. 3j+2 (value 10 straddles words 0 and 1, value 21 words 1 and
    2); the packed dim must be a multiple of 32. For 4 and 8 bits this stream is the layout
    above (`pack_block`: the values and words of one run).

AWQ (AutoAWQ "gemm" version), 4 bit only::

    qweight int32 [K, N // 8]   packed along the output dim, interleaved:
        nibble i of qweight[k, c]  =  q[k, 8c + AWQ_ORDER[i]],   AWQ_ORDER = [0,2,4,6,1,3,5,7]

        one word:  | n7 | n5 | n3 | n1 | n6 | n4 | n2 | n0 |   (n = output channel 8c + ...)
                   bit 31                            bit 0

    qzeros  int32 [G, N // 8]   same interleave, zeros stored as they are (no minus one).

compressed-tensors "pack-quantized" (llm-compressor's W4A16 / W8A16), `bits` in {4, 8}::

    weight_packed      int32 [N, K // P]   packed along the input dim, GPTQ's field order:
        the transpose of GPTQ's qweight. Codes are stored unsigned: compressed-tensors' signed
        code plus 2**(bits-1), i.e. the same codes as GPTQ's with symmetric zero 2**(bits-1).
    weight_zero_point  int32 [N // P, G]   (asymmetric only) zeros packed along the output dim,
        stored as they are, in [0, 2**bits): the transpose of a GPTQ qzeros without the minus one.

Packing nibble 7 of a word sets the sign bit of the int32: packing runs in int64 and wraps to
int32 explicitly; unpacking shifts (arithmetic, sign-filling) and then masks, which is correct for
negative words as well.
"""

from __future__ import annotations

import torch

AWQ_ORDER: tuple[int, ...] = (0, 2, 4, 6, 1, 3, 5, 7)
# AWQ_REVERSE_ORDER[j] = the nibble that holds channel 8c + j.
AWQ_REVERSE_ORDER: tuple[int, ...] = (0, 4, 1, 5, 2, 6, 3, 7)

__all__ = [
    "AWQ_ORDER",
    "AWQ_REVERSE_ORDER",
    "pack_factor",
    "pack_block",
    "GPTQ_BITS",
    "pack_gptq_qweight",
    "unpack_gptq_qweight",
    "pack_gptq_qzeros",
    "unpack_gptq_qzeros",
    "pack_awq_qweight",
    "unpack_awq_qweight",
    "pack_awq_qzeros",
    "unpack_awq_qzeros",
    "pack_ct_weight",
    "unpack_ct_weight",
    "pack_ct_zero_point",
    "unpack_ct_zero_point",
    "dequantize_gptq",
    "dequantize_awq",
    "gptq_g_idx",
    "gptq_group_size",
]


GPTQ_BITS = (3, 4, 8)  # what the GPTQ layout is written and read at here


def pack_factor(bits: int) -> int:
    """Values per int32 word (32 // bits) of the word-aligned layouts; raises for other bits."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    return 32 // bits


def pack_block(bits: int) -> tuple[int, int]:
    """(values, words): the shortest run of GPTQ values that fills whole int32 words (4 bit:
    (8, 1); 3 bit: (32, 3)). A packed dim is cut only at whole runs."""
    if bits not in GPTQ_BITS:
        raise ValueError(f"GPTQ bits must be one of {GPTQ_BITS}, got {bits}")
    return (32, bits) if 32 % bits else (32 // bits, 1)


def _check_range(q: torch.Tensor, lo: int, hi: int, what: str) -> None:
    if q.is_floating_point() or q.is_complex():
        raise TypeError(f"{what} must be an integer tensor, got {q.dtype}")
    if q.numel() and (int(q.min()) < lo or int(q.max()) > hi):
        raise ValueError(f"{what} values must lie in [{lo}, {hi}]")


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """Wrap int64 values in [0, 2**32) to the int32 with the same bits."""
    words = words & 0xFFFFFFFF
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


def _pack_last(q: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Pack [..., C] along the last dim into int32 [..., C // P]; field i <- value order[i]."""
    per_word = 32 // bits
    if q.shape[-1] % per_word:
        raise ValueError(f"dim of size {q.shape[-1]} is not a multiple of {per_word}")
    q = q.to(torch.int64).reshape(*q.shape[:-1], q.shape[-1] // per_word, per_word)
    if order is not None:
        q = q[..., list(order)]
    shifts = torch.arange(per_word, device=q.device, dtype=torch.int64) * bits
    return _to_int32((q << shifts).sum(dim=-1))


def _unpack_last(
    words: torch.Tensor, bits: int, order: tuple[int, ...] | None = None
) -> torch.Tensor:
    """Inverse of `_pack_last`: int32 [..., W] -> int32 [..., W * P]."""
    if words.dtype != torch.int32:
        raise TypeError(f"packed tensors must be int32, got {words.dtype}")
    per_word = 32 // bits
    shifts = torch.arange(per_word, device=words.device, dtype=torch.int32) * bits
    fields = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., W, P]
    if order is not None:
        # field i holds value order[i]: value j sits in field reverse[j].
        reverse = [order.index(j) for j in range(per_word)]
        fields = fields[..., reverse]
    return fields.reshape(*words.shape[:-1], words.shape[-1] * per_word)


# ---------------------------------------------------------------------------------------- GPTQ


def pack_gptq_qweight(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer weights q [K, N] in [0, 2**bits) into GPTQ qweight int32 [K*bits/32, N]."""
    _check_range(q, 0, (1 << bits) - 1, "q")
    return _gptq_pack(q.t(), bits).t().contiguous()


def unpack_gptq_qweight(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ qweight int32 [K*bits/32, N] -> q int32 [K, N]."""
    return _gptq_unpack(qweight.t(), bits).t().contiguous()


def pack_gptq_qzeros(zeros: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack zero points [G, N] in [1, 2**bits] into GPTQ qzeros int32 [G, N*bits/32] (zero - 1)."""
    _check_range(zeros, 1, 1 << bits, "GPTQ v1 zeros (stored as zero - 1)")
    return _gptq_pack(zeros.to(torch.int64) - 1, bits)


def unpack_gptq_qzeros(qzeros: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ qzeros int32 [G, N*bits/32] -> zero points int32 [G, N] (adds the 1 back)."""
    return _gptq_unpack(qzeros, bits) + 1


def _gptq_pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    _, words = pack_block(bits)
    return _pack_last(q, bits) if words == 1 else _pack_stream(q, bits)


def _gptq_unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    _, words = pack_block(bits)
    return _unpack_last(packed, bits) if words == 1 else _unpack_stream(packed, bits)


def _stream_fields(bits: int) -> list[tuple[int, int, int]]:
    """(value j, word, shift) of each of a 32-value run's values in its `bits`-word stream."""
    return [(j, *divmod(bits * j, 32)) for j in range(32)]


def _pack_stream(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack [..., C] (C a multiple of 32) into int32 [..., C * bits / 32]: each run of 32
    values one little-endian stream of `bits` words (a value may straddle two)."""
    if q.shape[-1] % 32:
        raise ValueError(f"dim of size {q.shape[-1]} is not a multiple of 32")
    q = q.to(torch.int64).reshape(*q.shape[:-1], q.shape[-1] // 32, 32)
    out = torch.zeros(*q.shape[:-1], bits, dtype=torch.int64, device=q.device)
    for j, word, shift in _stream_fields(bits):
        out[..., word] |= (q[..., j] << shift) & 0xFFFFFFFF
        if shift + bits > 32:  # the high bits spill into the next word
            out[..., word + 1] |= q[..., j] >> (32 - shift)
    return _to_int32(out.reshape(*out.shape[:-2], -1))


def _unpack_stream(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `_pack_stream`: int32 [..., W] -> int32 [..., W * 32 / bits]."""
    if words.dtype != torch.int32:
        raise TypeError(f"packed tensors must be int32, got {words.dtype}")
    if words.shape[-1] % bits:
        raise ValueError(f"packed dim of size {words.shape[-1]} is not a multiple of {bits}")
    w = (words.to(torch.int64) & 0xFFFFFFFF).reshape(*words.shape[:-1], -1, bits)
    mask = (1 << bits) - 1
    fields = []
    for _, word, shift in _stream_fields(bits):
        v = w[..., word] >> shift
        if shift + bits > 32:
            v = v | (w[..., word + 1] << (32 - shift))
        fields.append(v & mask)
    out = torch.stack(fields, dim=-1)  # [..., W / bits, 32]
    return out.reshape(*words.shape[:-1], -1).to(torch.int32)


def gptq_group_size(in_features: int, num_groups: int) -> int:
    """Group size of consecutive groups from K and G = ceil(K / group_size) (a power of 2,
    or K for one group per channel)."""
    if num_groups == 1:
        return in_features
    gs = 1 << (-(-in_features // num_groups) - 1).bit_length()
    if -(-in_features // gs) != num_groups:
        raise ValueError(f"{num_groups} groups do not split {in_features} channels evenly")
    return gs


def gptq_g_idx(in_features: int, group_size: int, perm: torch.Tensor | None = None) -> torch.Tensor:
    """g_idx int32 [K]: group of each input channel.

    group_size -1 means one group (per channel). With act-order, `perm` is the order in which the
    quantizer visited the input channels: channel perm[i] belongs to group i // group_size.
    """
    gs = in_features if group_size == -1 else group_size
    groups = torch.arange(in_features, dtype=torch.int32) // gs
    if perm is None:
        return groups
    g_idx = torch.empty_like(groups)
    g_idx[perm.to(torch.long)] = groups
    return g_idx


def dequantize_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    bits: int,
) -> torch.Tensor:
    """W [N, K] (nn.Linear layout) in scales' dtype.

    W[n, k] = scales[g_idx[k], n] * (q[k, n] - (qzero[g_idx[k], n] + 1)).
    g_idx None: consecutive groups (`gptq_group_size`).
    """
    q = unpack_gptq_qweight(qweight, bits)  # [K, N]
    zeros = unpack_gptq_qzeros(qzeros, bits)  # [G, N]
    K, N = q.shape
    if g_idx is None:
        g_idx = gptq_g_idx(K, gptq_group_size(K, zeros.shape[0])).to(q.device)
    if scales.shape[1] != N or zeros.shape != scales.shape or g_idx.shape != (K,):
        raise ValueError(
            f"shape mismatch: q {tuple(q.shape)}, zeros {tuple(zeros.shape)}, "
            f"scales {tuple(scales.shape)}, g_idx {tuple(g_idx.shape)}"
        )
    g = g_idx.to(torch.long)
    # (q - z) is an exact small integer, its product with the scale is exact in fp32: one rounding.
    w = (q - zeros[g]).to(torch.float32) * scales[g].to(torch.float32)  # [K, N]
    return w.to(scales.dtype).t().contiguous()


# -------------------------------------------------------------------------- compressed-tensors


def pack_ct_weight(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned codes q [N, K] in [0, 2**bits) into weight_packed int32 [N, K*bits/32]."""
    pack_factor(bits)
    _check_range(q, 0, (1 << bits) - 1, "q")
    return _pack_last(q, bits).contiguous()


def unpack_ct_weight(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """weight_packed int32 [N, K*bits/32] -> unsigned codes int32 [N, K]."""
    pack_factor(bits)
    return _unpack_last(packed, bits)


def pack_ct_zero_point(zeros: torch.Tensor, bits: int) -> torch.Tensor:
    """Zero points [G, N] in [0, 2**bits) -> weight_zero_point int32 [N*bits/32, G]."""
    pack_factor(bits)
    _check_range(zeros, 0, (1 << bits) - 1, "compressed-tensors zero points")
    return _pack_last(zeros, bits).t().contiguous()


def unpack_ct_zero_point(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """weight_zero_point int32 [N*bits/32, G] -> zero points int32 [G, N]."""
    pack_factor(bits)
    return _unpack_last(packed.t().contiguous(), bits)


# ----------------------------------------------------------------------------------------- AWQ


def pack_awq_qweight(q: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit weights q [K, N] into AWQ qweight int32 [K, N/8] (interleaved along N)."""
    _check_range(q, 0, 15, "q")
    return _pack_last(q, 4, AWQ_ORDER)


def unpack_awq_qweight(qweight: torch.Tensor) -> torch.Tensor:
    """AWQ qweight int32 [K, N/8] -> q int32 [K, N]."""
    return _unpack_last(qweight, 4, AWQ_ORDER)


def pack_awq_qzeros(zeros: torch.Tensor) -> torch.Tensor:
    """Pack zero points [G, N] in [0, 15] into AWQ qzeros int32 [G, N/8] (same interleave)."""
    _check_range(zeros, 0, 15, "AWQ zeros")
    return _pack_last(zeros, 4, AWQ_ORDER)


def unpack_awq_qzeros(qzeros: torch.Tensor) -> torch.Tensor:
    """AWQ qzeros int32 [G, N/8] -> zero points int32 [G, N]."""
    return _unpack_last(qzeros, 4, AWQ_ORDER)


def dequantize_awq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> torch.Tensor:
    """W [N, K] (nn.Linear layout) in scales' dtype.

    W[n, k] = scales[k // group_size, n] * (q[k, n] - zero[k // group_size, n]).
    """
    q = unpack_awq_qweight(qweight)  # [K, N]
    zeros = unpack_awq_qzeros(qzeros)  # [G, N]
    K, N = q.shape
    gs = K if group_size == -1 else group_size
    g = torch.arange(K, device=q.device) // gs
    if zeros.shape != scales.shape or scales.shape != (-(-K // gs), N):
        raise ValueError(
            f"shape mismatch: q {tuple(q.shape)}, zeros {tuple(zeros.shape)}, "
            f"scales {tuple(scales.shape)}, group_size {group_size}"
        )
    w = (q - zeros[g]).to(torch.float32) * scales[g].to(torch.float32)  # [K, N]
    return w.to(scales.dtype).t().contiguous()
