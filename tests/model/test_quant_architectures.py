"""Every method quantizes every architecture's tiny model, and the engine's logits of the
checkpoint match its dequantize-then-dense reference (fp32, the same engine)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from qserve.model.loader import load_model
from qserve.quantize.driver import quantize_model
from qserve.quantize.settings import QuantizeSettings
from tests.model.test_quant import fake_quant_inputs, prefill_logits, reference
from tests.tiny import byte_bpe_tokenizer
from tests.tiny_models import MOE_MODELS, TINY_MODELS, build_tiny_model

CALIB = {"num_samples": 4, "seq_len": 64}
METHODS = {
    "rtn": {"method": "rtn", "group_size": 32},
    "gptq": {"method": "gptq", "group_size": 32, **CALIB},
    "awq": {"method": "awq", "group_size": 32, **CALIB},
    "int8": {"method": "int8", **CALIB},
    "fp8": {"method": "fp8", **CALIB},
}
TOLERANCE = 1e-5  # max |quantized - reference| / max |reference|: summation order only


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@functools.cache
def base_model(root: Path, arch: str) -> Path:
    """The tiny `arch` model with the 1000-token tokenizer (calibration text is tokenized)."""
    folder = root / arch
    tokenizer = byte_bpe_tokenizer()
    build_tiny_model(arch, vocab_size=len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("arch", sorted(set(TINY_MODELS) - MOE_MODELS))  # MoE: not yet
def test_quantized_logits_match_the_dequantized_reference(arch, method, tmp_path_factory):
    root = tmp_path_factory.getbasetemp() / "quant-archs"
    settings = QuantizeSettings(**METHODS[method])
    folder = quantize_model(base_model(root, arch), root / f"{arch}-{method}", settings)
    model, config = load_model(folder, torch.float32)
    ref_model, _ = load_model(reference(folder), torch.float32)
    fake_quant_inputs(ref_model, folder)
    got, want = prefill_logits(model, config), prefill_logits(ref_model, config)
    err = float((got - want).abs().max() / want.abs().max())
    assert err <= TOLERANCE, f"{arch} {method}: relative logits error {err:.2e}"
