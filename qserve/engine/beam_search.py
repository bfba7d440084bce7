"""Beam search as a pure function of the live beams' log-probabilities, one prompt at a time.

It is transformers 5's `generate(num_beams=k, num_return_sequences=k, do_sample=False,
length_penalty=lp, early_stopping=...)` (`GenerationMixin._beam_search`) for one sequence,
step for step, in the same fp32 arithmetic:

- the running beams' scores are their summed log-probabilities; each step, the
  `(1 + number of EOS tokens, at least 2) * k` best continuations over every beam and token
  are kept (`_get_top_k_continuations`), so at least k of them do not end;
- a continuation that ends (an EOS token, or `max_tokens` reached) and is among the first k
  becomes a finished hypothesis scored `sum / generated_length ** lp` (the EOS counted), and
  the best k hypotheses are kept (`_update_finished_beams`);
- the best k continuations that do not end run on (`_get_running_beams_for_next_iteration`);
- the search stops once all k hypotheses exist and the best running beam, scored at its
  current length (`early_stopping` False or True), or at `max_tokens` when `early_stopping` is
  "never" and lp > 0, cannot beat the worst of them (`_check_early_stop_heuristic`); with
  `early_stopping=True` it stops as soon as k hypotheses exist; and at `max_tokens`.

transformers also penalizes new hypotheses when the batch item is already done; for one prompt
the search has stopped by then, so that case does not arise here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from qserve.errors import QServeError

NEG_INF = -1.0e9  # transformers' "never choose this" offset


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's `BeamSearchParams`, plus transformers' `early_stopping` (True, False or "never")."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool | Literal["never"] = False

    def __post_init__(self) -> None:
        if self.beam_width < 1:
            raise QServeError(f"beam_width must be >= 1, got {self.beam_width}", param="n")
        if self.max_tokens < 1:
            raise QServeError(f"max_tokens must be >= 1, got {self.max_tokens}", param="max_tokens")
        if self.temperature < 0:
            raise QServeError("temperature must be >= 0", param="temperature")
        if self.early_stopping not in (True, False, "never"):
            raise QServeError("early_stopping is true, false or 'never'", param="early_stopping")


@dataclass(frozen=True)
class Beam:
    token_ids: tuple[int, ...]  # generated so far
    logprobs: tuple[float, ...]  # of each generated token
    ranks: tuple[int, ...]  # of each generated token in its row (1 = most likely)
    cum_logprob: float  # fp32 sum of `logprobs`, accumulated as transformers does
    parent: int = 0  # index of the running beam it continues, in the previous step's state


@dataclass(frozen=True)
class Hypothesis:
    beam: Beam
    score: float  # cum_logprob / len(token_ids) ** length_penalty
    finish_reason: Literal["stop", "length"]
    key: int  # unique within the search


@dataclass(frozen=True)
class BeamSearchState:
    running: tuple[Beam, ...] = (Beam((), (), (), 0.0),)  # best first
    finished: tuple[Hypothesis, ...] = ()  # best first, at most beam_width
    num_steps: int = 0
    improvable: bool = True  # transformers' is_early_stop_heuristic_unsatisfied
    done: bool = False


@dataclass(frozen=True)
class _Candidates:
    scores: torch.Tensor  # fp32 [num_candidates], best first
    parents: list[int]
    token_ids: list[int]
    ends: list[bool]  # the continuation ends the beam: an EOS token, or max_tokens reached
    stops: list[bool]  # ends with an EOS token


def beam_search_step(
    state: BeamSearchState,
    logprobs: torch.Tensor,
    params: BeamSearchParams,
    eos_token_ids: list[int],
) -> BeamSearchState:
    """The next state, given `logprobs`: fp32 [len(state.running), vocab], each running beam's
    log_softmax over the next token."""
    eos = [] if params.ignore_eos else eos_token_ids
    cand = _top_continuations(state, logprobs, params, eos)
    running = _next_running(state, cand, logprobs, params.beam_width)
    finished = _update_finished(state, cand, logprobs, params)
    num_steps = state.num_steps + 1
    improvable = state.improvable and _improvable(running, finished, num_steps, params)
    done = (
        not improvable
        or (params.early_stopping is True and len(finished) == params.beam_width)
        or all(cand.ends)
    )
    return BeamSearchState(running, finished, num_steps, improvable, done)


def _top_continuations(
    state: BeamSearchState, logprobs: torch.Tensor, params: BeamSearchParams, eos: list[int]
) -> _Candidates:
    k, vocab = params.beam_width, logprobs.shape[-1]
    scores = torch.tensor([b.cum_logprob for b in state.running], dtype=torch.float32)
    acc = (logprobs.float() + scores[:, None]).reshape(-1)  # [num_beams * vocab]
    num_keep = min(max(2, 1 + len(eos)) * k, acc.numel())
    top_scores, top_indices = torch.topk(acc, num_keep)
    parents = (top_indices // vocab).tolist()
    token_ids = (top_indices % vocab).tolist()
    at_max = state.num_steps + 1 >= params.max_tokens
    stops = [t in eos for t in token_ids]
    return _Candidates(top_scores, parents, token_ids, [at_max or s for s in stops], stops)


def _extend(state: BeamSearchState, logprobs: torch.Tensor, cand: _Candidates, j: int) -> Beam:
    parent, token = cand.parents[j], cand.token_ids[j]
    beam, row = state.running[parent], logprobs[parent]
    rank = 1 + int((row > row[token]).sum())
    return Beam(
        beam.token_ids + (token,),
        beam.logprobs + (float(row[token]),),
        beam.ranks + (rank,),
        float(cand.scores[j]),
        parent,
    )


def _next_running(
    state: BeamSearchState, cand: _Candidates, logprobs: torch.Tensor, k: int
) -> tuple[Beam, ...]:
    """The best k continuations that do not end (an ended one scores NEG_INF lower)."""
    ends = torch.tensor(cand.ends, dtype=torch.float32)
    running_scores = cand.scores + ends * NEG_INF
    order = torch.topk(running_scores, min(k, len(cand.ends))).indices.tolist()
    return tuple(_extend(state, logprobs, cand, j) for j in order)


def _update_finished(
    state: BeamSearchState, cand: _Candidates, logprobs: torch.Tensor, params: BeamSearchParams
) -> tuple[Hypothesis, ...]:
    """The best k hypotheses: the kept ones and the continuations among the first k that end."""
    k, length = params.beam_width, state.num_steps + 1
    scores = cand.scores / (length**params.length_penalty)
    new = [
        Hypothesis(
            _extend(state, logprobs, cand, j),
            float(scores[j]),
            "stop" if cand.stops[j] else "length",
            state.num_steps * len(cand.ends) + j,
        )
        for j in range(min(k, len(cand.ends)))
        if cand.ends[j]
    ]
    merged = sorted(state.finished + tuple(new), key=lambda h: h.score, reverse=True)
    return tuple(merged[:k])


def _improvable(
    running: tuple[Beam, ...],
    finished: tuple[Hypothesis, ...],
    num_steps: int,
    params: BeamSearchParams,
) -> bool:
    """Whether the best running beam could still beat the worst of k hypotheses."""
    if len(finished) < params.beam_width:
        return True
    lp = params.length_penalty
    length = params.max_tokens if params.early_stopping == "never" and lp > 0 else num_steps
    best = torch.tensor([running[0].cum_logprob], dtype=torch.float32) / (length**lp)
    return bool(best[0] > min(h.score for h in finished))
