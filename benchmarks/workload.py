"""A seeded benchmark workload: real prompts cut from Moby-Dick, uniform prompt and output lengths.

Shared by the offline throughput benchmark and the serving benchmark. The whole API:

    config = WorkloadConfig(num_requests=64, seed=0)       # or QUICK for a smoke run
    requests = make_workload(tokenizer, config)            # list[BenchRequest]
    request.prompt_token_ids, request.max_tokens           # what to send (EOS is to be ignored)
    request.prompt                                         # the same prompt as text

Lengths come from `random.Random(seed)` before any text is read, so they depend on the seed only
(`sample_lengths`); prompt offsets are drawn after them from the same generator. Prompts are
`prompt_len` tokens of chapters 11-135 (chapters 1-10 are the evaluation split), starting at a
random word. `prompt_token_ids` is authoritative: decoding and re-encoding `prompt` may give a
slightly different number of tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol

from qserve import data

FIRST_CHAPTER = 11  # 1-10 are held out for evaluation (perplexity)
LAST_CHAPTER = 135
CHARS_PER_TOKEN = 8  # a generous bound for English BPE; the window doubles if it falls short


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


@dataclass(frozen=True)
class WorkloadConfig:
    num_requests: int = 64
    min_prompt_len: int = 32
    max_prompt_len: int = 512
    min_output_len: int = 16
    max_output_len: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        for lo, hi in (
            (self.min_prompt_len, self.max_prompt_len),
            (self.min_output_len, self.max_output_len),
        ):
            if not 1 <= lo <= hi:
                raise ValueError(f"length range [{lo}, {hi}] is empty or below 1")


QUICK = WorkloadConfig(
    num_requests=8, min_prompt_len=16, max_prompt_len=64, min_output_len=4, max_output_len=16
)


@dataclass(frozen=True)
class BenchRequest:
    request_id: str
    prompt: str
    prompt_token_ids: list[int]
    max_tokens: int  # exact output length: EOS ignored

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def sample_lengths(config: WorkloadConfig) -> list[tuple[int, int]]:
    """(prompt_len, output_len) per request, each uniform over its inclusive range."""
    return _sample_lengths(random.Random(config.seed), config)


def _sample_lengths(rng: random.Random, config: WorkloadConfig) -> list[tuple[int, int]]:
    return [
        (
            rng.randint(config.min_prompt_len, config.max_prompt_len),
            rng.randint(config.min_output_len, config.max_output_len),
        )
        for _ in range(config.num_requests)
    ]


def load_corpus(first: int = FIRST_CHAPTER, last: int = LAST_CHAPTER) -> str:
    """Chapters first..last of Moby-Dick, joined by blank lines."""
    return "\n\n".join(data.moby_dick(first, last))


def make_workload(
    tokenizer: Tokenizer, config: WorkloadConfig, corpus: str | None = None
) -> list[BenchRequest]:
    """The seeded requests: ids "0".."n-1", prompts of exactly their sampled length."""
    text = load_corpus() if corpus is None else corpus
    rng = random.Random(config.seed)
    lengths = _sample_lengths(rng, config)
    requests = []
    for i, (prompt_len, output_len) in enumerate(lengths):
        ids = cut_prompt(tokenizer, text, rng, prompt_len)
        requests.append(BenchRequest(str(i), tokenizer.decode(ids), ids, output_len))
    return requests


def cut_prompt(tokenizer: Tokenizer, text: str, rng: random.Random, num_tokens: int) -> list[int]:
    """`num_tokens` token ids of `text` from a random word on (the text must be long enough)."""
    window = num_tokens * CHARS_PER_TOKEN
    start = _word_start(text, rng.randrange(max(len(text) - window, 1)))
    while True:
        ids = tokenizer.encode(text[start : start + window])
        if len(ids) >= num_tokens or start + window >= len(text):
            break
        window *= 2
    if len(ids) < num_tokens:
        raise ValueError(f"the corpus is too short for a {num_tokens}-token prompt")
    return ids[:num_tokens]


def _word_start(text: str, pos: int) -> int:
    """The first position at or after `pos` that starts a word (pos itself if none follows)."""
    space = text.find(" ", pos)
    return pos if space < 0 else space + 1
