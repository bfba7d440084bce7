"""A real server (uvicorn in a thread, on a free loopback port) over a tiny random model."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from qserve.config import EngineConfig
from qserve.engine.llm_engine import LLMEngine
from qserve.server.api_server import Server, ServerConfig, build_app, make_uvicorn_server
from tests.server.tiny_model import MAX_POSITION_EMBEDDINGS, save_tiny_smollm

__all__ = ["MAX_POSITION_EMBEDDINGS"]

API_KEY = "test-key"
MODEL_NAME = "tiny-smollm"
STARTUP_TIMEOUT_S = 30.0


@dataclass
class RunningServer:
    base_url: str  # http://127.0.0.1:PORT
    api_key: str | None
    server: Server
    http: httpx.Client  # one client for raw requests (making one costs ~0.1 s: its SSL context)

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kw: object) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.base_url}/v1", api_key=self.api_key or "none", max_retries=0, **kw
        )

    def async_client(self, **kw: object) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.base_url}/v1", api_key=self.api_key or "none", max_retries=0, **kw
        )

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics by name (labels dropped; names are unique here)."""
        text = self.http.get("/metrics", headers=self.auth).text
        return {
            sample.name: sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }

    def wait_all_blocks_free(self, timeout_s: float = 10.0) -> dict[str, float]:
        """Poll /metrics until every KV block is back in the free pool (or the time is up)."""
        deadline = time.monotonic() + timeout_s
        metrics = self.metrics()
        while time.monotonic() < deadline and not _all_free(metrics):
            time.sleep(0.05)
            metrics = self.metrics()
        return metrics


def _all_free(metrics: dict[str, float]) -> bool:
    return metrics["qserve:kv_cache_free_blocks"] == metrics["qserve:kv_cache_num_blocks"]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_smollm(tmp_path_factory.mktemp("tiny-smollm"))


def tiny_engine(model_dir: Path, **overrides: object) -> LLMEngine:
    kw: dict = dict(
        model=str(model_dir),
        dtype="float32",  # bf16 matmuls are slow on CPUs without AMX
        kv_cache_memory="1MiB",  # 128 blocks of 16 tokens (8 KiB each)
        max_num_seqs=32,
        max_num_batched_tokens=1024,
        num_threads=1,
    )
    return LLMEngine(EngineConfig(**{**kw, **overrides}))


@contextmanager
def running_server(
    engine: LLMEngine, send_buffer: int | None = None, **config: object
) -> Iterator[RunningServer]:
    """uvicorn serving build_app(engine) in a thread on a socket bound to 127.0.0.1:0
    (`send_buffer`: the SO_SNDBUF its connections inherit, to fill up quickly)."""
    server_config = ServerConfig(served_model_name=MODEL_NAME, log_level="warning", **config)
    app = build_app(engine, server_config)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if send_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    uv = make_uvicorn_server(app, server_config)
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not uv.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert uv.started, "the server did not start"
    base_url = f"http://127.0.0.1:{port}"
    http = httpx.Client(base_url=base_url, timeout=30)
    try:
        yield RunningServer(base_url, server_config.api_key, app.state.server, http)
    finally:
        http.close()
        uv.should_exit = True
        thread.join(timeout=STARTUP_TIMEOUT_S)
        sock.close()


@pytest.fixture(scope="session")
def server(tiny_model_dir: Path) -> Iterator[RunningServer]:
    with running_server(tiny_engine(tiny_model_dir), api_key=API_KEY) as running:
        yield running


@pytest.fixture
def client(server: RunningServer) -> Iterator[openai.OpenAI]:
    with server.client(timeout=30) as c:
        yield c
