"""benchmarks/tensor_parallel.py on the tiny Llama: every configuration measured, and a TP=2
rank holds less than the whole model (its share of the layers, embeddings and lm_head whole)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import tensor_parallel
from tests.tiny import save_tiny_llama


def test_rows_and_weights_per_rank(tmp_path: Path) -> None:
    tiny = save_tiny_llama(tmp_path / "tiny")
    out = tmp_path / "tp.json"
    argv = ["--model", str(tiny), "--batch-sizes", "1", "2", "--steps", "2", "--prompt-len", "8",
            "--num-requests", "3", "--prefill-prompts", "2", "--prefill-len", "40",
            "--output", str(out)]  # fmt: skip
    assert tensor_parallel.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["tp"], r["pp"], r["threads_per_rank"], r["micro_batches"]) for r in rows] == [
        (1, 1, 1, None), (1, 1, 2, None), (2, 1, 1, None), (1, 2, 1, 1), (1, 2, 1, 2),
        (1, 2, 1, 4),
    ]  # fmt: skip
    for r in rows:
        assert r["decode_ms_b1"] > 0 and r["decode_ms_b2"] > 0 and r["workload_tokens_per_s"] > 0
        assert r["prefill_s"] > 0
    assert rows[2]["weight_mb_per_rank"] < rows[0]["weight_mb_per_rank"]
    assert rows[3]["weight_mb_per_rank"] < rows[0]["weight_mb_per_rank"]
