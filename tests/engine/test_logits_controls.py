"""logit_bias, allowed_token_ids and bad_words: vLLM's semantics and order, in the sampler and end
to end on the tiny random Llama (byte-level BPE, vocab 1000)."""

from __future__ import annotations

import pytest
import torch

from qserve.engine.llm import LLM
from qserve.engine.logits_processors import (
    TokenControls,
    banned_bad_word_tokens,
    tokenize_bad_words,
)
from qserve.engine.sampler import Sampler, SamplingMetadata, make_generator
from qserve.engine.sampling_params import MAX_BAD_WORDS, SamplingParams
from qserve.errors import QServeError
from tests.tiny import save_tiny_llama

VOCAB = 32
EOS = 31
INF = float("inf")


# -- the sampler on made-up logits ----------------------------------------------------------------


def run_sampler(logits, params, outputs=None, prompts=None, bad_words=None, generators=None):
    rows = len(params)
    bad_words = bad_words or [None] * rows
    controls = [TokenControls.build(p, b) for p, b in zip(params, bad_words, strict=True)]
    metadata = SamplingMetadata.from_requests(
        params,
        prompt_token_ids=prompts if prompts is not None else [[1, 2]] * rows,
        output_token_ids=outputs if outputs is not None else [[]] * rows,
        generators=generators or {},
        eos_token_ids=[EOS],
        vocab_size=logits.shape[1],
        token_controls=controls,
    )
    return Sampler()(logits, metadata)


def random_logits(rows, vocab=VOCAB, seed=0):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))


def test_logit_bias_forces_and_bans_greedy_tokens():
    logits = random_logits(3)
    top = logits.argmax(dim=-1).tolist()
    params = [
        SamplingParams(temperature=0, logit_bias={7: 100}),
        SamplingParams(temperature=0, logit_bias={top[1]: -100}),
        SamplingParams(temperature=0),
    ]
    sampled = run_sampler(logits, params).sampled_token_ids
    assert sampled[0] == 7
    assert sampled[1] != top[1] and sampled[1] == logits[1].topk(2).indices[1].item()
    assert sampled[2] == top[2]


def test_logit_bias_is_added_to_the_logit():
    logits = torch.zeros(1, VOCAB)
    logits[0, 3] = 1.0
    # +0.5 on token 4 is not enough to beat token 3's 1.0; +1.5 is
    assert run_sampler(logits, [SamplingParams(temperature=0, logit_bias={4: 0.5})]) \
        .sampled_token_ids == [3]  # fmt: skip
    assert run_sampler(logits, [SamplingParams(temperature=0, logit_bias={4: 1.5})]) \
        .sampled_token_ids == [4]  # fmt: skip


def test_allowed_token_ids_restrict_random_sampling():
    allowed = [3, 9, 20]
    params = SamplingParams(temperature=1.0, allowed_token_ids=allowed)
    seen = set()
    for seed in range(50):
        logits = random_logits(4, seed=seed)
        seen.update(run_sampler(logits, [params] * 4).sampled_token_ids)
    assert seen == set(allowed)  # only these, and each of them at some point


def test_bad_words_rule_is_vllms():
    # one token: banned at every step; longer: the last token once the output ends with the rest
    words = [[5], [6, 7], [8, 9, 10]]
    assert banned_bad_word_tokens(words, []) == [5]
    assert banned_bad_word_tokens(words, [1, 6]) == [5, 7]
    assert banned_bad_word_tokens(words, [6, 1]) == [5]
    assert banned_bad_word_tokens(words, [8, 9]) == [5, 10]
    assert banned_bad_word_tokens(words, [9]) == [5]  # [8, 9] must both be there
    # the prompt does not count (vLLM looks at the output only)
    logits = torch.zeros(1, VOCAB)
    logits[0, 7] = 5.0
    params = [SamplingParams(temperature=0, bad_words=["x"])]
    out = run_sampler(logits, params, prompts=[[6]], outputs=[[]], bad_words=[[[6, 7]]])
    assert out.sampled_token_ids == [7]
    out = run_sampler(logits, params, prompts=[[6]], outputs=[[6]], bad_words=[[[6, 7]]])
    assert out.sampled_token_ids != [7]


class FakeTokenizer:
    def __init__(self, table):
        self.table = table

    def encode(self, text, add_special_tokens=True):
        assert add_special_tokens is False
        return self.table[text]


def test_bad_words_tokenized_as_vllm_does():
    tokenizer = FakeTokenizer({
        "whale": [1, 2], " whale": [3, 2],  # a new first token, same length: both
        "sea": [4], " sea": [5],
        "ship": [6, 7], " ship": [8],  # another length: the plain form only (vLLM's rule)
        "ice": [9], " ice": [9],  # the same first token: once
    })  # fmt: skip
    words = ["  whale", "sea", "ship", "ice"]  # leading whitespace is dropped first
    assert tokenize_bad_words(tokenizer, VOCAB, words) == ((1, 2), (3, 2), (4,), (5,), (6, 7), (9,))
    with pytest.raises(QServeError) as bad:
        tokenize_bad_words(FakeTokenizer({"x": [], " x": [1]}), VOCAB, ["x"])
    assert bad.value.param == "bad_words"
    with pytest.raises(QServeError) as bad:
        tokenize_bad_words(FakeTokenizer({"x": [VOCAB], " x": [1]}), VOCAB, ["x"])
    assert bad.value.param == "bad_words"


def test_vllm_order_allowed_then_bad_words_then_min_tokens_then_bias_then_penalties():
    logits = torch.zeros(1, VOCAB)
    logits[0, 2] = 2.0
    logits[0, 4] = 1.0
    # logit_bias cannot bring back what allowed_token_ids, bad words or min_tokens masked
    params = SamplingParams(
        temperature=0, allowed_token_ids=[2, 4, 6, EOS], logit_bias={5: 100, 6: 100, EOS: 100},
        bad_words=["six"], min_tokens=2,
    )  # fmt: skip
    out = run_sampler(logits, [params], outputs=[[]], bad_words=[[[6]]])
    assert out.sampled_token_ids == [2]
    # the bias comes before the repetition penalty: token 2 (in the prompt) gets (1 + 3) / 2 = 2
    # and loses to token 4's 2.1; the penalty first would give it 1 / 2 + 3 = 3.5
    logits = torch.zeros(1, VOCAB)
    logits[0, 2] = 1.0
    logits[0, 4] = 2.1
    params = SamplingParams(temperature=0, logit_bias={2: 3.0}, repetition_penalty=2.0)
    assert run_sampler(logits, [params], prompts=[[2]]).sampled_token_ids == [4]


def test_logprobs_come_from_the_raw_logits():
    logits = random_logits(2, seed=3)
    raw = torch.log_softmax(logits, dim=-1)
    params = [
        SamplingParams(temperature=0, logprobs=3, logit_bias={11: 100}),
        SamplingParams(temperature=0, logprobs=3, allowed_token_ids=[12], bad_words=["x"]),
    ]
    out = run_sampler(logits, params, bad_words=[None, [[13]]])
    assert out.sampled_token_ids == [11, 12]
    for row, lp in enumerate(out.logprobs):
        token = out.sampled_token_ids[row]
        assert lp.logprob == pytest.approx(raw[row, token].item())
        assert lp.top_token_ids == raw[row].topk(3).indices.tolist()
        assert lp.rank == int((raw[row] >= raw[row, token]).sum())


def test_mixed_rows_each_get_what_they_get_alone():
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, seed=1, allowed_token_ids=[1, 5, 9, 17]),
        SamplingParams(temperature=0, logit_bias={3: 2.5, 8: -1.0}),
        SamplingParams(temperature=0.7, seed=2, top_k=5, bad_words=["x"]),
        SamplingParams(temperature=1.0, seed=3, presence_penalty=1.0, logit_bias={4: 1.0}),
    ]
    bad_words = [None, None, None, [[int(random_logits(1, seed=9).argmax())]], None]
    outputs = [[1, 2], [3], [], [4, 4], [4]]
    for step in range(5):
        logits = random_logits(len(params), seed=100 + step)
        generators = {i: make_generator(p) for i, p in enumerate(params) if p.seed is not None}
        together = run_sampler(logits, params, outputs, bad_words=bad_words, generators=generators)
        for i, p in enumerate(params):
            gen = {0: make_generator(p)} if p.seed is not None else None
            alone = run_sampler(logits[i : i + 1], [p], [outputs[i]], bad_words=[bad_words[i]],
                                generators=gen)  # fmt: skip
            assert alone.sampled_token_ids[0] == together.sampled_token_ids[i], (step, i)


def test_metadata_has_no_control_tensors_when_unused():
    meta = SamplingMetadata.from_requests(
        [SamplingParams(temperature=0)] * 2, [[1]] * 2, [[]] * 2, {}, [EOS], VOCAB
    )
    assert meta.allowed_token_ids_mask is None
    assert meta.bad_words_banned is None and meta.logit_bias is None


def test_params_are_checked():
    for kw, param in [
        (dict(logit_bias={1: 100.5}), "logit_bias"),
        (dict(logit_bias={1: -101}), "logit_bias"),
        (dict(logit_bias={-1: 1}), "logit_bias"),
        (dict(logit_bias={"1": 1}), "logit_bias"),
        (dict(logit_bias={1: float("nan")}), "logit_bias"),
        (dict(allowed_token_ids=[]), "allowed_token_ids"),
        (dict(allowed_token_ids=[1, -2]), "allowed_token_ids"),
        (dict(allowed_token_ids=[1.5]), "allowed_token_ids"),
        (dict(bad_words=[""]), "bad_words"),
        (dict(bad_words=["  "]), "bad_words"),
        (dict(bad_words="whale"), "bad_words"),
        (dict(bad_words=[3]), "bad_words"),
        (dict(bad_words=[f"w{i}" for i in range(MAX_BAD_WORDS + 1)]), "bad_words"),
    ]:
        with pytest.raises(QServeError) as bad:
            SamplingParams(**kw)
        assert bad.value.param == param, kw
    p = SamplingParams(logit_bias={5: 100}, allowed_token_ids=(2, 2, 3), bad_words=["a", "a"])
    assert p.logit_bias == {5: 100.0} and p.allowed_token_ids == [2, 2, 3]
    assert p.bad_words == ["a"]  # repeats dropped, as vLLM does
    assert SamplingParams().bad_words == [] and SamplingParams().logit_bias is None


# -- end to end on the tiny Llama -----------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    model_dir = save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    return LLM(str(model_dir), dtype="float32", kv_cache_memory="16MiB")


PROMPT = "The whale"
GREEDY = dict(temperature=0, max_tokens=16, ignore_eos=True)
RANDOM = dict(temperature=1.0, max_tokens=16, ignore_eos=True)


def generate(llm, params, prompt=PROMPT):
    return llm.generate([prompt], params)[0].outputs[0].token_ids


def contains(tokens, sequence):
    n = len(sequence)
    return any(list(tokens[i : i + n]) == list(sequence) for i in range(len(tokens) - n + 1))


def test_greedy_with_logit_bias(llm):
    assert generate(llm, SamplingParams(**GREEDY, logit_bias={500: 100})) == [500] * 16
    plain = generate(llm, SamplingParams(**GREEDY))
    banned = generate(llm, SamplingParams(**GREEDY, logit_bias={plain[0]: -100}))
    assert banned[0] != plain[0]
    assert plain[0] not in banned


def test_allowed_token_ids_end_to_end(llm):
    allowed = [7, 42, 300, 619, 950]
    seen = set()
    for seed in range(5):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=12, ignore_eos=True,
                                allowed_token_ids=allowed)  # fmt: skip
        tokens = generate(llm, params)
        assert set(tokens) <= set(allowed), tokens
        seen.update(tokens)
    assert len(seen) > 1


def test_single_token_bad_word(llm):
    tokenizer = llm.get_tokenizer()
    vocab = llm.engine.model_config.vocab_size
    plain = generate(llm, SamplingParams(**GREEDY))
    sequences = tokenize_bad_words(tokenizer, vocab, ["ice"])
    assert sequences == ((638,), (950,))  # "ice" and " ice": one token each
    assert 950 in plain  # greedy says " ice"
    banned = generate(llm, SamplingParams(**GREEDY, bad_words=["ice"]))
    assert 950 not in banned and 638 not in banned
    assert banned != plain


def test_multi_token_bad_word_never_completes(llm):
    tokenizer = llm.get_tokenizer()
    vocab = llm.engine.model_config.vocab_size
    plain = generate(llm, SamplingParams(**GREEDY))
    sequences = tokenize_bad_words(tokenizer, vocab, ["iceable"])
    assert sequences == ((638, 447), (950, 447))
    assert contains(plain, (950, 447))  # " iceable" without the ban
    banned = generate(llm, SamplingParams(**GREEDY, bad_words=["iceable"]))
    assert not any(contains(banned, s) for s in sequences), banned
    assert 950 in banned  # " ice" alone is fine; only "able" after it is banned
    assert "iceable" not in llm.get_tokenizer().decode(banned)


def test_mixed_batch_rows_get_what_they_get_alone(llm):
    params = [
        SamplingParams(**GREEDY),
        SamplingParams(**GREEDY, logit_bias={500: 100}),
        SamplingParams(**GREEDY, bad_words=["iceable", "ide"]),
        SamplingParams(**RANDOM, seed=4, allowed_token_ids=[7, 42, 300, 619, 950]),
        SamplingParams(temperature=0.8, seed=5, max_tokens=16, ignore_eos=True),
        SamplingParams(**GREEDY, repetition_penalty=1.3, logit_bias={447: -100}),
    ]
    prompts = [PROMPT, "It was the", PROMPT, "Call me", PROMPT, PROMPT]
    alone = [generate(llm, p, prompt) for p, prompt in zip(params, prompts, strict=True)]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert together == alone


def test_n_samples_and_logprobs_with_controls(llm):
    params = SamplingParams(temperature=1.0, seed=0, n=3, max_tokens=8, ignore_eos=True,
                            allowed_token_ids=[7, 42, 300], logprobs=2)  # fmt: skip
    output = llm.generate([PROMPT], params)[0]
    raw = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1, logprobs=2))[0]
    for sample in output.outputs:
        assert set(sample.token_ids) <= {7, 42, 300}
        # the first step's top logprobs are the raw model's, whatever was allowed
        assert sample.logprobs[0].top_token_ids == raw.outputs[0].logprobs[0].top_token_ids


def test_out_of_vocab_ids_and_too_many_bad_words(llm):
    vocab = llm.engine.model_config.vocab_size
    for kw, param in [
        (dict(allowed_token_ids=[1, vocab]), "allowed_token_ids"),
        (dict(logit_bias={vocab + 5: 1.0}), "logit_bias"),
        # 100 words of 2 token sequences each: more than vLLM's 128 sequences
        (dict(bad_words=[f"ice{i}" for i in range(100)]), "bad_words"),
    ]:
        with pytest.raises(QServeError) as bad:
            llm.generate([PROMPT], SamplingParams(max_tokens=2, **kw))
        assert bad.value.param == param, kw
    assert not llm.engine.has_unfinished_requests()
    # and the engine goes on serving
    assert len(generate(llm, SamplingParams(**GREEDY, allowed_token_ids=[vocab - 1]))) == 16
