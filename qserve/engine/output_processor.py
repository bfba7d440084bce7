"""A request's state in the engine (its n samples, each with its scheduler request and
detokenizer) and the RequestOutput built from it each step (vLLM's output processor).

A step rebuilds only the samples it advanced; the others keep their last output with empty
deltas, so with n = 128 a step costs what its advanced samples cost. DELTA outputs hold only what
is new (the same cost at token 4000 as at token 10); a request's prompt logprobs go out once
(CUMULATIVE: with every output)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from qserve.engine.detokenizer import IncrementalDetokenizer
from qserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from qserve.engine.request import Request
from qserve.engine.sampler import Logprobs
from qserve.engine.sampling_params import RequestOutputKind


@dataclass
class SampleState:
    """One of a request's n samples: its own scheduler request and detokenizer."""

    index: int
    request: Request
    detokenizer: IncrementalDetokenizer
    logprobs: list[Logprobs] | None
    num_sent_tokens: int = 0
    # the last output, with empty deltas: what a step that did not advance this sample reports
    # (with n = 128 most samples of a request wait while others run)
    unchanged: CompletionOutput | None = None


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[SampleState]
    metrics: RequestMetrics
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    finished_samples: set[int] = field(default_factory=set)
    # each sample's last output with empty deltas; a step rebuilds only the samples it advanced
    idle_outputs: list[CompletionOutput] | None = None
    sent_prompt_logprobs: bool = False

    @property
    def finished(self) -> bool:
        return len(self.finished_samples) == len(self.samples)


def make_request_output(
    state: RequestState, advanced: list[SampleState] | None = None
) -> RequestOutput:
    """The request's output: rebuilt for the `advanced` samples (all when None), the others
    as they were with empty deltas (with n = 128, most samples wait while a few run)."""
    delta = state.output_kind == RequestOutputKind.DELTA
    if state.idle_outputs is None or advanced is None:
        outputs = [completion_output(s, delta) for s in state.samples]
        state.idle_outputs = [s.unchanged or o for s, o in zip(state.samples, outputs)]
    else:
        outputs = list(state.idle_outputs)
        for sample in advanced:
            outputs[sample.index] = completion_output(sample, delta)
            state.idle_outputs[sample.index] = sample.unchanged or outputs[sample.index]
    # complete once any token is out; a DELTA request sends it in its first output only
    prompt_logprobs = state.samples[0].request.prompt_logprobs
    if delta and state.sent_prompt_logprobs:
        prompt_logprobs = None
    state.sent_prompt_logprobs = True
    return RequestOutput(
        request_id=state.request_id,
        prompt=state.prompt,
        prompt_token_ids=state.prompt_token_ids,
        prompt_logprobs=prompt_logprobs,
        outputs=outputs,
        finished=state.finished,
        metrics=replace(state.metrics),  # a snapshot: the engine keeps updating its own
        delta=delta,
    )


def completion_output(sample: SampleState, delta: bool = False) -> CompletionOutput:
    """The sample's output now: cumulative, or (`delta`) only what is new, which costs
    the same at token 4000 as at token 10."""
    request, detok = sample.request, sample.detokenizer
    finished = request.is_finished
    last = sample.unchanged
    if last is not None and last.finished == finished:
        if request.num_output_tokens == sample.num_sent_tokens:
            return last
    start, end = sample.num_sent_tokens, request.num_output_tokens
    delta_ids = request.output_token_ids[start:end]
    delta_text = detok.get_next_output_text(finished, delta=True)
    logprobs = sample.logprobs
    sample.num_sent_tokens = end
    if delta:
        output = CompletionOutput(
            sample.index, delta_text, delta_ids, delta_text, delta_ids,
            None if logprobs is None else logprobs[start:end],
            request.get_finished_reason(), request.stop_reason,
        )  # fmt: skip
        empty = [] if logprobs is not None else None
        sample.unchanged = replace(output, text="", token_ids=[], delta_text="",
                                   delta_token_ids=[], logprobs=empty)  # fmt: skip
        return output
    output = CompletionOutput(
        index=sample.index,
        text=detok.get_next_output_text(finished, delta=False),
        token_ids=list(request.output_token_ids),
        delta_text=delta_text,
        delta_token_ids=delta_ids,
        logprobs=list(logprobs) if logprobs is not None else None,
        finish_reason=request.get_finished_reason(),
        stop_reason=request.stop_reason,
    )
    sample.unchanged = replace(output, delta_text="", delta_token_ids=[])
    return output
