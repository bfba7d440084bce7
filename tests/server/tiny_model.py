"""A tiny random Llama with SmolLM2's tokenizer (vocab 49152, chat template): fast to serve."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from qserve.model.resolve import resolve_model

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)
MAX_POSITION_EMBEDDINGS = 512


def save_tiny_smollm(folder: Path, seed: int = 0) -> Path:
    """Save a 2-layer random Llama (hidden 64) plus the built-in SmolLM2 tokenizer files."""
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).eval().save_pretrained(folder)
    builtin = resolve_model("smollm2-135m")
    for name in TOKENIZER_FILES:
        if (builtin / name).is_file():
            shutil.copy(builtin / name, folder / name)
    return folder
