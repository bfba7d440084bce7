"""The verification of `--method auto`: the quantized checkpoint against the float model on the
held-out text (`qserve.data.heldout_text`), per window, through the engine in fp32.

Per window w of the first VERIFY_TOKENS tokens, d_w = mean NLL per token of the checkpoint less
the float model's (the float model's computed once per run); the perplexity increase is
exp(mean_w d_w) - 1, and what a budget is held to is exp(U) - 1, U the upper CONFIDENCE bound of
mean_w d_w by Student's t with the windows as samples (`budget.upper_bound`). A --max-kl budget
is held the same way to the bound over the windows' mean KLs (`kl.heldout_kl`). The paired
differences cancel most of the text's own spread of difficulty between windows; what remains is
how unevenly the quantization hurts them, which is what a checkpoint verified on these windows
must also survive on others.
"""

from __future__ import annotations

import math
from pathlib import Path

from qserve.quantize.auto import budget
from qserve.quantize.auto.measure import VERIFY_TOKENS, heldout_tokens

__all__ = ["VERIFY_TOKENS", "HeldOut"]


class HeldOut:
    """The verification on the held-out text through the engine (fp32): per window, the
    quantized checkpoint's mean NLL per token less the float model's (computed once), and the
    budget held to the upper CONFIDENCE bound of their mean (`budget.upper_bound`)."""

    def __init__(self, model_path: Path) -> None:
        self.model_path = model_path
        self._base: tuple[list[float], int] | None = None

    @property
    def _float(self) -> tuple[list[float], int]:
        """The float model's (mean NLL per token of each window, tokens scored per window),
        scored on first use."""
        if self._base is None:
            self._base = _window_nlls(self.model_path)
        return self._base

    @property
    def base_windows(self) -> list[float]:
        return self._float[0]

    @property
    def base(self) -> float:
        """The float model's perplexity on the verified windows."""
        return math.exp(sum(self.base_windows) / len(self.base_windows))

    @property
    def tokens(self) -> int:
        """Tokens scored: every window scores as many."""
        windows, count = self._float
        return len(windows) * count

    def increase(self, folder: Path) -> float:
        """The perplexity increase of the checkpoint at `folder` (its mean, no bound)."""
        return self.measure(folder)["increase"]

    def measure(self, folder: Path, with_kl: bool = False) -> dict[str, float]:
        """{"increase", "increase_bound"}: the perplexity increase and its upper bound; with
        `with_kl` also {"kl", "kl_bound"}: the mean KL per token and its bound."""
        nlls, _ = _window_nlls(folder)
        diffs = [q - b for q, b in zip(nlls, self.base_windows, strict=True)]
        mean, upper = budget.upper_bound(diffs)
        measured = {"increase": math.expm1(mean), "increase_bound": math.expm1(upper)}
        if with_kl:
            measured["kl"], measured["kl_bound"] = budget.upper_bound(
                _heldout_kl(self.model_path, folder)
            )
        return measured


def _heldout_ids(folder: Path) -> tuple[list[int], list[int], int]:
    """(held-out token ids, the tokens a text starts with, window) for the model at `folder`."""
    from qserve.model.config import ModelConfig
    from qserve.model.loader import load_tokenizer

    max_len = ModelConfig.from_pretrained(folder).max_position_embeddings
    return heldout_tokens(load_tokenizer(folder), max_len)


def _window_nlls(folder: Path) -> tuple[list[float], int]:
    """(the mean NLL per token of each held-out window of the model at `folder`, tokens scored
    per window)."""
    import gc

    from qserve.config import EngineConfig
    from qserve.engine.llm_engine import LLMEngine
    from qserve.eval import window_nlls

    ids, prefix, window = _heldout_ids(folder)
    engine = LLMEngine(EngineConfig(str(folder), dtype="float32", kv_cache_memory="64MiB"))
    try:
        window = min(window, engine.max_model_len - 1)  # room for one output token
        nlls, count = window_nlls(engine, ids, window, VERIFY_TOKENS, prefix)
        return [nll / count for nll in nlls], count
    finally:
        del engine
        gc.collect()


def _heldout_kl(model_path: Path, folder: Path) -> list[float]:
    from qserve.quantize.auto.kl import heldout_kl

    ids, prefix, window = _heldout_ids(folder)
    return heldout_kl(model_path, folder, ids, window, VERIFY_TOKENS, prefix)
