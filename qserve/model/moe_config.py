"""Mixture-of-experts fields of a config.json (Mixtral, Qwen3-MoE), checked once.

    Mixtral      num_local_experts, num_experts_per_tok; every layer sparse; experts of
                 `intermediate_size`; top-k probabilities always renormalized
    Qwen3-MoE    num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob;
                 layer i is sparse unless i is in `mlp_only_layers` or (i + 1) is not a multiple
                 of `decoder_sparse_step` (those get a dense MLP of `intermediate_size`)

Each expert is a SwiGLU MLP whose linears the checkpoint names per expert: Mixtral's
`experts.N.w1` (gate), `w3` (up), `w2` (down); Qwen3-MoE's `experts.N.gate_proj`, `up_proj`,
`down_proj`. The expert count is read under either name (transformers 5 writes Qwen3-MoE's
as num_local_experts). Training-only settings (router_aux_loss_coef, output_router_logits,
router_jitter_noise) do not change inference and are not read.

Quantized checkpoints (GPTQ, AWQ, compressed-tensors, as `qserve quantize`, GPTQModel and
llm-compressor write them) quantize each expert's linears on their own; the router stays dense.
"""

from __future__ import annotations

from typing import Any

from qserve.errors import QServeError

# model_type -> each expert's (gate, up, down) linear names in the checkpoint.
EXPERT_NAMES = {
    "mixtral": ("w1", "w3", "w2"),
    "qwen3_moe": ("gate_proj", "up_proj", "down_proj"),
}
# Keys that MoE variants we do not run would need (Qwen2-MoE's shared expert, DeepSeek's groups).
_UNSUPPORTED_KEYS = ("shared_expert_intermediate_size", "n_shared_experts", "n_group")


def moe_fields(raw: dict[str, Any], model_type: str, source: str) -> dict[str, Any]:
    """ModelConfig's MoE fields for `model_type` ({} for a dense architecture)."""
    if model_type not in EXPERT_NAMES:
        return {}
    _refuse_unsupported(raw, source)
    mixtral = model_type == "mixtral"
    num_experts = _positive(raw, _experts_key(raw), source)
    top_k = _positive(raw, "num_experts_per_tok", source)
    if top_k > num_experts:
        raise QServeError(
            f"{source}: num_experts_per_tok {top_k} is more than the {num_experts} experts"
        )
    num_layers = _positive(raw, "num_hidden_layers", source)
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": _positive(
            raw, "intermediate_size" if mixtral else "moe_intermediate_size", source
        ),
        "norm_topk_prob": True if mixtral else bool(raw.get("norm_topk_prob", False)),
        "moe_layers": (
            tuple(range(num_layers)) if mixtral else _qwen_moe_layers(raw, num_layers, source)
        ),
        "expert_names": EXPERT_NAMES[model_type],
    }


def _experts_key(raw: dict[str, Any]) -> str:
    """Mixtral says num_local_experts, Qwen3-MoE num_experts (transformers 5 writes either)."""
    return "num_experts" if "num_experts" in raw else "num_local_experts"


def _qwen_moe_layers(raw: dict[str, Any], num_layers: int, source: str) -> tuple[int, ...]:
    """The sparse layers, as transformers' Qwen3MoeDecoderLayer picks them."""
    step = raw.get("decoder_sparse_step", 1)
    dense = raw.get("mlp_only_layers") or []
    if not isinstance(step, int) or isinstance(step, bool) or step <= 0:
        raise QServeError(f"{source}: decoder_sparse_step is {step!r}; expected a positive integer")
    if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
        raise QServeError(f"{source}: mlp_only_layers is {dense!r}; expected a list of layers")
    return tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)


def _refuse_unsupported(raw: dict[str, Any], source: str) -> None:
    for key in _UNSUPPORTED_KEYS:
        if raw.get(key):
            raise QServeError(f"{source}: {key} (shared or grouped experts) is not supported")


def _positive(raw: dict[str, Any], key: str, source: str) -> int:
    value = raw.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise QServeError(f"{source}: {key} is {value!r}; expected a positive integer")
    return value
