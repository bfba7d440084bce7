"""What the engine returns for a request: one CompletionOutput per sample (n of them)."""

from __future__ import annotations

from dataclasses import dataclass, field

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
