"""What the engine returns for a request: one CompletionOutput per sample (n of them)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from qserve.engine.sampler import Logprobs


@dataclass
class CompletionOutput:
    index: int
    text: str  # all text so far (the tail that could start a stop string is held back)
    token_ids: list[int]
    delta_text: str = ""  # text new since the previous output of this request
    delta_token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    cumulative_logprob: float | None = None  # of a beam search's sequence: its tokens' logprobs

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # DELTA outputs: each CompletionOutput's text, token_ids and logprobs are only what is new
    delta: bool = False
    # one entry per prompt token, the first None (SamplingParams.prompt_logprobs); a DELTA
    # request has it in its first output only
    prompt_logprobs: list[Logprobs | None] | None = None


@dataclass
class BeamSearchSequence:
    """vLLM's: one of a beam search's best sequences."""

    tokens: list[int]  # the prompt's and the generated ones
    logprobs: list[dict[int, float]]  # per generated token: {token id: its logprob}
    cum_logprob: float = 0.0
    text: str | None = None  # the generated text
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """vLLM's: a beam search's best `beam_width` sequences, best first."""

    sequences: list[BeamSearchSequence]


def beam_search_output(output: RequestOutput) -> BeamSearchOutput:
    """The offline API's form of a finished beam search's RequestOutput."""
    prompt = output.prompt_token_ids
    sequences = [
        BeamSearchSequence(
            tokens=prompt + c.token_ids,
            logprobs=[{lp.sampled_token_id: lp.logprob} for lp in c.logprobs or []],
            cum_logprob=c.cumulative_logprob or 0.0,
            text=c.text,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )
        for c in output.outputs
    ]
    return BeamSearchOutput(sequences)


def coalesce(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """One output that says what `older` then `newer` said: the newer one, with the older one's
    deltas in front of its own (for DELTA outputs, its text, token ids and logprobs too). A
    reader that fell behind gets this instead of a backlog, so a stream buffers at most one
    output however slowly its client reads."""
    if newer.prompt_logprobs is None and older.prompt_logprobs is not None:
        newer = replace(newer, prompt_logprobs=older.prompt_logprobs)
    deltas = {c.index: c for c in older.outputs}
    outputs = []
    for c in newer.outputs:
        before = deltas.get(c.index)
        if before is not None and (before.delta_text or before.delta_token_ids):
            c = _joined(before, c, newer.delta)
        outputs.append(c)
    return replace(newer, outputs=outputs)


def _joined(before: CompletionOutput, c: CompletionOutput, delta: bool) -> CompletionOutput:
    joined = replace(
        c,
        delta_text=before.delta_text + c.delta_text,
        delta_token_ids=before.delta_token_ids + c.delta_token_ids,
    )
    if not delta:
        return joined
    logprobs = None if c.logprobs is None else (before.logprobs or []) + c.logprobs
    return replace(
        joined, text=joined.delta_text, token_ids=joined.delta_token_ids, logprobs=logprobs
    )


class OutputAccumulator:
    """Adds up a DELTA request's outputs into the cumulative final one, in O(its length)."""

    def __init__(self) -> None:
        self._texts: dict[int, list[str]] = {}
        self._token_ids: dict[int, list[int]] = {}
        self._logprobs: dict[int, list[Logprobs] | None] = {}
        self._last: RequestOutput | None = None
        self._prompt_logprobs: list[Logprobs | None] | None = None

    def add(self, output: RequestOutput) -> None:
        if output.prompt_logprobs is not None:
            self._prompt_logprobs = output.prompt_logprobs
        for c in output.outputs:
            self._texts.setdefault(c.index, []).append(c.text)
            self._token_ids.setdefault(c.index, []).extend(c.token_ids)
            if c.logprobs is not None:
                self._logprobs.setdefault(c.index, []).extend(c.logprobs)  # type: ignore[union-attr]
        self._last = output

    def result(self) -> RequestOutput:
        last = self._last
        assert last is not None, "no output to add up"
        if not last.delta:
            return last
        outputs = [
            replace(
                c,
                text="".join(self._texts[c.index]),
                token_ids=self._token_ids[c.index],
                logprobs=self._logprobs.get(c.index, []) if c.logprobs is not None else None,
            )
            for c in last.outputs
        ]
        return replace(last, outputs=outputs, delta=False, prompt_logprobs=self._prompt_logprobs)
