"""Prompt logprobs (vLLM's `prompt_logprobs`): each prompt token's logprob given the tokens before
it, computed from the hidden states of the prompt chunk a step runs, so that a long prompt never
needs a [prompt_len, vocab] tensor.

Prompt token i (i >= 1) is scored by the logits at position i - 1. A step that runs positions
[c, c + n) of a request therefore scores tokens c + 1 .. min(c + n, P - 1) (P = prompt length);
the logits at position P - 1 predict the first output token and belong to the sampler. Rows are
turned into logits PROMPT_LOGITS_CHUNK at a time, so the peak is one [chunk, vocab] fp32 block
whatever the prompt length. A request keeps the entries it has (`Request.prompt_logprobs`), so
a recomputed prompt (after preemption) is not scored twice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from qserve.engine.sampler import Logprobs, gather_logprobs
from qserve.engine.scheduler import ScheduledRequest

PROMPT_LOGITS_CHUNK = 128  # rows of fp32 logits turned into logprobs at a time


@dataclass(frozen=True)
class PromptSpan:
    """The prompt tokens one step scores for one request: tokens [first, first + count), from
    the hidden rows [row, row + count) of the step's flat batch."""

    request_id: str
    row: int
    first: int
    count: int
    num_logprobs: int
    targets: list[int]  # the prompt tokens scored: prompt[first : first + count]


def prompt_spans(scheduled: list[ScheduledRequest], query_starts: list[int]) -> list[PromptSpan]:
    """The spans of this step's requests that ask for prompt logprobs and still need some."""
    spans = []
    for s, start in zip(scheduled, query_starts):
        request = s.request
        k = request.sampling_params.prompt_logprobs
        if k is None:
            continue
        # tokens scored by positions [c, c + n): c + 1 .. c + n, capped at the prompt's last
        first = max(s.num_computed_tokens + 1, request.num_prompt_logprobs)
        end = min(s.num_computed_tokens + s.num_new_tokens, request.num_prompt_tokens - 1) + 1
        if end > first:
            row = start + (first - 1 - s.num_computed_tokens)
            targets = request.prompt_token_ids[first:end]
            spans.append(PromptSpan(request.request_id, row, first, end - first, k, targets))
    return spans


def compute_prompt_logprobs(
    model: nn.Module, hidden: torch.Tensor, spans: list[PromptSpan]
) -> dict[str, list[Logprobs]]:
    """request id -> the Logprobs of its span's prompt tokens, in order."""
    out: dict[str, list[Logprobs]] = {}
    for span in spans:
        entries: list[Logprobs] = []
        for a in range(0, span.count, PROMPT_LOGITS_CHUNK):
            b = min(a + PROMPT_LOGITS_CHUNK, span.count)
            logits = model.compute_logits(hidden[span.row + a : span.row + b]).float()
            targets = torch.tensor(span.targets[a:b], dtype=torch.int64, device=logits.device)
            logprobs = torch.log_softmax(logits, dim=-1)
            entries += gather_logprobs(logprobs, targets, [span.num_logprobs] * (b - a))
        out[span.request_id] = entries  # type: ignore[arg-type]
    return out
