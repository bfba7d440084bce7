"""FP8 KV cache scales from checkpoints: `k_scale` / `v_scale` tensors into `Attention`.

Names the ecosystem writes, per decoder layer i (`model.layers.{i}.self_attn...`):

    .self_attn.k_scale, .self_attn.v_scale             compressed-tensors kv_cache_scheme
    .self_attn.attn.k_scale, .self_attn.attn.v_scale   vLLM's module names
    .self_attn.k_proj.k_scale, .self_attn.v_proj.v_scale   vLLM / AutoFP8 `fp8` checkpoints
    .self_attn.k_proj.output_scale, .self_attn.v_proj.output_scale   older compressed-tensors
    .self_attn.kv_scale                                 one scale for both (deprecated)

A scale is one number (per tensor) or [num_kv_heads] (per KV head). Pages hold x / scale.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from qserve.errors import QServeError
from qserve.kernels.attention_ref import Scale
from qserve.model.attention import Attention

_PATTERNS = (
    (re.compile(r"^(.*\.self_attn)\.(?:attn\.)?(k|v)_scale$"), None),
    (re.compile(r"^(.*\.self_attn)\.(k|v)_proj\.(?:k|v)_scale$"), None),
    (re.compile(r"^(.*\.self_attn)\.(k|v)_proj\.output_scale$"), None),
    (re.compile(r"^(.*\.self_attn)\.kv_scale$"), "kv"),
)
# Attention-side scales some exporters also write; the torch/Triton attention does not use them.
_UNUSED = re.compile(r"^.*\.self_attn\.(?:attn\.)?(?:q|prob)_scale$")

KVScales = dict[str, dict[str, torch.Tensor]]  # attention module prefix -> {"k"|"v": tensor}


def pop_kv_scales(state: dict[str, torch.Tensor]) -> KVScales:
    """Remove every KV scale tensor from `state`; {".../self_attn": {"k": t, "v": t}}."""
    found: KVScales = {}
    for name in list(state):
        if _UNUSED.match(name):
            del state[name]
            continue
        for pattern, both in _PATTERNS:
            m = pattern.match(name)
            if m is None:
                continue
            tensor = state.pop(name)
            for which in ("k", "v") if both else (m.group(2),):
                found.setdefault(m.group(1), {})[which] = tensor
            break
    return found


def apply_kv_scales(model: nn.Module, scales: KVScales) -> int:
    """Set `Attention.k_scale` / `v_scale` of every layer the checkpoint has scales for.

    Returns the number of attention layers that got both scales."""
    complete = 0
    for prefix, pair in scales.items():
        attn = _attention(model, prefix)
        if "k" in pair:
            attn.k_scale = _as_scale(pair["k"], attn, f"{prefix} k_scale")
        if "v" in pair:
            attn.v_scale = _as_scale(pair["v"], attn, f"{prefix} v_scale")
        complete += "k" in pair and "v" in pair
    return complete


def _attention(model: nn.Module, prefix: str) -> Attention:
    try:
        module = model.get_submodule(prefix)
    except AttributeError:
        raise QServeError(f"checkpoint has KV scales for {prefix}, which the model lacks") from None
    attn = getattr(module, "attn", None)
    if not isinstance(attn, Attention):
        raise QServeError(f"checkpoint has KV scales for {prefix}, which is not an attention")
    return attn


def _as_scale(tensor: torch.Tensor, attn: Attention, what: str) -> Scale:
    """One number -> float; [num_kv_heads] -> fp32 tensor on the model's device."""
    values = tensor.detach().to(torch.float32).reshape(-1)
    if values.numel() == 1:
        value = float(values[0])
        if not value > 0:
            raise QServeError(f"{what} is {value}; expected a positive scale")
        return value
    if values.numel() != attn.num_kv_heads:
        raise QServeError(
            f"{what} has {values.numel()} values; expected 1 or {attn.num_kv_heads} (per KV head)"
        )
    if not bool((values > 0).all()):
        raise QServeError(f"{what} has a non-positive value; expected positive scales")
    return values
