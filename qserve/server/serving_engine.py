"""What the completion and chat endpoints share: the model check, adding a batch of requests,
collecting or merging their outputs, usage, and the tokens' texts and bytes logprobs show."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, TypeVar

from qserve.engine.beam_search import BeamSearchParams
from qserve.engine.outputs import OutputAccumulator, RequestOutput
from qserve.engine.sampling_params import SamplingParams
from qserve.server.async_engine import AsyncLLMEngine, EngineDeadError, RequestStream
from qserve.server.limits import RequestLimits
from qserve.server.logprobs import is_byte_level, token_bytes
from qserve.server.protocol import APIError
from qserve.server.responses import ErrorResponse, UsageInfo

Chunk = TypeVar("Chunk")

logger = logging.getLogger("qserve")


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncLLMEngine,
        served_model_name: str,
        limits: RequestLimits | None = None,
        max_tokens_default: int | None = None,
    ) -> None:
        self.engine = engine
        self.served_model_name = served_model_name
        self.limits = limits or RequestLimits()
        self.max_tokens_default = max_tokens_default
        self.tokenizer = engine.hf_tokenizer
        self._token_texts: dict[int, str] = {}
        self._token_bytes: dict[int, list[int]] = {}
        self._byte_level = is_byte_level(self.tokenizer)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise APIError(
                f"The model `{model}` does not exist; this server serves "
                f"`{self.served_model_name}`.",
                status_code=404,
                param="model",
                code="model_not_found",
            )

    async def add_requests(
        self,
        request_id: str,
        prompts: list[str | list[int]],
        params: SamplingParams,
        add_special_tokens: bool = True,
        cache_salt: str | None = None,
        beam: BeamSearchParams | None = None,
    ) -> list[RequestStream]:
        """One engine request per prompt (`{request_id}-{i}`), a beam search of each when
        `beam` is given; all or none are added, and none unless the request is within the
        limits and its sequences fit the queue."""
        self.limits.check_request(len(prompts), params)
        self.engine.check_room(len(prompts) * params.n)
        if params.structured_outputs is not None:  # compiled (and cached) off the engine thread
            manager = self.engine.engine.structured_outputs
            await asyncio.to_thread(manager.compile, params.structured_outputs)
        streams: list[RequestStream] = []
        try:
            for i, prompt in enumerate(prompts):
                sub_id = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                streams.append(
                    await self.engine.add_request(
                        sub_id, prompt, params, add_special_tokens, cache_salt, request_id, beam
                    )
                )
        except BaseException:
            close_all(streams)
            raise
        return streams

    def token_bytes(self, token_id: int) -> list[int]:
        """A token's own bytes, as logprobs' `bytes` show them: a token that is part of a
        character (one byte of an emoji) gives that byte, not the U+FFFD its text decodes to."""
        raw = self._token_bytes.get(token_id)
        if raw is None:
            raw = token_bytes(self.tokenizer, token_id, self._byte_level)
            self._token_bytes[token_id] = raw
        return raw

    def token_text(self, token_id: int) -> str:
        """A token's own text, as logprobs show it (decoded alone, so maybe a partial char)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self._token_texts[token_id] = text
        return text

    def stream_chunk(
        self,
        chunk_type: type[Chunk],
        object_name: str,
        request_id: str,
        include_usage: bool,
        choices: list[Any],
        counts: UsageInfo | None = None,
    ) -> Chunk:
        """A stream chunk of `choices`; it has `usage` (null but in the last one) if asked."""
        usage_field = {"usage": counts} if include_usage else {}
        return chunk_type(
            id=request_id,
            object=object_name,
            created=now(),
            model=self.served_model_name,
            choices=choices,
            **usage_field,
        )


@dataclass
class SSEStream:
    """A streamed response: its SSE payloads, and the requests to abort if it ends early (the
    payload generator may never start when the client is gone before the response)."""

    payloads: AsyncIterator[str]
    streams: list[RequestStream]


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def close_all(streams: list[RequestStream]) -> None:
    for stream in streams:
        stream.close()


async def collect(streams: list[RequestStream]) -> list[RequestOutput]:
    """The final output of each stream; closing (aborting) them all if cancelled."""
    try:
        return list(await asyncio.gather(*(_last(s) for s in streams)))
    finally:
        close_all(streams)


async def _last(stream: RequestStream) -> RequestOutput:
    """The request's whole output, added up from its (DELTA) outputs."""
    total = OutputAccumulator()
    async for output in stream:
        total.add(output)
    return total.result()


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from all streams as they come; closes them all when done. The
    hand-over queue is bounded, so a slow consumer leaves outputs in their streams, which
    coalesce them, rather than piling them up here."""
    queue: asyncio.Queue[tuple[int, RequestOutput | Exception | None]] = asyncio.Queue(
        maxsize=len(streams)
    )

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                await queue.put((i, output))
        except Exception as exc:  # re-raised by the consumer below
            await queue.put((i, exc))
        await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(streams)
    try:
        while remaining:
            i, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item is None:
                remaining -= 1
                continue
            yield i, item
    finally:
        for task in tasks:
            task.cancel()
        close_all(streams)


def usage(outputs: list[RequestOutput], completion_tokens: int | None = None) -> UsageInfo:
    """OpenAI's usage of whole `outputs`; a stream, whose last outputs are deltas, gives the
    completion tokens it counted."""
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    if completion_tokens is None:
        completion_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


def error_payload(exc: Exception) -> ErrorResponse:
    """The error event a stream ends with when its request cannot finish."""
    if isinstance(exc, APIError):
        return exc.response()
    if not isinstance(exc, EngineDeadError):
        logger.exception("a stream failed", exc_info=exc)
    return APIError(str(exc) or repr(exc), status_code=500, type="server_error").response()


def now() -> int:
    return int(time.time())
