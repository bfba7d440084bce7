"""Who may talk to the server: the API key, JSON-only bodies, and the Host header.

- The API key is compared as bytes in constant time; a header that is not a Bearer token, or
  not even text, is a 401 (never a 500).
- Bodies must be sent as `Content-Type: application/json` (415 otherwise): a web page can post
  `text/plain` to a local server without a CORS preflight, and JSON parsed from any content type
  let it drive a keyless server on loopback.
- Bound to loopback, the server answers only Host headers naming loopback (localhost,
  127.0.0.1, [::1]) or one of `--allowed-hosts`: a DNS-rebinding page reaches 127.0.0.1 under
  its own host name, and is refused here. `--allowed-hosts` sets the list for any bind address;
  `*` allows any host.
- Other web front-ends may call the API from the origins in `--allowed-origins` (CORS, as
  vLLM's option; off by default, so browsers keep other origins' pages from reading replies).
"""

from __future__ import annotations

import hmac
import json
import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse

from qserve.errors import QServeError
from qserve.options import excerpt
from qserve.server.protocol import APIError

LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Any, Any], Awaitable[None]]
# scheme://host[:port], nothing after it: what a browser sends as its Origin header
_ORIGIN = re.compile(r"^https?://(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+)(:\d{1,5})?$")


def check_bearer(request: Request, api_key: str | None) -> None:
    """401 unless the request carries `Authorization: Bearer <api_key>`."""
    if api_key is None:
        return
    raw = dict(request.scope["headers"]).get(b"authorization", b"")
    scheme, _, token = raw.partition(b" ")
    if scheme.lower() != b"bearer" or not hmac.compare_digest(token, api_key.encode()):
        raise APIError(
            "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
            status_code=401,
            code="invalid_api_key",
        )


def check_json_content_type(request: Request) -> None:
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise APIError(
            f"send the body as Content-Type: application/json (got {media_type or 'none'!r})",
            status_code=415,
            param="content-type",
            code="unsupported_media_type",
        )


def allowed_hosts(bind_host: str, configured: tuple[str, ...] | None) -> frozenset[str] | None:
    """The Host names the server answers (None: any)."""
    if configured:
        return None if "*" in configured else frozenset(h.lower() for h in configured)
    return LOOPBACK_HOSTS if bind_host.lower() in LOOPBACK_HOSTS else None


def host_name(header: str) -> str:
    """`example.com:8000` -> example.com, `[::1]:8000` -> ::1."""
    if header.startswith("["):
        return header[1 : header.find("]")].lower()
    return header.rsplit(":", 1)[0].lower() if header.count(":") == 1 else header.lower()


class HostCheckMiddleware:
    """Refuse (421, OpenAI-shaped) a request whose Host header is not one the server answers."""

    def __init__(self, app: ASGIApp, hosts: frozenset[str] | None) -> None:
        self.app = app
        self.hosts = hosts

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and self.hosts is not None:
            header = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
            if host_name(header) not in self.hosts:
                error = APIError(
                    f"host {header!r} is not served here (see --allowed-hosts)",
                    status_code=421,
                    param="host",
                    code="misdirected_request",
                )
                response = JSONResponse(error.body(), status_code=error.status_code)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def parse_origins(values: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """The origins of `--allowed-origins`: each value is an origin (`http://host:port`), `*`,
    or a JSON list of them (vLLM's spelling, `'["http://a:3000"]'`); QServeError otherwise."""
    origins: list[str] = []
    for value in values:
        items = _json_list(value) if value.lstrip().startswith("[") else [value]
        for item in items:
            origin = item.strip().rstrip("/")
            if origin != "*" and not _ORIGIN.match(origin):
                shape = "scheme://host[:port], or *"
                raise QServeError(
                    f"--allowed-origins: {excerpt(item)} is not an origin ({shape})",
                    param="allowed_origins",
                )
            origins.append(origin)
    return tuple(dict.fromkeys(origins))


def _json_list(value: str) -> list[str]:
    try:
        items = json.loads(value)
    except json.JSONDecodeError:
        items = None
    if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
        raise QServeError(
            f"--allowed-origins: {excerpt(value)} is not a JSON list of origins",
            param="allowed_origins",
        )
    return items


def cors_middleware(origins: tuple[str, ...]) -> tuple[type, dict[str, Any]]:
    """Starlette's CORS middleware and its options for `origins` (API keys travel in the
    Authorization header, so no cookies: credentials stay off)."""
    return CORSMiddleware, {
        "allow_origins": list(origins),
        "allow_methods": ["GET", "POST", "OPTIONS"],
        "allow_headers": ["Authorization", "Content-Type"],
        "expose_headers": ["Retry-After"],
        "max_age": 600,
    }
