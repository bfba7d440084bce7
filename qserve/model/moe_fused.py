"""Experts stacked for the fused mixture-of-experts kernel (vLLM's FusedMoE weights).

After loading, before the linears are prepared for their own kernels, `prepare_moe_blocks`
decides per `SparseMoeBlock` whether its experts run through `ops.fused_experts` (the Triton
grouped GEMM on CUDA) or stay per-expert modules run grouped by expert (`moe.fused_moe`, the
CPU path). A fused block's experts are stacked once into vLLM's two projections,

    w13 [E, 2I, H]   each expert's gate over its up (one GEMM, then silu_and_mul)
    w2  [E, H, I]    each expert's down, times the routing weight, summed over the top-k

as `MoEWeight`s (`kernels/fused_moe_ref.py`) in the experts' checkpoint format: dense, GPTQ
(4 or 8 bits, consecutive groups or act-order g_idx shared by an expert's gate and up), or
weight-only int8 / fp8 (per-channel or per-tensor scales, stored per channel). The experts'
own modules are then dropped, so the weights are held once: `StackedExperts` replaces the
block's `experts` list and owns the stacked tensors as buffers (`experts.w13_weight`, ...).
While a block is stacked its per-expert tensors and the stack both exist (one layer's experts
at most, if the caller holds no other references: the loader drops its state dicts first).

Formats the kernel cannot take keep the per-expert path, with the reason in the load report
(`linear_paths["experts"]`) and one warning per reason: AWQ experts, W8A8 experts (the kernel
quantizes no activations), expert biases, a gate and up with different act-order g_idx, and
mixed formats within one projection.

When: `QSERVE_FUSED_MOE` = "auto" (default: blocks whose weights are on CUDA with triton
installed), "1" (wherever the formats allow, CPU included: `ops.fused_experts` then runs the
torch reference, or the Triton interpreter where tests ask for it) or "0" (never).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import torch
from torch import nn

from qserve.errors import QServeError
from qserve.kernels import ops
from qserve.kernels.fused_moe_ref import MoEWeight
from qserve.kernels.packing import gptq_group_size
from qserve.model.awq_linear import AWQLinear
from qserve.model.gptq_linear import GPTQLinear
from qserve.model.moe import FusedMoE, SparseMoeBlock
from qserve.model.w8_linear import W8Linear

logger = logging.getLogger("qserve")

ENV_VAR = "QSERVE_FUSED_MOE"
MODES = ("auto", "1", "0")
PER_EXPERT = "grouped by expert"
_FIELDS = ("weight", "scales", "qzeros", "g_idx")
_W8_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


class Unfusable(Exception):
    """The experts' formats are not ones the fused kernel takes (the message says why)."""


def fused_moe_mode() -> str:
    """QSERVE_FUSED_MOE: "auto" (CUDA), "1" (always where the formats allow) or "0"."""
    mode = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise QServeError(f"{ENV_VAR}={mode!r}: expected one of {', '.join(MODES)}")
    return mode


def prepare_moe_blocks(model: nn.Module, mode: str | None = None) -> dict[str, str]:
    """Stack the experts of every SparseMoeBlock of `model` for the fused kernel where `mode`
    (default: `fused_moe_mode()`) and their formats allow. Run after loading and before
    `prepare_quant_linears`. Returns {"experts": path(s)} for the load report ({} without MoE)."""
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    blocks = [block for block in blocks if isinstance(block.experts, FusedMoE)]  # not stacked yet
    if not blocks:
        return {}
    mode = mode or fused_moe_mode()
    paths = {_prepare_block(block, mode) for block in blocks}
    return {"experts": " + ".join(sorted(paths))}


def _prepare_block(block: SparseMoeBlock, mode: str) -> str:
    if mode == "0" or (mode == "auto" and not _on_cuda(block.experts)):
        return PER_EXPERT
    try:
        return fuse_experts(block)
    except Unfusable as exc:
        _warn_once(str(exc))
        return f"{PER_EXPERT} (not fused: {exc})"


def _on_cuda(experts: FusedMoE) -> bool:
    tensor = next(iter(experts.buffers()), None)
    tensor = tensor if tensor is not None else next(experts.parameters())
    return ops.use_triton(tensor)


_warned: set[str] = set()


def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        logger.warning("MoE experts run one by one (grouped by expert), not fused: %s", reason)


def fuse_experts(block: SparseMoeBlock) -> str:
    """Stack `block`'s experts into w13 / w2 and drop their modules; returns the path for the
    load report. Raises Unfusable (the block unchanged) where the formats do not allow it."""
    w13, w2 = stack_experts(list(block.experts))
    block.experts = StackedExperts(w13, w2)
    return block.experts.describe()


def stack_experts(experts: Sequence[nn.Module]) -> tuple[MoEWeight, MoEWeight]:
    """(w13, w2) of `experts` (ExpertMLPs, as loaded: checkpoint tensors, not yet prepared)."""
    projections = [expert.projections() for expert in experts]
    w13 = stack_projection([[gate, up] for gate, up, _ in projections], "gate/up")
    w2 = stack_projection([[down] for _, _, down in projections], "down")
    return w13, w2


def stack_projection(linears: list[list[nn.Module]], what: str) -> MoEWeight:
    """One MoEWeight from each expert's `linears` (concatenated along the output features)."""
    kinds = {_format(m) for group in linears for m in group}
    unsupported = sorted(kinds - set(_STACKERS))
    if unsupported:
        names = ", ".join(unsupported)
        raise Unfusable(f"{names} {what} experts (the fused kernel takes dense, GPTQ and W8A16)")
    if len(kinds) != 1:
        raise Unfusable(f"mixed {what} formats across experts ({', '.join(sorted(kinds))})")
    if any(getattr(m, "bias", None) is not None for group in linears for m in group):
        raise Unfusable(f"{what} experts have biases (the fused kernel adds none)")
    return _STACKERS[kinds.pop()](linears, what)


def _format(m: nn.Module) -> str:
    if isinstance(m, nn.Linear):
        return "dense"
    if isinstance(m, GPTQLinear):
        return "gptq" if m.scheme.bits in (4, 8) else f"gptq {m.scheme.bits}-bit"
    if isinstance(m, W8Linear):
        return "w8" if m.scheme.activations is None else f"{m.scheme.format} W8A8"
    if isinstance(m, AWQLinear):
        return "AWQ"
    return type(m).__name__


def _stack_cat(parts: list[list[torch.Tensor]], dim: int, what: str) -> torch.Tensor:
    """[E] lists of tensors -> [E, ...]: each expert's tensors concatenated along `dim`, written
    into one preallocated stack (no per-expert temporaries)."""
    if len({t.dtype for group in parts for t in group}) != 1:
        raise Unfusable(f"{what} expert tensors differ in dtype")
    shapes = {tuple(tuple(t.shape) for t in group) for group in parts}
    if len(shapes) != 1:
        raise Unfusable(f"{what} expert tensors differ in shape")
    first = parts[0]
    shape = list(first[0].shape)
    shape[dim] = sum(t.shape[dim] for t in first)
    out = first[0].detach().new_empty((len(parts), *shape))
    for e, group in enumerate(parts):
        torch.cat([t.detach() for t in group], dim=dim, out=out[e])
    return out


def _stack_dense(linears: list[list[nn.Module]], what: str) -> MoEWeight:
    return MoEWeight.dense(_stack_cat([[m.weight for m in g] for g in linears], 0, what))


def _stack_gptq(linears: list[list[GPTQLinear]], what: str) -> MoEWeight:
    layers = [m for group in linears for m in group]
    bits = {m.scheme.bits for m in layers}
    if len(bits) != 1:
        raise Unfusable(f"{what} experts mix GPTQ bit widths {sorted(bits)}")
    qweight = _stack_cat([[m.qweight for m in g] for g in linears], 1, what)  # [E, K/P, N]
    qzeros = _stack_cat([[m.qzeros for m in g] for g in linears], 1, what)  # [E, G, N/P]
    scales = _stack_cat([[m.scales for m in g] for g in linears], 1, what)  # [E, G, N]
    g_idx = _stacked_g_idx(linears, qzeros.shape[1], what)
    return MoEWeight.gptq(qweight, qzeros, scales, g_idx, bits.pop())


def _stacked_g_idx(
    linears: list[list[GPTQLinear]], num_groups: int, what: str
) -> torch.Tensor | None:
    """None where every expert's groups are the consecutive ones the kernel derives from K and
    G; else int32 [E, K] (act-order), each expert's linears sharing one g_idx."""
    groups = []
    for group in linears:
        g = [m._groups() for m in group]  # int64 [K], range-checked
        if any(not torch.equal(g[0], other) for other in g[1:]):
            raise Unfusable(f"{what} linears of one expert have different act-order g_idx")
        groups.append(g[0])
    K = groups[0].numel()
    try:
        consecutive = torch.arange(K, device=groups[0].device) // gptq_group_size(K, num_groups)
    except ValueError:  # groups the kernel cannot derive from K and G: pass them explicitly
        consecutive = None
    if consecutive is not None and all(torch.equal(g, consecutive) for g in groups):
        return None
    return torch.stack(groups).to(torch.int32)


def _stack_w8(linears: list[list[W8Linear]], what: str) -> MoEWeight:
    formats = {m.scheme.format for group in linears for m in group}
    if len(formats) != 1:
        raise Unfusable(f"{what} experts mix 8-bit formats {sorted(formats)}")
    weight = _stack_cat([[m.weight for m in g] for g in linears], 0, what)  # [E, N, K]
    want = _W8_DTYPES[formats.pop()]
    if weight.dtype != want:
        raise QServeError(f"{what} expert weights are {weight.dtype}, expected {want}")

    def per_channel(m: W8Linear) -> torch.Tensor:  # [N, 1] or [1] -> fp32 [N]
        return m.weight_scale.to(torch.float32).reshape(-1).expand(m.out_features)

    scales = _stack_cat([[per_channel(m) for m in g] for g in linears], 0, what)  # [E, N]
    return MoEWeight.w8(weight, scales)


_STACKERS = {"dense": _stack_dense, "gptq": _stack_gptq, "w8": _stack_w8}


class StackedExperts(nn.Module):
    """A fused block's experts: w13 and w2 stacked, run by `ops.fused_experts` (vLLM's
    FusedMoE with its fused_experts). Called like `FusedMoE`: (x, topk_weights, topk_ids)."""

    def __init__(self, w13: MoEWeight, w2: MoEWeight) -> None:
        super().__init__()
        self.kinds: dict[str, tuple[str, int]] = {}
        for prefix, weight in (("w13", w13), ("w2", w2)):
            self.kinds[prefix] = (weight.kind, weight.bits)
            for field in _FIELDS:
                tensor = getattr(weight, field)
                if tensor is not None:
                    self.register_buffer(f"{prefix}_{field}", tensor)

    def moe_weight(self, prefix: str) -> MoEWeight:
        """The MoEWeight of "w13" or "w2" over the current buffers (they follow .to())."""
        kind, bits = self.kinds[prefix]
        tensors = {f: self._buffers.get(f"{prefix}_{f}") for f in _FIELDS}
        return MoEWeight(kind, bits=bits, **tensors)

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """x [T, H] -> [T, H]: sum_k topk_weights * expert[topk_ids](x), one kernel per GEMM."""
        w13, w2 = self.moe_weight("w13"), self.moe_weight("w2")
        return ops.fused_experts(x, w13, w2, topk_weights, topk_ids)

    def describe(self) -> str:
        """The load report's line: fused-moe <kernel> (w13 <format>, w2 <format>)."""
        kernel = ops.fused_experts_path(self.w13_weight)
        return f"fused-moe {kernel} (w13 {self._name('w13')}, w2 {self._name('w2')})"

    def _name(self, prefix: str) -> str:
        kind, bits = self.kinds[prefix]
        if kind == "gptq":
            return f"gptq w{bits}" + (" act-order" if f"{prefix}_g_idx" in self._buffers else "")
        if kind == "w8":
            return f"w8a16 {str(self._buffers[f'{prefix}_weight'].dtype).removeprefix('torch.')}"
        return "dense"

    def extra_repr(self) -> str:
        w13 = self.moe_weight("w13")
        return f"experts={w13.num_experts}, hidden={w13.in_features}, {self.describe()}"
