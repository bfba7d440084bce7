"""POST /v1/completions: text in, text out; a list of prompts is a batch."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from qserve.engine.outputs import CompletionOutput, RequestOutput
from qserve.engine.sampler import Logprobs
from qserve.server.async_engine import RequestStream
from qserve.server.protocol import CompletionRequest
from qserve.server.serving_engine import (
    Json,
    OpenAIServing,
    SSEStream,
    close_all,
    collect,
    error_payload,
    merge,
    now,
    random_id,
    sse,
    usage,
)


@dataclass
class _ChoiceState:
    """What a stream has sent of one choice so far."""

    started: bool = False
    num_tokens: int = 0
    text_offset: int = 0  # of the next token's logprobs entry (see `_logprobs`)
    finished: bool = False

    def update(self, completion: CompletionOutput, text_offset: int) -> None:
        self.started = True
        self.num_tokens += len(completion.token_ids)  # a DELTA output: the new tokens
        self.text_offset = text_offset
        self.finished = completion.finished


@dataclass
class _StreamState:
    choices: dict[int, _ChoiceState] = field(default_factory=dict)
    final: dict[int, RequestOutput] = field(default_factory=dict)

    def choice(self, index: int) -> _ChoiceState:
        return self.choices.setdefault(index, _ChoiceState())


class OpenAIServingCompletion(OpenAIServing):
    async def create(self, request: CompletionRequest) -> Json | SSEStream:
        self.check_model(request.model)
        params = request.sampling_params(self.max_tokens_default)
        prompts = request.prompts()
        request_id = random_id("cmpl")
        streams = await self.add_requests(
            request_id, prompts, params, cache_salt=request.cache_salt
        )
        if request.stream:
            return SSEStream(self._stream(request_id, request, prompts, streams), streams)
        outputs = await collect(streams)
        return self._response(request_id, request, prompts, outputs)

    # -- whole response ------------------------------------------------------------------------

    def _response(
        self,
        request_id: str,
        request: CompletionRequest,
        prompts: list[str | list[int]],
        outputs: list[RequestOutput],
    ) -> Json:
        choices = []
        for i, output in enumerate(outputs):
            prefix = self._prompt_text(prompts[i]) if request.echo else ""
            for completion in output.outputs:
                index = i * request.n + completion.index
                logprobs, _ = self._logprobs(completion.logprobs, request.logprobs, len(prefix))
                choices.append(_choice(index, prefix + completion.text, logprobs, completion))
        return {
            "id": request_id,
            "object": "text_completion",
            "created": now(),
            "model": self.served_model_name,
            "choices": choices,
            "usage": usage(outputs),
        }

    def _prompt_text(self, prompt: str | list[int]) -> str:
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)

    def _logprobs(
        self, entries: list[Logprobs] | None, num_top: int | None, text_offset: int
    ) -> tuple[Json | None, int]:
        """OpenAI's legacy logprobs object for `entries` (one per generated token), and the
        offset after them. A token's text_offset is where it starts if the tokens' own texts
        follow the echoed prompt (vLLM's rule), the same in a stream and in a whole response."""
        if entries is None or num_top is None:
            return None, text_offset
        tokens, offsets = [], []
        for entry in entries:
            offsets.append(text_offset)
            tokens.append(self.token_text(entry.sampled_token_id))
            text_offset += len(tokens[-1])
        logprobs = {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [self._top(e, num_top) for e in entries],
            "text_offset": offsets,
        }
        return logprobs, text_offset

    def _top(self, entry: Logprobs, num_top: int) -> dict[str, float]:
        top = {
            self.token_text(t): lp
            for t, lp in zip(entry.top_token_ids[:num_top], entry.top_logprobs[:num_top])
        }
        top.setdefault(self.token_text(entry.sampled_token_id), entry.logprob)
        return top

    # -- stream --------------------------------------------------------------------------------

    async def _stream(
        self,
        request_id: str,
        request: CompletionRequest,
        prompts: list[str | list[int]],
        streams: list[RequestStream],
    ) -> AsyncIterator[str]:
        state = _StreamState()
        try:
            async with aclosing(merge(streams)) as outputs:
                async for i, output in outputs:
                    for chunk in self._chunks(request, prompts[i], i, output, state):
                        yield sse(self._envelope(request_id, request, [chunk]))
            if request.include_usage:
                final = [state.final[i] for i in sorted(state.final)]
                sent = sum(choice.num_tokens for choice in state.choices.values())
                counts = usage(final, completion_tokens=sent)
                yield sse({**self._envelope(request_id, request, []), "usage": counts})
        except Exception as exc:  # the client gets an error event, never a hung stream
            yield sse(error_payload(exc))
        finally:
            close_all(streams)
        yield "[DONE]"

    def _chunks(
        self,
        request: CompletionRequest,
        prompt: str | list[int],
        prompt_index: int,
        output: RequestOutput,
        state: _StreamState,
    ) -> list[Json]:
        if output.finished:
            state.final[prompt_index] = output
        chunks = (self._chunk(request, prompt, prompt_index, c, state) for c in output.outputs)
        return [chunk for chunk in chunks if chunk is not None]

    def _chunk(
        self,
        request: CompletionRequest,
        prompt: str | list[int],
        prompt_index: int,
        completion: CompletionOutput,
        state: _StreamState,
    ) -> Json | None:
        """The chunk of one choice's news (None if it has none); records what was sent."""
        index = prompt_index * request.n + completion.index
        sent = state.choice(index)
        if sent.finished:
            return None
        text, offset = completion.delta_text, sent.text_offset
        if request.echo and not sent.started:
            echoed = self._prompt_text(prompt)
            text, offset = echoed + text, len(echoed)
        new_entries = completion.logprobs or []
        logprobs, offset = self._logprobs(
            new_entries if completion.logprobs is not None else None, request.logprobs, offset
        )
        sent.update(completion, offset)
        if not text and not completion.finished and not new_entries:
            return None
        return _choice(index, text, logprobs, completion)

    def _envelope(self, request_id: str, request: CompletionRequest, choices: list[Json]) -> Json:
        body: Json = {
            "id": request_id,
            "object": "text_completion",
            "created": now(),
            "model": self.served_model_name,
            "choices": choices,
        }
        if request.include_usage:
            body["usage"] = None
        return body


def _choice(index: int, text: str, logprobs: Json | None, completion: CompletionOutput) -> Json:
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": completion.finish_reason,
        "stop_reason": completion.stop_reason,
    }
