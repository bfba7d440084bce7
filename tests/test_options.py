"""qserve.options: a settings dataclass checks its fields by type, parses a recipe section and
becomes click options, all from the one definition."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

import click
import pytest
from click.testing import CliRunner

from qserve.errors import QServeError
from qserve.options import (
    Range,
    check_fields,
    click_options,
    given_values,
    parse_section,
    setting,
)


@dataclasses.dataclass(frozen=True)
class Example:
    kind: Literal["a", "b"] = setting("a", "A kind.")
    size: Literal[-1, 32, "auto"] | None = setting(None, "A size.", default_text="auto")
    count: Annotated[int, Range(1)] = setting(4, "How many.")
    share: Annotated[float, Range(0, 1, max_open=True)] = setting(0.5, "A fraction.")
    names: tuple[str, ...] = setting(("x",), "Names; repeatable.")
    flag: bool = setting(True, "On or off.")
    memory: int | str = setting("1GiB", "A size.")

    def __post_init__(self) -> None:
        check_fields(self)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"kind": "c"}, "kind: 'c' is not allowed (allowed: a, b)"),
        ({"size": 48}, "size: 48 is not allowed (allowed: -1, 32, auto)"),
        ({"size": "32"}, "size: '32' is not allowed (allowed: -1, 32, auto)"),
        ({"count": 0}, "count: must be >= 1, got 0"),
        ({"count": True}, "count: expected an integer, got True"),
        ({"share": 1.0}, "share: must be in [0, 1), got 1.0"),
        ({"names": "x"}, "names: expected a list of strings, got 'x'"),
        ({"flag": "yes"}, "flag: expected true or false, got 'yes'"),
        ({"memory": 1.5}, "memory: expected an integer or a string, got 1.5"),
    ],
)
def test_fields_are_checked_by_type(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(QServeError) as err:
        Example(**kw)
    assert str(err.value) == message and err.value.param == next(iter(kw))


def test_lists_become_tuples_and_ints_are_numbers() -> None:
    e = Example(names=["a", "b"], share=0, size=-1)
    assert e.names == ("a", "b") and e.share == 0 and e.size == -1


def test_parse_section_refuses_unknown_and_skipped_keys() -> None:
    assert parse_section(Example, {"count": 2, "names": ["y"]}) == {"count": 2, "names": ("y",)}
    with pytest.raises(QServeError, match=r"^cnt: unknown key \(allowed: kind, size, count,"):
        parse_section(Example, {"cnt": 2})
    with pytest.raises(QServeError, match=r"^kind: unknown key \(allowed: size,"):
        parse_section(Example, {"kind": "a"}, skip=("kind",))
    with pytest.raises(QServeError, match="expected a mapping"):
        parse_section(Example, ["count"])


def run(args: list[str]) -> tuple[int, str, dict[str, Any]]:
    seen: dict[str, Any] = {}

    @click.command()
    @click_options(Example)
    def command(**kw: Any) -> None:
        seen.update(given_values(Example, kw))

    result = CliRunner().invoke(command, args)
    return result.exit_code, result.output, seen


def test_click_options_from_the_fields() -> None:
    code, _, given = run([])
    assert code == 0 and given == {}  # nothing given: the fields' defaults apply
    args = ["--kind", "b", "--size", "32", "--count", "2", "--names", "p", "--names", "q",
            "--no-flag", "--memory", "2GiB", "--share", "0.25"]  # fmt: skip
    code, _, given = run(args)
    assert code == 0 and Example(**given) == Example(
        kind="b", size=32, count=2, names=("p", "q"), flag=False, memory="2GiB", share=0.25
    )
    assert run(["--size", "auto"])[2] == {"size": "auto"}
    for bad, words in [(["--size", "48"], "'48' is not one of -1, 32, auto"),
                       (["--count", "0"], "0 is not in the range x>=1"),
                       (["--kind", "c"], "'c' is not one of 'a', 'b'")]:  # fmt: skip
        code, output, _ = run(bad)
        assert code == 2 and words in output, output


def test_help_shows_each_default() -> None:
    _, output, _ = run(["--help"])
    for text in ("A kind. [default: a]", "[default: auto]", "[default: x]", "[default: on]"):
        assert text in " ".join(output.split()), text
