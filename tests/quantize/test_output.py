"""Where `qserve quantize` writes: the default folder name, and ordinary file permissions."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner

from qserve.cli import cli
from qserve.errors import QServeError
from qserve.quantize import output_dir
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
    folder = quantize_model(
        tiny_llama,
        tmp_path / "q",
        QuantizeSettings(method="awq", group_size=32, num_samples=2, seq_len=32),
    )
    assert (folder / "qserve" / "search_scales.safetensors").is_file()  # a subfolder too
    assert _modes(folder) == {("dir", 0o750), ("file", 0o640)}
    os.umask(0o022)
    folder = quantize_model(
        tiny_llama, tmp_path / "r", QuantizeSettings(method="rtn", group_size=32)
    )
    assert _modes(folder) == {("dir", 0o755), ("file", 0o644)}


# -- what --overwrite may replace ---------------------------------------------------------------


def _listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def _quantize_cli(*args: str) -> object:
    return CliRunner().invoke(cli, ["quantize", *args, "-m", "rtn", "--group-size", "32", "-q"])


def test_overwrite_never_replaces_the_current_folder(monkeypatch, tiny_llama, tmp_path) -> None:
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / ".git").mkdir()
    (project / "src" / "main.py").write_text("print('hi')")
    before = _listing(project)
    monkeypatch.chdir(project / "src")
    for target in (".", "..", str(project)):
        result = _quantize_cli(str(tiny_llama), "-o", target, "--overwrite")
        assert result.exit_code == 2, result.output
        assert "error: output folder" in result.output and "current folder" in result.output
    assert _listing(project) == before


def test_overwrite_never_replaces_the_input_model(tiny_llama: Path, tmp_path: Path) -> None:
    before = _listing(tiny_llama)
    for target in (tiny_llama, tiny_llama.parent):
        result = _quantize_cli(str(tiny_llama), "-o", str(target), "--overwrite")
        assert result.exit_code == 2 and "input model" in result.output, result.output
    assert _listing(tiny_llama) == before


def test_overwrite_replaces_only_a_checkpoint_folder(tiny_llama: Path, tmp_path: Path) -> None:
    unrelated = tmp_path / "photos"
    unrelated.mkdir()
    (unrelated / "config.json").write_text("{}")  # looks like a checkpoint, but ...
    (unrelated / "holiday.jpg").write_bytes(b"\xff\xd8")
    result = _quantize_cli(str(tiny_llama), "-o", str(unrelated), "--overwrite")
    assert result.exit_code == 2 and "holiday.jpg" in result.output, result.output
    assert _listing(unrelated) == ["config.json", "holiday.jpg"]
    checkpoint = tmp_path / "ckpt"
    assert _quantize_cli(str(tiny_llama), "-o", str(checkpoint)).exit_code == 0
    again = _quantize_cli(str(tiny_llama), "-o", str(checkpoint), "--overwrite")
    assert again.exit_code == 0, again.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "photos"]  # nothing aside


def test_a_failed_swap_keeps_the_old_checkpoint(tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text('{"old": true}')
    real_rename = Path.rename

    def failing_rename(self: Path, target: Path) -> Path:
        if Path(target) == out and ".tmp-" in self.name:
            raise OSError("disk gone")
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", failing_rename)
    with pytest.raises(OSError, match="disk gone"):
        with output_dir.staging_dir(out, overwrite=True) as tmp:
            (tmp / "config.json").write_text('{"new": true}')
    assert (out / "config.json").read_text() == '{"old": true}'
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_stale_staging_folders_of_dead_processes_are_removed(tmp_path: Path) -> None:
    out = tmp_path / "out"
    dead = tmp_path / ".out.tmp-999999999-abc"  # no such pid
    live = tmp_path / f".out.tmp-{os.getpid()}-xyz"
    for folder in (dead, live):
        folder.mkdir()
    with output_dir.staging_dir(out) as tmp:
        (tmp / "config.json").write_text("{}")
    assert not dead.exists() and live.exists()


def test_provenance_is_written_inside_the_checkpoint(tiny_llama: Path, tmp_path: Path) -> None:
    """Part of the atomic rename, and written for Python callers too; the loader reads it."""
    from qserve.model.loader import read_provenance
    from qserve.quantize.export import PROVENANCE_FILE

    folder = quantize_model(
        tiny_llama, tmp_path / "q", QuantizeSettings(method="rtn", group_size=32)
    )
    made_by = read_provenance(folder)
    assert made_by["recipe"] is None and made_by["effective"]["method"] == "rtn"
    assert made_by["effective"]["group_size"] == 32
    (folder / PROVENANCE_FILE).write_bytes(b"\xff")
    with pytest.raises(QServeError, match="is not readable JSON"):
        read_provenance(folder)
