"""Per-layer attention kinds and what comes with them, read from a config.json.

A layer is "full_attention" (every earlier token) or "sliding_attention" (the last
`sliding_window` tokens, transformers' convention: key positions (p - W, p] for a query at p).

    Mistral                   every layer slides when `sliding_window` is set
    Qwen2 / Qwen3             `use_sliding_window`: layers from `max_window_layers` on slide
    Gemma 3                   `layer_types`, or every `sliding_window_pattern`-th layer full
                              (the others slide), local layers on their own RoPE base

transformers 5 writes `layer_types` into config.json for all of them; older configs are derived
as transformers derives them.
"""

from __future__ import annotations

from typing import Any

from qserve.errors import QServeError

FULL, SLIDING = "full_attention", "sliding_attention"
GEMMA3_SLIDING_PATTERN = 6  # transformers' default: five local layers, then a global one


def layer_types(
    raw: dict[str, Any], model_type: str, num_layers: int, window: int | None, source: str
) -> tuple[str, ...]:
    """The attention kind of each layer; () (all full) when there is no window."""
    if window is None:
        return ()
    given = raw.get("layer_types")
    if given is not None:
        return _checked(given, num_layers, source)
    if model_type == "gemma3":
        pattern = int(raw.get("sliding_window_pattern") or GEMMA3_SLIDING_PATTERN)
        return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(num_layers))
    if model_type in ("qwen2", "qwen3"):
        first = int(raw.get("max_window_layers", num_layers))
        return tuple(SLIDING if i >= first else FULL for i in range(num_layers))
    return (SLIDING,) * num_layers


def _checked(given: Any, num_layers: int, source: str) -> tuple[str, ...]:
    if not isinstance(given, list) or len(given) != num_layers:
        raise QServeError(f"{source}: layer_types must list one kind per layer ({num_layers})")
    unknown = sorted({t for t in given if t not in (FULL, SLIDING)})
    if unknown:
        raise QServeError(f"{source}: layer type {unknown[0]!r} is not supported")
    return tuple(given)


def global_rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    """The RoPE parameters of the full-attention layers (Gemma 3 nests them per layer kind)."""
    params = dict(raw.get("rope_scaling") or {})
    nested = raw.get("rope_parameters") or {}
    params.update(nested[FULL] if isinstance(nested.get(FULL), dict) else nested)
    return params


def gemma3_fields(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """ModelConfig fields of Gemma 3 (text): the local RoPE base, the attention scale from
    query_pre_attn_scalar, the final logit soft-cap; what we do not run is refused."""
    if raw.get("attn_logit_softcapping") is not None:
        raise QServeError(f"{source}: attn_logit_softcapping is not supported")
    if raw.get("use_bidirectional_attention"):
        raise QServeError(f"{source}: use_bidirectional_attention is not supported")
    nested = raw.get("rope_parameters") or {}
    local = nested.get(SLIDING) if isinstance(nested.get(SLIDING), dict) else {}
    if local.get("rope_type", "default") != "default":
        raise QServeError(f"{source}: local layers' rope type {local['rope_type']!r}")
    local_theta = local.get("rope_theta", raw.get("rope_local_base_freq", 10000.0))
    softcap = raw.get("final_logit_softcapping")
    return {
        "local_rope_theta": float(local_theta),
        "attention_scale": float(raw.get("query_pre_attn_scalar", 256)) ** -0.5,
        "final_logit_softcapping": None if softcap is None else float(softcap),
        "embed_scale": float(raw["hidden_size"]) ** 0.5,
    }
