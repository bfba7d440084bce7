"""GPTQModel's per-module `dynamic` overrides (mixed-precision GPTQ checkpoints, as vLLM reads
them) load in qserve: a gptqmodel 7.6.0 checkpoint of the tiny Llama with one linear left dense
("-:"), the down projections in 8 bits with groups of 64, layer 1's gate/up in groups of 16
and its q/k/v in 3 bits (GPTQ's 96-bit stream of 32 codes), against gptqmodel's own loader
(fp16, its torch kernel: tolerance FP16 of test_interop)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks import third_party
from qserve.model.loader import load_model
from qserve.model.quant_config import LinearScheme, parse_quant_scheme
from tests.quantize.test_interop import FP16, ours, rel_err

DYNAMIC = {
    r"-:.*\.0\.self_attn\.o_proj": {},
    r"+:.*down_proj": {"bits": 8, "group_size": 64},
    r".*\.1\.mlp\.(gate|up)_proj": {"group_size": 16},
    r".*\.1\.self_attn\.(q|k|v)_proj": {"bits": 3},
}


def test_dynamic_rules_pick_each_module_scheme() -> None:
    scheme = parse_quant_scheme({"quant_method": "gptq", "bits": 4, "group_size": 32,
                                 "dynamic": DYNAMIC})  # fmt: skip
    assert scheme is not None
    assert scheme.for_module("model.layers.0.self_attn.o_proj") is None
    assert scheme.for_module("model.layers.1.self_attn.o_proj") == LinearScheme("gptq", 4, 32)
    assert scheme.for_module("model.layers.0.mlp.down_proj") == LinearScheme("gptq", 8, 64)
    assert scheme.for_module("model.layers.1.mlp.up_proj") == LinearScheme("gptq", 4, 16)
    assert scheme.for_module("model.layers.0.mlp.up_proj") == LinearScheme("gptq", 4, 32)
    assert scheme.for_module("model.layers.1.self_attn.k_proj") == LinearScheme("gptq", 3, 32)


@pytest.mark.parametrize(
    "dynamic, message",
    [({"+:(": {}}, "regex"), ({".*": {"bits": 2}}, "2-bit"), ({".*": {"damp": 1}}, "keys")],
    ids=["regex", "bits", "key"],
)
def test_bad_dynamic_rules_are_one_line_errors(dynamic, message) -> None:
    from qserve.errors import QServeError

    with pytest.raises(QServeError, match=message) as info:
        parse_quant_scheme({"quant_method": "gptq", "bits": 4, "dynamic": dynamic})
    assert "\n" not in str(info.value)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> Path:
    pytest.importorskip("optimum")
    try:
        third_party.import_gptqmodel()
    except ImportError as exc:
        pytest.skip(f"could not import 'gptqmodel': {exc}")
    from transformers import AutoTokenizer

    from qserve.quantize.calibration import calibration_windows, load_calibration_text

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    ids = calibration_windows(tokenizer, load_calibration_text(), num_samples=4, seq_len=64)
    out = tmp_path_factory.mktemp("gptqmodel-dynamic") / "ckpt"
    third_party.gptqmodel_quantize(tiny_llama, out, ids, group_size=32, dynamic=DYNAMIC)
    return out


def test_gptqmodel_dynamic_checkpoint_loads_in_qserve(checkpoint: Path) -> None:
    model, _ = load_model(checkpoint, torch.float32)
    assert model.load_report.scheme == (
        "gptq: gptq w4a16 g32, gptq w8a16 g64, gptq w4a16 g16, gptq w3a16 g32"
    )
    layer0 = model.model.layers[0]
    assert isinstance(layer0.self_attn.o_proj, torch.nn.Linear)  # "-:" left it dense
    prompt = torch.randint(0, 320, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    gptqmodel = third_party.import_gptqmodel()
    loaded = gptqmodel.GPTQModel.load(
        str(checkpoint), backend=gptqmodel.BACKEND.TORCH, device="cpu", dtype=torch.float16
    )
    assert loaded.model.model.layers[0].mlp.down_proj.bits == 8
    assert loaded.model.model.layers[1].self_attn.v_proj.bits == 3
    with torch.inference_mode():
        theirs = loaded.model(torch.tensor([prompt])).logits[0].float()
    err = rel_err(ours(checkpoint, prompt)[0], theirs)
    assert err <= FP16, f"against gptqmodel's loader: relative logits error {err:.2e}"


# qserve's own mixed checkpoints: `--dynamic` rules (quantize/dynamic.py), the same mix as DYNAMIC
RULES = (r"-:.*\.0\.self_attn\.o_proj", r".*down_proj=w8ch", r".*\.1\.mlp\.(gate|up)_proj=w4g64")
GPTQ_RULES = (*RULES, r".*\.1\.self_attn\.(q|k|v)_proj=w3g32")  # 3 bits: the GPTQ format only


@pytest.fixture(scope="module")
def ours_mixed(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> Path:
    from qserve.quantize.driver import quantize_model
    from qserve.quantize.settings import QuantizeSettings

    out = tmp_path_factory.mktemp("qserve-dynamic") / "ckpt"
    settings = QuantizeSettings(group_size=32, dynamic=GPTQ_RULES, num_samples=4, seq_len=64)
    return quantize_model(tiny_llama, out, settings)


def test_qserve_writes_dynamic_rules_gptqmodel_reads(ours_mixed: Path) -> None:
    import json

    from safetensors.torch import load_file

    qc = json.loads((ours_mixed / "config.json").read_text())["quantization_config"]
    assert qc["dynamic"] == {
        r"-:.*\.0\.self_attn\.o_proj": {},
        r"+:.*down_proj": {"bits": 8, "group_size": -1},
        r"+:.*\.1\.mlp\.(gate|up)_proj": {"bits": 4, "group_size": 64},
        r"+:.*\.1\.self_attn\.(q|k|v)_proj": {"bits": 3, "group_size": 32},
    }
    sd = load_file(str(ours_mixed / "model.safetensors"))
    assert "model.layers.0.self_attn.o_proj.weight" in sd  # left 16-bit
    assert "model.layers.1.self_attn.o_proj.qweight" in sd
    down = sd["model.layers.0.mlp.down_proj.qweight"]  # 8-bit: 4 codes per int32 row
    assert down.shape[0] * 4 == sd["model.layers.0.mlp.down_proj.g_idx"].numel()
    assert sd["model.layers.0.mlp.down_proj.scales"].shape[0] == 1  # one group: per channel
    assert sd["model.layers.1.mlp.up_proj.scales"].shape[0] == 128 // 64
    assert sd["model.layers.0.mlp.up_proj.scales"].shape[0] == 128 // 32
    assert sd["model.layers.1.self_attn.q_proj.qweight"].shape == (128 * 3 // 32, 128)


def test_qserve_mixed_checkpoint_matches_gptqmodel_loader(ours_mixed: Path) -> None:
    pytest.importorskip("optimum")
    try:
        gptqmodel = third_party.import_gptqmodel()
    except ImportError as exc:
        pytest.skip(f"could not import 'gptqmodel': {exc}")
    model, _ = load_model(ours_mixed, torch.float32)
    # config.json's keys are sorted (as transformers writes them): the rules are disjoint
    assert model.load_report.scheme == (
        "gptq: gptq w4a16 g32, gptq w4a16 g64, gptq w3a16 g32, gptq w8a16 channel"
    )
    prompt = torch.randint(0, 320, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    loaded = gptqmodel.GPTQModel.load(
        str(ours_mixed), backend=gptqmodel.BACKEND.TORCH, device="cpu", dtype=torch.float16
    )
    assert loaded.model.model.layers[0].mlp.down_proj.bits == 8
    assert loaded.model.model.layers[1].self_attn.q_proj.bits == 3
    with torch.inference_mode():
        theirs = loaded.model(torch.tensor([prompt])).logits[0].float()
    err = rel_err(ours(ours_mixed, prompt)[0], theirs)
    assert err <= FP16, f"against gptqmodel's loader: relative logits error {err:.2e}"


def test_bad_dynamic_rule_is_refused_before_calibration() -> None:
    from qserve.errors import QServeError
    from qserve.quantize.settings import QuantizeSettings

    for rule, message in [("(=w4g32", "regex"), (".*=w2g32", "unknown scheme"), (".*", "REGEX=")]:
        with pytest.raises(QServeError, match=message) as info:
            QuantizeSettings(dynamic=(rule,))
        assert "\n" not in str(info.value)
    with pytest.raises(QServeError, match="only rtn, gptq"):
        QuantizeSettings(method="awq", dynamic=(".*=w8ch",))
    for kwargs in [dict(dynamic=(".*=w3g32",)), dict(bits=3)]:  # 3 bits: the GPTQ format only
        with pytest.raises(QServeError, match="--format gptq"):
            QuantizeSettings(format="compressed-tensors", **kwargs)


def test_overlapping_rules_are_written_as_exact_names() -> None:
    """Sorted keys would reorder overlapping rules: they are written as one exact rule per
    scheme, which any order reads the same."""
    from qserve.quantize.dynamic import Scheme, disjoint_rules, gptq_dynamic, parse_rules

    names = [f"model.layers.{i}.mlp.{p}_proj" for i in range(2) for p in ("up", "down")]
    rules = parse_rules([r".*\.1\.mlp\.down_proj=w4g32", r"-:.*\.1\.", r".*down_proj=w8ch"])
    written = gptq_dynamic(disjoint_rules(rules, names, Scheme(4, 64)))
    assert written == {
        r"+:(?:model\.layers\.0\.mlp\.down_proj)$": {"bits": 8, "group_size": -1},
        r"+:(?:model\.layers\.1\.mlp\.down_proj)$": {"bits": 4, "group_size": 32},
        r"-:(?:model\.layers\.1\.mlp\.up_proj)$": {},
    }
    assert disjoint_rules(rules[2:], names, Scheme(4, 64)) == rules[2:]  # no overlap: as given
