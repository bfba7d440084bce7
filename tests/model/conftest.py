"""Tiny random Hugging Face checkpoints (no download), saved once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
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
# Mistral: explicit head_dim unlike hidden/heads, no sliding window.
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
}


def build_tiny_model(name: str, seed: int = 0) -> torch.nn.Module:
    cls, config = TINY_MODELS[name]
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():  # HF inits norms to 1 and biases to 0: randomize them so they matter
        for pname, param in model.named_parameters():
            if "norm" in pname or pname.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.1)
    return model


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """name -> folder of a saved random model (fp32 safetensors)."""
    folders = {}
    for name in TINY_MODELS:
        folder = tmp_path_factory.mktemp(f"tiny-{name}")
        build_tiny_model(name).save_pretrained(folder)
        folders[name] = folder
    return folders
