"""benchmarks/auto_cost.py on the tiny Llama: the three runs timed and the ratios printed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from benchmarks import auto_cost
from tests.tiny import save_tiny_llama


def test_auto_cost_times_the_pass_and_both_gptq_runs(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("QSERVE_CACHE_DIR", str(tmp_path / "cache"))  # not the user's cache
    model = save_tiny_llama(tmp_path / "tiny")
    out = tmp_path / "cost.json"
    argv = ["--model", str(model), "--num-samples", "8", "4", "--seq-len", "64",
            "--pass-num-samples", "4"]  # fmt: skip
    assert auto_cost.main([*argv, "--output", str(out)]) == 0
    seconds = json.loads(out.read_text())["seconds"]
    assert list(seconds) == ["measurement pass", "GPTQ, 8 x 64", "GPTQ, 4 x 64"]
    assert all(t > 0 for t in seconds.values())
    assert "pass / run" in capsys.readouterr().out
    # each run sampled its calibration into a cache of its own, then the user's is back
    assert os.environ["QSERVE_CACHE_DIR"] == str(tmp_path / "cache")
    assert not (tmp_path / "cache" / "calibration").exists()


@pytest.mark.parametrize("bad", [["--pass-num-samples", "0"], ["--num-samples", "8", "-1"]])
def test_non_positive_counts_are_a_one_line_error(bad: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as info:
        auto_cost.parse_args(bad)
    assert info.value.code == 2 and "must be positive" in capsys.readouterr().err
