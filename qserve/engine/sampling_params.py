"""Per-request sampling parameters (vLLM's names, defaults and ranges)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace

from qserve.engine.structured_outputs import StructuredOutputsParams
from qserve.errors import QServeError

# Below this temperature a request is sampled greedily (vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5
# Most top logprobs a request may ask for (OpenAI's top_logprobs limit, vLLM's max_logprobs).
MAX_LOGPROBS = 20
# logit_bias: the bias range (OpenAI's); -100 in effect bans a token, +100 forces it
MAX_LOGIT_BIAS = 100.0
# Most bad words, and most token sequences they tokenize to (vLLM's VLLM_MAX_NUM_BAD_WORDS), and
# most characters of them all, checked before the engine tokenizes them
MAX_BAD_WORDS = 128
MAX_BAD_WORDS_CHARS = 16384


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


class RequestOutputKind(enum.IntEnum):
    """What each of a request's outputs holds (vLLM's names)."""

    CUMULATIVE = 0  # all text, token ids and logprobs so far (LLM.generate)
    DELTA = 1  # only what is new since the previous output: no step copies the history
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    Checked once when built; use `dataclasses.replace` to derive a changed copy (it checks again).
    `top_k` 0 or -1 means off; `max_tokens=None` means up to the context limit; `logprobs` is the
    number of top logprobs returned besides the sampled token's own (0..20, None = no logprobs);
    `prompt_logprobs` the same for each prompt token after the first (vLLM's: the token's logprob
    given the tokens before it, in `RequestOutput.prompt_logprobs`; the first entry is None).
    `logit_bias` (token id -> bias in [-100, 100], added to the logit), `allowed_token_ids` (only
    these may be sampled) and `bad_words` (never generated) are vLLM's: see logits_processors.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # a grammar the output must follow (JSON schema, regex, choice, EBNF): see structured_outputs
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", _normalize_stop(self.stop))
        object.__setattr__(self, "stop_token_ids", list(self.stop_token_ids or []))
        self._verify_floats()
        self._verify_ints()
        self._verify_stop()
        self._verify_token_controls()

    def _verify_floats(self) -> None:
        _check_float("temperature", self.temperature, low=0.0)
        _check_float("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        _check_float("min_p", self.min_p, low=0.0, high=1.0)
        _check_float("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _check_float("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        _check_float("repetition_penalty", self.repetition_penalty, low=0.0, low_open=True)

    def _verify_ints(self) -> None:
        _check_int("n", self.n, low=1)
        _check_int("top_k", self.top_k, low=-1)
        _check_int("min_tokens", self.min_tokens, low=0)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, low=1)
            if self.min_tokens > self.max_tokens:
                raise QServeError(
                    f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                    f"got {self.min_tokens}",
                    param="min_tokens",
                )
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), low=0, high=MAX_LOGPROBS)
        if self.seed is not None:
            _check_int("seed", self.seed, low=-(2**63), high=2**64 - 1)

    def _verify_stop(self) -> None:
        if any(not isinstance(s, str) for s in self.stop):
            raise QServeError("stop must be a string or a list of strings", param="stop")
        if any(s == "" for s in self.stop):
            raise QServeError("stop cannot contain an empty string", param="stop")
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id, low=0)

    def _verify_token_controls(self) -> None:
        """Types and ranges; token ids against the vocabulary: logits_processors.check_token_ids,
        when the engine adds the request."""
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise QServeError("logit_bias must map token ids to biases", param="logit_bias")
            for token_id, bias in self.logit_bias.items():
                _check_token_id("logit_bias", token_id)
                _check_float("logit_bias", bias, low=-MAX_LOGIT_BIAS, high=MAX_LOGIT_BIAS)
            biases = {token_id: float(bias) for token_id, bias in self.logit_bias.items()}
            object.__setattr__(self, "logit_bias", biases)
        if self.allowed_token_ids is not None:
            allowed = list(self.allowed_token_ids)
            if not allowed:
                raise QServeError("allowed_token_ids cannot be empty", param="allowed_token_ids")
            for token_id in allowed:
                _check_token_id("allowed_token_ids", token_id)
            object.__setattr__(self, "allowed_token_ids", allowed)
        words = self.bad_words or []
        if isinstance(words, str) or any(not isinstance(w, str) for w in words):
            raise QServeError("bad_words must be a list of strings", param="bad_words")
        bad_words = list(dict.fromkeys(words))  # vLLM drops repeats
        if any(not w.strip() for w in bad_words):
            raise QServeError("bad_words cannot contain an empty or blank string", "bad_words")
        if len(bad_words) > MAX_BAD_WORDS:
            raise QServeError(f"at most {MAX_BAD_WORDS} bad_words", param="bad_words")
        if sum(len(w) for w in bad_words) > MAX_BAD_WORDS_CHARS:
            raise QServeError(
                f"the bad_words have more than {MAX_BAD_WORDS_CHARS} characters", "bad_words"
            )
        object.__setattr__(self, "bad_words", bad_words)

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def all_stop_token_ids(self) -> set[int]:
        """Token ids that end the request besides the model's EOS (added by the caller)."""
        return set(self.stop_token_ids)

    @property
    def stop_buffer_length(self) -> int:
        """Characters a stream withholds so that a stop string is never sent in part."""
        if not self.stop or self.include_stop_str_in_output:
            return 0
        return max(len(s) for s in self.stop) - 1

    def child_params(self, index: int) -> SamplingParams:
        """Params of child `index` of an n > 1 request: n=1, and seed + index when seeded."""
        if not 0 <= index < self.n:
            raise ValueError(f"child index {index} out of range for n={self.n}")
        seed = None if self.seed is None else (self.seed + index) % 2**64  # stays in range
        # the prompt is scored once, by child 0: the others may read it from the prefix cache
        prompt_logprobs = self.prompt_logprobs if index == 0 else None
        return replace(self, n=1, seed=seed, prompt_logprobs=prompt_logprobs)


def _normalize_stop(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    return list(stop)


def _check_float(
    name: str,
    value: float,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise QServeError(f"{name} must be a number, got {value!r}", param=name)
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and value > high
    if too_low or too_high or math.isinf(value):
        allowed = _range_text(low, high, low_open)
        raise QServeError(f"{name} must be in {allowed}, got {value}", param=name)


def _check_int(name: str, value: int, low: int | None = None, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise QServeError(f"{name} must be an integer, got {value!r}", param=name)
    if (low is not None and value < low) or (high is not None and value > high):
        raise QServeError(f"{name} must be in {_range_text(low, high)}, got {value}", param=name)


def _check_token_id(name: str, token_id: int) -> None:
    if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
        raise QServeError(f"{name}: token ids must be integers >= 0, got {token_id!r}", param=name)


def _range_text(low: float | None, high: float | None, low_open: bool = False) -> str:
    left = "(" if low_open or low is None else "["
    right = "]" if high is not None else ")"
    low_text = "-inf" if low is None else str(low)
    high_text = "inf" if high is None else str(high)
    return f"{left}{low_text}, {high_text}{right}"
