"""The benchmark workload is deterministic for a seed and keeps to its length ranges."""

from __future__ import annotations

import pytest

from benchmarks.workload import (  # noqa: E402
    QUICK,
    WorkloadConfig,
    load_corpus,
    make_workload,
    sample_lengths,
)


class ByteTokenizer:
    """One token per UTF-8 byte: fast, exact lengths, decode(encode(t)) == t."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        return bytes(token_ids).decode("utf-8", errors="replace")


@pytest.fixture(scope="module")
def corpus() -> str:
    return load_corpus()


def test_lengths_are_seeded_and_in_range() -> None:
    config = WorkloadConfig(num_requests=64, seed=3)
    lengths = sample_lengths(config)
    assert lengths == sample_lengths(WorkloadConfig(num_requests=64, seed=3))
    assert lengths != sample_lengths(WorkloadConfig(num_requests=64, seed=4))
    assert len(lengths) == 64
    assert all(32 <= p <= 512 and 16 <= o <= 256 for p, o in lengths)
    # Uniform over the ranges: 64 draws reach both halves of each range.
    assert min(p for p, _ in lengths) < 272 < max(p for p, _ in lengths)
    assert min(o for _, o in lengths) < 136 < max(o for _, o in lengths)


def test_workload_is_deterministic_and_exact(corpus: str) -> None:
    config = WorkloadConfig(num_requests=16, seed=0)
    first = make_workload(ByteTokenizer(), config, corpus)
    again = make_workload(ByteTokenizer(), config, corpus)
    assert first == again
    assert [r.request_id for r in first] == [str(i) for i in range(16)]
    assert [(r.prompt_len, r.max_tokens) for r in first] == sample_lengths(config)
    assert len({tuple(r.prompt_token_ids) for r in first}) == 16  # different stretches of text


def test_prompts_are_real_text_outside_the_evaluation_split(corpus: str) -> None:
    held_out = load_corpus(1, 10)
    for r in make_workload(ByteTokenizer(), WorkloadConfig(num_requests=8, seed=1), corpus):
        assert r.prompt.strip() in corpus
        assert r.prompt.strip()[:64] not in held_out
        assert r.prompt[0] != " "  # starts at a word


def test_quick_config_is_short() -> None:
    assert QUICK.num_requests == 8
    assert all(p <= 64 and o <= 16 for p, o in sample_lengths(QUICK))


@pytest.mark.parametrize(
    "kwargs",
    [dict(num_requests=0), dict(min_prompt_len=10, max_prompt_len=9), dict(min_output_len=0)],
)
def test_bad_config_fails(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        WorkloadConfig(**kwargs)


@pytest.mark.slow
def test_smollm2_prompts_have_exact_lengths() -> None:
    from qserve.model.loader import load_tokenizer
    from qserve.model.resolve import resolve_model

    tokenizer = load_tokenizer(resolve_model("smollm2-135m"))
    config = WorkloadConfig(num_requests=64, seed=0)
    requests = make_workload(tokenizer, config)
    assert [(r.prompt_len, r.max_tokens) for r in requests] == sample_lengths(config)
    assert requests == make_workload(tokenizer, config)
