"""The playground at / over plain HTTP (no browser): the page and its files, --no-ui,
--allowed-origins (CORS), and /server_info, whose numbers come from the running engine.
The page itself, driven in Chromium: test_playground_browser.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from qserve.cli import cli
from qserve.errors import QServeError
from qserve.server.playground import ASSETS, read_assets
from qserve.server.security import parse_origins
from tests.server.conftest import MODEL_NAME, RunningServer, running_server, tiny_engine
from tests.server.test_lifecycle import serve_process

FRONT_END = "http://localhost:3000"
PREFLIGHT = {
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization,content-type",
}


@pytest.fixture(scope="module")
def open_server(tiny_model_dir: Path) -> Iterator[RunningServer]:
    with running_server(tiny_engine(tiny_model_dir)) as running:
        yield running


def test_root_serves_the_page_and_its_files(server: RunningServer) -> None:
    """The page needs no key (the data it shows does), and names only its own files."""
    page = server.http.get("/")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert "connect-src 'self'" in page.headers["content-security-policy"]
    for src in ('src="/playground/app.js"', 'href="/playground/style.css"'):
        assert src in page.text
    for name in ("app.js", "style.css"):
        response = server.http.get(f"/playground/{name}")
        assert response.status_code == 200
        assert response.headers["content-type"] == ASSETS[name]
        assert response.content == read_assets()[name]
    for name, content in read_assets().items():  # nothing fetched from elsewhere
        assert b"http://" not in content and b"https://" not in content, name
    assert server.http.get("/playground/nothing.js").status_code == 404


def test_server_info_needs_the_key(server: RunningServer) -> None:
    response = server.http.get("/server_info")
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"
    wrong = server.http.get("/server_info", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    assert server.http.get("/server_info", headers=server.auth).status_code == 200


def test_server_info_describes_the_engine(server: RunningServer) -> None:
    info = server.http.get("/server_info", headers=server.auth).json()
    engine = server.server.engine.engine
    spec = engine.model_runner.kv_spec
    assert info["model"] == MODEL_NAME
    assert info["max_model_len"] == engine.max_model_len
    assert info["quantization"]["scheme"] == engine.load_report.scheme == "dense"
    assert info["quantization"]["kernel_paths"] == engine.load_report.linear_paths
    assert set(info["quantization"]["kernel_paths"]) >= {"q_proj", "down_proj", "lm_head"}
    metrics = server.metrics()
    assert info["kv_cache"]["num_blocks"] == spec.num_blocks == 128  # 1MiB of 8 KiB blocks
    assert metrics["qserve:kv_cache_num_blocks"] == spec.num_blocks
    assert info["kv_cache"]["block_size"] == 16
    assert info["kv_cache"]["bytes"] == 2**20


def _stream(server: RunningServer, started: threading.Event, stop: threading.Event) -> None:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Tell a story"}],
            "max_tokens": 400, "ignore_eos": True, "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body,
                      headers=server.auth, timeout=60) as response:  # fmt: skip
        for line in response.iter_lines():
            if line.startswith("data:"):
                started.set()
            if stop.is_set():
                return  # closes the connection mid-stream


def _usage(server: RunningServer) -> dict:
    return server.http.get("/server_info", headers=server.auth).json()["kv_cache_usage"]


def test_server_info_counts_the_blocks_a_request_holds(server: RunningServer) -> None:
    assert _usage(server)["used_blocks"] == 0
    started, stop = threading.Event(), threading.Event()
    client = threading.Thread(target=_stream, args=(server, started, stop))
    client.start()
    try:
        assert started.wait(30)
        seen = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(seen):
            seen.append(_usage(server)["used_blocks"])
        assert max(seen) > 0, "no KV block in use while a request streams"
        info = server.http.get("/server_info", headers=server.auth).json()
        assert info["requests"]["running"] == 1
    finally:
        stop.set()
        client.join(30)
    deadline = time.monotonic() + 10
    while _usage(server)["used_blocks"] and time.monotonic() < deadline:
        time.sleep(0.05)
    usage = _usage(server)
    assert usage["used_blocks"] == 0 and usage["free_blocks"] == 128


def test_server_info_shows_a_quantized_checkpoints_kernel_paths(tmp_path: Path) -> None:
    from qserve.quantize.driver import quantize_model
    from qserve.quantize.settings import QuantizeSettings
    from tests.tiny import save_tiny_llama

    model = save_tiny_llama(tmp_path / "tiny")
    folder = quantize_model(model, tmp_path / "q", QuantizeSettings(method="rtn", group_size=32))
    engine = tiny_engine(folder)
    with running_server(engine) as running:
        info = running.http.get("/server_info").json()
    quantization = info["quantization"]
    assert quantization["scheme"] == engine.load_report.scheme != "dense"
    assert quantization["kernel_paths"] == engine.load_report.linear_paths
    assert "cpu-w4a16" in quantization["kernel_paths"]["q_proj"]


def test_no_ui_is_a_404_at_root(tiny_model_dir: Path) -> None:
    with running_server(tiny_engine(tiny_model_dir), ui=False) as running:
        for path in ("/", "/playground/app.js"):
            response = running.http.get(path)
            assert response.status_code == 404
            assert response.json()["error"]["type"] == "invalid_request_error"
        assert running.http.get("/server_info").status_code == 200  # the API stays


def test_no_cors_headers_by_default(open_server: RunningServer) -> None:
    response = open_server.http.get("/v1/models", headers={"Origin": FRONT_END})
    assert response.status_code == 200
    assert "access-control-allow-origin" not in response.headers
    preflight = open_server.http.options(
        "/v1/chat/completions", headers={"Origin": FRONT_END, **PREFLIGHT}
    )
    assert "access-control-allow-origin" not in preflight.headers


def test_allowed_origins_get_cors_headers(tiny_model_dir: Path) -> None:
    engine = tiny_engine(tiny_model_dir)
    with running_server(engine, api_key="k", allowed_origins=(FRONT_END,)) as running:
        preflight = running.http.options(
            "/v1/chat/completions", headers={"Origin": FRONT_END, **PREFLIGHT}
        )
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == FRONT_END
        assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
        # an error reply is readable by the front-end too (its message, not an opaque failure)
        refused = running.http.get("/v1/models", headers={"Origin": FRONT_END})
        assert refused.status_code == 401
        assert refused.headers["access-control-allow-origin"] == FRONT_END
        key = {"Authorization": "Bearer k"}
        ok = running.http.get("/v1/models", headers={"Origin": FRONT_END, **key})
        assert ok.headers["access-control-allow-origin"] == FRONT_END
        other = {"Origin": "http://evil.example"}
        elsewhere = running.http.get("/v1/models", headers={**other, **key})
        assert "access-control-allow-origin" not in elsewhere.headers
        preflight = running.http.options("/v1/chat/completions", headers={**other, **PREFLIGHT})
        assert preflight.status_code == 400


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        (["http://localhost:3000"], ("http://localhost:3000",)),
        (["https://chat.example.com/", "*"], ("https://chat.example.com", "*")),
        (['["http://a:1", "http://[::1]:8080"]'], ("http://a:1", "http://[::1]:8080")),
        (["http://a", "http://a"], ("http://a",)),
    ],
)
def test_parse_origins(values: list[str], expected: tuple[str, ...]) -> None:
    assert parse_origins(values) == expected


@pytest.mark.parametrize(
    "value", ["localhost:3000", "http://a/path", "ftp://a", "http://", '["http://a", 3]', "[nope"]
)
def test_bad_origins_are_one_line_errors(value: str) -> None:
    with pytest.raises(QServeError, match="--allowed-origins"):
        parse_origins([value])
    result = CliRunner().invoke(cli, ["serve", "nowhere", "--allowed-origins", value])
    assert result.exit_code == 2
    (line,) = result.output.strip().splitlines()
    assert line.startswith("error: --allowed-origins:"), result.output


def test_serve_command_line_no_ui_and_allowed_origins(tiny_model_dir: Path) -> None:
    """The real `qserve serve --no-ui --allowed-origins ...`: / is a 404, CORS is on."""
    options = ("--no-ui", "--allowed-origins", FRONT_END)
    with serve_process(tiny_model_dir, "5", *options) as (_, base_url):
        assert httpx.get(f"{base_url}/").status_code == 404
        models = httpx.get(f"{base_url}/v1/models", headers={"Origin": FRONT_END})
        assert models.headers["access-control-allow-origin"] == FRONT_END
    with serve_process(tiny_model_dir, "5") as (_, base_url):
        page = httpx.get(f"{base_url}/")
        assert page.status_code == 200 and "qserve playground" in page.text
