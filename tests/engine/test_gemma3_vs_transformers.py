"""The engine's greedy output on the built-in Gemma 3 270M (fp32) equals transformers' `generate`
with Gemma3ForCausalLM, token for token, for 8 prompts of mixed lengths (10-1100 tokens; five are
longer than the 512-token sliding window, and one crosses it while decoding): with a roomy cache,
with a KV cache so small that requests are preempted, and with a token budget that forces chunked
prefill (chunks that straddle the window's edge)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.engine.greedy import engine_greedy, transformers_greedy
from tests.text import moby_dick

pytestmark = pytest.mark.slow

PROMPT_LENS = [10, 700, 37, 500, 150, 1100, 64, 530]
MAX_TOKENS = 24
SLIDING_WINDOW = 512


@pytest.fixture(scope="module")
def model_dir():
    from qserve.model.resolve import resolve_model

    return resolve_model("gemma3-270m")


@pytest.fixture(scope="module")
def prompts(model_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    config = json.loads((model_dir / "config.json").read_text())
    assert config["sliding_window"] == SLIDING_WINDOW
    assert sum(n > SLIDING_WINDOW for n in PROMPT_LENS) >= 3
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer.encode(moby_dick(1, 2), add_special_tokens=False)
    # Each prompt starts with <bos>, as Gemma expects, then a different stretch of the text, so
    # prompts share no prefix beyond <bos>.
    return [
        [tokenizer.bos_token_id] + ids[i * 97 : i * 97 + n - 1] for i, n in enumerate(PROMPT_LENS)
    ]


@pytest.fixture(scope="module")
def expected(model_dir, prompts) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert type(model).__name__ == "Gemma3ForCausalLM"
    return transformers_greedy(model, prompts, MAX_TOKENS)


def run(model_dir, prompts, **engine_args):
    return engine_greedy(model_dir, prompts, MAX_TOKENS, **engine_args)


def test_matches_transformers(model_dir, prompts, expected):
    _, got = run(model_dir, prompts, kv_cache_memory="256MiB", max_model_len=2048)
    assert got == expected


def test_matches_transformers_with_preemption(model_dir, prompts, expected):
    # 80 blocks of 16 tokens: the longest request alone needs 71, all together ~210.
    bytes_per_block = 2 * 16 * 1 * 256 * 4 * 18  # K and V, 1 KV head of 256, fp32, 18 layers
    llm, got = run(model_dir, prompts, kv_cache_memory=80 * bytes_per_block, max_model_len=1200)
    assert llm.engine.scheduler.num_preemptions > 0
    assert got == expected
    pool = llm.engine.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks


def test_matches_transformers_with_chunked_prefill(model_dir, prompts, expected):
    _, got = run(
        model_dir, prompts, kv_cache_memory="256MiB", max_model_len=2048, max_num_batched_tokens=48
    )
    assert got == expected
