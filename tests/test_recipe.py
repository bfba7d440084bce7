"""Recipes: every shipped file loads and round-trips, malformed files fail in one line naming the
key, contradictions are rejected, `--recipe auto` picks by hardware, explicit flags beat the recipe,
and each recipe quantizes a tiny model and generates from the checkpoint on CPU."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import click
import pytest
import yaml
from click.testing import CliRunner

from qserve import recipe as rc
from qserve.cli import cli
from qserve.config import EngineConfig
from qserve.errors import QServeError
from qserve.options import click_options, field_names, given_values
from qserve.quantize.settings import QuantizeSettings
from qserve.recipe import Hardware, Requires

SHIPPED = {
    "h100-fp8",
    "h200-fp8-long-context",
    "a100-awq-w4",
    "l4-gptq-w4",
    "rtx4090-awq-w4",
    "cpu-int8",
    "cpu-w4",
}
GIB = 2**30


def write(tmp_path: Path, data: dict[str, Any], name: str = "r.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def base(name: str = "l4-gptq-w4", **changes: Any) -> dict[str, Any]:
    """Shipped recipe `name` as a dict; `changes` maps 'section.key' to a new value (None:
    delete the key)."""
    data = yaml.safe_load(rc.find_recipe(name).path.read_text())
    for dotted, value in changes.items():
        *sections, key = dotted.split(".")
        target = data
        for s in sections:
            target = target.setdefault(s, {})
        target[key] = value
        if value is None:
            del target[key]
    return data


def error_of(tmp_path: Path, data: dict[str, Any]) -> str:
    path = write(tmp_path, data)
    with pytest.raises(QServeError) as info:
        rc.load_recipe(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    return message


# --------------------------------------------------------------------------- shipped recipes


def test_every_required_recipe_ships_and_loads():
    recipes = rc.shipped_recipes()
    assert {r.name for r in recipes} == SHIPPED
    for r in recipes:
        assert r.spec.description and r.spec.hardware and r.spec.why
        assert rc.contradictions(r) == []


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_recipe_round_trips(tmp_path, name):
    recipe = rc.find_recipe(name)
    again = rc.load_recipe(write(tmp_path, yaml.safe_load(rc.dump_recipe(recipe.spec))))
    assert again.spec == recipe.spec


def test_find_by_name_and_by_path():
    by_name = rc.find_recipe("cpu-w4")
    assert rc.find_recipe(str(by_name.path)).spec == by_name.spec
    assert by_name.name == "cpu-w4" and by_name.quantize.method == "gptq"


def test_recipes_need_no_torch():
    code = "import sys, qserve.recipe as r; r.shipped_recipes(); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------------------------------- malformed recipes


def test_unknown_key_names_it_and_the_allowed_keys(tmp_path):
    message = error_of(tmp_path, base(**{"quantize.bitz": 4}))
    assert "quantize.bitz: unknown key (allowed: method, bits, group_size," in message


def test_unknown_top_level_section(tmp_path):
    message = error_of(tmp_path, base(server={"dtype": "float16"}))
    allowed = "description, hardware, why, requires, quantize, serve"
    assert f"server: unknown key (allowed: {allowed})" in message


def test_wrong_type(tmp_path):
    message = error_of(tmp_path, base(**{"serve.block_size": "16"}))
    assert "serve.block_size: expected an integer, got '16'" in message


def test_unknown_method_lists_the_methods(tmp_path):
    message = error_of(tmp_path, base(**{"quantize.method": "nf4"}))
    allowed = "rtn, gptq, awq, int8, fp8, auto"
    assert f"quantize.method: 'nf4' is not allowed (allowed: {allowed})" in message


def test_unknown_kv_cache_dtype(tmp_path):
    message = error_of(tmp_path, base(**{"serve.kv_cache_dtype": "fp8"}))
    assert "serve.kv_cache_dtype: 'fp8' is not allowed (allowed: auto, fp8_e4m3, fp8_e5m2)" in (
        message
    )


def test_missing_key(tmp_path):
    data = base()
    del data["requires"]["device"]
    assert "requires.device: missing" in error_of(tmp_path, data)


def test_bad_memory_size(tmp_path):
    message = error_of(tmp_path, base(**{"serve.kv_cache_memory": "8 gigs"}))
    assert "serve.kv_cache_memory: cannot read memory size '8 gigs'" in message


def test_missing_file_and_unknown_name(tmp_path):
    with pytest.raises(QServeError, match=r"recipe .*nowhere.yaml: no such file"):
        rc.find_recipe(str(tmp_path / "nowhere.yaml"))
    with pytest.raises(QServeError, match=r"no recipe named 'h100' \(shipped: a100-awq-w4, "):
        rc.find_recipe("h100")


def test_yaml_bomb_is_refused_at_once(tmp_path):
    """Nine levels of nine aliases: 1 kB of text, 9**9 list items if expanded."""
    lines = ["l0: &l0 [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 9):
        lines.append(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]")
    (tmp_path / "bomb.yaml").write_text("\n".join([*lines, "quantize: *l8", ""]))
    start = time.monotonic()
    with pytest.raises(QServeError, match=r"bomb.yaml: aliases are not allowed \(line 2\)"):
        rc.load_recipe(tmp_path / "bomb.yaml")
    assert time.monotonic() - start < 1.0


def test_huge_binary_and_unreadable_files_are_refused(tmp_path):
    (tmp_path / "huge.yaml").write_text("# " + "x" * rc.MAX_RECIPE_BYTES)
    with pytest.raises(QServeError, match="huge.yaml: larger than 65536 bytes"):
        rc.load_recipe(tmp_path / "huge.yaml")
    (tmp_path / "binary.yaml").write_bytes(b"\xff\xfe\x00\x01")
    with pytest.raises(QServeError, match="binary.yaml: not UTF-8 text"):
        rc.load_recipe(tmp_path / "binary.yaml")
    with pytest.raises(QServeError, match="no such file"):
        rc.load_recipe(tmp_path)  # a folder


def test_errors_quote_only_an_excerpt_of_the_input(tmp_path):
    message = error_of(tmp_path, base(**{"quantize.method": "m" * 10_000}))
    assert "quantize.method: 'mmmm" in message and "m... is not allowed" in message
    assert len(message) < 300


def test_not_yaml_and_not_a_mapping(tmp_path):
    (tmp_path / "bad.yaml").write_text("quantize: [\n")
    with pytest.raises(QServeError, match="not valid YAML"):
        rc.load_recipe(tmp_path / "bad.yaml")
    (tmp_path / "list.yaml").write_text("- a\n")
    with pytest.raises(QServeError, match="expected a mapping"):
        rc.load_recipe(tmp_path / "list.yaml")


# ---------------------------------------------------------------------------- contradictions

CC80 = {"requires.min_compute_capability": 8.0}
CONTRADICTIONS = [
    (base("h100-fp8", **CC80), "quantize.method: fp8 matmuls need compute capability >= 8.9"),
    (
        base("l4-gptq-w4", **CC80),
        "serve.kv_cache_dtype: the Triton paged-attention kernel reads fp8_e4m3 pages only on "
        "compute capability >= 8.9 (requires.min_compute_capability is 8.0); allowed here: auto, "
        "fp8_e5m2",
    ),
    (
        base("l4-gptq-w4", **{"serve.kv_cache_dtype": "auto"}),
        "serve.kv_cache_dtype: auto contradicts quantize.kv_cache_dtype fp8_e4m3",
    ),
    (base("a100-awq-w4", **{"quantize.sym": True}), "quantize.sym: only rtn, gptq use it, but"),
    (base("a100-awq-w4", **{"quantize.bits": 8}), "quantize.bits: awq takes bits 4, got 8"),
    (
        base("h100-fp8", **{"quantize.group_size": 128}),
        "quantize.group_size: only rtn, gptq, awq use it, but method is fp8",
    ),
    (base("h100-fp8", **{"serve.device": "cpu"}), "serve.device: cpu contradicts requires.device"),
    (
        base("h100-fp8", **{"requires.cpu_features": ["bf16"]}),
        "requires.cpu_features: does not apply to device cuda",
    ),
    (
        base("cpu-int8", **{"quantize.method": "fp8", "quantize.smooth_alpha": None}),
        "quantize.method: fp8 has no CPU matmul kernel",
    ),
    (
        base("cpu-int8", **{"serve.dtype": "float32"}),
        "serve.dtype: torch's CPU int8 weight-only kernel needs bfloat16/float16",
    ),
]


@pytest.mark.parametrize(
    ("data", "expected"), CONTRADICTIONS, ids=[c[1][:40] for c in CONTRADICTIONS]
)
def test_contradictions_are_rejected_with_the_reason(tmp_path, data, expected):
    assert expected in error_of(tmp_path, data)


def test_fp32_activations_are_fine_for_the_cpu_w4_kernel(tmp_path):
    """The C++ W4 kernel takes fp32 activations (only torch's int8 kernel needs 16-bit ones)."""
    data = base("cpu-w4", **{"serve.dtype": "float32"})
    assert rc.load_recipe(write(tmp_path, data)).serve.dtype == "float32"


def test_fp8_e5m2_kv_is_fine_on_ampere(tmp_path):
    data = base(**{"requires.min_compute_capability": 8.0, "serve.kv_cache_dtype": "fp8_e5m2"})
    data["quantize"]["kv_cache_dtype"] = "fp8_e5m2"
    assert rc.load_recipe(write(tmp_path, data)).serve.kv_cache_dtype == "fp8_e5m2"


# ------------------------------------------------------------------------- hardware, auto

MACHINES = [
    (Hardware("cuda", "NVIDIA H200", 139.8 * GIB, 9.0), "h200-fp8-long-context"),
    (Hardware("cuda", "NVIDIA H100 80GB HBM3", 79.1 * GIB, 9.0), "h100-fp8"),
    (Hardware("cuda", "NVIDIA A100-SXM4-40GB", 39.4 * GIB, 8.0), "a100-awq-w4"),
    (Hardware("cuda", "NVIDIA A100-SXM4-80GB", 79.1 * GIB, 8.0), "a100-awq-w4"),
    (Hardware("cuda", "NVIDIA L4", 22.0 * GIB, 8.9), "l4-gptq-w4"),
    (Hardware("cuda", "NVIDIA GeForce RTX 4090", 23.6 * GIB, 8.9), "rtx4090-awq-w4"),
    (Hardware("cuda", "NVIDIA B200", 178 * GIB, 10.0), "h200-fp8-long-context"),
    (Hardware("cpu", "Xeon", 64 * GIB, None, frozenset({"avx2", "avx512", "bf16"})), "cpu-w4"),
    (Hardware("cpu", "EPYC", 16 * GIB, None, frozenset({"avx2"})), "cpu-int8"),
]


@pytest.mark.parametrize(
    ("hw", "expected"), MACHINES, ids=[m[1] + "-" + m[0].name for m in MACHINES]
)
def test_auto_picks_the_closest_fit(hw, expected):
    assert rc.select_recipe(rc.shipped_recipes(), hw).name == expected


def test_auto_fails_when_nothing_fits():
    t4 = Hardware("cuda", "Tesla T4", 14.6 * GIB, 7.5)
    with pytest.raises(QServeError, match="no shipped recipe fits this machine .*Tesla T4"):
        rc.select_recipe(rc.shipped_recipes(), t4)


def test_unmet_requirements_say_why():
    req = Requires(device="cuda", min_compute_capability=8.9, min_memory="20GiB")
    assert rc.unmet_requirements(req, Hardware("cuda", "A10", 22 * GIB, 8.6)) == [
        "needs compute capability >= 8.9, found 8.6"
    ]
    assert rc.unmet_requirements(req, Hardware("cuda", "x", 15 * GIB, 9.0)) == [
        "needs 20GiB memory, found 15.0 GiB"
    ]
    assert rc.unmet_requirements(req, Hardware("cpu", "x", 15 * GIB)) == [
        "needs a cuda device, found cpu"
    ]


def test_resolve_auto_uses_the_detected_hardware(monkeypatch):
    l4 = Hardware("cuda", "NVIDIA L4", 22.0 * GIB, 8.9)
    monkeypatch.setattr(rc, "detect_hardware", lambda: l4)
    assert rc.resolve_recipe("auto").name == "l4-gptq-w4"
    assert rc.resolve_recipe("cpu-w4").name == "cpu-w4"


def test_detect_hardware_on_this_machine():
    import torch

    hw = rc.detect_hardware()
    assert hw.device == ("cuda" if torch.cuda.is_available() else "cpu") and hw.memory > 0
    assert hw.describe().startswith(hw.device + ": ")


def test_whole_number_capability_is_a_float():
    assert Requires(device="cuda", min_compute_capability=9).min_compute_capability == 9.0


def test_gpu_names_match_whole_words():
    assert "l4" not in rc.gpu_name_words("NVIDIA L40S")
    assert "a100" in rc.gpu_name_words("NVIDIA A100-SXM4-80GB")


# ------------------------------------------------------------------------- CLI precedence


def run_with_recipe(
    args: list[str], recipe: rc.Recipe | None, cls: type = EngineConfig
) -> tuple[Any, dict]:
    """Run a command with `cls`'s options; return merge_settings' (settings, origin)."""
    seen: dict[str, Any] = {}

    @click.command()
    @click_options(cls)
    def command(**kw: Any) -> None:
        given = given_values(cls, kw)
        section = "serve" if cls is EngineConfig else "quantize"
        seen["settings"], seen["origin"] = rc.merge_settings(cls, given, recipe, section)

    result = CliRunner().invoke(command, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return seen["settings"], seen["origin"]


def with_values(recipe: rc.Recipe, section: str, values: dict[str, Any]) -> rc.Recipe:
    return dataclasses.replace(recipe, **{f"{section}_values": values})


def test_recipe_beats_defaults_and_explicit_flags_beat_the_recipe():
    recipe = rc.find_recipe("l4-gptq-w4")
    config, origin = run_with_recipe(["--kv-cache-dtype", "auto", "--max-num-seqs", "8"], recipe)
    assert config.kv_cache_dtype == "auto" and origin["kv_cache_dtype"] == "cli"  # = default
    assert config.max_num_seqs == 8 and origin["max_num_seqs"] == "cli"
    assert config.kv_cache_memory == "8GiB" and origin["kv_cache_memory"] == "recipe"
    assert config.device == "cuda" and config.dtype == "float16"
    assert config.max_model_len is None and "max_model_len" not in origin  # the field's default


def test_recipe_prefix_caching_is_the_flag():
    recipe = rc.find_recipe("cpu-w4")
    off = with_values(recipe, "serve", {"enable_prefix_caching": False})
    config, origin = run_with_recipe([], off)
    assert config.enable_prefix_caching is False and origin["enable_prefix_caching"] == "recipe"
    on = with_values(recipe, "serve", {"enable_prefix_caching": True})
    config, origin = run_with_recipe(["--no-enable-prefix-caching"], on)
    assert config.enable_prefix_caching is False and origin["enable_prefix_caching"] == "cli"


def test_quantize_keys_are_the_quantize_flags():
    recipe = with_values(
        rc.find_recipe("cpu-w4"),
        "quantize",
        {"calib": "c.txt", "ignore": ["lm_head", "re:.*gate"], "seq_len": 256, "damp": 0.05},
    )
    settings, origin = run_with_recipe(["--seq-len", "64"], recipe, QuantizeSettings)
    assert (settings.calib, settings.ignore) == ("c.txt", ("lm_head", "re:.*gate"))
    assert settings.seq_len == 64 and origin["seq_len"] == "cli"
    assert settings.damp == 0.05 and origin["damp"] == "recipe"


@pytest.mark.parametrize("cls", [QuantizeSettings, EngineConfig])
def test_every_key_is_a_flag_of_the_same_name(cls):
    """One name per concept: each settings field is a recipe key and a CLI option (--a-b for
    a_b; a bool also --no-a-b), the model of EngineConfig being MODEL, an argument."""

    @click.command()
    @click_options(cls, skip=("model",))
    def command(**kw: Any) -> None:
        pass

    options = {p.name: p for p in command.params}
    names = [n for n in field_names(cls) if n != "model"]
    assert sorted(options) == sorted(names)
    for name in names:
        assert f"--{name.replace('_', '-')}" in options[name].opts or name == "sym"
    if cls is QuantizeSettings:
        assert options["sym"].opts == ["--sym"] and options["sym"].secondary_opts == ["--asym"]


def test_format_settings_and_provenance(tmp_path):
    recipe = rc.find_recipe("cpu-w4")
    line = rc.format_settings({"bits": 4, "seq_len": 64}, {"bits": "recipe", "seq_len": "cli"})
    assert line == "bits=4 (recipe), seq_len=64 (cli)"
    from qserve.model.loader import read_provenance
    from qserve.quantize.export import write_provenance

    write_provenance(tmp_path, rc.provenance(recipe, {"bits": 4}))
    saved = read_provenance(tmp_path)
    assert saved["recipe"] == "cpu-w4" and saved["effective"] == {"bits": 4}
    assert rc.RecipeSpec.model_validate(saved["spec"]) == recipe.spec
    assert read_provenance(tmp_path / "nothing") is None


# ------------------------------------------------------------------------------- the CLI


def test_cli_list_show_and_missing():
    runner = CliRunner()
    listed = runner.invoke(cli, ["recipes", "list"])
    assert listed.exit_code == 0 and {ln.split()[0] for ln in listed.output.splitlines()} == SHIPPED
    shown = runner.invoke(cli, ["recipes", "show", "h100-fp8"])
    assert shown.output == rc.find_recipe("h100-fp8").path.read_text()
    missing = runner.invoke(cli, ["recipes", "show", "h100"])
    assert missing.exit_code == 2 and missing.output.count("\n") == 1


def test_cli_check(monkeypatch):
    h100 = Hardware("cuda", "NVIDIA H100 80GB HBM3", 79.1 * GIB, 9.0)
    monkeypatch.setattr(rc, "detect_hardware", lambda: h100)
    runner = CliRunner()
    ok = runner.invoke(cli, ["recipes", "check", "h100-fp8"])
    assert ok.exit_code == 0 and "h100-fp8 (NVIDIA H100" in ok.output and ": meets" in ok.output
    assert "--recipe auto picks: h100-fp8" in ok.output
    no = runner.invoke(cli, ["recipes", "check", "cpu-w4"])
    assert no.exit_code == 1 and "does not meet: needs a cpu device, found cuda" in no.output
    assert runner.invoke(cli, ["recipes", "check"]).exit_code == 0
    monkeypatch.setattr(rc, "detect_hardware", lambda: Hardware("cuda", "T4", 14 * GIB, 7.5))
    nothing = runner.invoke(cli, ["recipes", "check"])
    assert nothing.exit_code == 1 and "no shipped recipe fits this machine" in nothing.output


# ------------------------------------------------------------- end to end on a tiny model

TINY_CALIB = {"num_samples": 4, "seq_len": 32}  # what explicit CLI flags would override
TINY_SERVE = {"device": "cpu", "kv_cache_memory": "16MiB", "max_model_len": 128}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from tests.quantize._helpers import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_recipe_quantizes_and_generates_on_cpu(tmp_path, tiny_model, name):
    """Each recipe's quantize section runs on CPU; the checkpoint loads and generates with the
    serve section (device, KV memory and context forced to CPU-sized values)."""
    import torch

    from qserve.engine.llm import LLM
    from qserve.engine.sampling_params import SamplingParams
    from qserve.model.loader import read_provenance
    from qserve.quantize.driver import quantize_model
    from qserve.quantize.settings import QuantizeSettings

    torch.set_num_threads(1)
    recipe = rc.find_recipe(name)
    kwargs = recipe.section_values("quantize") | TINY_CALIB
    kwargs.pop("kv_cache_dtype", None)  # recorded, not a driver argument
    made_by = rc.provenance(recipe, kwargs)
    out = quantize_model(tiny_model, tmp_path / "q", QuantizeSettings(**kwargs), provenance=made_by)
    serve = recipe.serve_values | TINY_SERVE
    llm = LLM(str(out), **serve)
    assert llm.engine.config.kv_cache_dtype == recipe.serve.kv_cache_dtype
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    [result] = llm.generate(["Call me Ishmael."], params)
    assert len(result.outputs[0].token_ids) == 4
    assert read_provenance(out)["recipe"] == name


def test_engine_start_up_names_the_recipe_that_made_the_checkpoint(tmp_path, caplog):
    import logging

    from qserve.engine.llm import LLM
    from qserve.quantize.export import write_provenance
    from qserve.recipe import find_recipe, provenance
    from tests.tiny import save_tiny_llama

    folder = save_tiny_llama(tmp_path / "tiny")
    write_provenance(folder, provenance(find_recipe("cpu-int8"), {"method": "int8"}))
    with caplog.at_level(logging.INFO, logger="qserve"):
        LLM(str(folder), dtype="float32", kv_cache_memory="1MiB")
    assert "recipe cpu-int8" in caplog.text
    caplog.clear()
    write_provenance(folder, provenance(None, {"method": "int8"}))  # made without a recipe
    with caplog.at_level(logging.INFO, logger="qserve"):
        LLM(str(folder), dtype="float32", kv_cache_memory="1MiB")
    assert "(made by qserve quantize)" in caplog.text and "recipe None" not in caplog.text
