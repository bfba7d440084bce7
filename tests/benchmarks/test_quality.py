"""benchmarks/quality.py bookkeeping (the measurements themselves are the benchmark's job)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import quality
from qserve.eval import EvalResult


def fake_row(name: str, ppl: float) -> quality.Row:
    return quality.Row(name, name, ppl, 4088, 8, 1.0, 100.0, 5.0, "engine", "dense")


def test_json_is_written_after_every_row(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """A run that dies keeps its finished rows (a full run takes hours on CPU)."""
    ppl = {"baseline": 60.0, "rtn": 80.0, "gptq": 70.0}
    seen: list[list[str]] = []
    out = tmp_path / "quality.json"

    def run_method(model, method, ids, tmp, args, heldout=None):
        assert heldout == list(range(100))
        if out.exists():  # the rows before this one are already on disk
            seen.append([r["method"] for r in json.loads(out.read_text())["rows"]])
        return fake_row(method.name, ppl[method.name])

    monkeypatch.setattr(quality, "resolve_model", lambda name: name)
    monkeypatch.setattr(quality, "eval_tokens", lambda model: list(range(4096)))
    monkeypatch.setattr(quality, "heldout_tokens", lambda model: list(range(100)))
    monkeypatch.setattr(quality, "run_method", run_method)
    args = ["--methods", "rtn,gptq", "--group-size", "64", "--output", str(out)]
    assert quality.main(args) == 0
    assert seen == [["baseline"], ["baseline", "rtn"]]
    summary = json.loads(out.read_text())
    assert [r["method"] for r in summary["rows"]] == ["baseline", "rtn", "gptq"]
    assert summary["recovery_of_rtn_gap"]["gptq"] == pytest.approx(0.5)
    assert summary["heldout_recovery_of_rtn_gap"] == {}  # the fake rows have no held-out ppl


def test_recovery_on_the_heldout_column() -> None:
    rows = {n: fake_row(n, p) for n, p in (("baseline", 60.0), ("rtn", 80.0), ("gptq", 70.0))}
    for name, held in (("baseline", 20.0), ("rtn", 30.0), ("gptq", 22.0)):
        rows[name].heldout_perplexity = held
    assert quality.recovery(rows) == {"gptq": pytest.approx(0.5)}
    assert quality.recovery(rows, "heldout_perplexity") == {"gptq": pytest.approx(0.8)}
    table = quality.format_table(list(rows.values()), 60.0, 20.0)
    assert "22.000" in table and "+10.00%" in table


def test_max_tokens_zero_scores_every_token(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    """--max-tokens 0 hands perplexity no limit (all of chapters 1-10); a negative count is
    refused in one line."""
    limits: list[int | None] = []

    class Report:
        scheme = "dense"

    class Engine:
        load_report = Report()
        tokenizer = None

    def perplexity(engine, ids, seq_len, max_tokens, prefix):
        limits.append(max_tokens)
        return EvalResult(60.0, len(ids) - 1, 1, 1.0)

    monkeypatch.setattr(quality, "load_engine", lambda *a: (Engine(), "engine", None))
    monkeypatch.setattr(quality, "perplexity", perplexity)
    monkeypatch.setattr(quality, "text_prefix", lambda tokenizer: [])
    for given in ("0", "2048"):
        args = quality.parse_args(["--max-tokens", given])
        quality.evaluate(tmp_path, quality.METHODS["baseline"], list(range(4096)), tmp_path, args)
    assert limits == [None, 2048]
    with pytest.raises(SystemExit):
        quality.parse_args(["--max-tokens", "-1"])
    assert "--max-tokens must be >= 0" in capsys.readouterr().err
