"""Perplexity through the engine's own model and paged KV cache.

The tokens are cut into non-overlapping windows of `seq_len` (a last partial window is dropped),
so every model and method is scored on exactly the same tokens. Each window runs as one flat
one-sequence batch built by the engine's `ModelRunner.prepare_inputs`, over blocks that the
engine's KV cache manager hands to a throwaway request and takes back afterwards: K/V are written
into (and read from) the engine's pages, so `--kv-cache-dtype fp8_e4m3` pages are what is
measured. Within a window, position t predicts token t + 1: `seq_len - 1` scored tokens each.

    perplexity = exp( sum over windows and t of -log p(x[t+1] | x[..t]) / num_tokens )
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from qserve.data import EVAL_CHAPTERS, moby_dick
from qserve.errors import QServeError, read_user_text

if TYPE_CHECKING:
    from qserve.engine.llm_engine import LLMEngine

BUILTIN_EVAL_DATA = "moby-dick-eval"  # Moby-Dick chapters 1-10, bundled in qserve/data
LOGITS_CHUNK = 128  # rows of [chunk, vocab] fp32 logits at a time, to bound memory


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
) -> EvalResult:
    """Perplexity of `engine`'s model over `token_ids` in non-overlapping `seq_len` windows.

    Call it while no `engine.step()` runs concurrently; other requests may hold blocks."""
    chunks = windows(token_ids, seq_len, max_tokens)
    _check_fits(engine, seq_len)
    start = time.monotonic()
    nll, count = 0.0, 0
    for window in chunks:
        window_nll, window_count = window_nll_sum(engine, window)
        nll, count = nll + window_nll, count + window_count
    return EvalResult(math.exp(nll / count), count, len(chunks), time.monotonic() - start)


def _check_fits(engine: LLMEngine, seq_len: int) -> None:
    if seq_len > engine.max_model_len:
        raise QServeError(
            f"seq_len {seq_len} is longer than max_model_len {engine.max_model_len} (the "
            "model's context, capped by the KV cache memory)",
            param="seq_len",
        )


@torch.inference_mode()
def window_nll_sum(engine: LLMEngine, window: list[int]) -> tuple[float, int]:
    """(sum of -log p(next token), number of scored tokens) for one window from position 0."""
    _check_ids(window, engine.model_config.vocab_size)
    request, block_ids = _allocate(engine, window)
    try:
        hidden = _forward(engine, request, block_ids)  # [seq_len, hidden]
    finally:
        engine.scheduler.kv_cache_manager.forget(request)
    targets = torch.tensor(window[1:], dtype=torch.int64, device=hidden.device)
    return _nll_sum(engine.model_runner.model, hidden[:-1], targets), len(window) - 1


def _check_ids(window: list[int], vocab: int) -> None:
    if min(window) < 0 or max(window) >= vocab:
        raise QServeError(f"token ids must be in [0, {vocab})", param="data")


def _allocate(engine: LLMEngine, window: list[int]) -> tuple[Any, list[int]]:
    """A throwaway request holding blocks for the whole window (freed by the caller)."""
    from qserve.engine.request import Request
    from qserve.engine.sampling_params import SamplingParams

    kv = engine.scheduler.kv_cache_manager
    request = Request(f"eval-{time.monotonic_ns()}", window, SamplingParams(max_tokens=1))
    if kv.allocate_slots(request, len(window)) is None:
        kv.forget(request)
        raise QServeError(
            f"the KV cache has {kv.block_pool.get_num_free_blocks()} free blocks of "
            f"{kv.block_size} tokens, too few for one window of {len(window)} tokens; "
            "raise --kv-cache-memory or lower --seq-len"
        )
    return request, kv.get_block_ids(request.request_id)


def _forward(engine: LLMEngine, request: Any, block_ids: list[int]) -> torch.Tensor:
    """The model over the whole window as one prefill of a one-sequence flat batch."""
    from qserve.engine.scheduler import ScheduledRequest

    runner = engine.model_runner
    scheduled = ScheduledRequest(request, 0, request.num_tokens, block_ids)
    batch = runner.prepare_inputs([scheduled])
    return runner.model(batch.input_ids, batch.positions, runner.kv_caches, batch.attn_metadata)


def _nll_sum(model: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> float:
    """sum of -log_softmax(logits)[target] in fp32, LOGITS_CHUNK rows of logits at a time."""
    total = torch.zeros((), dtype=torch.float64)
    for a in range(0, hidden.shape[0], LOGITS_CHUNK):
        logits = model.compute_logits(hidden[a : a + LOGITS_CHUNK]).float()  # [chunk, vocab]
        nll = torch.nn.functional.cross_entropy(
            logits, targets[a : a + LOGITS_CHUNK], reduction="sum"
        )
        total += nll.double().cpu()
    return float(total)


def evaluate_text(
    engine: LLMEngine, text: str, seq_len: int = 512, max_tokens: int | None = None
) -> EvalResult:
    """Tokenize `text` with the engine's tokenizer and score it (see `perplexity`)."""
    return perplexity(engine, engine.tokenize(text), seq_len, max_tokens)
