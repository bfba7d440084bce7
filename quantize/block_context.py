"""One decoder block being quantized, with its calibration inputs (`BlockContext`), and GPTAQ's
full-precision side of it (`Reference`).

`BlockContext.collect` runs the block's inputs through it and folds the inputs of the named
linears into accumulators; linears of one sequential group share an input, which is collected
once. Once every attention linear is quantized, later passes replay the attention's outputs
instead of recomputing them (`attention_replay`).

Experts of a mixture-of-experts block see only the tokens routed to them (`qserve.quantize.moe`):
their accumulators stay None when no token reaches them, and `min_tokens` is the count below
which a linear's inputs are too few to calibrate on (`FEW_TOKENS_FRACTION` of the calibration
tokens; the methods then round it to nearest and record it in `fallbacks`). GPTAQ pairs an
expert's inputs with the float model's inputs at the same tokens: the float MoE block's input
rows of the tokens the quantized block routed to the expert, through the float expert.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from torch import Tensor, nn

from qserve.quantize.arch import ArchSpec
from qserve.quantize.capture import collect_inputs
from qserve.quantize.dynamic import Scheme
from qserve.quantize.moe import float_expert_input
from qserve.quantize.settings import QuantizeSettings, is_ignored_in

__all__ = [
    "BlockContext",
    "Reference",
    "FEW_TOKENS_FRACTION",
    "REPLAY_CACHE_BYTES",
    "REFERENCE_CACHE_BYTES",
]

REPLAY_CACHE_BYTES = 1 << 30  # a block keeps its attention's final outputs up to this
# A linear whose calibration inputs are fewer than this fraction of the calibration tokens (at
# least one token) is rounded to nearest: GPTQModel's FailSafe default (RTN below 0.5%).
FEW_TOKENS_FRACTION = 0.005


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
    fallbacks: dict[str, int] = dataclasses.field(default_factory=dict)  # name -> its tokens

    @functools.cached_property
    def names(self) -> list[str]:
        """The block's linears to quantize (not ignored, by their name or the checkpoint's)."""
        return [n for n in self.spec.linears if not self._ignored(self.prefix + n)]

    def _ignored(self, name: str) -> bool:
        if self.s.dynamic and self.s.scheme_of(self.spec.checkpoint_name(name)).dense:
            return True  # a "-:" dynamic rule: left 16-bit
        return is_ignored_in(self.spec, name, self.s.ignore)

    def scheme(self, name: str) -> Scheme:
        """The scheme of the block's linear `name` (relative): its dynamic rule's, or the run's."""
        return self.s.scheme_of(self.spec.checkpoint_name(self.prefix + name))

    @functools.cached_property
    def min_tokens(self) -> int:
        """Inputs of fewer tokens than this are too few to calibrate a linear on."""
        tokens = sum(x.numel() // x.shape[-1] for x in self.X)
        return max(1, math.ceil(FEW_TOKENS_FRACTION * tokens))

    def too_few(self, name: str, tokens: int) -> bool:
        """Whether linear `name` saw too few tokens; if so, and it is quantized, it is recorded
        as a fallback."""
        if tokens >= self.min_tokens:
            return False
        if name in self.names:
            self.fallbacks[name] = tokens
        return True

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
        """Each linear -> the linear whose input it shares (`ArchSpec.owner`)."""
        return {n: self.spec.owner(n) for n in names}

    def collect(
        self,
        names: Iterable[str],
        step: Callable[[Any, Tensor], Any],
        outputs: list[Tensor] | None = None,
    ) -> dict[str, Any]:
        """Accumulate the inputs of the named linears over X with `step`. Linears of one
        sequential group read the same input: it is accumulated once, for the first of them.
        `outputs`: the block's output for each of X is appended to it (the next block's X)."""
        owner = self._owners(names)
        if not owner and outputs is None:
            return {}
        modules = {o: self.linear(o) for o in set(owner.values())}
        with self.attention_replay(any(self._in_attention(o) for o in modules)):
            acc = collect_inputs(self.block, modules, self.X, self.kwargs, step, outputs=outputs)
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
        dense = {o for o in owners if not self.spec.is_expert(o)}
        with self.attention_replay(any(self._in_attention(o) for o in owners)):
            for i, x in enumerate(self.X):
                native = self.reference.inputs(i, dense)

                def paired(name: str, a: Any, v: Tensor, native: dict = native, i: int = i) -> Any:
                    x_fp = native[name] if name in native else self._float_expert_input(i, name)
                    return step(a, v, x_fp)

                acc = collect_inputs(self.block, modules, [x], self.kwargs, None, acc, paired)
        return {n: acc[o] for n, o in owner.items()}

    def _float_expert_input(self, i: int, name: str) -> Tensor:
        """The float model's input to expert linear `name` at the tokens of sample i that the
        quantized block routes to its expert in the call under way."""
        assert self.reference is not None
        tokens = self.block.get_submodule(name.rpartition(".")[0]).routed_tokens
        x_fp = self.reference.moe_inputs[i][tokens]
        return float_expert_input(self.reference.block, name, x_fp)


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
    moe_inputs: list[Tensor] | None = None  # a sparse block: its MoE block's input [T, H]

    @classmethod
    def run(
        cls, block: nn.Module, spec: ArchSpec, X: list[Tensor], kwargs: dict[str, Any]
    ) -> Reference:
        """One float pass over X that gives the outputs and, within budget, the inputs."""
        fp_block = copy.deepcopy(block)
        names = dict.fromkeys(spec.owner(n) for n in spec.linears if not spec.is_expert(n))
        owners = {n: fp_block.get_submodule(n) for n in names}
        width = sum(m.weight.shape[1] for m in owners.values())
        keep = sum(x.numel() // x.shape[-1] for x in X) * width * 4 <= REFERENCE_CACHE_BYTES
        cached: list[dict[str, Tensor]] = []
        seen: dict[str, Tensor] = {}
        moe_inputs: list[Tensor] = []

        def hook(name: str) -> Callable[..., None]:
            def fn(module: nn.Module, args: tuple[Tensor, ...]) -> None:
                seen[name] = args[0].detach()

            return fn

        handles = [m.register_forward_pre_hook(hook(n)) for n, m in owners.items()] if keep else []
        if spec.num_experts:  # the experts' float inputs are taken at the quantized routing
            handles.append(_record_moe_inputs(fp_block, spec, moe_inputs))
        outputs = []
        try:
            for x in X:
                outputs.append(fp_block(x, **kwargs))
                if keep:
                    cached.append(dict(seen))
        finally:
            for h in handles:
                h.remove()
        moe = moe_inputs if spec.num_experts else None
        return cls(fp_block, X, kwargs, outputs, cached if keep else None, moe)

    def inputs(self, i: int, owners: Iterable[str]) -> dict[str, Tensor]:
        """The float inputs of the named linears for sample i."""
        if self.cached is not None:
            return self.cached[i]
        modules = {o: self.block.get_submodule(o) for o in owners}
        return collect_inputs(self.block, modules, [self.X[i]], self.kwargs, lambda _, v: v)


def _record_moe_inputs(fp_block: nn.Module, spec: ArchSpec, into: list[Tensor]) -> Any:
    """A hook appending each input of the block's MoE block, flattened to [T, H], to `into`."""

    def hook(module: nn.Module, args: tuple[Tensor, ...]) -> None:
        into.append(args[0].detach().reshape(-1, args[0].shape[-1]))

    assert spec.moe is not None
    return fp_block.get_submodule(spec.moe.block).register_forward_pre_hook(hook)
