"""The server's tokenizer work (encode, chat template, decode) on a thread of its own.

Tokenizing a long prompt takes seconds; on the event loop it froze every stream, and on the engine
thread every step. Here it runs on one worker thread with its own copy of the tokenizer (Hugging
Face fast tokenizers must not be used from two threads at once, and the engine thread's detokenizer
uses the original); the Rust encoder releases the GIL, so streams keep flowing meanwhile.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from qserve.server.protocol import APIError, ChatMessage

T = TypeVar("T")


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

    async def render(self, messages: list[ChatMessage], add_generation_prompt: bool) -> str:
        """The prompt text the tokenizer's chat template makes of `messages`."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError("this model's tokenizer has no chat template", param="messages")
        turns = [m.template_dict() for m in messages]
        return await self.run(lambda tok: _apply_template(tok, turns, add_generation_prompt))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _apply_template(
    tokenizer: Any, turns: list[dict[str, str]], add_generation_prompt: bool
) -> str:
    try:
        return tokenizer.apply_chat_template(
            turns, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as exc:  # jinja raises what the template author chose
        raise APIError(f"the chat template failed: {exc}", param="messages") from None
