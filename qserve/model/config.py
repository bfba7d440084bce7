"""ModelConfig: the facts of a checkpoint's config.json that the engine needs, checked once."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qserve.errors import QServeError
from qserve.model.layer_types import gemma3_fields, global_rope_parameters, layer_types
from qserve.model.moe_config import moe_fields
from qserve.model.quant_config import QuantScheme, parse_quant_scheme


@dataclass(frozen=True)
class ArchitectureSpec:
    """What differs between the Llama-family architectures we run with one model class."""

    model_type: str
    qkv_bias: bool | None  # None: read config["attention_bias"] (default False)
    o_proj_bias_follows_qkv: bool  # Llama puts attention_bias on o_proj too; Qwen2 does not
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k, before RoPE
    fused_projections: bool = False  # Phi-3: one qkv_proj, one gate_up_proj in the checkpoint
    family: str = "llama"  # the model class: llama (LlamaForCausalLM) | gemma3
    activation: str = "silu"  # the MLP's, as config.json names it


ARCHITECTURES: dict[str, ArchitectureSpec] = {
    "LlamaForCausalLM": ArchitectureSpec("llama", qkv_bias=None, o_proj_bias_follows_qkv=True),
    "MistralForCausalLM": ArchitectureSpec("mistral", qkv_bias=None, o_proj_bias_follows_qkv=True),
    "Qwen2ForCausalLM": ArchitectureSpec("qwen2", qkv_bias=True, o_proj_bias_follows_qkv=False),
    "Qwen3ForCausalLM": ArchitectureSpec(
        "qwen3", qkv_bias=None, o_proj_bias_follows_qkv=True, qk_norm=True
    ),
    "Phi3ForCausalLM": ArchitectureSpec(
        "phi3", qkv_bias=False, o_proj_bias_follows_qkv=False, fused_projections=True
    ),
    "Gemma3ForCausalLM": ArchitectureSpec(
        "gemma3",
        qkv_bias=None,
        o_proj_bias_follows_qkv=True,
        qk_norm=True,
        family="gemma3",
        activation="gelu_pytorch_tanh",
    ),  # fmt: skip
    # Mixture of experts (qserve.model.moe_config): sparse MoE blocks instead of MLPs
    "MixtralForCausalLM": ArchitectureSpec(
        "mixtral", qkv_bias=False, o_proj_bias_follows_qkv=False
    ),
    "Qwen3MoeForCausalLM": ArchitectureSpec(
        "qwen3_moe", qkv_bias=None, o_proj_bias_follows_qkv=True, qk_norm=True
    ),
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 frequency scaling (`rope_type: llama3`) or Phi-3's LongRoPE (`longrope`: per
    frequency `short_factor` / `long_factor` divisors, cos and sin times `attention_factor`)."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 1.0
    original_max_position_embeddings: int = 0
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None  # None: plain RoPE
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v_proj
    o_proj_bias: bool
    mlp_bias: bool
    eos_token_ids: list[int]
    torch_dtype: torch.dtype  # dtype the checkpoint was saved in
    sliding_window: int | None = None  # None when absent or no shorter than the context
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (q_norm / k_norm)
    fused_projections: bool = False  # qkv_proj / gate_up_proj modules instead of q/k/v, gate/up
    family: str = "llama"  # which model class runs it (ArchitectureSpec.family)
    hidden_act: str = "silu"  # silu | gelu_pytorch_tanh (Gemma 3)
    layer_types: tuple[str, ...] = ()  # full_attention | sliding_attention, per layer
    # Gemma 3: local layers' RoPE base, q.k scale, final logit soft-cap, sqrt(hidden) on embeddings
    local_rope_theta: float | None = None
    attention_scale: float | None = None  # None: head_dim ** -0.5
    final_logit_softcapping: float | None = None
    embed_scale: float | None = None
    # Mixture of experts (qserve.model.moe_config): 0 experts is a dense model
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k experts per token
    moe_intermediate_size: int = 0  # each expert's; dense layers keep intermediate_size
    norm_topk_prob: bool = False  # renormalize the top-k router probabilities to sum to 1
    moe_layers: tuple[int, ...] = ()  # the layers with a sparse MoE block instead of an MLP
    expert_names: tuple[str, ...] = ()  # each expert's gate, up, down linears (checkpoint's)
    quantization: QuantScheme | None = None  # None: a dense checkpoint

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer`'s attention; None: full attention."""
        sliding = self.layer_types and self.layer_types[layer] == "sliding_attention"
        return self.sliding_window if sliding else None

    @property
    def max_context_len(self) -> int:
        """Longest sequence the model runs (sliding windows are honoured per layer)."""
        return self.max_position_embeddings

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Read `path/config.json` (and `generation_config.json` for extra EOS ids)."""
        folder = Path(path)
        raw = read_json(folder / "config.json", what="model config")
        gen_path = folder / "generation_config.json"
        gen = read_json(gen_path, what="generation config") if gen_path.is_file() else {}
        return cls.from_dict(raw, gen, source=str(folder / "config.json"))

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], generation: dict[str, Any] | None = None, source: str = "config"
    ) -> ModelConfig:
        arch = _architecture(raw, source)
        spec = ARCHITECTURES[arch]
        hidden = _int(raw, "hidden_size", source)
        heads = _int(raw, "num_attention_heads", source)
        activation = _activation(raw, spec, source)
        theta, scaling = _rope(raw, source)
        qkv_bias = (
            bool(raw.get("attention_bias", False)) if spec.qkv_bias is None else spec.qkv_bias
        )
        max_pos = _int(raw, "max_position_embeddings", source)
        return cls(
            architecture=arch,
            vocab_size=_int(raw, "vocab_size", source),
            hidden_size=hidden,
            intermediate_size=_int(raw, "intermediate_size", source),
            num_hidden_layers=_int(raw, "num_hidden_layers", source),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            o_proj_bias=qkv_bias and spec.o_proj_bias_follows_qkv,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            eos_token_ids=_eos_token_ids(raw, generation or {}),
            torch_dtype=_dtype(raw, source),
            sliding_window=_sliding_window(raw, max_pos),
            qk_norm=spec.qk_norm,
            fused_projections=spec.fused_projections,
            family=spec.family,
            hidden_act=activation,
            layer_types=layer_types(
                raw,
                spec.model_type,
                _int(raw, "num_hidden_layers", source),
                _sliding_window(raw, max_pos),
                source,
            ),  # fmt: skip
            **(gemma3_fields(raw, source) if spec.family == "gemma3" else {}),
            **moe_fields(raw, spec.model_type, source),
            quantization=parse_quant_scheme(raw.get("quantization_config"), source),
        )


def read_json(path: Path, what: str) -> dict[str, Any]:
    """Load a JSON object from `path`, or raise a one-line QServeError."""
    if not path.is_file():
        raise QServeError(f"model folder {path.parent} has no {path.name}; expected a {what}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise QServeError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise QServeError(f"{path} holds a {type(data).__name__}; expected a JSON object")
    return data


def _architecture(raw: dict[str, Any], source: str) -> str:
    archs = raw.get("architectures") or []
    supported = ", ".join(ARCHITECTURES)
    for arch in archs:
        if arch in ARCHITECTURES:
            return arch
    name = archs[0] if archs else f"model_type={raw.get('model_type')!r}"
    raise QServeError(
        f"{source}: architecture {name} is not supported; expected one of: {supported}"
    )


def _int(raw: dict[str, Any], key: str, source: str) -> int:
    value = raw.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise QServeError(f"{source}: {key} is {value!r}; expected a positive integer")
    return value


def _activation(raw: dict[str, Any], spec: ArchitectureSpec, source: str) -> str:
    act = raw.get("hidden_activation") or raw.get("hidden_act") or spec.activation
    if act != spec.activation:
        raise QServeError(
            f"{source}: hidden_act {act!r} is not supported; expected {spec.activation!r}"
        )
    return act


def _rope(raw: dict[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    """RoPE settings from transformers 5 `rope_parameters` or 4.x `rope_theta`/`rope_scaling`."""
    params = global_rope_parameters(raw)
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        expected = ", ".join(SUPPORTED_ROPE_TYPES)
        raise QServeError(
            f"{source}: rope type {rope_type!r} is not supported; expected {expected}"
        )
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise QServeError(f"{source}: partial_rotary_factor is not supported; expected 1.0")
    if rope_type == "default":
        return theta, None
    if rope_type == "longrope":
        return theta, _longrope(raw, params, source)
    if rope_type == "linear":
        return theta, RopeScaling("linear", float(params["factor"]))
    try:
        return theta, RopeScaling(
            rope_type=rope_type,
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    except KeyError as exc:
        raise QServeError(f"{source}: llama3 rope scaling lacks {exc.args[0]!r}") from None


def _longrope(raw: dict[str, Any], params: dict[str, Any], source: str) -> RopeScaling:
    """Phi-3's LongRoPE, with transformers' defaults: factor = max / original positions and
    attention_factor = sqrt(1 + ln(factor) / ln(original)) when not given."""
    original = params.get("original_max_position_embeddings")
    original = int(original or raw.get("original_max_position_embeddings") or 0)
    head_dim = int(raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"])
    short, long = params.get("short_factor"), params.get("long_factor")
    for name, factors in (("short_factor", short), ("long_factor", long)):
        if not isinstance(factors, list) or len(factors) != head_dim // 2:
            raise QServeError(f"{source}: longrope {name} must list head_dim / 2 numbers")
    if original <= 0:
        raise QServeError(f"{source}: longrope needs original_max_position_embeddings")
    factor = float(params.get("factor") or raw["max_position_embeddings"] / original)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    return RopeScaling(
        "longrope",
        factor,
        original_max_position_embeddings=original,
        short_factor=tuple(float(f) for f in short),
        long_factor=tuple(float(f) for f in long),
        attention_factor=float(attention_factor),
    )


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _eos_token_ids(raw: dict[str, Any], generation: dict[str, Any]) -> list[int]:
    ids = _as_id_list(raw.get("eos_token_id")) + _as_id_list(generation.get("eos_token_id"))
    return list(dict.fromkeys(ids))  # dedupe, keep order


def _dtype(raw: dict[str, Any], source: str) -> torch.dtype:
    name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    if name not in _DTYPES:
        raise QServeError(
            f"{source}: dtype {name!r} is not supported; expected one of {list(_DTYPES)}"
        )
    return _DTYPES[name]


def _sliding_window(raw: dict[str, Any], max_pos: int) -> int | None:
    window = raw.get("sliding_window")
    if window is None or raw.get("use_sliding_window") is False or window >= max_pos:
        return None
    return int(window)
