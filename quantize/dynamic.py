"""Per-module scheme overrides (GPTQModel's `dynamic`) for the GPTQ format: a mixed-precision
checkpoint that vLLM and GPTQModel load, and that `--method auto` writes.

A rule is a string, so that it is a repeatable flag and a YAML list item:

    REGEX=w8ch      modules whose name matches REGEX: 8 bits, one group per channel
    REGEX=w4g32     4 bits, groups of 32 (any of w3|w4|w8 with g32|g64|g128|ch; w3: GPTQ
                    format only, compressed-tensors' loaders in vLLM take 4 and 8 bits)
    -:REGEX         modules whose name matches REGEX stay 16-bit (not quantized)

The first rule whose REGEX matches (`re.match`, as GPTQModel and vLLM read `dynamic`) the
module's name in the checkpoint decides; a module no rule matches takes the run's bits and
group size. In the checkpoint they become `quantization_config["dynamic"]`:
{"+:REGEX": {"bits": 8, "group_size": -1}, "-:REGEX": {}}.

Pure string work: no torch.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from typing import Any

from qserve.errors import QServeError

__all__ = [
    "DynamicRule",
    "Scheme",
    "disjoint_rules",
    "gptq_dynamic",
    "parse_rule",
    "parse_rules",
    "scheme_for",
]

_SCHEME = re.compile(r"w(3|4|8)(?:g(32|64|128)|(ch))")


@dataclasses.dataclass(frozen=True)
class Scheme:
    """A GPTQ-format scheme of one linear: bits and group size (-1: per channel); bits 16 is
    the linear left unquantized."""

    bits: int
    group_size: int = -1

    @property
    def name(self) -> str:
        if self.bits == 16:
            return "bf16"
        return f"w{self.bits}" + ("ch" if self.group_size == -1 else f"g{self.group_size}")

    @property
    def dense(self) -> bool:
        return self.bits == 16

    @classmethod
    def parse(cls, text: str) -> Scheme:
        """'w4g64', 'w8ch', 'bf16' (also 'fp16', '16')."""
        if text in ("bf16", "fp16", "16"):
            return cls(16)
        m = _SCHEME.fullmatch(text)
        if m is None:
            expected = "w3|w4|w8 with g32|g64|g128|ch, or bf16"
            raise ValueError(f"unknown scheme {text!r}: expected {expected}")
        return cls(int(m.group(1)), -1 if m.group(3) else int(m.group(2)))


@dataclasses.dataclass(frozen=True)
class DynamicRule:
    pattern: str
    scheme: Scheme  # Scheme(16): the module stays dense

    def __str__(self) -> str:
        return f"-:{self.pattern}" if self.scheme.dense else f"{self.pattern}={self.scheme.name}"


def parse_rule(text: str) -> DynamicRule:
    """One rule string (see the module docstring); a one-line QServeError when malformed."""
    if text.startswith("-:"):
        pattern, scheme = text[2:], Scheme(16)
    else:
        pattern, sep, name = text.removeprefix("+:").rpartition("=")
        if not sep:
            raise QServeError(
                f"dynamic rule {text!r}: expected REGEX=SCHEME (e.g. '.*down_proj=w8ch') or "
                "-:REGEX",
                param="dynamic",
            )
        try:
            scheme = Scheme.parse(name)
        except ValueError as exc:
            raise QServeError(f"dynamic rule {text!r}: {exc}", param="dynamic") from None
    try:
        re.compile(pattern)
    except re.error as exc:
        raise QServeError(f"dynamic rule {text!r}: bad regex ({exc})", param="dynamic") from None
    if not pattern:
        raise QServeError(f"dynamic rule {text!r}: empty regex", param="dynamic")
    return DynamicRule(pattern, scheme)


def parse_rules(texts: Iterable[str]) -> tuple[DynamicRule, ...]:
    return tuple(parse_rule(t) for t in texts)


def scheme_for(name: str, rules: Iterable[DynamicRule], default: Scheme) -> Scheme:
    """The scheme of module `name` (its checkpoint name): the first matching rule's, else
    `default`."""
    for rule in rules:
        if re.match(rule.pattern, name):
            return rule.scheme
    return default


def disjoint_rules(
    rules: tuple[DynamicRule, ...], names: Iterable[str], default: Scheme
) -> tuple[DynamicRule, ...]:
    """Rules that give every module in `names` the scheme `rules` give it in any order: `rules`
    themselves when no module matches two of them, else one rule per scheme naming its modules
    exactly. config.json is written with sorted keys (as transformers writes it), so a reader
    may see the rules in another order than they were given."""
    names = list(names)
    if all(sum(bool(re.match(r.pattern, n)) for r in rules) <= 1 for n in names):
        return rules
    by_scheme: dict[Scheme, list[str]] = {}
    for name in names:
        scheme = scheme_for(name, rules, default)
        if scheme != default:
            by_scheme.setdefault(scheme, []).append(re.escape(name))
    return tuple(
        DynamicRule(f"(?:{'|'.join(escaped)})$", scheme) for scheme, escaped in by_scheme.items()
    )


def gptq_dynamic(rules: Iterable[DynamicRule]) -> dict[str, dict[str, Any]]:
    """`quantization_config["dynamic"]` as GPTQModel writes it."""
    out: dict[str, dict[str, Any]] = {}
    for rule in rules:
        if rule.scheme.dense:
            out[f"-:{rule.pattern}"] = {}
        else:
            scheme = rule.scheme
            out[f"+:{rule.pattern}"] = {"bits": scheme.bits, "group_size": scheme.group_size}
    return out
