"""The working device of calibration: cpu works, an unavailable one fails before any work, and on
CUDA only the current block and its inputs visit the device (those tests skip without CUDA)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from qserve.cli import cli
from qserve.errors import QServeError
from qserve.quantize.arch import arch_spec
from qserve.quantize.calibration import calibration_windows, load_calibration_text
from qserve.quantize.driver import QuantizeSettings, quantize_blocks, quantize_model, resolve_device

from ._helpers import grouped

CALIB = dict(num_samples=4, seq_len=32)
HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
no_cuda = pytest.mark.skipif(HAS_CUDA, reason="this machine has CUDA")


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def test_resolve_device() -> None:
    assert resolve_device(None) == torch.device("cuda" if HAS_CUDA else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    for bad in ("tpu", "cuda:x", "CPU", "cpu:0 "):
        with pytest.raises(QServeError, match="device must be cpu, cuda or cuda:N"):
            resolve_device(bad)


@no_cuda
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_without_cuda_fails_before_any_work(device: str, tmp_path: Path) -> None:
    # The model folder does not exist either: the device is refused first.
    with pytest.raises(QServeError) as err:
        quantize_model(
            tmp_path / "nowhere", tmp_path / "out", QuantizeSettings(method="gptq"), device=device
        )
    assert str(err.value) == f"device {device}: CUDA is not available on this machine"
    assert not (tmp_path / "out").exists()


@no_cuda
def test_cli_cuda_without_cuda_is_one_line(tiny_llama: Path, tmp_path: Path) -> None:
    args = ["quantize", str(tiny_llama), "-m", "rtn", "-o", str(tmp_path / "o"), "--device"]
    result = CliRunner().invoke(cli, [*args, "cuda"])
    assert result.exit_code == 2
    assert result.stderr == "error: device cuda: CUDA is not available on this machine\n"
    assert not (tmp_path / "o").exists()


def test_cpu_device(tiny_llama: Path, tmp_path: Path) -> None:
    kw = dict(group_size=32, kv_cache_dtype="fp8_e4m3", **CALIB)
    out = quantize_model(
        tiny_llama, tmp_path / "cpu", QuantizeSettings(method="gptq", **kw), device="cpu"
    )
    sd = tensors(out)
    assert sd["model.layers.1.self_attn.k_scale"].device.type == "cpu"
    if not HAS_CUDA:  # the default device is the CPU here: the same checkpoint
        default = tensors(
            quantize_model(tiny_llama, tmp_path / "default", QuantizeSettings(method="gptq", **kw))
        )
        assert sd.keys() == default.keys() and all(torch.equal(sd[k], default[k]) for k in sd)


# ----------------------------------------------------------------------------------- CUDA only


def _load(folder: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    text = load_calibration_text()
    ids = calibration_windows(AutoTokenizer.from_pretrained(folder), text, **CALIB)
    return model, ids


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("method", ["gptq", "awq", "fp8"])
def test_only_the_current_block_is_on_the_device(method: str, tiny_llama: Path) -> None:
    model, ids = _load(tiny_llama)
    spec = arch_spec("llama")
    settings = QuantizeSettings(method=method, **grouped(method), kv_cache_dtype="fp8_e4m3")
    blocks = model.get_submodule(spec.blocks)
    seen: list[tuple[int, str, list[str]]] = []

    def record(b: int):
        def hook(module, args, kwargs) -> None:
            x = args[0] if args else kwargs["hidden_states"]
            where = [next(block.parameters()).device.type for block in blocks]
            seen.append((b, x.device.type, where))

        return hook

    for b, block in enumerate(blocks):
        block.register_forward_pre_hook(record(b), with_kwargs=True)
    results = quantize_blocks(model, spec, settings, ids, device="cuda")
    assert seen and all(x == "cuda" for _, x, _ in seen)
    assert all(where == ["cuda" if i == b else "cpu" for i in range(2)] for b, _, where in seen)
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    for r in results.linears.values():
        assert {t.device.type for t in vars(r).values() if isinstance(t, torch.Tensor)} == {"cpu"}
    assert {m.device.type for pair in results.kv_absmax.values() for m in pair} == {"cpu"}


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("method", ["rtn", "gptq", "awq", "int8", "fp8"])
def test_cuda_checkpoint_matches_cpu(method: str, tiny_llama: Path, tmp_path: Path) -> None:
    kw = dict(**grouped(method), kv_cache_dtype="fp8_e4m3", dtype="float32", **CALIB)
    cpu = tensors(
        quantize_model(
            tiny_llama, tmp_path / "cpu", QuantizeSettings(method=method, **kw), device="cpu"
        )
    )
    cuda = tensors(
        quantize_model(
            tiny_llama, tmp_path / "cuda", QuantizeSettings(method=method, **kw), device="cuda"
        )
    )
    assert cpu.keys() == cuda.keys()
    for key in cpu:
        if cpu[key].is_floating_point() and cpu[key].element_size() > 1:
            torch.testing.assert_close(cuda[key], cpu[key], rtol=2e-3, atol=1e-5, msg=key)
        else:  # codes may differ where a value sits on a rounding boundary
            same = (cuda[key].view(torch.uint8) == cpu[key].view(torch.uint8)).float().mean()
            assert same > 0.9, key
