"""The model's fused-MoE path (`qserve.model.moe_fused`): SparseMoeBlocks whose experts are
stacked into w13 / w2 and run by `ops.fused_experts` give what the grouped-by-expert path gives.

Without CUDA the Triton kernel runs under the interpreter on CPU tensors (the fused path forced
with QSERVE_FUSED_MOE=1 and `ops._fused_moe_on_triton`); on CUDA (benchmarks/gpu_check.sh) the
same tests run the compiled kernel against the per-expert CUDA path (cuBLAS / Triton GPTQ).

Tolerance: max |fused - grouped| / max |grouped| of the logits (or block outputs). fp32: 1e-5,
summation order only (measured ~4e-7 on the tiny models). bf16: 2e-2, about five bf16 steps; the
two paths round to bf16 at different points (each token-expert pair's gate/up and down outputs
in the kernel, each expert's linear outputs per expert), which moves the tiny models' logits by
~6e-3 (measured up to 8e-3), about as far as bf16 moves them from fp32 on either path.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from qserve.errors import QServeError
from qserve.kernels import ops
from qserve.kernels import packing as P
from qserve.kernels.fp8_ref import quantize_weight_fp8_ref
from qserve.model import moe_fused
from qserve.model.config import ModelConfig
from qserve.model.llama import Linear
from qserve.model.loader import load_model
from qserve.model.moe import ExpertMLP, FusedMoE, SparseMoeBlock
from qserve.model.moe_fused import StackedExperts, fuse_experts, prepare_moe_blocks
from qserve.model.quant import AWQLinear, GPTQLinear, W8Linear, prepare_quant_linears
from qserve.model.quant_config import LinearScheme
from qserve.quantize.driver import quantize_model
from qserve.quantize.settings import QuantizeSettings
from tests.engine.greedy import engine_greedy
from tests.kernels.conftest import DEVICE
from tests.model.paged_batcher import PagedBatcher
from tests.tiny import byte_bpe_tokenizer
from tests.tiny_models import MOE_MODELS, TINY_MODELS, build_tiny_model

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
GPTQ = {"method": "gptq", "group_size": 32, "num_samples": 4, "seq_len": 64}
_cls, _hf = TINY_MODELS["qwen3-moe"]
CONFIG = ModelConfig.from_dict({**_hf.to_diff_dict(), "architectures": [_cls.__name__]})


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)  # tiny matrices: threads cost more than they save


@pytest.fixture(autouse=True)
def _triton_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """`ops.fused_experts` runs the Triton kernel: under the interpreter on CPU tensors."""
    monkeypatch.setattr(ops, "_fused_moe_on_triton", lambda t: True)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.float()
    return float((got.float() - want).abs().max() / want.abs().max())


# ---------------------------------------------------------------------- one block, each format


def gptq_layer(K: int, N: int, bits: int = 4, perm: torch.Tensor | None = None) -> GPTQLinear:
    """A GPTQ v1 layer of random codes, groups of 32 (act-order where `perm` is given)."""
    scheme = LinearScheme("gptq", bits=bits, group_size=32, desc_act=perm is not None)
    layer = GPTQLinear(scheme, K, N, bias=False, g_idx=perm is not None)
    G = K // 32
    layer.qweight = P.pack_gptq_qweight(torch.randint(0, 2**bits, (K, N), dtype=torch.int32), bits)
    layer.qzeros = P.pack_gptq_qzeros(torch.randint(1, 2**bits, (G, N), dtype=torch.int32), bits)
    layer.scales = (torch.rand(G, N) * 0.02 / 2 ** (bits - 4) + 0.002).half()
    if perm is not None:
        layer.g_idx = P.gptq_g_idx(K, 32, perm)
    return layer


def w8_layer(K: int, N: int, fmt: str, per_channel: bool) -> W8Linear:
    """A weight-only int8 / fp8 layer (W8A16), scales per channel or per tensor."""
    layer = W8Linear(LinearScheme(fmt), K, N, bias=False)
    w = torch.randn(N, K) * 0.05
    if fmt == "fp8":
        layer.weight, scale = quantize_weight_fp8_ref(w, per_channel)
    else:
        amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax()
        scale = (amax / 127).reshape(-1, 1) if per_channel else (amax / 127).reshape(1)
        layer.weight = (w / scale).round().clamp(-128, 127).to(torch.int8)
    layer.weight_scale = scale.reshape(-1, 1) if per_channel else scale.reshape(1)
    return layer


def act_order_perm(e: int, K: int, role: str) -> torch.Tensor:
    """One permutation per expert and input size: gate and up (one input) share it."""
    seed = 100 * e + K + (7 if role == "down" else 0)
    return torch.randperm(K, generator=torch.Generator().manual_seed(seed))


Make = Callable[[int, int, int, str], nn.Module]  # (K, N, expert, gate|up|down) -> layer
FORMATS: dict[str, Make | None] = {
    "dense": None,
    "gptq4": lambda K, N, e, role: gptq_layer(K, N),
    "gptq4-act-order": lambda K, N, e, role: gptq_layer(K, N, perm=act_order_perm(e, K, role)),
    "gptq8": lambda K, N, e, role: gptq_layer(K, N, bits=8),
    "int8-channel": lambda K, N, e, role: w8_layer(K, N, "int8", True),
    "fp8-tensor": lambda K, N, e, role: w8_layer(K, N, "fp8", False),
    "gptq4+int8": lambda K, N, e, role: (
        w8_layer(K, N, "int8", True) if role == "down" else gptq_layer(K, N)
    ),
}


def moe_block(make: Make | None) -> SparseMoeBlock:
    """The tiny Qwen3-MoE block (hidden 64, 4 experts of 96, top-2): random dense weights, the
    experts' linears replaced by `make`'s layers."""
    torch.manual_seed(0)
    block = SparseMoeBlock(CONFIG, Linear).requires_grad_(False)
    for p in block.parameters():
        nn.init.normal_(p, std=0.1)
    if make is not None:
        for e, expert in enumerate(block.experts):
            for role, name in zip(("gate", "up", "down"), expert.names, strict=True):
                linear = expert.get_submodule(name)
                setattr(expert, name, make(linear.in_features, linear.out_features, e, role))
    return block


@pytest.mark.parametrize("tokens", [1, 17])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_stacked_block_matches_grouped_by_expert(fmt, tokens):
    block = moe_block(FORMATS[fmt]).to(DEVICE)
    grouped = copy.deepcopy(block)
    prepare_quant_linears(grouped, torch.float32)
    grouped.merge()
    assert prepare_moe_blocks(block, mode="1")["experts"].startswith("fused-moe triton (w13 ")
    assert isinstance(block.experts, StackedExperts)
    assert not any(isinstance(m, ExpertMLP) for m in block.modules())  # one copy of the weights
    x = torch.randn(tokens, CONFIG.hidden_size, device=DEVICE)
    with torch.inference_mode():
        err = rel_err(block(x), grouped(x))
    assert err <= TOL[torch.float32], f"{fmt}: relative error {err:.2e}"


def test_stacked_layouts():
    """w13 is each expert's gate over its up; consecutive GPTQ groups need no g_idx, act-order
    ones keep each expert's; per-tensor W8 scales are stored per channel."""
    E, H, inter = CONFIG.num_experts, CONFIG.hidden_size, CONFIG.moe_intermediate_size
    block = moe_block(None)
    gate, up = block.experts[2].projections()[:2]
    w13, w2 = moe_fused.stack_experts(list(block.experts))
    assert w13.weight.shape == (E, 2 * inter, H) and w2.weight.shape == (E, H, inter)
    assert torch.equal(w13.weight[2], torch.cat([gate.weight, up.weight]))
    w13, w2 = moe_fused.stack_experts(list(moe_block(FORMATS["gptq4"]).experts))
    assert w13.g_idx is None and w2.g_idx is None
    assert w13.weight.shape == (E, H // 8, 2 * inter)
    assert w13.scales.shape == (E, H // 32, 2 * inter)
    w13, w2 = moe_fused.stack_experts(list(moe_block(FORMATS["gptq4-act-order"]).experts))
    assert w13.g_idx.shape == (E, H) and w2.g_idx.shape == (E, inter)
    w13, w2 = moe_fused.stack_experts(list(moe_block(FORMATS["fp8-tensor"]).experts))
    assert w13.weight.dtype == torch.float8_e4m3fn and w13.scales.shape == (E, 2 * inter)


def _unfusable(fmt: str) -> SparseMoeBlock:
    K_H, K_I = CONFIG.hidden_size, CONFIG.moe_intermediate_size
    block = moe_block(FORMATS["gptq4"])
    expert = block.experts[1]
    gate, up, down = expert.names
    if fmt == "awq":
        scheme = LinearScheme("awq", bits=4, group_size=32)
        setattr(expert, down, AWQLinear(scheme, K_I, K_H, bias=False))
    elif fmt == "w8a8":
        scheme = LinearScheme("int8", activations="token")
        setattr(expert, gate, W8Linear(scheme, K_H, K_I, bias=False))
    elif fmt == "mixed":
        setattr(expert, down, Linear(K_I, K_H, bias=False))
    elif fmt == "bias":
        setattr(expert, down, GPTQLinear(LinearScheme("gptq", 4, 32), K_I, K_H, True, False))
    elif fmt == "act-order":  # gate and up with different g_idx
        setattr(expert, gate, gptq_layer(K_H, K_I, perm=torch.randperm(K_H)))
        setattr(expert, up, gptq_layer(K_H, K_I, perm=torch.randperm(K_H)))
    return block


@pytest.mark.parametrize(
    "fmt,reason",
    [
        ("awq", "AWQ down experts"),
        ("w8a8", "int8 W8A8 gate/up experts"),
        ("mixed", "mixed down formats across experts (dense, gptq)"),
        ("bias", "down experts have biases"),
        ("act-order", "different act-order g_idx"),
    ],
)
def test_unfusable_experts_stay_per_expert_and_say_why(fmt, reason, monkeypatch, caplog):
    monkeypatch.setattr(moe_fused, "_warned", set())
    block = _unfusable(fmt)
    with caplog.at_level(logging.WARNING, logger="qserve"):
        paths = prepare_moe_blocks(block, mode="1")
    assert isinstance(block.experts, FusedMoE)
    assert paths["experts"].startswith("grouped by expert (not fused: "), paths
    assert reason in paths["experts"] and reason in caplog.text


def test_modes(monkeypatch):
    """auto: fused on CUDA only; 0: never; a bad QSERVE_FUSED_MOE is refused."""
    block = moe_block(None).to(DEVICE)
    assert prepare_moe_blocks(block, mode="0") == {"experts": "grouped by expert"}
    monkeypatch.setattr(ops, "_fused_moe_on_triton", ops.use_triton)
    want = "fused-moe triton (w13 dense, w2 dense)" if DEVICE == "cuda" else "grouped by expert"
    assert prepare_moe_blocks(block, mode="auto") == {"experts": want}
    assert prepare_moe_blocks(nn.Linear(2, 2)) == {}  # no MoE block: no report line
    monkeypatch.setenv(moe_fused.ENV_VAR, "yes")
    with pytest.raises(QServeError, match=moe_fused.ENV_VAR):
        prepare_moe_blocks(moe_block(None))


def test_merge_and_state_dict_of_a_stacked_block():
    block = moe_block(FORMATS["gptq4"])
    fuse_experts(block)
    assert block.merge()  # gate and up: one GEMM in w13
    names = set(block.state_dict())
    assert {"experts.w13_weight", "experts.w13_scales", "experts.w2_qzeros"} <= names
    assert not any(n.startswith("experts.0.") for n in names)


# ------------------------------------------------------------------ tiny models, end to end


@functools.cache
def checkpoint(root: Path, arch: str, fmt: str) -> Path:
    """The tiny `arch` model (with the 1000-token tokenizer), dense or GPTQ w4 g32."""
    base = root / arch
    if not base.exists():
        tokenizer = byte_bpe_tokenizer()
        build_tiny_model(arch, vocab_size=len(tokenizer)).save_pretrained(base)
        tokenizer.save_pretrained(base)
    if fmt == "dense":
        return base
    return quantize_model(base, root / f"{arch}-{fmt}", QuantizeSettings(**GPTQ))


def load(folder: Path, dtype: torch.dtype, fused: bool, monkeypatch) -> nn.Module:
    monkeypatch.setenv(moe_fused.ENV_VAR, "1" if fused else "0")
    model, _ = load_model(folder, dtype, DEVICE)
    return model


def logits(model: nn.Module, lengths: tuple[int, ...]) -> torch.Tensor:
    """Logits of one flat batch of random prompts of `lengths` tokens, on DEVICE."""
    config = model.config
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    batcher = PagedBatcher(config)
    dtype = model.lm_head.weight.dtype if hasattr(model.lm_head, "weight") else torch.float32
    batcher.kv_caches = [c.to(DEVICE, dtype) for c in batcher.kv_caches]
    step = batcher.step(list(enumerate(prompts)))
    md = step.attn_metadata
    moved = {
        f.name: getattr(md, f.name).to(DEVICE)
        for f in dataclasses.fields(md)
        if isinstance(getattr(md, f.name), torch.Tensor)
    }
    md = dataclasses.replace(md, **moved)
    with torch.inference_mode():
        ids, positions = step.input_ids.to(DEVICE), step.positions.to(DEVICE)
        return model.compute_logits(model(ids, positions, batcher.kv_caches, md)).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt", ["dense", "gptq"])
@pytest.mark.parametrize("arch", sorted(MOE_MODELS))
def test_fused_moe_logits_match_grouped_by_expert(arch, fmt, dtype, monkeypatch, tmp_path_factory):
    folder = checkpoint(tmp_path_factory.getbasetemp() / "moe-fused", arch, fmt)
    grouped = load(folder, dtype, False, monkeypatch)
    fused = load(folder, dtype, True, monkeypatch)
    kind = "dense" if fmt == "dense" else "gptq w4"
    assert grouped.load_report.linear_paths["experts"] == "grouped by expert"
    want = f"fused-moe triton (w13 {kind}, w2 {kind})"
    assert fused.load_report.linear_paths["experts"] == want
    for lengths in [(40, 9), (1,)]:  # a prefill batch, and one decode-sized token
        err = rel_err(logits(fused, lengths), logits(grouped, lengths))
        assert err <= TOL[dtype], f"{arch} {fmt} {lengths}: relative logits error {err:.2e}"


@pytest.mark.parametrize("arch", sorted(MOE_MODELS))
def test_fused_moe_torch_reference_matches_grouped_by_expert(arch, monkeypatch, tmp_path_factory):
    """`ops.fused_experts`'s torch path (what a forced fused block runs on CPU by default)."""
    monkeypatch.setattr(ops, "_fused_moe_on_triton", lambda t: False)
    folder = checkpoint(tmp_path_factory.getbasetemp() / "moe-fused", arch, "gptq")
    fused = load(folder, torch.float32, True, monkeypatch)
    assert fused.load_report.linear_paths["experts"].startswith("fused-moe torch")
    want = logits(load(folder, torch.float32, False, monkeypatch), (40, 9))
    assert rel_err(logits(fused, (40, 9)), want) <= TOL[torch.float32]


def test_engine_greedy_generation_fused_equals_grouped(monkeypatch, tmp_path_factory):
    """The engine serves a GPTQ Mixtral through the fused path (prefill and decode steps): the
    greedy tokens of the grouped-by-expert path."""
    folder = checkpoint(tmp_path_factory.getbasetemp() / "moe-fused", "mixtral", "gptq")
    prompts = [[5, 17, 300, 2, 99, 41, 7], [11, 400, 3]]
    outs = []
    for mode in ("0", "1"):
        monkeypatch.setenv(moe_fused.ENV_VAR, mode)
        llm, tokens = engine_greedy(folder, prompts, 8, device=DEVICE, kv_cache_memory="4MiB")
        outs.append(tokens)
    assert llm.engine.load_report.linear_paths["experts"].startswith("fused-moe triton")
    assert outs[0] == outs[1]
