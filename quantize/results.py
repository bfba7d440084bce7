"""What quantizing a block gives back: the quantized weights of its linears and the K/V absmax
of its attention, and `to_device` to move them (and any nest of tensors) between devices."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import Tensor

from qserve.quantize.rtn import QuantizedWeight

__all__ = ["W8Weight", "BlockResults", "to_device"]


@dataclasses.dataclass(frozen=True)
class W8Weight:
    """int8 or fp8 weight Q [N, K] with weight_scale [N, 1] | [1] and optional input_scale [1]."""

    Q: Tensor
    weight_scale: Tensor
    input_scale: Tensor | None = None


@dataclasses.dataclass
class BlockResults:
    """What `quantize_blocks` returns, on the CPU."""

    linears: dict[str, QuantizedWeight | W8Weight] = dataclasses.field(default_factory=dict)
    # attention module (model.layers.N.self_attn) -> (max |K|, max |V|), fp32 scalars
    kv_absmax: dict[str, tuple[Tensor, Tensor]] = dataclasses.field(default_factory=dict)
    # linears that saw too few calibration tokens (experts) -> their token count
    fallbacks: dict[str, int] = dataclasses.field(default_factory=dict)

    def update(self, other: BlockResults) -> None:
        self.linears.update(other.linears)
        self.kv_absmax.update(other.kv_absmax)
        self.fallbacks.update(other.fallbacks)


def to_device(obj: Any, device: Any) -> Any:
    """`obj` with every tensor in it (lists, tuples, dicts, result dataclasses) on `device`."""
    if isinstance(obj, Tensor):
        return obj.to(device)
    if type(obj) in (list, tuple):
        return type(obj)(to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (QuantizedWeight, W8Weight)):
        fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        return dataclasses.replace(obj, **to_device(fields, device))
    return obj
