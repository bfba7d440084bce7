"""Every method quantizes every architecture's tiny model, and the engine's logits of the
checkpoint match its dequantize-then-dense reference (fp32, the same engine).

Mixture of experts (Mixtral, Qwen3-MoE): each expert's linears are quantized and loaded on
their own; the router stays dense. In the reference, a W8A8 scheme fake-quantizes the inputs of
the linears it quantizes, asked under their checkpoint names, and never the router's.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from qserve.model.config import ModelConfig
from qserve.model.loader import load_model
from qserve.model.moe import SparseMoeBlock, checkpoint_namer, checkpoint_renames, is_router
from qserve.model.quant import QuantLinear
from qserve.quantize.driver import quantize_model
from qserve.quantize.settings import QuantizeSettings
from tests.model.test_quant import (
    _fake_quant_hook,
    fake_quant_inputs,
    greedy,
    prefill_logits,
    reference,
)
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
@pytest.mark.parametrize("arch", sorted(TINY_MODELS))
def test_quantized_logits_match_the_dequantized_reference(arch, method, tmp_path_factory):
    root = tmp_path_factory.getbasetemp() / "quant-archs"
    settings = QuantizeSettings(**METHODS[method])
    folder = quantize_model(base_model(root, arch), root / f"{arch}-{method}", settings)
    model, config = load_model(folder, torch.float32)
    ref_model, _ = load_model(reference(folder), torch.float32)
    if arch in MOE_MODELS:
        check_experts_quantized(model, folder)
        moe_fake_quant_inputs(ref_model, folder)
    else:
        fake_quant_inputs(ref_model, folder)
    got, want = prefill_logits(model, config), prefill_logits(ref_model, config)
    err = float((got - want).abs().max() / want.abs().max())
    assert err <= TOLERANCE, f"{arch} {method}: relative logits error {err:.2e}"


def check_experts_quantized(model: torch.nn.Module, folder: Path) -> None:
    """Every expert linear is a quantized layer and every router a dense one; the checkpoint
    names Mixtral's MoE blocks as the Hub does."""
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks
    for block in blocks:
        assert isinstance(block.gate, torch.nn.Linear)
        for expert in block.experts:
            assert all(isinstance(p, QuantLinear) for p in expert.projections())
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    if ModelConfig.from_pretrained(folder).expert_names[0] == "w1":  # Mixtral
        assert "model.layers.0.block_sparse_moe.gate.weight" in names
        assert not any(".mlp." in n for n in names)
    assert not any(n.endswith("gate.qweight") or n.endswith("gate.weight_scale") for n in names)


def moe_fake_quant_inputs(model: torch.nn.Module, folder: Path) -> None:
    """`fake_quant_inputs` for MoE models: the scheme asked under checkpoint names, routers
    left alone, and each expert's gate/up called one by one (the hooks fire on the modules)."""
    config = ModelConfig.from_pretrained(folder)
    scheme = config.quantization
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        name_in_checkpoint = checkpoint_namer(checkpoint_renames(f.keys(), config))
        tensors = {k: f.get_tensor(k) for k in f.keys() if k.endswith("input_scale")}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or is_router(model, name):
            continue
        linear_scheme = scheme.for_module(name_in_checkpoint(name))
        if linear_scheme is not None and linear_scheme.activations is not None:
            input_scale = tensors.get(f"{name_in_checkpoint(name)}.input_scale")
            module.register_forward_pre_hook(_fake_quant_hook(linear_scheme, input_scale))
    for layer in model.model.layers:
        layer.self_attn.qkv_proj = None
        if isinstance(layer.mlp, SparseMoeBlock):
            for expert in layer.mlp.experts:
                expert.gate_up = None
        else:
            layer.mlp.gate_up_proj = None


@pytest.mark.parametrize("method", ["gptq", "awq"])
@pytest.mark.parametrize("arch", sorted(MOE_MODELS))
def test_moe_greedy_generation_matches_the_reference(arch, method, tmp_path_factory):
    """The engine serves a quantized MoE checkpoint: the greedy tokens of its dequantized
    reference (weight-only schemes: nothing to fake-quantize)."""
    root = tmp_path_factory.getbasetemp() / "quant-archs"
    folder = root / f"{arch}-{method}"
    if not folder.exists():
        quantize_model(base_model(root, arch), folder, QuantizeSettings(**METHODS[method]))
    got = greedy(folder)
    assert got == greedy(reference(folder), folder)
