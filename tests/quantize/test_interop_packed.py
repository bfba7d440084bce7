"""compressed-tensors "pack-quantized" checkpoints (`--format compressed-tensors`; llm-compressor's
W4A16 / W8A16 format): qserve writes them, mixed schemes as several config groups, and reads them.

    packing      our layout against compressed-tensors 0.20.1's own pack_to_int32
    qserve       a mixed checkpoint in both formats gives the same logits in qserve
    transformers our symmetric checkpoint loads in transformers (compressed-tensors decompresses
                 it): logits as qserve's (tolerance SAME_FP32 of test_interop)
    asymmetric   compressed-tensors' decompressor rebuilds every weight qserve dequantizes
                 (transformers 5.24 cannot load asymmetric pack-quantized checkpoints at all,
                 llm-compressor#1618)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qserve.errors import QServeError
from qserve.kernels import packing
from qserve.model.gptq_linear import gptq_from_pack_quantized
from qserve.quantize.driver import quantize_model
from qserve.quantize.settings import QuantizeSettings
from tests.quantize.test_interop import SAME_FP32, ours, rel_err
from tests.quantize.test_interop_dynamic import RULES

ct = pytest.importorskip("compressed_tensors")
COMMON = dict(group_size=32, num_samples=4, seq_len=64)


@pytest.mark.parametrize("bits", [4, 8])
def test_packing_matches_compressed_tensors(bits: int) -> None:
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    g = torch.Generator().manual_seed(bits)
    offset = 1 << (bits - 1)
    q = torch.randint(0, 1 << bits, (16, 64), generator=g)  # [N, K] unsigned codes
    zeros = torch.randint(0, 1 << bits, (2, 16), generator=g)  # [G, N]
    theirs = pack_to_int32((q - offset).to(torch.int8), bits)  # they store signed + offset
    assert torch.equal(packing.pack_ct_weight(q, bits), theirs)
    assert torch.equal(packing.unpack_ct_weight(theirs, bits), q.to(torch.int32))
    theirs_zp = pack_to_int32((zeros - offset).t().to(torch.int8), bits, packed_dim=0)
    assert torch.equal(packing.pack_ct_zero_point(zeros, bits), theirs_zp)
    assert torch.equal(packing.unpack_ct_zero_point(theirs_zp, bits), zeros.to(torch.int32))


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("packed")
    return {
        fmt: quantize_model(
            tiny_llama, root / fmt, QuantizeSettings(dynamic=RULES, format=fmt, **COMMON)
        )
        for fmt in ("gptq", "compressed-tensors")
    }


def test_mixed_schemes_are_config_groups(mixed: dict[str, Path]) -> None:
    folder = mixed["compressed-tensors"]
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "pack-quantized" and qc["quant_method"] == "compressed-tensors"
    groups = {
        (g["weights"]["num_bits"], g["weights"]["group_size"]): g["targets"]
        for g in qc["config_groups"].values()
    }
    assert groups[(8, None)] == [f"model.layers.{i}.mlp.down_proj" for i in range(2)]
    assert groups[(4, 64)] == [f"model.layers.1.mlp.{p}_proj" for p in ("gate", "up")]
    assert len(groups[(4, 32)]) == 2 * 4 + 2 - 1  # attention and layer 0's gate/up, less one
    assert qc["ignore"] == ["lm_head", "model.layers.0.self_attn.o_proj"]
    sd = load_file(str(folder / "model.safetensors"))
    assert sd["model.layers.0.mlp.down_proj.weight_packed"].shape == (128, 256 * 8 // 32)
    assert sd["model.layers.0.mlp.up_proj.weight_scale"].shape == (256, 128 // 32)
    assert "model.layers.0.self_attn.o_proj.weight" in sd  # left 16-bit
    assert not any(k.endswith("weight_zero_point") for k in sd)  # symmetric


def test_mixed_checkpoint_runs_as_the_gptq_one(mixed: dict[str, Path]) -> None:
    prompt = torch.randint(0, 320, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    theirs, gptq_paths = ours(mixed["gptq"], prompt)
    logits, paths = ours(mixed["compressed-tensors"], prompt)
    assert rel_err(logits, theirs) <= SAME_FP32
    assert paths == gptq_paths  # the same kernel for every kind of layer


def test_mixed_checkpoint_loads_in_transformers(mixed: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM

    folder = mixed["compressed-tensors"]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompt = torch.randint(0, 320, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.inference_mode():
        theirs = model(torch.tensor([prompt])).logits[0].float()
    err = rel_err(ours(folder, prompt)[0], theirs)
    assert err <= SAME_FP32, f"against transformers: relative logits error {err:.2e}"


def test_asymmetric_static_act_order_decompresses_as_qserve_reads_it(
    tmp_path: Path, tiny_llama: Path
) -> None:
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    settings = QuantizeSettings(
        sym=False, desc_act=True, static_groups=True, format="compressed-tensors", **COMMON
    )
    folder = quantize_model(tiny_llama, tmp_path / "asym", settings)
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    (scheme,) = QuantizationConfig.model_validate(qc).config_groups.values()
    assert scheme.weights.actorder == "weight" and not scheme.weights.symmetric
    sd = load_file(str(folder / "model.safetensors"))
    names = ("self_attn.q_proj", "mlp.down_proj")
    for prefix in [f"model.layers.{i}.{n}" for i in range(2) for n in names]:
        local = {k.removeprefix(f"{prefix}."): v for k, v in sd.items() if k.startswith(prefix)}
        theirs = PackedQuantizationCompressor.decompress(local, scheme)["weight"]
        state = {f"{prefix}.{k}": v for k, v in local.items()}
        gptq_from_pack_quantized(prefix, state, 4)
        mine = packing.dequantize_gptq(
            state[f"{prefix}.qweight"], state[f"{prefix}.qzeros"],
            state[f"{prefix}.scales"].float(), torch.arange(theirs.shape[1]) // 32, 4,
        )  # fmt: skip
        # (q - z) * s is exact in fp32; they round it to the scales' dtype
        assert torch.equal(mine.to(theirs.dtype), theirs), prefix


def test_act_order_needs_static_groups() -> None:
    with pytest.raises(QServeError, match="static-groups") as info:
        QuantizeSettings(desc_act=True, format="compressed-tensors")
    assert "\n" not in str(info.value)
    QuantizeSettings(desc_act=True, format="gptq")  # g_idx: fine in GPTQ's format


def test_a_zero_point_of_zero_is_refused_in_one_line() -> None:
    zeros = torch.full((1, 8), 3)
    zeros[0, 5] = 0
    state = {
        "l.weight_packed": packing.pack_ct_weight(torch.zeros(8, 32, dtype=torch.int32), 4),
        "l.weight_scale": torch.ones(8, 1),
        "l.weight_zero_point": packing.pack_ct_zero_point(zeros, 4),
    }
    with pytest.raises(QServeError, match="zero point of 0") as info:
        gptq_from_pack_quantized("l", state, 4)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3-moe"])
def test_moe_experts_export_and_load_per_expert(arch: str, tmp_path: Path) -> None:
    from tests.quantize.test_moe import saved

    model = saved(tmp_path, arch)
    kw = dict(group_size=32, num_samples=4, seq_len=32, calib="moby-dick")
    folders = [
        quantize_model(model, tmp_path / fmt, QuantizeSettings(format=fmt, **kw))
        for fmt in ("gptq", "compressed-tensors")
    ]
    sd = load_file(str(folders[1] / "model.safetensors"))
    assert any(".experts.1." in k and k.endswith("weight_packed") for k in sd)
    prompt = list(range(5, 25))
    (theirs, gptq_paths), (logits, paths) = (ours(f, prompt) for f in folders)
    assert rel_err(logits, theirs) <= SAME_FP32 and paths == gptq_paths
