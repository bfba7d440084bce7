"""The MoE decode benchmark's smoke run: both executions at every batch, a table and JSON."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.moe_decode import main


def test_smoke(tmp_path: Path, capsys) -> None:
    out = tmp_path / "moe.json"
    argv = ["--hidden", "64", "--intermediate", "96", "--experts", "4", "--batches", "1", "5",
            "--num-threads", "1", "--repeats", "2", "--output", str(out)]  # fmt: skip
    assert main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 5]
    assert all(r["grouped_us"] > 0 and r["per_token_loop_us"] > 0 for r in rows)
    assert "loop / grouped" in capsys.readouterr().out
