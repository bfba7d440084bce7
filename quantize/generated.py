"""Calibration text the float model writes itself (`--calib generated`, issue 27).

Calibrated on one book, GPTQ fits that book's activations and loses most of its gain over RTN
on text unlike it. A broad corpus would help but cannot be bundled; the model's own samples are
as broad as what it learned (LLM-QAT's data-free calibration, Liu et al. 2023): each sequence
starts from a random token and is sampled at temperature 1 through qserve's engine. `generated`
calibrates on those sequences for half the windows and on the default text (Moby-Dick
chapters 11+) for the other half, interleaved. Sequence i is seeded SEED + i, so the cache
(by model files, length and seed) serves any count: a smaller one reads the first rows, a larger
one samples only the rows past them. `--method auto`'s measurement pass (its Hessian windows and
a few more) and its quantization (the Hessian windows) sample once between them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch
from torch import Tensor

from qserve.model.resolve import model_files_stamp

__all__ = ["GENERATED", "generated_ids", "generated_cache_dir", "mixed_with_generated"]

logger = logging.getLogger("qserve")
GENERATED = "generated"
START_TOKENS = 10_000  # first tokens are drawn from the lowest ids (a BPE's most common merges)
SEED = 0
VERSION = 2  # 2: one cache file per model and length, any count


def generated_cache_dir() -> Path:
    from qserve.model.builtin import cache_dir

    return cache_dir() / "calibration"


def _key(model_path: Path, seq_len: int, prefix: list[int]) -> str:
    what = [VERSION, model_files_stamp(model_path), seq_len, SEED, START_TOKENS]
    what += [prefix] if prefix else []  # the keys of models without one predate it
    return hashlib.sha256(json.dumps(what).encode()).hexdigest()[:16]


def generated_ids(
    model_path: Path, num_samples: int, seq_len: int, cache_dir: Path | None = None
) -> Tensor:
    """[num_samples, seq_len] token ids sampled from the model at `model_path` (float, through
    the engine), from `cache_dir` when there (None: `generated_cache_dir()`). Each sequence
    starts as the tokenizer starts a text (Gemma's <bos>), then a random token."""
    from transformers import AutoTokenizer

    from qserve.quantize.calibration import text_prefix  # (calibration imports this module)

    cache_dir = generated_cache_dir() if cache_dir is None else cache_dir
    prefix = text_prefix(AutoTokenizer.from_pretrained(model_path))
    path = cache_dir / f"{_key(model_path, seq_len, prefix)}.pt"
    cached = torch.load(path) if path.is_file() else torch.empty(0, seq_len, dtype=torch.long)
    if len(cached) >= num_samples:
        return cached[:num_samples]
    ids = torch.cat([cached, _sample(model_path, len(cached), num_samples, seq_len, prefix)])
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    torch.save(ids, tmp)
    tmp.replace(path)  # atomic; two runs extending it at once write the same first rows
    return ids


def _sample(model_path: Path, first: int, stop: int, seq_len: int, prefix: list[int]) -> Tensor:
    """Sequences first..stop-1: sequence i starts from the i-th start token drawn from SEED and
    samples with seed SEED + i, whichever others are sampled beside it."""
    import gc
    import time

    from qserve.engine.llm import LLM
    from qserve.engine.sampling_params import SamplingParams

    logger.info(
        "calibration: sampling %d sequences of %d tokens from the model (--calib generated; "
        "cached in %s)", stop - first, seq_len, generated_cache_dir(),
    )  # fmt: skip
    start = time.monotonic()
    level = logger.level
    logger.setLevel(logging.WARNING)  # not the sampling engine's start-up report
    try:
        llm = LLM(str(model_path), dtype="float32", max_model_len=seq_len)
    finally:
        logger.setLevel(level)
    try:
        special = set(llm.get_tokenizer().all_special_ids)
        vocab = min(START_TOKENS, llm.engine.model_config.vocab_size)
        candidates = torch.tensor([i for i in range(vocab) if i not in special])
        g = torch.Generator().manual_seed(SEED)
        draws = torch.randint(len(candidates), (stop,), generator=g)  # the same first draws
        starts = candidates[draws[first:]].tolist()  # for any stop
        new_tokens = seq_len - 1 - len(prefix)
        params = [
            SamplingParams(temperature=1.0, max_tokens=new_tokens, ignore_eos=True, seed=SEED + i)
            for i in range(first, stop)
        ]
        prompts = [[*prefix, s] for s in starts]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        logger.info("calibration: sampled in %.0f s", time.monotonic() - start)
        return torch.tensor([[*p, *o.outputs[0].token_ids] for p, o in zip(prompts, outputs)])
    finally:
        del llm
        gc.collect()


def mixed_with_generated(generated: Tensor, text_windows: Tensor) -> Tensor:
    """Generated and text windows alternating, generated first: [n_gen + n_text, seq_len]."""
    rows = []
    for i in range(max(len(generated), len(text_windows))):
        rows += [t[i] for t in (generated, text_windows) if i < len(t)]
    return torch.stack(rows)
