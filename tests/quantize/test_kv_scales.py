"""FP8 KV cache scales: calibrated during quantization, checked against K/V computed
independently with transformers, written in each format's names and loaded by the engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from torch import Tensor
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from qserve.cli import cli
from qserve.errors import QServeError
from qserve.kernels import packing
from qserve.model.attention import AttentionMetadata, make_kv_cache
from qserve.model.loader import load_model
from qserve.quantize import export
from qserve.quantize.calibration import calibration_windows, load_calibration_text
from qserve.quantize.driver import QuantizeSettings, quantize_model
from qserve.quantize.kv_scales import KVObserver, fp8_max, kv_scale
from tests.tiny import save_tiny_llama

from ._helpers import grouped

CALIB = dict(num_samples=8, seq_len=64)
SCALE_KEYS = [f"model.layers.{i}.self_attn.{kv}_scale" for i in range(2) for kv in "kv"]
_cache: dict[tuple[str, str], Path] = {}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/tiny.py's Llama: hidden 64, 4 heads / 2 KV heads of 16, fp32."""
    return save_tiny_llama(tmp_path_factory.mktemp("kv") / "tiny")


@pytest.fixture(scope="module")
def quantized(tiny: Path, tmp_path_factory: pytest.TempPathFactory):
    """quantized(method, kv_cache_dtype) -> checkpoint folder (float tensors kept in fp32)."""

    def make(method: str, kv_cache_dtype: str = "fp8_e4m3") -> Path:
        if (method, kv_cache_dtype) not in _cache:
            out = tmp_path_factory.mktemp("q") / f"{method}-{kv_cache_dtype}"
            quantize_model(
                tiny,
                out,
                QuantizeSettings(
                    method=method,
                    **grouped(method),
                    dtype="float32",
                    kv_cache_dtype=kv_cache_dtype,
                    **CALIB,
                ),
            )
            _cache[method, kv_cache_dtype] = out
        return _cache[method, kv_cache_dtype]

    return make


def tensors(folder: Path) -> dict[str, Tensor]:
    return load_file(str(folder / "model.safetensors"))


def qconfig(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())["quantization_config"]


# ------------------------------------------------------------------ the independent reference


def dequantized_llama(folder: Path) -> torch.nn.Module:
    """transformers' Llama holding the checkpoint's weights, dequantized exactly in fp32."""
    qc, sd = qconfig(folder), tensors(folder)
    dense = {}
    for key, t in sd.items():
        name, _, kind = key.rpartition(".")
        if kind == "qweight" and qc["quant_method"] == "gptq":
            args = (t, sd[f"{name}.qzeros"], sd[f"{name}.scales"].float(), sd[f"{name}.g_idx"])
            dense[f"{name}.weight"] = packing.dequantize_gptq(*args, qc["bits"])
        elif kind == "qweight":
            args = (t, sd[f"{name}.qzeros"], sd[f"{name}.scales"].float(), qc["group_size"])
            dense[f"{name}.weight"] = packing.dequantize_awq(*args)
        elif kind == "weight" and f"{name}.weight_scale" in sd:
            dense[key] = t.float() * sd[f"{name}.weight_scale"]
        elif kind in ("weight", "bias"):
            dense[key] = t.float()
    config = AutoConfig.from_pretrained(folder)
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.load_state_dict(dense, strict=True)
    return model


@torch.no_grad()
def reference_absmax(folder: Path, tiny: Path) -> dict[str, float]:
    """max |K| and max |V| of every layer over the calibration windows: hooks on k_proj / v_proj
    of transformers' Llama, with transformers' RoPE applied to the keys."""
    model = dequantized_llama(folder)
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    ids = calibration_windows(AutoTokenizer.from_pretrained(tiny), load_calibration_text(), **CALIB)
    outputs: dict[str, Tensor] = {}
    for i, layer in enumerate(model.model.layers):
        for kv in "kv":
            proj = getattr(layer.self_attn, f"{kv}_proj")
            key = f"model.layers.{i}.self_attn.{kv}_scale"
            proj.register_forward_hook(lambda m, a, out, key=key: outputs.__setitem__(key, out))
    absmax = dict.fromkeys(SCALE_KEYS, 0.0)
    for row in ids:
        model(row[None])
        positions = torch.arange(row.numel())[None]
        cos, sin = model.model.rotary_emb(outputs[SCALE_KEYS[0]], positions)
        for key, out in outputs.items():
            x = out.view(1, row.numel(), -1, head_dim).transpose(1, 2)  # [1, kv_heads, T, D]
            if key.endswith("k_scale"):
                _, x = apply_rotary_pos_emb(x, x, cos, sin)
            absmax[key] = max(absmax[key], float(x.abs().max()))
    return absmax


@pytest.mark.parametrize("method", ["rtn", "awq", "fp8"])  # GPTQ, AWQ, compressed-tensors
def test_scales_are_absmax_over_448_of_the_keys_after_rope(method, quantized, tiny) -> None:
    folder = quantized(method)
    sd = tensors(folder)
    expected = reference_absmax(folder, tiny)
    for key in SCALE_KEYS:
        assert sd[key].dtype == torch.float32 and sd[key].shape == (1,)
        assert float(sd[key]) == pytest.approx(expected[key] / 448.0, rel=1e-5), key


def test_compressed_tensors_declares_the_kv_cache_scheme(quantized) -> None:
    assert qconfig(quantized("fp8"))["kv_cache_scheme"] == {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "strategy": "tensor",
        "dynamic": False,
    }
    # compressed-tensors' 8-bit float is E4M3: e5m2 scales are written, not declared
    assert qconfig(quantized("fp8", "fp8_e5m2"))["kv_cache_scheme"] is None
    gptq = quantized("rtn")
    assert "kv_cache_scheme" not in qconfig(gptq)
    assert json.loads((gptq / "quantize_config.json").read_text()) == qconfig(gptq)


def test_e5m2_scales_divide_by_57344(quantized) -> None:
    e4m3, e5m2 = tensors(quantized("fp8")), tensors(quantized("fp8", "fp8_e5m2"))
    for key in SCALE_KEYS:
        assert float(e5m2[key]) * 57344.0 == pytest.approx(float(e4m3[key]) * 448.0, rel=1e-6)


def test_without_kv_cache_dtype_no_scales_and_no_calibration(tiny, tmp_path) -> None:
    missing = tmp_path / "missing.txt"
    # methods that need no calibration data of their own (fp8 when it rounds to nearest)
    for method in ("rtn", "fp8"):
        kw = dict(**grouped(method), calib=missing, gptq_weights=False if method == "fp8" else None)
        out = quantize_model(tiny, tmp_path / method, QuantizeSettings(method=method, **kw))
        assert not [k for k in tensors(out) if k.endswith(("k_scale", "v_scale"))]
        with pytest.raises(QServeError, match="missing.txt does not exist"):
            quantize_model(
                tiny,
                tmp_path / f"{method}-kv",
                QuantizeSettings(method=method, kv_cache_dtype="fp8_e4m3", **kw),
            )
        assert not (tmp_path / f"{method}-kv").exists()


# ------------------------------------------------------------------------------- the engine


@torch.no_grad()
def engine_logits(folder: Path, tokens: Tensor, kv_dtype: torch.dtype, calibrated=True) -> Tensor:
    """Our model's logits [T, vocab] for one prompt in one step, K/V through `kv_dtype` pages
    (with k_scale = v_scale = 1.0 instead of the checkpoint's when not `calibrated`)."""
    model, config = load_model(folder, torch.float32)
    assert model.load_report.has_kv_scales
    if not calibrated:
        for layer in model.model.layers:
            layer.self_attn.attn.k_scale = layer.self_attn.attn.v_scale = 1.0
    T, block_size = tokens.numel(), 16
    num_blocks = -(-T // block_size)
    kv_caches = [
        make_kv_cache(num_blocks, block_size, config.num_key_value_heads, config.head_dim, kv_dtype)
        for _ in range(config.num_hidden_layers)
    ]
    md = AttentionMetadata(
        slot_mapping=torch.arange(T),
        block_tables=torch.arange(num_blocks, dtype=torch.int32)[None],
        seq_lens=torch.tensor([T], dtype=torch.int32),
        query_start_loc=torch.tensor([0, T], dtype=torch.int32),
        seq_lens_cpu=[T],
        query_lens_cpu=[T],
    )
    return model.compute_logits(model(tokens, torch.arange(T), kv_caches, md))


def test_engine_loads_the_scales_and_fp8_pages_stay_close(quantized, tiny) -> None:
    folder = quantized("rtn")
    sd = tensors(folder)
    model, _ = load_model(folder, torch.float32)
    for i, layer in enumerate(model.model.layers):
        assert layer.self_attn.attn.k_scale == float(sd[f"model.layers.{i}.self_attn.k_scale"])
        assert layer.self_attn.attn.v_scale == float(sd[f"model.layers.{i}.self_attn.v_scale"])
    tok = AutoTokenizer.from_pretrained(tiny)
    tokens = torch.tensor(tok(load_calibration_text()[-3000:])["input_ids"][:96])
    ref = engine_logits(folder, tokens, torch.float32)

    def rel_error(logits: Tensor) -> float:
        return float((logits - ref).pow(2).mean() / ref.pow(2).mean())

    fp8 = engine_logits(folder, tokens, torch.float8_e4m3fn)
    e5m2 = engine_logits(quantized("rtn", "fp8_e5m2"), tokens, torch.float8_e5m2)
    assert 0 < rel_error(fp8) < 1e-3 and 0 < rel_error(e5m2) < 1e-2  # > 0: pages are FP8
    assert not torch.equal(fp8, engine_logits(folder, tokens, torch.float8_e4m3fn, False))


def test_cli_kv_cache_dtype(tiny, tmp_path) -> None:
    out = tmp_path / "cli"
    args = ["quantize", str(tiny), "-m", "rtn", "-o", str(out), "--group-size", "32"]
    args += ["--num-samples", "4", "--seq-len", "32", "--kv-cache-dtype", "fp8_e4m3", "-q"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert set(SCALE_KEYS) <= set(tensors(out))
    assert json.loads((out / "qserve_recipe.json").read_text())["effective"]["kv_cache_dtype"] == (
        "fp8_e4m3"
    )


# ------------------------------------------------------------------------------ pure functions


def test_kv_scale() -> None:
    assert (fp8_max("fp8_e4m3"), fp8_max("fp8_e5m2")) == (448.0, 57344.0)
    assert torch.equal(kv_scale(torch.tensor(896.0), "fp8_e4m3"), torch.tensor([2.0]))
    assert torch.equal(kv_scale(torch.tensor(57344.0), "fp8_e5m2"), torch.tensor([1.0]))
    assert float(kv_scale(torch.tensor(0.0), "fp8_e4m3")) > 0  # the engine needs scale > 0


def test_observer_passes_keys_and_values_through() -> None:
    observer = KVObserver()
    assert observer.absmax is None
    k, v = torch.tensor([[1.0, -3.0]]), torch.tensor([[0.5]])
    assert observer.update(k, v, 0, {"cache_position": None}) == (k, v)
    observer.update(torch.tensor([2.0]), torch.tensor([-4.0]), 0, kwargs={})
    assert [float(m) for m in observer.absmax] == [3.0, 4.0]


def test_settings_check_kv_cache_dtype() -> None:
    assert not QuantizeSettings(method="rtn").calibrates_kv_scales
    assert QuantizeSettings(method="rtn", kv_cache_dtype="fp8_e5m2").needs_calibration()
    allowed = r"kv_cache_dtype: 'int8' is not allowed \(allowed: auto, fp8_e4m3, fp8_e5m2\)"
    with pytest.raises(QServeError, match=allowed):
        QuantizeSettings(method="rtn", kv_cache_dtype="int8")


def test_export_names() -> None:
    names = export.kv_scale_tensors("model.layers.3.self_attn", torch.tensor(0.5), torch.tensor(2))
    assert {k: v.tolist() for k, v in names.items()} == {
        "model.layers.3.self_attn.k_scale": [0.5],
        "model.layers.3.self_attn.v_scale": [2.0],
    }
