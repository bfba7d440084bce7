"""benchmarks/quality.py bookkeeping (the measurements themselves are the benchmark's job)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import quality


def fake_row(name: str, ppl: float) -> quality.Row:
    return quality.Row(name, name, ppl, 4088, 8, 1.0, 100.0, 5.0, "engine", "dense")


def test_json_is_written_after_every_row(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """A run that dies keeps its finished rows (a full run takes hours on CPU)."""
    ppl = {"baseline": 60.0, "rtn": 80.0, "gptq": 70.0}
    seen: list[list[str]] = []
    out = tmp_path / "quality.json"

    def run_method(model, method, ids, tmp, args):
        if out.exists():  # the rows before this one are already on disk
            seen.append([r["method"] for r in json.loads(out.read_text())["rows"]])
        return fake_row(method.name, ppl[method.name])

    monkeypatch.setattr(quality, "resolve_model", lambda name: name)
    monkeypatch.setattr(quality, "eval_tokens", lambda model: list(range(4096)))
    monkeypatch.setattr(quality, "run_method", run_method)
    args = ["--methods", "rtn,gptq", "--group-size", "64", "--output", str(out)]
    assert quality.main(args) == 0
    assert seen == [["baseline"], ["baseline", "rtn"]]
    summary = json.loads(out.read_text())
    assert [r["method"] for r in summary["rows"]] == ["baseline", "rtn", "gptq"]
    assert summary["recovery_of_rtn_gap"]["gptq"] == pytest.approx(0.5)
