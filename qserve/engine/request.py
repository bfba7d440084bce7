"""A request as the scheduler sees it: token ids catching up through num_computed_tokens."""

from __future__ import annotations

import copy
import enum
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from qserve.engine.logits_processors import TokenControls
    from qserve.engine.sampler import Logprobs
    from qserve.engine.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after this point is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def finish_reason(status: RequestStatus) -> str | None:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """One sequence to generate. There is no prefill or decode mode: each step the scheduler
    gives the request a number of tokens so that `num_computed_tokens` catches up with
    `num_tokens` (prompt + outputs so far)."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: list[int] | None = None,
        max_model_len: int | None = None,
        generator: torch.Generator | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        group: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.cache_salt = cache_salt
        # the client request this sequence belongs to (its n samples, a batch of prompts):
        # the scheduler admits waiting sequences fairly between groups
        self.group = request_id if group is None else group
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = list(eos_token_ids or [])
        self.max_model_len = max_model_len
        self.generator = generator
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        # the request's xgrammar GrammarMatcher (structured outputs), set by the engine
        self.grammar: Any = None
        # allowed_token_ids, logit_bias and tokenized bad_words, built once by the engine
        self.token_controls: TokenControls | None = None
        # beam search: this round's log-softmax row over the vocabulary, set once computed and
        # cleared when the search advances (the scheduler skips a beam while it is set)
        self.beam_logprobs: Any = None
        # a beam: the model runner returns its log-probabilities, the search picks its tokens
        self.is_beam = False
        # n > 1: the other samples, forked from this one once it has computed all but the last
        # prompt token (they then share its blocks, the partial last one copied on write)
        self.forks: list[Request] = []
        # prompt logprobs so far, one per prompt token (the first None), when asked for
        self.prompt_logprobs: list[Logprobs | None] | None = (
            [None] if sampling_params.prompt_logprobs is not None else None
        )

    def fork(self, request_id: str) -> Request:
        """A copy of this sequence under another id (a beam of a beam search); the scheduler
        forks its blocks (`Scheduler.fork_request`)."""
        child = copy.copy(self)
        child.request_id = request_id
        child.output_token_ids = list(self.output_token_ids)
        child.all_token_ids = list(self.all_token_ids)
        child.num_preemptions = 0
        return child

    @property
    def cache_salt_key(self) -> bytes:
        """The salt as it enters the first block's key (empty: shares with unsalted prompts)."""
        return b"salt:" + self.cache_salt.encode() if self.cache_salt else b""

    @property
    def num_prompt_logprobs(self) -> int:
        """Prompt tokens whose logprobs are known (the first counts; 0 when none are asked)."""
        return len(self.prompt_logprobs) if self.prompt_logprobs is not None else 0

    def add_prompt_logprobs(self, entries: list[Logprobs]) -> None:
        assert self.prompt_logprobs is not None
        self.prompt_logprobs.extend(entries)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_to_compute(self) -> int:
        """How far the scheduler may compute this request now: every token, except the last
        prompt token while samples wait to be forked before it."""
        return self.num_tokens - 1 if self.forks else self.num_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def append_output_token_ids(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.grammar is not None and not self.grammar.is_terminated():
            self.grammar.accept_token(token_id)

    def get_finished_reason(self) -> str | None:
        return RequestStatus.finish_reason(self.status)

    def check_stop(self) -> bool:
        """After a token was appended: stop on EOS, a stop token id, max_tokens or the context
        limit. Stop strings are checked by the detokenizer, which aborts the request."""
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if (not params.ignore_eos and last in self.eos_token_ids) or last in params.stop_token_ids:
            if self.num_output_tokens >= params.min_tokens:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = None if last in self.eos_token_ids else last
                return True
        if self.grammar is not None and self.grammar.is_terminated():
            self.status = RequestStatus.FINISHED_STOPPED  # the grammar is complete
            return True
        max_tokens = params.max_tokens
        if (max_tokens is not None and self.num_output_tokens >= max_tokens) or (
            self.max_model_len is not None and self.num_tokens >= self.max_model_len
        ):
            self.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False
