"""The chat playground at `/` (static files shipped in `qserve/server/static/`) and
`/server_info`, the JSON its model panel reads.

The page is plain HTML, CSS and JavaScript: no build step, nothing fetched from elsewhere. It
talks to the server through the public API (`/v1/chat/completions`, streamed) and
`/server_info`, with the API key the user types (kept in sessionStorage at most).
`/server_info` describes the engine as it was built (quantization scheme, the kernel path of
each kind of layer, the KV cache's size) and as it is now (KV blocks in use, requests); it is
served with or without the page, behind the API key like the other API routes.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import resources
from typing import TYPE_CHECKING, Any

import torch
from fastapi import FastAPI
from fastapi.params import Depends
from fastapi.responses import Response

if TYPE_CHECKING:
    from qserve.server.api_server import Server

# name -> media type of the files served (the page at /, the others under /playground/)
ASSETS = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
# The page runs only its own script and style and talks only to this server.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
    "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def read_assets() -> dict[str, bytes]:
    """The page's files, read once from the installed package."""
    folder = resources.files("qserve.server").joinpath("static")
    return {name: folder.joinpath(name).read_bytes() for name in ASSETS}


def add_playground_routes(app: FastAPI) -> None:
    """`/` serves the page, `/playground/<file>` its script and style."""
    assets = read_assets()

    def serve(name: str) -> Callable[[], Any]:
        async def asset() -> Response:
            return Response(assets[name], media_type=ASSETS[name], headers=PAGE_HEADERS)

        return asset

    app.get("/", include_in_schema=False)(serve("index.html"))
    for name in ASSETS:
        if name != "index.html":
            app.get(f"/playground/{name}", include_in_schema=False)(serve(name))


def add_server_info_route(app: FastAPI, server: Server, auth: list[Depends]) -> None:
    built = engine_description(server)

    @app.get("/server_info", dependencies=auth)
    async def server_info() -> dict[str, Any]:
        return {**built, **current_usage(server)}


def engine_description(server: Server) -> dict[str, Any]:
    """What does not change while the server runs: the model, its weights' scheme and kernel
    paths, the KV cache's size (this process's; a tensor-parallel rank's pages hold its share
    of the KV heads)."""
    engine = server.engine.engine
    report = engine.load_report
    spec = engine.model_runner.kv_spec
    return {
        "model": server.config.served_model_name,
        "root": str(engine.config.model or server.config.served_model_name),
        "architecture": engine.model_config.architecture,
        "dtype": _dtype_name(engine.dtype),
        "device": engine.config.device,
        "max_model_len": engine.max_model_len,
        "quantization": {
            "scheme": report.scheme,
            "kernel_paths": dict(report.linear_paths),
            "merged": list(report.merged),
            "cpu_kernels": _cpu_kernels(engine.config.device),
        },
        "parallel": {
            "tensor_parallel_size": engine.config.tensor_parallel_size,
            "pipeline_parallel_size": engine.config.pipeline_parallel_size,
        },
        "kv_cache": {
            "num_blocks": spec.num_blocks,
            "block_size": spec.block_size,
            "num_tokens": spec.num_tokens,
            "bytes": spec.num_blocks * spec.bytes_per_block,
            "dtype": _dtype_name(spec.dtype),
            "prefix_caching": engine.config.enable_prefix_caching,
        },
    }


def current_usage(server: Server) -> dict[str, Any]:
    """The engine thread's last snapshot: KV blocks in use and requests in flight."""
    stats = server.engine.stats
    return {
        "kv_cache_usage": {
            "used_blocks": stats.num_blocks - stats.num_free_blocks,
            "free_blocks": stats.num_free_blocks,
            "usage": stats.kv_cache_usage,
            "prefix_cache_hit_rate": stats.prefix_cache_hit_rate,
        },
        "requests": {"running": stats.num_running, "waiting": stats.num_waiting},
    }


def _cpu_kernels(device: str) -> dict[str, str] | None:
    if torch.device(device).type != "cpu":
        return None
    from qserve.kernels import ops

    return ops.cpu_kernel_paths()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
