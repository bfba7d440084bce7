"""One decoder block being quantized, with its calibration inputs (`BlockContext`), and GPTAQ's
full-precision side of it (`Reference`).

`BlockContext.collect` runs the block's inputs through it and folds the inputs of the named
linears into accumulators; linears of one sequential group share an input, which is collected
once. Once every attention linear is quantized, later passes replay the attention's outputs
instead of recomputing them (`attention_replay`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from torch import Tensor, nn

from qserve.quantize.arch import ArchSpec
from qserve.quantize.capture import collect_inputs
from qserve.quantize.settings import QuantizeSettings, is_ignored

__all__ = ["BlockContext", "Reference", "REPLAY_CACHE_BYTES", "REFERENCE_CACHE_BYTES"]

REPLAY_CACHE_BYTES = 1 << 30  # a block keeps its attention's final outputs up to this


@dataclasses.dataclass
class BlockContext:
    """One decoder block with its calibration inputs X (one [1, T, hidden] per sample)."""

    block: nn.Module
    prefix: str
    spec: ArchSpec
    s: QuantizeSettings
    X: list[Tensor]
    kwargs: dict[str, Any]
    reference: Reference | None = None  # GPTAQ: the full-precision model's side
    finished: set[str] = dataclasses.field(default_factory=set)  # linears quantized so far
    attention_outputs: list[Any] | None = None  # per sample, once every attention linear is

    @property
    def names(self) -> list[str]:
        """The block's linears to quantize (not ignored)."""
        return [n for n in self.spec.linears if not is_ignored(self.prefix + n, self.s.ignore)]

    def finish(self, names: Iterable[str]) -> None:
        """Mark the named linears quantized (their weights are final)."""
        self.finished.update(names)

    def _in_attention(self, name: str) -> bool:
        return name.startswith(self.spec.attention + ".")

    @contextlib.contextmanager
    def attention_replay(self, reads_attention: bool = False) -> Iterator[None]:
        """Passes of X through the block inside reuse the attention's outputs once they are
        final (every linear in it quantized): the first such pass records them, later ones
        return them instead of recomputing projections and attention. `reads_attention`: the
        pass needs the attention itself to run (hooks inside it), so nothing is replayed."""
        attention_linears = [n for n in self.names if self._in_attention(n)]
        final = all(n in self.finished for n in attention_linears)
        fits = sum(x.numel() for x in self.X) * 4 <= REPLAY_CACHE_BYTES
        if reads_attention or not final or not fits:
            yield
            return
        attention = self.block.get_submodule(self.spec.attention)
        if self.attention_outputs is None:
            outputs: list[Any] = []
            handle = attention.register_forward_hook(lambda m, a, out: outputs.append(out))
            try:
                yield
            finally:
                handle.remove()
            self.attention_outputs = outputs if len(outputs) == len(self.X) else None
            return
        replayed = iter(self.attention_outputs)
        own = attention.__dict__.get("forward")  # a forward already patched onto the instance
        attention.forward = lambda *args, **kw: next(replayed)  # instance attribute: shadows
        try:
            yield
        finally:
            if own is None:
                del attention.forward
            else:
                attention.forward = own
        if next(replayed, None) is not None:
            raise RuntimeError(f"{self.prefix}{self.spec.attention}: a pass skipped a sample")

    def linear(self, name: str) -> nn.Linear:
        return self.block.get_submodule(name)

    def _owners(self, names: Iterable[str]) -> dict[str, str]:
        """Each linear -> the first of its sequential group (the group's linears share inputs)."""
        return {n: next(g for g in self.spec.sequential if n in g)[0] for n in names}

    def collect(self, names: Iterable[str], step: Callable[[Any, Tensor], Any]) -> dict[str, Any]:
        """Accumulate the inputs of the named linears over X with `step`. Linears of one
        sequential group read the same input: it is accumulated once, for the first of them."""
        owner = self._owners(names)
        if not owner:
            return {}
        modules = {o: self.linear(o) for o in set(owner.values())}
        with self.attention_replay(any(self._in_attention(o) for o in modules)):
            acc = collect_inputs(self.block, modules, self.X, self.kwargs, step)
        return {n: acc[o] for n, o in owner.items()}

    def collect_paired(
        self, names: Iterable[str], step: Callable[[Any, Tensor, Tensor], Any]
    ) -> dict[str, Any]:
        """As `collect`, with each input paired with the full-precision model's input to the
        same linear at the same tokens (`reference` must be set)."""
        assert self.reference is not None
        owner = self._owners(names)
        if not owner:
            return {}
        owners = set(owner.values())
        modules = {o: self.linear(o) for o in owners}
        acc: dict[str, Any] = dict.fromkeys(owners)
        with self.attention_replay(any(self._in_attention(o) for o in owners)):
            for i, x in enumerate(self.X):
                native = self.reference.inputs(i, owners)

                def paired(name: str, a: Any, v: Tensor, native: dict[str, Tensor] = native) -> Any:
                    return step(a, v, native[name])

                acc = collect_inputs(self.block, modules, [x], self.kwargs, None, acc, paired)
        return {n: acc[o] for n, o in owner.items()}


REFERENCE_CACHE_BYTES = 1 << 30  # GPTAQ keeps the float inputs of a block's linears up to this


@dataclasses.dataclass
class Reference:
    """GPTAQ's full-precision side of one block: a copy of the block before quantization, its
    inputs X from the float model, its outputs (the next block's X), and the inputs of the
    block's linears (one dict per sample; kept when they fit REFERENCE_CACHE_BYTES, else
    recomputed per sequential group)."""

    block: nn.Module
    X: list[Tensor]
    kwargs: dict[str, Any]
    outputs: list[Tensor]
    cached: list[dict[str, Tensor]] | None

    @classmethod
    def run(
        cls, block: nn.Module, spec: ArchSpec, X: list[Tensor], kwargs: dict[str, Any]
    ) -> Reference:
        """One float pass over X that gives the outputs and, within budget, the inputs."""
        fp_block = copy.deepcopy(block)
        owners = {g[0]: fp_block.get_submodule(g[0]) for g in spec.sequential}
        width = sum(m.weight.shape[1] for m in owners.values())
        keep = sum(x.numel() // x.shape[-1] for x in X) * width * 4 <= REFERENCE_CACHE_BYTES
        cached: list[dict[str, Tensor]] = []
        seen: dict[str, Tensor] = {}

        def hook(name: str) -> Callable[..., None]:
            def fn(module: nn.Module, args: tuple[Tensor, ...]) -> None:
                seen[name] = args[0].detach()

            return fn

        handles = [m.register_forward_pre_hook(hook(n)) for n, m in owners.items()] if keep else []
        outputs = []
        try:
            for x in X:
                outputs.append(fp_block(x, **kwargs))
                if keep:
                    cached.append(dict(seen))
        finally:
            for h in handles:
                h.remove()
        return cls(fp_block, X, kwargs, outputs, cached if keep else None)

    def inputs(self, i: int, owners: Iterable[str]) -> dict[str, Tensor]:
        """The float inputs of the named linears for sample i."""
        if self.cached is not None:
            return self.cached[i]
        modules = {o: self.block.get_submodule(o) for o in owners}
        return collect_inputs(self.block, modules, [self.X[i]], self.kwargs, lambda _, v: v)
