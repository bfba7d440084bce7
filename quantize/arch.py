"""Architecture knowledge as data: the linears of a decoder block and which op feeds which.

`sequential`: the order GPTQ's true-sequential mode quantizes the block's linears in (each
group's inputs are collected after the previous groups were quantized).
`mappings`: (prev op, linears it feeds) for AWQ / SmoothQuant scale folding. A mapping whose
prev is a linear (v_proj -> o_proj) only folds when the shapes line up (no grouped-query
attention), as AutoAWQ does.
`attention`: the block's attention module, whose keys/values FP8 KV cache scales are taken of
(the checkpoint names them `<blocks>.N.<attention>.k_scale` / `v_scale`).
"""

from __future__ import annotations

from dataclasses import dataclass

from qserve.errors import QServeError

__all__ = ["ScaleMapping", "ArchSpec", "ARCHITECTURES", "arch_spec"]


@dataclass(frozen=True)
class ScaleMapping:
    prev: str  # module name relative to the block, e.g. "input_layernorm"
    linears: tuple[str, ...]
    smooth: bool = True  # also used by SmoothQuant (only norm -> linears mappings are)


@dataclass(frozen=True)
class ArchSpec:
    blocks: str  # dotted path of the ModuleList of decoder blocks
    sequential: tuple[tuple[str, ...], ...]
    mappings: tuple[ScaleMapping, ...]
    attention: str = "self_attn"

    @property
    def linears(self) -> tuple[str, ...]:
        return tuple(name for group in self.sequential for name in group)


_LLAMA = ArchSpec(
    blocks="model.layers",
    sequential=(
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        ("self_attn.o_proj",),
        ("mlp.gate_proj", "mlp.up_proj"),
        ("mlp.down_proj",),
    ),
    mappings=(
        ScaleMapping(
            "input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        ),
        ScaleMapping("self_attn.v_proj", ("self_attn.o_proj",), smooth=False),
        ScaleMapping("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
        ScaleMapping("mlp.up_proj", ("mlp.down_proj",), smooth=False),
    ),
)

# Gemma 3: the MLP's input norm is pre_feedforward_layernorm (post_attention_layernorm acts on
# the attention output); its norms scale by (1 + w), which fold.norm_offset knows.
_GEMMA3 = ArchSpec(
    blocks="model.layers",
    sequential=_LLAMA.sequential,
    mappings=(
        _LLAMA.mappings[0],
        _LLAMA.mappings[1],
        ScaleMapping("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
        _LLAMA.mappings[3],
    ),
)

# Phi-3: q/k/v and gate/up are one linear each. Scales fold from the norms into them; v -> o and
# up -> down do not fold (the previous linear's output holds q and k, or gate, too).
_PHI3 = ArchSpec(
    blocks="model.layers",
    sequential=(
        ("self_attn.qkv_proj",),
        ("self_attn.o_proj",),
        ("mlp.gate_up_proj",),
        ("mlp.down_proj",),
    ),
    mappings=(
        ScaleMapping("input_layernorm", ("self_attn.qkv_proj",)),
        ScaleMapping("post_attention_layernorm", ("mlp.gate_up_proj",)),
    ),
)

# model_type (config.json) -> spec. Mistral, Qwen2 and Qwen3 share Llama's block layout (Qwen3's
# q_norm / k_norm act per head after the projections: they fold nothing and are left in float).
ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": _LLAMA,
    "phi3": _PHI3,
    "gemma3_text": _GEMMA3,
}


def arch_spec(model_type: str) -> ArchSpec:
    try:
        return ARCHITECTURES[model_type]
    except KeyError:
        raise QServeError(
            f"unsupported architecture {model_type!r} for quantization "
            f"(supported: {', '.join(sorted(ARCHITECTURES))})",
            param="model",
        ) from None
