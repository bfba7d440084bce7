"""Tool calling, as vLLM does it: policy for `tool_choice`, and the calls of an output.

    none        the tools reach the chat template; the output is content
    named       the output is the named function's arguments, enforced by the JSON schema of
                its parameters; one call
    required    the output is a JSON array of {"name", "parameters"} of the given tools
                (at least one), enforced by its schema; finish_reason "tool_calls"
    auto        the model decides; `--tool-call-parser` reads calls out of its text (tool
                choice "auto" without `--enable-auto-tool-choice` is a 400)

Tools without a tool_choice mean "auto", as in OpenAI's API.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from qserve.engine.structured_outputs import StructuredOutputsParams
from qserve.errors import QServeError
from qserve.server.tool_parsers import ParsedCall, ToolParser
from qserve.server.tool_protocol import ChatCompletionTool, NamedToolChoice, ToolChoice

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def effective_choice(tools: list[ChatCompletionTool], choice: ToolChoice | None) -> ToolChoice:
    """The tool choice a request means: "auto" when it gives tools but no choice."""
    if choice is None:
        return "auto" if tools else "none"
    return choice


def tool_choice_constraint(
    tools: list[ChatCompletionTool], choice: ToolChoice | None, parallel: bool = True
) -> StructuredOutputsParams | None:
    """The grammar a required or named tool choice puts on the output (None otherwise);
    `parallel` False (OpenAI's parallel_tool_calls) allows one call."""
    choice = effective_choice(tools, choice)
    if isinstance(choice, NamedToolChoice):
        return StructuredOutputsParams(json=_parameters(named_tool(tools, choice)),
                                       param="tool_choice")  # fmt: skip
    if choice == "required":
        if not tools:
            raise QServeError('tool_choice "required" needs tools', param="tool_choice")
        schema = _required_schema(tools)
        if not parallel:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema, param="tool_choice")
    return None


def named_tool(tools: list[ChatCompletionTool], choice: NamedToolChoice) -> ChatCompletionTool:
    for tool in tools:
        if tool.function.name == choice.function.name:
            return tool
    raise QServeError(
        f"tool_choice names the function {choice.function.name!r}, which is not in tools",
        param="tool_choice",
    )


def _parameters(tool: ChatCompletionTool) -> dict[str, Any]:
    return tool.function.parameters or ANY_OBJECT


def _required_schema(tools: list[ChatCompletionTool]) -> dict[str, Any]:
    """vLLM's schema for "required": an array of calls, each one of the tools with its
    parameters."""
    calls = [
        {
            "properties": {
                "name": {"type": "string", "enum": [tool.function.name]},
                "parameters": _parameters(tool),
            },
            "required": ["name", "parameters"],
        }
        for tool in tools
    ]
    return {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}


@dataclass(frozen=True)
class ToolOutput:
    """A finished output read as the message it stands for."""

    content: str | None
    calls: list[ParsedCall]
    finish_reason: str | None  # replaces the engine's when calls were made ("tool_calls")


def read_output(
    text: str,
    tools: list[ChatCompletionTool],
    choice: ToolChoice | None,
    parser: ToolParser | None,
    finish_reason: str | None,
    parallel: bool = True,
) -> ToolOutput:
    """The content and calls of a finished output under the request's tool choice (with
    `parallel` False, only the first call of an `auto` output)."""
    choice = effective_choice(tools, choice)
    if isinstance(choice, NamedToolChoice):
        return ToolOutput(None, [ParsedCall(choice.function.name, text)], finish_reason)
    if choice == "required":
        calls = _required_calls(text)
        return ToolOutput(None if calls else text, calls, "tool_calls" if calls else finish_reason)
    if choice == "auto" and parser is not None:
        content, calls = parser.extract(text)
        calls = calls if parallel else calls[:1]
        return ToolOutput(content, calls, "tool_calls" if calls else finish_reason)
    return ToolOutput(text, [], finish_reason)


def _required_calls(text: str) -> list[ParsedCall]:
    """The calls of a "required" output (a JSON array); [] when cut short (max_tokens)."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return []
    return [ParsedCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False))
            for item in items]  # fmt: skip


def call_id() -> str:
    """A tool call's id, in vLLM's form."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"
