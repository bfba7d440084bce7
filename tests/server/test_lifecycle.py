"""Admission (429 beyond --max-queue) and `qserve serve` draining on SIGTERM and exiting 0."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest

from tests.server.conftest import MODEL_NAME, RunningServer, running_server, tiny_engine

REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 90
DRAIN_TOKENS = 48


@pytest.fixture
def one_slot_server(tiny_model_dir: Path) -> Iterator[RunningServer]:
    """At most one request in flight: max_num_seqs 1 and no queue."""
    with running_server(tiny_engine(tiny_model_dir, max_num_seqs=1), max_queue=0) as running:
        yield running


def test_full_queue_gets_429_with_retry_after(one_slot_server: RunningServer) -> None:
    server = one_slot_server
    with server.client(timeout=30) as client:
        stream = client.completions.create(
            model=MODEL_NAME, prompt="The whale", max_tokens=300, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        next(iter(stream))
        response = server.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert response.status_code == 429
        assert response.headers["retry-after"] == "1"
        assert response.json()["error"]["code"] == "queue_full"
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2)
        stream.close()
        server.wait_all_blocks_free()
        deadline = time.monotonic() + 10
        while server.server.engine.num_requests and time.monotonic() < deadline:
            time.sleep(0.02)
        result = client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2)
        assert result.usage.completion_tokens >= 1


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_healthy(base_url: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"{base_url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"qserve serve did not become healthy (exit code {process.poll()})")


def _stream_tokens(base_url: str, first_chunk: threading.Event, result: list[object]) -> None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=60)
    stream = client.completions.create(
        model=MODEL_NAME, prompt="The whale", max_tokens=DRAIN_TOKENS, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = []
    for chunk in stream:
        chunks.append(chunk)
        first_chunk.set()
    result.append(chunks[-1].usage.completion_tokens)


@contextmanager
def serve_process(
    model_dir: Path, drain_timeout: str, *extra: str, stderr_lines: list[str] | None = None
) -> Iterator[tuple[subprocess.Popen, str]]:
    """`qserve serve` (with `extra` options) in its own process, healthy; on exit: killed if
    still running, and its stderr (its lines appended to `stderr_lines`) must hold no
    traceback."""
    port = _free_port()
    base_url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "qserve.cli", "serve", str(model_dir), "--port", str(port),
               "--served-model-name", MODEL_NAME, "--dtype", "float32", "--kv-cache-memory",
               "1MiB", "--num-threads", "1", "--drain-timeout", drain_timeout, *extra]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("QSERVE_API_KEY", None)
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE)
    try:
        _wait_healthy(base_url, process)
        yield process, base_url
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
        stderr = process.stderr.read().decode() if process.stderr else ""
    if stderr_lines is not None:
        stderr_lines += stderr.strip().splitlines()
    assert "Traceback" not in stderr, stderr


def test_serve_drains_on_sigterm_and_exits_0(tiny_model_dir: Path) -> None:
    with serve_process(tiny_model_dir, "30") as (process, base_url):
        first_chunk, result = threading.Event(), []
        client = threading.Thread(target=_stream_tokens, args=(base_url, first_chunk, result))
        client.start()
        assert first_chunk.wait(30)
        process.send_signal(signal.SIGTERM)
        client.join(60)
        assert result == [DRAIN_TOKENS]  # the request in flight finished in full
        assert process.wait(30) == 0


def _stream_lines(base_url: str, started: threading.Event, lines: list[str]) -> None:
    body = {"prompt": "The whale", "max_tokens": 480, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data:"):
                lines.append(line)
                started.set()


def test_sigterm_cuts_what_the_drain_window_cannot_finish(tiny_model_dir: Path) -> None:
    """Streams still running after --drain-timeout end with an error event and [DONE]; a plain
    request gets a JSON 503; the server exits 0 without a traceback."""
    with serve_process(tiny_model_dir, "0.2") as (process, base_url):
        streams = [(threading.Event(), []) for _ in range(3)]
        threads = [threading.Thread(target=_stream_lines, args=(base_url, *s)) for s in streams]
        plain: list[httpx.Response] = []
        body = {"prompt": "x", "max_tokens": 480, "ignore_eos": True}
        threads.append(threading.Thread(target=lambda: plain.append(
            httpx.post(f"{base_url}/v1/completions", json=body, timeout=60))))  # fmt: skip
        for thread in threads:
            thread.start()
        assert all(started.wait(30) for started, _ in streams)
        process.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(60)
        assert process.wait(30) == 0
    for _, lines in streams:
        assert lines[-1] == "data: [DONE]"
        assert '"error"' in lines[-2] and "shut down" in lines[-2]
    (response,) = plain
    assert response.status_code == 503 and "shut down" in response.json()["error"]["message"]
