"""Perplexity through the engine's paged KV cache: equal to transformers' on the same windows,
FP8 pages close to fp32 pages, bad input as one-line errors, the CLI's JSON output."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from qserve.cli import cli
from qserve.config import EngineConfig
from qserve.engine.llm_engine import LLMEngine
from qserve.engine.request import Request
from qserve.engine.sampling_params import SamplingParams
from qserve.errors import QServeError
from qserve.eval import EvalResult, load_eval_text, perplexity, windows
from tests.text import moby_dick
from tests.tiny import byte_bpe_tokenizer, save_tiny_llama

SEQ_LEN = 64
MAX_TOKENS = 300  # 4 full windows of 64; the last 44 tokens are a partial window, dropped


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def token_ids() -> list[int]:
    return byte_bpe_tokenizer().encode(moby_dick(1, 1))


def make_engine(model_dir: Path, **kw: object) -> LLMEngine:
    kw.setdefault("kv_cache_memory", "4MiB")
    return LLMEngine(EngineConfig(str(model_dir), dtype="float32", **kw))


def hf_perplexity(model_dir: Path, chunks: list[list[int]]) -> float:
    """exp of the mean next-token cross-entropy of transformers' logits, window by window."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.inference_mode():
        for window in chunks:
            ids = torch.tensor([window])
            logits = model(ids).logits[0, :-1].float()
            total += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
            count += len(window) - 1
    return math.exp(total / count)


def test_windows_drop_the_partial_one() -> None:
    chunks = windows(list(range(300)), 64)
    assert [c[0] for c in chunks] == [0, 64, 128, 192] and all(len(c) == 64 for c in chunks)
    assert len(windows(list(range(300)), 64, max_tokens=128)) == 2


def test_equals_transformers(model_dir: Path, token_ids: list[int]) -> None:
    engine = make_engine(model_dir)
    result = perplexity(engine, token_ids, SEQ_LEN, MAX_TOKENS)
    assert (result.num_windows, result.num_tokens) == (4, 4 * (SEQ_LEN - 1))
    expected = hf_perplexity(model_dir, windows(token_ids, SEQ_LEN, MAX_TOKENS))
    assert result.perplexity == pytest.approx(expected, rel=1e-4)
    pool = engine.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks  # the throwaway request's blocks are back


# The perplexity `qserve eval` gave on these windows before it ran through prompt logprobs (its
# own path around the scheduler, commit cba6b1f): the rebuild must not move it.
BEFORE_REBUILD = 2114.3134340641477


def test_unchanged_by_the_rebuild(model_dir: Path, token_ids: list[int]) -> None:
    result = perplexity(make_engine(model_dir), token_ids, SEQ_LEN, MAX_TOKENS)
    assert result.perplexity == pytest.approx(BEFORE_REBUILD, rel=1e-6)


def test_windows_are_batched_chunked_and_preempted(model_dir: Path, token_ids: list[int]) -> None:
    """The windows go through the scheduler beside a generation that grows (10 KV blocks of 16
    tokens, 8 KiB each here): a small token budget chunks them, and the older generation
    preempts them when it needs a block; the perplexity is the same."""
    engine = make_engine(model_dir, max_num_batched_tokens=40, kv_cache_memory=10 * 8192)
    grow = SamplingParams(max_tokens=60, ignore_eos=True, temperature=0)
    engine.add_request("background", token_ids[:96], grow)  # 6 blocks, growing to 10
    result = perplexity(engine, token_ids, SEQ_LEN, MAX_TOKENS)
    assert engine.scheduler.num_preemptions > 0
    assert result.perplexity == pytest.approx(BEFORE_REBUILD, rel=1e-5)


def test_a_prefix_starts_every_window(model_dir: Path, token_ids: list[int]) -> None:
    """With a prefix (a tokenizer's <bos>), each window is prefix + seq_len - 1 text tokens and
    every text token is scored."""
    engine = make_engine(model_dir)
    result = perplexity(engine, token_ids, SEQ_LEN, MAX_TOKENS, prefix=[0])
    chunks = windows(token_ids, SEQ_LEN - 1, MAX_TOKENS)
    assert (result.num_windows, result.num_tokens) == (len(chunks), len(chunks) * (SEQ_LEN - 1))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total = 0.0
    with torch.inference_mode():
        for chunk in chunks:
            ids = torch.tensor([[0, *chunk]])
            logits = model(ids).logits[0, :-1]
            total += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
    assert result.perplexity == pytest.approx(math.exp(total / result.num_tokens), rel=1e-4)


def test_fp8_pages_close_to_fp32_pages(model_dir: Path, token_ids: list[int]) -> None:
    fp32 = perplexity(make_engine(model_dir), token_ids, SEQ_LEN, MAX_TOKENS)
    fp8 = perplexity(make_engine(model_dir, kv_cache_dtype="fp8_e4m3"), token_ids, SEQ_LEN, 300)
    assert fp8.perplexity != fp32.perplexity  # the FP8 pages are really what is read
    assert fp8.perplexity == pytest.approx(fp32.perplexity, rel=0.03)


def test_too_few_tokens(model_dir: Path) -> None:
    engine = make_engine(model_dir)
    with pytest.raises(QServeError, match="has 10 tokens, fewer than one window"):
        perplexity(engine, list(range(10)), SEQ_LEN)
    with pytest.raises(QServeError, match="--max-tokens 10 keeps 10 of"):
        perplexity(engine, list(range(100)), SEQ_LEN, max_tokens=10)


def test_seq_len_longer_than_context(model_dir: Path, token_ids: list[int]) -> None:
    with pytest.raises(QServeError, match="max_model_len"):
        perplexity(make_engine(model_dir), token_ids, 1024)


def test_too_few_free_blocks(model_dir: Path, token_ids: list[int]) -> None:
    engine = make_engine(model_dir)
    kv = engine.scheduler.kv_cache_manager
    free = kv.block_pool.get_num_free_blocks()
    hog = Request("hog", [0] * (free - 2) * kv.block_size, SamplingParams())
    assert kv.allocate_slots(hog, hog.num_tokens) is not None  # 2 blocks left; a window needs 4
    with pytest.raises(QServeError, match="too few for one window"):
        perplexity(engine, token_ids, SEQ_LEN)
    assert kv.block_pool.get_num_free_blocks() == 2


def test_data_files(tmp_path: Path) -> None:
    with pytest.raises(QServeError, match="does not exist"):
        load_eval_text(tmp_path / "missing.txt")
    with pytest.raises(QServeError, match="no .txt files"):
        load_eval_text(tmp_path)
    (tmp_path / "b.txt").write_text("second")
    (tmp_path / "a.txt").write_text("first")
    assert load_eval_text(tmp_path) == "first\nsecond"
    assert load_eval_text(tmp_path / "a.txt") == "first"
    assert load_eval_text("moby-dick-eval").startswith("CHAPTER 1. Loomings.")


def test_cli_json(model_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "text.txt"
    data.write_text(moby_dick(1, 1))
    args = ["eval", str(model_dir), "--data", str(data), "--seq-len", "64", "--max-tokens", "300"]
    args += ["--dtype", "float32", "--kv-cache-memory", "4MiB", "--num-threads", "1", "--json"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert (out["num_windows"], out["num_tokens"]) == (4, 4 * 63)
    assert out["perplexity"] > 1 and out["kv_cache_dtype"] == "auto"
    assert set(EvalResult.__dataclass_fields__) <= set(out)


def test_cli_bad_input(model_dir: Path, tmp_path: Path) -> None:
    short = tmp_path / "short.txt"
    short.write_text("Call me Ishmael.")
    for data in (str(tmp_path / "missing.txt"), str(short)):
        args = ["eval", str(model_dir), "--data", data, "--seq-len", "64"]
        result = CliRunner().invoke(cli, [*args, "--kv-cache-memory", "4MiB"])
        assert result.exit_code == 2
        assert result.stderr.strip().startswith("error: ") and "\n" not in result.stderr.strip()
