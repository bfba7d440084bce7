import json

import pytest
import torch

from qserve.errors import QServeError
from qserve.kernels.packing import dequantize_awq, dequantize_gptq
from qserve.quantize import export, output_dir
from qserve.quantize.gptq import accumulate_hessian, gptq_quantize
from qserve.quantize.rtn import rtn_quantize


def _fp16_scales(qw):
    import dataclasses

    return dataclasses.replace(qw, scales=qw.scales.half().float())


@pytest.mark.parametrize("bits", [3, 4, 8])
@pytest.mark.parametrize("group_size", [32, 128, -1])
@pytest.mark.parametrize("sym", [True, False])
def test_gptq_export_round_trip(bits: int, group_size: int, sym: bool) -> None:
    torch.manual_seed(0)
    W = torch.randn(64, 256)
    H, _ = accumulate_hessian(None, 0, torch.randn(512, 256))
    qw = gptq_quantize(W, H, bits, group_size, sym, desc_act=True, min_zero=1)
    t = export.gptq_tensors(qw)
    G = 1 if group_size == -1 else 256 // group_size
    assert t["qweight"].dtype == torch.int32 and t["qweight"].shape == (256 * bits // 32, 64)
    assert t["qzeros"].dtype == torch.int32 and t["qzeros"].shape == (G, 64 * bits // 32)
    assert t["scales"].dtype == torch.float16 and t["scales"].shape == (G, 64)
    assert t["g_idx"].dtype == torch.int32 and torch.equal(t["g_idx"], qw.g_idx)
    W_disk = dequantize_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], bits)
    expected = _fp16_scales(qw).dequantize()
    torch.testing.assert_close(W_disk.float(), expected, rtol=1e-3, atol=1e-3)
    if sym and bits == 4:
        assert torch.all(t["qzeros"] == 0x77777777)


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_awq_export_round_trip(group_size: int) -> None:
    torch.manual_seed(0)
    W = torch.randn(64, 256)
    qw = rtn_quantize(W, 4, group_size, sym=False)
    t = export.awq_tensors(qw)
    assert t["qweight"].dtype == torch.int32 and t["qweight"].shape == (256, 8)
    assert t["qzeros"].shape == (256 // group_size, 8) and t["scales"].shape == (
        256 // group_size,
        64,
    )
    W_disk = dequantize_awq(t["qweight"], t["qzeros"], t["scales"], group_size)
    torch.testing.assert_close(W_disk.float(), _fp16_scales(qw).dequantize(), rtol=1e-3, atol=1e-3)


def test_awq_refuses_what_it_cannot_store() -> None:
    W = torch.randn(16, 64)
    with pytest.raises(QServeError, match="4-bit"):
        export.awq_tensors(rtn_quantize(W, 8, 32, sym=False))
    H, _ = accumulate_hessian(None, 0, torch.randn(128, 64) * torch.rand(64))
    with pytest.raises(QServeError, match="g_idx"):
        export.awq_tensors(gptq_quantize(W, H, 4, 32, False, desc_act=True))


def test_configs() -> None:
    g = export.gptq_config(4, 128, True, True, 0.01)
    assert g["quant_method"] == "gptq" and g["checkpoint_format"] == "gptq"
    assert {"bits", "group_size", "desc_act", "sym", "damp_percent", "static_groups"} <= set(g)
    a = export.awq_config(64)
    assert a == {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 64,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": None,
    }
    c = export.compressed_tensors_config("float", "tensor", static_activations=True)
    assert c["format"] == "float-quantized" and c["ignore"] == ["lm_head"]
    group = c["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"]
    assert group["weights"] == {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "strategy": "tensor",
        "dynamic": False,
    }
    assert group["input_activations"]["strategy"] == "tensor"
    assert group["input_activations"]["dynamic"] is False


def test_output_folder_rules(tmp_path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "old.safetensors").write_text("x")
    with pytest.raises(QServeError, match="not empty"):
        output_dir.check_output_dir(out, overwrite=False)
    with output_dir.staging_dir(out, overwrite=True) as tmp:
        assert tmp.parent == out.parent.resolve() and tmp != out
        export.write_checkpoint(tmp, {"a": torch.zeros(2)}, {"x": 1}, {"extra.json": {"y": 2}})
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "extra.json",
        "model.safetensors",
    ]
    assert json.loads((out / "config.json").read_text()) == {"x": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temp folder left behind


def test_failed_write_leaves_destination_alone(tmp_path) -> None:
    out = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with output_dir.staging_dir(out) as tmp:
            (tmp / "partial").write_text("x")
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []
