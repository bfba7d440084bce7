"""The per-block quantizer of each method, behind one protocol: given a `BlockContext`, quantize
its linears (putting the dequantized weights back, so later passes see the quantized block)
and return the quantized weights by name relative to the block.

    rtn, awq   round to nearest (awq: after `awq_search` scaled and clipped the weights)
    gptq       GPTQ, true-sequential; GPTAQ's asymmetric target when the context has a reference
    int8, fp8  W8 weights (to nearest or with GPTQ rounding) and optional static input scales

The AWQ / SmoothQuant searches run first (`quantize_block`) when their result is collected;
`quantize_lm_head` quantizes lm_head like a block's linear.

Too few tokens (mixture-of-experts experts see only the tokens routed to them): a linear whose
inputs number fewer than `BlockContext.min_tokens` (0.5% of the calibration tokens, at least 1)
is not calibrated on them: a Hessian of so few tokens is rank-deficient and GPTQ would fit
those tokens only (GPTQModel's FailSafe does the same). gptq and int8/fp8 with GPTQ rounding
round it to nearest instead; awq leaves it out of the scale search's error and skips its clip
search; a static input scale takes the largest of the same projection's over the block's
experts. Each such linear is recorded (`BlockContext.fallbacks`, then the checkpoint's
provenance).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from qserve.quantize.arch import ScaleMapping
from qserve.quantize.awq import rescale_stats, search_clip, search_scale
from qserve.quantize.block_context import BlockContext
from qserve.quantize.fold import ScaleResult, apply_scales, clip_weight
from qserve.quantize.fp8 import dequantize_fp8, fp8_input_scale, quantize_fp8
from qserve.quantize.gptq import (
    accumulate_dxxt,
    accumulate_hessian,
    gptq_quantize,
    gptq_w8_quantize,
    hessian_step,
)
from qserve.quantize.results import W8Weight
from qserve.quantize.rtn import QuantizedWeight, rtn_quantize
from qserve.quantize.settings import QuantizeSettings
from qserve.quantize.smoothquant import (
    activation_absmax,
    dequantize_int8,
    int8_input_scale,
    quantize_int8,
    smooth_scales,
)

__all__ = ["BlockQuantizer", "BLOCK_QUANTIZERS", "quantize_block", "quantize_lm_head"]


class BlockQuantizer(Protocol):
    """Quantize the block's linears in place; the quantized weights by relative name."""

    def __call__(self, ctx: BlockContext) -> dict[str, QuantizedWeight | W8Weight]: ...


def quantize_block(
    ctx: BlockContext, scales: ScaleResult | None
) -> dict[str, QuantizedWeight | W8Weight]:
    """The AWQ / SmoothQuant search (when `scales` collects it), then the method's quantizer."""
    s = ctx.s
    if scales is not None and s.method == "awq":
        _awq_search(ctx, scales)
    elif scales is not None and s.method == "int8" and s.smooth_alpha > 0:
        _smooth_search(ctx, scales)
    return {ctx.prefix + n: r for n, r in BLOCK_QUANTIZERS[s.method](ctx).items()}


def _gptq_block(ctx: BlockContext) -> dict[str, QuantizedWeight]:
    """GPTQ, true-sequential: each group's Hessian is taken after earlier groups are quantized."""
    s, out = ctx.s, {}
    for group in ctx.spec.sequential:
        group = [n for n in group if n in ctx.names]
        if ctx.reference is not None:
            stats = ctx.collect_paired(group, _gptaq_step)
        else:
            stats = {n: (h, None) for n, h in ctx.collect(group, hessian_step).items()}
        for n, acc in stats.items():
            hessian, dxxt = acc or (None, None)
            H, tokens = hessian or (None, 0)
            if ctx.too_few(n, tokens):
                out[n] = _set_weight(ctx.linear(n), _rtn(ctx, n))
                continue
            W = ctx.linear(n).weight.data
            scheme = ctx.scheme(n)
            qw = gptq_quantize(
                W, H, scheme.bits, scheme.group_size, s.sym, s.damp,
                desc_act=s.desc_act, static_groups=s.static_groups, min_zero=s.min_zero,
                mse=s.mse, act_group_aware=s.act_group_aware,
                dXXT=dxxt[0] if dxxt is not None else None, gptaq_alpha=s.gptaq_alpha,
            )  # fmt: skip
            out[n] = _set_weight(ctx.linear(n), qw)
        ctx.finish(group)
    return out


def _rtn_block(ctx: BlockContext) -> dict[str, QuantizedWeight]:
    """RTN on the (AWQ-scaled and clipped, for awq) weights."""
    out = {n: _set_weight(ctx.linear(n), _rtn(ctx, n)) for n in ctx.names}
    ctx.finish(out)
    return out


def _rtn(ctx: BlockContext, name: str) -> QuantizedWeight:
    s = ctx.s
    if s.method == "awq":
        return rtn_quantize(ctx.linear(name).weight.data, s.bits, s.group_size, s.sym, s.min_zero)
    scheme = ctx.scheme(name)  # rtn / gptq: a dynamic rule may set its own
    W = ctx.linear(name).weight.data
    return rtn_quantize(W, scheme.bits, scheme.group_size, s.sym, s.min_zero)


def _w8_block(ctx: BlockContext) -> dict[str, W8Weight]:
    """int8 / fp8 weights (rounded to nearest, or with GPTQ true-sequentially); static
    activation scales from the inputs of the quantized block."""
    s = ctx.s
    int8 = s.method == "int8"
    quant, dequant = (quantize_int8, dequantize_int8) if int8 else (quantize_fp8, dequantize_fp8)
    out = {}
    for group in ctx.spec.sequential:
        group = [n for n in group if n in ctx.names]
        if s.gptq_weights:
            results = {}
            for n, acc in ctx.collect(group, hessian_step).items():
                H, tokens = acc or (None, 0)
                W = ctx.linear(n).weight.data
                few = ctx.too_few(n, tokens)
                results[n] = (
                    quant(W, s.weight_strategy)
                    if few
                    else gptq_w8_quantize(W, H, s.method, s.weight_strategy, s.damp)
                )
        else:
            results = {n: quant(ctx.linear(n).weight.data, s.weight_strategy) for n in group}
        for n, (Q, scale) in results.items():
            ctx.linear(n).weight.data.copy_(dequant(Q, scale))
            out[n] = W8Weight(Q, scale)
        ctx.finish(group)
    if s.activation_scheme == "static":
        to_scale = int8_input_scale if int8 else fp8_input_scale
        for n, absmax in _input_absmax(ctx).items():
            out[n] = dataclasses.replace(out[n], input_scale=to_scale(absmax))
    return out


def _input_absmax(ctx: BlockContext) -> dict[str, Tensor]:
    """max |x| of each linear's inputs; an expert that saw too few tokens takes the largest of
    its projection's (w1, w2, ...) over the block's experts."""
    stats = {n: acc or (None, 0) for n, acc in ctx.collect(ctx.names, _absmax_count_step).items()}
    few = {n for n, (_, tokens) in stats.items() if ctx.too_few(n, tokens)}
    absmax = {n: m for n, (m, _) in stats.items()}
    for n in few:
        kind = n.rpartition(".")[2]
        same = [m for o, m in absmax.items() if m is not None and ctx.spec.is_expert(o)
                and o.rpartition(".")[2] == kind]  # fmt: skip
        absmax[n] = torch.stack(same).amax(dim=0)
    return absmax


BLOCK_QUANTIZERS: dict[str, BlockQuantizer] = {
    "rtn": _rtn_block,
    "gptq": _gptq_block,
    "awq": _rtn_block,
    "int8": _w8_block,
    "fp8": _w8_block,
}


def _set_weight(linear: nn.Linear, qw: QuantizedWeight) -> QuantizedWeight:
    """Round the scales to fp16 (as stored on disk) and put the dequantized weight back."""
    qw = dataclasses.replace(qw, scales=qw.scales.to(torch.float16).float())
    linear.weight.data.copy_(qw.dequantize())
    return qw


def _foldable(ctx: BlockContext, m: ScaleMapping) -> bool:
    prev, first = ctx.block.get_submodule(m.prev), ctx.linear(m.linears[0])
    # grouped-query attention: v_proj's rows do not line up with o_proj's columns
    return not isinstance(prev, nn.Linear) or prev.weight.shape[0] == first.weight.shape[1]


def _awq_search(ctx: BlockContext, result: ScaleResult) -> None:
    """AWQ on the float block: scale search + fold for each mapping, then the clip search."""
    s = ctx.s
    stats = {n: _awq_stats(ctx, n, acc) for n, acc in
             ctx.collect(ctx.spec.linears, _awq_stats_step).items()}  # fmt: skip
    for m in filter(lambda m: _foldable(ctx, m), ctx.spec.mappings):
        searched = [n for n in m.linears if n in ctx.names and stats[n] is not None]
        if stats[m.linears[0]] is None or not searched:
            continue  # an expert that saw too few tokens: no scales
        x_mean, _ = stats[m.linears[0]]
        Ws = [ctx.linear(n).weight.data for n in searched]
        scale, _, _ = search_scale(x_mean, _hessians(stats, searched), Ws, s.bits, s.group_size)
        apply_scales(ctx.block.get_submodule(m.prev), [ctx.linear(n) for n in m.linears], scale)
        _rescale(stats, m.linears, scale)
        result.scales[ctx.prefix + m.prev] = scale.cpu()
        result.linears[ctx.prefix + m.prev] = [ctx.prefix + n for n in m.linears]
    for n in ctx.names:
        if n.endswith(("q_proj", "k_proj")) or stats[n] is None:
            continue  # the softmax hides their error (AutoAWQ skips them too); too few tokens
        W = ctx.linear(n).weight.data
        max_val = search_clip(stats[n][1], W, s.bits, s.group_size)
        W.copy_(clip_weight(W, max_val, s.group_size))
        result.clips[ctx.prefix + n] = max_val.cpu()


def _smooth_search(ctx: BlockContext, result: ScaleResult) -> None:
    """SmoothQuant: fold s = max|X|^a / max|W|^(1-a) into each norm -> linears mapping."""
    maps = [m for m in ctx.spec.mappings if m.smooth and _foldable(ctx, m)]
    absmax = ctx.collect([m.linears[0] for m in maps], _absmax_step)
    for m in maps:
        W = [ctx.linear(n).weight.data for n in m.linears if n in ctx.names]
        if not W:
            continue
        scale = smooth_scales(absmax[m.linears[0]], W, ctx.s.smooth_alpha)
        apply_scales(ctx.block.get_submodule(m.prev), [ctx.linear(n) for n in m.linears], scale)
        result.scales[ctx.prefix + m.prev] = scale.cpu()
        result.linears[ctx.prefix + m.prev] = [ctx.prefix + n for n in m.linears]


def _awq_stats(ctx: BlockContext, name: str, acc: Any) -> tuple[Tensor, Tensor] | None:
    """(mean |x|, H) of a linear's inputs, or None when they are too few to search on."""
    (H, tokens), abs_sum = acc or ((None, 0), None)
    return None if ctx.too_few(name, tokens) else (abs_sum / tokens, H)


def _hessians(stats: dict[str, Any], names: list[str]) -> Tensor | list[Tensor]:
    """The H the linears share, or one per linear (experts: each of its routed tokens)."""
    Hs = [stats[n][1] for n in names]
    return Hs[0] if all(H is Hs[0] for H in Hs) else Hs


def _rescale(stats: dict[str, Any], names: tuple[str, ...], scale: Tensor) -> None:
    """Statistics of the inputs after folding 1/scale into them (shared ones rescaled once)."""
    done: dict[int, tuple[Tensor, Tensor]] = {}
    for n in names:
        if stats[n] is not None:
            key = id(stats[n])
            if key not in done:
                done[key] = rescale_stats(*stats[n], scale)
            stats[n] = done[key]


# ------------------------------------------------------------------------ statistics steps


def _gptaq_step(acc: Any, x: Tensor, x_fp: Tensor) -> tuple[tuple[Tensor, int], tuple[Tensor, int]]:
    """((H, tokens), (dXXT, tokens)): GPTAQ's statistics of a linear's inputs."""
    (H, n), (D, _) = acc if acc is not None else ((None, 0), (None, 0))
    return accumulate_hessian(H, n, x), accumulate_dxxt(D, n, x, x_fp)


def _absmax_step(acc: Tensor | None, x: Tensor) -> Tensor:
    m = activation_absmax(x)
    return m if acc is None else torch.maximum(acc, m)


def _absmax_count_step(acc: tuple[Tensor, int] | None, x: Tensor) -> tuple[Tensor, int]:
    """(max |x| per channel, tokens)."""
    m, n = acc if acc is not None else (None, 0)
    return _absmax_step(m, x), n + x.numel() // x.shape[-1]


def _awq_stats_step(acc: Any, x: Tensor) -> tuple[tuple[Tensor, int], Tensor]:
    """((H, tokens), sum |x|): what AWQ's searches need of a linear's inputs."""
    (H, n), abs_sum = acc if acc is not None else ((None, 0), 0.0)
    x = x.reshape(-1, x.shape[-1]).float()
    return accumulate_hessian(H, n, x), abs_sum + x.abs().sum(dim=0)


@torch.no_grad()
def quantize_lm_head(
    model: nn.Module, s: QuantizeSettings, X: list[Tensor], X_fp: list[Tensor] | None = None
) -> QuantizedWeight:
    """lm_head [vocab, hidden] quantized like the blocks' linears: GPTQ (with the Hessian of the
    final-norm hidden states of the calibration samples, the last block's outputs X; GPTAQ's
    statistics too when the float model's X_fp are given) or RTN.
    It is untied from the input embeddings first: those stay in floating point, and the config
    then says tie_word_embeddings false."""
    head = model.get_output_embeddings()
    if getattr(model.config, "tie_word_embeddings", False):
        head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=False)
        model.config.tie_word_embeddings = False
    if not s.lm_head_needs_inputs:
        return _set_weight(head, rtn_quantize(head.weight, s.bits, s.group_size, s.sym, s.min_zero))
    norm = model.get_decoder().norm
    H, D, n = None, None, 0
    for i, x in enumerate(X):
        if X_fp is not None:
            D, _ = accumulate_dxxt(D, n, norm(x), norm(X_fp[i]))
        H, n = accumulate_hessian(H, n, norm(x))
    qw = gptq_quantize(
        head.weight, H, s.bits, s.group_size, s.sym, s.damp,
        desc_act=s.desc_act, static_groups=s.static_groups, min_zero=s.min_zero,
        mse=s.mse, act_group_aware=s.act_group_aware, dXXT=D, gptaq_alpha=s.gptaq_alpha,
    )  # fmt: skip
    return _set_weight(head, qw)
