"""Settings dataclasses as the one definition of their options (mechanism, no policy).

A settings class (`EngineConfig`, `QuantizeSettings`) is a frozen dataclass whose fields are
made with `setting(default, help)`. Its field types say what a value may be:

    bool, int, float, str, X | None, Literal[...], tuple[str, ...] (a list in YAML, a
    repeatable flag), Annotated[int, Range(1)] (bounds)

From that one definition come:

    check_fields(obj)              every field against its type, in the class's __post_init__
    parse_section(cls, data, key)  a recipe section: unknown keys refused, each value checked
    click_options(cls, skip)       one CLI option per field: --name, type, default, help
    given_values(cls, kw)          the options a command line gave (not left at their default)

as vLLM generates its argument parser from its config dataclasses. A CLI option's default is
None ("not given"), so that a recipe value beats the field's default and an explicit flag beats
the recipe; the field's default is shown in the help.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from qserve.errors import QServeError

__all__ = [
    "Range",
    "setting",
    "check_fields",
    "parse_section",
    "click_options",
    "given_values",
    "field_names",
    "excerpt",
]


@dataclasses.dataclass(frozen=True)
class Range:
    """Bounds of a number: Annotated[int, Range(1)] is >= 1; open bounds exclude the limit."""

    min: float | None = None
    max: float | None = None
    min_open: bool = False
    max_open: bool = False

    def check(self, name: str, value: float) -> None:
        low = self.min is not None and (value <= self.min if self.min_open else value < self.min)
        high = self.max is not None and (value >= self.max if self.max_open else value > self.max)
        if low or high:
            raise QServeError(f"{name}: must be {self.describe()}, got {value}", name)

    def describe(self) -> str:
        """'>= 1', 'in [0, 1)', '<= 1'."""
        if self.min is not None and self.max is not None:
            ends = ("(" if self.min_open else "[", ")" if self.max_open else "]")
            return f"in {ends[0]}{self.min}, {self.max}{ends[1]}"
        if self.min is not None:
            return f"{'>' if self.min_open else '>='} {self.min}"
        return f"{'<' if self.max_open else '<='} {self.max}"


def setting(
    default: Any, help: str, *, flag: str | None = None, default_text: str | None = None
) -> Any:
    """A field of a settings class. `flag`: the CLI spelling when it is not --name (e.g.
    "-m/--method" or "--sym/--asym"); `default_text`: the help's default when the field's is
    None ("the method's default")."""
    meta = {"help": help, "flag": flag, "default_text": default_text}
    if isinstance(default, (list, dict, set)):
        raise TypeError("mutable defaults: use a tuple")
    return dataclasses.field(default=default, metadata=meta)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=True)


def field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


# ------------------------------------------------------------------------------ checking


def check_fields(obj: Any) -> None:
    """Check every field of `obj` against its type (one-line QServeError naming the field);
    lists given for tuple fields become tuples."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        checked = check_value(f.name, value, hints[f.name])
        if checked is not value:
            object.__setattr__(obj, f.name, checked)


def check_value(name: str, value: Any, hint: Any) -> Any:
    """`value` if it has type `hint` (a list for a tuple becomes a tuple), else QServeError."""
    origin = get_origin(hint)
    if origin is Annotated:
        base, *marks = get_args(hint)
        value = check_value(name, value, base)
        for mark in marks:
            if isinstance(mark, Range) and value is not None:
                mark.check(name, value)
        return value
    if origin in (Union, types.UnionType):
        return _check_union(name, value, get_args(hint))
    if origin is Literal:
        if not any(value == v and type(value) is type(v) for v in get_args(hint)):
            raise QServeError(f"{name}: {excerpt(value)} is not allowed (allowed: "
                              f"{_allowed(hint)})", name)  # fmt: skip
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise QServeError(f"{name}: expected a list of strings, got {excerpt(value)}", name)
        return tuple(value)
    if not _is_instance(value, hint):
        raise QServeError(f"{name}: expected {_describe(hint)}, got {excerpt(value)}", name)
    return value


def _check_union(name: str, value: Any, args: tuple[Any, ...]) -> Any:
    if value is None and type(None) in args:
        return None
    arms = [a for a in args if a is not type(None)]
    for arm in arms:
        try:
            return check_value(name, value, arm)
        except QServeError as exc:
            error = exc
    if len(arms) == 1:
        raise error
    expected = " or ".join(_describe(a) for a in arms)
    raise QServeError(f"{name}: expected {expected}, got {excerpt(value)}", name)


def _is_instance(value: Any, hint: Any) -> bool:
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _describe(hint: Any) -> str:
    origin = get_origin(hint)
    if origin is Annotated:
        return _describe(get_args(hint)[0])
    if origin is Literal:
        return "one of " + _allowed(hint)
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    return names.get(hint, getattr(hint, "__name__", str(hint)))


def _allowed(hint: Any) -> str:
    return ", ".join(str(v) for v in get_args(hint))


def excerpt(value: Any, limit: int = 60) -> str:
    """repr(value), cut short: an error line never echoes more than a few words of input."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parse_section(cls: type, data: Mapping[str, Any], skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """The values a recipe section sets, each checked against `cls`'s field of that name;
    an unknown key (or one in `skip`) is refused, naming the allowed keys."""
    if not isinstance(data, Mapping):
        raise QServeError(f"expected a mapping of keys, got {excerpt(data)}")
    names = [n for n in field_names(cls) if n not in skip]
    hints = _hints(cls)
    values = {}
    for key, value in data.items():
        if key not in names:
            raise QServeError(f"{key}: unknown key (allowed: {', '.join(names)})", str(key))
        values[key] = check_value(key, value, hints[key])
    return values


# ------------------------------------------------------------------------------ click options


def click_options(cls: type, skip: tuple[str, ...] = ()) -> Callable[[Any], Any]:
    """A decorator adding one click option per field of `cls` (except `skip`), in field order."""
    import click

    def decorate(func: Any) -> Any:
        for f in reversed(dataclasses.fields(cls)):
            if f.name not in skip:
                hint = _hints(cls)[f.name]
                func = click.option(*_flags(f, hint), **_option_kwargs(f, hint))(func)
        return func

    return decorate


def given_values(cls: type, kw: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of `cls` that a command line gave (options default to None: not given)."""
    return {n: kw[n] for n in field_names(cls) if kw.get(n) not in (None, ())}


def _flags(f: dataclasses.Field[Any], hint: Any) -> list[str]:
    """--name (a bool: --name/--no-name), or the field's own spelling; then the name."""
    flag = f.metadata["flag"] or ("--" + f.name.replace("_", "-"))
    if _base(hint) is bool and "/" not in flag:
        flag += "/--no-" + flag.removeprefix("--")
    return [*flag.split(","), f.name]


def _base(hint: Any) -> Any:
    """The hint without Annotated and None: int for Annotated[int, Range(1)] | None."""
    if get_origin(hint) is Annotated:
        return _base(get_args(hint)[0])
    if get_origin(hint) in (Union, types.UnionType):
        arms = [a for a in get_args(hint) if a is not type(None)]
        return _base(arms[0]) if len(arms) == 1 else hint
    return hint


def _option_kwargs(f: dataclasses.Field[Any], hint: Any) -> dict[str, Any]:
    import click

    default = f.metadata["default_text"] or _show(f.default)
    kwargs: dict[str, Any] = {"default": None, "help": f"{f.metadata['help']} [default: {default}]"}
    base = _base(hint)
    if base is bool:
        return kwargs
    if get_origin(base) is tuple:
        return kwargs | {"multiple": True}
    return kwargs | {"type": _click_type(base, _range(hint), click)}


def _range(hint: Any) -> Range | None:
    if get_origin(hint) in (Union, types.UnionType):
        arms = [a for a in get_args(hint) if a is not type(None)]
        return _range(arms[0]) if len(arms) == 1 else None
    if get_origin(hint) is Annotated:
        return next((m for m in get_args(hint)[1:] if isinstance(m, Range)), None)
    return None


def _click_type(base: Any, bounds: Range | None, click: Any) -> Any:
    if get_origin(base) is Literal:
        values = get_args(base)
        if all(isinstance(v, str) for v in values):
            return click.Choice(values)
        return _literal_type()(values)
    if base in (int, float):
        if bounds is None:
            return base
        kind = click.IntRange if base is int else click.FloatRange
        return kind(bounds.min, bounds.max, min_open=bounds.min_open, max_open=bounds.max_open)
    return click.STRING


def _show(default: Any) -> str:
    if isinstance(default, tuple):
        return " ".join(default) or "none"
    if isinstance(default, bool):
        return "on" if default else "off"
    return "none" if default is None else str(default)


@functools.cache
def _literal_type() -> type:
    import click

    class LiteralType(click.ParamType):
        """A choice among literals of mixed types (e.g. -1, 32, 64, 128 and "auto")."""

        name = "choice"

        def __init__(self, values: tuple[Any, ...]) -> None:
            self.values = values

        def get_metavar(self, param: Any, ctx: Any = None) -> str:
            return "[" + "|".join(map(str, self.values)) + "]"

        def convert(self, value: Any, param: Any, ctx: Any) -> Any:
            for v in self.values:
                if str(v) == str(value):
                    return v
            self.fail(f"{value!r} is not one of {', '.join(map(str, self.values))}", param, ctx)

    return LiteralType
