"""The serving benchmark's hostile clients, against a real server: each attack gets its 4xx."""

from __future__ import annotations

import asyncio
from pathlib import Path

from benchmarks.hostile import KINDS, hostile_clients
from benchmarks.serve import format_hostile
from qserve.server.limits import RequestLimits
from tests.server.conftest import MODEL_NAME, running_server, tiny_engine
from tests.server.tiny_model import save_tiny_smollm


def test_hostile_clients_are_refused_and_reported(tmp_path: Path) -> None:
    engine = tiny_engine(save_tiny_smollm(tmp_path / "tiny"), max_num_seqs=8)
    limits = RequestLimits(max_body_bytes=8 * 2**20)
    with running_server(engine, limits=limits, stream_timeout=1.0) as server:

        async def attack() -> dict:
            async with hostile_clients(server.base_url, MODEL_NAME, len(KINDS)) as report:
                await asyncio.sleep(2.0)
            return report

        report = asyncio.run(attack())
        server.wait_all_blocks_free(timeout_s=30)
    assert set(report) == set(KINDS)
    assert report["huge_body"]["statuses"].get("413", 0) >= 1
    assert report["stop_strings"]["statuses"].get("400", 0) >= 1
    assert set(report["tokenize"]["statuses"]) <= {"200", "400"}


def test_side_by_side_table() -> None:
    keys = ("completed", "failed", "output_throughput", "median_ttft_ms", "p99_ttft_ms",
            "median_itl_ms", "p99_itl_ms")  # fmt: skip
    plain = dict.fromkeys(keys, 10.0)
    hostile = {**dict.fromkeys(keys, 20.0), "hostile_clients": 5,
               "hostile": {"wide": {"done": 1, "statuses": {"200": 1}}}}  # fmt: skip
    table = format_hostile(plain, hostile)
    assert "+5 hostile" in table and "2.00x" in table and "hostile wide: 1 done" in table
