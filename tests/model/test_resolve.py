"""resolve_model and load_model on bad input: one-line QServeErrors naming the path."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from qserve.errors import QServeError
from qserve.model.builtin import gguf_cache_folder
from qserve.model.loader import load_model, load_tokenizer
from qserve.model.resolve import resolve_model


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("QSERVE_CACHE_DIR", str(root))
    return root


def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_local_folder_resolves_to_itself(tiny_checkpoints):
    folder = tiny_checkpoints["llama"]
    assert resolve_model(str(folder)) == folder


def test_missing_folder(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(QServeError, match=f"^model {missing} does not exist; expected a model"):
        resolve_model(str(missing))


def test_folder_without_config_json(tmp_path):
    with pytest.raises(QServeError) as err:
        resolve_model(str(tmp_path))
    assert str(err.value) == f"model folder {tmp_path} has no config.json; expected a model config"


def test_folder_without_safetensors(tmp_path, tiny_checkpoints):
    shutil.copy(tiny_checkpoints["llama"] / "config.json", tmp_path)
    with pytest.raises(QServeError) as err:
        resolve_model(str(tmp_path))
    assert str(err.value) == (
        f"model folder {tmp_path} has no model.safetensors or model.safetensors.index.json"
    )


def test_non_gguf_file_with_gguf_suffix(tmp_path, cache):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(QServeError) as err:
        resolve_model(str(fake))
    assert str(err.value) == f"{fake} is not a GGUF file (it does not start with b'GGUF')"


def test_missing_gguf_file(tmp_path, cache):
    with pytest.raises(QServeError, match=f"^{tmp_path}/x.gguf does not exist; expected a .gguf"):
        resolve_model(str(tmp_path / "x.gguf"))


def test_broken_gguf_leaves_no_cache_entry(tmp_path, cache):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\x00" * 60)
    with pytest.raises(QServeError, match=f"^could not convert {broken} with transformers: "):
        resolve_model(str(broken))
    leftovers = list((cache / "models" / "gguf").iterdir())
    assert leftovers == []


def test_gguf_cache_key_follows_path_size_and_mtime(tmp_path, cache):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF1234")
    first = gguf_cache_folder(f)
    assert first == gguf_cache_folder(f)
    assert first.parent == cache / "models" / "gguf" and first.name.startswith("m-")
    os.utime(f, ns=(0, 123))
    assert gguf_cache_folder(f) != first


def test_unknown_hub_id_fails_fast_with_one_line():
    start = time.monotonic()
    with pytest.raises(QServeError) as err:
        resolve_model("qserve-tests/no-such-model")
    assert str(err.value).startswith(
        "model qserve-tests/no-such-model is not a local folder and could not be fetched from "
        "the Hugging Face hub: "
    )
    assert "\n" not in str(err.value)
    assert time.monotonic() - start < 30


def test_unsupported_architecture_on_load(tmp_path, tiny_checkpoints):
    folder = copy_checkpoint(tiny_checkpoints["llama"], tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GemmaForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(QServeError, match="architecture GemmaForCausalLM is not supported"):
        load_model(folder, torch.float32)


def rewrite_weights(folder, edit):
    path = folder / "model.safetensors"
    state = load_file(path)
    edit(state)
    save_file(state, path, metadata={"format": "pt"})


def test_missing_tensor(tmp_path, tiny_checkpoints):
    folder = copy_checkpoint(tiny_checkpoints["qwen2"], tmp_path / "m")
    rewrite_weights(folder, lambda s: s.pop("model.norm.weight"))
    with pytest.raises(QServeError) as err:
        load_model(folder, torch.float32)
    assert str(err.value) == (
        f"checkpoint {folder} lacks 1 tensor(s) the model needs, e.g. model.norm.weight"
    )


def test_unexpected_tensor(tmp_path, tiny_checkpoints):
    folder = copy_checkpoint(tiny_checkpoints["qwen2"], tmp_path / "m")
    rewrite_weights(folder, lambda s: s.update({"model.layers.0.mlp.extra": torch.zeros(2)}))
    with pytest.raises(QServeError) as err:
        load_model(folder, torch.float32)
    assert str(err.value) == (
        f"checkpoint {folder} holds 1 tensor(s) the model does not use, "
        "e.g. model.layers.0.mlp.extra"
    )


def test_wrong_shape(tmp_path, tiny_checkpoints):
    folder = copy_checkpoint(tiny_checkpoints["qwen2"], tmp_path / "m")
    rewrite_weights(folder, lambda s: s.update({"model.norm.weight": torch.ones(3)}))
    with pytest.raises(QServeError) as err:
        load_model(folder, torch.float32)
    assert str(err.value) == f"{folder}: tensor model.norm.weight has shape [3]; expected [64]"


def test_corrupt_safetensors(tmp_path, tiny_checkpoints):
    folder = copy_checkpoint(tiny_checkpoints["qwen2"], tmp_path / "m")
    (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00garbage")
    with pytest.raises(QServeError, match=f"^{folder}/model.safetensors is not a readable safe"):
        load_model(folder, torch.float32)


def test_folder_without_tokenizer(tiny_checkpoints):
    folder = tiny_checkpoints["qwen2"]
    with pytest.raises(QServeError) as err:
        load_tokenizer(folder)
    assert str(err.value) == (
        f"model folder {folder} has no tokenizer; expected one of: "
        "tokenizer.json, tokenizer.model, vocab.json"
    )
