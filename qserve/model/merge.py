"""Merged projections: q/k/v, and gate/up, read the same input and run as one matmul.

vLLM loads them into QKVParallelLinear / MergedColumnParallelLinear. Here the checkpoint's
modules stay (their names are the checkpoint's, and each is quantized on its own); once they
are loaded and prepared, a group whose kernel path concatenates gets one fused weight, and the
modules' own weights become views into it, so memory does not grow:

    nn.Linear      weights (and biases) concatenated along the output dim
    cpu-w4a16      the C++ kernel's packed codes and scales concatenated (`cpu_w4a16.concat`)

Other paths (Triton, torch's int4/int8 kernels, dequantized) keep one call per module. At
decode on CPU a call costs more in dispatch than in arithmetic for SmolLM2-sized layers, so
q/k/v + gate/up as two calls instead of five is a measurable part of a step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from qserve.kernels import cpu_w4a16, ops
from qserve.model.quant import QuantLinear

MergedLinear = Callable[[torch.Tensor], torch.Tensor]  # x [T, K] -> [T, sum of the outputs]


def merge_linears(linears: list[nn.Module]) -> MergedLinear | None:
    """One matmul for `linears` (same input size), or None where their paths do not merge."""
    if len({m.in_features for m in linears}) != 1:
        return None
    if all(isinstance(m, nn.Linear) for m in linears):
        return _merge_dense(linears)
    if all(isinstance(m, QuantLinear) and m.path == "cpu-w4a16" for m in linears):
        return _merge_w4(linears)
    return None


def _merge_dense(linears: list[nn.Linear]) -> MergedLinear | None:
    weights = [m.weight for m in linears]
    if len({(w.dtype, w.device) for w in weights}) != 1:
        return None
    if _mixed_bias([m.bias for m in linears]):
        return None
    biases = _cat_bias([m.bias for m in linears])
    weight = torch.cat([w.detach() for w in weights])
    sizes = [m.out_features for m in linears]
    for m, view in zip(linears, weight.split(sizes), strict=True):
        m.weight = nn.Parameter(view, requires_grad=False)
    if biases is not None:
        for m, view in zip(linears, biases.split(sizes), strict=True):
            m.bias = nn.Parameter(view, requires_grad=False)
    return lambda x: ops.linear(x, weight, biases)


def _merge_w4(linears: list[QuantLinear]) -> MergedLinear | None:
    if _mixed_bias([m.w4_bias for m in linears]):
        return None
    biases = _cat_bias([m.w4_bias for m in linears])
    try:
        w = cpu_w4a16.concat([m.w4 for m in linears])
    except ValueError:  # different groups or act-order permutations
        return None
    sizes = [m.out_features for m in linears]
    for m, view in zip(linears, cpu_w4a16.split(w, sizes), strict=True):
        m.w4 = view
    if biases is not None:
        for m, view in zip(linears, biases.split(sizes), strict=True):
            m.w4_bias = view
    return lambda x: cpu_w4a16.w4_mm(x, w, biases)


def _mixed_bias(biases: list[torch.Tensor | None]) -> bool:
    """Some modules have a bias and some not: their outputs do not merge."""
    return len({b is None for b in biases}) > 1


def _cat_bias(biases: list[torch.Tensor | None]) -> torch.Tensor | None:
    return None if biases[0] is None else torch.cat([b.detach() for b in biases])
