"""The output-cost benchmark's smoke run: both kinds, every position, a table and JSON."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.output_cost import main


def test_smoke(tmp_path: Path, capsys) -> None:
    out = tmp_path / "cost.json"
    assert main(["--positions", "10", "60", "--steps", "5", "--output", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["kind"] for r in rows] == ["CUMULATIVE", "DELTA"]
    assert all(set(r["us_per_step"]) == {"10", "60"} and r["growth"] > 0 for r in rows)
    assert "last / first" in capsys.readouterr().out
