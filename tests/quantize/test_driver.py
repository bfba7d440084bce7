import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qserve.errors import QServeError
from qserve.kernels import packing
from qserve.quantize.calibration import load_calibration_text
from qserve.quantize.driver import SEARCH_FILE, quantize_model
from qserve.quantize.fold import ScaleResult
from qserve.quantize.rtn import rtn_quantize
from qserve.quantize.settings import QuantizeSettings

from ._helpers import grouped, load_dequantized, make_tiny_model

LINEARS = {  # name -> (N, K) of the tiny model (hidden 128, intermediate 256, 4 heads of 32)
    "self_attn.q_proj": (128, 128),
    "self_attn.k_proj": (128, 128),
    "self_attn.v_proj": (128, 128),
    "self_attn.o_proj": (128, 128),
    "mlp.gate_proj": (256, 128),
    "mlp.up_proj": (256, 128),
    "mlp.down_proj": (128, 256),
}
CALIB = dict(num_samples=8, seq_len=64)
_cache: dict[str, Path] = {}


def _export(method: str, tiny_llama: Path, tmp_path_factory, **kw) -> Path:
    key = method + repr(sorted(kw.items()))
    if key not in _cache:
        out = tmp_path_factory.mktemp("q") / method
        if method in ("rtn", "gptq", "awq"):  # int8 / fp8 are per channel or per tensor
            kw.setdefault("group_size", 32)
        quantize_model(tiny_llama, out, QuantizeSettings(method=method, **CALIB, **kw))
        _cache[key] = out
    return _cache[key]


def _rel_logit_error(folder: Path, tiny_llama: Path) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    ids = torch.tensor([tok(load_calibration_text()[-4000:])["input_ids"][:128]])
    ref = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        L, Lq = ref(ids).logits, load_dequantized(folder)(ids).logits
    return float((Lq - L).pow(2).mean() / L.pow(2).mean())


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_gptq_format(method: str, tiny_llama: Path, tmp_path_factory) -> None:
    out = _export(method, tiny_llama, tmp_path_factory)
    sd = _tensors(out)
    for b in range(2):
        for name, (N, K) in LINEARS.items():
            p = f"model.layers.{b}.{name}"
            assert f"{p}.weight" not in sd
            assert (sd[f"{p}.qweight"].dtype, sd[f"{p}.qweight"].shape) == (
                torch.int32,
                (K // 8, N),
            )
            assert (sd[f"{p}.qzeros"].dtype, sd[f"{p}.qzeros"].shape) == (
                torch.int32,
                (K // 32, N // 8),
            )
            assert (sd[f"{p}.scales"].dtype, sd[f"{p}.scales"].shape) == (
                torch.float16,
                (K // 32, N),
            )
            assert torch.equal(sd[f"{p}.g_idx"], torch.arange(K, dtype=torch.int32) // 32)
            assert torch.all(sd[f"{p}.qzeros"] == 0x77777777)  # symmetric 4 bit
    assert sd["lm_head.weight"].dtype == torch.float16
    assert sd["model.layers.0.input_layernorm.weight"].dtype == torch.float16
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc == json.loads((out / "quantize_config.json").read_text())
    assert (qc["quant_method"], qc["checkpoint_format"], qc["bits"], qc["group_size"]) == (
        "gptq",
        "gptq",
        4,
        32,
    )
    assert (out / "tokenizer.json").is_file()


def test_awq_format(tiny_llama: Path, tmp_path_factory) -> None:
    out = _export("awq", tiny_llama, tmp_path_factory)
    sd = _tensors(out)
    for name, (N, K) in LINEARS.items():
        p = f"model.layers.1.{name}"
        assert (sd[f"{p}.qweight"].dtype, sd[f"{p}.qweight"].shape) == (torch.int32, (K, N // 8))
        assert (sd[f"{p}.qzeros"].dtype, sd[f"{p}.qzeros"].shape) == (
            torch.int32,
            (K // 32, N // 8),
        )
        assert (sd[f"{p}.scales"].dtype, sd[f"{p}.scales"].shape) == (torch.float16, (K // 32, N))
        assert f"{p}.g_idx" not in sd and f"{p}.weight" not in sd
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "awq" and qc["version"] == "gemm" and qc["zero_point"] is True


@pytest.mark.parametrize("method,wtype", [("int8", torch.int8), ("fp8", torch.float8_e4m3fn)])
def test_compressed_tensors_format(method: str, wtype, tiny_llama: Path, tmp_path_factory) -> None:
    out = _export(method, tiny_llama, tmp_path_factory)
    sd = _tensors(out)
    for name, (N, K) in LINEARS.items():
        p = f"model.layers.0.{name}"
        assert (sd[f"{p}.weight"].dtype, sd[f"{p}.weight"].shape) == (wtype, (N, K))
        assert (sd[f"{p}.weight_scale"].dtype, sd[f"{p}.weight_scale"].shape) == (
            torch.float32,
            (N, 1),
        )
        assert f"{p}.input_scale" not in sd  # dynamic per-token activations
    assert sd["lm_head.weight"].dtype == torch.bfloat16
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["ignore"] == ["lm_head"]
    kind = "int" if method == "int8" else "float"
    assert qc["format"] == f"{kind}-quantized"
    assert qc["config_groups"]["group_0"]["input_activations"]["strategy"] == "token"


def test_fp8_static_activations(tiny_llama: Path, tmp_path_factory) -> None:
    out = _export(
        "fp8", tiny_llama, tmp_path_factory, activation_scheme="static", weight_strategy="tensor"
    )
    sd = _tensors(out)
    for name in LINEARS:
        p = f"model.layers.1.{name}"
        assert sd[f"{p}.weight_scale"].shape == (1,) and sd[f"{p}.input_scale"].shape == (1,)
        assert sd[f"{p}.input_scale"].dtype == torch.float32 and float(sd[f"{p}.input_scale"]) > 0
    group = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]
    assert group["group_0"]["input_activations"]["dynamic"] is False


def test_logits_stay_close_and_calibrated_methods_beat_rtn(tiny_llama, tmp_path_factory) -> None:
    err = {
        m: _rel_logit_error(_export(m, tiny_llama, tmp_path_factory), tiny_llama)
        for m in ("rtn", "gptq", "awq", "int8", "fp8")
    }
    assert err["rtn"] < 0.06
    assert err["gptq"] < 0.75 * err["rtn"]
    assert err["awq"] < 0.75 * err["rtn"]
    assert err["int8"] < 1e-3 and err["fp8"] < 5e-3


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_gptq_weights_same_format_closer_logits(method: str, tiny_llama: Path, tmp_path_factory):
    no_smoothing = {"smooth_alpha": 0} if method == "int8" else {}  # fp8 never smooths
    plain = _export(method, tiny_llama, tmp_path_factory, **no_smoothing, gptq_weights=False)
    gptq = _export(method, tiny_llama, tmp_path_factory, **no_smoothing)  # GPTQ rounding: default
    a, b = _tensors(plain), _tensors(gptq)
    assert a.keys() == b.keys()
    for key in a:
        assert (a[key].dtype, a[key].shape) == (b[key].dtype, b[key].shape)
        if key.endswith("weight_scale"):  # GPTQ changes the rounding, not the scales
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)
    q = "model.layers.1.mlp.down_proj.weight"
    assert not torch.equal(a[q].view(torch.uint8), b[q].view(torch.uint8))
    assert _rel_logit_error(gptq, tiny_llama) < _rel_logit_error(plain, tiny_llama)


def test_gptaq_same_format(tiny_llama: Path, tmp_path_factory) -> None:
    plain = _export("gptq", tiny_llama, tmp_path_factory, gptaq=False)
    asym = _export("gptq", tiny_llama, tmp_path_factory)  # GPTAQ: gptq's default
    a, b = _tensors(plain), _tensors(asym)
    assert {k: (v.dtype, v.shape) for k, v in a.items()} == {
        k: (v.dtype, v.shape) for k, v in b.items()
    }
    # The first group of block 0 sees the float model's inputs: GPTAQ changes nothing there.
    q = "model.layers.0.self_attn.q_proj.qweight"
    assert torch.equal(a[q], b[q])
    d = "model.layers.1.mlp.down_proj.qweight"
    assert not torch.equal(a[d], b[d])
    # (Whether it beats plain GPTQ is measured on SmolLM2 in benchmarks/quality.py; on this
    # random model with 8 calibration windows the two are within a few percent either way.)
    rtn = _export("rtn", tiny_llama, tmp_path_factory)
    assert _rel_logit_error(asym, tiny_llama) < 0.75 * _rel_logit_error(rtn, tiny_llama)


def test_gptaq_recomputes_what_it_does_not_keep(tiny_llama: Path, tmp_path: Path, monkeypatch):
    """Float inputs over the cache budget are recomputed per group: the same checkpoint."""
    from qserve.quantize import block_context

    a = tmp_path / "kept"
    quantize_model(
        tiny_llama, a, QuantizeSettings(method="gptq", group_size=32, gptaq=True, **CALIB)
    )
    monkeypatch.setattr(block_context, "REFERENCE_CACHE_BYTES", 0)
    b = tmp_path / "recomputed"
    quantize_model(
        tiny_llama, b, QuantizeSettings(method="gptq", group_size=32, gptaq=True, **CALIB)
    )
    ta, tb = _tensors(a), _tensors(b)
    assert all(torch.equal(ta[k], tb[k]) for k in ta)


@pytest.mark.parametrize(
    "kw",
    [
        dict(method="gptq", gptaq=False),
        dict(method="gptq", gptaq=True),
        dict(method="int8", gptq_weights=True),
        dict(method="fp8", gptq_weights=True, kv_cache_dtype="fp8_e4m3"),
    ],
    ids=["gptq", "gptaq", "int8", "fp8-kv"],
)
def test_attention_replay_changes_nothing(kw: dict, tiny_llama: Path, tmp_path: Path, monkeypatch):
    """Reusing each block's final attention outputs (instead of recomputing them for the later
    sequential groups and the block's outputs) gives the same checkpoint, bit for bit."""
    from qserve.quantize import block_context

    calls = {"replayed": 0}
    replay = block_context.BlockContext.attention_replay

    def counting(self, reads_attention: bool = False):
        calls["replayed"] += self.attention_outputs is not None and not reads_attention
        return replay(self, reads_attention)

    monkeypatch.setattr(block_context.BlockContext, "attention_replay", counting)
    a = tmp_path / "replayed"
    quantize_model(tiny_llama, a, QuantizeSettings(**grouped(kw["method"]), **kw, **CALIB))
    assert calls["replayed"] > 0
    monkeypatch.setattr(block_context, "REPLAY_CACHE_BYTES", 0)
    b = tmp_path / "recomputed"
    quantize_model(tiny_llama, b, QuantizeSettings(**grouped(kw["method"]), **kw, **CALIB))
    ta, tb = _tensors(a), _tensors(b)
    assert ta.keys() == tb.keys()
    assert all(torch.equal(ta[k], tb[k]) for k in ta)


def test_gptaq_quantizes_lm_head_too(tiny_llama: Path, tmp_path_factory) -> None:
    plain = _export("gptq", tiny_llama, tmp_path_factory, quantize_lm_head=True, gptaq=False)
    asym = _export("gptq", tiny_llama, tmp_path_factory, quantize_lm_head=True, gptaq=True)
    a, b = _tensors(plain)["lm_head.qweight"], _tensors(asym)["lm_head.qweight"]
    assert a.shape == b.shape and not torch.equal(a, b)


def test_gptq_desc_act(tiny_llama: Path, tmp_path_factory) -> None:
    out = _export("gptq", tiny_llama, tmp_path_factory, desc_act=True, sym=False)
    sd = _tensors(out)
    g_idx = sd["model.layers.0.mlp.down_proj.g_idx"]
    assert torch.bincount(g_idx).tolist() == [32] * 8  # each group still holds 32 channels
    assert not torch.equal(g_idx, torch.arange(256, dtype=torch.int32) // 32)  # act-order
    assert json.loads((out / "quantize_config.json").read_text())["desc_act"] is True
    assert _rel_logit_error(out, tiny_llama) < 0.05


def test_ignore_and_progress(tiny_llama: Path, tmp_path: Path) -> None:
    calls = []
    quantize_model(
        tiny_llama,
        tmp_path / "o",
        QuantizeSettings(
            method="rtn", group_size=-1, bits=8, ignore=["lm_head", "re:.*\\.down_proj"]
        ),
        progress=lambda *a: calls.append(a),
    )
    sd = _tensors(tmp_path / "o")
    assert sd["model.layers.0.mlp.down_proj.weight"].dtype == torch.float16
    assert "model.layers.0.mlp.down_proj.qweight" not in sd
    assert sd["model.layers.0.mlp.up_proj.qweight"].shape == (128 // 4, 256)  # 8 bit
    assert sd["model.layers.0.mlp.up_proj.scales"].shape == (1, 256)  # group_size -1
    assert [c[:2] for c in calls] == [(1, 2), (2, 2)] and calls[-1][2] == 0


def test_awq_results_replay(tiny_llama: Path, tmp_path: Path) -> None:
    saved = tmp_path / "awq.safetensors"
    quantize_model(
        tiny_llama,
        tmp_path / "a",
        QuantizeSettings(method="awq", group_size=64, **CALIB),
        scales=saved,
    )
    assert saved.is_file()
    quantize_model(
        tiny_llama,
        tmp_path / "b",
        QuantizeSettings(method="awq", group_size=64, calib=tmp_path / "missing.txt"),
        scales=saved,
    )
    a, b = _tensors(tmp_path / "a"), _tensors(tmp_path / "b")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_qwen2_gqa_tied_awq(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "qwen", model_type="qwen2", kv_heads=2, tie=True)
    quantize_model(model, tmp_path / "o", QuantizeSettings(method="awq", group_size=32, **CALIB))
    sd = _tensors(tmp_path / "o")
    assert sd["model.layers.0.self_attn.v_proj.qweight"].shape == (128, 64 // 8)
    assert sd["model.layers.0.self_attn.q_proj.bias"].dtype == torch.float16
    assert "lm_head.weight" not in sd  # tied to the embeddings
    assert _rel_logit_error(tmp_path / "o", model) < 0.05


def test_refusals(tiny_llama: Path, tmp_path: Path) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(QServeError, match="not empty"):
        quantize_model(tiny_llama, tmp_path / "full", QuantizeSettings(method="rtn"))
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(QServeError, match="unsupported architecture 'gpt2'"):
        quantize_model(tmp_path / "gpt2", tmp_path / "o", QuantizeSettings(method="rtn"))
    with pytest.raises(QServeError, match="method: 'nf4' is not allowed"):
        quantize_model(tiny_llama, tmp_path / "o", QuantizeSettings(method="nf4"))
    with pytest.raises(QServeError, match="bits: awq takes bits 4, got 8"):
        quantize_model(tiny_llama, tmp_path / "o", QuantizeSettings(method="awq", bits=8))
    with pytest.raises(QServeError, match="not a model folder"):
        quantize_model(tmp_path / "nowhere", tmp_path / "o", QuantizeSettings(method="rtn"))
    assert not (tmp_path / "o").exists()


def test_group_size_must_divide_in_features(tmp_path: Path) -> None:
    from tests.tiny import save_tiny_llama

    model = save_tiny_llama(tmp_path / "m")  # hidden 64, intermediate 160
    with pytest.raises(QServeError, match="group_size 64 does not divide .*mlp.down_proj's 160"):
        quantize_model(
            model, tmp_path / "o", QuantizeSettings(method="gptq", group_size=64, **CALIB)
        )
    assert not (tmp_path / "o").exists()
    # Leaving the offending linears unquantized is a way out.
    quantize_model(
        model, tmp_path / "o", QuantizeSettings(method="rtn", group_size=64, ignore=["down_proj"])
    )


def test_auto_group_size_is_the_largest_that_divides(tmp_path: Path) -> None:
    from tests.tiny import save_tiny_llama

    def written(out: Path) -> int:
        return json.loads((out / "config.json").read_text())["quantization_config"]["group_size"]

    model = save_tiny_llama(tmp_path / "m")  # hidden 64, intermediate 160: 32 divides both
    quantize_model(model, tmp_path / "a", QuantizeSettings(method="rtn", group_size="auto"))
    assert written(tmp_path / "a") == 32
    quantize_model(
        model, tmp_path / "b", QuantizeSettings(method="rtn", ignore=["lm_head", "down_proj"])
    )
    assert written(tmp_path / "b") == 64  # the default is auto; down_proj (160) left dense
    odd = tmp_path / "odd"  # the group size is chosen from config.json alone, before weights
    odd.mkdir()
    config = json.loads((model / "config.json").read_text())
    config.update(hidden_size=72, intermediate_size=144, num_attention_heads=2)
    config.update(num_key_value_heads=2, head_dim=36)
    (odd / "config.json").write_text(json.dumps(config))
    with pytest.raises(QServeError, match="no group size of 128, 64 or 32 divides"):
        quantize_model(odd, tmp_path / "c", QuantizeSettings(method="rtn", group_size="auto"))
    allowed = r"group_size: 48 is not allowed \(allowed: -1, 32, 64, 128, auto\)"
    with pytest.raises(QServeError, match=allowed):
        quantize_model(model, tmp_path / "c", QuantizeSettings(method="rtn", group_size=48))
    assert not (tmp_path / "c").exists()


def test_mistral_wide_heads_awq(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "mistral", model_type="mistral")
    saved = tmp_path / "awq.safetensors"
    quantize_model(
        model, tmp_path / "o", QuantizeSettings(method="awq", group_size=64, **CALIB), scales=saved
    )
    sd = _tensors(tmp_path / "o")
    assert sd["model.layers.0.self_attn.q_proj.qweight"].shape == (128, 256 // 8)
    assert sd["model.layers.0.self_attn.o_proj.qweight"].shape == (256, 128 // 8)
    # v_proj (256 outputs) lines up with o_proj (256 inputs): that mapping is folded too.
    assert ScaleResult.load(saved).scales["model.layers.0.self_attn.v_proj"].shape == (256,)
    # The checkpoint carries the same search result, out of the loaders' way.
    inside = ScaleResult.load(tmp_path / "o" / SEARCH_FILE)
    assert inside.scales.keys() == ScaleResult.load(saved).scales.keys()
    assert sorted(p.name for p in (tmp_path / "o").glob("*.safetensors")) == ["model.safetensors"]
    assert _rel_logit_error(tmp_path / "o", model) < 0.05


def test_smoothquant_scales_replay(tiny_llama: Path, tmp_path: Path) -> None:
    saved = tmp_path / "smooth.safetensors"
    nearest = dict(method="int8", gptq_weights=False)  # GPTQ rounding would need data again
    quantize_model(tiny_llama, tmp_path / "a", QuantizeSettings(**nearest, **CALIB), scales=saved)
    result = ScaleResult.load(saved)
    assert list(result.scales) == [
        "model.layers.0.input_layernorm",
        "model.layers.0.post_attention_layernorm",
        "model.layers.1.input_layernorm",
        "model.layers.1.post_attention_layernorm",
    ]
    assert result.linears["model.layers.1.post_attention_layernorm"] == [
        "model.layers.1.mlp.gate_proj",
        "model.layers.1.mlp.up_proj",
    ]
    quantize_model(
        tiny_llama, tmp_path / "b", QuantizeSettings(calib="nope.txt", **nearest), scales=saved
    )
    a, b = _tensors(tmp_path / "a"), _tensors(tmp_path / "b")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_ignored_linears_are_named_in_the_configs(tiny_llama: Path, tmp_path: Path) -> None:
    def qconfig(method: str) -> dict:
        out = tmp_path / method
        quantize_model(
            tiny_llama, out, QuantizeSettings(method=method, ignore=["lm_head", "o_proj"], **CALIB)
        )
        sd = _tensors(out)
        assert sd["model.layers.1.self_attn.o_proj.weight"].dtype in (torch.float16, torch.bfloat16)
        return json.loads((out / "config.json").read_text())["quantization_config"]

    skipped = ["model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj"]
    assert qconfig("fp8")["ignore"] == [*skipped, "lm_head"]
    assert qconfig("awq")["modules_to_not_convert"] == skipped
    assert qconfig("gptq")["modules_in_block_to_quantize"] == [
        ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
        [],
        ["mlp.gate_proj", "mlp.up_proj"],
        ["mlp.down_proj"],
    ]


@pytest.mark.parametrize(
    ("method", "tie", "offload"),
    [("rtn", False, False), ("rtn", True, True), ("gptq", True, False), ("gptq", False, True)],
)
def test_quantize_lm_head(method: str, tie: bool, offload: bool, tmp_path: Path) -> None:
    from qserve.kernels.packing import dequantize_gptq
    from qserve.model.loader import load_model
    from qserve.model.quant import QuantLinear

    base = make_tiny_model(tmp_path / "base", tie=tie)
    out = tmp_path / "q"
    offload_dir = tmp_path / "offload" if offload else None
    calib = dict(**CALIB, calib="moby-dick" if offload else None) if method == "gptq" else {}
    quantize_model(
        base,
        out,
        QuantizeSettings(method=method, group_size=32, quantize_lm_head=True, **calib),
        offload_dir=offload_dir,
    )
    sd = _tensors(out)
    config = json.loads((out / "config.json").read_text())
    assert "lm_head.weight" not in sd and sd["lm_head.qweight"].shape == (128 // 8, 320)
    assert config["tie_word_embeddings"] is False
    assert config["quantization_config"]["lm_head"] is True
    # the input embeddings stay in floating point, untouched by lm_head's rounding
    embed = load_file(str(base / "model.safetensors"))["model.embed_tokens.weight"]
    assert torch.equal(sd["model.embed_tokens.weight"], embed.to(torch.float16))
    model, _ = load_model(out, torch.float32)
    assert isinstance(model.lm_head, QuantLinear)
    hidden = torch.randn(3, 128)
    head = dequantize_gptq(
        sd["lm_head.qweight"], sd["lm_head.qzeros"], sd["lm_head.scales"].float(),
        sd["lm_head.g_idx"], 4,
    )  # fmt: skip
    want = hidden @ head.t()
    torch.testing.assert_close(model.compute_logits(hidden), want, rtol=1e-5, atol=1e-5)
    if method == "gptq":  # error feedback on the final hidden states: not plain rounding
        rtn = rtn_quantize(embed.float() if tie else _lm_head(base), 4, 32, True, 1)
        assert not torch.equal(packing.unpack_gptq_qweight(sd["lm_head.qweight"], 4), rtn.Q.t())


def _lm_head(base: Path) -> torch.Tensor:
    return load_file(str(base / "model.safetensors"))["lm_head.weight"].float()


def test_generated_calibration_is_refused_with_offload(tiny_llama: Path, tmp_path: Path) -> None:
    """`generated` samples from the whole model: offloaded runs calibrate on a text."""
    with pytest.raises(QServeError, match="--calib moby-dick") as info:
        quantize_model(tiny_llama, tmp_path / "q", QuantizeSettings(), offload_dir=tmp_path / "o")
    assert "\n" not in str(info.value) and not (tmp_path / "o").exists()


def test_quantize_lm_head_needs_the_gptq_format(tiny_llama: Path, tmp_path: Path) -> None:
    not_awq = "quantize_lm_head: only rtn, gptq use it, but method is awq"
    with pytest.raises(QServeError, match=not_awq):
        quantize_model(
            tiny_llama, tmp_path / "q", QuantizeSettings(method="awq", quantize_lm_head=True)
        )


def test_cli_group_size_takes_auto_and_refuses_words(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from qserve.cli import cli
    from tests.tiny import save_tiny_llama

    model = save_tiny_llama(tmp_path / "m")
    args = ["quantize", str(model), "-m", "rtn", "-q", "-o"]
    ok = CliRunner().invoke(cli, [*args, str(tmp_path / "o"), "--group-size", "auto"])
    assert ok.exit_code == 0, ok.output
    bad = CliRunner().invoke(cli, [*args, str(tmp_path / "x"), "--group-size", "big"])
    assert bad.exit_code == 2 and "'big' is not one of -1, 32, 64, 128, auto" in bad.output


def test_method_defaults_gptaq_and_gptq_rounding() -> None:
    """Unset, gptq means GPTAQ and int8 / fp8 round their weights with GPTQ (so they calibrate);
    explicit False turns each off, and either asked of a method it does not apply to is refused."""
    from qserve.quantize.driver import QuantizeSettings

    assert QuantizeSettings(method="gptq").gptaq
    assert not QuantizeSettings(method="gptq", gptaq=False).gptaq
    assert not QuantizeSettings(method="awq").gptaq
    for method in ("int8", "fp8"):
        assert QuantizeSettings(method=method).gptq_weights
        assert QuantizeSettings(method=method).needs_calibration()
    assert not QuantizeSettings(method="fp8", gptq_weights=False).needs_calibration()
    assert not QuantizeSettings(method="rtn").gptq_weights
    with pytest.raises(QServeError, match="gptaq: only gptq, auto use it, but method is awq"):
        QuantizeSettings(method="awq", gptaq=True)
    not_gptq = "gptq_weights: only int8, fp8 use it, but method is gptq"
    with pytest.raises(QServeError, match=not_gptq):
        QuantizeSettings(method="gptq", gptq_weights=True)


def test_windows_longer_than_the_context_are_refused(tiny_llama: Path, tmp_path: Path) -> None:
    context = json.loads((tiny_llama / "config.json").read_text())["max_position_embeddings"]
    settings = QuantizeSettings(num_samples=2, seq_len=context + 1)
    with pytest.raises(QServeError, match=f"longer than the model's context \\({context}") as info:
        quantize_model(tiny_llama, tmp_path / "q", settings)
    assert "\n" not in str(info.value) and not (tmp_path / "q").exists()
