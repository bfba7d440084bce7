"""benchmarks/decode.py on the tiny Llama: every row measured, its floor from the bytes its
model holds and the bandwidth measured in the same run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import decode
from tests.tiny import save_tiny_llama


def test_decode_rows_and_floors(tmp_path: Path) -> None:
    tiny_llama = save_tiny_llama(tmp_path / "tiny")
    out = tmp_path / "decode.json"
    argv = ["--model", str(tiny_llama), "--batch-sizes", "1", "2", "--decode-steps", "2",
            "--decode-prompt-len", "8", "--skip-hf", "--output", str(out)]  # fmt: skip
    assert decode.main(argv) == 0
    summary = json.loads(out.read_text())
    labels = ["dense fp32", "dense bf16", "w4", "w4 + w4 lm_head"]
    assert [(r["label"], r["mode"], r["batch_size"]) for r in summary["rows"]] == [
        (label, mode, b) for b in (1, 2) for label in labels for mode in ("eager", "graph")
    ]
    assert summary["read_gb_s"] > 0
    for r in summary["rows"]:  # the tiny Llama's head_dim 16 takes the torch attention: eager
        assert r["capture_ms"] is None
    by = {(r["label"], r["batch_size"]): r for r in summary["rows"]}
    for r in summary["rows"]:
        assert r["ms_per_token"] > 0
        want = 1e3 * r["weight_mb"] * 1e6 / (summary["read_gb_s"] * 1e9)
        assert r["floor_ms"] == pytest.approx(want) and r["x_floor"] == pytest.approx(
            r["ms_per_token"] / r["floor_ms"]
        )
    assert by[("dense bf16", 1)]["weight_mb"] < by[("dense fp32", 1)]["weight_mb"]
    assert by[("w4 + w4 lm_head", 1)]["weight_mb"] < by[("w4", 1)]["weight_mb"]


def test_step_bytes_count_tied_embeddings_once() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
              num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    for tie in (True, False):
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=tie, **kw)).to(torch.float32)
        total = sum(p.numel() * 4 for p in model.parameters())  # tied: counted once already
        rotary = sum(b.numel() * b.element_size() for b in model.buffers())
        embed = 100 * 16 * 4
        assert decode.step_bytes(model) == total + rotary - (0 if tie else embed)


def test_device_needs_skip_hf() -> None:
    with pytest.raises(SystemExit) as info:
        decode.parse_args(["--device", "cuda"])
    assert info.value.code == 2
    if torch.cuda.is_available():
        assert decode.parse_args(["--device", "cuda", "--skip-hf"]).device == "cuda"


@pytest.mark.parametrize("device", ["cuda", "tpu"])
def test_a_device_this_machine_lacks_is_a_usage_error(device: str, capsys) -> None:
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit) as info:
        decode.parse_args(["--device", device, "--skip-hf"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "error: " in err and ("no CUDA device" in err or "invalid choice: 'tpu'" in err)
