"""Tiny random Hugging Face models of every architecture qserve runs (no download), with
norms and biases randomized so they matter."""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

_COMMON = dict(
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
)

# name -> (HF model class, config). Llama: tied embeddings and llama3 RoPE scaling (with a short
# original context, so that the scaling changes frequencies); Qwen2: q/k/v bias, untied;
# Mistral: explicit head_dim unlike hidden/heads, no sliding window; Qwen3: q/k norms per head,
# head_dim 32 (not hidden / heads), attention bias on q/k/v/o.
TINY_MODELS = {
    "llama": (
        LlamaForCausalLM,
        LlamaConfig(
            vocab_size=300,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            **_COMMON,
        ),
    ),
    "qwen2": (
        Qwen2ForCausalLM,
        Qwen2Config(vocab_size=512, tie_word_embeddings=False, rope_theta=1e6, **_COMMON),
    ),
    "mistral": (
        MistralForCausalLM,
        MistralConfig(vocab_size=1000, head_dim=32, sliding_window=None, **_COMMON),
    ),
    "mistral-window": (  # every layer slides over the last 8 tokens
        MistralForCausalLM,
        MistralConfig(vocab_size=1000, head_dim=32, sliding_window=8, **_COMMON),
    ),
    "gemma3": (  # local and global layers (window 8, own RoPE bases; linear scaling on global)
        Gemma3ForCausalLM,
        Gemma3TextConfig(
            vocab_size=300,
            head_dim=32,
            query_pre_attn_scalar=24,
            sliding_window=8,
            final_logit_softcapping=30.0,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
            },
            **_COMMON,
        ),
    ),
    "phi3": (  # fused qkv_proj / gate_up_proj; its pad id must lie inside the tiny vocab
        Phi3ForCausalLM,
        Phi3Config(vocab_size=350, pad_token_id=0, bos_token_id=1, eos_token_id=2, **_COMMON),
    ),
    "phi3-longrope": (  # LongRoPE over an original context of 32: prompts and outputs cross it
        Phi3ForCausalLM,
        Phi3Config(
            vocab_size=350,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            original_max_position_embeddings=32,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0 + 0.1 * i for i in range(8)],  # head_dim 16: 8 frequencies
                "long_factor": [2.0 + 0.5 * i for i in range(8)],
                "original_max_position_embeddings": 32,
            },
            **_COMMON,
        ),
    ),
    "qwen3": (
        Qwen3ForCausalLM,
        Qwen3Config(
            vocab_size=400, head_dim=32, attention_bias=True, tie_word_embeddings=True, **_COMMON
        ),
    ),
    # Mixture of experts: 4 experts, top-2. Mixtral: every layer sparse, always renormalized;
    # Qwen3-MoE: layer 1 a dense MLP (mlp_only_layers), experts of moe_intermediate_size, no
    # renormalization, q/k norms per head.
    "mixtral": (
        MixtralForCausalLM,
        MixtralConfig(vocab_size=450, num_local_experts=4, num_experts_per_tok=2, **_COMMON),
    ),
    "qwen3-moe": (
        Qwen3MoeForCausalLM,
        Qwen3MoeConfig(
            vocab_size=500,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=96,
            mlp_only_layers=[1],
            norm_topk_prob=False,
            **_COMMON,
        ),
    ),
}
# The mixture-of-experts models (their quantized checkpoints are checked per expert).
MOE_MODELS = {"mixtral", "qwen3-moe"}


def build_tiny_model(name: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """The tiny `name` model; `overrides` change its config (e.g. vocab_size)."""
    cls, config = TINY_MODELS[name]
    if overrides:
        config = copy.deepcopy(config)
        for key, value in overrides.items():
            setattr(config, key, value)
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():  # HF inits norms to 1 and biases to 0: randomize them so they matter
        for pname, param in model.named_parameters():
            if "norm" in pname or pname.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.1)
    return model
