"""`--format compressed-tensors` for rtn / gptq / auto: llm-compressor's "pack-quantized" W4A16 /
W8A16 checkpoints, which vLLM, transformers (through the compressed-tensors package) and qserve
load. The codes, scales and zeros are those the GPTQ format would hold (`kernels.packing`
documents both layouts). Tensors per quantized linear `<name>`:

    <name>.weight_packed      int32 [N, K*bits/32]
    <name>.weight_scale       [N, G] in the checkpoint's dtype (llm-compressor's convention)
    <name>.weight_shape       int64 [2] = [N, K]
    <name>.weight_zero_point  int32 [N*bits/32, G]   asymmetric only

Act-order needs static groups (`--desc-act --static-groups`, compressed-tensors' actorder
"weight"): the format has no g_idx since compressed-tensors 0.20 removed actorder "group".

The config has one config group per scheme (bits, group size), targeting its linears by exact
name, so a mixed allocation (`--dynamic`, `--method auto`) is several groups; linears left
16-bit are listed in `ignore`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from qserve.errors import QServeError
from qserve.kernels import packing
from qserve.quantize.dynamic import Scheme
from qserve.quantize.rtn import QuantizedWeight

__all__ = ["FORMAT", "pack_quantized_tensors", "pack_quantized_config"]

FORMAT = "compressed-tensors"


def pack_quantized_tensors(qw: QuantizedWeight, dtype: torch.dtype) -> dict[str, Tensor]:
    """The pack-quantized tensors of one linear (suffix -> tensor). Groups must be in natural
    order: compressed-tensors 0.20 has no g_idx (its actorder "group" was removed)."""
    N, K = qw.Q.shape
    gs = K if qw.group_size == -1 else qw.group_size
    if not torch.equal(qw.g_idx.long(), torch.arange(K) // gs):
        raise QServeError("compressed-tensors has no g_idx: act-order needs --static-groups")
    out = {
        "weight_packed": packing.pack_ct_weight(qw.Q.to(torch.int32), qw.bits),
        "weight_scale": qw.scales.t().to(dtype).contiguous(),
        "weight_shape": torch.tensor([N, K], dtype=torch.int64),
    }
    if not qw.sym:
        out["weight_zero_point"] = packing.pack_ct_zero_point(qw.zeros.to(torch.int32), qw.bits)
    return out


def pack_quantized_config(
    schemes: dict[str, Scheme], ignore: list[str], sym: bool, act_order: bool
) -> dict[str, Any]:
    """config.json["quantization_config"]: `schemes` maps each quantized linear (checkpoint
    name) to its scheme; `ignore` names the linears left 16-bit."""
    by_scheme: dict[Scheme, list[str]] = {}
    for name, scheme in schemes.items():
        by_scheme.setdefault(scheme, []).append(name)
    ordered = sorted(by_scheme, key=lambda s: (-len(by_scheme[s]), s.bits, s.group_size))
    groups = {
        f"group_{i}": {
            "targets": sorted(by_scheme[scheme]),
            "weights": _weights(scheme, sym, act_order),
            "input_activations": None,
            "output_activations": None,
            "format": "pack-quantized",
        }
        for i, scheme in enumerate(ordered)
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": sorted(ignore),
        "kv_cache_scheme": None,
    }


def _weights(scheme: Scheme, sym: bool, act_order: bool) -> dict[str, Any]:
    grouped = scheme.group_size != -1
    return {
        "num_bits": scheme.bits,
        "type": "int",
        "symmetric": sym,
        "strategy": "group" if grouped else "channel",
        "group_size": scheme.group_size if grouped else None,
        "actorder": "weight" if act_order else None,  # static groups: no g_idx
        "dynamic": False,
    }
