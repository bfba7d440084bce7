"""The whole engine on a tiny random Llama (offline, fast): equality with transformers, sampling
options end to end, prefix sharing, aborts."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from qserve.engine.llm import LLM
from qserve.engine.sampling_params import SamplingParams
from qserve.errors import ContextLengthError, QServeError
from tests.text import moby_dick
from tests.tiny import byte_bpe_tokenizer, save_tiny_llama

PROMPT_LENS = [5, 120, 17, 64, 33, 90, 48, 200]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    ids = byte_bpe_tokenizer().encode(moby_dick(1, 2))
    return [ids[i * 211 : i * 211 + n] for i, n in enumerate(PROMPT_LENS)]


@pytest.fixture(scope="module")
def expected(model_dir, prompts) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [
            model.generate(
                torch.tensor([p]),
                max_new_tokens=20,
                min_new_tokens=20,
                do_sample=False,
                pad_token_id=0,
            )[0, len(p) :].tolist()
            for p in prompts
        ]


def make_llm(model_dir, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", "16MiB")
    return LLM(str(model_dir), dtype="float32", **kw)


GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def token_ids(llm, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def assert_all_blocks_free(llm):
    pool = llm.engine.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks


def test_greedy_matches_transformers(model_dir, prompts, expected):
    llm = make_llm(model_dir)
    assert token_ids(llm, prompts) == expected
    assert_all_blocks_free(llm)


def test_greedy_matches_with_preemption_and_chunked_prefill(model_dir, prompts, expected):
    # 2 layers x 2 KV heads x 16 dims x 4 bytes x 2 (K, V) x 16 tokens = 8 KiB a block: 24 blocks
    # hold 384 tokens, far fewer than the ~800 the batch needs at once.
    llm = make_llm(
        model_dir, kv_cache_memory=24 * 8192, max_num_batched_tokens=32, max_model_len=384
    )
    assert token_ids(llm, prompts) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert_all_blocks_free(llm)


def test_same_output_without_prefix_caching(model_dir, prompts, expected):
    llm = make_llm(model_dir, enable_prefix_caching=False, max_num_seqs=3)
    assert token_ids(llm, prompts) == expected


def test_second_request_reuses_the_prompt_prefix(model_dir, prompts, expected):
    llm = make_llm(model_dir)
    assert token_ids(llm, [prompts[7]]) == [expected[7]]
    stats = llm.engine.scheduler.kv_cache_manager.prefix_cache_stats
    hits_before = stats.hits
    assert token_ids(llm, [prompts[7]]) == [expected[7]]
    assert stats.hits - hits_before == (200 // 16) * 16


def test_cache_salt_shares_blocks_only_within_a_salt(model_dir, prompts, expected):
    llm = make_llm(model_dir)
    stats = llm.engine.scheduler.kv_cache_manager.prefix_cache_stats
    salted = {"prompt_token_ids": prompts[7], "cache_salt": "tenant-a"}
    assert token_ids(llm, [salted]) == [expected[7]]
    for prompt, hits in ((prompts[7], 0), ({**salted, "cache_salt": "b"}, 0), (salted, 192)):
        hits_before = stats.hits
        assert token_ids(llm, [prompt]) == [expected[7]]
        assert stats.hits - hits_before == hits
    with pytest.raises(QServeError, match="one of 'prompt' or 'prompt_token_ids'"):
        llm.generate({"prompt_ids": prompts[0]})


def test_n_samples_share_the_prompt_blocks(model_dir, prompts):
    llm = make_llm(model_dir)
    engine = llm.engine
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8)
    engine.add_request("r", prompts[1], params)
    engine.step()  # sample 0 computes 119 of the 120 prompt tokens; the others wait for it
    manager = engine.scheduler.kv_cache_manager
    assert manager.get_block_ids("1_r") == manager.get_block_ids("2_r") == []
    engine.step()  # they fork and each computes the last prompt token into a copy of block 7
    blocks = [manager.get_block_ids(f"{i}_r") for i in range(3)]
    full = 120 // 16
    assert blocks[0][:full] == blocks[1][:full] == blocks[2][:full]
    assert len({b[full] for b in blocks}) == 3  # each sample writes its own last block
    assert sorted(dst for _, dst in engine.scheduler.kv_cache_manager.blocks_to_copy) == sorted(
        b[full] for b in blocks[:2]
    )
    while engine.has_unfinished_requests():
        outs = engine.step()
    texts = [o.token_ids for o in outs[0].outputs]
    assert len({tuple(t) for t in texts}) > 1  # seeds seed+0, +1, +2 differ
    assert_all_blocks_free(llm)


def test_seed_is_reproducible_whatever_the_batch(model_dir, prompts):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12)
    llm = make_llm(model_dir)
    alone = token_ids(llm, [prompts[2]], params)[0]
    others = SamplingParams(temperature=0.8, max_tokens=12)
    batch = token_ids(llm, [prompts[0], prompts[2], prompts[3]], [others, params, others])
    assert batch[1] == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=12)
    assert token_ids(llm, [prompts[2]], other_seed)[0] != alone


def test_stop_string_truncates_and_stops(model_dir, prompts):
    llm = make_llm(model_dir)
    full = llm.generate([prompts[3]], GREEDY)[0].outputs[0]
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    out = llm.generate(
        [prompts[3]], SamplingParams(temperature=0, max_tokens=20, stop=[stop], ignore_eos=True)
    )[0].outputs[0]
    assert out.text == full.text[: full.text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert_all_blocks_free(llm)


def test_stop_token_id_and_max_tokens(model_dir, prompts, expected):
    llm = make_llm(model_dir)
    stop_id = expected[4][5]
    first = expected[4].index(stop_id)
    params = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_id], ignore_eos=True)
    out = llm.generate([prompts[4]], params)[0].outputs[0]
    assert out.token_ids == expected[4][: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    out = llm.generate([prompts[4]], SamplingParams(temperature=0, max_tokens=7))[0].outputs[0]
    assert len(out.token_ids) <= 7
    if len(out.token_ids) == 7:
        assert out.finish_reason == "length"


def test_logprobs_of_greedy_tokens(model_dir, prompts):
    llm = make_llm(model_dir)
    out = llm.generate([prompts[1]], SamplingParams(temperature=0, max_tokens=5, logprobs=3))
    completion = out[0].outputs[0]
    assert len(completion.logprobs) == len(completion.token_ids)
    for token, lp in zip(completion.token_ids, completion.logprobs):
        assert lp.sampled_token_id == token and lp.rank == 1
        assert len(lp.top_token_ids) == 3 and lp.top_token_ids[0] == token
        assert lp.logprob == pytest.approx(lp.top_logprobs[0])
        assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)


def test_streamed_deltas_add_up_to_the_text(model_dir, prompts):
    llm = make_llm(model_dir)
    engine = llm.engine
    engine.add_request("s", prompts[2], SamplingParams(temperature=0, max_tokens=16))
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.outputs[0].delta_text)
            final = out
    assert "".join(deltas) == final.outputs[0].text
    assert final.outputs[0].text == byte_bpe_tokenizer().decode(
        final.outputs[0].token_ids, skip_special_tokens=True
    )


def test_abort_frees_every_block(model_dir, prompts):
    llm = make_llm(model_dir)
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=50))
    engine.step()
    engine.step()
    engine.abort_request([str(i) for i in range(len(prompts))])
    assert not engine.has_unfinished_requests()
    assert_all_blocks_free(llm)


def test_bad_prompts_are_rejected(model_dir):
    llm = make_llm(model_dir, max_model_len=64)
    with pytest.raises(QServeError, match="empty"):
        llm.engine.add_request("a", [], GREEDY)
    with pytest.raises(ContextLengthError, match="context length is 64 tokens; the prompt has 64"):
        llm.engine.add_request("b", list(range(64)), GREEDY)
    with pytest.raises(QServeError, match="token ids"):
        llm.engine.add_request("c", [10**6], GREEDY)
    # min_tokens that cannot fit is refused; max_tokens beyond the context just stops there
    with pytest.raises(ContextLengthError, match="min_tokens=60 does not fit"):
        llm.engine.add_request("d", list(range(10)), SamplingParams(max_tokens=80, min_tokens=60))
    llm.engine.add_request("e", list(range(10)), SamplingParams(max_tokens=80))


def test_output_stops_at_max_model_len(model_dir, prompts):
    llm = make_llm(model_dir, max_model_len=40)
    out = llm.generate(
        [prompts[0]], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    )[0]
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 40
    assert out.outputs[0].finish_reason == "length"


def test_a_failed_step_leaves_no_unwritten_block_in_the_prefix_cache(model_dir, prompts, expected):
    """Blocks are cached when scheduled, before the model writes them: a step that raises must
    take them out again, or the next identical prompt reuses pages never written (filled with
    noise here)."""
    llm = make_llm(model_dir)
    engine = llm.engine
    for kv_cache in engine.model_runner.kv_caches:
        kv_cache.normal_()
    real = engine.model_runner.execute_model

    def broken(out):
        raise RuntimeError("injected fault")

    engine.model_runner.execute_model = broken
    engine.add_request("doomed", prompts[7], GREEDY)
    with pytest.raises(RuntimeError, match="injected fault"):
        engine.step()
    engine.abort_request("doomed")
    engine.model_runner.execute_model = real
    assert_all_blocks_free(llm)
    assert token_ids(llm, [prompts[7]]) == [expected[7]]


def _outputs(llm, prompt, params) -> list:
    engine = llm.engine
    engine.add_request("r", prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


@pytest.mark.parametrize("stop", [None, ["the"]])
def test_delta_and_final_only_outputs_add_up_to_the_cumulative_one(model_dir, prompts, stop):
    from qserve.engine.outputs import OutputAccumulator
    from qserve.engine.sampling_params import RequestOutputKind

    llm = make_llm(model_dir)
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=30, logprobs=2, stop=stop)
    cumulative = _outputs(llm, prompts[3], params)
    deltas = _outputs(
        llm, prompts[3], dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
    )
    final_only = _outputs(
        llm, prompts[3], dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
    )
    assert len(final_only) == 1 and len(deltas) == len(cumulative) > 1
    total = OutputAccumulator()
    for output in deltas:
        assert output.delta and all(len(c.token_ids) <= 1 for c in output.outputs)  # per step
        total.add(output)
    for got in (total.result(), final_only[0]):
        for c, want in zip(got.outputs, cumulative[-1].outputs):
            assert (c.text, c.token_ids, c.logprobs, c.finish_reason) == (
                want.text, want.token_ids, want.logprobs, want.finish_reason)  # fmt: skip
