"""Recipes: one YAML per hardware target that drives both `quantize` and `serve`.

    description: one line            hardware: what it is for        why: why the choices fit
    requires:  device cuda|cpu, min_compute_capability, min_memory, gpu_names, cpu_features
    quantize:  method + the driver's knobs (bits, group_size, sym, desc_act, calib, ...)
    serve:     the engine's knobs (dtype, kv_cache_dtype, block_size, kv_cache_memory, ...)

Keys are the parameter names of `qserve.quantize.driver.quantize_model` and of the CLI engine
options, so a recipe is a file form of the flags, not a second set of knobs. Parsing is strict:
an unknown key, a wrong type, an unknown value or a contradiction raises a one-line QServeError
naming the file and the key. Explicit CLI flags override the recipe (`apply_recipe`).

This module imports no torch; only `detect_hardware` does, inside the function.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from qserve.config import parse_memory
from qserve.errors import QServeError
from qserve.platform import Hardware, detect_hardware

if TYPE_CHECKING:
    import click

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


class Quantize(_Section):
    """`qserve quantize` settings: the keyword arguments of `quantize_model`, plus the KV
    cache dtype the checkpoint is meant to be served with."""

    method: Literal["rtn", "gptq", "awq", "int8", "fp8"]
    bits: Literal[4, 8] | None = None
    group_size: Literal[-1, 32, 64, 128, "auto"] | None = None
    sym: bool | None = None
    desc_act: bool | None = None
    damp: float | None = Field(None, ge=0, lt=1)
    static_groups: bool | None = None
    mse: bool | None = None
    act_group_aware: bool | None = None
    gptaq: bool | None = None  # gptq: asymmetric calibration (the float model's outputs)
    quantize_lm_head: bool | None = None
    calib: str | None = None  # .txt / .jsonl; None: the bundled text
    num_samples: int | None = Field(None, ge=1)
    seq_len: int | None = Field(None, ge=16)  # as --seq-len
    ignore: list[str] | None = None
    smooth_alpha: float | None = Field(None, le=1)
    weight_strategy: Literal["channel", "tensor"] | None = None
    activation_scheme: Literal["dynamic", "static"] | None = None
    gptq_weights: bool | None = None  # int8 / fp8: GPTQ rounding (needs calibration data)
    dtype: Literal["float16", "bfloat16", "float32"] | None = None
    kv_cache_dtype: Literal["auto", "fp8_e4m3", "fp8_e5m2"] | None = None


class Serve(_Section):
    """`qserve serve` / `generate` settings: the names of the engine options."""

    device: str | None = Field(None, pattern=r"^(cpu|cuda(:\d+)?)$")  # default: requires.device
    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = None
    kv_cache_dtype: Literal["auto", "fp8_e4m3", "fp8_e5m2"] | None = None
    block_size: int | None = Field(None, ge=1)
    kv_cache_memory: str | None = None  # e.g. 40GiB
    max_num_seqs: int | None = Field(None, ge=1)
    max_num_batched_tokens: int | None = Field(None, ge=1)
    max_model_len: int | None = Field(None, ge=2)
    enable_prefix_caching: bool | None = None

    @field_validator("kv_cache_memory")
    @classmethod
    def _memory_size(cls, value: str | None) -> str | None:
        return _memory(value)


class RecipeSpec(_Section):
    """The whole file."""

    description: str
    hardware: str
    why: str
    requires: Requires
    quantize: Quantize
    serve: Serve = Serve()


def _memory(value: str | None) -> str | None:
    if value is not None:
        parse_memory(value)
    return value


@dataclass(frozen=True)
class Recipe:
    name: str  # the file's stem
    path: Path
    spec: RecipeSpec

    @property
    def quantize(self) -> Quantize:
        return self.spec.quantize

    @property
    def serve(self) -> Serve:
        return self.spec.serve

    @property
    def requires(self) -> Requires:
        return self.spec.requires

    @property
    def serve_values(self) -> dict[str, Any]:
        """The serve settings the recipe sets, with the device defaulting to requires.device."""
        return {"device": self.requires.device} | section_values(self.serve)

    def summary(self) -> str:
        """One line for `recipes list`: name, target, method, KV dtype, description."""
        q, kv = self.quantize, self.serve.kv_cache_dtype or "auto"
        method = q.method + (f" w{q.bits}" if q.bits else "")
        target = _target(self.requires)
        return f"{self.name:<28} {target:<22} {method:<9} kv {kv:<9} {self.spec.description}"


def section_values(section: BaseModel) -> dict[str, Any]:
    """The keys a recipe section sets (None means 'not set': the CLI default stays)."""
    return section.model_dump(exclude_none=True)


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
    for key, reason in contradictions(spec):
        raise QServeError(f"recipe {path}: {key}: {reason}", "recipe")
    return Recipe(path.stem, path, spec)


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
        return f"{key}: {_excerpt(err['input'])} is not allowed (allowed: {_allowed(err)})"
    msg = str(err["msg"]).removeprefix("Value error, ")
    return f"{key}: {msg}, got {_excerpt(err['input'])}".replace("\n", " ")


def _excerpt(value: Any, limit: int = 60) -> str:
    """repr(value), cut short: an error line never echoes more than a few words of input."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


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

Rule = Callable[[RecipeSpec], "tuple[str, str] | None"]

# which methods read each quantize option (the others would silently ignore it)
_OPTION_METHODS = {
    "desc_act": ("gptq",),
    "damp": ("gptq",),
    "static_groups": ("gptq",),
    "mse": ("gptq",),
    "act_group_aware": ("gptq",),
    "gptaq": ("gptq",),
    "quantize_lm_head": ("rtn", "gptq"),
    "sym": ("rtn", "gptq"),
    "smooth_alpha": ("int8",),
    "weight_strategy": ("int8", "fp8"),
    "activation_scheme": ("int8", "fp8"),
    "gptq_weights": ("int8", "fp8"),
}
_METHOD_BITS = {"rtn": (4, 8), "gptq": (4, 8), "awq": (4,), "int8": (8,), "fp8": (8,)}


def _cc(spec: RecipeSpec) -> float | None:
    req = spec.requires
    return req.min_compute_capability if req.device == "cuda" else None


def _fp8_matmul(spec: RecipeSpec) -> tuple[str, str] | None:
    if spec.quantize.method != "fp8":
        return None
    if spec.requires.device == "cpu":
        return "quantize.method", "fp8 has no CPU matmul kernel (weights would be dequantized)"
    cc = _cc(spec)
    if cc is None or cc < FP8_MIN_CAPABILITY:
        return "quantize.method", (
            f"fp8 matmuls need compute capability >= {FP8_MIN_CAPABILITY}, but "
            f"requires.min_compute_capability is {cc}"
        )
    return None


def _fp8_kv_reader(spec: RecipeSpec) -> tuple[str, str] | None:
    if spec.serve.kv_cache_dtype != "fp8_e4m3" or spec.requires.device != "cuda":
        return None
    cc = _cc(spec)
    if cc is None or cc < FP8_MIN_CAPABILITY:
        return "serve.kv_cache_dtype", (
            "the Triton paged-attention kernel reads fp8_e4m3 pages only on compute capability "
            f">= {FP8_MIN_CAPABILITY} (requires.min_compute_capability is {cc}); "
            "allowed here: auto, fp8_e5m2"
        )
    return None


def _kv_mismatch(spec: RecipeSpec) -> tuple[str, str] | None:
    made_for = spec.quantize.kv_cache_dtype
    served = spec.serve.kv_cache_dtype or "auto"
    if made_for in (None, "auto") or made_for == served:
        return None
    return "serve.kv_cache_dtype", (
        f"{served} contradicts quantize.kv_cache_dtype {made_for} (the checkpoint's KV scales)"
    )


def _bits(spec: RecipeSpec) -> tuple[str, str] | None:
    q = spec.quantize
    allowed = _METHOD_BITS[q.method]
    if q.bits is not None and q.bits not in allowed:
        return "quantize.bits", f"{q.method} takes bits {'/'.join(map(str, allowed))}, got {q.bits}"
    if q.method == "awq" and q.group_size == -1:
        return "quantize.group_size", "awq needs a group size (allowed: 32, 64, 128)"
    if q.group_size is not None and q.method in ("int8", "fp8"):
        return "quantize.group_size", f"{q.method} is per channel or per tensor, not grouped"
    return None


def _unused_option(spec: RecipeSpec) -> tuple[str, str] | None:
    q = spec.quantize
    for name, methods in _OPTION_METHODS.items():
        if getattr(q, name) is not None and q.method not in methods:
            users = ", ".join(methods)
            return f"quantize.{name}", f"only {users} use it, but method is {q.method}"
    return None


def _device(spec: RecipeSpec) -> tuple[str, str] | None:
    req, device = spec.requires, spec.serve.device
    if device is not None and device.split(":")[0] != req.device:
        return "serve.device", f"{device} contradicts requires.device {req.device}"
    cuda_only = {"min_compute_capability": req.min_compute_capability, "gpu_names": req.gpu_names}
    cpu_only = {"cpu_features": req.cpu_features}
    for key, value in (cuda_only if req.device == "cpu" else cpu_only).items():
        if value:
            return f"requires.{key}", f"does not apply to device {req.device}"
    return None


def _cpu_kernels(spec: RecipeSpec) -> tuple[str, str] | None:
    if spec.requires.device == "cpu" and spec.serve.dtype == "float32":
        return "serve.dtype", (
            "torch's CPU int4/int8 weight-only kernels need bfloat16/float16 activations "
            "(allowed here: auto, bfloat16, float16)"
        )
    return None


RULES: tuple[Rule, ...] = (
    _bits,
    _unused_option,
    _device,
    _fp8_matmul,
    _fp8_kv_reader,
    _kv_mismatch,
    _cpu_kernels,
)


def contradictions(spec: RecipeSpec) -> list[tuple[str, str]]:
    """(key, reason) for each quantization / serving / hardware choice that contradicts another."""
    return [found for rule in RULES if (found := rule(spec)) is not None]


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

# recipe key -> (CLI parameter name, recipe value -> CLI value)
CLI_NAMES: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "enable_prefix_caching": ("no_prefix_caching", lambda enabled: not enabled),  # serve
    "calib": ("calib_data", str),  # quantize --calib-data
    "ignore": ("ignore", tuple),  # quantize --ignore (multiple=True gives a tuple)
}


def explicit_params(ctx: click.Context, names: Iterable[str]) -> set[str]:
    """The CLI parameters the user gave (command line, environment, prompt), not defaults."""
    import click

    given = {click.core.ParameterSource.COMMANDLINE, click.core.ParameterSource.ENVIRONMENT}
    given.add(click.core.ParameterSource.PROMPT)
    return {n for n in names if ctx.get_parameter_source(n) in given}


def apply_recipe(
    values: Mapping[str, Any], cli_values: Mapping[str, Any], ctx: click.Context
) -> tuple[dict[str, Any], dict[str, str]]:
    """Merge recipe `values` (`section_values(...)` or `Recipe.serve_values`) into the
    command's parameters: explicit flags win, the recipe beats click's defaults.

    Returns (merged parameters, origin of each recipe-covered or explicit key: 'cli' | 'recipe').
    Recipe keys without a CLI flag (e.g. damp when quantize has no --damp) are added as is.
    """
    merged, origin = dict(cli_values), {}
    explicit = explicit_params(ctx, cli_values)
    origin.update(dict.fromkeys(explicit, "cli"))
    for key, value in values.items():
        name, convert = CLI_NAMES.get(key, (key, lambda v: v))
        if name not in explicit:
            merged[name], origin[name] = convert(value), "recipe"
    return merged, origin


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
