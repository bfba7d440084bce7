"""Architecture knowledge as data: the linears of a decoder block and which op feeds which.

`sequential`: the order GPTQ's true-sequential mode quantizes the block's linears in (each
group's inputs are collected after the previous groups were quantized).
`mappings`: (prev op, linears it feeds) for AWQ / SmoothQuant scale folding. A mapping whose
prev is a linear (v_proj -> o_proj) only folds when the shapes line up (no grouped-query
attention), as AutoAWQ does.
`attention`: the block's attention module, whose keys/values FP8 KV cache scales are taken of
(the checkpoint names them `<blocks>.N.<attention>.k_scale` / `v_scale`).

Linears of one sequential group under one parent module read the same input (q/k/v, gate/up,
one expert's gate/up): it is collected once, for the first of them (`ArchSpec.owner`).

Mixture of experts (`moe`, a `MoeSpec`): the spec names the dense MLP; a block whose MLP is a
sparse MoE block (`qserve.quantize.moe.CalibrationMoe`, per-expert linears) gets the spec
`with_experts(E)`, where each dense MLP linear becomes that linear of every expert (gate/up of
expert 0, gate/up of expert 1, ..., then every down), the router joins the gate/up group (it
reads the same input; it is never quantized: the driver adds it to the ignored modules), and
the mappings become post_attention_layernorm -> (router, every expert's gate and up) and, per
expert, up -> down. Folding into the norm scales the router's columns too, so routing is
unchanged (AutoAWQ folds into the experts only, which changes the router's input).
`checkpoint_name` gives the names checkpoints use (Mixtral's `block_sparse_moe`, which
transformers 5 calls `mlp`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from qserve.errors import QServeError

if TYPE_CHECKING:
    from torch import nn

__all__ = ["ScaleMapping", "MoeSpec", "ArchSpec", "ARCHITECTURES", "arch_spec"]


@dataclass(frozen=True)
class ScaleMapping:
    prev: str  # module name relative to the block, e.g. "input_layernorm"
    linears: tuple[str, ...]
    smooth: bool = True  # also used by SmoothQuant (only norm -> linears mappings are)


@dataclass(frozen=True)
class MoeSpec:
    """The sparse MoE block of a decoder block: its module, names and routing."""

    experts: tuple[str, str, str]  # each expert's gate, up, down linears (checkpoint names)
    checkpoint_block: str = "mlp"  # the MoE block's name in checkpoints (Mixtral's differs)
    renormalize: str | None = None  # config key saying whether top-k weights sum to 1; None: yes
    block: str = "mlp"  # the MoE block in a decoder block (transformers' module name)
    router: str = "gate"  # the router linear inside it (one logit per expert)
    dense: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # the MLP's in the spec


@dataclass(frozen=True)
class ArchSpec:
    blocks: str  # dotted path of the ModuleList of decoder blocks
    sequential: tuple[tuple[str, ...], ...]
    mappings: tuple[ScaleMapping, ...]
    attention: str = "self_attn"
    moe: MoeSpec | None = None
    num_experts: int = 0  # > 0: this spec is for a sparse block (`with_experts`)

    @property
    def linears(self) -> tuple[str, ...]:
        return tuple(name for group in self.sequential for name in group)

    def owner(self, name: str) -> str:
        """The linear whose input `name` reads too: the first of its sequential group under the
        same parent module (`name` itself when it is in no group)."""
        parent = name.rpartition(".")[0]
        group = next((g for g in self.sequential if name in g), (name,))
        return next(n for n in group if n.rpartition(".")[0] == parent)

    def is_expert(self, name: str) -> bool:
        """Whether linear `name` (relative to a block) belongs to an expert."""
        return self.moe is not None and name.startswith(f"{self.moe.block}.experts.")

    def for_block(self, block: nn.Module) -> ArchSpec:
        """The spec of `block`: with its experts when its MLP is a sparse MoE block (per-expert
        linears in an `experts` list), else this one."""
        if self.moe is None:
            return self
        experts = getattr(block.get_submodule(self.moe.block), "experts", None)
        return self.with_experts(len(experts)) if hasattr(experts, "__len__") else self

    def with_experts(self, num_experts: int) -> ArchSpec:
        """This spec with the dense MLP's linears replaced by `num_experts` experts'."""
        return _with_experts(self, num_experts)

    def checkpoint_name(self, name: str) -> str:
        """A full module or tensor name as checkpoints write it (Mixtral: `block_sparse_moe.`
        for the MoE block that transformers 5 names `mlp.`)."""
        moe = self.moe
        head = self.blocks + "."
        if moe is None or moe.block == moe.checkpoint_block or not name.startswith(head):
            return name
        layer, _, rest = name[len(head) :].partition(".")
        inside = rest.removeprefix(moe.block + ".")
        if inside == rest or inside.partition(".")[0] not in (moe.router, "experts"):
            return name
        return f"{head}{layer}.{moe.checkpoint_block}.{inside}"


@functools.cache
def _with_experts(spec: ArchSpec, num_experts: int) -> ArchSpec:
    moe = spec.moe
    assert moe is not None and num_experts > 0
    prefix = moe.block + "."

    def in_moe(name: str) -> bool:
        return name.startswith(prefix)

    def expert(name: str, e: int) -> str:
        leaf = moe.experts[moe.dense.index(name.removeprefix(prefix))]
        return f"{prefix}experts.{e}.{leaf}"

    def every_expert(names: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(expert(n, e) for e in range(num_experts) for n in names)

    router = prefix + moe.router
    sequential = []
    for group in spec.sequential:
        if not any(map(in_moe, group)):
            sequential.append(group)
        else:  # the router reads what gate/up read
            head = (router,) if moe.dense[0] in (n.removeprefix(prefix) for n in group) else ()
            sequential.append(head + every_expert(group))
    mappings = []
    for m in spec.mappings:
        if not any(map(in_moe, m.linears)):
            mappings.append(m)
        elif not in_moe(m.prev):  # the norm before the MoE block feeds the router too
            mappings.append(replace(m, linears=(router, *every_expert(m.linears))))
        else:  # up -> down inside each expert
            mappings += [
                replace(m, prev=expert(m.prev, e), linears=tuple(expert(n, e) for n in m.linears))
                for e in range(num_experts)
            ]
    return replace(
        spec, sequential=tuple(sequential), mappings=tuple(mappings), num_experts=num_experts
    )


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

# Mixtral and Qwen3-MoE: Llama's attention, a sparse MoE block as the MLP (Qwen3-MoE's
# mlp_only_layers keep a dense MLP: those blocks use the spec as it is).
_MIXTRAL = replace(
    _LLAMA, moe=MoeSpec(experts=("w1", "w3", "w2"), checkpoint_block="block_sparse_moe")
)
_QWEN3_MOE = replace(
    _LLAMA,
    moe=MoeSpec(experts=("gate_proj", "up_proj", "down_proj"), renormalize="norm_topk_prob"),
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
    "mixtral": _MIXTRAL,
    "qwen3_moe": _QWEN3_MOE,
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
