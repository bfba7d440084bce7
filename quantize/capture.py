"""Activation capture with forward hooks: the hidden states entering block 0, and the inputs of a
block's linears folded into accumulators (Hessians, absmax, ...) without keeping them."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from torch import Tensor, nn

__all__ = ["StopForward", "capture_block_inputs", "collect_inputs"]


class StopForward(Exception):
    """Raised by a hook to end a forward pass once it has what it needs."""


def capture_block_inputs(
    model: nn.Module, blocks: nn.ModuleList, input_ids: Tensor
) -> tuple[list[Tensor], list[dict[str, Any]]]:
    """Hidden states entering block 0, one [1, T, hidden] per sample, and each block's kwargs
    (position embeddings, mask: the same for every sample of one length, but they differ
    between layer kinds, e.g. Gemma 3's local and global layers).

    Each block's forward is swapped for one that records its call and returns its input, so a
    pass costs the embeddings only, and blocks still on the meta device are never touched."""
    X: list[Tensor] = []
    kwargs: list[dict[str, Any]] = [{} for _ in blocks]

    def recorder(b: int) -> Callable[..., Tensor]:
        def forward(*args: Any, **kw: Any) -> Tensor:
            hidden = args[0] if args else kw["hidden_states"]
            if b == 0:
                X.append(hidden.detach())
            kwargs[b] = {k: v for k, v in kw.items() if k != "hidden_states"}
            if b == len(blocks) - 1:
                raise StopForward
            return hidden

        return forward

    with _forwards_replaced(blocks, recorder):
        for ids in input_ids:
            try:
                model(input_ids=ids[None], use_cache=False)
            except StopForward:
                pass
    return X, [_without_cache(kw) for kw in kwargs]


@contextlib.contextmanager
def _forwards_replaced(
    blocks: nn.ModuleList, make: Callable[[int], Callable[..., Any]]
) -> Iterator[None]:
    """Inside, block b's forward is make(b) (an instance attribute, shadowing the class's)."""
    if any("forward" in vars(block) for block in blocks):
        raise RuntimeError("a decoder block already has its own forward")
    for b, block in enumerate(blocks):
        block.forward = make(b)
    try:
        yield
    finally:
        for block in blocks:
            del block.forward


def _without_cache(kwargs: dict[str, Any]) -> dict[str, Any]:
    kwargs = {
        k: v for k, v in kwargs.items() if k not in ("cache", "past_key_values", "past_key_value")
    }
    kwargs["use_cache"] = False
    return kwargs


# ------------------------------------------------------------------------------------- export


def collect_inputs(
    block: nn.Module,
    linears: dict[str, nn.Module],
    X: list[Tensor],
    kwargs: dict[str, Any],
    step: Callable[[Any, Tensor], Any] | None,
    start: dict[str, Any] | None = None,
    named_step: Callable[[str, Any, Tensor], Any] | None = None,
    outputs: list[Tensor] | None = None,
) -> dict[str, Any]:
    """Run X through `block`, folding each linear's inputs into an accumulator with `step`
    (or `named_step`, which is also given the linear's name), starting from `start`.

    The forward of a sample stops as soon as every hooked linear has seen its input (the rest
    of the block is not needed): pre-hooks, so a linear's own matmul is skipped too. With
    `outputs`, each forward runs to the end instead and the block's output is appended to it.
    """
    acc: dict[str, Any] = dict(start) if start is not None else dict.fromkeys(linears)
    seen: set[str] = set()
    fold = named_step if named_step is not None else (lambda _, a, v: step(a, v))

    def hook(name: str) -> Callable[..., None]:
        def fn(module: nn.Module, args: tuple[Tensor, ...]) -> None:
            acc[name] = fold(name, acc[name], args[0].detach())
            seen.add(name)
            if outputs is None and len(seen) == len(linears):
                raise StopForward

        return fn

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in linears.items()]
    try:
        for x in X:
            seen.clear()
            try:
                out = block(x, **kwargs)
            except StopForward:
                continue
            if outputs is not None:
                outputs.append(out)
    finally:
        for h in handles:
            h.remove()
    return acc
