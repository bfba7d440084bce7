"""Request bodies of the OpenAI API (the fields we honour), checked strictly, and their errors.

Unknown fields are ignored, as OpenAI's API does; a known field of the wrong type is a 400.
Ranges are checked once, by `SamplingParams`, so the server and `LLM.generate` agree on them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from qserve.engine.beam_search import BeamSearchParams
from qserve.engine.sampling_params import RequestOutputKind, SamplingParams
from qserve.errors import QServeError
from qserve.server.request_fields import (
    ResponseFormat,
    StructuredOutputs,
    check_extra_fields,
    structured_params,
)
from qserve.server.responses import ErrorInfo, ErrorResponse, Json, dump
from qserve.server.tool_protocol import ChatCompletionTool, ToolCallIn, ToolChoice
from qserve.server.tools import tool_choice_constraint

# Most samples one request may ask for: n beyond this is surely a mistake, and costs memory.
MAX_N = 128
# OpenAI's limit on completions' `logprobs`; chat's `top_logprobs` goes to 20.
MAX_COMPLETION_LOGPROBS = 20
# /v1/completions without max_tokens (or with null): vLLM's and OpenAI's default
COMPLETION_MAX_TOKENS = 16

T = TypeVar("T")


class APIError(Exception):
    """An error the client gets as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self,
        message: str,
        status_code: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def response(self) -> ErrorResponse:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info)

    def body(self) -> Json:
        return dump(self.response())

    @classmethod
    def from_qserve(cls, exc: QServeError) -> APIError:
        return cls(str(exc), param=exc.param, code="invalid_value")

    @classmethod
    def from_validation(cls, exc: ValidationError) -> APIError:
        errors = exc.errors(include_url=False)
        first = errors[0]
        if first["type"] == "json_invalid":
            return cls(f"the request body is not valid JSON: {first['msg']}", code="invalid_json")
        param = ".".join(str(part) for part in _field_loc(errors)) or None
        where = f"{param}: " if param else ""
        return cls(f"{where}{first['msg']}", param=param, code="invalid_type")


def _field_loc(errors: list[Any]) -> tuple[int | str, ...]:
    """The field the first error is about. A value that fits no member of a union gets one error
    per member, located `(field, member, ...)`: the field is what those errors have in common."""
    loc = errors[0]["loc"]
    same_field = [e["loc"] for e in errors if e["loc"][:1] == loc[:1]]
    common = 0
    while common < len(loc) and all(
        len(x) > common and x[common] == loc[common] for x in same_field
    ):
        common += 1
    return loc[:common]


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class OpenAIRequest(OpenAIModel):
    """A request body: unknown fields are kept (`model_extra`) to be refused or logged."""

    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class SamplingRequest(OpenAIRequest):
    """The fields /v1/completions and /v1/chat/completions share (vLLM's extras included)."""

    model: str | None = None
    n: int = 1
    best_of: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None  # vLLM's
    bad_words: list[str] | None = None  # vLLM's
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's field: requests share prefix-cache blocks only with requests of the same salt
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's
    use_beam_search: bool = False  # vLLM's: a beam search of n beams, the best n returned
    length_penalty: float = 1.0  # vLLM's, for beam search

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def to_sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        self._check_unsupported()
        check_extra_fields(self.model_extra)
        return SamplingParams(
            n=self.n,
            temperature=_or(self.temperature, 1.0),
            top_p=_or(self.top_p, 1.0),
            top_k=_or(self.top_k, 0),
            min_p=_or(self.min_p, 0.0),
            seed=self.seed,
            presence_penalty=_or(self.presence_penalty, 0.0),
            frequency_penalty=_or(self.frequency_penalty, 0.0),
            repetition_penalty=_or(self.repetition_penalty, 1.0),
            stop=self.stop,
            stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=structured_params(self.response_format, self.structured_outputs),
            logit_bias=_logit_bias(self.logit_bias),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            # the server streams what is new, and adds it up for a whole response
            output_kind=RequestOutputKind.DELTA,
        )

    def beam_search_params(self, params: SamplingParams) -> BeamSearchParams | None:
        """vLLM's beam search: `n` beams, the best n returned, scored with `length_penalty`
        (transformers' search, `qserve.engine.beam_search`); None without use_beam_search.
        What it cannot honour (a stream, logprobs, stops, constraints) is a 400."""
        if not self.use_beam_search:
            return None
        refused = {
            "stream": self.stream,
            "logprobs": params.logprobs is not None or params.prompt_logprobs is not None,
            "stop": bool(params.stop or params.stop_token_ids),
            "min_tokens": params.min_tokens > 0,
            "response_format": params.structured_outputs is not None,
        }
        for name, asked in refused.items():
            if asked:
                raise QServeError(f"{name} is not supported with use_beam_search", param=name)
        return BeamSearchParams(
            beam_width=self.n,
            max_tokens=params.max_tokens or 2**31 - 1,  # None: up to the end of the context
            ignore_eos=self.ignore_eos,
            temperature=_or(self.temperature, 1.0),
            length_penalty=self.length_penalty,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )

    def _check_unsupported(self) -> None:
        if self.n > MAX_N:
            raise QServeError(f"n must be at most {MAX_N}, got {self.n}", param="n")
        if self.best_of is not None and self.best_of != self.n:
            raise QServeError("best_of other than n is not supported", param="best_of")


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = None
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    # vLLM's extra: the top prompt_logprobs of each prompt token, in choices[].prompt_logprobs
    prompt_logprobs: int | None = None

    @property
    def scores_only(self) -> bool:
        """`echo` with `max_tokens: 0`: the prompt (and its logprobs) alone, nothing generated
        (one token is, as in vLLM, and dropped)."""
        return self.echo and self.max_tokens == 0

    def sampling_params(self, default_max_tokens: int | None = None) -> SamplingParams:
        """`default_max_tokens` (the server's --max-tokens-default, else 16) stands in for a
        missing or null max_tokens. `echo` with `logprobs` scores the prompt too (vLLM's rule:
        its prompt logprobs are the echoed tokens' logprobs)."""
        self._check_completion_fields()
        default = _or(default_max_tokens, COMPLETION_MAX_TOKENS)
        max_tokens = 1 if self.scores_only else _or(self.max_tokens, default)
        params = self.to_sampling_params(max_tokens, self.logprobs)
        wanted = [k for k in (self.prompt_logprobs, self.echo_logprobs) if k is not None]
        return replace(params, prompt_logprobs=max(wanted)) if wanted else params

    @property
    def echo_logprobs(self) -> int | None:
        """Top logprobs of each echoed prompt token (None: the echo has no logprobs)."""
        return self.logprobs if self.echo else None

    def _check_completion_fields(self) -> None:
        if self.suffix:
            raise QServeError("suffix is not supported", param="suffix")
        if self.logprobs is not None and self.logprobs > MAX_COMPLETION_LOGPROBS:
            raise QServeError(
                f"logprobs must be at most {MAX_COMPLETION_LOGPROBS}, got {self.logprobs}",
                param="logprobs",
            )
        if self.max_tokens == 0 and not self.echo:
            raise QServeError(
                "max_tokens 0 generates nothing; it is only allowed with echo: true, which "
                "returns the prompt (and its logprobs)",
                param="max_tokens",
            )
        if self.prompt_logprobs is not None and self.stream:
            raise QServeError(
                "prompt_logprobs are not available when stream is true (use echo with logprobs)",
                param="prompt_logprobs",
            )

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts: a string or token ids is a batch of one."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise QServeError("the prompt is empty", param="prompt")
        if isinstance(prompt[0], int):
            return [prompt]  # type: ignore[list-item]
        return list(prompt)  # type: ignore[arg-type]


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # the call a tool message answers

    def template_dict(self) -> dict[str, Any]:
        """What the chat template sees: content parts joined with newlines (as vLLM joins
        them), and the tool fields where given."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        turn: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.tool_calls:
            turn["tool_calls"] = [call.template_dict() for call in self.tool_calls]
        if self.tool_call_id is not None:
            turn["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            turn["name"] = self.name
        return turn


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatCompletionTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True

    def sampling_params(self, default_max_tokens: int | None = None) -> SamplingParams:
        """Without max_completion_tokens / max_tokens: `default_max_tokens` (the server's
        --max-tokens-default), else up to the end of the context, as OpenAI and vLLM. A
        required or named tool choice is enforced by the JSON schema of the tools' arguments."""
        if self.top_logprobs is not None and not self.logprobs:
            raise QServeError("top_logprobs needs logprobs: true", param="top_logprobs")
        if self.add_generation_prompt and self.continue_final_message:
            raise QServeError(
                "continue_final_message and add_generation_prompt cannot both be true",
                param="continue_final_message",
            )
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = _or(_or(self.max_completion_tokens, self.max_tokens), default_max_tokens)
        params = self.to_sampling_params(max_tokens, logprobs)
        constraint = tool_choice_constraint(
            self.tools or [], self.tool_choice, self.parallel_tool_calls
        )
        if constraint is None:
            return params
        if params.structured_outputs is not None:
            raise QServeError(
                "a required or named tool_choice cannot be combined with response_format or "
                "structured_outputs",
                param="tool_choice",
            )
        return replace(params, structured_outputs=constraint)

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        return [tool.template_dict() for tool in self.tools] if self.tools else None


class TokenizeRequest(OpenAIModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    tools: list[ChatCompletionTool] | None = None  # rendered by the chat template, as in chat
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]


def _or(value: T | None, default: T) -> T:
    return default if value is None else value


def _logit_bias(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias, keyed by token ids written as strings of decimal digits."""
    if logit_bias is None:
        return None
    for key in logit_bias:
        if not (key.isascii() and key.removeprefix("-").isdigit()):
            raise QServeError(
                f"logit_bias keys must be token ids (integers), got {key!r}", param="logit_bias"
            )
    return {int(key): bias for key, bias in logit_bias.items()}
