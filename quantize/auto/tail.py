"""The partial forwards of the measurement pass (`measure.py`): the float model from block b on
with some linears' weights swapped for quantized ones, and the KL of its final logits against the
float model's."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["Swap", "Tail", "block_forward", "logits", "swapped"]

Swap = list[tuple[nn.Linear, Tensor]]  # (linear, the weight it takes at the reference scheme)


class Tail:
    """The float model from block b on, and the KL of its final logits against the float
    model's (from its final hidden states `final`). Per window and token, with z the logits,
    KL(p || q) = sum p log p + LSE(z) sum p - sum p z: the first and the mass sum p are the
    float model's, kept per token in float64, so a KL costs the head's matmul, a logsumexp and
    a dot per token (no [T, vocab] log-probabilities written): 2.3x less than log_softmax and
    the sum of p (log p - log q) in fp32, and closer to that sum in float64 (on random logits
    over SmolLM2's vocabulary: 1e-4 off, the fp32 terms summed 2e-3)."""

    def __init__(
        self, model: nn.Module, blocks: nn.ModuleList, kwargs: list[dict], final: list[Tensor]
    ) -> None:
        self.model, self.blocks, self.kwargs = model, blocks, kwargs
        self.p, self.constant, self.mass = [], [], []
        for h in final:
            log_p = torch.log_softmax(logits(model, h), dim=-1)
            p = log_p.exp()
            self.p.append(p)
            self.constant.append(float(torch.linalg.vecdot(p, log_p).double().sum()))
            self.mass.append(p.sum(-1).double())

    def kl_sums(self, b: int, X: list[Tensor], swap: Swap) -> list[float]:
        """Per window of X (block b's inputs of the first len(X) KL windows), its KL summed over
        its tokens, with the swapped weights in place."""
        with swapped(swap):
            hidden = block_forward(self.blocks[b], X, self.kwargs[b])
        for c in range(b + 1, len(self.blocks)):
            hidden = block_forward(self.blocks[c], hidden, self.kwargs[c])
        sums = []
        for i, h in enumerate(hidden):
            z = logits(self.model, h)
            lse = torch.logsumexp(z, dim=-1).double()
            pz = torch.linalg.vecdot(self.p[i], z).double()
            sums.append(self.constant[i] + float((lse * self.mass[i] - pz).sum()))
        return sums

    def tokens(self, windows: int) -> int:
        """Tokens of the first `windows` KL windows."""
        return sum(p.shape[0] for p in self.p[:windows])

    def kl_with(self, b: int, X: list[Tensor], swap: Swap) -> float:
        """Mean KL per token with the swapped weights in place, from block b's inputs X."""
        return sum(self.kl_sums(b, X, swap)) / self.tokens(len(X))

    def all_at_once(self, X: list[Tensor], swaps: list[Swap]) -> float:
        with swapped([pair for swap in swaps for pair in swap]):
            return self.kl_with(0, X, [])


def block_forward(block: nn.Module, X: list[Tensor], kwargs: dict[str, Any]) -> list[Tensor]:
    """block(x) for each x of X ([1, T, hidden] each), as one batch where their lengths agree
    (the kwargs' position embeddings and masks, batch 1, broadcast): larger matmuls, about 10%
    less block time on SmolLM2-135M (timed alone, 2-core AVX2 EPYC)."""
    if len({x.shape for x in X}) != 1:
        return [block(x, **kwargs) for x in X]
    return list(block(torch.cat(X), **kwargs).split(1))


def logits(model: nn.Module, hidden: Tensor) -> Tensor:
    """[T, vocab] fp32 logits of the final hidden states [1, T, hidden] (soft-capped where the
    model caps them)."""
    h = model.get_decoder().norm(hidden)
    z = model.get_output_embeddings()(h)[0].float()
    cap = getattr(model.config, "final_logit_softcapping", None)
    return torch.tanh(z / cap) * cap if cap else z


class swapped:
    """Inside, each linear holds its swapped weight; its own weight is back after."""

    def __init__(self, swap: Swap) -> None:
        self.swap = swap
        self.saved: list[Tensor] = []

    def __enter__(self) -> None:
        self.saved = [m.weight.data for m, _ in self.swap]
        for m, w in self.swap:
            m.weight.data = w

    def __exit__(self, *exc: object) -> None:
        for (m, _), w in zip(self.swap, self.saved):
            m.weight.data = w
