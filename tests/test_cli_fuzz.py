"""Every subcommand over a list of broken inputs: each is `error: ...` and exit status 2, never a
traceback on the user's terminal (nor the CLI's last-resort one-liner for unforeseen errors)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from qserve.cli import cli

Maker = Callable[[Path], Path]


def _missing(root: Path) -> Path:
    return root / "nowhere"


def _empty_dir(root: Path) -> Path:
    (root / "empty").mkdir()
    return root / "empty"


def _empty_file(root: Path) -> Path:
    (root / "empty.txt").write_bytes(b"")
    return root / "empty.txt"


def _binary_file(root: Path) -> Path:
    (root / "binary.txt").write_bytes(bytes(range(256)) * 4)
    return root / "binary.txt"


def _model_with(config: bytes | None, weights: bytes | None = None) -> Maker:
    def make(root: Path) -> Path:
        folder = root / "model"
        folder.mkdir()
        if config is not None:
            (folder / "config.json").write_bytes(config)
        if weights is not None:
            (folder / "model.safetensors").write_bytes(weights)
        return folder

    return make


def _truncated_model(tiny: Path) -> Maker:
    def make(root: Path) -> Path:
        folder = root / "truncated"
        shutil.copytree(tiny, folder)
        data = (folder / "model.safetensors").read_bytes()
        (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
        return folder

    return make


def _gguf(content: bytes) -> Maker:
    def make(root: Path) -> Path:
        (root / "m.gguf").write_bytes(content)
        return root / "m.gguf"

    return make


LLAMA_CONFIG = json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}).encode()
BAD_MODELS: dict[str, Maker] = {
    "missing": _missing,
    "empty-dir": _empty_dir,
    "a-file": _empty_file,
    "binary-config": _model_with(bytes(range(256))),
    "empty-config": _model_with(b""),
    "list-config": _model_with(b"[]"),
    "config-no-weights": _model_with(LLAMA_CONFIG),
    "garbage-weights": _model_with(LLAMA_CONFIG, b"\x00" * 64),
    "header-only-weights": _model_with(LLAMA_CONFIG, b"\xff" * 8 + b"{}"),
    "empty-gguf": _gguf(b""),
    "garbage-gguf": _gguf(b"GGUF" + b"\x00" * 60),
}
COMMANDS = {
    "generate": ["generate", "{model}", "-p", "x", "--max-tokens", "1"],
    "eval": ["eval", "{model}", "--data", "moby-dick-eval", "--max-tokens", "64"],
    "serve": ["serve", "{model}", "--port", "0"],
    "quantize": ["quantize", "{model}", "-m", "rtn", "-o", "{root}/out"],
}


def _assert_clean_error(args: list[str]) -> None:
    result = CliRunner().invoke(cli, args, catch_exceptions=True)
    shown = result.output + (result.stderr if result.stderr_bytes is not None else "")
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        f"{args}: {result.exception!r}\n{shown}"
    )
    assert "Traceback" not in shown and "error" in shown.lower(), shown
    # 2: a QServeError or a usage error, each with its own message; the CLI's last-resort
    # catch (exit 1, "-v shows where") means a case nobody handled
    assert result.exit_code == 2, shown


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("bad", BAD_MODELS)
def test_bad_models(command: str, bad: str, tmp_path: Path) -> None:
    model = BAD_MODELS[bad](tmp_path)
    args = [a.format(model=model, root=tmp_path) for a in COMMANDS[command]]
    _assert_clean_error(args)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.tiny import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("tiny"))


@pytest.mark.parametrize("command", COMMANDS)
def test_truncated_weights(command: str, tiny: Path, tmp_path: Path) -> None:
    model = _truncated_model(tiny)(tmp_path)
    _assert_clean_error([a.format(model=model, root=tmp_path) for a in COMMANDS[command]])


BAD_FILES: dict[str, Maker] = {
    "missing": _missing,
    "empty": _empty_file,
    "binary": _binary_file,
    "a-folder": _empty_dir,
}
FILE_OPTIONS = {
    "quantize --calib": ["quantize", "{tiny}", "-m", "gptq", "-o", "{root}/o",
                              "--calib", "{file}"],
    "quantize --scales": ["quantize", "{tiny}", "-m", "awq", "-o", "{root}/o",
                          "--scales", "{file}"],
    "quantize --recipe": ["quantize", "{tiny}", "-o", "{root}/o", "--recipe", "{file}"],
    "generate --recipe": ["generate", "{tiny}", "-p", "x", "--recipe", "{file}"],
    "eval --data": ["eval", "{tiny}", "--data", "{file}"],
    "recipes show": ["recipes", "show", "{file}"],
    "recipes check": ["recipes", "check", "{file}"],
    "quantize -o": ["quantize", "{tiny}", "-m", "rtn", "-o", "{file}/sub"],
}  # fmt: skip


@pytest.mark.parametrize("option", FILE_OPTIONS)
@pytest.mark.parametrize("bad", BAD_FILES)
def test_bad_files(option: str, bad: str, tiny: Path, tmp_path: Path) -> None:
    if option == "quantize --scales" and bad == "missing":
        pytest.skip("a missing --scales file is where the search is saved")
    if option == "quantize -o" and bad in ("missing", "a-folder"):
        pytest.skip("a folder inside a missing or empty folder is a fine place for a checkpoint")
    file = BAD_FILES[bad](tmp_path)
    args = [a.format(tiny=tiny, root=tmp_path, file=file) for a in FILE_OPTIONS[option]]
    _assert_clean_error(args)


def test_an_unforeseen_error_is_one_line_unless_verbose(monkeypatch) -> None:
    import qserve.recipe

    def broken() -> None:
        raise RuntimeError("something nobody planned for\nsecond line")

    monkeypatch.setattr(qserve.recipe, "shipped_recipes", broken)
    result = CliRunner().invoke(cli, ["recipes", "list"])
    assert result.exit_code == 1
    assert result.output == "error: RuntimeError: something nobody planned for (-v shows where)\n"


def test_serve_limit_options_come_from_request_limits() -> None:
    from dataclasses import fields

    from qserve.server.limits import RequestLimits

    help_text = CliRunner().invoke(cli, ["serve", "--help"], terminal_width=200).output
    for f in fields(RequestLimits):
        assert f.metadata["flag"] in help_text and f.metadata["help"] in help_text
    bad = CliRunner().invoke(cli, ["serve", "--max-request-body", "8gigs"])
    assert bad.exit_code == 2 and "cannot read memory size '8gigs'" in bad.output
