"""OpenAI logprobs from the engine's per-token `Logprobs`, for both endpoints.

`logprob_entries` builds the per-token entries (the token's own text, its logprob, bytes, and
the top-k tokens in its place); chat sends them as they are (`{"content": [...]}`), completions
as the legacy columns (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`). A token's
text and bytes come from callables (the serving's cached decoders), so these stay pure.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

from qserve.engine.sampler import Logprobs
from qserve.server.responses import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    CompletionLogProbs,
    PromptLogprob,
)

TokenText = Callable[[int], str]
TokenBytes = Callable[[int], list[int]]


def token_logprob(
    token_id: int, logprob: float, text: TokenText, bytes_of: TokenBytes | None = None
) -> ChatCompletionLogProb:
    """One token's logprob; its bytes only when `bytes_of` is given (chat shows them)."""
    return ChatCompletionLogProb(**_token_fields(token_id, logprob, text, bytes_of))


def logprob_entry(
    entry: Logprobs, num_top: int, text: TokenText, bytes_of: TokenBytes | None = None
) -> ChatCompletionLogProbsContent:
    """The sampled token's logprob and the `num_top` most likely tokens', most likely first."""
    top = zip(entry.top_token_ids[:num_top], entry.top_logprobs[:num_top])
    return ChatCompletionLogProbsContent(
        **_token_fields(entry.sampled_token_id, entry.logprob, text, bytes_of),
        top_logprobs=[token_logprob(t, lp, text, bytes_of) for t, lp in top],
    )


def _token_fields(
    token_id: int, logprob: float, text: TokenText, bytes_of: TokenBytes | None
) -> dict[str, Any]:
    raw = None if bytes_of is None else bytes_of(token_id)
    return {"token": text(token_id), "logprob": logprob, "bytes": raw}


def logprob_entries(
    entries: list[Logprobs], num_top: int, text: TokenText, bytes_of: TokenBytes | None = None
) -> list[ChatCompletionLogProbsContent]:
    return [logprob_entry(e, num_top, text, bytes_of) for e in entries]


def chat_logprobs(
    entries: list[Logprobs] | None, num_top: int, text: TokenText, bytes_of: TokenBytes
) -> ChatCompletionLogProbs | None:
    """Chat's logprobs object of `entries` (one per generated token); None if none were asked."""
    if entries is None:
        return None
    return ChatCompletionLogProbs(content=logprob_entries(entries, num_top, text, bytes_of))


def completion_logprobs(
    entries: list[Logprobs] | None, num_top: int | None, text_offset: int, text: TokenText
) -> tuple[CompletionLogProbs | None, int]:
    """OpenAI's legacy logprobs object for `entries` (one per generated token), and the
    offset after them. A token's text_offset is where it starts if the tokens' own texts
    follow the echoed prompt (vLLM's rule), the same in a stream and in a whole response."""
    if entries is None or num_top is None:
        return None, text_offset
    rows = logprob_entries(entries, num_top, text)
    offsets = []
    for row in rows:
        offsets.append(text_offset)
        text_offset += len(row.token)
    logprobs = CompletionLogProbs(
        tokens=[row.token for row in rows],
        token_logprobs=[row.logprob for row in rows],
        top_logprobs=[_top_dict(row) for row in rows],
        text_offset=offsets,
    )
    return logprobs, text_offset


def echo_logprobs(
    prompt_ids: list[int], entries: list[Logprobs | None], num_top: int, text: TokenText
) -> tuple[CompletionLogProbs, int]:
    """The legacy columns of an echoed prompt (`entries`: its prompt logprobs, the first None),
    offsets from 0, and the offset after it. The first token's logprob and top are null."""
    first = text(prompt_ids[0])
    rest, offset = completion_logprobs(
        [e for e in entries[1:] if e is not None], num_top, len(first), text
    )
    assert rest is not None
    columns = CompletionLogProbs(
        tokens=[first, *rest.tokens],
        token_logprobs=[None, *rest.token_logprobs],
        top_logprobs=[None, *rest.top_logprobs],
        text_offset=[0, *rest.text_offset],
    )
    return columns, offset


def joined(a: CompletionLogProbs | None, b: CompletionLogProbs | None) -> CompletionLogProbs | None:
    """The rows of `a`, then those of `b` (either may be None)."""
    if a is None or b is None:
        return a or b
    return CompletionLogProbs(
        tokens=a.tokens + b.tokens,
        token_logprobs=a.token_logprobs + b.token_logprobs,
        top_logprobs=a.top_logprobs + b.top_logprobs,
        text_offset=a.text_offset + b.text_offset,
    )


def prompt_logprobs_field(
    entries: list[Logprobs | None], num_top: int, text: TokenText
) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's `prompt_logprobs` of a completion choice: per prompt token (the first None), the
    token's own entry and the `num_top` most likely, keyed by token id."""
    out: list[dict[str, PromptLogprob] | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        top = zip(entry.top_token_ids[:num_top], entry.top_logprobs[:num_top])
        row = {str(t): PromptLogprob(logprob=lp, rank=r, decoded_token=text(t))
               for r, (t, lp) in enumerate(top, start=1)}  # fmt: skip
        own = str(entry.sampled_token_id)
        row.setdefault(own, PromptLogprob(logprob=entry.logprob, rank=entry.rank,
                                          decoded_token=text(entry.sampled_token_id)))  # fmt: skip
        out.append(row)
    return out


def _top_dict(row: ChatCompletionLogProbsContent) -> dict[str, float]:
    """The legacy top-k: token text -> logprob, the sampled token's included."""
    top = {t.token: t.logprob for t in row.top_logprobs}
    top.setdefault(row.token, row.logprob)
    return top


# -- a token's own bytes --------------------------------------------------------------------------


def is_byte_level(tokenizer: Any) -> bool:
    """Whether the tokenizer's pieces are GPT-2 style byte-level strings (one char per byte)."""
    from tokenizers import decoders

    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and isinstance(backend.decoder, decoders.ByteLevel)


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    """The inverse of GPT-2's bytes_to_unicode: printable bytes map to themselves, the others
    to 256 + n in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]  # fmt: skip
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def token_bytes(tokenizer: Any, token_id: int, byte_level: bool) -> list[int]:
    """The bytes token `token_id` stands for: byte-level pieces mapped back to bytes,
    SentencePiece byte-fallback pieces (`<0xE2>`) to their byte, others as UTF-8 text."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    table = _unicode_to_byte()
    if byte_level and isinstance(piece, str) and all(c in table for c in piece):
        return [table[c] for c in piece]
    if isinstance(piece, str) and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):
        return [int(piece[3:5], 16)]
    return list(tokenizer.decode([token_id]).encode("utf-8"))
