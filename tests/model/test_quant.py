"""Quantized checkpoints through the loader and the engine, against a dequantized reference.

Checkpoints come from `qserve.quantize` (RTN, GPTQ with and without act-order, AWQ, INT8
SmoothQuant, FP8) on a tiny random Llama; one is rewritten into vLLM's `fp8` form with KV scales.
The reference of a checkpoint is a dense folder holding its dequantized weights (fp32), run by the
same engine; for W8A8 schemes every quantized linear's input is fake-quantized by the kernels'
torch references (`scaled_int8_quant_ref` / `scaled_fp8_quant_ref`) with the scheme's scales.
"""

from __future__ import annotations

import functools
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from paged_batcher import PagedBatcher
from safetensors.torch import load_file, save_file

from qserve.engine.llm import LLM
from qserve.engine.sampling_params import SamplingParams
from qserve.errors import QServeError
from qserve.kernels import cpu_w4a16, packing
from qserve.kernels.fp8_ref import scaled_fp8_quant_ref
from qserve.kernels.int8_ref import scaled_int8_quant_ref
from qserve.model.config import ModelConfig
from qserve.model.loader import load_model
from qserve.model.quant import QuantLinear
from qserve.model.quant_config import LinearScheme
from tests.tiny import save_tiny_llama

CALIB = dict(num_samples=4, seq_len=64)
METHODS = {
    "rtn": dict(method="rtn", group_size=32),
    "rtn-8bit": dict(method="rtn", bits=8, group_size=-1),  # symmetric per channel: int8 kernel
    "gptq": dict(method="gptq", group_size=32, **CALIB),
    "gptq-act-order": dict(method="gptq", group_size=32, desc_act=True, **CALIB),
    "gptq-3bit": dict(method="gptq", bits=3, group_size=32, **CALIB),  # on the 4-bit kernels
    "awq": dict(method="awq", group_size=32, **CALIB),
    "int8": dict(method="int8", **CALIB),
    "fp8": dict(method="fp8"),
    "fp8-vllm": dict(method="fp8", weight_strategy="tensor", activation_scheme="static", **CALIB),
}
# 4-bit checkpoints run on the C++ kernel on CPU (any activation dtype) where it compiled and
# QSERVE_CPU_KERNELS is not 0; otherwise, and for the others, these paths with bf16 activations
# (fp32 activations take "dequantized").
W4_METHODS = ("rtn", "gptq", "gptq-act-order", "gptq-3bit", "awq")
BF16_PATHS = {
    "rtn": "cpu-int4pack",
    "rtn-8bit": "cpu-int8pack",
    "gptq": "cpu-int4pack",
    "gptq-act-order": "cpu-int4pack",
    "gptq-3bit": "cpu-int4pack",
    "awq": "cpu-int4pack",
    "int8": "cpu-int8pack",
    "fp8": "dequantized",
    "fp8-vllm": "dequantized",
}
# Logits: max |quantized - reference| / max |reference| over a 40-token prompt. fp32 runs the
# same dequantized weights (summation order only; the C++ kernel sums in fp32 too); bf16 runs
# packed kernels against a dense bf16 matmul, both rounding to 8 significant bits.
LOGITS_TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
NUM_PROMPTS, MAX_TOKENS = 4, 32


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("quant")
    save_tiny_llama(root / "base")
    return root


@functools.cache
def checkpoint(root: Path, name: str) -> Path:
    from qserve.quantize.driver import quantize_model
    from qserve.quantize.settings import QuantizeSettings

    folder = quantize_model(root / "base", root / name, QuantizeSettings(**METHODS[name]))
    if name == "fp8-vllm":
        to_vllm_fp8(folder)
    return folder


def to_vllm_fp8(folder: Path) -> None:
    """vLLM's own fp8 form: quant_method fp8, 0-d scales, KV scales on k_proj/v_proj."""
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static"}
    (folder / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(folder / "model.safetensors"))
    for name in list(tensors):
        if name.endswith(("weight_scale", "input_scale")):
            tensors[name] = tensors[name].reshape(())
    for i in range(2):
        tensors[f"model.layers.{i}.self_attn.k_proj.k_scale"] = torch.tensor(0.05 * (i + 1))
        tensors[f"model.layers.{i}.self_attn.v_proj.v_scale"] = torch.tensor(0.02 * (i + 1))
    save_file(tensors, str(folder / "model.safetensors"))


# ------------------------------------------------------------------------------------ reference


def dequantized(tensors: dict[str, torch.Tensor], prefix: str, scheme: LinearScheme):
    """fp32 W [N, K] of one quantized linear."""
    t = {k.removeprefix(prefix + "."): v for k, v in tensors.items() if k.startswith(prefix + ".")}
    if scheme.format == "gptq":
        args = (t["qweight"], t["qzeros"], t["scales"].float(), t["g_idx"], scheme.bits)
        return packing.dequantize_gptq(*args)
    if scheme.format == "awq":
        return packing.dequantize_awq(
            t["qweight"], t["qzeros"], t["scales"].float(), scheme.group_size
        )
    scale = t["weight_scale"].float()
    return t["weight"].float() * (scale.reshape(-1, 1) if scale.numel() > 1 else scale)


@functools.cache
def reference(folder: Path) -> Path:
    """A dense fp32 folder beside `folder` with its dequantized weights (no KV scales)."""
    out = folder.parent / f"{folder.name}-reference"
    scheme = ModelConfig.from_pretrained(folder).quantization
    tensors = load_file(str(folder / "model.safetensors"))
    quantized = {k.rpartition(".")[0] for k in tensors if k.endswith((".qweight", ".weight_scale"))}
    dense = {}
    for key, t in tensors.items():
        prefix, _, suffix = key.rpartition(".")
        if prefix not in quantized:
            dense[key] = t.float()
        elif suffix in ("qweight", "weight"):
            dense[f"{prefix}.weight"] = dequantized(tensors, prefix, scheme.for_module(prefix))
        elif suffix == "bias":
            dense[key] = t.float()
    dense = {k: v for k, v in dense.items() if not k.endswith(("k_scale", "v_scale"))}
    shutil.copytree(folder, out)
    save_file(dense, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    return out


def fake_quant_inputs(model: torch.nn.Module, folder: Path) -> None:
    """W8A8 schemes of checkpoint `folder`: quantize-dequantize each quantized linear's input in
    `model` (its dense reference), as the scheme says."""
    scheme = ModelConfig.from_pretrained(folder).quantization
    tensors = load_file(str(folder / "model.safetensors"))
    for module_name, module in model.named_modules():
        linear_scheme = scheme.for_module(module_name)
        if isinstance(module, torch.nn.Linear) and linear_scheme is not None:
            if linear_scheme.activations is not None:
                input_scale = tensors.get(f"{module_name}.input_scale")
                module.register_forward_pre_hook(_fake_quant_hook(linear_scheme, input_scale))
    for layer in model.model.layers:  # the hooks fire on the modules: call them one by one
        if not layer.self_attn.fused:  # Phi-3's fused modules are the checkpoint's own
            layer.self_attn.qkv_proj = layer.mlp.gate_up_proj = None


def _fake_quant_hook(scheme: LinearScheme, input_scale: torch.Tensor | None):
    quant = scaled_int8_quant_ref if scheme.format == "int8" else scaled_fp8_quant_ref
    qmax = 127.0 if scheme.format == "int8" else 448.0

    def hook(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
        x = args[0]
        scale = None if input_scale is None else input_scale.float().reshape(1)
        if scheme.activations == "tensor":
            scale = (x.float().abs().amax() / qmax).reshape(1)
        codes, s = quant(x, scale)
        return ((codes.float() * s).to(x.dtype),)

    return hook


# ---------------------------------------------------------------------------------------- logits


def prefill_logits(
    model: torch.nn.Module, config: ModelConfig, lengths: tuple[int, ...] = (40, 9)
) -> torch.Tensor:
    """Logits of prompts of `lengths` tokens (by default 40 and 9), in one flat batch: fp32
    [sum(lengths), vocab]."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    batcher = PagedBatcher(config)
    step = batcher.step(list(enumerate(prompts)))
    with torch.inference_mode():
        hidden = model(step.input_ids, step.positions, batcher.kv_caches, step.attn_metadata)
        return model.compute_logits(hidden)


def expected_path(name: str, dtype: torch.dtype) -> str:
    if name in W4_METHODS and cpu_w4a16.available():
        return "cpu-w4a16"
    return BF16_PATHS[name] if dtype == torch.bfloat16 else "dequantized"


@pytest.mark.parametrize(
    ("dtype", "cpu_kernels"),
    [(torch.float32, "1"), (torch.bfloat16, "1"), (torch.float32, "0"), (torch.bfloat16, "0")],
    ids=["fp32", "bf16", "fp32-torch", "bf16-torch"],
)
@pytest.mark.parametrize("name", list(METHODS))
def test_logits_match_the_dequantized_reference(work, name, dtype, cpu_kernels, monkeypatch):
    monkeypatch.setenv("QSERVE_CPU_KERNELS", cpu_kernels)  # "0": torch's kernels, no C++
    folder = checkpoint(work, name)
    model, config = load_model(folder, dtype)
    ref_model, _ = load_model(reference(folder), dtype)
    fake_quant_inputs(ref_model, folder)
    path = expected_path(name, dtype)
    paths = model.load_report.linear_paths
    assert paths == {**dict.fromkeys(paths, path), "lm_head": "dense (not quantized)"}
    got, want = prefill_logits(model, config), prefill_logits(ref_model, config)
    err = float((got - want).abs().max() / want.abs().max())
    assert err <= LOGITS_TOL[dtype], f"{name}: relative logits error {err:.2e}"


@pytest.mark.parametrize("lengths", [(40, 9), (5, 3)], ids=["gemm", "gemv"])
@pytest.mark.parametrize(
    ("name", "dtype", "merged"),
    [
        ("gptq-act-order", torch.float32, ("qkv_proj", "gate_up_proj")),  # cpu-w4a16
        ("awq", torch.bfloat16, ("qkv_proj", "gate_up_proj")),
        ("int8", torch.bfloat16, ()),  # torch's int8 kernel: one call per module
    ],
)
def test_merged_projections_compute_what_the_modules_compute(work, name, dtype, merged, lengths):
    """q/k/v and gate/up fused into one matmul each (where the path allows) give the logits
    of calling the modules one by one; their weights are views into the fused one."""
    if name in W4_METHODS and not cpu_w4a16.available():
        merged = ()
    model, config = load_model(checkpoint(work, name), dtype)
    assert model.load_report.merged == merged
    fused = prefill_logits(model, config, lengths)
    for layer in model.model.layers:
        layer.self_attn.qkv_proj = layer.mlp.gate_up_proj = None
    separate = prefill_logits(model, config, lengths)
    torch.testing.assert_close(fused, separate, rtol=1e-5, atol=1e-5 * float(separate.abs().max()))


def test_dense_models_merge_their_projections(work):
    model, _ = load_model(work / "base", torch.float32)
    assert model.load_report.merged == ("qkv_proj", "gate_up_proj")
    attn = model.model.layers[0].self_attn
    assert attn.k_proj.weight.data_ptr() > attn.q_proj.weight.data_ptr()  # views, in order
    assert (
        attn.k_proj.weight.untyped_storage().data_ptr()
        == attn.q_proj.weight.untyped_storage().data_ptr()
    )


# ---------------------------------------------------------------------------------------- greedy


PROMPTS = ["Call me Ishmael.", "The whale", "It was a dark and", "Queequeg and I went"]


def greedy(folder: Path, quantized: Path | None = None, dtype: str = "float32") -> list[list[int]]:
    """Greedy tokens of PROMPTS; `quantized`: `folder` is its reference (fake-quant inputs).

    fp32 on tiny models: a random tiny model has near-ties that bf16 rounding flips within 32
    tokens (the bf16 kernel paths are held to the logits tolerance above, and to greedy
    equality on SmolLM2 in test_quant_smollm2.py)."""
    llm = LLM(str(folder), dtype=dtype, kv_cache_memory="16MiB")
    if quantized is not None:
        fake_quant_inputs(llm.engine.model_runner.model, quantized)
    prompts = PROMPTS
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("name", list(METHODS))
def test_greedy_generation_matches_the_reference(work, name):
    folder = checkpoint(work, name)
    got = greedy(folder)
    assert got == greedy(reference(folder), folder)
    assert [len(t) for t in got] == [MAX_TOKENS] * NUM_PROMPTS


# ------------------------------------------------------------------------- load-time behaviour


def edited_copy(root: Path, name: str, new: str, edit) -> Path:
    """A copy of checkpoint `name` after edit(config, tensors)."""
    out = root / new
    if not out.exists():
        shutil.copytree(checkpoint(root, name), out)
        config = json.loads((out / "config.json").read_text())
        tensors = load_file(str(out / "model.safetensors"))
        edit(config, tensors)
        (out / "config.json").write_text(json.dumps(config))
        save_file(tensors, str(out / "model.safetensors"))
    return out


def test_an_unsupported_scheme_fails_at_load_in_one_line(work):
    def two_bit(config, tensors):
        config["quantization_config"]["bits"] = 2

    folder = edited_copy(work, "rtn", "gptq-2bit", two_bit)
    for load in (lambda: load_model(folder, torch.float32), lambda: LLM(str(folder))):
        with pytest.raises(QServeError, match="GPTQ 2-bit is not supported") as info:
            load()
        assert "\n" not in str(info.value)


@pytest.mark.parametrize("method", ["rtn", "awq", "fp8"])
def test_ignored_modules_stay_dense(work, method):
    from qserve.quantize.driver import quantize_model
    from qserve.quantize.settings import QuantizeSettings

    out = work / f"{method}-ignore"
    if not out.exists():
        settings = {k: v for k, v in METHODS[method].items() if k != "method"}
        quantize_model(
            work / "base",
            out,
            QuantizeSettings(method=method, ignore=("lm_head", "down_proj"), **settings),
        )
    model, _ = load_model(out, torch.bfloat16)
    for layer in model.model.layers:
        assert isinstance(layer.mlp.down_proj, torch.nn.Linear)
        assert isinstance(layer.mlp.up_proj, QuantLinear)  # not an nn.Linear
    assert model.load_report.linear_paths["down_proj"] == "dense (not quantized)"


def with_ct_kv_scales(config, tensors):
    kv = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
    config["quantization_config"]["kv_cache_scheme"] = kv
    for i in range(2):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor([0.25])
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor([0.5, 0.125])  # per head


def test_kv_scales_from_compressed_tensors_and_vllm_names(work):
    folder = edited_copy(work, "fp8", "fp8-kv", with_ct_kv_scales)
    model, _ = load_model(folder, torch.bfloat16)
    for layer in model.model.layers:
        assert layer.self_attn.attn.k_scale == 0.25
        assert layer.self_attn.attn.v_scale.tolist() == [0.5, 0.125]
    assert model.load_report.has_kv_scales
    vllm, _ = load_model(checkpoint(work, "fp8-vllm"), torch.bfloat16)
    attns = [layer.self_attn.attn for layer in vllm.model.layers]
    assert [a.k_scale for a in attns] == pytest.approx([0.05, 0.1])
    assert [a.v_scale for a in attns] == pytest.approx([0.02, 0.04])


def test_fp8_pages_double_the_blocks_and_warn_without_scales(work, caplog):
    base = str(work / "base")
    caplog.set_level(logging.INFO, logger="qserve")
    bf16 = LLM(base, dtype="bfloat16", kv_cache_memory="1MiB").engine
    assert "FP8 KV cache without calibrated scales" not in caplog.text
    fp8 = LLM(base, dtype="bfloat16", kv_cache_memory="1MiB", kv_cache_dtype="fp8_e4m3").engine
    assert fp8.model_runner.kv_spec.num_blocks == 2 * bf16.model_runner.kv_spec.num_blocks
    assert fp8.model_runner.kv_caches[0].dtype == torch.float8_e4m3fn
    assert "FP8 KV cache without calibrated scales in the checkpoint (0 of 2 layers" in caplog.text


def test_startup_log_names_the_scheme_and_kernel_paths(work, caplog):
    caplog.set_level(logging.INFO, logger="qserve")
    folder = checkpoint(work, "fp8-vllm")
    llm = LLM(str(folder), kv_cache_memory="1MiB", kv_cache_dtype="fp8_e4m3")
    assert llm.engine.dtype == torch.bfloat16  # auto: bf16 activations for quantized on CPU
    assert "weights: fp8: fp8 w8a8 (static activations)" in caplog.text
    assert "q_proj     dequantized" in caplog.text
    assert "lm_head    dense (not quantized)" in caplog.text
    assert "merged into one matmul" not in caplog.text  # the dequantized path keeps its calls
    assert "FP8 KV pages: k_scale/v_scale from the checkpoint" in caplog.text
    assert "without calibrated scales" not in caplog.text
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert len(llm.generate(["Call me Ishmael."], params)[0].outputs[0].token_ids) == 8
