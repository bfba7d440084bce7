"""Quantizing mixture-of-experts models: the calibration block computes what transformers'
does, each expert sees exactly the tokens routed to it, an expert no token reaches is rounded to
nearest (and recorded), checkpoint names are the Hub's, and offloading changes nothing."""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qserve.kernels import packing
from qserve.model.loader import load_model
from qserve.model.quant import QuantLinear
from qserve.quantize import moe
from qserve.quantize.arch import arch_spec
from qserve.quantize.block_context import BlockContext, Reference
from qserve.quantize.calibration import calibration_windows, load_calibration_text
from qserve.quantize.capture import capture_block_inputs
from qserve.quantize.driver import SEARCH_FILE, quantize_model
from qserve.quantize.fold import ScaleResult
from qserve.quantize.rtn import rtn_quantize
from qserve.quantize.settings import QuantizeSettings
from tests.quantize.test_offload import _assert_same_checkpoint
from tests.tiny import byte_bpe_tokenizer
from tests.tiny_models import TINY_MODELS, build_tiny_model

MODEL_TYPES = {"mixtral": "mixtral", "qwen3-moe": "qwen3_moe"}
CALIB = dict(num_samples=4, seq_len=32)


@functools.cache
def saved(root: Path, arch: str) -> Path:
    """The tiny `arch` model with a tokenizer, saved as transformers saves it."""
    folder = root / arch
    tokenizer = byte_bpe_tokenizer()
    build_tiny_model(arch, vocab_size=len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("moe")


# ------------------------------------------------------------------------ calibration blocks


@pytest.mark.parametrize("arch", list(MODEL_TYPES))
def test_calibration_block_computes_what_transformers_computes(arch):
    model = build_tiny_model(arch)
    hf_block = copy.deepcopy(model.model.layers[0].mlp)
    ids = torch.randint(0, TINY_MODELS[arch][1].vocab_size, (2, 29))
    x = torch.randn(3, 17, model.config.hidden_size)
    with torch.no_grad():
        want_logits, want = model(input_ids=ids).logits, hf_block(x)
        assert moe.prepare_moe(model, arch_spec(MODEL_TYPES[arch])) > 0
        block = model.model.layers[0].mlp
        assert isinstance(block, moe.CalibrationMoe)
        torch.testing.assert_close(block(x), want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(model(input_ids=ids).logits, want_logits, rtol=0, atol=1e-5)
    assert moe.prepare_moe(model, arch_spec(MODEL_TYPES[arch])) == 0  # already replaced


def test_qwen3_moe_dense_layers_keep_the_dense_spec():
    model = build_tiny_model("qwen3-moe")
    spec = arch_spec("qwen3_moe")
    moe.prepare_moe(model, spec)
    sparse, dense = (spec.for_block(layer) for layer in model.model.layers)
    assert dense is spec and sparse.num_experts == 4
    assert sparse.sequential[2][:3] == (
        "mlp.gate",
        "mlp.experts.0.gate_proj",
        "mlp.experts.0.up_proj",
    )
    norm = next(m for m in sparse.mappings if m.prev == "post_attention_layernorm")
    assert norm.linears[0] == "mlp.gate" and len(norm.linears) == 1 + 2 * 4
    assert [m.prev for m in sparse.mappings[3:]] == [f"mlp.experts.{e}.up_proj" for e in range(4)]


def test_checkpoint_names():
    name = arch_spec("mixtral").checkpoint_name
    assert name("model.layers.3.mlp.experts.0.w1.qweight") == (
        "model.layers.3.block_sparse_moe.experts.0.w1.qweight"
    )
    assert name("model.layers.3.mlp.gate") == "model.layers.3.block_sparse_moe.gate"
    assert name("model.layers.3.self_attn.q_proj") == "model.layers.3.self_attn.q_proj"
    qwen = arch_spec("qwen3_moe").checkpoint_name
    assert (
        qwen("model.layers.0.mlp.experts.1.down_proj") == "model.layers.0.mlp.experts.1.down_proj"
    )


def block_context(arch: str, gptaq: bool = False) -> tuple[BlockContext, torch.nn.Module]:
    """Block 0 of the tiny `arch` model with calibration inputs, and transformers' MoE block."""
    tokenizer = byte_bpe_tokenizer()
    model = build_tiny_model(arch, vocab_size=len(tokenizer))
    hf_moe = copy.deepcopy(model.model.layers[0].mlp)
    spec = arch_spec(MODEL_TYPES[arch])
    moe.prepare_moe(model, spec)
    ids = calibration_windows(tokenizer, load_calibration_text()[:6000], 4, 32)
    blocks = model.model.layers
    with torch.no_grad():
        X, kwargs = capture_block_inputs(model, blocks, ids)
    block = blocks[0]
    block_spec = spec.for_block(block)
    reference = Reference.run(block, block_spec, X, kwargs[0]) if gptaq else None
    settings = QuantizeSettings(method="gptq", **CALIB)
    ctx = BlockContext(block, "model.layers.0.", block_spec, settings, X, kwargs[0], reference)
    return ctx, hf_moe


@pytest.mark.parametrize("arch", list(MODEL_TYPES))
def test_each_expert_sees_exactly_its_routed_tokens(arch):
    ctx, hf_moe = block_context(arch)
    moe_inputs = []
    handle = ctx.block.mlp.register_forward_pre_hook(lambda m, a: moe_inputs.append(a[0]))
    with torch.no_grad():
        for x in ctx.X:
            ctx.block(x, **ctx.kwargs)
    handle.remove()
    x = torch.cat([h.reshape(-1, h.shape[-1]) for h in moe_inputs])
    _, _, top_k = hf_moe.gate(x)  # transformers' router on the same hidden states
    routed = torch.bincount(top_k.flatten(), minlength=4).tolist()
    assert 0 < min(routed) and sum(routed) == 2 * len(x)  # top-2: (token, k) pairs

    experts = [n for n in ctx.names if ".experts." in n]
    with torch.no_grad():
        rows = ctx.collect(experts, lambda acc, v: (acc or 0) + len(v))
        sums = ctx.collect(experts, lambda acc, v: v.sum(0) + (0 if acc is None else acc))
    for e in range(4):
        for name in [n for n in experts if f".experts.{e}." in n]:
            assert rows[name] == routed[e], name
        gate = next(n for n in experts if f".experts.{e}." in n)
        mine = (top_k == e).any(dim=1)  # tokens routed to e (at most once per token)
        torch.testing.assert_close(sums[gate], x[mine].sum(0), rtol=1e-5, atol=1e-5)


def test_gptaq_pairs_an_expert_with_the_float_inputs_of_its_tokens():
    """Before any linear is quantized the two streams agree: each expert's float inputs, taken
    at the tokens the (quantized) block routed to it, equal its own inputs row by row."""
    ctx, _ = block_context("mixtral", gptaq=True)
    names = [n for n in ctx.spec.linears if ".experts." in n]

    def step(acc, x, x_fp):
        assert x.shape == x_fp.shape
        return max(acc or 0.0, float((x - x_fp).abs().max()))

    with torch.no_grad():
        diffs = ctx.collect_paired(names, step)
    assert set(diffs) == set(names) and max(diffs.values()) == 0.0


@pytest.mark.parametrize("method", ["awq", "int8"])
def test_scales_fold_into_the_router_too(method, root, tmp_path):
    """AWQ / SmoothQuant fold into post_attention_layernorm -> (router, every expert's gate and
    up): with the router's columns scaled as well, the float model computes what it did."""
    kw = dict(group_size=32) if method == "awq" else {}
    folder = quantize_model(
        saved(root, "mixtral"), tmp_path / method, QuantizeSettings(method=method, **kw, **CALIB)
    )
    search = ScaleResult.load(folder / SEARCH_FILE)
    norm = "model.layers.0.post_attention_layernorm"
    assert search.linears[norm][:2] == [
        "model.layers.0.mlp.gate",
        "model.layers.0.mlp.experts.0.w1",
    ]
    model = build_tiny_model("mixtral", vocab_size=len(byte_bpe_tokenizer()))
    moe.prepare_moe(model, arch_spec("mixtral"))
    ids = torch.randint(0, model.config.vocab_size, (2, 40))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        ScaleResult(scales=search.scales, linears=search.linears).apply(model)  # no clips
        got = model(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * float(want.abs().max()))


# ------------------------------------------------------------------------ few-token fallback


def never_expert_3(monkeypatch: pytest.MonkeyPatch) -> None:
    """Calibration routes no token to expert 3 (its router logit is -inf)."""
    route = moe.route

    def without_3(logits, top_k, renormalize):
        logits = logits.clone()
        logits[:, 3] = float("-inf")
        return route(logits, top_k, renormalize)

    monkeypatch.setattr(moe, "route", without_3)


FALLBACK_CASES = {
    "gptq": dict(method="gptq", group_size=32),
    "awq": dict(method="awq", group_size=32),
    "int8-static": dict(method="int8", activation_scheme="static"),
}


@pytest.mark.parametrize("case", list(FALLBACK_CASES))
def test_an_expert_no_token_reaches_is_rounded_to_nearest(case, root, tmp_path, monkeypatch):
    never_expert_3(monkeypatch)
    model = saved(root, "mixtral")
    settings = QuantizeSettings(**FALLBACK_CASES[case], **CALIB)
    folder = quantize_model(model, tmp_path / case, settings)
    made_by = json.loads((folder / "qserve_recipe.json").read_text())
    fallback = made_by["few_token_fallback"]
    expert3 = [
        f"model.layers.{i}.block_sparse_moe.experts.3.w{j}" for i in (0, 1) for j in (1, 3, 2)
    ]
    assert fallback["linears"] == dict.fromkeys(expert3, 0)
    assert "rounded to nearest" in fallback["rule"]
    tensors = load_file(str(folder / "model.safetensors"))
    float_weights = load_file(str(model / "model.safetensors"))
    prefix = "model.layers.0.block_sparse_moe.experts"
    if case == "gptq":  # RTN codes of the float weights (GPTQ leaves other weights alone)
        W = float_weights[f"{prefix}.3.w1.weight"]
        codes = rtn_quantize(W, 4, 32, sym=True, min_zero=1).Q
        assert torch.equal(
            tensors[f"{prefix}.3.w1.qweight"], packing.pack_gptq_qweight(codes.t(), 4)
        )
    if case == "awq":  # no scales of its own, no clip search
        search = ScaleResult.load(folder / SEARCH_FILE)
        assert f"{prefix.replace('block_sparse_moe', 'mlp')}.3.w3" not in search.scales
        assert f"{prefix.replace('block_sparse_moe', 'mlp')}.2.w3" in search.scales
        assert not any(".experts.3." in name for name in search.clips)
    if case == "int8-static":  # the largest input scale of its projection
        for j in (1, 2, 3):
            scales = [tensors[f"{prefix}.{e}.w{j}.input_scale"] for e in range(4)]
            assert torch.equal(scales[3], torch.stack(scales[:3]).amax(0))
    served, _ = load_model(folder, torch.float32)
    expert = served.model.layers[0].mlp.experts[3]
    assert all(isinstance(p, QuantLinear) for p in expert.projections())


# ------------------------------------------------------------------------ names and offload


@pytest.mark.parametrize("method", ["rtn", "fp8"])
def test_ignored_experts_by_checkpoint_name(method, root, tmp_path):
    kw = dict(group_size=32) if method == "rtn" else dict(gptq_weights=False)
    ignore = ("lm_head", "block_sparse_moe.experts.0.w2")
    folder = quantize_model(
        saved(root, "mixtral"),
        tmp_path / method,
        QuantizeSettings(method=method, ignore=ignore, **kw),
    )
    tensors = load_file(str(folder / "model.safetensors"))
    assert "model.layers.1.block_sparse_moe.experts.0.w2.weight" in tensors
    served, _ = load_model(folder, torch.float32)
    for layer in served.model.layers:
        gate, up, down = layer.mlp.experts[0].projections()
        assert isinstance(down, torch.nn.Linear) and isinstance(gate, QuantLinear)
        assert isinstance(layer.mlp.experts[1].projections()[2], QuantLinear)
        assert isinstance(layer.mlp.gate, torch.nn.Linear)


@pytest.mark.parametrize("method", ["gptq", "awq"])
@pytest.mark.parametrize("arch", list(MODEL_TYPES))
def test_offload_gives_the_same_moe_checkpoint(arch, method, root, tmp_path):
    kw = dict(method=method, group_size=32, calib="moby-dick", **CALIB)  # offload: a text
    model = saved(root, arch)
    plain = quantize_model(model, tmp_path / "plain", QuantizeSettings(**kw))
    offloaded = quantize_model(
        model, tmp_path / "offloaded", QuantizeSettings(**kw), offload_dir=tmp_path / "off"
    )
    _assert_same_checkpoint(plain, offloaded)


def test_replayed_search(root, tmp_path):
    """A saved AWQ search (per-expert names) replays into the same checkpoint."""
    kw = dict(method="awq", group_size=32, **CALIB)
    model = saved(root, "qwen3-moe")
    searched = quantize_model(model, tmp_path / "searched", QuantizeSettings(**kw))
    replayed = quantize_model(
        model, tmp_path / "replayed", QuantizeSettings(**kw), scales=searched / SEARCH_FILE
    )
    a = load_file(str(searched / "model.safetensors"))
    b = load_file(str(replayed / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
