"""A streamed choice under tool calling: what each chunk's delta says.

    named       the call's id and name first, then its arguments as the text comes
    required    nothing until the end, then the calls (each whole, in one delta)
    auto        content streams until the parser's start marker may begin; from there text is
                held back, and at the end the calls go out (or, if none parsed, the held text
                as content)

Reassembled, a stream gives the same message as the whole response (`tools.read_output`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from qserve.server.responses import DeltaFunctionCall, DeltaMessage, DeltaToolCall
from qserve.server.tool_parsers import ToolParser
from qserve.server.tool_protocol import ChatCompletionTool, NamedToolChoice, ToolChoice
from qserve.server.tools import call_id, effective_choice, read_output


@dataclass
class ToolStream:
    tools: list[ChatCompletionTool]
    choice: ToolChoice | None
    parser: ToolParser | None
    parallel: bool = True  # OpenAI's parallel_tool_calls: False keeps one call
    text: str = ""
    sent: int = 0  # characters of `text` sent as content (auto) or as arguments (named)
    holding: bool = False  # auto: a call may have begun
    started: bool = field(default=False)

    def feed(self, delta_text: str, finished: bool, finish_reason: str | None
             ) -> tuple[DeltaMessage | None, str | None]:  # fmt: skip
        """The delta for the new text (None: nothing to send yet) and the finish reason."""
        self.text += delta_text
        choice = effective_choice(self.tools, self.choice)
        if isinstance(choice, NamedToolChoice):
            return self._named(choice, delta_text), finish_reason
        if choice == "auto" and self.parser is not None and not finished:
            return self._auto_content(), finish_reason
        if choice in ("required", "auto") and (choice == "required" or self.parser is not None):
            return self._at_end(finished, finish_reason) if finished else (None, finish_reason)
        return (DeltaMessage(content=delta_text) if delta_text else None), finish_reason

    def _named(self, choice: NamedToolChoice, delta_text: str) -> DeltaMessage | None:
        if not self.started:
            self.started = True
            function = DeltaFunctionCall(name=choice.function.name, arguments=delta_text)
            call = DeltaToolCall(index=0, id=call_id(), type="function", function=function)
            return DeltaMessage(tool_calls=[call])
        if not delta_text:
            return None
        return DeltaMessage(tool_calls=[DeltaToolCall(index=0, function=DeltaFunctionCall(
            arguments=delta_text))])  # fmt: skip

    def _auto_content(self) -> DeltaMessage | None:
        assert self.parser is not None
        if self.holding or self.parser.start(self.text) is not None:
            self.holding = True
            return None
        end = self.parser.safe_prefix(self.text)
        if end <= self.sent:
            return None
        content, self.sent = self.text[self.sent : end], end
        return DeltaMessage(content=content)

    def _at_end(self, finished: bool, finish_reason: str | None
                ) -> tuple[DeltaMessage | None, str | None]:  # fmt: skip
        out = read_output(self.text, self.tools, self.choice, self.parser, finish_reason,
                          self.parallel)  # fmt: skip
        content = None
        if out.content is not None:
            sent = self.text[: self.sent]
            rest = out.content[len(sent) :] if out.content.startswith(sent) else out.content
            content = rest or None
        calls = [
            DeltaToolCall(index=i, id=call_id(), type="function",
                          function=DeltaFunctionCall(name=c.name, arguments=c.arguments))
            for i, c in enumerate(out.calls)
        ]  # fmt: skip
        if content is None and not calls:
            return None, out.finish_reason
        return DeltaMessage(content=content, tool_calls=calls or None), out.finish_reason
