"""GPTQModel's per-module `dynamic` overrides (mixed-precision GPTQ checkpoints, as vLLM reads
them) load in qserve: a gptqmodel 7.6.0 checkpoint of the tiny Llama with one linear left dense
("-:"), the down projections in 8 bits with groups of 64, and layer 1's gate/up in groups of 16,
against gptqmodel's own loader (fp16, its torch kernel: tolerance FP16 of test_interop)."""

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


@pytest.mark.parametrize(
    "dynamic, message",
    [({"+:(": {}}, "regex"), ({".*": {"bits": 3}}, "3-bit"), ({".*": {"damp": 1}}, "keys")],
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
    assert model.load_report.scheme == "gptq: gptq w4a16 g32, gptq w8a16 g64, gptq w4a16 g16"
    layer0 = model.model.layers[0]
    assert isinstance(layer0.self_attn.o_proj, torch.nn.Linear)  # "-:" left it dense
    prompt = torch.randint(0, 320, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    gptqmodel = third_party.import_gptqmodel()
    loaded = gptqmodel.GPTQModel.load(
        str(checkpoint), backend=gptqmodel.BACKEND.TORCH, device="cpu", dtype=torch.float16
    )
    assert loaded.model.model.layers[0].mlp.down_proj.bits == 8
    with torch.inference_mode():
        theirs = loaded.model(torch.tensor([prompt])).logits[0].float()
    err = rel_err(ours(checkpoint, prompt)[0], theirs)
    assert err <= FP16, f"against gptqmodel's loader: relative logits error {err:.2e}"
