"""Every architecture's tiny random model: the engine's fp32 greedy output equals transformers
`generate`, token for token, for a batch of prompts of mixed lengths: with a roomy KV cache, with
one so small that requests are preempted, and with a token budget that forces chunked prefill."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from qserve.engine.llm import LLM
from tests.engine.greedy import engine_greedy, transformers_greedy
from tests.tiny import byte_bpe_tokenizer
from tests.tiny_models import TINY_MODELS, build_tiny_model

PROMPT_LENS = [5, 40, 25, 70, 1, 33]  # 25 + 12 output tokens crosses 32 (LongRoPE)
MAX_TOKENS = 12
BLOCK_SIZE = 16


@functools.cache
def saved_model(name: str, root: Path) -> Path:
    folder = root / name
    build_tiny_model(name).save_pretrained(folder)
    byte_bpe_tokenizer().save_pretrained(folder)  # 1000 tokens: covers every tiny vocab
    return folder


@pytest.fixture(scope="module", params=sorted(TINY_MODELS))
def case(request, tmp_path_factory) -> tuple[Path, list[list[int]], list[list[int]]]:
    """(model folder, prompts, transformers' greedy continuations)."""
    folder = saved_model(request.param, tmp_path_factory.getbasetemp())
    vocab = TINY_MODELS[request.param][1].vocab_size
    gen = torch.Generator().manual_seed(len(request.param))
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    return folder, prompts, transformers_reference(folder, prompts)


def transformers_reference(folder: Path, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return transformers_greedy(model, prompts, MAX_TOKENS)


def generate(folder: Path, prompts: list[list[int]], **engine_args) -> tuple[LLM, list]:
    engine_args = {"block_size": BLOCK_SIZE, "num_threads": 1} | engine_args
    return engine_greedy(folder, prompts, MAX_TOKENS, **engine_args)


def block_bytes(folder: Path) -> int:
    """Bytes of one KV block in fp32 over all layers."""
    config = TINY_MODELS[folder.name][1]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_layer = 2 * BLOCK_SIZE * config.num_key_value_heads * head_dim * 4
    return per_layer * config.num_hidden_layers


def test_matches_transformers(case):
    folder, prompts, expected = case
    _, got = generate(folder, prompts, kv_cache_memory="16MiB")
    assert got == expected


def test_matches_transformers_with_preemption(case):
    folder, prompts, expected = case
    # 6 blocks of 16 tokens: the longest request alone needs all 6, all of them together 18.
    llm, got = generate(folder, prompts, kv_cache_memory=6 * block_bytes(folder), max_model_len=96)
    assert llm.engine.scheduler.num_preemptions > 0
    assert got == expected


def test_matches_transformers_with_chunked_prefill(case):
    folder, prompts, expected = case
    _, got = generate(folder, prompts, kv_cache_memory="16MiB", max_num_batched_tokens=24)
    assert got == expected
