"""Perplexity through the engine: each window is a request asking for its prompt logprobs.

The tokens are cut into non-overlapping windows (a last partial window is dropped), so every
model and method is scored on exactly the same tokens. A window starts the way the tokenizer
starts a text (`prefix`: Gemma's <bos>; nothing for SmolLM2), and holds `seq_len - len(prefix)`
text tokens. The windows go through the normal engine path (`LLMEngine.add_request` with
`SamplingParams(prompt_logprobs=0, max_tokens=1)`, then `step()`): the scheduler batches them
under its token budget, chunks long ones, preempts when the KV cache is short, and the model
runner scores each chunk's positions as it runs them. K/V are written into (and read from) the
engine's pages, so `--kv-cache-dtype fp8_e4m3` pages are what is measured. Every text token of
a window is scored except, without a prefix, its first:

    perplexity = exp( sum over windows and scored tokens of -log p(x[t] | x[..t-1]) / num_tokens )
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qserve.data import EVAL_CHAPTERS, moby_dick
from qserve.engine.sampling_params import RequestOutputKind, SamplingParams
from qserve.errors import QServeError, read_user_text
from qserve.quantize.calibration import text_prefix

if TYPE_CHECKING:
    from qserve.engine.llm_engine import LLMEngine
    from qserve.engine.sampler import Logprobs

BUILTIN_EVAL_DATA = "moby-dick-eval"  # Moby-Dick chapters 1-10, bundled in qserve/data


@dataclass(frozen=True)
class EvalResult:
    perplexity: float
    num_tokens: int  # tokens scored: num_windows * (seq_len - 1)
    num_windows: int
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ------------------------------------------------------------------------------------ data


def load_eval_text(data: str | Path) -> str:
    """Text of a .txt file, of a folder of .txt files (joined in name order), or of the
    built-in `moby-dick-eval` (Moby-Dick chapters 1-10)."""
    if str(data) == BUILTIN_EVAL_DATA:
        return _builtin_text()
    path = Path(data)
    if path.is_dir():
        return _folder_text(path)
    if not path.is_file():
        raise QServeError(f"eval data {path} does not exist", param="data")
    if path.suffix != ".txt":
        raise QServeError(f"eval data must be a .txt file or a folder, got {path.name}", "data")
    return read_user_text(path, "eval data", "data")


def _builtin_text() -> str:
    return "\n".join(moby_dick(EVAL_CHAPTERS[0], EVAL_CHAPTERS[-1]))


def _folder_text(folder: Path) -> str:
    files = sorted(folder.glob("*.txt"))
    if not files:
        raise QServeError(f"eval data folder {folder} has no .txt files", param="data")
    return "\n".join(read_user_text(f, "eval data", "data") for f in files)


def windows(token_ids: list[int], seq_len: int, max_tokens: int | None = None) -> list[list[int]]:
    """Non-overlapping windows of `seq_len` over the first `max_tokens` tokens; a last partial
    window is dropped. Raises QServeError when not even one window fits."""
    if seq_len < 2:
        raise QServeError(f"seq_len must be >= 2, got {seq_len}", param="seq_len")
    if max_tokens is not None and max_tokens < 1:
        raise QServeError(f"max_tokens must be >= 1, got {max_tokens}", param="max_tokens")
    ids = token_ids[:max_tokens] if max_tokens is not None else token_ids
    n = len(ids) // seq_len
    if n == 0:
        what = f"the eval data has {len(token_ids)} tokens"
        if len(ids) < len(token_ids):
            what = f"--max-tokens {max_tokens} keeps {len(ids)} of the eval data's tokens"
        raise QServeError(f"{what}, fewer than one window of seq_len {seq_len}", param="data")
    return [ids[i * seq_len : (i + 1) * seq_len] for i in range(n)]


# ------------------------------------------------------------------------------ perplexity


def perplexity(
    engine: LLMEngine,
    token_ids: list[int],
    seq_len: int = 512,
    max_tokens: int | None = None,
    prefix: Sequence[int] = (),
) -> EvalResult:
    """Perplexity of `engine`'s model over `token_ids` in non-overlapping windows of `seq_len`
    tokens, each `prefix` + text tokens. Runs `engine.step()` until its windows are done
    (requests already in the engine run along)."""
    start = time.monotonic()
    nlls, per_window = window_nlls(engine, token_ids, seq_len, max_tokens, prefix)
    count = per_window * len(nlls)
    return EvalResult(math.exp(sum(nlls) / count), count, len(nlls), time.monotonic() - start)


def window_nlls(
    engine: LLMEngine,
    token_ids: list[int],
    seq_len: int = 512,
    max_tokens: int | None = None,
    prefix: Sequence[int] = (),
) -> tuple[list[float], int]:
    """(the summed negative log-likelihood of each window's scored tokens, tokens scored per
    window) over the windows `perplexity` scores: what a paired comparison of two models on
    the same windows needs."""
    chunks = windows(token_ids, seq_len - len(prefix), max_tokens)
    _check_fits(engine, seq_len)
    outputs = score_prompts(engine, [[*prefix, *chunk] for chunk in chunks])
    first = max(len(prefix), 1)  # the first scored position
    nlls = [-sum(e.logprob for e in out[first:]) for out in outputs]  # type: ignore[union-attr]
    return nlls, len(outputs[0]) - first


def _check_fits(engine: LLMEngine, seq_len: int) -> None:
    if seq_len > engine.max_model_len:
        raise QServeError(
            f"seq_len {seq_len} is longer than max_model_len {engine.max_model_len} (the "
            "model's context, capped by the KV cache memory)",
            param="seq_len",
        )


def score_prompts(engine: LLMEngine, prompts: list[list[int]]) -> list[list[Logprobs | None]]:
    """The prompt logprobs of each prompt (the first entry None), through the engine."""
    for prompt in prompts:
        _check_ids(prompt, engine.model_config.vocab_size)
    params = SamplingParams(
        max_tokens=1, temperature=0, prompt_logprobs=0, output_kind=RequestOutputKind.FINAL_ONLY
    )
    tag = f"eval-{time.monotonic_ns()}"
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    try:
        done = _run(engine, set(ids))
    finally:
        engine.abort_request(ids)
    return [done[i] for i in ids]


def _run(engine: LLMEngine, waiting_for: set[str]) -> dict[str, list[Logprobs | None]]:
    """Step the engine until the `waiting_for` requests are done; their prompt logprobs."""
    done: dict[str, list[Logprobs | None]] = {}
    while len(done) < len(waiting_for):
        outputs = engine.step()
        if not outputs and not engine.scheduler.running:
            kv = engine.scheduler.kv_cache_manager
            raise QServeError(
                f"the KV cache has {kv.block_pool.get_num_free_blocks()} free blocks of "
                f"{kv.block_size} tokens, too few for one window; raise --kv-cache-memory or "
                "lower --seq-len"
            )
        for output in outputs:
            if output.request_id in waiting_for and output.finished:
                assert output.prompt_logprobs is not None
                done[output.request_id] = output.prompt_logprobs
    return done


def _check_ids(window: list[int], vocab: int) -> None:
    if min(window) < 0 or max(window) >= vocab:
        raise QServeError(f"token ids must be in [0, {vocab})", param="data")


def evaluate_text(
    engine: LLMEngine, text: str, seq_len: int = 512, max_tokens: int | None = None
) -> EvalResult:
    """Tokenize `text` with the engine's tokenizer and score it (see `perplexity`); each window
    starts with what the tokenizer puts before a text (its <bos>, if it adds one)."""
    prefix = text_prefix(engine.tokenizer)
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    return perplexity(engine, ids, seq_len, max_tokens, prefix)
