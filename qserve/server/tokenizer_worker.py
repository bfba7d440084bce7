"""The server's tokenizer work (encode, chat template, decode) on a thread of its own.

Tokenizing a long prompt takes seconds; on the event loop it froze every stream, and on the engine
thread every step. Here it runs on one worker thread with its own copy of the tokenizer (Hugging
Face fast tokenizers must not be used from two threads at once, and the engine thread's detokenizer
uses the original); the Rust encoder releases the GIL, so streams keep flowing meanwhile.
"""

from __future__ import annotations

import asyncio
import copy
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from qserve.server.protocol import APIError, ChatMessage

T = TypeVar("T")
# Stand-ins for message contents while the chat template renders (private-use characters)
_CONTENT = re.compile("\ue000(\\d+)\ue001")


class TokenizerWorker:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = copy.deepcopy(tokenizer)
        # The longest token's text: no token covers more characters of a prompt (limits.py).
        self.max_token_chars = max((len(t) for t in tokenizer.get_vocab()), default=1)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="qserve-tokenizer")

    async def run(self, fn: Callable[[Any], T]) -> T:
        """`fn(tokenizer)` on the worker thread."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, self.tokenizer)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self.run(lambda tok: tok.encode(text, add_special_tokens=add_special_tokens))

    async def decode(self, token_ids: list[int]) -> str:
        return await self.run(lambda tok: tok.decode(token_ids))

    async def chat_token_ids(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        special_tokens_in_content: bool = False,
        template: ChatTemplateArgs | None = None,
    ) -> list[int]:
        """The prompt's token ids: the chat template rendered and tokenized. The template's own
        special tokens (role markers) are parsed; text like `<|im_end|>` inside a message stays
        plain text unless `special_tokens_in_content`, so a user cannot close their turn and
        write another role's. (vLLM tokenizes the rendered string whole, parsing both.)
        `template`: the tools, a template overriding the model's, extra template variables and
        continue_final_message."""
        template = template or ChatTemplateArgs()
        if not (template.chat_template or getattr(self.tokenizer, "chat_template", None)):
            raise APIError("this model's tokenizer has no chat template", param="messages")
        turns = [m.template_dict() for m in messages]
        parse = special_tokens_in_content
        return await self.run(
            lambda tok: _chat_token_ids(tok, turns, add_generation_prompt, parse, template)
        )

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass(frozen=True)
class ChatTemplateArgs:
    tools: list[dict[str, Any]] | None = None
    chat_template: str | None = None  # overrides the tokenizer's (--chat-template)
    kwargs: dict[str, Any] = field(default_factory=dict)  # the request's chat_template_kwargs
    continue_final_message: bool = False


def _chat_token_ids(
    tokenizer: Any,
    turns: list[dict[str, Any]],
    generation_prompt: bool,
    parse_content: bool,
    template: ChatTemplateArgs,
) -> list[int]:
    if parse_content:
        text = _apply_template(tokenizer, turns, generation_prompt, template)
        return tokenizer.encode(text, add_special_tokens=False)
    marked = [{**turn, "content": f"\ue000{i}\ue001"} if turn["content"] else turn
              for i, turn in enumerate(turns)]  # fmt: skip
    parts = _CONTENT.split(_apply_template(tokenizer, marked, generation_prompt, template))
    ids: list[int] = []
    for k, part in enumerate(parts):  # template text, content index, template text, ...
        if k % 2 == 0:
            ids += tokenizer.encode(part, add_special_tokens=False) if part else []
        else:
            content = turns[int(part)]["content"]
            ids += tokenizer.encode(content, add_special_tokens=False, split_special_tokens=True)
    return ids


def _apply_template(
    tokenizer: Any,
    turns: list[dict[str, Any]],
    add_generation_prompt: bool,
    template: ChatTemplateArgs,
) -> str:
    kwargs = {k: v for k, v in template.kwargs.items() if k not in _RESERVED_TEMPLATE_KWARGS}
    try:
        return tokenizer.apply_chat_template(
            turns,
            tools=template.tools,
            chat_template=template.chat_template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=template.continue_final_message,
            **kwargs,
        )
    except Exception as exc:  # jinja raises what the template author chose
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise APIError(f"the chat template failed: {message}", param="messages") from None


# chat_template_kwargs that would change how the template is called, not what it reads
_RESERVED_TEMPLATE_KWARGS = {
    "tokenize",
    "tools",
    "chat_template",
    "conversation",
    "add_generation_prompt",
    "continue_final_message",
    "return_dict",
}
