"""benchmarks/auto_carry.py on the tiny Llama: every unit's directly measured KLs beside the
pass's carries, and the allocations each estimate makes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import auto_carry
from tests.tiny import save_tiny_llama


def test_carries_are_compared_with_measured_kls(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("QSERVE_CACHE_DIR", str(tmp_path / "cache"))  # not the user's cache
    model = save_tiny_llama(tmp_path / "tiny")
    out = tmp_path / "carry.json"
    argv = ["--model", str(model), "--blocks", "1", "--num-samples", "4", "--seq-len", "64"]
    assert auto_carry.main([*argv, "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    units = result["units"]
    assert [u["name"].split(".")[-1] for u in units] == [
        "q_proj+k_proj+v_proj", "o_proj", "gate_proj+up_proj", "down_proj"
    ]  # fmt: skip
    assert all(".layers.1." in u["name"] for u in units)
    for u in units:
        assert u["kl"]["w4g32"] > 0 and u["kl"]["w3g32"] > u["kl"]["w4g32"]
        ref = "w4g64" if "w4g64" in u["kl"] else "w4g32"  # down_proj's K = 160
        assert u["pass_carry"][ref] == u["kl"][ref] == u["mse_carry"][ref]  # measured, not carried
        if "w3g64" in u["kl"]:  # the coarsest W3 is measured, the finer carried from it
            assert u["pass_carry"]["w3g64"] == u["kl"]["w3g64"]
            assert u["pass_carry"]["w3g32"] != u["kl"]["w3g32"]
    allocations = result["allocations"]
    assert allocations["uniform"] == "w4g32"
    oracle = allocations["kl"]
    assert oracle["predicted"] == pytest.approx(oracle["measured"])
    for key in ("pass_carry", "mse_carry"):  # the measured KLs' own allocation is the least
        assert oracle["measured"] <= allocations[key]["measured"] + 1e-9
    assert "least-error allocation" in capsys.readouterr().out


def test_negative_blocks_are_a_one_line_error(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        auto_carry.parse_args(["--blocks", "-1"])
    assert info.value.code == 2 and "not negative" in capsys.readouterr().err


def test_blocks_past_the_models_are_a_one_line_error(tmp_path: Path) -> None:
    model = save_tiny_llama(tmp_path / "tiny")  # 2 blocks
    with pytest.raises(SystemExit) as info:
        auto_carry.main(["--model", str(model), "--blocks", "0", "2"])
    assert str(info.value) == f"--blocks: {model} has blocks 0 to 1"
