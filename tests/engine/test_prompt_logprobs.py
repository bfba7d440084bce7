"""Prompt logprobs through the engine (SamplingParams.prompt_logprobs), against transformers'
log_softmax of the same tiny random Llama in fp32: roomy, under chunked prefill and preemption,
on a prefix-cache hit, with n > 1 and with DELTA outputs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from qserve.engine import prompt_logprobs as prompt_logprobs_module
from qserve.engine.llm import LLM
from qserve.engine.outputs import OutputAccumulator
from qserve.engine.sampling_params import RequestOutputKind, SamplingParams
from qserve.errors import QServeError
from tests.text import moby_dick
from tests.tiny import byte_bpe_tokenizer, save_tiny_llama

PROMPT_LENS = [2, 150, 17, 64, 300, 33]
TOP = 3
SCORE = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=TOP)
ATOL = 1e-4  # fp32 on both sides; different summation orders


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    ids = byte_bpe_tokenizer().encode(moby_dick(1, 3))
    return [ids[i * 97 : i * 97 + n] for i, n in enumerate(PROMPT_LENS)]


@pytest.fixture(scope="module")
def reference(model_dir, prompts) -> list[torch.Tensor]:
    """transformers' log_softmax over the vocabulary at every prompt position: [len - 1, vocab]
    (row i scores prompt token i + 1)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [torch.log_softmax(model(torch.tensor([p])).logits[0, :-1], -1) for p in prompts]


def make_llm(model_dir, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", "16MiB")
    return LLM(str(model_dir), dtype="float32", **kw)


def assert_matches(entries, prompt, want: torch.Tensor, top: int = TOP) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    for i, entry in enumerate(entries[1:]):
        row = want[i]
        assert entry.sampled_token_id == prompt[i + 1]
        assert entry.logprob == pytest.approx(float(row[prompt[i + 1]]), abs=ATOL)
        own = row[prompt[i + 1]]  # rank: tokens at least as likely, itself included
        assert int((row > own + ATOL).sum()) + 1 <= entry.rank <= int((row >= own - ATOL).sum())
        values, ids = row.topk(top)
        assert entry.top_logprobs == pytest.approx(values.tolist(), abs=ATOL)
        assert entry.top_token_ids == ids.tolist()


@pytest.mark.parametrize(
    "engine_args",
    [{}, {"max_num_batched_tokens": 32, "kv_cache_memory": 24 * 8192, "max_model_len": 384}],
    ids=["roomy", "chunked-preempted"],
)
def test_prompt_logprobs_match_transformers(model_dir, prompts, reference, engine_args):
    llm = make_llm(model_dir, **engine_args)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=20, prompt_logprobs=TOP,
                                                   temperature=0, ignore_eos=True))  # fmt: skip
    for output, prompt, want in zip(outputs, prompts, reference):
        assert_matches(output.prompt_logprobs, prompt, want)
    if engine_args:
        assert llm.engine.scheduler.num_preemptions > 0


def test_a_prefix_cache_hit_is_still_scored(model_dir, prompts, reference):
    """The second request's prompt is all in the prefix cache, but it asks for prompt logprobs:
    it skips the cache (as in vLLM) and every position is scored."""
    llm = make_llm(model_dir)
    llm.generate([prompts[4]], SamplingParams(max_tokens=1))
    stats = llm.engine.scheduler.kv_cache_manager.prefix_cache_stats
    hits = stats.hits
    [output] = llm.generate([prompts[4]], SCORE)
    assert stats.hits == hits
    assert_matches(output.prompt_logprobs, prompts[4], reference[4])


def test_n_samples_share_one_scoring(model_dir, prompts, reference):
    llm = make_llm(model_dir)
    params = SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=4, prompt_logprobs=0)
    [output] = llm.generate([prompts[1]], params)
    assert len(output.outputs) == 3
    assert_matches(output.prompt_logprobs, prompts[1], reference[1], top=0)


def test_delta_outputs_carry_them_once(model_dir, prompts, reference):
    llm = make_llm(model_dir)
    params = dataclasses.replace(SCORE, max_tokens=5, ignore_eos=True,
                                 output_kind=RequestOutputKind.DELTA)  # fmt: skip
    llm.engine.add_request("r", prompts[3], params)
    outputs, total = [], OutputAccumulator()
    while llm.engine.has_unfinished_requests():
        for output in llm.engine.step():
            outputs.append(output)
            total.add(output)
    assert [o.prompt_logprobs is not None for o in outputs] == [True] + [False] * 4
    assert_matches(total.result().prompt_logprobs, prompts[3], reference[3])


def test_logits_are_made_a_chunk_at_a_time(model_dir, prompts, monkeypatch):
    """Never a [prompt_len, vocab] block: rows go through compute_logits PROMPT_LOGITS_CHUNK at
    a time (here 16), whatever the step's token budget."""
    monkeypatch.setattr(prompt_logprobs_module, "PROMPT_LOGITS_CHUNK", 16)
    llm = make_llm(model_dir, max_num_batched_tokens=512)
    model = llm.engine.model_runner.model
    rows: list[int] = []
    real = model.compute_logits

    def counting(hidden):
        rows.append(hidden.shape[0])
        return real(hidden)

    monkeypatch.setattr(model, "compute_logits", counting)
    [output] = llm.generate([prompts[4]], SCORE)
    assert max(rows) == 16 and sum(rows) == len(prompts[4]) - 1 + 1  # + the sampled row
    assert len(output.prompt_logprobs) == len(prompts[4])


@pytest.mark.parametrize("value", [-1, 21, 1.5, True])
def test_out_of_range_prompt_logprobs_are_refused(value):
    with pytest.raises(QServeError, match="prompt_logprobs") as info:
        SamplingParams(prompt_logprobs=value)
    assert info.value.param == "prompt_logprobs"


def test_without_the_option_there_are_none(model_dir, prompts):
    llm = make_llm(model_dir)
    [output] = llm.generate([prompts[2]], SamplingParams(max_tokens=2))
    assert output.prompt_logprobs is None
