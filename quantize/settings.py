"""What to quantize and how: `QuantizeSettings`, checked once, and the group-size rules that
need the model's shapes (`auto_group_size`, `check_group_size`).

This module imports no torch at import time, so the CLI and recipes can read the settings'
fields without loading it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

from qserve.errors import QServeError
from qserve.quantize.arch import ArchSpec
from qserve.quantize.kv_scales import check_kv_cache_dtype

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
    "out_dtype",
]

METHODS = ("rtn", "gptq", "awq", "int8", "fp8")
GROUP_SIZES = (128, 64, 32)  # what the formats and kernels take; "auto" picks the largest fitting


@dataclasses.dataclass(frozen=True)
class QuantizeSettings:
    """What to quantize and how; checked once in __post_init__."""

    method: str = "gptq"
    bits: int = 4
    group_size: int | str = 128  # "auto": resolved per model by `auto_group_size`
    sym: bool = True
    desc_act: bool = False
    damp: float = 0.01
    static_groups: bool = False
    mse: bool = False  # gptq: MSE grid search of each group's range
    act_group_aware: bool = True  # gptq without desc_act: group-aware order (GPTQModel's default)
    gptaq: bool | None = None  # gptq: GPTAQ's asymmetric target; None: on for gptq
    gptaq_alpha: float = 0.25
    quantize_lm_head: bool = False  # rtn / gptq: lm_head too, by the same method ("lm_head": true)
    ignore: tuple[str, ...] = ("lm_head",)
    smooth_alpha: float = 0.5  # SmoothQuant; <= 0 turns smoothing off
    weight_strategy: str = "channel"  # int8 / fp8: channel | tensor
    activation_scheme: str = "dynamic"  # int8 / fp8: dynamic | static
    gptq_weights: bool | None = None  # int8 / fp8: GPTQ rounding (same format); None: on
    kv_cache_dtype: str = "auto"  # fp8_e4m3 | fp8_e5m2: also calibrate k_scale / v_scale

    def __post_init__(self) -> None:
        m = self.method
        if m not in METHODS:
            raise QServeError(f"unknown method {m!r} (choose from {', '.join(METHODS)})", "method")
        if m in ("rtn", "gptq") and self.bits not in (4, 8):
            raise QServeError(f"{m} supports bits 4 or 8, got {self.bits}", "bits")
        if m == "awq" and (self.bits != 4 or self.group_size == -1):
            raise QServeError("awq supports bits 4 with a group_size (32, 64, 128)", "bits")
        if m in ("rtn", "gptq", "awq") and self.group_size not in (-1, *GROUP_SIZES, "auto"):
            raise QServeError(
                f"group_size must be -1, 32, 64, 128 or auto, got {self.group_size}", "group_size"
            )
        if self.weight_strategy not in ("channel", "tensor"):
            raise QServeError("weight_strategy must be 'channel' or 'tensor'", "weight_strategy")
        if self.activation_scheme not in ("dynamic", "static"):
            raise QServeError("activation_scheme must be 'dynamic' or 'static'")
        if self.quantize_lm_head and m not in ("rtn", "gptq"):
            raise QServeError(
                f"quantize_lm_head is supported for rtn and gptq (the GPTQ format), not {m}",
                "quantize_lm_head",
            )
        if self.gptaq and m != "gptq":
            raise QServeError(f"gptaq is a variant of gptq, not of {m}", "gptaq")
        if self.gptq_weights and m not in ("int8", "fp8"):
            raise QServeError(f"gptq_weights rounds int8 / fp8 weights, not {m}'s", "gptq_weights")
        # Unset options take the method's default: GPTAQ for gptq, GPTQ rounding for int8 / fp8.
        if self.gptaq is None:
            object.__setattr__(self, "gptaq", m == "gptq")
        if self.gptq_weights is None:
            object.__setattr__(self, "gptq_weights", m in ("int8", "fp8"))
        if not 0 <= self.damp < 1:
            raise QServeError(f"damp must be in [0, 1), got {self.damp}", "damp")
        check_kv_cache_dtype(self.kv_cache_dtype)

    @property
    def lm_head_needs_inputs(self) -> bool:
        """GPTQ of lm_head needs the final hidden states (RTN does not)."""
        return self.quantize_lm_head and self.method == "gptq"

    @property
    def calibrates_kv_scales(self) -> bool:
        return check_kv_cache_dtype(self.kv_cache_dtype) is not None

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
        return self.method == "gptq" or (self.searches_scales and not replay)

    @property
    def scheme_name(self) -> str:
        """What a default output folder is named after: `gptq-w4g64`, `rtn-w8ch` (per
        channel), `int8-w8a8`, `fp8`. The group size must be resolved (not "auto")."""
        if self.method == "int8":
            return "int8-w8a8"
        if self.method == "fp8":
            return "fp8"
        groups = "ch" if self.group_size == -1 else f"g{self.group_size}"
        return f"{self.method}-w{self.bits}{groups}"

    @property
    def min_zero(self) -> int:
        # GPTQ v1 stores zero - 1: asymmetric zeros of 0 are not representable.
        return 1 if self.method in ("rtn", "gptq") else 0


def check_group_size(model: nn.Module, spec: ArchSpec, settings: QuantizeSettings) -> None:
    """One-line error, before any calibration, when the group size does not divide the input
    size of a linear that would be quantized (the formats have no partial groups)."""
    gs = settings.group_size
    if settings.method not in ("rtn", "gptq", "awq") or gs == -1:
        return
    for b, block in enumerate(model.get_submodule(spec.blocks)):
        for name in spec.linears:
            full = f"{spec.blocks}.{b}.{name}"
            K = block.get_submodule(name).in_features
            if K % gs and not is_ignored(full, settings.ignore):
                raise _group_size_error(gs, full, K)
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
            check_group_size(model, spec, dataclasses.replace(settings, group_size=gs))
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


def out_dtype(dtype: str | None, method: str) -> torch.dtype:
    """The dtype of the tensors a checkpoint keeps in floating point (default float16 for the
    GPTQ / AWQ formats, bfloat16 for compressed-tensors)."""
    import torch

    if dtype is None:
        return torch.float16 if method in ("rtn", "gptq", "awq") else torch.bfloat16
    choices = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
    if dtype not in choices:
        raise QServeError(f"dtype must be one of {', '.join(choices)}, got {dtype!r}", "dtype")
    return choices[dtype]
