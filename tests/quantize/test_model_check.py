"""A checkpoint whose config.json lies about it is refused before any calibration."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from qserve.errors import QServeError
from qserve.quantize.driver import quantize_model
from qserve.quantize.settings import QuantizeSettings


def _lying_copy(tiny_llama: Path, tmp_path: Path, **config: object) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama, folder)
    data = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**data, **config}))
    return folder


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_hidden_layers": 5}, r"has no tensor model\.layers\.2\.\S+ \(\d+ more like it\)"),
        ({"num_hidden_layers": 1}, r"has tensor model\.layers\.1\.\S+, which the config never"),
        ({"intermediate_size": 192}, r"of shape \[256, 128\] where the config needs \[192, 128\]"),
    ],
)
def test_config_that_does_not_match_the_weights_is_refused(
    change: dict, message: str, tiny_llama: Path, tmp_path: Path, monkeypatch
) -> None:
    import qserve.quantize.driver as driver

    def no_calibration(*args, **kw):
        raise AssertionError("calibration started")

    monkeypatch.setattr(driver, "quantize_blocks", no_calibration)
    model = _lying_copy(tiny_llama, tmp_path, **change)
    with pytest.raises(QServeError, match=message):
        quantize_model(model, tmp_path / "out", QuantizeSettings(method="gptq", group_size=32))
    assert not (tmp_path / "out").exists()


def test_tied_lm_head_may_be_absent(tiny_llama: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from qserve.quantize.model_check import check_model_tensors, meta_model

    check_model_tensors(
        tiny_llama, meta_model(AutoConfig.from_pretrained(tiny_llama))
    )  # honest: passes
    model = _lying_copy(tiny_llama, tmp_path, tie_word_embeddings=True)
    tensors = load_file(model / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    check_model_tensors(
        model, meta_model(AutoConfig.from_pretrained(model))
    )  # tied: lm_head comes along
    untied = _lying_copy(model, tmp_path / "untied", tie_word_embeddings=False)
    with pytest.raises(QServeError, match="has no tensor lm_head.weight"):
        check_model_tensors(untied, meta_model(AutoConfig.from_pretrained(untied)))
