"""The measured side of `--max-kl`: the mean KL(p_float || p_quantized) per token of the
next-token distributions on held-out text, per window.

Both models run in qserve's own model code in fp32 (the quantized one on its kernels, as it
serves), one window at a time as a single prefill over a private paged KV cache; the engine is
not used because it returns only the sampled tokens' logprobs, not whole distributions. Each
window starts as the tokenizer starts a text (`prefix`) and every position that predicts a token
of the window counts:

    KL_w = sum over positions t < T - 1 of sum_v p(v | x[..t]) (log p - log q) / (T - 1)

per window w (the verification holds a budget to a bound over the windows' KLs).

Logits are turned into log-probabilities LOGITS_CHUNK rows at a time, so the peak is two
[chunk, vocab] fp32 blocks, not two [window, vocab] ones. Both models are in memory together.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from qserve.model.config import ModelConfig

__all__ = ["heldout_kl", "window_hidden"]

BLOCK_SIZE = 16
LOGITS_CHUNK = 128


@torch.inference_mode()
def heldout_kl(
    float_folder: Path,
    quant_folder: Path,
    ids: Sequence[int],
    window: int,
    max_tokens: int,
    prefix: Sequence[int] = (),
) -> list[float]:
    """The mean KL per position of the quantized checkpoint against the float model in each
    window of `window` tokens (prefix included) over the text `ids`: every window counts as many
    positions, so the text's mean KL is the mean of these."""
    from qserve.eval import windows  # the application's modules, imported when run
    from qserve.model.loader import load_model

    models = [load_model(folder, torch.float32) for folder in (float_folder, quant_folder)]
    try:
        kls = []
        for chunk in windows(list(ids), window - len(prefix), max_tokens):
            tokens = [*prefix, *chunk]
            (p_model, _), (q_model, _) = models
            p_hidden, q_hidden = (window_hidden(m, c, tokens) for m, c in models)
            total = 0.0
            for start in range(0, len(tokens) - 1, LOGITS_CHUNK):
                rows = slice(start, min(start + LOGITS_CHUNK, len(tokens) - 1))
                log_p = torch.log_softmax(p_model.compute_logits(p_hidden[rows]), dim=-1)
                log_q = torch.log_softmax(q_model.compute_logits(q_hidden[rows]), dim=-1)
                total += float((log_p.exp() * (log_p - log_q)).sum())
            kls.append(total / (len(tokens) - 1))
        return kls
    finally:
        del models
        gc.collect()


def window_hidden(model: nn.Module, config: ModelConfig, tokens: Sequence[int]) -> Tensor:
    """Final hidden states [T, hidden] of one sequence run as a single prefill."""
    from qserve.model.attention import AttentionMetadata, make_kv_cache

    T = len(tokens)
    num_blocks = -(-T // BLOCK_SIZE)
    caches = [
        make_kv_cache(
            num_blocks, BLOCK_SIZE, config.num_key_value_heads, config.head_dim, torch.float32
        )
        for _ in range(config.num_hidden_layers)
    ]
    metadata = AttentionMetadata(
        slot_mapping=torch.arange(T, dtype=torch.int64),
        block_tables=torch.arange(num_blocks, dtype=torch.int32)[None],
        seq_lens=torch.tensor([T], dtype=torch.int32),
        query_start_loc=torch.tensor([0, T], dtype=torch.int32),
        seq_lens_cpu=[T],
        query_lens_cpu=[T],
        prompt_lens_cpu=[T],
    )
    return model(torch.tensor(list(tokens)), torch.arange(T), caches, metadata)
