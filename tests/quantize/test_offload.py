"""Calibration with the decoder blocks offloaded to disk (`offload_dir`): the same checkpoint,
bit for bit, with about one block in memory at a time, and one-line errors for bad folders."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from qserve.cli import cli
from qserve.errors import QServeError
from qserve.quantize import driver, offload
from qserve.quantize.calibration import load_calibration_text
from qserve.quantize.driver import SEARCH_FILE, quantize_model
from qserve.quantize.export import merge_safetensors
from qserve.quantize.settings import QuantizeSettings

from ._helpers import grouped, make_tiny_model

CALIB = dict(num_samples=4, seq_len=32)

CASES = {  # name -> quantize_model keywords
    "rtn": dict(method="rtn"),
    "gptq-desc-act": dict(method="gptq", desc_act=True, static_groups=True),
    "awq": dict(method="awq"),
    "int8": dict(method="int8", activation_scheme="static"),
    "int8-gptq": dict(method="int8", gptq_weights=True, smooth_alpha=0.0),
    "fp8": dict(method="fp8", weight_strategy="tensor"),
    "gptq-kv": dict(method="gptq", kv_cache_dtype="fp8_e4m3"),
    "fp8-kv": dict(method="fp8", activation_scheme="static", kv_cache_dtype="fp8_e4m3"),
}


@pytest.fixture(scope="module")
def calib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A short calibration text: tokenizing the bundled chapters dominates a tiny model's run."""
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text(load_calibration_text()[:6000])
    return path


@pytest.fixture(scope="module")
def tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tied"), tie=True, seed=1)


@pytest.fixture(scope="module")
def sharded(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_llama saved in ~300 KB shards with model.safetensors.index.json; some blocks span
    two shards."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("sharded")
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    model.save_pretrained(folder, max_shard_size="300KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_llama / name, folder / name)
    assert (folder / offload.INDEX_FILE).is_file() and len(list(folder.glob("*.safetensors"))) > 2
    return folder


def _quantize_both(model: Path, tmp_path: Path, calib: Path, **kw) -> tuple[Path, Path]:
    kw = dict(**grouped(kw.get("method", "gptq")), calib=calib, **CALIB, **kw)
    plain = quantize_model(model, tmp_path / "plain", QuantizeSettings(**kw))
    offloaded = quantize_model(
        model, tmp_path / "offloaded", QuantizeSettings(**kw), offload_dir=tmp_path / "off"
    )
    return plain, offloaded


def _assert_same_checkpoint(a: Path, b: Path) -> None:
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    for name in files:
        if name.suffix == ".safetensors":
            ta, tb = load_file(str(a / name)), load_file(str(b / name))
            assert list(ta) == list(tb)
            for key in ta:
                assert ta[key].dtype == tb[key].dtype and torch.equal(ta[key], tb[key]), key
            assert _metadata(a / name) == _metadata(b / name)
        elif name.suffix == ".json":
            assert json.loads((a / name).read_text()) == json.loads((b / name).read_text())
    # laid out as save_file lays it out: even the bytes are the same
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()


def _metadata(path: Path) -> dict[str, str] | None:
    with safe_open(str(path), "pt") as f:  # a hash map: its order on disk varies run to run
        return f.metadata()


# ------------------------------------------------------------------------- same checkpoint


@pytest.mark.parametrize("case", list(CASES))
def test_offload_gives_the_same_checkpoint(
    case: str, tiny_llama: Path, calib: Path, tmp_path: Path
) -> None:
    plain, offloaded = _quantize_both(tiny_llama, tmp_path, calib, **CASES[case])
    _assert_same_checkpoint(plain, offloaded)
    assert not (tmp_path / "off").exists()  # created for the run, removed after


@pytest.mark.parametrize("method", ["rtn", "awq"])
def test_tied_embeddings_stay_tied(method: str, tied: Path, calib: Path, tmp_path: Path) -> None:
    plain, offloaded = _quantize_both(tied, tmp_path, calib, method=method)
    _assert_same_checkpoint(plain, offloaded)
    assert "lm_head.weight" not in load_file(str(offloaded / "model.safetensors"))


def test_sharded_checkpoint(sharded: Path, tiny_llama: Path, calib: Path, tmp_path: Path) -> None:
    plain, offloaded = _quantize_both(sharded, tmp_path, calib, method="gptq")
    _assert_same_checkpoint(plain, offloaded)
    from_single = quantize_model(
        tiny_llama,
        tmp_path / "single",
        QuantizeSettings(method="gptq", group_size=32, calib=calib, **CALIB),
    )
    assert torch.equal(*(load_file(str(f / "model.safetensors"))[
        "model.layers.1.mlp.down_proj.qweight"] for f in (offloaded, from_single)))  # fmt: skip


@pytest.mark.parametrize("method", ["awq", "int8"])
def test_replayed_search(method: str, tiny_llama: Path, calib: Path, tmp_path: Path) -> None:
    kw = dict(method=method, **grouped(method), calib=calib, **CALIB)
    searched = quantize_model(tiny_llama, tmp_path / "searched", QuantizeSettings(**kw))
    replay = dict(scales=searched / SEARCH_FILE, offload_dir=tmp_path / "off")
    replayed = quantize_model(tiny_llama, tmp_path / "replayed", QuantizeSettings(**kw), **replay)
    _assert_same_checkpoint(searched, replayed)


# ------------------------------------------------------------------------- memory


def test_one_block_in_memory_at_a_time(
    tiny_llama: Path, calib: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    models: list[torch.nn.Module] = []
    counts: dict[str, list[int]] = {"capture": [], "quantize": [], "outputs": [], "done": []}
    files: list[int] = []

    def materialized() -> int:
        return sum(map(offload.is_materialized, models[0].model.layers))

    def counting(stage: str, fn):
        def wrapped(*args, **kw):
            counts[stage].append(materialized())
            return fn(*args, **kw)

        return wrapped

    def keep(*args, **kw):
        models.append(empty_model(*args, **kw))
        return models[-1]

    empty_model = offload.empty_model
    monkeypatch.setattr(offload, "empty_model", keep)
    for stage, name in [("capture", "capture_block_inputs"), ("quantize", "quantize_block"),
                        ("outputs", "_block_outputs")]:  # fmt: skip
        monkeypatch.setattr(driver, name, counting(stage, getattr(driver, name)))

    def progress(done: int, total: int, seconds_left: float) -> None:
        counts["done"].append(materialized())
        files.append(len(list((tmp_path / "off").glob("*/*.safetensors"))))

    kw = dict(group_size=32, calib=calib, kv_cache_dtype="fp8_e4m3", **CALIB)
    quantize_model(
        tiny_llama,
        tmp_path / "o",
        QuantizeSettings(method="gptq", **kw),
        progress=progress,
        offload_dir=tmp_path / "off",
    )
    assert counts == {"capture": [0], "quantize": [1, 1], "outputs": [1, 1], "done": [0, 0]}
    assert files == [1, 2]  # one file per finished block
    layers = models[0].model.layers
    assert all(p.is_meta for p in layers.parameters())  # the blocks were never all loaded
    assert not models[0].model.embed_tokens.weight.is_meta


# ------------------------------------------------------------------------- folders and errors


def test_existing_offload_dir_is_left_as_it_was(
    tiny_llama: Path, calib: Path, tmp_path: Path
) -> None:
    (tmp_path / "off").mkdir()
    (tmp_path / "off" / "mine.txt").write_text("keep me")
    quantize_model(
        tiny_llama,
        tmp_path / "o",
        QuantizeSettings(method="rtn", group_size=32),
        offload_dir=tmp_path / "off",
    )
    assert [p.name for p in (tmp_path / "off").iterdir()] == ["mine.txt"]


def test_offload_folder_is_removed_on_error(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(ctx, scales):
        if ctx.prefix.endswith(".1."):  # block 0 was written to the offload folder
            assert len(list((tmp_path / "a" / "off").glob("*/*"))) == 1
            raise RuntimeError("boom")
        return quantize_block(ctx, scales)

    quantize_block = driver.quantize_block
    monkeypatch.setattr(driver, "quantize_block", fail)
    with pytest.raises(RuntimeError, match="boom"):
        quantize_model(
            tiny_llama,
            tmp_path / "o",
            QuantizeSettings(method="rtn"),
            offload_dir=tmp_path / "a" / "off",
        )
    assert not (tmp_path / "a").exists() and not (tmp_path / "o").exists()


def _error(model: Path, tmp_path: Path, offload_dir: Path) -> str:
    with pytest.raises(QServeError) as err:
        quantize_model(
            model,
            tmp_path / "o",
            QuantizeSettings(method="rtn", group_size=32),
            offload_dir=offload_dir,
        )
    assert "\n" not in str(err.value) and not (tmp_path / "o").exists()
    return str(err.value)


def test_offload_dir_that_is_a_file(tiny_llama: Path, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    message = _error(tiny_llama, tmp_path, tmp_path / "file")
    assert message == f"offload folder {tmp_path / 'file'} exists and is not a folder"


def test_offload_dir_that_cannot_be_created(tiny_llama: Path, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    message = _error(tiny_llama, tmp_path, tmp_path / "file" / "off")
    assert message.startswith(f"cannot create offload folder {tmp_path / 'file' / 'off'}: ")


def test_offload_dir_inside_the_output(tiny_llama: Path, tmp_path: Path) -> None:
    assert "is inside the output folder" in _error(tiny_llama, tmp_path, tmp_path / "o" / "x")


def test_checkpoint_without_safetensors(tiny_llama: Path, tmp_path: Path) -> None:
    folder = tmp_path / "bin"
    shutil.copytree(tiny_llama, folder)
    torch.save(load_file(str(folder / "model.safetensors")), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    message = _error(folder, tmp_path, tmp_path / "off")
    assert message.startswith(f"{folder} has no .safetensors weights: offloading reads")
    assert not (tmp_path / "off").exists()


def test_checkpoint_missing_a_block_tensor(tiny_llama: Path, tmp_path: Path) -> None:
    folder = tmp_path / "partial"
    shutil.copytree(tiny_llama, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    message = _error(folder, tmp_path, tmp_path / "off")
    assert message.startswith(f"{folder}: the checkpoint does not match its config.json: it has "
                              "no tensor model.layers.1.mlp.up_proj.weight")  # fmt: skip
    assert not (tmp_path / "off").exists()


def test_broken_sharded_checkpoint(sharded: Path, tmp_path: Path) -> None:
    folder = tmp_path / "broken"
    shutil.copytree(sharded, folder)
    shard = sorted(folder.glob("*.safetensors"))[-1]
    shard.unlink()
    assert _error(folder, tmp_path, tmp_path / "off").startswith(f"cannot read {shard}: ")
    (folder / offload.INDEX_FILE).write_text("{")
    message = _error(folder, tmp_path, tmp_path / "off")
    assert message == f"{folder / offload.INDEX_FILE} is not a safetensors index"


def test_empty_model(tied: Path) -> None:
    checkpoint = offload.SafetensorsCheckpoint(tied)
    model = offload.empty_model(tied, checkpoint, "model.layers")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not offload.is_materialized(model.model.layers)
    ref = load_file(str(tied / "model.safetensors"))
    for name, t in model.state_dict().items():
        assert t.is_meta == name.startswith("model.layers."), name
        if not t.is_meta and name != "lm_head.weight":  # tied: not stored
            assert torch.equal(t, ref[name].float()), name


def test_cli_offload_dir(tiny_llama: Path, tmp_path: Path) -> None:
    args = ["quantize", str(tiny_llama), "-m", "rtn", "--group-size", "32", "-q"]
    off = ["--offload-dir", str(tmp_path / "off")]
    ok = CliRunner().invoke(cli, [*args, "-o", str(tmp_path / "o"), *off])
    assert ok.exit_code == 0, ok.output
    plain = CliRunner().invoke(cli, [*args, "-o", str(tmp_path / "plain")])
    assert plain.exit_code == 0, plain.output
    sd = load_file(str(tmp_path / "o" / "model.safetensors"))
    ref = load_file(str(tmp_path / "plain" / "model.safetensors"))
    assert sd.keys() == ref.keys() and all(torch.equal(sd[k], ref[k]) for k in sd)
    (tmp_path / "file").write_text("")
    args += ["-o", str(tmp_path / "bad"), "--offload-dir", str(tmp_path / "file" / "x")]
    bad = CliRunner().invoke(cli, args)
    assert bad.exit_code == 2
    assert (
        bad.stderr.startswith("error: cannot create offload folder") and bad.stderr.count("\n") == 1
    )


# ------------------------------------------------------------------------- streamed writer


def test_merge_safetensors_is_save_file(tmp_path: Path) -> None:
    torch.manual_seed(0)
    dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int8,
              torch.float8_e4m3fn, torch.bool, torch.int64]  # fmt: skip
    tensors = {
        f"t{j}.{i}": torch.randn(shape).to(dtype)
        for i, dtype in enumerate(dtypes)
        for j, shape in enumerate([(3, 5), (1,), (), (7,)])
    }
    names = list(tensors)
    save_file({n: tensors[n] for n in names[1::3]}, str(tmp_path / "a.safetensors"))
    save_file({n: tensors[n] for n in names[2::3]}, str(tmp_path / "b.safetensors"))
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    files = [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    memory = {n: tensors[n] for n in names[::3]}
    merge_safetensors(tmp_path / "merged.safetensors", memory, files, {"format": "pt"})
    ref = (tmp_path / "ref.safetensors").read_bytes()
    assert (tmp_path / "merged.safetensors").read_bytes() == ref
    with pytest.raises(ValueError, match=r"tensor t\S+ is in .*a.safetensors and elsewhere"):
        merge_safetensors(tmp_path / "twice.safetensors", tensors, files, {})
