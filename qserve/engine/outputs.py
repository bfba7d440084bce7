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


def coalesce(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """One output that says what `older` then `newer` said: the newer one, with the older one's
    deltas in front of its own. A reader that fell behind gets this instead of a backlog, so a
    stream buffers at most one output however slowly its client reads."""
    deltas = {c.index: c for c in older.outputs}
    outputs = []
    for c in newer.outputs:
        before = deltas.get(c.index)
        if before is not None and (before.delta_text or before.delta_token_ids):
            c = replace(
                c,
                delta_text=before.delta_text + c.delta_text,
                delta_token_ids=before.delta_token_ids + c.delta_token_ids,
            )
        outputs.append(c)
    return replace(newer, outputs=outputs)
