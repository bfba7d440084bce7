"""Response bodies of the OpenAI API (vLLM's names), beside protocol.py's request bodies.

A whole response (`dump`) has every field, `null` included. A stream chunk (`sse`) has the
fields it was given (`exclude_unset`, as vLLM's chunks): the role chunk has no `stop_reason`,
a delta only what it adds, and `usage` (null but in the last chunk) is there only when the
client asked for it. Both serialize with `json`, not pydantic's serializer, whose floats are
spelled otherwise (1e-5 for json's 1e-05). The server builds them with their constructors:
for models this small pydantic's compiled validation costs less than `model_construct`.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

Json = dict[str, Any]


class OpenAIResponse(BaseModel):
    """protocol.OpenAIModel's sibling: lax, and keeping any extra field it is given."""

    model_config = ConfigDict(extra="allow")


def dump(response: BaseModel) -> Json:
    """A whole response as the dict JSONResponse sends (every field)."""
    return response.model_dump()


def sse(chunk: BaseModel) -> str:
    """One stream chunk as an SSE `data:` payload, the fields it was given (EventSourceResponse
    adds the framing)."""
    payload = chunk.model_dump(exclude_unset=True)
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


# -- shared ---------------------------------------------------------------------------------------


class UsageInfo(OpenAIResponse):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ErrorInfo(OpenAIResponse):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(OpenAIResponse):
    """Every 4xx/5xx body, and the event a stream ends with when its request fails."""

    error: ErrorInfo


# -- /v1/models, /tokenize, /detokenize -----------------------------------------------------------


class ModelCard(OpenAIResponse):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "qserve"
    root: str
    max_model_len: int


class ModelList(OpenAIResponse):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(OpenAIResponse):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(OpenAIResponse):
    prompt: str


# -- /v1/completions ------------------------------------------------------------------------------


class CompletionLogProbs(OpenAIResponse):
    """OpenAI's legacy logprobs: one column per field, a row per token (an echoed prompt's
    first token has null logprobs: nothing comes before it)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(OpenAIResponse):
    """vLLM's prompt-logprob entry: one of a prompt position's likely tokens."""

    logprob: float
    rank: int
    decoded_token: str


class CompletionResponseChoice(OpenAIResponse):
    """A choice of a whole response, and of a stream chunk (text: what is new)."""

    index: int
    text: str
    logprobs: CompletionLogProbs | None
    finish_reason: str | None
    stop_reason: int | str | None
    # vLLM's: per prompt token (the first null), token id -> its entry (the prompt token and
    # the top prompt_logprobs); whole responses only
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class CompletionResponse(OpenAIResponse):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionStreamResponse(OpenAIResponse):
    id: str
    object: Literal["text_completion"]  # no default: a chunk has only the fields it is given
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None  # left out unless given


# -- /v1/chat/completions -------------------------------------------------------------------------


class ChatCompletionLogProb(OpenAIResponse):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    """A generated token's logprob, and the most likely tokens in its place."""

    top_logprobs: list[ChatCompletionLogProb]


class ChatCompletionLogProbs(OpenAIResponse):
    content: list[ChatCompletionLogProbsContent]


class FunctionCall(OpenAIResponse):
    name: str
    arguments: str  # JSON text


class ToolCall(OpenAIResponse):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(OpenAIResponse):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIResponse):
    """A stream's piece of a tool call: the first has its id, type and name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ChatCompletionMessage(OpenAIResponse):
    """The assistant's message of a whole response (vLLM's ChatMessage)."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] = []


class ChatCompletionResponseChoice(OpenAIResponse):
    index: int
    message: ChatCompletionMessage
    logprobs: ChatCompletionLogProbs | None
    finish_reason: str | None
    stop_reason: int | str | None


class ChatCompletionResponse(OpenAIResponse):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo


class DeltaMessage(OpenAIResponse):
    """What a chat stream chunk adds to its choice's message: only the fields given."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionResponseStreamChoice(OpenAIResponse):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None
    finish_reason: str | None
    stop_reason: int | str | None = None  # left out of the role chunk


class ChatCompletionStreamResponse(OpenAIResponse):
    id: str
    object: Literal["chat.completion.chunk"]  # no default: a chunk has only the fields given
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None  # left out unless given
