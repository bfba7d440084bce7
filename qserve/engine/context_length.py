"""Whether a request fits the model's context: one check, one set of messages, for the engine
and the server."""

from __future__ import annotations

from qserve.engine.sampling_params import SamplingParams
from qserve.errors import ContextLengthError


def check_context_length(
    num_prompt_tokens: int,
    params: SamplingParams,
    max_model_len: int,
    max_tokens_must_fit: bool = False,
) -> None:
    """The prompt leaves room for output, and for min_tokens. With `max_tokens_must_fit` (the
    server, as OpenAI's API) max_tokens must fit too; otherwise (`LLM.generate`, as vLLM's) the
    output stops at the end of the context."""
    max_tokens, min_tokens = params.max_tokens, params.min_tokens
    if num_prompt_tokens >= max_model_len:
        raise ContextLengthError(
            f"This model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{num_prompt_tokens} tokens, which leaves no room for output.",
            param="prompt",
        )
    too_long = max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len
    if max_tokens_must_fit and too_long:
        raise ContextLengthError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
            f"prompt, {max_tokens} for the completion). Please reduce the prompt or max_tokens.",
            param="max_tokens",
        )
    if num_prompt_tokens + min_tokens > max_model_len:
        raise ContextLengthError(
            f"min_tokens={min_tokens} does not fit: the prompt has {num_prompt_tokens} tokens "
            f"and this model's maximum context length is {max_model_len} tokens.",
            param="min_tokens",
        )
