"""What to quantize and how: `QuantizeSettings`, checked once, and the group-size rules that
need the model's shapes (`auto_group_size`, `check_group_size`).

This module imports no torch at import time, so the CLI and recipes can read the settings'
fields without loading it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, get_args

from qserve.errors import QServeError
from qserve.options import Range, check_fields, setting
from qserve.quantize.arch import ArchSpec
from qserve.quantize.dynamic import DynamicRule, Scheme, parse_rules, scheme_for

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "METHODS",
    "GROUP_SIZES",
    "QuantizeSettings",
    "check_group_size",
    "auto_group_size",
    "is_ignored",
    "is_ignored_in",
    "with_routers_ignored",
    "out_dtype",
]

Method = Literal["rtn", "gptq", "awq", "int8", "fp8", "auto"]
GroupSize = Literal[-1, 32, 64, 128, "auto"]
KVCacheDtype = Literal["auto", "fp8_e4m3", "fp8_e5m2"]
METHODS: tuple[str, ...] = get_args(Method)
GROUP_SIZES = (128, 64, 32)  # what the formats and kernels take; "auto" picks the largest fitting


# Which methods read each option, and its default for them. An option a method does not read
# stays None; given for such a method it is refused (it would be silently ignored).
METHOD_DEFAULTS: dict[str, dict[str, Any]] = {
    "bits": {"rtn": 4, "gptq": 4, "awq": 4, "int8": 8, "fp8": 8},
    "group_size": {"rtn": "auto", "gptq": "auto", "awq": "auto"},
    "sym": {"rtn": True, "gptq": True, "awq": False, "auto": True},
    "desc_act": {"gptq": False},
    "damp": {"gptq": 0.01, "int8": 0.01, "fp8": 0.01, "auto": 0.01},
    "static_groups": {"gptq": False, "auto": False},
    "mse": {"gptq": True, "auto": True},  # issue 27: keeps more of GPTQ's gain on unseen text
    "act_group_aware": {"gptq": True, "auto": True},
    "gptaq": {"gptq": True, "auto": True},
    "gptaq_alpha": {"gptq": 0.25, "auto": 0.25},
    "quantize_lm_head": {"rtn": False, "gptq": False},
    "dynamic": {"rtn": (), "gptq": ()},
    "format": {"rtn": "gptq", "gptq": "gptq", "auto": "gptq"},
    # auto: exactly one budget is given (checked in __post_init__)
    "max_ppl_increase": {"auto": None},
    "max_kl": {"auto": None},
    "target_bits": {"auto": None},
    "measure_samples": {"auto": 4},
    "smooth_alpha": {"int8": 0.5},
    "weight_strategy": {"int8": "channel", "fp8": "channel"},
    "activation_scheme": {"int8": "dynamic", "fp8": "dynamic"},
    "gptq_weights": {"int8": True, "fp8": True},
}
# The calibration each method reads by default (issue 27: GPTQ calibrated on one book keeps
# little of its gain on other text; on text the model samples itself it keeps more).
CALIB_DEFAULTS = {"gptq": "generated", "auto": "generated", "awq": "moby-dick",
                  "int8": "moby-dick", "fp8": "moby-dick"}  # fmt: skip
AUTO_BUDGETS = ("max_ppl_increase", "max_kl", "target_bits")  # auto takes exactly one
METHOD_BITS = {"rtn": (3, 4, 8), "gptq": (3, 4, 8), "awq": (4,), "int8": (8,), "fp8": (8,),
               "auto": ()}  # fmt: skip
GPTQ_DAMP = 0.01  # what a GPTQ-format config records as damp_percent when no Hessian was damped


@dataclasses.dataclass(frozen=True)
class QuantizeSettings:
    """What to quantize and how: every `qserve quantize` option and recipe `quantize:` key,
    checked once in __post_init__. Options a method does not read are None."""

    method: Method = setting(
        "gptq",
        "rtn/gptq -> GPTQ format, awq -> AWQ gemm, int8/fp8 -> compressed-tensors; auto -> the "
        "smallest mixed GPTQ checkpoint meeting --max-ppl-increase (or --target-bits).",
        flag="-m,--method",
    )
    bits: Literal[3, 4, 8] | None = setting(
        None, "3, 4 or 8 (rtn/gptq; 3: GPTQ format only).", default_text="4; int8/fp8: 8"
    )
    group_size: GroupSize | None = setting(
        None,
        "rtn/gptq/awq: 32, 64, 128, -1 (per channel) or auto (the largest of 128/64/32 dividing "
        "every quantized linear's input size).",
        default_text="auto",
    )
    sym: bool | None = setting(
        None, "rtn/gptq: symmetric codes (awq is asymmetric).", flag="--sym/--asym",
        default_text="sym",
    )  # fmt: skip
    desc_act: bool | None = setting(
        None, "gptq: act-order (columns by descending Hessian diagonal).", default_text="off"
    )
    damp: Annotated[float, Range(0, 1, max_open=True)] | None = setting(
        None, "gptq (and int8/fp8 GPTQ rounding): dampening, a fraction of mean(diag H).",
        default_text="0.01",
    )  # fmt: skip
    static_groups: bool | None = setting(
        None, "gptq with act-order: group scales fixed before the column sweep.", default_text="off"
    )
    mse: bool | None = setting(
        None, "gptq: MSE grid search of each group's range.", default_text="on"
    )
    act_group_aware: bool | None = setting(
        None, "gptq without act-order: visit whole groups by importance (GPTQModel's default).",
        default_text="on",
    )  # fmt: skip
    gptaq: bool | None = setting(
        None, "gptq: fit each layer to the float model's output (GPTAQ); off is plain GPTQ.",
        default_text="on",
    )  # fmt: skip
    gptaq_alpha: Annotated[float, Range(0, 1)] | None = setting(
        None, "gptq with GPTAQ: weight of the asymmetric correction.", default_text="0.25"
    )
    quantize_lm_head: bool | None = setting(
        None, "rtn/gptq: quantize lm_head too (same method, bits and groups; untied from the "
        "embeddings).", default_text="off",
    )  # fmt: skip
    dynamic: tuple[str, ...] | None = setting(
        None, "rtn/gptq: per-module scheme, GPTQModel's `dynamic`: 'REGEX=w8ch', 'REGEX=w4g32' "
        "or '-:REGEX' (left 16-bit); the first rule whose REGEX matches a module's checkpoint "
        "name decides; repeatable.", default_text="none",
    )  # fmt: skip
    format: Literal["gptq", "compressed-tensors"] | None = setting(
        None, "rtn/gptq/auto: the checkpoint's format: gptq (GPTQModel's; `dynamic` for mixed "
        "schemes) or compressed-tensors (llm-compressor's pack-quantized; a config group per "
        "scheme).", default_text="gptq",
    )  # fmt: skip
    max_ppl_increase: str | None = setting(
        None, "auto: the largest perplexity increase allowed on held-out text, in percent (1% or "
        "1); the checkpoint is the smallest that meets it, verified before it is written.",
    )  # fmt: skip
    max_kl: Annotated[float, Range(0, min_open=True)] | None = setting(
        None, "auto: the largest mean KL(float || quantized) of the next-token distributions on "
        "held-out text, in nats per token; the smallest checkpoint that meets it, verified.",
    )  # fmt: skip
    target_bits: Annotated[float, Range(2.5, 16)] | None = setting(
        None, "auto: bits per weight of the quantized linears (scales, zeros and g_idx counted); "
        "the least predicted error within that size.",
    )  # fmt: skip
    measure_samples: Annotated[int, Range(1)] | None = setting(
        None,
        "auto: calibration windows the measurement pass takes its KLs on, besides the "
        "--num-samples windows its Hessians come from (cached).",
        default_text="4",
    )
    calib: str | Path | None = setting(
        None,
        "Calibration: 'generated' (half text the model samples itself, half moby-dick; "
        "cached), 'moby-dick' (the bundled chapters 11+), 'mixed' (the bundled five-source "
        "mix) or a .txt/.jsonl file.",
        default_text="generated for gptq/auto, moby-dick for awq/int8/fp8",
    )
    num_samples: Annotated[int, Range(1)] = setting(128, "Calibration windows.")
    seq_len: Annotated[int, Range(16)] = setting(512, "Tokens per calibration window.")
    ignore: tuple[str, ...] = setting(
        ("lm_head",), "Module name (exact, dotted suffix or re:REGEX) left unquantized; repeatable."
    )
    smooth_alpha: Annotated[float, Range(max=1)] | None = setting(
        None, "int8: SmoothQuant alpha; <= 0 turns smoothing off.", default_text="0.5"
    )
    weight_strategy: Literal["channel", "tensor"] | None = setting(
        None, "int8/fp8: weight scales per channel or per tensor.", default_text="channel"
    )
    activation_scheme: Literal["dynamic", "static"] | None = setting(
        None, "int8/fp8: activation scales per token at run time, or calibrated.",
        default_text="dynamic",
    )  # fmt: skip
    gptq_weights: bool | None = setting(
        None, "int8/fp8: round the weights with GPTQ error feedback (needs calibration data); "
        "off rounds to nearest (fp8 dynamic: no calibration).", default_text="on",
    )  # fmt: skip
    dtype: Literal["float16", "bfloat16", "float32"] | None = setting(
        None, "dtype of the tensors left in floating point.",
        default_text="float16; int8/fp8: bfloat16",
    )  # fmt: skip
    kv_cache_dtype: KVCacheDtype = setting(
        "auto", "fp8_e4m3/fp8_e5m2: also calibrate and write k_scale/v_scale per attention layer."
    )

    def __post_init__(self) -> None:
        check_fields(self)
        self._check_method_options()
        for name, defaults in METHOD_DEFAULTS.items():
            if getattr(self, name) is None and self.method in defaults:
                object.__setattr__(self, name, defaults[self.method])
        if self.calib in (None, "default"):  # "default": the method's, said explicitly
            object.__setattr__(self, "calib", CALIB_DEFAULTS.get(self.method))
        if self.method == "auto":
            self._check_auto()
        if self.dynamic:
            parse_rules(self.dynamic)  # a malformed rule: one line now, not after calibration
        if self.format == "compressed-tensors" and self.desc_act and not self.static_groups:
            raise QServeError(
                "desc_act: compressed-tensors has no g_idx; act-order there needs "
                "--static-groups (its actorder 'weight')", "desc_act",
            )  # fmt: skip
        self._check_format_bits()
        if self.method == "awq" and self.group_size == -1:
            raise QServeError("group_size: awq needs a group size (32, 64, 128)", "group_size")

    def _check_method_options(self) -> None:
        m = self.method
        for name, defaults in METHOD_DEFAULTS.items():
            value = getattr(self, name)
            if value is not None and m not in defaults:
                users = ", ".join(defaults)
                verb = "uses" if len(defaults) == 1 else "use"
                raise QServeError(f"{name}: only {users} {verb} it, but method is {m}", name)
        if self.bits is not None and self.bits not in METHOD_BITS[m]:
            allowed = "/".join(map(str, METHOD_BITS[m]))
            raise QServeError(f"bits: {m} takes bits {allowed}, got {self.bits}", "bits")
        if m == "awq" and self.sym:
            raise QServeError("sym: only rtn, gptq use it, but method is awq (asymmetric)", "sym")

    def _check_format_bits(self) -> None:
        """3 bits is written in the GPTQ format only: compressed-tensors packs 3-bit codes 10 to
        a word, and vLLM's compressed-tensors loaders take 4 and 8 bits."""
        if self.format != "compressed-tensors":
            return
        three = [str(r) for r in self.rules if r.scheme.bits == 3]
        if self.bits == 3 or three:
            what = f"dynamic rule {three[0]!r}" if three else "bits 3"
            raise QServeError(
                f"{what}: compressed-tensors checkpoints here are 4- or 8-bit (vLLM's loaders "
                "take no other); use --format gptq for 3 bits", "bits" if not three else "dynamic",
            )  # fmt: skip

    def _check_auto(self) -> None:
        budgets = [n for n in AUTO_BUDGETS if getattr(self, n) is not None]
        if len(budgets) != 1:
            raise QServeError(
                "method auto needs one budget: --max-ppl-increase PERCENT, --max-kl NATS or "
                "--target-bits BITS"
                + (f" (got {len(budgets)}: {', '.join(budgets)})" if budgets else ""),
                "max_ppl_increase",
            )
        if self.max_ppl_increase is not None:
            self.max_increase  # noqa: B018 - parses it: a bad value fails here, not later

    @property
    def max_increase(self) -> float | None:
        """--max-ppl-increase as a fraction (0.01 for 1%), None when not given."""
        if self.max_ppl_increase is None:
            return None
        text = str(self.max_ppl_increase).strip().removesuffix("%")
        try:
            value = float(text)
        except ValueError:
            value = -1.0
        if not 0 < value < 1000:
            raise QServeError(
                f"max_ppl_increase: expected a percentage above 0, such as 1% or 0.5, got "
                f"{self.max_ppl_increase!r}",
                "max_ppl_increase",
            )
        return value / 100

    @property
    def rules(self) -> tuple[DynamicRule, ...]:
        return parse_rules(self.dynamic or ())

    def scheme_of(self, name: str) -> Scheme:
        """The scheme of linear `name` (as the checkpoint names it): its `dynamic` rule's, else
        the run's bits and group size (resolved: not "auto")."""
        group_size = self.group_size if isinstance(self.group_size, int) else -1
        default = Scheme(self.bits or 16, group_size)
        return scheme_for(name, self.rules, default)

    @property
    def lm_head_needs_inputs(self) -> bool:
        """GPTQ of lm_head needs the final hidden states (RTN does not)."""
        return self.quantize_lm_head and self.method == "gptq"

    @property
    def calibrates_kv_scales(self) -> bool:
        return self.kv_cache_dtype != "auto"

    @property
    def searches_scales(self) -> bool:
        """AWQ and SmoothQuant produce a ScaleResult that can be saved and replayed."""
        return self.method == "awq" or (self.method == "int8" and self.smooth_alpha > 0)

    def needs_calibration(self, replay: bool = False) -> bool:
        """Whether calibration inputs are needed (not for a replayed AWQ/SmoothQuant search, nor
        for RTN and dynamic int8/fp8, unless KV cache scales are asked for)."""
        if self.calibrates_kv_scales:
            return True
        if self.method in ("int8", "fp8") and (
            self.activation_scheme == "static" or self.gptq_weights
        ):
            return True
        return self.method in ("gptq", "auto") or (self.searches_scales and not replay)

    @property
    def scheme_name(self) -> str:
        """What a default output folder is named after: `gptq-w4g64`, `rtn-w8ch` (per
        channel), `int8-w8a8`, `fp8`. The group size must be resolved (not "auto")."""
        if self.method == "int8":
            return "int8-w8a8"
        if self.method == "fp8":
            return "fp8"
        if self.method == "auto":
            return "gptq-auto"
        groups = "ch" if self.group_size == -1 else f"g{self.group_size}"
        mixed = "-mixed" if self.dynamic else ""
        return f"{self.method}-w{self.bits}{groups}{mixed}"

    @property
    def min_zero(self) -> int:
        # GPTQ v1 stores zero - 1: asymmetric zeros of 0 are not representable.
        return 1 if self.method in ("rtn", "gptq", "auto") else 0


def check_group_size(model: nn.Module, spec: ArchSpec, settings: QuantizeSettings) -> None:
    """One-line error, before any calibration, when the group size does not divide the input
    size of a linear that would be quantized (the formats have no partial groups)."""
    gs = settings.group_size
    if settings.method not in ("rtn", "gptq", "awq") or (gs == -1 and not settings.dynamic):
        return
    for b, block in enumerate(model.get_submodule(spec.blocks)):
        for name in spec.for_block(block).linears:
            full = f"{spec.blocks}.{b}.{name}"
            K = block.get_submodule(name).in_features
            scheme = settings.scheme_of(spec.checkpoint_name(full)) if settings.dynamic else None
            g = scheme.group_size if scheme is not None and not scheme.dense else gs
            if scheme is not None and scheme.dense or g == -1:
                continue
            if K % g and not is_ignored_in(spec, full, settings.ignore):
                raise _group_size_error(g, spec.checkpoint_name(full), K)
    K = model.get_output_embeddings().in_features
    if settings.quantize_lm_head and K % gs:
        raise _group_size_error(gs, "lm_head", K)


def auto_group_size(model: nn.Module, spec: ArchSpec, settings: QuantizeSettings) -> int:
    """The largest of GROUP_SIZES that divides the input size of every linear `settings` would
    quantize in `model` (its `meta_model`: no weights are read)."""
    if settings.method not in ("rtn", "gptq", "awq"):
        return GROUP_SIZES[0]  # int8 / fp8 are per channel or per tensor: not read
    for gs in GROUP_SIZES:
        try:
            plain = dataclasses.replace(settings, group_size=gs, dynamic=settings.dynamic and ())
            check_group_size(model, spec, plain)
        except QServeError:
            continue
        return gs
    raise QServeError(
        "no group size of 128, 64 or 32 divides every quantized linear's input size; "
        "use --group-size -1 (per channel)",
        param="group_size",
    )


def _group_size_error(group_size: int, name: str, K: int) -> QServeError:
    return QServeError(
        f"group_size {group_size} does not divide {name}'s {K} input features "
        "(choose a group size that does, or -1 for per-channel)",
        param="group_size",
    )


def is_ignored(name: str, ignore: Iterable[str]) -> bool:
    for pattern in ignore:
        if pattern.startswith("re:"):
            if re.fullmatch(pattern[3:], name):
                return True
        elif name == pattern or name.endswith("." + pattern):
            return True
    return False


def is_ignored_in(spec: ArchSpec, name: str, ignore: Iterable[str]) -> bool:
    """`is_ignored` by the module's name in the model or in the checkpoint (they differ for
    Mixtral's MoE blocks: `mlp.` in transformers 5, `block_sparse_moe.` in checkpoints)."""
    return is_ignored(name, ignore) or is_ignored(spec.checkpoint_name(name), ignore)


def with_routers_ignored(settings: QuantizeSettings, spec: ArchSpec) -> QuantizeSettings:
    """`settings` ignoring the routers of mixture-of-experts blocks (as checkpoints name them):
    they stay unquantized, as GPTQModel, llm-compressor and vLLM keep them."""
    if spec.moe is None:
        return settings
    router = f"{spec.moe.checkpoint_block}.{spec.moe.router}"
    if router in settings.ignore:
        return settings
    return dataclasses.replace(settings, ignore=(*settings.ignore, router))


def out_dtype(dtype: str | None, method: str) -> torch.dtype:
    """The dtype of the tensors a checkpoint keeps in floating point (default float16 for the
    GPTQ / AWQ formats, bfloat16 for compressed-tensors)."""
    import torch

    if dtype is None:
        return torch.float16 if method in ("rtn", "gptq", "awq", "auto") else torch.bfloat16
    choices = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
    if dtype not in choices:
        raise QServeError(f"dtype must be one of {', '.join(choices)}, got {dtype!r}", "dtype")
    return choices[dtype]
