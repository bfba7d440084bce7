"""The engine's greedy output on SmolLM2-135M (fp32) equals transformers `generate`, token for
token, for 8 prompts of mixed lengths (10-400 tokens): with a roomy cache, with a KV cache so small
that requests are preempted, and with a token budget that forces chunked prefill."""

from __future__ import annotations

import pytest
import torch

from tests.engine.greedy import engine_greedy, transformers_greedy
from tests.text import moby_dick

pytestmark = pytest.mark.slow

PROMPT_LENS = [10, 400, 37, 150, 64, 230, 95, 310]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def model_dir():
    from qserve.model.resolve import resolve_model

    return resolve_model("smollm2-135m")


@pytest.fixture(scope="module")
def prompts(model_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer.encode(moby_dick(1, 2))
    # Different stretches of the text, so prompts share no prefix by accident.
    return [ids[i * 97 : i * 97 + n] for i, n in enumerate(PROMPT_LENS)]


@pytest.fixture(scope="module")
def expected(model_dir, prompts) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return transformers_greedy(model, prompts, MAX_TOKENS)


def run(model_dir, prompts, **engine_args):
    return engine_greedy(model_dir, prompts, MAX_TOKENS, **engine_args)


def test_matches_transformers(model_dir, prompts, expected):
    _, got = run(model_dir, prompts, kv_cache_memory="256MiB")
    assert got == expected


def test_matches_transformers_with_preemption(model_dir, prompts, expected):
    # 40 blocks of 16 tokens: the longest request alone needs 27, all together ~100.
    bytes_per_block = 2 * 16 * 3 * 64 * 4 * 30
    llm, got = run(model_dir, prompts, kv_cache_memory=40 * bytes_per_block, max_model_len=640)
    assert llm.engine.scheduler.num_preemptions > 0
    assert got == expected
    pool = llm.engine.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks


def test_matches_transformers_with_chunked_prefill(model_dir, prompts, expected):
    _, got = run(model_dir, prompts, kv_cache_memory="256MiB", max_num_batched_tokens=48)
    assert got == expected
