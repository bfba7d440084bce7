"""Mixture-of-experts checkpoints across tools, on the tiny Mixtral and Qwen3-MoE:

    a  our GPTQ and AWQ exports load in transformers (through gptqmodel's `defuser`, as gptqmodel
       loads MoE checkpoints; `transformers_moe_logits` says why in a process of its own)
    b  gptqmodel 7.6's GPTQ Mixtral (experts named gate_proj / up_proj / down_proj) loads in
       qserve (gptqmodel fails on the tiny Qwen3-MoE's dense layer, so that one is not made)

Logits are compared on one 40-token prompt within SAME_FP32 (both sides dequantize the same
codes and run in fp32: transformers with the torch / torch_awq kernels). Every decoder linear,
each expert's included, must come back packed: an expert left dense runs on random weights
(relative logits error 0.23-0.25 measured when that happens)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qserve.model.loader import load_model
from tests.quantize.test_interop import PROMPT_LEN, SAME_FP32, other_checkpoint, ours, rel_err
from tests.tiny_models import TINY_MODELS

ARCHS = ("mixtral", "qwen3-moe")
METHODS = ("gptq", "awq")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    pytest.importorskip("optimum")
    pytest.importorskip("gptqmodel")
    pytest.importorskip("defuser")
    work = tmp_path_factory.mktemp("interop-moe")
    return {(a, m): other_checkpoint(work, a, m) for a in ARCHS for m in METHODS}


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, 1000, (PROMPT_LEN,), generator=gen).tolist()


@pytest.fixture(scope="module")
def theirs(exports, gptqmodel_mixtral, prompt, tmp_path_factory) -> dict[str, dict]:
    """transformers' logits and packed linears of every checkpoint, from one child process."""
    out = tmp_path_factory.mktemp("theirs") / "logits.pt"
    folders = [str(f) for f in [*exports.values(), gptqmodel_mixtral]]
    child("logits", str(out), ",".join(map(str, prompt)), *folders)
    return torch.load(out)


@pytest.fixture(scope="module")
def gptqmodel_mixtral(exports: dict[tuple[str, str], Path]) -> Path:
    out = exports["mixtral", "gptq"].parent / "mixtral-gptqmodel"
    child("gptqmodel", str(out.parent / "mixtral-base"), str(out))
    return out


def child(*args: str) -> None:
    cmd = [sys.executable, "-m", "tests.quantize.transformers_moe_logits", *args]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("arch", ARCHS)
def test_our_moe_exports_load_in_transformers(exports, prompt, theirs, arch, method):
    folder = exports[arch, method]
    result = theirs[str(folder)]
    config = TINY_MODELS[arch][1]
    experts = getattr(config, "num_local_experts", None) or config.num_experts
    dense = len(getattr(config, "mlp_only_layers", []))  # Qwen3-MoE: layers with a dense MLP
    sparse = config.num_hidden_layers - dense
    # q, k, v, o in every layer; each expert's gate, up, down; a dense MLP's gate, up, down
    assert len(result["packed"]) == 4 * config.num_hidden_layers + 3 * (experts * sparse + dense)
    assert not any(n.endswith(".gate") for n in result["packed"])  # the router stays dense
    err = rel_err(ours(folder, prompt)[0], result["logits"])
    assert err <= SAME_FP32, f"{arch} {method}: relative logits error {err:.2e}"


def test_gptqmodel_mixtral_loads_in_qserve(gptqmodel_mixtral, prompt, theirs):
    model, _ = load_model(gptqmodel_mixtral, torch.float32)
    assert model.load_report.scheme == "gptq: gptq w4a16 g32"
    paths = model.load_report.linear_paths  # by linear's short name
    assert all(paths[n] != "dense (not quantized)" for n in ("w1", "w3", "w2")), paths
    err = rel_err(ours(gptqmodel_mixtral, prompt)[0], theirs[str(gptqmodel_mixtral)]["logits"])
    assert err <= SAME_FP32, f"relative logits error {err:.2e}"
