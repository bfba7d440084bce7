"""POST /v1/chat/completions: messages through the tokenizer's chat template, then generate."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

from qserve.engine.outputs import CompletionOutput, RequestOutput
from qserve.engine.sampler import Logprobs
from qserve.server.async_engine import AsyncLLMEngine, RequestStream
from qserve.server.limits import RequestLimits, check_text_length
from qserve.server.logprobs import chat_logprobs
from qserve.server.protocol import APIError, ChatCompletionRequest, ChatMessage
from qserve.server.responses import (
    ChatCompletionLogProbs,
    ChatCompletionMessage,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    DeltaMessage,
    FunctionCall,
    ToolCall,
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
from qserve.server.tokenizer_worker import ChatTemplateArgs
from qserve.server.tool_parsers import ToolParser
from qserve.server.tool_stream import ToolStream
from qserve.server.tools import call_id, effective_choice, read_output

CHUNK = "chat.completion.chunk"


class OpenAIServingChat(OpenAIServing):
    def __init__(
        self,
        engine: AsyncLLMEngine,
        served_model_name: str,
        limits: RequestLimits | None = None,
        max_tokens_default: int | None = None,
        special_tokens_in_content: bool = False,
        chat_template: str | None = None,
        tool_parser: ToolParser | None = None,
    ) -> None:
        super().__init__(engine, served_model_name, limits, max_tokens_default)
        # Text like <|im_end|> in a message is parsed as the special token (off: plain text)
        self.special_tokens_in_content = special_tokens_in_content
        self.chat_template = chat_template  # --chat-template: overrides the model's
        self.tool_parser = tool_parser  # --enable-auto-tool-choice --tool-call-parser

    async def create(self, request: ChatCompletionRequest) -> ChatCompletionResponse | SSEStream:
        self.check_model(request.model)
        params = request.sampling_params(self.max_tokens_default)
        beam = request.beam_search_params(params)
        choice = effective_choice(request.tools or [], request.tool_choice)
        if choice == "auto" and self.tool_parser is None:
            raise APIError(
                '"auto" tool choice (the default when tools are given) needs the server to run '
                "with --enable-auto-tool-choice and --tool-call-parser",
                param="tool_choice",
            )
        template = ChatTemplateArgs(
            request.template_tools,
            self.chat_template,
            request.chat_template_kwargs or {},
            request.continue_final_message,
        )
        prompt_ids = await self.prompt_ids(
            request.messages, request.add_generation_prompt, template
        )
        request_id = random_id("chatcmpl")
        streams = await self.add_requests(
            request_id, [prompt_ids], params, cache_salt=request.cache_salt, beam=beam
        )
        if request.stream:
            return SSEStream(self._stream(request_id, request, streams), streams)
        (output,) = await collect(streams)
        return self._response(request_id, request, output)

    async def prompt_ids(
        self,
        messages: list[ChatMessage],
        generation_prompt: bool,
        template: ChatTemplateArgs | None = None,
    ) -> list[int]:
        """The chat template's prompt as token ids (its own special tokens included, so none
        are added), refused before rendering when the messages alone overflow the context."""
        worker = self.engine.tokenizer
        text = "".join(m.template_dict()["content"] for m in messages)
        check_text_length(text, self.engine.max_model_len, worker.max_token_chars)
        template = template or ChatTemplateArgs(chat_template=self.chat_template)
        return await worker.chat_token_ids(
            messages, generation_prompt, self.special_tokens_in_content, template
        )

    # -- whole response ------------------------------------------------------------------------

    def _response(
        self, request_id: str, request: ChatCompletionRequest, output: RequestOutput
    ) -> ChatCompletionResponse:
        choices = []
        for c in output.outputs:
            read = read_output(c.text, request.tools or [], request.tool_choice, self.tool_parser,
                               c.finish_reason, request.parallel_tool_calls)  # fmt: skip
            calls = [ToolCall(id=call_id(), function=FunctionCall(name=t.name,
                                                                  arguments=t.arguments))
                     for t in read.calls]  # fmt: skip
            message = ChatCompletionMessage(content=read.content, tool_calls=calls)
            choices.append(ChatCompletionResponseChoice(
                index=c.index, message=message, logprobs=self._logprobs(c.logprobs, request),
                finish_reason=read.finish_reason, stop_reason=c.stop_reason,
            ))  # fmt: skip
        return ChatCompletionResponse(
            id=request_id,
            object="chat.completion",
            created=now(),
            model=self.served_model_name,
            choices=choices,
            usage=usage([output]),
        )

    def _logprobs(
        self, entries: list[Logprobs] | None, request: ChatCompletionRequest
    ) -> ChatCompletionLogProbs | None:
        num_top = request.top_logprobs or 0
        return chat_logprobs(entries, num_top, self.token_text, self.token_bytes)

    # -- stream --------------------------------------------------------------------------------

    async def _stream(
        self, request_id: str, request: ChatCompletionRequest, streams: list[RequestStream]
    ) -> AsyncIterator[str]:
        sent_tokens = [0] * request.n
        finished = [False] * request.n
        tools = (request.tools or [], request.tool_choice, self.tool_parser)
        tool_streams = [ToolStream(*tools, request.parallel_tool_calls) for _ in range(request.n)]
        final: RequestOutput | None = None
        try:
            for index in range(request.n):
                yield sse(self._envelope(request_id, request, [_role_chunk(index)]))
            async with aclosing(merge(streams)) as outputs:
                async for _, output in outputs:
                    chunks = self._chunks(request, output, sent_tokens, finished, tool_streams)
                    for chunk in chunks:
                        yield sse(self._envelope(request_id, request, [chunk]))
                    final = output if output.finished else final
            if request.include_usage and final is not None:
                counts = usage([final], completion_tokens=sum(sent_tokens))
                yield sse(self._envelope(request_id, request, [], counts))
        except Exception as exc:  # the client gets an error event, never a hung stream
            yield sse(error_payload(exc))
        finally:
            close_all(streams)
        yield "[DONE]"

    def _chunks(
        self,
        request: ChatCompletionRequest,
        output: RequestOutput,
        sent_tokens: list[int],
        finished: list[bool],
        tool_streams: list[ToolStream],
    ) -> list[ChatCompletionResponseStreamChoice]:
        """The chunks of the choices that moved; updates what was sent of each."""
        chunks = []
        for c in output.outputs:
            if finished[c.index]:
                continue
            chunk = self._chunk(request, c, tool_streams[c.index])
            sent_tokens[c.index] += len(c.token_ids)  # a DELTA output: the new tokens
            finished[c.index] = c.finished
            if chunk is not None:
                chunks.append(chunk)
        return chunks

    def _chunk(
        self, request: ChatCompletionRequest, c: CompletionOutput, tools: ToolStream
    ) -> ChatCompletionResponseStreamChoice | None:
        new_entries = c.logprobs or []
        logprobs = self._logprobs(new_entries, request) if c.logprobs is not None else None
        delta, finish_reason = tools.feed(c.delta_text, c.finished, c.finish_reason)
        if delta is None and not c.finished and not new_entries:
            return None
        return ChatCompletionResponseStreamChoice(
            index=c.index,
            delta=delta or DeltaMessage(),
            logprobs=logprobs,
            finish_reason=finish_reason,
            stop_reason=c.stop_reason,
        )

    def _envelope(
        self,
        request_id: str,
        request: ChatCompletionRequest,
        choices: list[ChatCompletionResponseStreamChoice],
        counts: UsageInfo | None = None,
    ) -> ChatCompletionStreamResponse:
        """A chunk of `choices`; it has `usage` (null but in the last one) if it was asked."""
        return self.stream_chunk(
            ChatCompletionStreamResponse, CHUNK, request_id, request.include_usage, choices, counts
        )


def _role_chunk(index: int) -> ChatCompletionResponseStreamChoice:
    """The first chunk of each choice: the role, and no stop_reason."""
    return ChatCompletionResponseStreamChoice(
        index=index,
        delta=DeltaMessage(role="assistant", content=""),
        logprobs=None,
        finish_reason=None,
    )
