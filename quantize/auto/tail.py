"""The partial forwards of the measurement pass (`measure.py`): the float model from block b on
with some linears' weights swapped for quantized ones, and the KL of its final logits against the
float model's."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["HEAD_MASS", "Head", "Swap", "Tail", "block_forward", "logits", "swapped"]

Swap = list[tuple[nn.Linear, Tensor]]  # (linear, the weight it takes at the reference scheme)


# the KL is taken over the tokens that hold this much of p's mass at some position of a window
# (`Head`): on Gemma-3-270M's 262144-token vocabulary 51k-62k tokens per 512-token window, and a
# unit's KL 0.10% to 0.26% below the whole vocabulary's (10 unit/scheme pairs of 5 kinds, W4
# g128 and W3 g64, RTN; at 0.999: 113k-124k tokens, 0.01% to 0.03%), alike for every scheme of a
# unit. Over the 72 units of a whole measurement (version 9 against 8), a median 1.0% below, the
# least KLs (o_proj, 2e-4 to 4e-4 nats) 5% to 9% below; the allocation at W4 g64's size was the
# same, unit for unit
HEAD_MASS = 0.99
SORT_ROWS = 64  # positions whose next-token distributions `Head.of` sorts at a time


class Tail:
    """The float model from block b on, and the KL of its final logits against the float
    model's (from its final hidden states `final`). With a = z_q - z_p the change of each
    token's logit, KL(p || q) = log E_p[exp(a - E_p[a])] exactly; it is taken over each
    window's `Head` (the tokens holding `mass` of p at some position), the rest of the
    vocabulary taken to move with the head's mean: per token log1p(sum_head p expm1(a - abar)),
    abar the head's p-weighted mean of a. So a KL costs the head's rows of the output matmul
    and a few [T, head] elementwise ops, summed per token in float64."""

    def __init__(
        self,
        model: nn.Module,
        blocks: nn.ModuleList,
        kwargs: list[dict],
        final: list[Tensor],
        mass: float = HEAD_MASS,
    ) -> None:
        self.model, self.blocks, self.kwargs = model, blocks, kwargs
        self.heads = [Head.of(model, h, mass) for h in final]

    def kl_sums(self, b: int, X: list[Tensor], swap: Swap) -> list[float]:
        """Per window of X (block b's inputs of the first len(X) KL windows), its KL summed over
        its tokens, with the swapped weights in place."""
        with swapped(swap):
            hidden = block_forward(self.blocks[b], X, self.kwargs[b])
        for c in range(b + 1, len(self.blocks)):
            hidden = block_forward(self.blocks[c], hidden, self.kwargs[c])
        return [head.kl_sum(self.model, h) for head, h in zip(self.heads, hidden)]

    def tokens(self, windows: int) -> int:
        """Tokens of the first `windows` KL windows."""
        return sum(head.p.shape[0] for head in self.heads[:windows])

    def kl_with(self, b: int, X: list[Tensor], swap: Swap) -> float:
        """Mean KL per token with the swapped weights in place, from block b's inputs X."""
        return sum(self.kl_sums(b, X, swap)) / self.tokens(len(X))

    def all_at_once(self, X: list[Tensor], swaps: list[Swap]) -> float:
        with swapped([pair for swap in swaps for pair in swap]):
            return self.kl_with(0, X, [])


@dataclasses.dataclass
class Head:
    """One window's head of the vocabulary: the tokens that hold `mass` of the float model's
    next-token distribution p at some position, their rows of the output embedding, and p and
    the float logits z there ([T, tokens])."""

    tokens: Tensor
    weight: Tensor
    bias: Tensor | None
    p: Tensor
    z: Tensor

    @classmethod
    def of(cls, model: nn.Module, hidden: Tensor, mass: float) -> Head:
        z = logits(model, hidden)
        p = torch.softmax(z, dim=-1)
        keep = torch.zeros(p.shape[-1], dtype=torch.bool)
        for rows in p.split(SORT_ROWS):  # a sort of [T, vocab] at once: ~1.6 GB on Gemma
            ranked, order = rows.sort(dim=-1, descending=True)
            k = (ranked.cumsum(-1) < mass).sum(-1) + 1  # per position, the tokens reaching mass
            keep[order[torch.arange(order.shape[1]) < k[:, None]]] = True
        tokens = keep.nonzero()[:, 0]
        out = model.get_output_embeddings()
        bias = None if out.bias is None else out.bias.detach()[tokens]
        return cls(tokens, out.weight.detach()[tokens], bias, p[:, tokens], z[:, tokens])

    def kl_sum(self, model: nn.Module, hidden: Tensor) -> float:
        """The KL of the final hidden states `hidden` [1, T, hidden]'s logits, summed over the
        window's tokens."""
        z = nn.functional.linear(_final_norm(model, hidden)[0], self.weight, self.bias)
        a = _capped(model, z.float()) - self.z
        mean = (self.p * a).sum(-1, keepdim=True) / self.p.sum(-1, keepdim=True)
        kl = torch.log1p((self.p * torch.expm1(a - mean)).sum(-1))
        return float(kl.double().sum())


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
    h = _final_norm(model, hidden)
    return _capped(model, model.get_output_embeddings()(h)[0].float())


def _final_norm(model: nn.Module, hidden: Tensor) -> Tensor:
    return model.get_decoder().norm(hidden)


def _capped(model: nn.Module, z: Tensor) -> Tensor:
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
