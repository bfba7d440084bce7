"""Activation capture with forward hooks: the hidden states entering block 0, and the inputs of a
block's linears folded into accumulators (Hessians, absmax, ...) without keeping them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

__all__ = ["StopForward", "capture_block_inputs", "collect_inputs"]


class StopForward(Exception):
    """Raised by a hook to end a forward pass once it has what it needs."""


def capture_block_inputs(
    model: nn.Module, block0: nn.Module, input_ids: Tensor
) -> tuple[list[Tensor], dict[str, Any]]:
    """Hidden states entering block 0, one [1, T, hidden] per sample, and the block's kwargs
    (position embeddings, mask), which are the same for every sample of one length."""
    X: list[Tensor] = []
    kwargs: dict[str, Any] = {}

    def pre_hook(module: nn.Module, args: tuple[Any, ...], kw: dict[str, Any]) -> None:
        X.append((args[0] if args else kw["hidden_states"]).detach())
        kwargs.update({k: v for k, v in kw.items() if k != "hidden_states"})
        raise StopForward

    handle = block0.register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        for ids in input_ids:
            try:
                model(input_ids=ids[None], use_cache=False)
            except StopForward:
                pass
    finally:
        handle.remove()
    for k in ("cache", "past_key_values", "past_key_value"):
        kwargs.pop(k, None)
    kwargs["use_cache"] = False
    return X, kwargs


# ------------------------------------------------------------------------------------- export


def collect_inputs(
    block: nn.Module,
    linears: dict[str, nn.Module],
    X: list[Tensor],
    kwargs: dict[str, Any],
    step: Callable[[Any, Tensor], Any] | None,
    start: dict[str, Any] | None = None,
    named_step: Callable[[str, Any, Tensor], Any] | None = None,
) -> dict[str, Any]:
    """Run X through `block`, folding each linear's inputs into an accumulator with `step`
    (or `named_step`, which is also given the linear's name), starting from `start`.

    The forward of a sample stops as soon as every hooked linear has seen its input (the rest
    of the block is not needed): pre-hooks, so a linear's own matmul is skipped too.
    """
    acc: dict[str, Any] = dict(start) if start is not None else dict.fromkeys(linears)
    seen: set[str] = set()
    fold = named_step if named_step is not None else (lambda _, a, v: step(a, v))

    def hook(name: str) -> Callable[..., None]:
        def fn(module: nn.Module, args: tuple[Tensor, ...]) -> None:
            acc[name] = fold(name, acc[name], args[0].detach())
            seen.add(name)
            if len(seen) == len(linears):
                raise StopForward

        return fn

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in linears.items()]
    try:
        for x in X:
            seen.clear()
            try:
                block(x, **kwargs)
            except StopForward:
                pass
    finally:
        for h in handles:
            h.remove()
    return acc
