"""The sliding-window benchmark's smoke run: every path, full and windowed, a table and JSON."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.sliding_window import main


def test_smoke(tmp_path: Path, capsys) -> None:
    out = tmp_path / "swa.json"
    argv = ["--context", "64", "--windows", "16", "--batch", "2", "--heads", "4", "2",
            "--head-dim", "32", "--dtype", "float32", "--num-threads", "1", "--repeats", "2",
            "--output", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert json.loads(out.read_text())
    assert "full / this" in capsys.readouterr().out
