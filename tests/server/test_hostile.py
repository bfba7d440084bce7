"""Hostile clients against a real server on loopback: they cannot read each other's cache, and
every limit is a 4xx naming its parameter while a victim's stream keeps flowing."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from qserve.server.limits import RequestLimits
from tests.engine.test_kv_cache_manager import COLLIDING_BLOCKS
from tests.server.conftest import (
    MAX_POSITION_EMBEDDINGS,
    RunningServer,
    running_server,
    tiny_engine,
)

SUFFIX = [300, 301, 302, 303]  # after the 16-token block, so the block is a cacheable prefix


@pytest.fixture(scope="module")
def open_server(tiny_model_dir: Path) -> Iterator[RunningServer]:
    """No API key, /metrics public: what a hostile client can reach on an open server."""
    with running_server(tiny_engine(tiny_model_dir), metrics_public=True) as running:
        yield running


def _greedy(server: RunningServer, prompt: list[int], salt: str | None = None) -> dict:
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 1}
    if salt is not None:
        body["cache_salt"] = salt
    response = server.http.post("/v1/completions", json=body, headers=server.auth)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return {"text": choice["text"], "logprobs": choice["logprobs"]["token_logprobs"]}


def _prefix_hits(server: RunningServer) -> int:
    return server.server.engine.engine.scheduler.kv_cache_manager.prefix_cache_stats.hits


def test_python_hash_collision_does_not_leak_the_cache(
    open_server: RunningServer, tiny_model_dir: Path
) -> None:
    """The attacker's block B and the victim's block A have equal Python tuple hashes: with
    `hash()` block keys the victim was served B's K/V and got the attacker's continuation."""
    victim, attacker = COLLIDING_BLOCKS
    _greedy(open_server, attacker + SUFFIX)
    hits = _prefix_hits(open_server)
    served = _greedy(open_server, victim + SUFFIX)
    assert _prefix_hits(open_server) == hits
    engine = tiny_engine(tiny_model_dir, enable_prefix_caching=False)
    with running_server(engine) as uncached:
        assert served == _greedy(uncached, victim + SUFFIX)


def test_cache_salt_isolates_tenants(open_server: RunningServer) -> None:
    prompt = list(range(1000, 1040))  # two full blocks and a partial one
    first = _greedy(open_server, prompt, salt="tenant-a")
    for salt, new_hits in (("tenant-b", 0), (None, 0), ("tenant-a", 32)):
        hits = _prefix_hits(open_server)
        assert _greedy(open_server, prompt, salt) == first
        assert _prefix_hits(open_server) - hits == new_hits
    response = open_server.http.post("/v1/completions", json={"prompt": "x", "cache_salt": ""})
    assert response.status_code == 400 and response.json()["error"]["param"] == "cache_salt"


def test_metrics_public_only_when_asked(open_server: RunningServer, tiny_model_dir) -> None:
    assert open_server.http.get("/metrics").status_code == 200
    with running_server(tiny_engine(tiny_model_dir), api_key="k", metrics_public=True) as s:
        assert s.http.get("/metrics").status_code == 200
        assert s.http.get("/v1/models").status_code == 401


# -- limits -----------------------------------------------------------------------------------

LIMITS = RequestLimits(
    max_body_bytes=2**20, max_prompts=8, max_seqs=16, max_stop_strings=4, max_stop_chars=64
)


@pytest.fixture(scope="module")
def limited_server(tiny_model_dir: Path) -> Iterator[RunningServer]:
    engine = tiny_engine(tiny_model_dir, max_num_seqs=8)
    with running_server(engine, max_queue=24, limits=LIMITS) as running:
        yield running


class VictimStream:
    """A client streaming completions one after another in a thread, timing its tokens."""

    def __init__(self, server: RunningServer) -> None:
        self.server, self.gaps, self.tokens = server, [0.0], 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = {"prompt": "Call me Ishmael.", "max_tokens": 400, "stream": True,
                "ignore_eos": True}  # fmt: skip
        with httpx.Client(base_url=self.server.base_url, timeout=30) as http:
            while not self._stop.is_set():
                last = None
                with http.stream("POST", "/v1/completions", json=body) as response:
                    for line in response.iter_lines():
                        now = time.monotonic()
                        if line.startswith("data: {"):
                            self.tokens += 1
                            self.gaps.append(0.0 if last is None else now - last)
                            last = now
                        if self._stop.is_set():
                            break

    def __enter__(self) -> VictimStream:
        self._thread.start()
        deadline = time.monotonic() + 10
        while self.tokens < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.tokens >= 5, "the victim's stream did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


def _error(response: httpx.Response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    return error


def test_every_limit_is_a_4xx_and_the_victim_keeps_streaming(limited_server) -> None:
    server = limited_server
    post = server.http.post
    text_bound = MAX_POSITION_EMBEDDINGS * server.server.engine.tokenizer.max_token_chars
    with VictimStream(server) as victim:
        big = b'{"prompt": "' + b"x" * (2**20) + b'"}'
        json_type = {"Content-Type": "application/json"}
        _error(post("/v1/completions", content=big, headers=json_type), 413, "body")
        chunked = (big[i : i + 65536] for i in range(0, len(big), 65536))  # no content-length
        _error(post("/v1/completions", content=chunked, headers=json_type), 413, "body")
        _error(post("/v1/completions", json={"prompt": ["a"] * 9}), 400, "prompt")
        _error(post("/v1/completions", json={"prompt": ["a"] * 4, "n": 5}), 400, "n")
        _error(post("/v1/completions", json={"prompt": "a", "stop": list("abcde")}), 400, "stop")
        _error(post("/v1/completions", json={"prompt": "a", "stop": ["s" * 65]}), 400, "stop")
        _error(post("/v1/completions", json={"prompt": "a " * text_bound}), 400, "prompt")
        _error(post("/tokenize", json={"prompt": "a " * text_bound}), 400, "prompt")
        ids = list(range(100, 100 + MAX_POSITION_EMBEDDINGS))
        _error(post("/v1/completions", json={"prompt": ids}), 400, "prompt")
        min_tokens = {"prompt": "a", "min_tokens": MAX_POSITION_EMBEDDINGS, "max_tokens": None}
        _error(post("/v1/chat/completions", json={**min_tokens, "messages": [
            {"role": "user", "content": "a"}]}), 400, "min_tokens")  # fmt: skip
        # 8 running + 24 queued sequences: 25 more than fit at once can never fit: a 400
        _error(post("/v1/completions", json={"prompt": ["a"] * 8, "n": 4}), 400, "n")
        tokens = post("/tokenize", json={"prompt": "whale " * 6000}).json()["count"]
        assert tokens >= 6000  # a long text, tokenized off the event loop and the engine thread
    assert victim.tokens > 20 and max(victim.gaps) < 1.0, max(victim.gaps)


def test_queue_counts_sequences_not_requests(limited_server) -> None:
    """Two requests of 2 prompts x n=8 fill the 32 places (8 running, 24 queued): a third such
    request gets 429 although only two HTTP requests are in flight."""
    server = limited_server
    body = {"prompt": ["a", "b"], "n": 8, "max_tokens": 500, "ignore_eos": True}
    results: list[int] = []

    def send() -> None:
        # 16 x 500 tokens: over a minute on a 2-core machine busy with other work
        with httpx.Client(base_url=server.base_url, timeout=600) as http:
            results.append(http.post("/v1/completions", json=body).status_code)

    senders = [threading.Thread(target=send) for _ in range(2)]
    for sender in senders:
        sender.start()
    deadline = time.monotonic() + 10
    while server.server.engine.num_seqs < 32 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert server.server.engine.num_seqs == 32 and server.server.engine.num_requests == 4
    full = server.http.post("/v1/completions", json=body)
    assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full"
    for sender in senders:
        sender.join(600)
    assert results == [200, 200]
    server.wait_all_blocks_free()


def test_completions_default_to_16_tokens(limited_server) -> None:
    for body in ({"prompt": "a", "ignore_eos": True}, {"prompt": "a", "ignore_eos": True,
                                                        "max_tokens": None}):  # fmt: skip
        usage = limited_server.http.post("/v1/completions", json=body).json()["usage"]
        assert usage["completion_tokens"] == 16


# -- slow readers -------------------------------------------------------------------------------


def _open_unread_stream(server: RunningServer, body: dict) -> socket.socket:
    """A client that sends a streaming request and then reads nothing (a tiny receive
    buffer, so the server's sends soon block)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    host, port = server.base_url.removeprefix("http://").split(":")
    sock.connect((host, int(port)))
    payload = json.dumps(body).encode()
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    return sock


def _read_to_end(sock: socket.socket, timeout: float) -> bytes:
    sock.settimeout(timeout)
    chunks = []
    while chunk := sock.recv(1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


def test_slow_readers_are_cut_off_and_hold_one_output_each(tiny_model_dir: Path) -> None:
    """Two clients stop reading their streams: each holds one coalesced output in the server
    (not one per step), and after --stream-timeout the server closes the connection before
    [DONE]; every block is back in the pool."""
    engine = tiny_engine(tiny_model_dir, max_num_seqs=64)
    with running_server(engine, send_buffer=4096, stream_timeout=1.0) as server:
        # ~2 MB of chunks each, far more than the (small) socket buffers hold
        body = {"prompt": "Call me Ishmael.", "max_tokens": 480, "n": 8, "logprobs": 5,
                "ignore_eos": True, "stream": True}  # fmt: skip
        readers = [_open_unread_stream(server, body) for _ in range(2)]
        try:
            most_pending, deadline = 0, time.monotonic() + 5
            while time.monotonic() < deadline:
                streams = list(server.server.engine._streams.values())
                most_pending = max([most_pending, *(s.num_pending for s in streams)])
                time.sleep(0.01)
            metrics = server.wait_all_blocks_free()
            received = [_read_to_end(sock, timeout=10) for sock in readers]
        finally:
            for sock in readers:
                sock.close()
    assert most_pending <= 1
    assert metrics["qserve:kv_cache_free_blocks"] == metrics["qserve:kv_cache_num_blocks"]
    for data in received:  # closed by the server (recv gave b""), the stream cut short
        assert data.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in data


def test_client_gone_while_sending_its_body_is_quiet(open_server: RunningServer, caplog) -> None:
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            host, port = open_server.base_url.removeprefix("http://").split(":")
            sock = socket.create_connection((host, int(port)))
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                b"Content-Type: application/json\r\nContent-Length: 99\r\n\r\n{"
            )
            sock.close()
        time.sleep(0.5)
        assert open_server.http.get("/health").status_code == 200
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


# -- fairness -----------------------------------------------------------------------------------


def test_one_token_request_is_not_starved_by_wide_requests(tiny_model_dir: Path) -> None:
    """20 requests of n=128 queue 2560 sequences for 32 running slots; a one-token request sent
    after them is admitted at the next free slot, not after all of them."""
    engine = tiny_engine(tiny_model_dir, max_num_seqs=32, kv_cache_memory="4MiB")
    with running_server(engine, max_queue=4096) as server:
        done = threading.Event()

        def wide() -> None:
            body = {"prompt": "Call me Ishmael.", "n": 128, "max_tokens": 64, "stream": True,
                    "ignore_eos": True}  # fmt: skip
            with httpx.Client(base_url=server.base_url, timeout=60) as http:
                with http.stream("POST", "/v1/completions", json=body) as response:
                    for _ in response.iter_lines():
                        if done.is_set():
                            break

        steps = []
        engine_step = engine.step

        def counted_step():  # a step count, not wall time: the test holds on a loaded machine
            steps.append(None)
            return engine_step()

        engine.step = counted_step
        senders = [threading.Thread(target=wide) for _ in range(20)]
        for sender in senders:
            sender.start()
        deadline = time.monotonic() + 30
        while server.server.engine.num_seqs < 20 * 128 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.server.engine.num_seqs == 20 * 128
        start = len(steps)
        small = server.http.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})
        waited = len(steps) - start
        in_flight = server.server.engine.num_seqs
        done.set()
        for sender in senders:
            sender.join(60)
        server.wait_all_blocks_free()
    assert small.status_code == 200 and small.json()["usage"]["completion_tokens"] == 1
    assert in_flight > 20 * 128 - 4 * 32, "the wide requests should still be mostly waiting"
    # A slot frees within one wide generation (64 decode steps); first-come-first-served would
    # wait for 2560 / 32 generations of 64 steps.
    assert waited <= 3 * 64, waited
