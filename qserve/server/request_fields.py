"""Request fields beyond sampling: structured outputs (`response_format`, vLLM's
`structured_outputs`), the fields qserve refuses rather than ignores, and unknown fields.

    response_format      {"type": "text"} | {"type": "json_object"}
                         | {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    structured_outputs   vLLM's: exactly one of json, regex, choice, grammar, json_object

Fields a client sends expecting behaviour qserve does not have (function calling's
old `functions`, vLLM's older guided_* names) are a 400 naming the field, never a silent 200. Any
other unknown field is accepted, as OpenAI does, and
logged once per field name, as vLLM logs them.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from qserve.engine.structured_outputs import StructuredOutputsParams
from qserve.errors import QServeError

logger = logging.getLogger("qserve")

# field -> why it is refused, for values that ask for something (see `_asks_for`)
REFUSED_FIELDS = {
    "functions": "function calling is not supported",
    "function_call": "function calling is not supported",
    "guided_json": "use structured_outputs: {json: ...} or response_format instead",
    "guided_regex": "use structured_outputs: {regex: ...} instead",
    "guided_choice": "use structured_outputs: {choice: [...]} instead",
    "guided_grammar": "use structured_outputs: {grammar: ...} instead",
    "guided_decoding_backend": "structured outputs always use xgrammar",
}
_logged_unknown: set[str] = set()


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class JsonSchemaFormat(_Strict):
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs` request field (the constraints qserve runs)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


def structured_params(
    response_format: ResponseFormat | None, structured_outputs: StructuredOutputs | None
) -> StructuredOutputsParams | None:
    """The request's one constraint, or None; both fields at once is a 400."""
    if response_format is not None and structured_outputs is not None:
        if response_format.type != "text":
            raise QServeError(
                "give response_format or structured_outputs, not both", param="response_format"
            )
    if structured_outputs is not None:
        s = structured_outputs
        return StructuredOutputsParams(s.json_, s.regex, s.choice, s.grammar, s.json_object)
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutputsParams(json_object=True, param="response_format")
    schema = response_format.json_schema
    if schema is None or schema.json_schema is None:
        raise QServeError(
            "response_format json_schema needs json_schema.schema", param="response_format"
        )
    return StructuredOutputsParams(json=schema.json_schema, param="response_format")


def check_extra_fields(extra: dict[str, Any] | None) -> None:
    """Refuse fields that ask for what qserve cannot do; log other unknown fields once."""
    for name, value in (extra or {}).items():
        if name in REFUSED_FIELDS:
            if _asks_for(name, value):
                raise QServeError(f"{name}: {REFUSED_FIELDS[name]}", param=name)
        elif name not in _logged_unknown:
            _logged_unknown.add(name)
            logger.warning("the request field %r is not known to qserve and is ignored", name)


def _asks_for(name: str, value: Any) -> bool:
    """Whether a refused field's value asks for anything (an empty list, null, false or a
    tool_choice of "none" asks for nothing)."""
    if name == "tool_choice":
        return value not in (None, "none")
    return value not in (None, False, [], {}, "")
