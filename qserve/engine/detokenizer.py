"""Incremental detokenization and stop strings (the shape of vLLM v1's `detokenizer.py`).

Text is decoded over a sliding window of tokens, as vLLM's `detokenize_incrementally` does:

    tokens[prefix_offset:read_offset]  -> prefix_text  (already emitted, decoded again as context)
    tokens[prefix_offset:]             -> new_text     (the same, plus the tokens not yet emitted)

The delta is `new_text[len(prefix_text):]`. Decoding a few tokens before the new ones gives
tokenizers that merge across tokens (leading spaces, byte fallback) the context they need. While
`new_text` ends in U+FFFD the new tokens hold part of a multi-byte character, so nothing is emitted
and the offsets stay put until the character is complete.
"""

from __future__ import annotations

from typing import Any

from qserve.engine.sampling_params import SamplingParams

# How many prompt tokens before the first output token serve as decoding context.
INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's output token ids into text, one step at a time, and finds stop strings.

    `tokenizer` is a transformers tokenizer (fast or slow).
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.stop = params.stop
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.skip_special_tokens = params.skip_special_tokens
        self.stop_buffer_length = params.stop_buffer_length
        self.vocab_len = len(tokenizer)
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self._output_text = ""
        self._last_output_text_offset = 0
        self._init_window(prompt_token_ids)

    def _init_window(self, prompt_token_ids: list[int]) -> None:
        context = prompt_token_ids[-INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET - 2 :]
        self.tokens = self._convert_ids_to_tokens(context)
        self.read_offset = len(self.tokens)
        self.prefix_offset = max(self.read_offset - INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET, 0)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def output_text(self) -> str:
        return self._output_text

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Append this step's tokens; return the stop string they completed, if any.

        `stop_terminated`: the last new token is a stop token (EOS or a stop_token_id); its text
        is left out unless include_stop_str_in_output. A matched stop string truncates the output
        text at its start (or after its end with include_stop_str_in_output).
        """
        if not new_token_ids:
            return None
        skipped_stop_token_id = None
        if stop_terminated and not self.include_stop_str_in_output:
            skipped_stop_token_id = new_token_ids[-1]
            new_token_ids = new_token_ids[:-1]
        stop_check_offset = len(self._output_text)
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            self._output_text += self.decode_next(token_id)
            # Text produced before min_tokens is reached cannot stop the request.
            if self.min_tokens and len(self.output_token_ids) <= self.min_tokens:
                stop_check_offset = len(self._output_text)
        if skipped_stop_token_id is not None:
            self.token_ids.append(skipped_stop_token_id)
        if not self.stop or len(self.output_token_ids) <= self.min_tokens:
            return None
        return self._apply_stop_strings(len(self._output_text) - stop_check_offset)

    def _apply_stop_strings(self, new_char_count: int) -> str | None:
        match = check_stop_strings(
            self._output_text, new_char_count, self.stop, self.include_stop_str_in_output
        )
        if match is None:
            return None
        stop_string, truncate_to = match
        if truncate_to != -1:
            self._output_text = self._output_text[:truncate_to]
        return stop_string

    def decode_next(self, token_id: int) -> str:
        """The text that token `token_id` completes (may be "" while a character is partial)."""
        self.tokens.extend(self._convert_ids_to_tokens([token_id]))
        window = self.tokens[self.prefix_offset :]
        prefix_text = self._tokens_to_string(self.tokens[self.prefix_offset : self.read_offset])
        new_text = self._tokens_to_string(window)
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.tokens)
        return new_text[len(prefix_text) :]

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to send now: all of it (delta=False) or what is new since the last call.

        While not finished the last `stop_buffer_length` characters are held back, so that a stop
        string that is not yet complete is never sent.
        """
        buffer_length = 0 if finished else self.stop_buffer_length
        length = len(self._output_text) - buffer_length
        if not delta:
            return self._output_text[: max(length, 0)]
        last_offset = self._last_output_text_offset
        if last_offset >= length:
            return ""
        self._last_output_text_offset = length
        return self._output_text[last_offset:length]

    def _convert_ids_to_tokens(self, token_ids: list[int]) -> list[str]:
        # Ids past the tokenizer (a model vocab padded for the kernels) decode to nothing.
        known = [t for t in token_ids if 0 <= t < self.vocab_len]
        tokens = self.tokenizer.convert_ids_to_tokens(
            known, skip_special_tokens=self.skip_special_tokens
        )
        return [t or "" for t in tokens]

    def _tokens_to_string(self, tokens: list[str]) -> str:
        if not tokens:
            return ""
        return self.tokenizer.convert_tokens_to_string(tokens)


def check_stop_strings(
    output_text: str, new_char_count: int, stop: list[str], include_in_output: bool
) -> tuple[str, int] | None:
    """Find the earliest stop string that ends in the last `new_char_count` characters.

    Returns (stop string, truncate_to): the text should be cut at `truncate_to`, or left as it is
    when truncate_to is -1. Only text that could overlap the new characters is searched.
    """
    if not new_char_count or not stop:
        return None
    matches = []
    for stop_str in stop:
        start = max(len(output_text) - new_char_count - len(stop_str) + 1, 0)
        stop_index = output_text.find(stop_str, start)
        if stop_index != -1:
            matches.append((stop_index, stop_str))
    if not matches:
        return None
    stop_index, stop_str = min(matches, key=lambda m: m[0])
    if include_in_output:
        stop_index += len(stop_str)
        if stop_index >= len(output_text):
            return stop_str, -1
    return stop_str, stop_index
