"""What one request may ask of the server, so that no client can make it hoard memory or time.

Each limit is a 4xx naming the parameter, checked before the work it bounds: the body size
before the body is read (413), the number of prompts and of sequences (prompts x n) and the
stop strings once the body is parsed, a text prompt's length before it is tokenized (every token
covers at most the longest token's number of characters, so a longer text cannot fit the
context). The queue itself counts sequences (`AsyncLLMEngine`), not HTTP requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from qserve.engine.sampling_params import SamplingParams
from qserve.errors import QServeError
from qserve.server.protocol import APIError

if TYPE_CHECKING:  # the CLI builds its options from RequestLimits without the server packages
    from starlette.requests import Request

MIB = 2**20


def _limit(default: int, flag: str, help: str, kind: str = "count") -> Any:
    """A limit's field; its `qserve serve` option is made from this metadata (cli.py)."""
    return field(default=default, metadata={"flag": flag, "help": help, "kind": kind})


@dataclass(frozen=True)
class RequestLimits:
    max_body_bytes: int = _limit(
        8 * MIB, "--max-request-body", "Largest request body (e.g. 8MiB); larger gets 413.", "bytes"
    )
    max_prompts: int = _limit(
        256, "--max-prompts-per-request", "Prompts in one /v1/completions request."
    )
    max_seqs: int = _limit(
        256, "--max-seqs-per-request", "Sequences (prompts x n) one request may ask for."
    )
    max_stop_strings: int = _limit(64, "--max-stop-strings", "Stop strings in one request.")
    max_stop_chars: int = _limit(
        4096, "--max-stop-chars", "Characters of all of a request's stop strings together."
    )

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value < 1:
                raise QServeError(f"{name} must be >= 1, got {value}", param=name)

    def check_request(self, num_prompts: int, params: SamplingParams) -> None:
        """Prompts, sequences and stop strings of a parsed request."""
        if num_prompts > self.max_prompts:
            raise QServeError(
                f"{num_prompts} prompts in one request; at most {self.max_prompts}", "prompt"
            )
        if num_prompts * params.n > self.max_seqs:
            raise QServeError(
                f"{num_prompts} prompts x n={params.n} is {num_prompts * params.n} sequences; "
                f"one request may ask for at most {self.max_seqs}",
                param="n",
            )
        if len(params.stop) > self.max_stop_strings:
            raise QServeError(f"at most {self.max_stop_strings} stop strings", param="stop")
        if sum(len(s) for s in params.stop) > self.max_stop_chars:
            raise QServeError(
                f"the stop strings have more than {self.max_stop_chars} characters", "stop"
            )

    async def read_body(self, request: Request) -> bytes:
        """The body, refused with a 413 once it exceeds max_body_bytes (declared or sent)."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            raise self._too_large()
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise self._too_large()
            chunks.append(chunk)
        return b"".join(chunks)

    def _too_large(self) -> APIError:
        return APIError(
            f"the request body is larger than {self.max_body_bytes} bytes",
            status_code=413,
            param="body",
            code="request_too_large",
        )


def check_text_length(text: str, max_model_len: int, max_token_chars: int) -> None:
    """Refuse, before tokenizing it, a text too long to be `max_model_len` tokens."""
    if len(text) > max_model_len * max_token_chars:
        raise QServeError(
            f"the prompt has {len(text)} characters, more than this model's context of "
            f"{max_model_len} tokens can hold",
            param="prompt",
        )
