"""Tensor-parallel weight shards (issue 24, `qserve.parallel.shard`): for every format, the
column shards' outputs concatenate to the whole layer's output and the row shards' partial
outputs sum to it (the all-reduce), computed from the shards' own dequantized weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from qserve.errors import QServeError
from qserve.kernels import packing
from qserve.parallel.shard import column_shard, row_shard
from qserve.quantize.export import awq_tensors, gptq_tensors
from qserve.quantize.rtn import rtn_quantize

N, K, GROUP = 128, 256, 32


def _layer(fmt: str, bits: int = 4, act_order: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    W = torch.randn(N, K, generator=g)
    bias = torch.randn(N, generator=g)
    if fmt == "dense":
        return {"weight": W, "bias": bias}
    if fmt == "w8":
        scale = W.abs().amax(dim=1, keepdim=True) / 127
        return {
            "weight": torch.round(W / scale).to(torch.int8),
            "weight_scale": scale,
            "bias": bias,
        }
    qw = rtn_quantize(W, bits, GROUP, fmt == "gptq", 1)
    if act_order:  # channels visited by a permutation: g_idx no longer consecutive
        perm = torch.randperm(K, generator=g)
        qw = dataclasses.replace(qw, g_idx=qw.g_idx[torch.argsort(perm)])
    tensors = gptq_tensors(qw) if fmt == "gptq" else awq_tensors(qw)
    return {**tensors, "bias": bias}


def _weight(t: dict[str, torch.Tensor], fmt: str, bits: int = 4) -> torch.Tensor:
    """[n, k] fp32 of one shard, from its own tensors."""
    if fmt == "dense":
        return t["weight"]
    if fmt == "w8":
        return t["weight"].float() * t["weight_scale"]
    if fmt == "gptq":
        return packing.dequantize_gptq(
            t["qweight"], t["qzeros"], t["scales"].float(), t["g_idx"], bits
        )
    return packing.dequantize_awq(t["qweight"], t["qzeros"], t["scales"].float(), GROUP)


def _forward(t: dict[str, torch.Tensor], fmt: str, x: torch.Tensor, bits: int = 4) -> torch.Tensor:
    y = x @ _weight(t, fmt, bits).t()
    return y + t["bias"] if "bias" in t else y


CASES = [("dense", 4, False), ("w8", 8, False), ("gptq", 4, False), ("gptq", 8, False),
         ("gptq", 4, True), ("gptq", 3, False), ("gptq", 3, True), ("awq", 4, False)]  # fmt: skip


@pytest.mark.parametrize("fmt, bits, act_order", CASES)
@pytest.mark.parametrize("world", [2, 4])
def test_shards_compute_the_whole_layer(fmt: str, bits: int, act_order: bool, world: int) -> None:
    layer = _layer(fmt, bits, act_order)
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(1))
    whole = _forward(layer, fmt, x, bits)
    columns = [_forward(column_shard(layer, fmt, r, world), fmt, x, bits) for r in range(world)]
    torch.testing.assert_close(torch.cat(columns, dim=1), whole, rtol=0, atol=1e-5)
    part = K // world
    rows = [
        _forward(row_shard(layer, fmt, r, world, GROUP), fmt, x[:, r * part : (r + 1) * part], bits)
        for r in range(world)
    ]
    torch.testing.assert_close(sum(rows), whole, rtol=1e-5, atol=1e-4)  # the all-reduce
    shard = row_shard(layer, fmt, 1, world, GROUP)
    assert "bias" not in shard  # added once, by rank 0
    if fmt in ("gptq", "awq") and not act_order:
        assert shard["scales"].shape[0] == K // world // GROUP  # only its own groups
    if act_order:
        assert shard["scales"].shape[0] == K // GROUP  # every group: g_idx points anywhere


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda: row_shard(_layer("gptq"), "gptq", 0, 16, GROUP, "model.layers.0.mlp.down_proj"),
            "model.layers.0.mlp.down_proj: tensor parallel size 16 splits its 256 input channels "
            "into 16 per rank, not a multiple of 32 (whole groups of 32)",
        ),
        (lambda: column_shard(_layer("awq"), "awq", 0, 32, "o"), "not a multiple of 8"),
        (
            lambda: column_shard(_layer("gptq", 3), "gptq", 0, 8, "q"),
            "16 per rank, not a multiple of 32 (the 32 values packed in 3 words)",
        ),
        (lambda: column_shard(_layer("dense"), "dense", 0, 3, "q"), "42.6667 per rank"),
    ],
    ids=["row-splits-a-group", "column-splits-a-word", "column-splits-a-3-bit-run", "uneven"],
)
def test_cuts_the_formats_cannot_hold_are_one_line_errors(call, message: str) -> None:
    with pytest.raises(QServeError, match=message.replace("(", r"\(").replace(")", r"\)")) as info:
        call()
    assert "\n" not in str(info.value)
