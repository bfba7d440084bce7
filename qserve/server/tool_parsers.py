"""Tool-call parsers for `tool_choice: "auto"` (`--tool-call-parser`): the formats models emit.

    hermes       Qwen 2.5/3, Hermes: <tool_call>{"name": ..., "arguments": {...}}</tool_call>
                 blocks (any number), content before them
    llama3_json  Llama 3.1/3.2: the output is {"name": ..., "parameters": {...}} (optionally after
                 <|python_tag|>), several joined by ";"
    mistral      Mistral: [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]

Each parser splits a finished output into (content, calls); `start` tells a stream where tool
calls may begin, so that the text before them streams as content and the rest is held back.
Output that does not parse as calls is content (vLLM's behaviour: a model that tried and failed
returns text, never a 500).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from qserve.errors import QServeError


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text


class ToolParser:
    """Splits model output into content and tool calls."""

    name = ""
    start_markers: tuple[str, ...] = ()  # text that begins the tool-call part of an output

    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        raise NotImplementedError

    def start(self, text: str) -> int | None:
        """Where tool calls begin in `text` (a stream's output so far), or None; a stream sends
        content only up to a possible partial marker at the end."""
        hits = [i for i in (text.find(m) for m in self.start_markers) if i >= 0]
        return min(hits) if hits else None

    def safe_prefix(self, text: str) -> int:
        """How much of `text` may stream as content: all but a tail that could begin a marker."""
        for k in range(min(len(text), max(map(len, self.start_markers), default=0)), 0, -1):
            if any(m.startswith(text[-k:]) for m in self.start_markers):
                return len(text) - k
        return len(text)


class HermesToolParser(ToolParser):
    name = "hermes"
    start_markers = ("<tool_call>",)
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        begin = self.start(text)
        if begin is None:
            return text, []
        calls = [_call(body, "arguments") for body in self._block.findall(text[begin:])]
        if not calls or any(c is None for c in calls):
            return text, []
        content = text[:begin]  # as vLLM's: the text before the calls, unstripped
        return content if content.strip() else None, [c for c in calls if c is not None]


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    start_markers = ("<|python_tag|>", "{")

    def start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped.startswith("<|python_tag|>") or stripped.startswith("{"):
            return len(text) - len(stripped)
        return None

    def safe_prefix(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or "<|python_tag|>".startswith(stripped):
            return 0  # could still become a call: hold back
        return len(text)

    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        begin = self.start(text)
        if begin is None:
            return text, []
        body = text[begin:].removeprefix("<|python_tag|>")
        calls = [_call(part, "parameters") for part in _split_objects(body)]
        if not calls or any(c is None for c in calls):
            return text, []
        return None, [c for c in calls if c is not None]


class MistralToolParser(ToolParser):
    name = "mistral"
    start_markers = ("[TOOL_CALLS]",)

    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        begin = self.start(text)
        if begin is None:
            return text, []
        try:
            items = json.loads(text[begin + len("[TOOL_CALLS]") :].strip())
        except json.JSONDecodeError:
            return text, []
        items = items if isinstance(items, list) else [items]
        calls = [_call(json.dumps(item), "arguments") for item in items]
        if not calls or any(c is None for c in calls):
            return text, []
        content = text[:begin]  # as vLLM's: the text before the calls, unstripped
        return content if content.strip() else None, [c for c in calls if c is not None]


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}


def tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        known = ", ".join(sorted(TOOL_PARSERS))
        raise QServeError(f"unknown tool-call parser {name!r}; known: {known}") from None


def _call(body: str, arguments_key: str) -> ParsedCall | None:
    """A {"name", arguments_key} object as a call (arguments as JSON text), else None."""
    try:
        data: Any = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    arguments = data.get(arguments_key, data.get("arguments", data.get("parameters", {})))
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ParsedCall(data["name"], text)


def _split_objects(text: str) -> list[str]:
    """Top-level JSON objects of `text`, separated by ';' or whitespace."""
    decoder, parts, i = json.JSONDecoder(), [], 0
    while i < len(text):
        while i < len(text) and text[i] in " \t\r\n;":
            i += 1
        if i >= len(text):
            break
        try:
            _, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return [text]  # not JSON: the caller treats it as content
        parts.append(text[i:end])
        i = end
    return parts
