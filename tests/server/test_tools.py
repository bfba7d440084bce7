"""Tool calling against a real server on the tiny random model (SmolLM2's tokenizer), with a
Hermes-style chat template (--chat-template) and the hermes parser (--enable-auto-tool-choice).
A random model calls tools correctly only when the grammar makes it: named and required tool
choices must always give arguments that validate; `auto` is shown with the model's text pinned
by a regex, so the hermes parser has <tool_call> blocks to read."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

from tests.server.conftest import MODEL_NAME, RunningServer, running_server, tiny_engine

TEMPLATE = Path(__file__).parent / "templates" / "hermes.jinja"


class WeatherArgs(BaseModel):
    city: str = Field(max_length=12)
    unit: Literal["celsius", "fahrenheit"]
    days: int = Field(ge=1, le=7)


class TimeArgs(BaseModel):
    timezone: Literal["UTC", "CET", "PST"]


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather",
                                      "parameters": WeatherArgs.model_json_schema()}},
    {"type": "function", "function": {"name": "get_time", "description": "The time",
                                      "parameters": TimeArgs.model_json_schema()}},
]  # fmt: skip
ARGS = {"get_weather": WeatherArgs, "get_time": TimeArgs}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": 2}}\n</tool_call>'  # noqa: E501


@pytest.fixture(scope="module")
def tool_server(tiny_model_dir: Path) -> Iterator[RunningServer]:
    with running_server(tiny_engine(tiny_model_dir), chat_template=TEMPLATE.read_text(),
                        tool_call_parser="hermes") as server:  # fmt: skip
        yield server


@pytest.fixture
def tool_client(tool_server: RunningServer) -> Iterator[openai.OpenAI]:
    with tool_server.client(timeout=30) as c:
        yield c


def test_named_tool_choice_always_validates(tool_client: openai.OpenAI) -> None:
    for seed in range(6):
        choice = tool_client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, temperature=1.0, seed=seed,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=120,
        ).choices[0]  # fmt: skip
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
        WeatherArgs.model_validate_json(call.function.arguments)
        assert choice.finish_reason == "stop"  # OpenAI's for a named function


def test_required_tool_choice_always_validates(tool_client: openai.OpenAI) -> None:
    for seed in range(6):
        choice = tool_client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, temperature=1.0, seed=seed,
            tool_choice="required", max_tokens=200,
        ).choices[0]  # fmt: skip
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            ARGS[call.function.name].model_validate_json(call.function.arguments)


def test_auto_with_the_hermes_parser(tool_client: openai.OpenAI) -> None:
    pinned = {"structured_outputs": {"regex": "Let me check\\.\\n" + _regex_literal(CALL)}}
    # at least one character a token: room for the whole pinned text, however it is split
    choice = tool_client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=200, seed=0,
        extra_body=pinned,
    ).choices[0]  # fmt: skip
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check.\n"  # the text before the call
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius", "days": 2}


def test_parallel_tool_calls_false_gives_one_call(tool_client: openai.OpenAI) -> None:
    for seed in range(4):
        choice = tool_client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, temperature=1.0, seed=seed,
            tool_choice="required", parallel_tool_calls=False, max_tokens=200,
        ).choices[0]  # fmt: skip
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    two = "Go.\n" + CALL + "\n" + CALL  # 225 characters: at most 225 tokens (and EOS)
    pinned = {"structured_outputs": {"regex": _regex_literal(two)}}
    choice = tool_client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=236, seed=0,
        parallel_tool_calls=False, extra_body=pinned,
    ).choices[0]  # fmt: skip
    assert len(choice.message.tool_calls) == 1  # auto: the first of the two


def test_auto_without_a_call_is_content(tool_client: openai.OpenAI) -> None:
    pinned = {"structured_outputs": {"choice": ["It is sunny."]}}
    choice = tool_client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=20, extra_body=pinned,
    ).choices[0]  # fmt: skip
    assert choice.message.content == "It is sunny." and not choice.message.tool_calls
    assert choice.finish_reason == "stop"


@pytest.mark.parametrize("mode", ["named", "required", "auto"])
def test_streamed_tool_calls_reassemble_to_the_same_call(tool_client, mode: str) -> None:
    kw: dict = dict(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, temperature=1.0, seed=3,
                    max_tokens=200)  # fmt: skip
    if mode == "named":
        kw["tool_choice"] = {"type": "function", "function": {"name": "get_weather"}}
    elif mode == "required":
        kw["tool_choice"] = "required"
    else:
        pattern = "Let me check\\.\\n" + _regex_literal(CALL)
        kw["extra_body"] = {"structured_outputs": {"regex": pattern}}
    whole = tool_client.chat.completions.create(**kw).choices[0]
    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in tool_client.chat.completions.create(stream=True, **kw):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
        for piece in delta.tool_calls or []:
            call = calls.setdefault(piece.index, {"name": "", "arguments": ""})
            call["name"] += piece.function.name or ""
            call["arguments"] += piece.function.arguments or ""
    assert [calls[i] for i in sorted(calls)] == [
        {"name": c.function.name, "arguments": c.function.arguments}
        for c in whole.message.tool_calls
    ]
    assert (content or None) == whole.message.content and finish == whole.finish_reason


def test_history_with_calls_and_results_reaches_the_template(tool_server) -> None:
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call-1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": "18 degrees"},
    ]  # fmt: skip
    body = {"model": MODEL_NAME, "messages": history, "tools": TOOLS, "tool_choice": "none",
            "add_generation_prompt": True}  # fmt: skip
    response = tool_server.http.post("/tokenize", headers=tool_server.auth, json=body)
    tokens = {"tokens": response.json()["tokens"]}
    text = tool_server.http.post("/detokenize", headers=tool_server.auth, json=tokens).json()
    text = text["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<tool_response>\n18 degrees\n</tool_response>" in text
    assert '"name": "get_time"' in text  # the tools reach the template


BAD = [
    ("not-in-tools", {"tools": TOOLS,
                      "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
    ("named-without-tools", {"tool_choice": {"type": "function", "function": {"name": "f"}}}),
    ("required-without-tools", {"tool_choice": "required"}),
    ("bad-choice", {"tools": TOOLS, "tool_choice": "sometimes"}),
    ("with-response-format", {"tools": TOOLS, "tool_choice": "required",
                              "response_format": {"type": "json_object"}}),
]  # fmt: skip


@pytest.mark.parametrize("extra", [c[1] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_tool_requests_are_400(tool_server: RunningServer, extra: dict) -> None:
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 4, **extra}
    response = tool_server.http.post("/v1/chat/completions", headers=tool_server.auth, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].startswith("tool_choice")


def test_auto_without_a_parser_is_a_400(server: RunningServer) -> None:
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 4, "tools": TOOLS}
    response = server.http.post("/v1/chat/completions", headers=server.auth, json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice"
    body["tool_choice"] = "none"  # tools offered, none called: fine without a parser
    assert server.http.post("/v1/chat/completions", headers=server.auth,
                            json=body).status_code == 200  # fmt: skip


def _regex_literal(text: str) -> str:
    special = set("\\^$.|?*+()[]{}/-")
    return "".join("\\n" if c == "\n" else ("\\" + c if c in special else c) for c in text)


def test_langchain_bind_tools_round_trip(tool_server: RunningServer) -> None:
    """A tool call, the tool's result, then the final answer, through langchain-openai."""
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool(args_schema=WeatherArgs)
    def get_weather(city: str, unit: str, days: int) -> str:
        """The weather forecast for a city."""
        return f"{days} days of sun in {city}, 20 degrees {unit}"

    llm = langchain_openai.ChatOpenAI(
        model=MODEL_NAME, base_url=f"{tool_server.base_url}/v1", api_key=tool_server.api_key or "x",
        temperature=1.0, max_tokens=100, max_retries=0, seed=1,
    )  # fmt: skip
    history = [HumanMessage("What is the weather in Paris?")]
    asked = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(history)
    [call] = asked.tool_calls
    assert call["name"] == "get_weather"
    result = get_weather.invoke(call["args"])
    history += [asked, ToolMessage(result, tool_call_id=call["id"])]
    final = llm.invoke(history)
    assert isinstance(final.content, str) and final.content and not final.tool_calls


def test_langchain_with_structured_output(tool_server: RunningServer) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(
        model=MODEL_NAME, base_url=f"{tool_server.base_url}/v1", api_key=tool_server.api_key or "x",
        temperature=1.0, max_tokens=100, max_retries=0, seed=2,
    )  # fmt: skip
    answer = llm.with_structured_output(WeatherArgs).invoke("Weather in Oslo for 3 days?")
    assert isinstance(answer, WeatherArgs)
