"""Step graphs: a model step captured once and replayed without re-running its Python.

The CPU analog of a CUDA graph. Capture runs the step once, eagerly, on static input tensors,
and records, in order, every C++ kernel launch (`cpu_build.recording_launches`: the function
and its raw arguments, pointers included) and every torch op that computes something (a
`TorchDispatchMode`: the op and its tensor arguments). Every tensor the step creates is kept,
so each recorded pointer stays valid. Replay copies nothing in and walks the list: the launches
with their recorded arguments, the torch ops again on the same tensors (a functional op
through its `out=` overload into the tensor it returned at capture, or, without one, its
result copied there). A new step's inputs are copied into the static inputs first, by the
caller (`decode_graphs`).

Python that the replay does not run must not have depended on the step's values. Capture
refuses (raises `NotCapturable`, the caller runs eager) what would bake them in:
- an op that reads a tensor's values into Python (`item`, `tolist`) or has a data-dependent
  output shape (`nonzero`, `unique`, ...), or draws random numbers;
- the Python lists of the attention metadata (`seq_lens_cpu`, ...), replaced by lists that
  raise when read.
What the Python reads besides (shapes, dtypes, settings) is the same at every replay of one
graph, since each graph serves one padded batch size.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from qserve.kernels import cpu_build

# ops that read values into Python, whose output shape depends on values, or that sync
_REFUSED = {
    "item", "_local_scalar_dense", "resolve_conj", "resolve_neg", "is_nonzero", "equal",
    "nonzero", "nonzero_static", "masked_select", "unique", "_unique", "_unique2",
    "unique_consecutive", "unique_dim", "bincount", "repeat_interleave", "histc",
}  # fmt: skip
# allocations: nothing to replay (the tensor is kept)
_ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}


class NotCapturable(Exception):
    """The step depends on values that a replay could not see; run it eagerly."""


class UnavailableList(list):
    """A metadata list a captured step may not read (its values change between replays)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def _refuse(self, *args: object) -> Any:
        raise NotCapturable(f"the step reads attn_metadata.{self.name}")

    __len__ = __iter__ = __getitem__ = __bool__ = __contains__ = _refuse  # type: ignore[assignment]


class HostReadGuard(TorchDispatchMode):
    """Runs ops as they are, raising NotCapturable for what a CUDA graph could not replay: an op
    that reads values into Python, has a value-dependent shape or draws random numbers, and a
    copy from the device to the host (a sync, which stream capture forbids)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if _refused(func):
            raise NotCapturable(f"the step calls aten.{func.overloadpacket.__name__}")
        out = func(*args, **kwargs)
        if _to_host(args, kwargs, out):
            name = func.overloadpacket.__name__
            raise NotCapturable(f"the step copies to the host (aten.{name})")
        return out


def _to_host(args: tuple, kwargs: dict, out: Any) -> bool:
    """Whether an op took a tensor off an accelerator and made a CPU one."""
    ins = [t for t in tree_flatten((args, kwargs))[0] if _is_tensor(t)]
    outs = [t for t in tree_flatten(out)[0] if _is_tensor(t)]
    on_device = any(t.device.type not in ("cpu", "meta") for t in ins)
    return on_device and any(t.device.type == "cpu" for t in outs)


class _Recorder(TorchDispatchMode):
    """Records torch ops that compute (in order, into `steps`) and keeps every tensor made."""

    def __init__(self, steps: list[tuple[Callable[..., Any], tuple, bool]]) -> None:
        super().__init__()
        self.steps = steps
        self.keep: list[Any] = []
        self.made: list[Any] = []  # what the step allocated (not views of what it was given)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if _refused(func):
            raise NotCapturable(f"the step calls aten.{name}")
        out = func(*args, **kwargs)
        self.keep.append(out)
        if func.is_view and _aliases_input(out, args):
            return out
        self.made.append(out)
        if name in _ALLOCATIONS:
            return out
        if func._schema.is_mutable:  # in place (or out=): the same call writes the same tensors
            self.steps.append((_call, (func, args, kwargs), False))
        else:
            self.steps.append(_functional_step(func, args, kwargs, out))
        return out


def _functional_step(
    func: torch._ops.OpOverload, args: tuple, kwargs: dict, out: Any
) -> tuple[Callable[..., Any], tuple, bool]:
    """How a replay reruns a functional op: into the tensor(s) it returned at capture."""
    if isinstance(out, torch.Tensor):
        if func.overloadpacket.__name__ == "to":  # a copy (an alias was returned before this)
            return (_call, (torch.Tensor.copy_, (out, args[0]), {}), False)
        into = _out_overload(func)
        if into is not None:  # computed straight into the captured result
            return (_call, (into, args, {**kwargs, "out": out}), False)
    return (_call_into, (func, args, kwargs, out), False)


@functools.cache
def _refused(func: torch._ops.OpOverload) -> bool:
    """Reads values into Python, has a value-dependent shape, or draws random numbers."""
    random = torch.Tag.nondeterministic_seeded in func.tags
    return random or func.overloadpacket.__name__ in _REFUSED


@functools.cache
def _out_overload(func: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """The op's `out=` overload (same arguments, names and types, plus one `out` tensor), if it
    has one: a replay then writes its result in place instead of allocating a new tensor and
    copying it (for a step's logits, megabytes a step, each allocation page-faulted anew)."""
    want = [(a.name, str(a.type)) for a in func._schema.arguments]
    packet = func.overloadpacket
    for name in packet.overloads():
        schema = getattr(packet, name)._schema
        outs = [a for a in schema.arguments if a.is_out]
        ins = [(a.name, str(a.type)) for a in schema.arguments if not a.is_out]
        if len(outs) == 1 and outs[0].name == "out" and ins == want and len(schema.returns) == 1:
            return getattr(packet, name)
    return None


def _aliases_input(out: Any, args: tuple) -> bool:
    """Whether every tensor out is a view of an input (`to`, `contiguous`, `reshape` may
    alias, or copy: only an alias needs no replay)."""
    inputs = {a.untyped_storage().data_ptr() for a in tree_flatten(args)[0] if _is_tensor(a)}
    outs = [o for o in tree_flatten(out)[0] if _is_tensor(o)]
    return all(o.untyped_storage().data_ptr() in inputs for o in outs)


def _storage_bytes(values: list[Any]) -> int:
    storages = {}
    for t in tree_flatten(values)[0]:
        if _is_tensor(t):
            s = t.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


def _is_tensor(x: object) -> bool:
    return isinstance(x, torch.Tensor)


def _call(func: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    func(*args, **kwargs)


def _call_into(func: Callable[..., Any], args: tuple, kwargs: dict, out: Any) -> None:
    """Run a functional op again and write its result where the capture's result lives."""
    for dst, src in zip(tree_flatten(out)[0], tree_flatten(func(*args, **kwargs))[0]):
        if isinstance(dst, torch.Tensor):
            dst.copy_(src)


class StepGraph:
    """One captured step: `replay()` runs it again on the static inputs it was captured on
    (refilled by the caller) and returns the same output tensor, rewritten."""

    def __init__(
        self, steps: list[tuple[Callable[..., Any], tuple, bool]], keep: list[Any], output: Any
    ) -> None:
        self.steps = steps
        self._keep = keep
        self.output = output
        self.capture_seconds = 0.0
        self.held_bytes = 0  # memory of the tensors the captured step allocated

    @property
    def num_launches(self) -> int:
        return sum(1 for _, _, is_launch in self.steps if is_launch)

    def summary(self) -> str:
        ops, held = len(self.steps) - self.num_launches, self.held_bytes / 1e6
        return f"{self.num_launches} kernel launches, {ops} torch ops, {held:.1f} MB held"

    @classmethod
    def capture(cls, step: Callable[[], Any]) -> StepGraph:
        """Run `step()` once, recording it (its output is the graph's `output`). Raises
        NotCapturable if the step depends on values a replay could not see."""
        steps: list[tuple[Callable[..., Any], tuple, bool]] = []

        def record_launch(fn: Callable[..., int], args: tuple) -> None:
            steps.append((fn, args, True))

        start = time.perf_counter()
        recorder = _Recorder(steps)
        with cpu_build.recording_launches(record_launch), recorder:
            output = step()
        graph = cls(steps, recorder.keep, output)
        graph.held_bytes = _storage_bytes(recorder.made)
        graph.capture_seconds = time.perf_counter() - start
        return graph

    def replay(self) -> Any:
        for fn, args, is_launch in self.steps:
            status = fn(*args)
            if is_launch and status:
                raise RuntimeError(f"a replayed kernel launch failed (status {status})")
        return self.output
