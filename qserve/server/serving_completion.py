"""POST /v1/completions: text in, text out; a list of prompts is a batch."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field, replace

from qserve.engine.outputs import CompletionOutput, RequestOutput
from qserve.server.async_engine import RequestStream
from qserve.server.logprobs import (
    completion_logprobs,
    echo_logprobs,
    joined,
    prompt_logprobs_field,
)
from qserve.server.protocol import CompletionRequest
from qserve.server.responses import (
    CompletionLogProbs,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    PromptLogprob,
    UsageInfo,
    sse,
)
from qserve.server.serving_engine import (
    OpenAIServing,
    SSEStream,
    close_all,
    collect,
    error_payload,
    merge,
    now,
    random_id,
    usage,
)

OBJECT = "text_completion"


@dataclass
class _ChoiceState:
    """What a stream has sent of one choice so far."""

    started: bool = False
    num_tokens: int = 0
    text_offset: int = 0  # of the next token's logprobs entry (see `completion_logprobs`)
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
    first: dict[int, RequestOutput] = field(default_factory=dict)  # each prompt's, if scored

    def choice(self, index: int) -> _ChoiceState:
        return self.choices.setdefault(index, _ChoiceState())


@dataclass(frozen=True)
class _Echo:
    """The echoed prompt a choice starts with: its text, its tokens' logprobs (with echo and
    logprobs) and the text offset of the token after it."""

    text: str
    logprobs: CompletionLogProbs | None
    offset: int


class OpenAIServingCompletion(OpenAIServing):
    async def create(self, request: CompletionRequest) -> CompletionResponse | SSEStream:
        self.check_model(request.model)
        params = request.sampling_params(self.max_tokens_default)
        beam = request.beam_search_params(params)
        prompts = request.prompts()
        request_id = random_id("cmpl")
        streams = await self.add_requests(
            request_id, prompts, params, cache_salt=request.cache_salt, beam=beam
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
    ) -> CompletionResponse:
        choices = []
        for i, output in enumerate(outputs):
            echo = self._echo(request, prompts[i], output)
            field = self._prompt_logprobs_field(request, output)
            for completion in output.outputs:
                index = i * request.n + completion.index
                choice = self._choice(request, index, echo, completion)
                choice.prompt_logprobs = field
                choices.append(choice)
        completion_tokens = 0 if request.scores_only else None
        return CompletionResponse(
            id=request_id,
            object=OBJECT,
            created=now(),
            model=self.served_model_name,
            choices=choices,
            usage=usage(outputs, completion_tokens),
        )

    def _echo(
        self,
        request: CompletionRequest,
        prompt: str | list[int],
        output: RequestOutput | None = None,
    ) -> _Echo:
        """What a choice starts with: nothing, or (echo) the prompt's text and, with logprobs,
        its tokens' logprobs (`output`: the request's first output, which has them)."""
        if not request.echo:
            return _Echo("", None, 0)
        text = self._prompt_text(prompt)
        k = request.echo_logprobs
        if k is None:
            return _Echo(text, None, len(text))
        assert output is not None and output.prompt_logprobs is not None
        columns, offset = echo_logprobs(
            output.prompt_token_ids, output.prompt_logprobs, k, self.token_text
        )
        return _Echo(text, columns, offset)

    def _prompt_logprobs_field(
        self, request: CompletionRequest, output: RequestOutput
    ) -> list[dict[str, PromptLogprob] | None] | None:
        if request.prompt_logprobs is None or output.prompt_logprobs is None:
            return None
        return prompt_logprobs_field(output.prompt_logprobs, request.prompt_logprobs,
                                     self.token_text)  # fmt: skip

    def _choice(
        self, request: CompletionRequest, index: int, echo: _Echo, completion: CompletionOutput
    ) -> CompletionResponseChoice:
        """A whole choice: `echo`, then the completion's text and logprobs (none of them with
        max_tokens 0)."""
        completion = _scored_only(request, completion)
        logprobs, _ = completion_logprobs(
            completion.logprobs, request.logprobs, echo.offset, self.token_text
        )
        text = echo.text + completion.text
        return _choice(index, text, joined(echo.logprobs, logprobs), completion)

    def _prompt_text(self, prompt: str | list[int]) -> str:
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)

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
                yield sse(self._envelope(request_id, request, [], counts))
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
    ) -> list[CompletionResponseChoice]:
        if output.finished:
            state.final[prompt_index] = output
        if output.prompt_logprobs is not None:  # a DELTA request's first output has them
            state.first.setdefault(prompt_index, output)
        chunks = (self._chunk(request, prompt, prompt_index, c, state) for c in output.outputs)
        return [chunk for chunk in chunks if chunk is not None]

    def _chunk(
        self,
        request: CompletionRequest,
        prompt: str | list[int],
        prompt_index: int,
        completion: CompletionOutput,
        state: _StreamState,
    ) -> CompletionResponseChoice | None:
        """The chunk of one choice's news (None if it has none); records what was sent. A
        choice's first chunk starts with the echo, if asked."""
        index = prompt_index * request.n + completion.index
        sent = state.choice(index)
        if sent.finished:
            return None
        completion = _scored_only(request, completion)
        text, offset, head = completion.delta_text, sent.text_offset, None
        if request.echo and not sent.started:
            first = state.first.get(prompt_index)
            echo = self._echo(request, prompt, first) if first else self._echo(request, prompt)
            text, offset, head = echo.text + text, echo.offset, echo.logprobs
        logprobs, offset = completion_logprobs(
            completion.logprobs, request.logprobs, offset, self.token_text
        )
        sent.update(completion, offset)
        if not text and not completion.finished and not completion.logprobs and head is None:
            return None
        return _choice(index, text, joined(head, logprobs), completion)

    def _envelope(
        self,
        request_id: str,
        request: CompletionRequest,
        choices: list[CompletionResponseChoice],
        counts: UsageInfo | None = None,
    ) -> CompletionStreamResponse:
        """A chunk of `choices`; it has `usage` (null but in the last one) if it was asked."""
        return self.stream_chunk(
            CompletionStreamResponse, OBJECT, request_id, request.include_usage, choices, counts
        )


def _scored_only(request: CompletionRequest, completion: CompletionOutput) -> CompletionOutput:
    """With max_tokens 0 the one token generated (vLLM generates one too) is dropped."""
    if not request.scores_only:
        return completion
    logprobs = [] if completion.logprobs is not None else None
    return replace(completion, text="", delta_text="", token_ids=[], delta_token_ids=[],
                   logprobs=logprobs)  # fmt: skip


def _choice(
    index: int, text: str, logprobs: CompletionLogProbs | None, completion: CompletionOutput
) -> CompletionResponseChoice:
    return CompletionResponseChoice(
        index=index,
        text=text,
        logprobs=logprobs,
        finish_reason=completion.finish_reason,
        stop_reason=completion.stop_reason,
    )
