"""`beam_search_step` equals transformers 5's beam search (`generate(num_beams=k,
num_return_sequences=k, do_sample=False)`) on a tiny random Llama, in sequences and scores, for
every `early_stopping` (False, True, "never") and length penalties of either sign. Both sides
run the model without a KV cache on the same batches of beams, so they see the same logits."""

from __future__ import annotations

import pytest
import torch

from qserve.engine.beam_search import BeamSearchParams, BeamSearchState, beam_search_step
from tests.engine.beams import transformers_beams
from tests.tiny_models import build_tiny_model

EOS = 7
PROMPTS = [[5, 9, 20, 31], [1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12], [50]]


@pytest.fixture(scope="module")
def model():
    model = build_tiny_model("llama", seed=3, vocab_size=64)
    with torch.no_grad():  # make EOS a likely token, so beams end early and ranks change
        model.model.embed_tokens.weight[EOS] *= 4
    return model


def qserve_beams(model, prompt, params: BeamSearchParams):
    state = BeamSearchState()
    k = params.beam_width
    while not state.done:
        # the same batches transformers runs: k rows (the prompt k times at first)
        beams = [prompt + list(b.token_ids) for b in state.running]
        batch = torch.tensor(beams * k if len(beams) == 1 else beams)
        with torch.inference_mode():
            logits = model(batch, use_cache=False).logits[:, -1, :].float()
        rows = torch.log_softmax(logits, dim=-1)[: len(beams)]
        state = beam_search_step(state, rows, params, [EOS])
    return [list(h.beam.token_ids) for h in state.finished], [h.score for h in state.finished]


@pytest.mark.parametrize("early_stopping", [False, True, "never"])
@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 2.0, -0.5])
@pytest.mark.parametrize("k", [2, 4])
def test_matches_transformers(model, k, length_penalty, early_stopping):
    params = BeamSearchParams(
        k, max_tokens=10, length_penalty=length_penalty, early_stopping=early_stopping
    )
    for prompt in PROMPTS:
        want_seqs, want_scores = transformers_beams(model, prompt, params, EOS, 0)
        got_seqs, got_scores = qserve_beams(model, prompt, params)
        assert got_seqs == want_seqs
        assert got_scores == pytest.approx(want_scores, rel=1e-6, abs=1e-5)


def test_cum_logprob_is_the_sum_of_token_logprobs(model):
    params = BeamSearchParams(3, max_tokens=6)
    state = BeamSearchState()
    prompt = PROMPTS[0]
    while not state.done:
        beams = [prompt + list(b.token_ids) for b in state.running]
        with torch.inference_mode():
            logits = model(torch.tensor(beams), use_cache=False).logits[:, -1, :].float()
        state = beam_search_step(state, torch.log_softmax(logits, -1), params, [EOS])
    for h in state.finished:
        assert h.beam.cum_logprob == pytest.approx(sum(h.beam.logprobs), abs=1e-5)
        length = len(h.beam.token_ids)
        assert h.score == pytest.approx(h.beam.cum_logprob / length, abs=1e-6)
        assert h.finish_reason == ("stop" if h.beam.token_ids[-1] == EOS else "length")
