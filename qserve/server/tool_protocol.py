"""Request bodies of OpenAI tool calling: the tools offered, the tool choice, and the calls of
an assistant message in the history (checked strictly, as protocol.py's)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class FunctionDefinition(_Model):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionTool(_Model):
    type: Literal["function"]
    function: FunctionDefinition

    def template_dict(self) -> dict[str, Any]:
        """As chat templates read a tool (transformers' and vLLM's shape)."""
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class NamedFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCallIn(_Model):
    name: str
    arguments: str


class ToolCallIn(_Model):
    """A call of an assistant message in the history."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn

    def template_dict(self) -> dict[str, Any]:
        """As chat templates read a call: the arguments as an object when they are JSON (vLLM
        parses them for templates that write `arguments | tojson`)."""
        try:
            arguments: Any = json.loads(self.function.arguments)
        except json.JSONDecodeError:
            arguments = self.function.arguments
        function = {"name": self.function.name, "arguments": arguments}
        return {"id": self.id, "type": "function", "function": function}
