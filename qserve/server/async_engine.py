"""The engine behind asyncio.

`LLMEngine` is not thread-safe, so one thread owns it: it runs every call that the event loop posts
to its inbox (add, abort), then steps the engine, and hands each step's outputs back to the loop,
which routes them to per-request queues. Everything that touches the engine runs on that thread;
prompts are tokenized before, on the tokenizer worker's thread (`tokenizer_worker`), so a long
prompt stalls neither the loop nor the steps. The loop only awaits.

    event loop                                       engine thread
    add_request() --(tokenizer thread: encode)-->
                  --(inbox: call)-->                 check, engine.add_request
                  <--(future)--------
    RequestStream <--(call_soon_threadsafe)-- engine.step() -> list[RequestOutput]
    stream closed --(inbox: abort)-->   engine.abort_request (frees the blocks)
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from qserve.engine.beam_search import BeamSearchParams
from qserve.engine.context_length import check_context_length
from qserve.engine.llm_engine import LLMEngine
from qserve.engine.outputs import RequestOutput, coalesce
from qserve.engine.sampling_params import SamplingParams
from qserve.errors import QServeError
from qserve.parallel.workers import WorkerDiedError
from qserve.server.limits import check_text_length
from qserve.server.tokenizer_worker import TokenizerWorker

logger = logging.getLogger("qserve")

T = TypeVar("T")
IDLE_STEP_SLEEP_S = 0.001
EngineCall = Callable[[LLMEngine], Any]


class EngineDeadError(RuntimeError):
    """The engine failed or is shutting down; the request cannot finish."""


class QueueFullError(RuntimeError):
    """More sequences are in flight than the server admits (--max-queue)."""


class StepObserver:
    """Called on the engine thread: after each step with its outputs, and on each abort."""

    def on_step(self, outputs: list[RequestOutput]) -> None:
        pass

    def on_abort(self, request_id: str) -> None:
        pass


class RequestStream:
    """The outputs of one request, in order; iterating ends after the finished output.

    Outputs the reader has not taken yet are coalesced into one (`coalesce`): a client that
    reads slowly gets its text in larger pieces, and the server holds one output for it, not a
    backlog that grows with every step."""

    def __init__(self, request_id: str, engine: AsyncLLMEngine, num_seqs: int = 1) -> None:
        self.request_id = request_id
        self.num_seqs = num_seqs  # the request's n: the sequences it holds in the engine
        self.finished = False
        self._pending: deque[RequestOutput | BaseException] = deque()
        self._ready = asyncio.Event()
        self._engine = engine

    def put(self, item: RequestOutput | BaseException) -> None:
        last = self._pending[-1] if self._pending else None
        if isinstance(item, RequestOutput) and isinstance(last, RequestOutput):
            self._pending[-1] = coalesce(last, item)
        else:
            self._pending.append(item)
        self._ready.set()

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            if not self._pending:
                self._ready.clear()
                await self._ready.wait()
                continue
            item = self._pending.popleft()
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            self.finished = item.finished
            yield item

    def close(self) -> None:
        """Abort the request unless it finished (a client went away); idempotent."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


class AsyncLLMEngine:
    def __init__(
        self,
        engine: LLMEngine,
        max_num_seqs: int | None = None,
        observer: StepObserver | None = None,
    ) -> None:
        self.engine = engine
        self.max_num_seqs = max_num_seqs  # sequences in flight, running or waiting
        self.observer = observer or StepObserver()
        self.tokenizer = TokenizerWorker(engine.tokenizer)
        self.stats = engine.get_stats()
        self._inbox: queue.SimpleQueue[EngineCall | None] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # touched on the loop thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.draining = False  # shutting down: no new requests
        self.fatal_error: str | None = None  # why the engine can run no more steps, if so
        self.on_fatal: Callable[[str], None] | None = None  # the server's exit, when fatal

    # -- lifecycle (event loop) ----------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="qserve-engine", daemon=True)
        self._thread.start()

    # -- what the server reads of the engine (fixed once it is built) ----------------------------

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    @property
    def model_path(self) -> str | None:
        """The model the engine was asked for (None: the built-in default)."""
        return self.engine.config.model

    @property
    def hf_tokenizer(self) -> Any:
        """The engine's tokenizer, for token -> text lookups on the event loop (encoding goes
        through `tokenize`, on the tokenizer thread)."""
        return self.engine.tokenizer

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def num_requests(self) -> int:
        return len(self._streams)

    @property
    def num_seqs(self) -> int:
        return sum(stream.num_seqs for stream in self._streams.values())

    def check_room(self, num_seqs: int) -> None:
        """QueueFullError unless `num_seqs` more sequences fit (--max-queue counts sequences);
        a request larger than the whole queue could never fit: a QServeError (400)."""
        if self.max_num_seqs is not None and num_seqs > self.max_num_seqs:
            raise QServeError(
                f"this request asks for {num_seqs} sequences (prompts x n); the server holds at "
                f"most {self.max_num_seqs} at a time",
                param="n",
            )
        if self.max_num_seqs is not None and self.num_seqs + num_seqs > self.max_num_seqs:
            raise QueueFullError(
                f"{self.num_seqs} sequences are in flight and this request adds {num_seqs}; "
                "try again later"
            )

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; requests still in flight end with EngineDeadError."""
        self._stopping = True
        self._inbox.put(None)
        self.tokenizer.shutdown()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)
        self._fail_all(EngineDeadError("the server is shutting down"))

    # -- requests (event loop) -----------------------------------------------------------------

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the engine thread before its next step; return its result."""
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")
        assert self._loop is not None
        future: asyncio.Future[T] = self._loop.create_future()
        self._inbox.put(lambda engine: self._resolve(future, fn, engine))
        return await future

    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        add_special_tokens: bool = True,
        cache_salt: str | None = None,
        group: str | None = None,
        beam: BeamSearchParams | None = None,
    ) -> RequestStream:
        """Tokenize and check the prompt, queue the request (a beam search with `beam`, whose
        one output is final); QServeError for bad input."""
        if self.draining:
            raise EngineDeadError("the server is shutting down")
        self.check_room(params.n)
        stream = RequestStream(request_id, self, params.n)
        self._streams[request_id] = stream
        arrival = time.monotonic()
        try:
            prompt_ids = await self.tokenize(prompt, add_special_tokens)
            check_context_length(len(prompt_ids), params, self.engine.max_model_len, True)
            if beam is not None:
                await self.call(
                    lambda engine: engine.add_beam_search_request(
                        request_id, prompt_ids, beam, arrival, cache_salt
                    )
                )
            else:
                await self.call(
                    lambda engine: engine.add_request(
                        request_id, prompt_ids, params, arrival, cache_salt, group
                    )
                )
        except BaseException:
            self._streams.pop(request_id, None)
            stream.finished = True
            self.abort(request_id)  # no-op unless cancelled after the add ran
            raise
        return stream

    async def tokenize(self, prompt: str | list[int], add_special_tokens: bool) -> list[int]:
        """A text prompt's token ids, on the tokenizer thread; one too long for the context
        is refused before it is tokenized. Token ids are returned as they are."""
        if not isinstance(prompt, str):
            return prompt
        check_text_length(prompt, self.engine.max_model_len, self.tokenizer.max_token_chars)
        return await self.tokenizer.encode(prompt, add_special_tokens)

    def cut_all(self, message: str) -> None:
        """End every request in flight now: each stream raises EngineDeadError(message) (a
        streamed response then ends with an error event and [DONE]) and the engine frees their
        blocks. New requests are refused from here on (`draining`)."""
        self.draining = True
        request_ids = list(self._streams)
        self._fail_all(EngineDeadError(message))
        for request_id in request_ids:
            self._inbox.put(lambda engine, r=request_id: self._abort_now(engine, r))

    def fail(self, message: str) -> None:
        """The engine can run no more steps (a parallel worker died): stop it, end every
        request in flight with `message`, and call `on_fatal` once. Any thread; idempotent."""
        if self.fatal_error is not None:
            return
        self.fatal_error = message
        logger.error("%s", message)
        self._stopping = True
        self._inbox.put(None)
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.cut_all, message)
        if self.on_fatal is not None:
            self.on_fatal(message)

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._inbox.put(lambda engine: self._abort_now(engine, request_id))

    # -- the engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._drain_inbox(block=not self.engine.has_unfinished_requests())
                if not self._stopping and self.engine.has_unfinished_requests():
                    self._step()
                self.stats = self.engine.get_stats()
        finally:  # stopped, or died: no stream may wait for outputs that will never come
            self._abort_all()
            self.stats = self.engine.get_stats()
            self._post(self._fail_all, EngineDeadError("the engine stopped"))

    def _drain_inbox(self, block: bool) -> None:
        call = self._inbox.get() if block else self._next_call()
        while call is not None:
            try:
                call(self.engine)
            except Exception:  # calls report their own errors; this is a bug, keep serving
                logger.exception("engine call failed")
            call = self._next_call()

    def _next_call(self) -> EngineCall | None:
        try:
            return self._inbox.get_nowait()
        except queue.Empty:
            return None

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except WorkerDiedError as exc:  # no step can run any more: the server exits
            self.fail(str(exc))
            return
        except Exception as exc:  # a bug, not bad input: fail what is in flight, keep serving
            logger.exception("engine step failed; aborting the requests in flight")
            self._abort_all()
            self._post(self._fail_all, EngineDeadError(f"engine step failed: {exc!r}"))
            return
        self.observer.on_step(outputs)
        if outputs:
            self._post(self._deliver, outputs)
        else:  # a prompt chunk, or nothing schedulable: let the event loop have the GIL
            time.sleep(IDLE_STEP_SLEEP_S)

    def _abort_now(self, engine: LLMEngine, request_id: str) -> None:
        engine.abort_request(request_id)
        self.observer.on_abort(request_id)

    def _abort_all(self) -> None:
        for request_id in self.engine.request_ids():
            self._abort_now(self.engine, request_id)

    def _resolve(
        self, future: asyncio.Future[T], fn: Callable[[LLMEngine], T], engine: Any
    ) -> None:
        try:
            result = fn(engine)
        except Exception as exc:  # handed to the awaiting coroutine
            self._post(_set_exception, future, exc)
            return
        self._post(_set_result, future, result)

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fn, *args)

    # -- back on the event loop ----------------------------------------------------------------

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            stream.put(output)
            if output.finished:
                del self._streams[output.request_id]

    def _fail_all(self, exc: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.put(exc)


def _set_result(future: asyncio.Future[T], result: T) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
