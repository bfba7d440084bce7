"""The prompt-logprobs memory benchmark runs (on a tiny model, in this process)."""

from __future__ import annotations

from pathlib import Path

from benchmarks import prompt_logprobs_memory
from tests.tiny import save_tiny_llama


def test_measure_one(tmp_path: Path) -> None:
    model = save_tiny_llama(tmp_path / "tiny")
    row = prompt_logprobs_memory.measure_one(str(model), 200, budget=64, context=256)
    assert row["prompt_len"] == 200 and row["peak_rise_mib"] >= 0
    assert row["full_logits_mib"] > 0
