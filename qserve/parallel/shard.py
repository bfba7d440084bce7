"""Megatron-style weight shards for tensor parallelism (issue 24), as pure functions on one
linear's checkpoint tensors: what rank r of `world` ranks holds.

    column  the output dim N is split (vLLM's ColumnParallelLinear: q/k/v, gate/up); each rank
            computes its slice of the output, gathered or consumed as is by the next layer
    row     the input dim K is split (vLLM's RowParallelLinear: o_proj, down_proj); each rank
            computes a partial output from its slice of the input, and the partials are summed
            (all-reduce); the bias is added once, on rank 0

Formats (tensor suffix -> shape; `kernels/packing.py` has the layouts):

    dense  weight [N, K], bias [N]
    gptq   qweight [K*b/32, N], qzeros [G, N*b/32], scales [G, N], g_idx [K], bias [N]
    awq    qweight [K, N/8], qzeros [G, N/8], scales [G, N], bias [N]
    w8     weight [N, K] int8/fp8, weight_scale [N, 1] or [1], input_scale [1], bias [N]

Shards are cut where the formats allow it, or refused in one line naming the layer and why:
N per rank a multiple of the values packed in a word along N (32 values in 3 words at 3 bits:
`packing.pack_block`); K per rank a multiple of the values packed along K, and of the group
size unless GPTQ act-order (`g_idx` not consecutive), where, as vLLM does, every rank keeps all
groups' scales and zeros and its slice of g_idx. Contiguous ranges (`shard_range`), rank 0
first.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qserve.errors import QServeError
from qserve.kernels import packing

__all__ = ["FORMATS", "shard_range", "column_shard", "row_shard"]

FORMATS = ("dense", "gptq", "awq", "w8")
Tensors = dict[str, Tensor]


def shard_range(size: int, rank: int, world: int) -> tuple[int, int]:
    """[start, end) of rank `rank`'s equal part of `size` (which `world` divides)."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside a world of {world}")
    if size % world:
        raise ValueError(f"{size} does not split into {world} equal parts")
    part = size // world
    return rank * part, (rank + 1) * part


def column_shard(
    tensors: Tensors, fmt: str, rank: int, world: int, name: str = "linear"
) -> Tensors:
    """Rank `rank`'s tensors when the output dim is split."""
    N = _out_features(tensors, fmt)
    pack, words = _block(tensors, fmt, N) if fmt == "gptq" else ({"awq": 8}.get(fmt, 1), 1)
    _check_cut(N, world, pack, name, "output channels", _packed_why(pack, words))
    r0, r1 = shard_range(N, rank, world)
    out: Tensors = {}
    for key, t in tensors.items():
        if key == "bias" or (key in ("weight", "weight_scale") and t.shape[0] == N):
            out[key] = t[r0:r1]  # [N, ...]: dense / w8 weight, per-channel w8 scales, bias
        elif key == "scales" or (fmt == "gptq" and key == "qweight"):
            out[key] = t[:, r0:r1]  # [.., N]
        elif key == "qzeros" or (fmt == "awq" and key == "qweight"):
            out[key] = t[:, r0 // pack * words : r1 // pack * words]  # [.., N / pack * words]
        else:  # g_idx, per-tensor scales, input_scale: whole on every rank
            out[key] = t
    return {k: v.contiguous() for k, v in out.items()}


def row_shard(
    tensors: Tensors, fmt: str, rank: int, world: int, group_size: int = -1, name: str = "linear"
) -> Tensors:
    """Rank `rank`'s tensors when the input dim is split (bias on rank 0 only). `group_size`:
    gptq / awq (-1: one group per channel, which every K split keeps whole)."""
    K = _in_features(tensors, fmt)
    N = _out_features(tensors, fmt)
    pack, words = _block(tensors, fmt, N) if fmt == "gptq" else (1, 1)
    act_order = fmt == "gptq" and "g_idx" in tensors and not _ascending(tensors["g_idx"])
    grouped = fmt in ("gptq", "awq") and group_size != -1 and not act_order
    unit = max(group_size, pack) if grouped else pack
    what = f"whole groups of {group_size}" if grouped else _packed_why(pack, words)
    _check_cut(K, world, unit, name, "input channels", what)
    k0, k1 = shard_range(K, rank, world)
    g0, g1 = (k0 // group_size, k1 // group_size) if grouped else (None, None)
    out: Tensors = {}
    for key, t in tensors.items():
        if key == "bias":
            if rank == 0:
                out[key] = t
        elif key == "weight":
            out[key] = t[:, k0:k1]  # dense / w8 [N, K]
        elif key == "qweight":
            out[key] = t[k0 // pack * words : k1 // pack * words] if fmt == "gptq" else t[k0:k1]
        elif key == "g_idx":
            out[key] = t[k0:k1] - (g0 or 0)  # its groups renumbered from the shard's first
        elif key in ("scales", "qzeros") and g0 is not None:
            out[key] = t[g0:g1]
        else:  # per-channel quantization, act-order scales/zeros, w8 scales: whole
            out[key] = t
    return {k: v.contiguous() for k, v in out.items()}


def _packed_why(pack: int, words: int) -> str:
    if words == 1:
        return f"the {pack} values packed in a word"
    return f"the {pack} values packed in {words} words"


def _check_cut(size: int, world: int, unit: int, name: str, what: str, why: str) -> None:
    if size % world or (size // world) % unit:
        raise QServeError(
            f"{name}: tensor parallel size {world} splits its {size} {what} into "
            f"{size / world:g} per rank, not a multiple of {unit} ({why})",
            "tensor_parallel_size",
        )


def _ascending(g_idx: Tensor) -> bool:
    """Groups in input-channel order (no act-order permutation)."""
    g = g_idx.to(torch.int64)
    return bool(torch.all(g[1:] >= g[:-1]))


def _out_features(tensors: Tensors, fmt: str) -> int:
    if fmt in ("dense", "w8"):
        return tensors["weight"].shape[0]
    if fmt in ("gptq", "awq"):
        return tensors["scales"].shape[1]
    raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")


def _in_features(tensors: Tensors, fmt: str) -> int:
    if fmt in ("dense", "w8"):
        return tensors["weight"].shape[1]
    if fmt == "awq":
        return tensors["qweight"].shape[0]
    return tensors["qweight"].shape[0] * 32 // _bits(tensors, fmt, _out_features(tensors, fmt))


def _block(tensors: Tensors, fmt: str, N: int) -> tuple[int, int]:
    """GPTQ's (values, words) of one packed run (`packing.pack_block`): a cut falls between
    runs."""
    return packing.pack_block(_bits(tensors, fmt, N))


def _bits(tensors: Tensors, fmt: str, N: int) -> int:
    """GPTQ's bits from the packed zeros' width: qzeros [G, N * bits / 32]."""
    if fmt != "gptq":
        return 4
    return tensors["qzeros"].shape[1] * 32 // N
