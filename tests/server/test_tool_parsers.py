"""The tool-call parsers on the formats models emit, and on text that is not a call."""

from __future__ import annotations

import json

import pytest

from qserve.errors import QServeError
from qserve.server.tool_parsers import ParsedCall, tool_parser

WEATHER = {"city": "Paris", "days": 2}


def call(name: str = "get_weather", args: dict | None = None) -> ParsedCall:
    return ParsedCall(name, json.dumps(args if args is not None else WEATHER))


CASES = [
    ("hermes", 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
     '"days": 2}}\n</tool_call>', "Sure.\n", [call()]),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
     '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', None,
     [call(), call("get_time", {})]),
    ("hermes", "<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    ("hermes", "No tools needed.", "No tools needed.", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}', None,
     [call()]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", '
     '"days": 2}}; {"name": "get_time", "parameters": {}}', None,
     [call(), call("get_time", {})]),
    ("llama3_json", "The weather is fine.", "The weather is fine.", []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]',
     None, [call()]),
    ("mistral", "[TOOL_CALLS] oops", "[TOOL_CALLS] oops", []),
]  # fmt: skip


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_extract(name: str, text: str, content: str | None, calls: list[ParsedCall]) -> None:
    got_content, got_calls = tool_parser(name).extract(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == [
        (c.name, json.loads(c.arguments)) for c in calls
    ]


def test_a_stream_holds_back_a_partial_marker() -> None:
    hermes = tool_parser("hermes")
    assert hermes.safe_prefix("Sure. <tool_") == len("Sure. ")
    assert hermes.safe_prefix("Sure.") == len("Sure.")
    assert hermes.start("Sure. <tool_call>{") == len("Sure. ")
    llama = tool_parser("llama3_json")
    assert llama.safe_prefix("  ") == 0 and llama.safe_prefix("Hello") == len("Hello")


def test_unknown_parser() -> None:
    with pytest.raises(QServeError, match="unknown tool-call parser 'nope'"):
        tool_parser("nope")
