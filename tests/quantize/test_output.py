"""Where `qserve quantize` writes: the default folder name, and ordinary file permissions."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner

from qserve.cli import cli
from qserve.quantize.driver import QuantizeSettings, default_output_dir, quantize_model


@pytest.mark.parametrize(
    ("settings", "name"),
    [
        (dict(method="gptq", group_size=64), "gptq-w4g64"),
        (dict(method="rtn", bits=8, group_size=-1), "rtn-w8ch"),
        (dict(method="awq", group_size=128), "awq-w4g128"),
        (dict(method="int8", bits=8), "int8-w8a8"),
        (dict(method="fp8", bits=8), "fp8"),
    ],
)
def test_scheme_names(settings: dict, name: str) -> None:
    assert QuantizeSettings(**settings).scheme_name == name


def test_default_output_dir_is_in_the_current_folder(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    gptq = QuantizeSettings(method="gptq", group_size=64)
    for model in ("smollm2-135m", "HuggingFaceTB/SmolLM2-135M", "models/tiny/", "tiny.gguf"):
        want = Path(model.rstrip("/")).name.removesuffix(".gguf") + "-gptq-w4g64"
        assert default_output_dir(model, gptq) == tmp_path / want


def _modes(folder: Path) -> set[tuple[str, int]]:
    """(kind, permission bits) of the folder and everything in it."""
    paths = [folder, *folder.rglob("*")]
    return {("dir" if p.is_dir() else "file", stat.S_IMODE(p.stat().st_mode)) for p in paths}


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    yield
    os.umask(old)


def test_cli_without_output_writes_model_method_scheme(monkeypatch, tiny_llama: Path, tmp_path):
    monkeypatch.chdir(tmp_path)
    args = ["quantize", str(tiny_llama), "-m", "rtn", "--group-size", "32", "-q"]
    ok = CliRunner().invoke(cli, args)
    assert ok.exit_code == 0, ok.output
    folder = tmp_path / f"{tiny_llama.name}-rtn-w4g32"
    assert f"wrote {folder} (rtn" in ok.output
    assert (folder / "model.safetensors").is_file() and (folder / "qserve_recipe.json").is_file()
    again = CliRunner().invoke(cli, args)
    assert again.exit_code == 2 and "is not empty" in again.output


def test_checkpoint_permissions_follow_the_umask(tiny_llama: Path, tmp_path, umask_027) -> None:
    """Not mkdtemp's 0700: folders 0777 and files 0666 less the umask, as save_pretrained."""
    folder = quantize_model(tiny_llama, tmp_path / "q", "awq", group_size=32, num_samples=2,
                            seq_len=32)  # fmt: skip
    assert (folder / "qserve" / "search_scales.safetensors").is_file()  # a subfolder too
    assert _modes(folder) == {("dir", 0o750), ("file", 0o640)}
    os.umask(0o022)
    folder = quantize_model(tiny_llama, tmp_path / "r", "rtn", group_size=32)
    assert _modes(folder) == {("dir", 0o755), ("file", 0o644)}
