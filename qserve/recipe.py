"""Recipes: one YAML per hardware target that drives both `quantize` and `serve`.

    description: one line            hardware: what it is for        why: why the choices fit
    requires:  device cuda|cpu, min_compute_capability, min_memory, gpu_names, cpu_features
    quantize:  QuantizeSettings fields (method, bits, group_size, sym, desc_act, calib, ...)
    serve:     EngineConfig fields (dtype, kv_cache_dtype, block_size, kv_cache_memory, ...)

The quantize and serve sections are those two settings types (`qserve.options`): a key is a
field name, which is also the CLI flag's name, so a recipe is a file form of the flags, not a
second set of knobs, and each section is checked by its type's one validator. Parsing is strict:
an unknown key, a wrong type, an unknown value or a contradiction raises a one-line QServeError
naming the file and the key. Explicit CLI flags override the recipe (`merge_settings`).

This module imports no torch; only `detect_hardware` does, inside the function.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from qserve.config import EngineConfig, parse_memory
from qserve.errors import QServeError
from qserve.options import excerpt, parse_section
from qserve.platform import Hardware, detect_hardware
from qserve.quantize.settings import QuantizeSettings

FP8_MIN_CAPABILITY = 8.9  # FP8 tensor cores (Ada sm_89, Hopper sm_90); Triton's fp8e4nv too
AUTO = "auto"

# ------------------------------------------------------------------------------------ schema


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Requires(_Section):
    """What the target hardware must have. `recipes check` and `--recipe auto` read this."""

    device: Literal["cuda", "cpu"]
    min_compute_capability: float | None = Field(None, ge=0)  # cuda only, e.g. 8.9
    min_memory: str | None = None  # GPU memory (cuda) or RAM (cpu), e.g. 24GiB
    gpu_names: list[str] = []  # words of the GPU name; `--recipe auto` prefers a match
    cpu_features: list[Literal["avx2", "avx512", "bf16"]] = []  # bf16: AMX or AVX-512 BF16

    @field_validator("min_memory")
    @classmethod
    def _memory_size(cls, value: str | None) -> str | None:
        return _memory(value)


class RecipeSpec(_Section):
    """The whole file."""

    description: str
    hardware: str
    why: str
    requires: Requires
    quantize: dict[str, Any]  # QuantizeSettings fields, checked by `load_recipe`
    serve: dict[str, Any] = {}  # EngineConfig fields but model


def _memory(value: str | None) -> str | None:
    if value is not None:
        parse_memory(value)
    return value


@dataclass(frozen=True)
class Recipe:
    name: str  # the file's stem
    path: Path
    spec: RecipeSpec
    quantize_values: dict[str, Any]  # the keys the recipe sets, checked
    serve_values: dict[str, Any]  # the same, with device defaulting to requires.device
    quantize: QuantizeSettings
    serve: EngineConfig

    @property
    def requires(self) -> Requires:
        return self.spec.requires

    def section_values(self, section: str) -> dict[str, Any]:
        """The keys the "quantize" or "serve" section sets."""
        return dict(self.quantize_values if section == "quantize" else self.serve_values)

    def summary(self) -> str:
        """One line for `recipes list`: name, target, method, KV dtype, description."""
        bits, kv = self.quantize_values.get("bits"), self.serve.kv_cache_dtype
        method = self.quantize.method + (f" w{bits}" if bits else "")
        target = _target(self.requires)
        return f"{self.name:<28} {target:<22} {method:<9} kv {kv:<9} {self.spec.description}"


def _target(req: Requires) -> str:
    if req.device == "cpu":
        return "cpu" + "".join(f"+{f}" for f in req.cpu_features)
    cc = f" cc>={req.min_compute_capability}" if req.min_compute_capability else ""
    mem = f" {req.min_memory}" if req.min_memory else ""
    return f"cuda{cc}{mem}"


# ----------------------------------------------------------------------------- loading


def recipes_dir() -> Path:
    """Shipped recipes: `qserve/recipes/` in a wheel, the repository's `recipes/` otherwise."""
    here = Path(__file__).resolve().parent
    for folder in (here / "recipes", here.parent / "recipes"):
        if folder.is_dir():
            return folder
    return here / "recipes"


def shipped_recipes() -> list[Recipe]:
    return [load_recipe(p) for p in sorted(recipes_dir().glob("*.yaml"))]


def find_recipe(name_or_path: str) -> Recipe:
    """A recipe by path (anything with a '/' or a .yaml/.yml suffix) or by shipped name."""
    if "/" in name_or_path or name_or_path.endswith((".yaml", ".yml")):
        return load_recipe(Path(name_or_path))
    path = recipes_dir() / f"{name_or_path}.yaml"
    if not path.is_file():
        names = ", ".join(p.stem for p in sorted(recipes_dir().glob("*.yaml")))
        raise QServeError(f"no recipe named {name_or_path!r} (shipped: {names})", "recipe")
    return load_recipe(path)


def resolve_recipe(name_or_path: str) -> Recipe:
    """`--recipe VALUE`: 'auto' picks the best shipped recipe for this machine."""
    if name_or_path == AUTO:
        return select_recipe(shipped_recipes(), detect_hardware())
    return find_recipe(name_or_path)


MAX_RECIPE_BYTES = 64 * 1024  # the shipped recipes are under 2 kB


class _RecipeLoader(yaml.SafeLoader):
    """safe_load without aliases: `*name` can expand a 1.7 kB file into gigabytes (a YAML
    bomb), and a recipe has no use for them."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.events.AliasEvent):
            mark = self.peek_event().start_mark
            raise yaml.composer.ComposerError(None, None, "aliases are not allowed", mark)
        return super().compose_node(parent, index)


def _read_recipe_text(path: Path) -> str:
    if not path.is_file():
        raise QServeError(f"recipe {path}: no such file", "recipe")
    try:
        if path.stat().st_size > MAX_RECIPE_BYTES:
            raise QServeError(f"recipe {path}: larger than {MAX_RECIPE_BYTES} bytes", "recipe")
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise QServeError(f"recipe {path}: not UTF-8 text", "recipe") from None
    except OSError as exc:
        raise QServeError(f"recipe {path}: cannot read it ({exc.strerror})", "recipe") from None


def load_recipe(path: Path) -> Recipe:
    """Parse, validate and check one recipe file; every problem is a one-line QServeError."""
    text = _read_recipe_text(path)
    try:
        data = yaml.load(text, Loader=_RecipeLoader)  # noqa: S506 (a SafeLoader)
    except yaml.composer.ComposerError as exc:
        line = exc.problem_mark.line + 1 if exc.problem_mark else "?"
        raise QServeError(f"recipe {path}: {exc.problem} (line {line})", "recipe") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise QServeError(f"recipe {path}: not valid YAML{where}", "recipe") from None
    if not isinstance(data, dict):
        raise QServeError(f"recipe {path}: expected a mapping of sections at the top", "recipe")
    try:
        spec = RecipeSpec.model_validate(data)
    except ValidationError as exc:
        raise QServeError(f"recipe {path}: {_describe(exc)}", "recipe") from None
    section = "quantize"
    try:
        quantize_values = parse_section(QuantizeSettings, spec.quantize)
        quantize = QuantizeSettings(**quantize_values)
        section = "serve"
        serve_values = {"device": spec.requires.device}
        serve_values |= parse_section(EngineConfig, spec.serve, skip=("model",))
        serve = EngineConfig(**serve_values)
    except QServeError as exc:
        raise QServeError(f"recipe {path}: {section}.{exc}", "recipe") from None
    recipe = Recipe(path.stem, path, spec, quantize_values, serve_values, quantize, serve)
    for key, reason in contradictions(recipe):
        raise QServeError(f"recipe {path}: {key}: {reason}", "recipe")
    return recipe


def dump_recipe(spec: RecipeSpec) -> str:
    """YAML text that loads back to an equal spec (keys that are not set are left out)."""
    return yaml.safe_dump(spec.model_dump(exclude_none=True), sort_keys=False)


def _describe(exc: ValidationError) -> str:
    """The first validation error as 'key: what is wrong (allowed: ...)'."""
    err = exc.errors()[0]
    loc = [str(p) for p in err["loc"]]
    key = ".".join(loc)
    kind = err["type"]
    if kind == "extra_forbidden":
        allowed = ", ".join(_section_model(loc[:-1]).model_fields)
        return f"{key}: unknown key (allowed: {allowed})"
    if kind == "missing":
        return f"{key}: missing"
    if kind == "literal_error":
        return f"{key}: {excerpt(err['input'])} is not allowed (allowed: {_allowed(err)})"
    msg = str(err["msg"]).removeprefix("Value error, ")
    return f"{key}: {msg}, got {excerpt(err['input'])}".replace("\n", " ")


def _allowed(err: Any) -> str:
    return str(err.get("ctx", {}).get("expected", "")).replace(" or ", ", ").replace("'", "")


def _section_model(loc: list[str]) -> type[BaseModel]:
    model: type[BaseModel] = RecipeSpec
    for name in loc:
        field_info = model.model_fields.get(name)
        if field_info is None or not isinstance(field_info.annotation, type):
            break
        model = field_info.annotation
    return model


# ------------------------------------------------------------------------ contradictions

Rule = Callable[[Recipe], "tuple[str, str] | None"]


def _cc(recipe: Recipe) -> float | None:
    req = recipe.requires
    return req.min_compute_capability if req.device == "cuda" else None


def _fp8_matmul(recipe: Recipe) -> tuple[str, str] | None:
    if recipe.quantize.method != "fp8":
        return None
    if recipe.requires.device == "cpu":
        return "quantize.method", "fp8 has no CPU matmul kernel (weights would be dequantized)"
    cc = _cc(recipe)
    if cc is None or cc < FP8_MIN_CAPABILITY:
        return "quantize.method", (
            f"fp8 matmuls need compute capability >= {FP8_MIN_CAPABILITY}, but "
            f"requires.min_compute_capability is {cc}"
        )
    return None


def _fp8_kv_reader(recipe: Recipe) -> tuple[str, str] | None:
    if recipe.serve.kv_cache_dtype != "fp8_e4m3" or recipe.requires.device != "cuda":
        return None
    cc = _cc(recipe)
    if cc is None or cc < FP8_MIN_CAPABILITY:
        return "serve.kv_cache_dtype", (
            "the Triton paged-attention kernel reads fp8_e4m3 pages only on compute capability "
            f">= {FP8_MIN_CAPABILITY} (requires.min_compute_capability is {cc}); "
            "allowed here: auto, fp8_e5m2"
        )
    return None


def _kv_mismatch(recipe: Recipe) -> tuple[str, str] | None:
    made_for, served = recipe.quantize.kv_cache_dtype, recipe.serve.kv_cache_dtype
    if made_for == "auto" or made_for == served:
        return None
    return "serve.kv_cache_dtype", (
        f"{served} contradicts quantize.kv_cache_dtype {made_for} (the checkpoint's KV scales)"
    )


def _device(recipe: Recipe) -> tuple[str, str] | None:
    req, device = recipe.requires, recipe.serve.device
    if device.split(":")[0] != req.device:
        return "serve.device", f"{device} contradicts requires.device {req.device}"
    cuda_only = {"min_compute_capability": req.min_compute_capability, "gpu_names": req.gpu_names}
    cpu_only = {"cpu_features": req.cpu_features}
    for key, value in (cuda_only if req.device == "cpu" else cpu_only).items():
        if value:
            return f"requires.{key}", f"does not apply to device {req.device}"
    return None


def _cpu_kernels(recipe: Recipe) -> tuple[str, str] | None:
    """torch's CPU int8 weight-only kernel (int8 W8A8, 8-bit GPTQ) takes only 16-bit
    activations; the C++ W4 kernel takes fp32 too."""
    q = recipe.quantize
    int8_kernel = q.method == "int8" or (q.method in ("rtn", "gptq") and q.bits == 8)
    cpu = recipe.requires.device == "cpu"
    if cpu and int8_kernel and recipe.serve.dtype == "float32":
        return "serve.dtype", (
            "torch's CPU int8 weight-only kernel needs bfloat16/float16 activations "
            "(allowed here: auto, bfloat16, float16)"
        )
    return None


RULES: tuple[Rule, ...] = (_device, _fp8_matmul, _fp8_kv_reader, _kv_mismatch, _cpu_kernels)


def contradictions(recipe: Recipe) -> list[tuple[str, str]]:
    """(key, reason) for each quantization / serving / hardware choice that contradicts another."""
    return [found for rule in RULES if (found := rule(recipe)) is not None]


# ---------------------------------------------------------------------------- hardware


def unmet_requirements(req: Requires, hw: Hardware) -> list[str]:
    """Why `hw` does not meet `req`; empty when it does."""
    if req.device != hw.device:
        return [f"needs a {req.device} device, found {hw.device}"]
    reasons = []
    cc = req.min_compute_capability
    if cc is not None and (hw.compute_capability or 0.0) < cc:
        reasons.append(f"needs compute capability >= {cc}, found {hw.compute_capability}")
    if req.min_memory is not None and hw.memory < parse_memory(req.min_memory):
        reasons.append(f"needs {req.min_memory} memory, found {hw.memory / 2**30:.1f} GiB")
    missing = sorted(set(req.cpu_features) - hw.cpu_features)
    if missing:
        reasons.append(f"needs CPU features {', '.join(missing)}")
    return reasons


def _rank(recipe: Recipe, hw: Hardware) -> tuple[Any, ...]:
    """Higher is a closer fit: a named GPU, then the most demanding requirements met."""
    req = recipe.requires
    named = bool(set(map(str.lower, req.gpu_names)) & gpu_name_words(hw.name))
    memory = parse_memory(req.min_memory) if req.min_memory else 0
    return (named, req.min_compute_capability or 0.0, memory, len(req.cpu_features))


def gpu_name_words(name: str) -> set[str]:
    """'NVIDIA A100-SXM4-80GB' -> {nvidia, a100, sxm4, 80gb}: 'L4' matches L4, not L40S."""
    return set(re.split(r"[\s\-_/]+", name.lower()))


def select_recipe(recipes: Iterable[Recipe], hw: Hardware) -> Recipe:
    """`--recipe auto`: of the recipes `hw` meets, the closest fit (ties: first by name)."""
    fits = sorted((r for r in recipes if not unmet_requirements(r.requires, hw)), key=_name)
    if not fits:
        raise QServeError(f"no shipped recipe fits this machine ({hw.describe()})", "recipe")
    return max(fits, key=lambda r: _rank(r, hw))


def _name(recipe: Recipe) -> str:
    return recipe.name


# ----------------------------------------------------------------------- CLI precedence


def merge_settings(
    cls: type, given: Mapping[str, Any], recipe: Recipe | None, section: str
) -> tuple[Any, dict[str, str]]:
    """`cls` (QuantizeSettings for "quantize", EngineConfig for "serve") from the values a
    command line `given`, over the recipe's `section`, over the field defaults; and where each
    set value came from ('cli' | 'recipe')."""
    values = recipe.section_values(section) if recipe is not None else {}
    origin = dict.fromkeys(values, "recipe") | dict.fromkeys(given, "cli")
    return cls(**(values | dict(given))), origin


def format_settings(values: Mapping[str, Any], origin: Mapping[str, str]) -> str:
    """'key=value (recipe), ...' on one line, for the start-up log."""
    parts = [f"{k}={v!r} ({origin.get(k, 'default')})" for k, v in sorted(values.items())]
    return ", ".join(parts)


def provenance(recipe: Recipe | None, effective: Mapping[str, Any]) -> dict[str, Any]:
    """What `quantize` writes beside the weights (quantize.export.PROVENANCE_FILE): the recipe
    and the settings."""
    spec = recipe.spec.model_dump(exclude_none=True) if recipe is not None else None
    name = recipe.name if recipe is not None else None
    return {"recipe": name, "spec": spec, "effective": dict(effective)}
