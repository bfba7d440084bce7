"""The OpenAI-compatible HTTP server: FastAPI routes over one AsyncLLMEngine, run by uvicorn."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from sse_starlette import EventSourceResponse
from sse_starlette.sse import SendTimeoutError
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from qserve.engine.llm_engine import LLMEngine
from qserve.errors import ContextLengthError, QServeError
from qserve.server.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    QueueFullError,
)
from qserve.server.limits import RequestLimits
from qserve.server.metrics import ServerMetrics, StatLogger
from qserve.server.playground import add_playground_routes, add_server_info_route
from qserve.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from qserve.server.responses import (
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
    dump,
)
from qserve.server.security import (
    HostCheckMiddleware,
    allowed_hosts,
    check_bearer,
    check_json_content_type,
    cors_middleware,
    parse_origins,
)
from qserve.server.serving_chat import OpenAIServingChat
from qserve.server.serving_completion import OpenAIServingCompletion
from qserve.server.serving_engine import SSEStream, close_all, now
from qserve.server.tokenizer_worker import ChatTemplateArgs
from qserve.server.tool_parsers import tool_parser

logger = logging.getLogger("qserve")

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")
# A client that went away before its (non-streamed) response: nginx's "client closed request".
CLIENT_CLOSED_REQUEST = 499


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    # With an API key, /metrics needs it too (its counters tell what other clients' prompts hit
    # in the prefix cache) unless this is set; /health never needs it.
    metrics_public: bool = False
    max_queue: int = 1024  # sequences admitted beyond max_num_seqs; more get 429
    drain_timeout: float = 30.0  # seconds a shutdown waits for requests in flight
    ping_interval: float = 15.0  # seconds between SSE keep-alive comments
    # a client that takes nothing of its stream for this long is cut off, its request aborted
    stream_timeout: float = 60.0
    log_interval: float = 10.0  # seconds between throughput / queue / KV cache log lines
    log_level: str = "info"
    limits: RequestLimits = field(default_factory=RequestLimits)
    # max_tokens of a request without one: None is 16 on /v1/completions (vLLM's default) and
    # the rest of the context on /v1/chat/completions (OpenAI's)
    max_tokens_default: int | None = None
    # parse text like <|im_end|> inside chat messages as special tokens (vLLM does)
    special_tokens_in_content: bool = False
    chat_template: str | None = None  # a Jinja template used instead of the model's
    tool_call_parser: str | None = None  # tool_choice "auto" reads calls with it (tool_parsers)
    # Host headers answered (None: loopback names when bound to loopback, else any; "*": any)
    allowed_hosts: tuple[str, ...] | None = None
    ui: bool = True  # the chat playground at / (off: --no-ui)
    # origins whose pages may call the API (CORS; "*": any); none by default
    allowed_origins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "allowed_origins", parse_origins(self.allowed_origins))


class Server:
    """The app's state: the engine loop, the endpoint handlers and the metrics."""

    def __init__(self, engine: LLMEngine, config: ServerConfig) -> None:
        self.config = config
        max_seqs = engine.config.max_num_seqs + config.max_queue
        self.metrics = ServerMetrics(config.served_model_name, lambda: self.engine.stats)
        self.engine = AsyncLLMEngine(engine, max_seqs, observer=self.metrics)
        self.stat_logger = StatLogger(self.metrics, lambda: self.engine.stats, config.log_interval)
        serving = (self.engine, config.served_model_name, config.limits, config.max_tokens_default)
        self.completion = OpenAIServingCompletion(*serving)
        parser = tool_parser(config.tool_call_parser) if config.tool_call_parser else None
        self.chat = OpenAIServingChat(
            *serving,
            special_tokens_in_content=config.special_tokens_in_content,
            chat_template=config.chat_template,
            tool_parser=parser,
        )

    async def check_api_key(self, request: Request) -> None:
        check_bearer(request, self.config.api_key)


def build_app(engine: LLMEngine, config: ServerConfig) -> FastAPI:
    server = Server(engine, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.engine.start()
        stat_logger = asyncio.ensure_future(server.stat_logger.run())
        yield
        stat_logger.cancel()
        await server.engine.shutdown()

    app = FastAPI(title="qserve", lifespan=lifespan)
    app.add_middleware(HostCheckMiddleware, hosts=allowed_hosts(config.host, config.allowed_hosts))
    if config.allowed_origins:  # outermost: error replies carry the CORS headers too
        middleware, options = cors_middleware(config.allowed_origins)
        app.add_middleware(middleware, **options)
    app.state.server = server
    _add_exception_handlers(app)
    _add_routes(app, server)
    if config.ui:
        add_playground_routes(app)
    return app


def _add_routes(app: FastAPI, server: Server) -> None:
    auth = [Depends(server.check_api_key)]

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if server.engine.is_alive else 503)

    @app.get("/metrics", dependencies=[] if server.config.metrics_public else auth)
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict[str, Any]:
        return dump(ModelList(object="list", data=[_model_card(server)]))

    add_server_info_route(app, server, auth)

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request) -> Response:
        body = await parse_body(request, CompletionRequest, server.config.limits)
        result = await until_disconnected(request, server.completion.create(body))
        return _respond(result, server.config)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(request: Request) -> Response:
        body = await parse_body(request, ChatCompletionRequest, server.config.limits)
        result = await until_disconnected(request, server.chat.create(body))
        return _respond(result, server.config)

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await parse_body(request, TokenizeRequest, server.config.limits)
        return dump(await _tokenize(server, body))

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await parse_body(request, DetokenizeRequest, server.config.limits)
        server.completion.check_model(body.model)
        vocab = server.engine.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise QServeError(f"token ids must be in [0, {vocab})", param="tokens")
        prompt = await server.engine.tokenizer.decode(body.tokens)
        return dump(DetokenizeResponse(prompt=prompt))


def _model_card(server: Server) -> ModelCard:
    return ModelCard(
        id=server.config.served_model_name,
        object="model",
        created=now(),
        owned_by="qserve",
        root=str(server.engine.model_path or server.config.served_model_name),
        max_model_len=server.engine.max_model_len,
    )


async def _tokenize(server: Server, body: TokenizeRequest) -> TokenizeResponse:
    server.chat.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError("send exactly one of prompt and messages", param="prompt")
    if body.messages is not None:
        template = ChatTemplateArgs(
            [tool.template_dict() for tool in body.tools] if body.tools else None,
            server.chat.chat_template,
            body.chat_template_kwargs or {},
        )
        tokens = await server.chat.prompt_ids(body.messages, body.add_generation_prompt, template)
    else:
        tokens = await server.engine.tokenize(body.prompt or "", body.add_special_tokens)
    max_model_len = server.engine.max_model_len
    return TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=max_model_len)


def _respond(result: BaseModel | SSEStream, config: ServerConfig) -> Response:
    if not isinstance(result, SSEStream):
        return JSONResponse(dump(result))
    return _EventSourceResponse(
        result.payloads,
        sep="\n",
        ping=config.ping_interval,
        send_timeout=config.stream_timeout,
        background=BackgroundTask(close_all, result.streams),
        on_send_timeout=lambda: close_all(result.streams),
    )


class _EventSourceResponse(EventSourceResponse):
    """An SSE response whose client stopped reading for `send_timeout` seconds ends quietly:
    its requests are aborted (their blocks freed) and the connection closes."""

    def __init__(self, *args: Any, on_send_timeout: Callable[[], None], **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._on_send_timeout = on_send_timeout

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        except SendTimeoutError:
            self._on_send_timeout()
            logger.warning(
                "a client read nothing of its stream for %g s: its request was aborted and the "
                "connection closed",
                self.send_timeout,
            )


async def parse_body(request: Request, model: type[M], limits: RequestLimits) -> M:
    """The JSON body as `model`, strictly typed; ValidationError (a 400) otherwise, 413 over
    the size limit, 415 unless sent as JSON, and a quiet 499 when the client goes away while
    sending it."""
    check_json_content_type(request)
    try:
        body = await limits.read_body(request)
    except ClientDisconnect:
        raise APIError("the client closed the request", CLIENT_CLOSED_REQUEST) from None
    return model.model_validate_json(body)


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work` unless the client disconnects first: then cancel it (aborting its requests)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        raise APIError("the client closed the request", status_code=CLIENT_CLOSED_REQUEST)
    return task.result()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


# -- errors: every 4xx/5xx is {"error": {"message", "type", "param", "code"}} ---------------------


def _add_exception_handlers(app: FastAPI) -> None:
    handlers: dict[type[Exception], Callable[[Any], APIError]] = {
        APIError: lambda exc: exc,
        ValidationError: APIError.from_validation,
        ContextLengthError: lambda exc: APIError(
            str(exc), param=exc.param, code="context_length_exceeded"
        ),
        QServeError: APIError.from_qserve,
        QueueFullError: lambda exc: APIError(
            str(exc), 429, "rate_limit_error", code="queue_full", headers={"Retry-After": "1"}
        ),
        EngineDeadError: lambda exc: APIError(
            str(exc), 503, "server_error", headers={"Retry-After": "1"}
        ),
        StarletteHTTPException: lambda exc: APIError(
            str(exc.detail), exc.status_code, _http_error_type(exc.status_code)
        ),
    }
    for exc_type, to_api_error in handlers.items():
        app.add_exception_handler(exc_type, _handler(to_api_error))
    app.add_exception_handler(Exception, _internal_error)


def _handler(to_api_error: Callable[[Any], APIError]) -> Callable[..., Awaitable[Response]]:
    async def handle(request: Request, exc: Exception) -> Response:
        error = to_api_error(exc)
        return JSONResponse(error.body(), status_code=error.status_code, headers=error.headers)

    return handle


async def _internal_error(request: Request, exc: Exception) -> Response:
    logger.exception("unexpected error on %s", request.url.path, exc_info=exc)
    error = APIError(f"internal server error: {exc!r}", 500, "server_error")
    return JSONResponse(error.body(), status_code=500)


def _http_error_type(status_code: int) -> str:
    return "invalid_request_error" if status_code < 500 else "server_error"


# -- running -------------------------------------------------------------------------------------


# Seconds between cutting the requests still in flight at the end of the drain window and
# uvicorn cancelling what is left: time for each cut stream to send its error event and [DONE].
CUT_GRACE_S = 2


def make_uvicorn_server(app: FastAPI, config: ServerConfig) -> Any:
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn, whose shutdown drains: requests in flight get `drain_timeout` seconds to
        finish; those still running are then cut (a stream ends with an error event and
        [DONE], a plain request gets a 503), never dropped mid-stream without a word."""

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            engine: AsyncLLMEngine = app.state.server.engine
            engine.draining = True
            message = f"the server shut down after a {config.drain_timeout:g} s drain"
            loop = asyncio.get_running_loop()
            cut = loop.call_later(config.drain_timeout, engine.cut_all, message)
            try:
                await super().shutdown(sockets)
            finally:
                cut.cancel()

    return DrainingServer(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level=config.log_level,
            timeout_graceful_shutdown=int(config.drain_timeout) + CUT_GRACE_S,
            access_log=False,
        )
    )


def run_server(engine: LLMEngine, config: ServerConfig, sock: socket.socket | None = None) -> None:
    """Serve until Ctrl-C / SIGTERM, then drain requests in flight (bounded) and return. If
    the engine failed for good (a parallel worker died), shut down at once and raise
    its one line."""
    from sse_starlette.sse import AppStatus

    # sse-starlette would end every open stream on the first signal; we drain them instead,
    # bounded by uvicorn's graceful-shutdown timeout (then their tasks are cancelled and aborted).
    AppStatus.disable_automatic_graceful_drain()
    # uvicorn re-raises the signal it caught once it has shut down; a no-op handler turns that
    # into a normal return, so the process exits 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    app = build_app(engine, config)
    server = make_uvicorn_server(app, config)
    async_engine = app.state.server.engine
    async_engine.on_fatal = lambda message: setattr(server, "should_exit", True)
    if engine.workers is not None:  # a parallel worker that dies stops the server
        engine.workers.watch(async_engine.fail)
    server.run(sockets=[sock] if sock is not None else None)
    if async_engine.fatal_error is not None:
        raise QServeError(async_engine.fatal_error)
