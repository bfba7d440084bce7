"""Interop with the tools users already have (ARCHITECTURE.md section 4), on the tiny random
Llama of `_helpers.make_tiny_model` (hidden 128, intermediate 256: group size 32 divides every
in_features).

    a  our GPTQ export                  -> transformers (optimum + gptqmodel kernels)
    b  our AWQ export                   -> transformers' AWQ loader (gptqmodel kernels)
    c  gptqmodel 7.6.0 GPTQ checkpoint  -> qserve, against gptqmodel's loader and transformers
    d  autoawq 0.2.9 AWQ checkpoint     -> qserve, against autoawq's loader and transformers
    e  the quantization_config each tool writes parses, or fails at load in one line
    f  autoawq 0.2.9's CPU scale-search bug, and the workaround our benchmark and tests use

qserve's side is its own model (`load_model`) over a paged KV cache, in fp32 and, for
third-party checkpoints, in bf16 too (4-bit layers on the C++ CPU kernel, or torch's int4 kernel
where it did not build; fp32 without either: dequantized weights). Every comparison
is on the logits of one 40-token prompt: err = max |ours - theirs| / max |theirs|. Tolerances, by
what differs between the two sides (measured on this machine in brackets):

    SAME_FP32  2e-3  both dequantize the same codes with the same fp16 scales and run in fp32:
                     summation order, and fp16 weights in gptqmodel's AWQ torch kernel
                     (3.4e-4 to 6.9e-4)
    FP16       5e-3  the other side runs the whole model in fp16: autoawq's loader, gptqmodel's
                     own loader (8.8e-4 to 1.0e-3)
    BF16       2e-2  a bf16 step on one side: transformers' default CPU kernel for GPTQ/AWQ
                     (gptqmodel's TorchAten*: torch's int4 kernel on bf16 activations), or
                     qserve's own bf16 path against its fp32 one (4.5e-3 to 8.1e-3)

A layout error is far outside all of them: the checkpoints' whole quantization error is
0.17-0.19 on the same measure, and corrupting a single linear of a gptqmodel checkpoint (one
zero point off by one, two rows swapped, g_idx ignored) moves the logits by 0.07-0.28.
Third-party packages are optional (`importorskip`); the `test` extra installs them.
"""

from __future__ import annotations

import functools
import importlib
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks import third_party
from qserve.errors import QServeError
from qserve.kernels import cpu_w4a16
from qserve.model.loader import load_model
from qserve.model.quant_config import parse_quant_scheme
from qserve.quantize.calibration import calibration_windows, load_calibration_text
from tests.model.paged_batcher import PagedBatcher

SAME_FP32, FP16, BF16 = 2e-3, 5e-3, 2e-2
CALIB = dict(num_samples=4, seq_len=64)
GROUP_SIZE = 32
PROMPT_LEN = 40
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("interop")


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, 320, (PROMPT_LEN,), generator=gen).tolist()


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


@pytest.fixture(scope="module")
def gptqmodel() -> Any:
    """gptqmodel, imported once (10-20 s), with optimum: transformers loads GPTQ and AWQ
    checkpoints through them. Tests that use it skip where they are not installed."""
    pytest.importorskip("optimum")
    try:
        return third_party.import_gptqmodel()
    except ImportError as exc:
        pytest.skip(f"could not import 'gptqmodel': {exc}")


@pytest.fixture(scope="module")
def awq(gptqmodel: Any) -> Any:
    try:
        return third_party.import_autoawq()
    except ImportError as exc:
        pytest.skip(f"could not import 'awq': {exc}")


# ------------------------------------------------------------------------------------ logits


def ours(
    folder: Path, prompt: list[int], dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, dict[str, str]]:
    """qserve's logits of `prompt` as one prefill over a paged KV cache ([len, vocab] fp32),
    and the kernel path of each kind of linear."""
    model, config = load_model(folder, dtype)
    batcher = PagedBatcher(config)
    step = batcher.step([(0, prompt)])
    with torch.inference_mode():
        hidden = model(step.input_ids, step.positions, batcher.kv_caches, step.attn_metadata)
        return model.compute_logits(hidden).float(), model.load_report.linear_paths


def forward(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([prompt])).logits[0].float()


def assert_quantized(model: torch.nn.Module) -> None:
    """Every decoder linear is a quantized module holding packed weights, none a dense one."""
    for layer in model.model.layers:
        modules = {n: m for n, m in layer.named_modules() if n.rpartition(".")[2] in LINEARS}
        assert len(modules) == len(LINEARS)
        for name, module in modules.items():
            assert not isinstance(module, torch.nn.Linear), name
            assert isinstance(getattr(module, "qweight", None), torch.Tensor), name


def transformers_model(folder: Path, method: str, backend: str | None) -> torch.nn.Module:
    """transformers' own loader (fp32); `backend` picks gptqmodel's kernel (None: its default)."""
    from transformers import AutoModelForCausalLM, AwqConfig, GPTQConfig

    kwargs = {}
    if backend is not None:
        config_class = GPTQConfig if method == "gptq" else AwqConfig
        kwargs["quantization_config"] = config_class(bits=4, backend=backend)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs).eval()
    assert_quantized(model)
    return model


# backend -> tolerance: "torch" / "torch_awq" dequantize and matmul in the model's dtype (fp32);
# the default on this CPU (TorchAten*) runs torch's int4 kernel on bf16 activations.
GPTQ_BACKENDS = {"torch": SAME_FP32, None: BF16}
AWQ_BACKENDS = {"torch_awq": SAME_FP32, None: BF16}


# ------------------------------------------------------------------- a, b: our exports loaded


@functools.cache
def our_checkpoint(root: Path, method: str, desc_act: bool, sym: bool) -> Path:
    from qserve.quantize.driver import quantize_model
    from qserve.quantize.settings import QuantizeSettings

    name = f"{method}-{'act' if desc_act else 'natural'}-{'sym' if sym else 'asym'}"
    kwargs = dict(desc_act=desc_act, sym=sym) if method == "gptq" else {}
    return quantize_model(
        root / "base",
        root / name,
        QuantizeSettings(method=method, group_size=GROUP_SIZE, **kwargs, **CALIB),
    )


@pytest.fixture(scope="module")
def root(work: Path, tiny_llama: Path) -> Path:
    base = work / "base"
    if not base.exists():
        base.symlink_to(tiny_llama, target_is_directory=True)
    return work


@pytest.mark.parametrize("backend", list(GPTQ_BACKENDS), ids=["torch", "default"])
@pytest.mark.parametrize(
    "desc_act, sym",
    [(False, True), (True, True), (True, False)],
    ids=["natural-sym", "act-sym", "act-asym"],
)
def test_our_gptq_export_loads_in_transformers(gptqmodel, root, prompt, desc_act, sym, backend):
    folder = our_checkpoint(root, "gptq", desc_act, sym)
    theirs = forward(transformers_model(folder, "gptq", backend), prompt)
    err = rel_err(ours(folder, prompt)[0], theirs)
    assert err <= GPTQ_BACKENDS[backend], f"relative logits error {err:.2e}"


@pytest.mark.parametrize("backend", list(AWQ_BACKENDS), ids=["torch_awq", "default"])
def test_our_awq_export_loads_in_transformers(gptqmodel, root, prompt, backend):
    folder = our_checkpoint(root, "awq", False, False)
    theirs = forward(transformers_model(folder, "awq", backend), prompt)
    err = rel_err(ours(folder, prompt)[0], theirs)
    assert err <= AWQ_BACKENDS[backend], f"relative logits error {err:.2e}"


# ------------------------------------------------------- c, d: third-party checkpoints loaded


@pytest.fixture(scope="module")
def calib_ids(tiny_llama: Path) -> torch.Tensor:
    """The windows `quantize_model` calibrates on with these settings: [4, 64]."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    return calibration_windows(tokenizer, load_calibration_text(), **CALIB)


@functools.cache
def gptqmodel_checkpoint(root: Path, calib_ids: torch.Tensor, desc_act: bool, sym: bool) -> Path:
    out = root / f"gptqmodel-{'act' if desc_act else 'natural'}-{'sym' if sym else 'asym'}"
    third_party.gptqmodel_quantize(
        root / "base", out, calib_ids, group_size=GROUP_SIZE, desc_act=desc_act, sym=sym
    )
    return out


def assert_bf16_path_matches(folder: Path, prompt: list[int]) -> None:
    """qserve's bf16 path (the C++ kernel, or torch's int4 kernel where it did not build) on the
    same checkpoint, against its fp32 path."""
    got, paths = ours(folder, prompt, torch.bfloat16)
    err = rel_err(got, ours(folder, prompt)[0])
    path = "cpu-w4a16" if cpu_w4a16.available() else "cpu-int4pack"
    assert paths == {**dict.fromkeys(paths, path), "lm_head": "dense (not quantized)"}
    assert err <= BF16, f"bf16 against fp32: relative logits error {err:.2e}"


@pytest.mark.parametrize(
    "desc_act, sym", [(True, True), (False, False)], ids=["act-sym", "natural-asym"]
)
def test_gptqmodel_checkpoint_loads_in_qserve(gptqmodel, root, calib_ids, prompt, desc_act, sym):
    folder = gptqmodel_checkpoint(root, calib_ids, desc_act, sym)
    model, _ = load_model(folder, torch.float32)
    act_order = " act-order" if desc_act else ""
    assert model.load_report.scheme == f"gptq: gptq w4a16 g{GROUP_SIZE}{act_order}"
    got, _ = ours(folder, prompt)

    # gptqmodel's own loader, with its torch kernel (fp16 or bf16 only). Not its default on CPU:
    # that picks TorchFusedLinear, which is wrong on asymmetric checkpoints (relative logits
    # error ~1.0 against transformers and qserve, which agree at 3e-4).
    loaded = gptqmodel.GPTQModel.load(
        str(folder), backend=gptqmodel.BACKEND.TORCH, device="cpu", dtype=torch.float16
    )
    err = rel_err(got, forward(loaded.model, prompt))
    assert err <= FP16, f"against gptqmodel's loader: relative logits error {err:.2e}"

    theirs = forward(transformers_model(folder, "gptq", "torch"), prompt)
    err = rel_err(got, theirs)
    assert err <= SAME_FP32, f"against transformers: relative logits error {err:.2e}"
    assert_bf16_path_matches(folder, prompt)


@functools.cache
def autoawq_checkpoint(root: Path, calib_ids: torch.Tensor) -> Path:
    out = root / "autoawq"
    third_party.autoawq_quantize(root / "base", out, calib_ids, group_size=GROUP_SIZE)
    return out


def autoawq_model(awq: Any, folder: Path, monkeypatch: pytest.MonkeyPatch) -> torch.nn.Module:
    """autoawq's `from_quantized` on CPU, in fp16 (its only dtype there).

    On CPU it insists on intel_extension_for_pytorch (no build for torch 2.13), and with triton
    installed its GEMM calls Triton kernels that need a GPU; both are side-stepped (for the rest
    of the test) so that WQLinear_GEMM takes its own torch path: `dequantize_gemm` + matmul."""
    awq_base = importlib.import_module("awq.models.base")
    awq_gemm = importlib.import_module("awq.modules.linear.gemm")

    monkeypatch.setattr(awq_base, "get_best_device", lambda: "cuda:0")  # skips the ipex check
    monkeypatch.setattr(awq_gemm, "TRITON_AVAILABLE", False)
    with third_party.quiet():
        loaded = awq.AutoAWQForCausalLM.from_quantized(
            str(folder), torch_dtype=torch.float16, device_map={"": "cpu"}, fuse_layers=False
        )
    assert_quantized(loaded.model)
    return loaded.model


def test_autoawq_checkpoint_loads_in_qserve(awq, root, calib_ids, prompt, monkeypatch):
    folder = autoawq_checkpoint(root, calib_ids)
    model, _ = load_model(folder, torch.float32)
    assert model.load_report.scheme == f"awq: awq w4a16 g{GROUP_SIZE}"
    got, _ = ours(folder, prompt)

    err = rel_err(got, forward(autoawq_model(awq, folder, monkeypatch), prompt))
    assert err <= FP16, f"against autoawq's loader: relative logits error {err:.2e}"

    theirs = forward(transformers_model(folder, "awq", "torch_awq"), prompt)
    err = rel_err(got, theirs)
    assert err <= SAME_FP32, f"against transformers: relative logits error {err:.2e}"
    assert_bf16_path_matches(folder, prompt)


def scale_search_changes_weights(quantizer_cls: type) -> bool:
    """Run autoawq's per-linear scale search once on CPU; did it leave the weights changed?"""
    quantizer = quantizer_cls.__new__(quantizer_cls)  # only what `_compute_best_scale` reads
    quantizer.__dict__.update(
        w_bit=4, group_size=32, zero_point=True, duo_scaling=True,
        max_chunk_memory=2**30, n_parallel_calib_samples=None,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(64, 32, bias=False)
    with torch.no_grad():  # input channels of different sizes, as in trained weights
        linear.weight.copy_(torch.randn(32, 64, generator=gen) * torch.rand(64, generator=gen) * 4)
        before = linear.weight.clone()
        x = torch.randn(1, 16, 64, generator=gen)
        x_mean = x.abs().mean(dim=(0, 1))
        w_mean = linear.weight.abs().mean(dim=0)
        quantizer._compute_best_scale(x, w_mean, x_mean, linear, [linear], linear(x))
    return not torch.equal(linear.weight, before)


def test_autoawq_cpu_scale_search_bug_is_worked_around(awq):
    """autoawq 0.2.9 on CPU leaves the weights multiplied by its first grid point's scales
    (see `third_party.cpu_safe_quantizer`); the quantizer our benchmark and tests use does not."""
    upstream = importlib.import_module("awq.quantize.quantizer").AwqQuantizer
    assert scale_search_changes_weights(upstream)
    assert not scale_search_changes_weights(third_party.cpu_safe_quantizer())


# ------------------------------------------------------------- configs as the tools write them

# quantization_config of a gptqmodel 7.6.0 checkpoint (`meta` trimmed: damp_percent,
# static_groups and true_sequential live there now, not at the top level).
GPTQMODEL_GPTQ = {
    "bits": 4,
    "group_size": 32,
    "desc_act": True,
    "lm_head": False,
    "method": "gptq",
    "quant_method": "gptq",
    "format": "gptq",
    "checkpoint_format": "gptq",
    "pack_dtype": "int32",
    "meta": {"quantizer": ["gptqmodel:7.6.0"], "damp_percent": 0.01, "act_group_aware": False},
    "sym": True,
}
AUTOAWQ = {
    "bits": 4,
    "group_size": 32,
    "modules_to_not_convert": None,
    "quant_method": "awq",
    "version": "gemm",
    "zero_point": True,
}
# gptqmodel's own AWQ config (its AWQ quantizer needs CUDA): symmetric by default.
GPTQMODEL_AWQ = {
    **{k: GPTQMODEL_GPTQ[k] for k in ("bits", "desc_act", "lm_head", "pack_dtype")},
    "group_size": 128,
    "method": "awq",
    "quant_method": "awq",
    "format": "gemm",
    "checkpoint_format": "gemm",
    "zero_point": False,
    "version": "gemm",
}


@pytest.mark.parametrize(
    "raw, expected",
    [
        (GPTQMODEL_GPTQ, "gptq: gptq w4a16 g32 act-order"),
        ({**GPTQMODEL_GPTQ, "desc_act": False, "sym": False}, "gptq: gptq w4a16 g32"),
        (AUTOAWQ, "awq: awq w4a16 g32"),
        ({**GPTQMODEL_GPTQ, "pack_dtype": "int16"}, "GPTQ pack_dtype 'int16' is not supported"),
        ({**GPTQMODEL_GPTQ, "format": "gptq_v2", "checkpoint_format": "gptq_v2"}, "gptq_v2"),
        (GPTQMODEL_AWQ, "AWQ without zero points is not supported"),
        ({**AUTOAWQ, "version": "gemv"}, "AWQ version 'gemv' is not supported"),
    ],
    ids=["gptqmodel", "gptqmodel-asym", "autoawq", "int16", "v2", "gptqmodel-awq", "gemv"],
)
def test_third_party_configs_parse_or_fail_in_one_line(raw, expected):
    if expected.startswith(("gptq:", "awq:")):
        assert parse_quant_scheme(raw).describe() == expected
        return
    with pytest.raises(QServeError, match=expected) as info:
        parse_quant_scheme(raw)
    assert "\n" not in str(info.value)


# --------------------------------------------- a, b for the other architectures: Gemma 3, ...

OTHER_ARCHS = ("gemma3", "qwen3", "phi3")


@functools.cache
def other_checkpoint(root: Path, arch: str, method: str) -> Path:
    """Our `method` export of the tiny `arch` model (with the 1000-token tokenizer)."""
    from qserve.quantize.driver import quantize_model
    from qserve.quantize.settings import QuantizeSettings
    from tests.tiny import byte_bpe_tokenizer
    from tests.tiny_models import build_tiny_model

    base = root / f"{arch}-base"
    if not base.exists():
        tokenizer = byte_bpe_tokenizer()
        build_tiny_model(arch, vocab_size=len(tokenizer)).save_pretrained(base)
        tokenizer.save_pretrained(base)
    settings = QuantizeSettings(method=method, group_size=GROUP_SIZE, **CALIB)
    return quantize_model(base, root / f"{arch}-{method}", settings)


@pytest.mark.parametrize("method", ["gptq", "awq"])
@pytest.mark.parametrize("arch", OTHER_ARCHS)
def test_our_exports_of_other_architectures_load_in_transformers(gptqmodel, work, arch, method):
    from transformers import AutoModelForCausalLM, AwqConfig, GPTQConfig

    folder = other_checkpoint(work, arch, method)
    config = (GPTQConfig if method == "gptq" else AwqConfig)(
        bits=4, backend="torch" if method == "gptq" else "torch_awq"
    )
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                 quantization_config=config).eval()  # fmt: skip
    packed = [n for n, m in model.named_modules() if isinstance(getattr(m, "qweight", None),
                                                                torch.Tensor)]  # fmt: skip
    per_layer = 4 if arch == "phi3" else 7  # Phi-3: qkv, o, gate_up, down
    assert len(packed) == 2 * per_layer  # every decoder linear of both layers
    prompt = torch.randint(0, 1000, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1))
    err = rel_err(ours(folder, prompt.tolist())[0], forward(model, prompt.tolist()))
    assert err <= SAME_FP32, f"{arch} {method}: relative logits error {err:.2e}"
