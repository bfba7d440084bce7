"""`LLM.beam_search` on SmolLM2-135M (fp32) equals transformers `generate(num_beams=k,
num_return_sequences=k, do_sample=False, length_penalty=..., early_stopping=...)` in sequences
and scores, for k = 2, 4 and 8 on 8 prompts of mixed lengths (two of them chat turns, so some
beams end with EOS), all prompts in one batch of the engine; and under a KV budget small enough
to preempt beams, the output is the same as unpressured.

qserve matches transformers' three early-stopping semantics (False: the heuristic at the current
length, True: stop once k hypotheses exist, "never": the heuristic at max length for a positive
length penalty); `tests/engine/test_beam_search.py` checks each exactly on a tiny model, here
each k runs one of them."""

from __future__ import annotations

import pytest
import torch

from qserve.engine.beam_search import BeamSearchParams
from tests.engine.beams import transformers_beams
from tests.text import moby_dick

pytestmark = pytest.mark.slow

PROMPT_LENS = [10, 120, 37, 64, 25, 90]
CHATS = ["What is the capital of France?", "Say hi."]
MAX_TOKENS = 10
EOS = 2
CASES = {2: (1.0, False), 4: (0.5, True), 8: (1.0, "never")}  # k -> length_penalty, early_stopping


@pytest.fixture(scope="module")
def model_dir():
    from qserve.model.resolve import resolve_model

    return resolve_model("smollm2-135m")


@pytest.fixture(scope="module")
def prompts(model_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer.encode(moby_dick(1, 2))
    text = [ids[i * 97 : i * 97 + n] for i, n in enumerate(PROMPT_LENS)]
    chats = [
        tokenizer.encode(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n") for q in CHATS
    ]
    return text + chats


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def params_for(k: int) -> BeamSearchParams:
    length_penalty, early_stopping = CASES[k]
    return BeamSearchParams(
        k, MAX_TOKENS, length_penalty=length_penalty, early_stopping=early_stopping
    )


@pytest.fixture(scope="module")
def llm(model_dir):
    from qserve.engine.llm import LLM

    return LLM(str(model_dir), dtype="float32", kv_cache_memory="256MiB")


def scores(result, params: BeamSearchParams) -> list[float]:
    return [s.cum_logprob / (len(s.logprobs) ** params.length_penalty) for s in result.sequences]


def generated(result, prompt) -> list[list[int]]:
    return [s.tokens[len(prompt) :] for s in result.sequences]


@pytest.mark.parametrize("k", [2, 4, 8])
def test_matches_transformers(llm, hf_model, prompts, k):
    params = params_for(k)
    results = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    num_eos = 0
    for prompt, result in zip(prompts, results):
        want_seqs, want_scores = transformers_beams(hf_model, prompt, params, EOS, EOS)
        assert generated(result, prompt) == want_seqs
        assert scores(result, params) == pytest.approx(want_scores, abs=2e-4)
        num_eos += sum(s.finish_reason == "stop" for s in result.sequences)
    assert num_eos > 0  # some beams ended with EOS
    pool = llm.engine.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks


def test_preempted_beams_give_the_same_output(model_dir, llm, prompts):
    from qserve.engine.llm import LLM

    params = params_for(4)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    want = llm.beam_search(inputs, params)
    # 24 blocks of 16 tokens: one search's beams fit, all eight searches' do not
    bytes_per_block = 2 * 16 * 3 * 64 * 4 * 30
    small = LLM(str(model_dir), dtype="float32", kv_cache_memory=24 * bytes_per_block)
    got = small.beam_search(inputs, params)
    assert small.engine.scheduler.num_preemptions > 0
    for a, b in zip(got, want):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        assert [s.cum_logprob for s in a.sequences] == pytest.approx(
            [s.cum_logprob for s in b.sequences], abs=1e-4
        )
        assert [s.text for s in a.sequences] == [s.text for s in b.sequences]
    pool = small.engine.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks
