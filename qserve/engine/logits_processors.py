"""Per-request token controls for the sampler, with vLLM's names and semantics.

- `allowed_token_ids`: only these tokens may be sampled (every other logit becomes -inf);
- `bad_words`: words that must not be generated. The engine tokenizes each once per request
  (`tokenize_bad_words`), as it is and with a leading space. At each step a bad word's last token
  is banned when the output so far (the prompt does not count) ends with its other tokens: a
  one-token word's token is banned at every step;
- `logit_bias`: token id -> bias in [-100, 100], added to that token's logit.

The sampler applies them as vLLM v1 does, after the raw logprobs and before the penalties:
allowed_token_ids, bad words, min_tokens (sampler.py), logit_bias, then the penalties.
A request's controls are turned into tensors once (`TokenControls`, kept on the `Request`); each
step concatenates the rows' tensors into one index per control and applies each in one op.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from qserve.engine.sampling_params import MAX_BAD_WORDS, SamplingParams
from qserve.errors import QServeError

# Most tokens all of a request's tokenized bad words may hold (vLLM's
# VLLM_MAX_BAD_WORDS_TOTAL_TOKENS); MAX_BAD_WORDS (vLLM's VLLM_MAX_NUM_BAD_WORDS) bounds the number
# of token sequences.
MAX_BAD_WORDS_TOKENS = 1024


def check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """allowed_token_ids and logit_bias ids must be in [0, vocab_size) (SamplingParams checked
    the rest); a QServeError naming the field."""
    fields = {"allowed_token_ids": params.allowed_token_ids, "logit_bias": params.logit_bias}
    for name, ids in fields.items():
        if ids and max(ids) >= vocab_size:
            bad = sorted(t for t in ids if t >= vocab_size)[:10]
            raise QServeError(
                f"{name} has token ids outside the vocabulary [0, {vocab_size}): {bad}",
                param=name,
            )


def tokenize_bad_words(
    tokenizer: Any, vocab_size: int, bad_words: Sequence[str]
) -> tuple[tuple[int, ...], ...]:
    """Each bad word's token sequences, as vLLM builds them (`SamplingParams.
    update_from_tokenizer`): the word without leading whitespace, then with one leading space when
    that starts with another token and has as many tokens (a word in mid-text)."""
    sequences: list[list[int]] = []
    for word in bad_words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not plain:
            raise QServeError(f"bad_words entry {word!r} tokenizes to no tokens", param="bad_words")
        sequences.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    if len(sequences) > MAX_BAD_WORDS:
        raise QServeError(
            f"bad_words tokenize to {len(sequences)} token sequences; at most {MAX_BAD_WORDS}",
            param="bad_words",
        )
    if sum(len(s) for s in sequences) > MAX_BAD_WORDS_TOKENS:
        raise QServeError(
            f"bad_words tokenize to more than {MAX_BAD_WORDS_TOKENS} tokens in all",
            param="bad_words",
        )
    if any(t < 0 or t >= vocab_size for s in sequences for t in s):
        raise QServeError(
            f"bad_words tokenize to token ids outside the vocabulary [0, {vocab_size})",
            param="bad_words",
        )
    return tuple(tuple(s) for s in sequences)


@dataclass(frozen=True)
class TokenControls:
    """One request's controls as the sampler uses them, built once (`build`) on the CPU."""

    allowed_token_ids: Tensor | None  # int64 [k], unique
    bias_token_ids: Tensor | None  # int64 [m], unique
    biases: Tensor | None  # fp32 [m]
    bad_words_token_ids: tuple[tuple[int, ...], ...]  # from tokenize_bad_words

    @classmethod
    def build(
        cls,
        params: SamplingParams,
        bad_words_token_ids: Sequence[Sequence[int]] | None = None,
    ) -> TokenControls | None:
        """None when the request uses none of the three. `params.bad_words` must come
        tokenized (`tokenize_bad_words`) as `bad_words_token_ids`."""
        if params.bad_words and bad_words_token_ids is None:
            raise ValueError("bad_words need their token ids (tokenize_bad_words)")
        bad = tuple(tuple(s) for s in bad_words_token_ids or ())
        allowed = params.allowed_token_ids
        bias = params.logit_bias or {}
        if allowed is None and not bias and not bad:
            return None
        return cls(
            allowed_token_ids=(
                None if allowed is None else torch.tensor(sorted(set(allowed)), dtype=torch.int64)
            ),
            bias_token_ids=torch.tensor(list(bias), dtype=torch.int64) if bias else None,
            biases=torch.tensor(list(bias.values()), dtype=torch.float32) if bias else None,
            bad_words_token_ids=bad,
        )


def control_tensors(
    controls: Sequence[TokenControls | None],
    output_token_ids: Sequence[Sequence[int]],
    vocab_size: int,
    device: torch.device | str = "cpu",
) -> dict[str, Any]:
    """This step's SamplingMetadata fields for the rows' controls (None where no row uses one)."""
    return {
        "allowed_token_ids_mask": _allowed_mask(controls, vocab_size, device),
        "bad_words_banned": _bad_words_banned(controls, output_token_ids, device),
        "logit_bias": _logit_bias(controls, device),
    }


def _flat(
    controls: Sequence[TokenControls | None], field: str
) -> tuple[list[int], list[int], list[Tensor]] | None:
    """The rows whose controls have `field`, each one's length, and the tensors; None if none."""
    found = [(i, getattr(c, field)) for i, c in enumerate(controls) if c is not None]
    found = [(i, t) for i, t in found if t is not None]
    if not found:
        return None
    return [i for i, _ in found], [len(t) for _, t in found], [t for _, t in found]


def _allowed_mask(
    controls: Sequence[TokenControls | None], vocab_size: int, device: torch.device | str
) -> Tensor | None:
    """bool [num_rows, vocab]: True where a row with allowed_token_ids may not sample."""
    flat = _flat(controls, "allowed_token_ids")
    if flat is None:
        return None
    rows, lengths, ids = flat
    row_index = torch.repeat_interleave(torch.tensor(rows), torch.tensor(lengths))
    mask = torch.zeros(len(controls), vocab_size, dtype=torch.bool, device=device)
    mask[torch.tensor(rows, device=device)] = True
    mask[row_index.to(device), torch.cat(ids).to(device)] = False
    return mask


def banned_bad_word_tokens(
    bad_words_token_ids: Sequence[Sequence[int]], output_token_ids: Sequence[int]
) -> list[int]:
    """vLLM's rule: the last token of each bad word whose other tokens end the output so far."""
    num_output = len(output_token_ids)
    banned = []
    for word in bad_words_token_ids:
        prefix_len = len(word) - 1
        if prefix_len > num_output:
            continue
        if list(output_token_ids[num_output - prefix_len :]) == list(word[:prefix_len]):
            banned.append(word[-1])
    return banned


def _bad_words_banned(
    controls: Sequence[TokenControls | None],
    output_token_ids: Sequence[Sequence[int]],
    device: torch.device | str,
) -> tuple[Tensor, Tensor] | None:
    """(rows, token ids) the rows' bad words ban at this step."""
    rows: list[int] = []
    ids: list[int] = []
    for i, c in enumerate(controls):
        if c is not None and c.bad_words_token_ids:
            banned = banned_bad_word_tokens(c.bad_words_token_ids, output_token_ids[i])
            rows += [i] * len(banned)
            ids += banned
    if not ids:
        return None
    return torch.tensor(rows, device=device), torch.tensor(ids, device=device)


def _logit_bias(
    controls: Sequence[TokenControls | None], device: torch.device | str
) -> tuple[Tensor, Tensor, Tensor] | None:
    """(rows, token ids, biases), flat over the rows with a logit_bias."""
    flat = _flat(controls, "bias_token_ids")
    if flat is None:
        return None
    rows, lengths, token_ids = flat
    biases = [controls[i].biases for i in rows]  # type: ignore[union-attr]
    row_index = torch.repeat_interleave(torch.tensor(rows), torch.tensor(lengths))
    return row_index.to(device), torch.cat(token_ids).to(device), torch.cat(biases).to(device)


def apply_allowed_token_ids(logits: Tensor, mask: Tensor | None) -> None:
    """-inf outside each row's allowed_token_ids (in place)."""
    if mask is not None:
        logits.masked_fill_(mask, -float("inf"))


def apply_bad_words(logits: Tensor, banned: tuple[Tensor, Tensor] | None) -> None:
    """-inf on the tokens that would complete a bad word (in place)."""
    if banned is not None:
        logits[banned] = -float("inf")


def apply_logit_bias(logits: Tensor, bias: tuple[Tensor, Tensor, Tensor] | None) -> None:
    """Add each row's biases to its logits (in place)."""
    if bias is not None:
        rows, token_ids, biases = bias
        logits.index_put_((rows, token_ids), biases, accumulate=True)
