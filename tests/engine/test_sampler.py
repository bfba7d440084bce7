import dataclasses

import pytest
import torch

from qserve.engine.sampler import (
    Sampler,
    SamplingMetadata,
    apply_min_p,
    apply_penalties,
    apply_top_k,
    apply_top_p,
    make_generator,
)
from qserve.engine.sampling_params import SamplingParams

VOCAB = 32
EOS = 31


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def metadata_for(params, prompts=None, outputs=None, generators=None, vocab=VOCAB):
    rows = len(params)
    return SamplingMetadata.from_requests(
        params,
        prompt_token_ids=prompts if prompts is not None else [[1, 2]] * rows,
        output_token_ids=outputs if outputs is not None else [[]] * rows,
        generators=generators or {},
        eos_token_ids=[EOS],
        vocab_size=vocab,
    )


def sample(logits, params, **kwargs):
    return Sampler()(logits, metadata_for(params, vocab=logits.shape[1], **kwargs))


def random_logits(rows, vocab=VOCAB, seed=0):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))


def test_greedy_batch_is_argmax():
    logits = random_logits(6)
    out = sample(logits, [SamplingParams(temperature=0.0)] * 6)
    assert out.sampled_token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs is None


def test_input_logits_are_left_untouched():
    logits = random_logits(3, seed=6)
    before = logits.clone()
    params = [SamplingParams(temperature=0.5, top_k=3, top_p=0.8, min_p=0.1)] * 2
    sample(logits, params + [SamplingParams(repetition_penalty=1.3, min_tokens=1)])
    assert torch.equal(logits, before)


def test_empty_batch():
    assert sample(torch.zeros(0, VOCAB), []).sampled_token_ids == []


def test_metadata_flags_and_unused_steps_are_none():
    meta = metadata_for([SamplingParams(temperature=0.0)] * 2)
    assert meta.all_greedy and not meta.all_random
    assert meta.temperature is None and meta.top_k is None and meta.top_p is None
    assert meta.min_p is None and meta.no_penalties and meta.max_num_logprobs is None
    both_off = [SamplingParams(top_k=-1), SamplingParams(top_k=100)]  # 100 > VOCAB: off
    assert metadata_for(both_off).top_k is None
    params = [SamplingParams(top_k=-1), SamplingParams(top_k=100), SamplingParams(top_k=5)]
    meta = metadata_for(params + [SamplingParams(top_p=0.5)])
    assert meta.all_random and not meta.all_greedy
    assert meta.top_k.tolist() == [VOCAB, VOCAB, 5, VOCAB]
    assert meta.top_p.tolist() == [1.0, 1.0, 1.0, 0.5]


def test_top_k_one_equals_greedy():
    torch.manual_seed(0)
    logits = random_logits(8, seed=1)
    out = sample(logits, [SamplingParams(temperature=1.5, top_k=1)] * 8)
    assert out.sampled_token_ids == logits.argmax(dim=-1).tolist()


def test_tiny_top_p_equals_greedy():
    torch.manual_seed(0)
    logits = random_logits(8, seed=2)
    out = sample(logits, [SamplingParams(temperature=1.0, top_p=1e-6)] * 8)
    assert out.sampled_token_ids == logits.argmax(dim=-1).tolist()


def test_mixed_batch_keeps_greedy_rows_greedy():
    torch.manual_seed(0)
    logits = random_logits(4, seed=3)
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=1)] * 2
    out = sample(logits, params)
    assert out.sampled_token_ids == logits.argmax(dim=-1).tolist()


def test_top_k_and_top_p_keep_exactly_the_expected_tokens():
    # probs 0.5, 0.3, 0.1, 0.1 on tokens 0..3
    logits = torch.tensor([[0.5, 0.3, 0.1, 0.1]]).log().repeat(400, 1)
    torch.manual_seed(0)
    top_k = sample(logits, [SamplingParams(top_k=2)] * 400).sampled_token_ids
    top_p = sample(logits, [SamplingParams(top_p=0.7)] * 400).sampled_token_ids
    assert set(top_k) == {0, 1}
    assert set(top_p) == {0, 1}  # 0.5 + 0.3 >= 0.7, 0.5 alone is not
    assert set(sample(logits, [SamplingParams()] * 400).sampled_token_ids) == {0, 1, 2, 3}


def test_top_k_keeps_ties():
    logits = torch.tensor([[3.0, 1.0, 3.0, 0.0], [3.0, 1.0, 3.0, 0.0]])
    masked = apply_top_k(logits.clone(), torch.tensor([1, 3]))
    expected = [[True, False, True, False], [True, True, True, False]]
    assert torch.isfinite(masked).tolist() == expected


def _top_p_reference(logits, p):
    """Full sort: keep a token when the mass ranked above it is below p."""
    probs = logits.softmax(dim=-1)
    sorted_probs, ids = probs.sort(dim=-1, descending=True)
    keep = (sorted_probs.cumsum(dim=-1) - sorted_probs) < p.unsqueeze(1)
    keep[:, 0] = True
    return torch.zeros_like(keep).scatter_(1, ids, keep)


@pytest.mark.parametrize("scale", [8.0, 0.5])  # peaked: top candidates suffice; flat: full sort
def test_top_p_over_candidates_matches_a_full_sort(scale):
    logits = random_logits(4, vocab=4096, seed=7) * scale
    p = torch.tensor([0.9, 0.5, 1.0, 0.99])
    masked = apply_top_p(logits.clone(), p)
    assert torch.equal(torch.isfinite(masked), _top_p_reference(logits, p) | (p == 1.0)[:, None])
    assert masked[2].tolist() == logits[2].tolist()


def test_min_p_masks_tokens_below_the_scaled_top_probability():
    logits = torch.tensor([[0.5, 0.3, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25]]).log()
    masked = apply_min_p(logits.clone(), torch.tensor([0.5, 0.9]))
    inf = float("inf")
    assert torch.isinf(masked).tolist() == [[False, False, True, True], [False] * 4]
    assert masked[0, 2:].tolist() == [-inf, -inf]
    torch.manual_seed(0)
    many = logits[:1].repeat(400, 1)
    assert set(sample(many, [SamplingParams(min_p=0.5)] * 400).sampled_token_ids) == {0, 1}


def test_penalties_hand_computed():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0], [2.0, -1.0, 0.5, 3.0, -2.0]])
    params = [
        SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(),  # penalties off on this row
    ]
    meta = metadata_for(params, prompts=[[0], [0]], outputs=[[1, 1, 3], [1, 1, 3]], vocab=5)
    penalised = apply_penalties(logits.clone(), meta)
    # repetition over prompt+output {0, 1, 3}: 2/2, -1*2, 3/2; frequency 0.5*count over output
    # (token 1 twice, token 3 once); presence 0.25 over output {1, 3}.
    assert penalised[0].tolist() == [1.0, -3.25, 0.5, 0.75, -2.0]
    assert penalised[1].tolist() == logits[1].tolist()
    greedy = [dataclasses.replace(p, temperature=0.0) for p in params]
    out = sample(logits, greedy, prompts=[[0], [0]], outputs=[[1, 1, 3], [1, 1, 3]])
    assert out.sampled_token_ids == [0, 3]


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 5.0
    logits[0, 7] = 4.0
    logits[0, 3] = 3.0
    params = [SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[7, 1000])]
    assert sample(logits, params, outputs=[[5]]).sampled_token_ids == [3]
    assert sample(logits, params, outputs=[[5, 6]]).sampled_token_ids == [EOS]
    ignore = [SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True)]
    assert sample(logits, ignore, outputs=[[5]]).sampled_token_ids == [EOS]


def _seeded_run(logits_steps, rows_params, seeded_row, seed):
    """Tokens of `seeded_row` over the steps, with the other rows sampled beside it."""
    params = list(rows_params)
    params[seeded_row] = SamplingParams(temperature=0.9, seed=seed, top_p=0.95)
    generator = make_generator(params[seeded_row])
    tokens = []
    for logits in logits_steps:
        batch = logits.repeat(len(params), 1)
        out = sample(batch, params, generators={seeded_row: generator})
        tokens.append(out.sampled_token_ids[seeded_row])
    return tokens


def test_seeded_rows_do_not_depend_on_the_batch():
    steps = [random_logits(1, vocab=64, seed=10 + s) for s in range(6)]
    alone = _seeded_run(steps, [None], 0, seed=1234)
    others = [SamplingParams(), SamplingParams(temperature=0.0), None, SamplingParams(top_k=3)]
    torch.manual_seed(99)  # the unseeded rows draw from the global RNG
    in_batch = _seeded_run(steps, others, 2, seed=1234)
    assert in_batch == alone
    first = _seeded_run(steps, [None, SamplingParams(temperature=2.0, seed=5)], 0, seed=1234)
    assert first == alone


def test_different_seeds_differ_and_children_are_reproducible():
    steps = [random_logits(1, vocab=64, seed=20 + s) for s in range(10)]
    parent = SamplingParams(n=2, temperature=1.0, seed=42)
    runs = [_seeded_run(steps, [None], 0, seed=parent.child_params(i).seed) for i in range(2)]
    assert runs[0] != runs[1]
    assert runs[0] == _seeded_run(steps, [None], 0, seed=42)


def test_temperature_sampling_matches_softmax():
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, -1.5]])
    temperature = 0.7
    draws = 2000
    torch.manual_seed(0)
    out = sample(logits.repeat(draws, 1), [SamplingParams(temperature=temperature)] * draws)
    counts = torch.bincount(torch.tensor(out.sampled_token_ids), minlength=5)
    expected = torch.softmax(logits[0] / temperature, dim=-1)
    # Largest binomial std here is ~0.011; allow 3.5 of them.
    assert (counts / draws - expected).abs().max().item() < 0.04


def test_logprobs_are_raw_log_softmax_with_ranks():
    torch.manual_seed(0)
    logits = random_logits(3, seed=4)
    params = [
        SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=1.5),
        SamplingParams(),  # no logprobs on this row
        SamplingParams(temperature=0.5, logprobs=0),
    ]
    out = sample(logits, params, outputs=[[5], [6], [7]])
    expected = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[1] is None
    first = out.logprobs[0]
    assert first.sampled_token_id == out.sampled_token_ids[0]
    assert first.logprob == expected[0, first.sampled_token_id].item()
    order = expected[0].argsort(descending=True).tolist()
    assert first.top_token_ids == order[:3]
    assert first.top_logprobs == expected[0, order[:3]].tolist()
    assert first.rank == order.index(first.sampled_token_id) + 1
    third = out.logprobs[2]
    token = out.sampled_token_ids[2]
    assert (third.sampled_token_id, third.logprob) == (token, expected[2, token].item())
    assert third.rank == int((expected[2] >= expected[2, token]).sum())
    assert third.top_token_ids == [] and third.top_logprobs == []


def test_greedy_logprob_rank_is_one():
    logits = random_logits(2, seed=5)
    out = sample(logits, [SamplingParams(temperature=0.0, logprobs=1)] * 2)
    assert [lp.rank for lp in out.logprobs] == [1, 1]
    assert [lp.top_token_ids[0] for lp in out.logprobs] == out.sampled_token_ids


def test_seeded_top_p_row_is_unchanged_when_a_flat_row_forces_a_full_sort():
    peaked = random_logits(1, vocab=2048, seed=30) * 3.0
    flat = random_logits(1, vocab=2048, seed=31) * 0.1
    params = SamplingParams(top_p=0.9, seed=77)

    def run(batch_logits, rows):
        generator = make_generator(params)
        out = [sample(batch_logits, rows, generators={0: generator}) for _ in range(8)]
        return [o.sampled_token_ids[0] for o in out]

    alone = run(peaked, [params])
    with_flat = run(torch.cat([peaked, flat]), [params, SamplingParams(top_p=0.9)])
    assert with_flat == alone
    assert len(set(alone)) > 1


def test_every_bit_of_a_64_bit_seed_counts():
    """mt19937 keeps 32 bits of its seed: without mixing, seed 1 and 2**32 + 1 drew the same."""
    from qserve.engine.sampler import make_generator

    def draws(seed: int) -> list[float]:
        generator = make_generator(SamplingParams(seed=seed, temperature=1.0))
        return torch.rand(4, generator=generator).tolist()

    assert draws(1) == draws(1)
    assert (
        len({tuple(draws(s)) for s in (1, 2**32 + 1, 2**63 + 1, -1, 2**64 - 1)}) == 4
    )  # -1 is 2**64-1


def test_n_samples_of_the_largest_seed():
    params = SamplingParams(n=3, seed=2**64 - 1, temperature=1.0)
    assert [params.child_params(i).seed for i in range(3)] == [2**64 - 1, 0, 1]
