"""Quantization schemes of checkpoints: `config.json["quantization_config"]`, checked once.

A quantized checkpoint is a state dict plus a scheme. The scheme says, per
linear module name, how its weights are stored (`LinearScheme`), or that the module stays dense.
Formats (ARCHITECTURE.md section 4):

    quant_method          LinearScheme.format   weights                activations
    gptq                  gptq                  3/4/8-bit, groups, g_idx 16-bit
    awq (version gemm)    awq                   4-bit, groups, zeros    16-bit
    compressed-tensors    int8 | fp8            8-bit, channel|tensor   token|tensor|static|None
      pack-quantized      gptq (repacked)       4/8-bit, groups|channel 16-bit
    fp8 (vLLM)            fp8                   fp8, tensor|channel     tensor|static

GPTQ checkpoints may mix schemes per module with GPTQModel's `dynamic` overrides (regexes over
module names: other bits / group size / act-order, or "-:" to leave a module dense), read as
vLLM reads them. Anything else fails here, at start, with one line naming the scheme.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from qserve.errors import QServeError
from qserve.kernels.packing import GPTQ_BITS

FORMATS = ("gptq", "awq", "int8", "fp8")
# Activation quantization of W8A8 layers: dynamic per token, dynamic per tensor, static per
# tensor (a calibrated `input_scale`), or None (weight-only: activations stay 16-bit).
ACTIVATIONS = ("token", "tensor", "static", None)
SUPPORTED_METHODS = ("gptq", "awq", "compressed-tensors", "fp8")


@dataclass(frozen=True)
class LinearScheme:
    """How one linear's weights are stored in the checkpoint."""

    format: str  # one of FORMATS
    bits: int = 8
    group_size: int = -1  # gptq / awq; -1 = one group per output channel
    desc_act: bool = False  # gptq: g_idx is an act-order permutation
    activations: str | None = None  # int8 / fp8: one of ACTIVATIONS

    @property
    def name(self) -> str:
        if self.format in ("gptq", "awq"):
            group = "channel" if self.group_size == -1 else f"g{self.group_size}"
            act_order = " act-order" if self.desc_act else ""
            return f"{self.format} w{self.bits}a16 {group}{act_order}"
        if self.activations is None:
            return f"{self.format} w8a16"
        return f"{self.format} w8a8 ({_ACT_NAMES[self.activations]} activations)"


_ACT_NAMES = {"token": "dynamic per-token", "tensor": "dynamic per-tensor", "static": "static"}


@dataclass(frozen=True)
class QuantScheme:
    """A checkpoint's quantization: which linears hold which `LinearScheme`."""

    method: str  # quant_method as written in the config
    groups: tuple[tuple[tuple[str, ...], LinearScheme], ...]  # (targets, scheme), first wins
    ignore: tuple[str, ...] = ()  # names left dense (exact, dotted suffix or "re:<regex>")
    ignore_substrings: tuple[str, ...] = ()  # AWQ's modules_to_not_convert (substring match)
    block_modules: tuple[str, ...] | None = None  # GPTQ modules_in_block_to_quantize
    kv_cache_scheme: bool = False  # compressed-tensors kv_cache_scheme: k/v scales expected
    lm_head: bool = False  # GPTQ "lm_head": true (GPTQModel, vLLM): lm_head has the first scheme
    # GPTQModel's per-module `dynamic` overrides: (regex, scheme or None = left dense), the
    # first whose regex matches (re.match) the module's name decides, before everything else
    dynamic: tuple[tuple[str, LinearScheme | None], ...] = ()

    def for_module(self, name: str) -> LinearScheme | None:
        """The scheme of linear `name`, or None when it stays dense (lm_head does unless the
        checkpoint quantized it)."""
        for pattern, scheme in self.dynamic:
            if re.match(pattern, name):
                return scheme
        if name == "lm_head":
            return self.groups[0][1] if self.lm_head and self.groups else None
        if self._ignored(name):
            return None
        for targets, scheme in self.groups:
            if any(_matches(name, t) for t in targets):
                return scheme
        return None

    def _ignored(self, name: str) -> bool:
        if any(_matches(name, pattern) for pattern in self.ignore):
            return True
        if any(sub in name for sub in self.ignore_substrings):
            return True
        if self.block_modules is None:
            return False
        return not any(name.endswith("." + m) for m in self.block_modules)

    def describe(self) -> str:
        schemes = [scheme for _, scheme in self.groups]
        schemes += [scheme for _, scheme in self.dynamic if scheme is not None]
        names = list(dict.fromkeys(scheme.name for scheme in schemes))
        return f"{self.method}: {', '.join(names)}"


def _matches(name: str, pattern: str) -> bool:
    """compressed-tensors target/ignore matching: "Linear" (every linear we are asked about),
    "re:<regex>" (re.match, as compressed-tensors does), an exact name or a dotted suffix."""
    if pattern == "Linear":
        return True
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern or name.endswith("." + pattern)


def parse_quant_scheme(raw: Any, source: str = "config") -> QuantScheme | None:
    """`config.json["quantization_config"]` -> QuantScheme (None for dense checkpoints)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise QServeError(f"{source}: quantization_config is not a JSON object")
    method = str(raw.get("quant_method", "")).lower()
    parser = _PARSERS.get(method)
    if parser is None:
        supported = ", ".join(SUPPORTED_METHODS)
        raise QServeError(
            f"{source}: quantization method {method or None!r} is not supported; "
            f"expected one of {supported}"
        )
    return parser(raw, source)


def _unsupported(source: str, what: str, expected: str) -> QServeError:
    return QServeError(f"{source}: {what} is not supported; {expected}")


# ---------------------------------------------------------------------------------------- GPTQ


def _parse_gptq(raw: dict[str, Any], source: str) -> QuantScheme:
    bits = raw.get("bits")
    if bits not in GPTQ_BITS:
        raise _unsupported(source, f"GPTQ {bits}-bit", "qserve loads 3-, 4- and 8-bit GPTQ")
    fmt = raw.get("checkpoint_format") or raw.get("format") or "gptq"
    if fmt != "gptq":
        raise _unsupported(source, f"GPTQ checkpoint_format {fmt!r}", "expected 'gptq' (v1)")
    _check_pack_dtype(raw, source, "GPTQ")
    scheme = LinearScheme(
        "gptq",
        bits=bits,
        group_size=_group_size(raw.get("group_size", -1), source, "GPTQ"),
        desc_act=bool(raw.get("desc_act", False)),
    )
    return QuantScheme(
        "gptq",
        ((("Linear",), scheme),),
        block_modules=_block_modules(raw),
        lm_head=bool(raw.get("lm_head", False)),
        dynamic=_gptq_dynamic(raw.get("dynamic"), scheme, source),
    )


def _gptq_dynamic(
    raw: Any, base: LinearScheme, source: str
) -> tuple[tuple[str, LinearScheme | None], ...]:
    """GPTQModel's `dynamic`: {"[+:|-:]regex": {bits, group_size, desc_act, sym}}. A "-:" rule
    leaves matching modules dense; a positive one overrides the base scheme's fields (as
    GPTQModel and vLLM read it: the first matching rule decides)."""
    if not raw:
        return ()
    if not isinstance(raw, dict):
        raise _unsupported(source, f"GPTQ dynamic {type(raw).__name__}", "expected an object")
    rules = []
    for key, overrides in raw.items():
        negative = key.startswith("-:")
        pattern = key.removeprefix("-:").removeprefix("+:")
        try:
            re.compile(pattern)
        except re.error as exc:
            raise _unsupported(
                source, f"GPTQ dynamic regex {pattern!r} ({exc})", "a regex"
            ) from None
        if negative:
            rules.append((pattern, None))
            continue
        rules.append((pattern, _dynamic_scheme(overrides, base, source, pattern)))
    return tuple(rules)


_DYNAMIC_KEYS = {"bits", "group_size", "desc_act", "sym"}


def _dynamic_scheme(overrides: Any, base: LinearScheme, source: str, pattern: str) -> LinearScheme:
    if not isinstance(overrides, dict) or set(overrides) - _DYNAMIC_KEYS:
        what = f"GPTQ dynamic overrides {overrides!r} for {pattern!r}"
        raise _unsupported(source, what, f"expected keys among {sorted(_DYNAMIC_KEYS)}")
    bits = overrides.get("bits", base.bits)
    if bits not in GPTQ_BITS:
        raise _unsupported(source, f"GPTQ {bits}-bit (dynamic {pattern!r})", "3, 4 or 8 bits")
    group = _group_size(overrides.get("group_size", base.group_size), source, "GPTQ")
    desc_act = bool(overrides.get("desc_act", base.desc_act))
    return LinearScheme("gptq", bits=bits, group_size=group, desc_act=desc_act)


def _check_pack_dtype(raw: dict[str, Any], source: str, method: str) -> None:
    """GPTQModel can pack into int8/int16/int64 words (`pack_dtype`); the formats are int32."""
    pack_dtype = str(raw.get("pack_dtype") or "int32").removeprefix("torch.")
    if pack_dtype != "int32":
        raise _unsupported(source, f"{method} pack_dtype {pack_dtype!r}", "expected int32 words")


def _group_size(value: Any, source: str, method: str) -> int:
    if value is None:
        return -1
    if not isinstance(value, int) or isinstance(value, bool) or (value < 1 and value != -1):
        raise _unsupported(source, f"{method} group_size {value!r}", "expected -1 or >= 1")
    return value


def _block_modules(raw: dict[str, Any]) -> tuple[str, ...] | None:
    """optimum's `modules_in_block_to_quantize` (nested lists of names inside a block)."""
    groups = raw.get("modules_in_block_to_quantize")
    if not groups:
        return None
    return tuple(name for group in groups for name in group)


# ----------------------------------------------------------------------------------------- AWQ


def _parse_awq(raw: dict[str, Any], source: str) -> QuantScheme:
    version = str(raw.get("version", "gemm")).lower()
    if version != "gemm":
        raise _unsupported(source, f"AWQ version {version!r}", "expected 'gemm'")
    bits = raw.get("bits", raw.get("w_bit"))
    if bits != 4:
        raise _unsupported(source, f"AWQ {bits}-bit", "AWQ gemm checkpoints are 4-bit")
    if not raw.get("zero_point", True):
        raise _unsupported(source, "AWQ without zero points", "expected zero_point: true")
    _check_pack_dtype(raw, source, "AWQ")
    group = _group_size(raw.get("group_size", raw.get("q_group_size", 128)), source, "AWQ")
    scheme = LinearScheme("awq", bits=4, group_size=group)
    skip = tuple(raw.get("modules_to_not_convert") or ())
    return QuantScheme("awq", ((("Linear",), scheme),), ignore_substrings=skip)


# -------------------------------------------------------------------------- compressed-tensors

_CT_FORMATS = ("int-quantized", "float-quantized", "naive-quantized", "pack-quantized")
# "mixed-precision": each config group names its own format


def _parse_compressed_tensors(raw: dict[str, Any], source: str) -> QuantScheme:
    fmt = raw.get("format")
    groups = raw.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise QServeError(f"{source}: compressed-tensors config has no config_groups")
    if not all(isinstance(g, dict) for g in groups.values()):
        raise QServeError(f"{source}: compressed-tensors config_groups are not JSON objects")
    parsed = tuple(_ct_group(name, g, g.get("format") or fmt, source) for name, g in groups.items())
    return QuantScheme(
        "compressed-tensors",
        parsed,
        ignore=tuple(raw.get("ignore") or ()),
        kv_cache_scheme=_ct_kv_scheme(raw.get("kv_cache_scheme"), source),
    )


def _ct_group(
    name: str, group: dict[str, Any], fmt: Any, source: str
) -> tuple[tuple[str, ...], LinearScheme]:
    if fmt not in _CT_FORMATS:
        expected = "expected one of " + ", ".join(_CT_FORMATS)
        raise _unsupported(source, f"compressed-tensors format {fmt!r}", expected)
    where = f"compressed-tensors {name}"
    targets = tuple(group.get("targets") or ("Linear",))
    if fmt == "pack-quantized":
        return targets, _ct_packed(group, where, source)
    weights = group.get("weights") or {}
    kind, bits = weights.get("type", "int"), weights.get("num_bits")
    if bits != 8 or kind not in ("int", "float"):
        raise _unsupported(source, f"{where} {bits}-bit {kind} weights", "expected 8-bit")
    if weights.get("strategy") not in ("channel", "tensor"):
        strategy = weights.get("strategy")
        raise _unsupported(source, f"{where} weight strategy {strategy!r}", "channel or tensor")
    if not weights.get("symmetric", True):
        raise _unsupported(source, f"{where} asymmetric weights", "expected symmetric")
    if group.get("output_activations"):
        raise _unsupported(source, f"{where} output activations", "expected none")
    activations = _ct_activations(group.get("input_activations"), kind, where, source)
    fmt = "int8" if kind == "int" else "fp8"
    return targets, LinearScheme(fmt, activations=activations)


def _ct_packed(group: dict[str, Any], where: str, source: str) -> LinearScheme:
    """A pack-quantized group (W4A16 / W8A16 integer weights): loaded as GPTQ, repacked."""
    weights = group.get("weights") or {}
    bits, kind, strategy = (
        weights.get("num_bits"),
        weights.get("type", "int"),
        weights.get("strategy"),
    )
    if bits not in (4, 8) or kind != "int":
        raise _unsupported(source, f"{where} {bits}-bit {kind} packed weights", "4 or 8-bit int")
    if group.get("input_activations") or group.get("output_activations"):
        raise _unsupported(source, f"{where} quantized activations", "expected 16-bit ones")
    if strategy not in ("group", "channel"):
        raise _unsupported(source, f"{where} weight strategy {strategy!r}", "group or channel")
    group_size = weights.get("group_size") if strategy == "group" else -1
    if strategy == "group" and not (isinstance(group_size, int) and group_size > 0):
        raise QServeError(f"{source}: {where} has strategy group but group_size {group_size!r}")
    actorder = weights.get("actorder")
    if actorder not in (None, "group", "weight", "static"):
        raise _unsupported(source, f"{where} actorder {actorder!r}", "group, weight or none")
    return LinearScheme("gptq", bits=bits, group_size=group_size, desc_act=actorder == "group")


def _ct_activations(acts: dict[str, Any] | None, kind: str, where: str, source: str) -> str | None:
    if not acts:
        return None
    if acts.get("num_bits") != 8 or acts.get("type", kind) != kind:
        what = f"{where} {acts.get('num_bits')}-bit {acts.get('type')} activations"
        raise _unsupported(source, what, f"expected 8-bit {kind} like the weights")
    strategy, dynamic = acts.get("strategy"), acts.get("dynamic")
    if strategy == "token" and dynamic:
        return "token"
    if strategy == "tensor":
        return "tensor" if dynamic else "static"
    what = f"{where} activations (strategy {strategy!r}, dynamic {dynamic!r})"
    raise _unsupported(source, what, "expected dynamic per-token or per-tensor, or static")


def _ct_kv_scheme(kv: dict[str, Any] | None, source: str) -> bool:
    if not kv:
        return False
    if kv.get("num_bits") != 8 or kv.get("type") != "float":
        what = f"kv_cache_scheme {kv.get('num_bits')}-bit {kv.get('type')}"
        raise _unsupported(source, what, "expected 8-bit float")
    return True


# ------------------------------------------------------------------------------- vLLM's fp8


def _parse_fp8(raw: dict[str, Any], source: str) -> QuantScheme:
    if raw.get("weight_block_size"):
        raise _unsupported(source, "block-wise fp8 (weight_block_size)", "expected per-tensor")
    scheme_name = raw.get("activation_scheme", "dynamic")
    if scheme_name not in ("dynamic", "static"):
        raise _unsupported(source, f"fp8 activation_scheme {scheme_name!r}", "dynamic or static")
    # vLLM quantizes activations per tensor for this format (dynamically, or with input_scale).
    scheme = LinearScheme("fp8", activations="tensor" if scheme_name == "dynamic" else "static")
    ignore = tuple(raw.get("ignored_layers") or raw.get("modules_to_not_convert") or ())
    return QuantScheme("fp8", ((("Linear",), scheme),), ignore=ignore)


_PARSERS: dict[str, Callable[[dict[str, Any], str], QuantScheme]] = {
    "gptq": _parse_gptq,
    "awq": _parse_awq,
    "compressed-tensors": _parse_compressed_tensors,
    "fp8": _parse_fp8,
}
