"""benchmarks/autoquant.py: the paired comparison, and --pareto-only on the tiny Llama (its
intermediate size 160 takes no group of 64: the comparison is at W4 g32)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from benchmarks import autoquant
from tests.tiny import save_tiny_llama


def test_paired_is_the_ratio_of_perplexities_with_an_interval() -> None:
    rng = random.Random(0)
    b = [2.0 + rng.random() for _ in range(40)]
    assert autoquant.paired(b, b) == (0.0, 0.0)
    shifted = [x + 0.01 for x in b]  # every window 0.01 nats/token worse: no spread at all
    diff, half = autoquant.paired(shifted, b)
    assert diff == pytest.approx(math.expm1(0.01)) and half == pytest.approx(0.0, abs=1e-12)
    assert diff == pytest.approx(autoquant.perplexity(shifted) / autoquant.perplexity(b) - 1)
    noisy = [x + rng.gauss(0.0, 0.05) for x in b]
    diff, half = autoquant.paired(noisy, b)
    assert 0.05 / math.sqrt(40) < half < 4 * 0.05 / math.sqrt(40)  # about 1.96 standard errors


def test_pareto_only_compares_auto_with_uniform_at_its_size(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    monkeypatch.setenv("QSERVE_CACHE_DIR", str(tmp_path / "cache"))  # not the user's cache
    model = save_tiny_llama(tmp_path / "tiny")
    out = tmp_path / "autoquant.json"
    argv = ["--model", str(model), "--pareto-only", "--num-samples", "4", "--seq-len", "64",
            "--measure-samples", "2", "--eval-tokens", "2048", "--output", str(out),
            "--no-chart"]  # fmt: skip
    assert autoquant.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["name"] for r in rows] == ["baseline", "W4 g32", "auto @W4 g32"]
    auto, uniform = rows[2], rows[1]
    assert auto["bits_per_weight"] <= uniform["bits_per_weight"]
    assert len(auto["heldout_windows"]) == len(uniform["heldout_windows"]) == 4
    assert auto["heldout"] == pytest.approx(autoquant.perplexity(auto["heldout_windows"]))
    assert "auto @W4 g32 against W4 g32: held-out" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [["--budgets", "1,x"], ["--budgets", "-1"], ["--measure-samples", "0"], ["--seq-len", "1"],
     ["--eval-tokens", "0"], ["--pareto-only", "--budgets-only"]],
)  # fmt: skip
def test_bad_options_are_usage_errors(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as info:
        autoquant.parse_args(argv)
    assert info.value.code == 2
    assert "error: " in capsys.readouterr().err
