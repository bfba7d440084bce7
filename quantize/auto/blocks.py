"""The float model block by block, as `--method auto`'s measurement pass (`measure.py`) and
`benchmarks/auto_carry.py` walk it: for each block its Hessians on the fit windows and its float
inputs of the KL windows, and the unit-level GPTQ helpers both use.

The calibration is the quantization's own `num_samples` windows (the Hessians) and
`measure_samples` more after them (the KLs). Every block's float inputs of the KL windows are
made up front (the later blocks' partial forwards start from them); the fit windows' inputs are
carried one block at a time, from the same forward that collects the block's Hessians.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from qserve.quantize.arch import arch_spec
from qserve.quantize.auto.budget import Unit
from qserve.quantize.auto.tail import Tail, block_forward
from qserve.quantize.block_context import BlockContext
from qserve.quantize.calibration import calibration_ids
from qserve.quantize.capture import capture_block_inputs
from qserve.quantize.dynamic import Scheme
from qserve.quantize.gptq import gptq_quantize, hessian_step
from qserve.quantize.moe import prepare_moe
from qserve.quantize.settings import QuantizeSettings

__all__ = ["BlockStep", "FloatWalk", "unit_gptq", "unit_name", "unit_proxy"]


@dataclasses.dataclass
class BlockStep:
    b: int
    ctx: BlockContext
    groups: list[list[str]]  # the block's units: the linears that share a scheme (vLLM fuses)
    hessians: dict[str, Any]  # per linear: (H, tokens) on the fit windows
    kl_inputs: list[Tensor]  # block b's float inputs of the KL windows


class FloatWalk:
    """The float model at `model_path` (fp32) with its calibration windows; iterating it yields
    one `BlockStep` per block, in order. `tail` takes the KL of the final logits with some of a
    block's linears swapped; `kl_inputs[b]` are block b's float inputs of the KL windows."""

    def __init__(self, model_path: Path, settings: QuantizeSettings) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.settings = settings
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self.spec = arch_spec(self.model.config.model_type)
        prepare_moe(self.model, self.spec)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        n_fit, s = settings.num_samples, settings
        self.ids = calibration_ids(
            model_path, self.tokenizer, s.calib, n_fit + s.measure_samples, s.seq_len
        )
        self.blocks: nn.ModuleList = self.model.get_submodule(self.spec.blocks)
        with torch.no_grad():
            X, self.kwargs = capture_block_inputs(self.model, self.blocks, self.ids)
            self._fit, self.kl_inputs = X[:n_fit], [X[n_fit:]]
            for b, block in enumerate(self.blocks):
                self.kl_inputs.append(block_forward(block, self.kl_inputs[b], self.kwargs[b]))
        self.tail = Tail(self.model, self.blocks, self.kwargs, self.kl_inputs[-1])

    @property
    def kl_tokens(self) -> int:
        return self.ids[self.settings.num_samples :].numel()

    def __iter__(self) -> Iterator[BlockStep]:
        fit, spec, s = self._fit, self.spec, self.settings
        for b, block in enumerate(self.blocks):
            prefix = f"{spec.blocks}.{b}."
            ctx = BlockContext(block, prefix, spec.for_block(block), s, fit, self.kwargs[b])
            groups = [[n for n in group if n in ctx.names] for group in ctx.spec.sequential]
            groups = [names for names in groups if names]
            fit = []  # block b + 1's float inputs, from the same forward as block b's Hessians
            with torch.no_grad():
                hessians = ctx.collect([n for names in groups for n in names], hessian_step, fit)
            yield BlockStep(b, ctx, groups, hessians, self.kl_inputs[b])

    def unit(self, step: BlockStep, names: list[str]) -> Unit:
        """The unit of block `step.b`'s linears `names`, by their checkpoint names."""
        full = [self.spec.checkpoint_name(step.ctx.prefix + n) for n in names]
        shapes = tuple(tuple(step.ctx.linear(n).weight.shape) for n in names)
        return Unit(unit_name(full), tuple(full), shapes)


def unit_gptq(
    ctx: BlockContext, names: list[str], hessians: dict[str, Any], scheme: Scheme, mse: bool
) -> list[Tensor]:
    """The unit's dequantized GPTQ weights at `scheme` (float Hessians, no GPTAQ)."""
    s, out = ctx.s, []
    for n in names:
        W = ctx.linear(n).weight.data.float()
        qw = gptq_quantize(
            W, hessians[n][0], scheme.bits, scheme.group_size, s.sym, s.damp,
            min_zero=s.min_zero, mse=mse, act_group_aware=s.act_group_aware,
        )  # fmt: skip
        out.append(qw.dequantize().to(W.dtype))
    return out


def unit_proxy(
    ctx: BlockContext, names: list[str], hessians: dict[str, Any], quantized: list[Tensor]
) -> float:
    """sum tr((W - W_s) H (W - W_s)^T) over the unit's linears, W_s their `quantized` weights:
    the layer-wise loss GPTQ minimizes."""
    total = 0.0
    for n, Wq in zip(names, quantized):
        dW = ctx.linear(n).weight.data.float() - Wq
        total += float(((dW @ hessians[n][0]) * dW).sum())
    return total


def unit_name(linears: list[str]) -> str:
    """'model.layers.0.self_attn.q_proj+k_proj+v_proj' for a fused unit."""
    parent, _, first = linears[0].rpartition(".")
    rest = [n.rpartition(".")[2] for n in linears[1:]]
    return f"{parent}.{'+'.join([first, *rest])}"
