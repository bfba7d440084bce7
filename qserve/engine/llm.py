"""Offline API: `LLM(model).generate(prompts, SamplingParams(...))`, as in vLLM."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from qserve.config import EngineConfig
from qserve.engine.beam_search import BeamSearchParams
from qserve.engine.llm_engine import LLMEngine
from qserve.engine.outputs import BeamSearchOutput, RequestOutput, beam_search_output
from qserve.engine.sampling_params import SamplingParams
from qserve.errors import QServeError

# A text, token ids, or vLLM's dict form: {"prompt": text} or {"prompt_token_ids": ids}, with an
# optional "cache_salt" (prefix-cache blocks are shared only between prompts of equal salt).
Prompt = str | list[int] | dict[str, Any]
PROMPT_KEYS = {"prompt", "prompt_token_ids", "cache_salt"}


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
            ids.append(self._next_id())
            text_or_ids, cache_salt = _unpack(prompt)
            self.engine.add_request(ids[-1], text_or_ids, p, cache_salt=cache_salt)
        return self._run(ids)

    def beam_search(
        self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams
    ) -> list[BeamSearchOutput]:
        """The best `params.beam_width` sequences of each prompt, best first (vLLM's API; the
        search is transformers' `generate(num_beams=...)`, `qserve.engine.beam_search`)."""
        ids = []
        for prompt in _as_list(prompts):
            ids.append(self._next_id())
            text_or_ids, cache_salt = _unpack(prompt)
            self.engine.add_beam_search_request(ids[-1], text_or_ids, params, None, cache_salt)
        return [beam_search_output(output) for output in self._run(ids)]

    def _next_id(self) -> str:
        self._counter += 1
        return str(self._counter - 1)

    def _run(self, ids: list[str]) -> list[RequestOutput]:
        """Step until every request has finished; their final outputs in the order of `ids`."""
        finished: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished:
                    finished[output.request_id] = output
        return [finished[i] for i in ids]


def _unpack(prompt: Prompt) -> tuple[str | list[int], str | None]:
    """(text or token ids, cache salt) of one prompt."""
    if not isinstance(prompt, dict):
        return prompt, None
    unknown = set(prompt) - PROMPT_KEYS
    if unknown or ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise QServeError(
            "a prompt dict takes one of 'prompt' or 'prompt_token_ids', and 'cache_salt'"
            + (f"; unknown keys: {', '.join(sorted(unknown))}" if unknown else ""),
            param="prompt",
        )
    text_or_ids = prompt["prompt"] if "prompt" in prompt else list(prompt["prompt_token_ids"])
    return text_or_ids, prompt.get("cache_salt")


def _as_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str | dict):
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
