"""Hostile clients against a real server on loopback: they cannot read each other's cache."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engine.test_kv_cache_manager import COLLIDING_BLOCKS
from tests.server.conftest import RunningServer, running_server, tiny_engine

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
