"""Offline API: `LLM(model).generate(prompts, SamplingParams(...))`, as in vLLM."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from qserve.config import EngineConfig
from qserve.engine.llm_engine import LLMEngine
from qserve.engine.outputs import RequestOutput
from qserve.engine.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """Runs a batch of prompts to completion with continuous batching.

    Keyword arguments are EngineConfig fields (dtype, kv_cache_memory, max_num_seqs, ...).
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))
        self._counter = 0

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in the order given."""
        prompts = _as_list(prompts)
        params = _params_per_prompt(sampling_params, len(prompts))
        ids = []
        for prompt, p in zip(prompts, params):
            ids.append(str(self._counter))
            self._counter += 1
            self.engine.add_request(ids[-1], prompt, p)
        finished: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished:
                    finished[output.request_id] = output
        return [finished[i] for i in ids]


def _as_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if prompts and isinstance(prompts[0], int):
        return [list(prompts)]  # one prompt given as token ids
    return list(prompts)


def _params_per_prompt(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"{len(params)} sampling params for {n} prompts")
    return list(params)
