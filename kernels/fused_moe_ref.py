"""Pure-torch references for the fused mixture-of-experts GEMMs (vLLM's fused_moe).

One projection of all E experts, stacked (`MoEWeight`), applied to token-expert pairs:

    pair p = t * top_k + j      token t's j-th chosen expert e = topk_ids[t, j]
    pairs[p]  = x[t] @ W[e].T   (* topk_weights[t, j] when weighted)       [T * top_k, N]
    linear[t] = sum_j topk_weights[t, j] * x[t] @ W[e].T                   [T, N]
    experts[t] = sum_j topk_weights[t, j] * down[e](silu(gate[e](x[t])) * up[e](x[t]))

Weights, W[e] [N, K] in nn.Linear layout once dequantized:

    dense  weight [E, N, K] in x's dtype
    gptq   qweight int32 [E, K/P, N], qzeros int32 [E, G, N/P], scales [E, G, N],
           g_idx int32 [E, K] (act-order) or None (consecutive groups), bits 4 or 8
           (each expert in the GPTQ v1 layout of `packing`, dequantized by `dequantize_gptq`
           with fp32 scales: W exact in fp32, as the kernel and the model's GPTQ layers have it)
    w8     weight int8 or float8_e4m3fn [E, N, K], scales fp32 [E, N] (per channel) or [E]
           (one per expert); weight-only: W[e][n, k] = weight[e, n, k] * scales[e, n]

Math in fp32 from the operands' values; each pair's output is rounded once to x's dtype (what the
kernel stores), the sum over k is taken in fp32 and rounded once more.

`moe_align_block_size` sorts the pairs by expert and pads each expert's run to a multiple of the
block size, so that every BLOCK_M tile of the sorted list belongs to one expert.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from qserve.kernels.model_ops_ref import silu_and_mul_ref
from qserve.kernels.packing import dequantize_gptq

KINDS = ("dense", "gptq", "w8")


@dataclass(frozen=True)
class MoEWeight:
    """One projection of E experts, stacked (layouts in the module docstring)."""

    kind: str
    weight: torch.Tensor  # dense / w8: [E, N, K]; gptq: qweight [E, K/P, N]
    scales: torch.Tensor | None = None  # gptq: [E, G, N]; w8: [E, N] or [E]
    qzeros: torch.Tensor | None = None  # gptq: [E, G, N/P]
    g_idx: torch.Tensor | None = None  # gptq act-order: [E, K]
    bits: int = 4

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind != "dense" and self.scales is None:
            raise ValueError(f"{self.kind} weights need scales")
        if self.kind == "gptq" and self.qzeros is None:
            raise ValueError("gptq weights need qzeros")

    @classmethod
    def dense(cls, weight: torch.Tensor) -> MoEWeight:
        return cls("dense", weight)

    @classmethod
    def gptq(
        cls,
        qweight: torch.Tensor,
        qzeros: torch.Tensor,
        scales: torch.Tensor,
        g_idx: torch.Tensor | None = None,
        bits: int = 4,
    ) -> MoEWeight:
        return cls("gptq", qweight, scales, qzeros, g_idx, bits)

    @classmethod
    def w8(cls, weight: torch.Tensor, scales: torch.Tensor) -> MoEWeight:
        return cls("w8", weight, scales)

    def to(self, device: torch.device | str) -> MoEWeight:
        """The same weight with its tensors on `device`."""
        moved = {
            f: getattr(self, f).to(device)
            for f in ("weight", "scales", "qzeros", "g_idx")
            if getattr(self, f) is not None
        }
        return replace(self, **moved)

    @property
    def num_experts(self) -> int:
        return self.weight.shape[0]

    @property
    def out_features(self) -> int:
        """N."""
        return self.weight.shape[2] if self.kind == "gptq" else self.weight.shape[1]

    @property
    def in_features(self) -> int:
        """K."""
        if self.kind == "gptq":
            return self.weight.shape[1] * (32 // self.bits)
        return self.weight.shape[2]


def dequantize_expert(weight: MoEWeight, e: int) -> torch.Tensor:
    """W[e] [N, K] in fp32."""
    if weight.kind == "dense":
        return weight.weight[e].to(torch.float32)
    if weight.kind == "w8":
        scales = weight.scales.to(torch.float32).reshape(weight.num_experts, -1)[e]
        return weight.weight[e].to(torch.float32) * scales.reshape(-1, 1)
    g_idx = None if weight.g_idx is None else weight.g_idx[e]
    scales = weight.scales[e].to(torch.float32)  # exact: not rounded to the scales' dtype
    return dequantize_gptq(weight.weight[e], weight.qzeros[e], scales, g_idx, weight.bits)


def moe_align_block_size(
    topk_ids: torch.Tensor, block_size: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] -> (sorted_token_ids int32 [P], expert_ids int32 [P / block_size],
    num_tokens_post_padded int32 [1] = P).

    sorted_token_ids lists the pair ids t * k + j grouped by expert (ascending expert, pairs in
    ascending order within one), each expert's run padded with the sentinel T * k up to a
    multiple of block_size; an expert without pairs gets no block. expert_ids[b] is the expert of
    block b. One host sync (the padded total)."""
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [T, k], got {tuple(topk_ids.shape)}")
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_pairs = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)[:num_experts]
    blocks = (counts + block_size - 1) // block_size
    padded_start = torch.cumsum(blocks * block_size, 0) - blocks * block_size
    start = torch.cumsum(counts, 0) - counts
    sorted_experts, order = flat.sort(stable=True)
    rank = torch.arange(num_pairs, device=device) - start[sorted_experts]  # place in its run
    total = int(blocks.sum()) * block_size
    sorted_ids = torch.full((total,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids[padded_start[sorted_experts] + rank] = order.to(torch.int32)
    experts = torch.arange(num_experts, dtype=torch.int32, device=device)
    expert_ids = torch.repeat_interleave(experts, blocks, output_size=total // block_size)
    num_post_pad = torch.tensor([total], dtype=torch.int32, device=device)
    return sorted_ids, expert_ids, num_post_pad


def moe_gemm_ref(
    x: torch.Tensor,
    weight: MoEWeight,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, K] -> pairs [T * k, N] in x's dtype: row t * k + j = x[t] @ W[topk_ids[t, j]].T,
    times topk_weights[t, j] when given. Each used expert is dequantized once."""
    top_k = topk_ids.shape[1]
    ids = topk_ids.reshape(-1).to(torch.int64)
    rows = x.to(torch.float32).repeat_interleave(top_k, dim=0)  # [T * k, K]
    out = torch.zeros(ids.numel(), weight.out_features, dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():
        sel = (ids == e).nonzero().squeeze(1)
        out[sel] = rows[sel] @ dequantize_expert(weight, e).t()
    if topk_weights is not None:
        out = out * topk_weights.reshape(-1, 1).to(torch.float32)
    return out.to(x.dtype)


def sum_pairs(pairs: torch.Tensor, top_k: int) -> torch.Tensor:
    """[T * k, N] -> [T, N]: the sum over k in fp32, rounded once to pairs' dtype."""
    return pairs.view(-1, top_k, pairs.shape[-1]).sum(dim=1, dtype=torch.float32).to(pairs.dtype)


def moe_linear_ref(
    x: torch.Tensor, weight: MoEWeight, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """x [T, K] -> [T, N]: out[t] = sum_j topk_weights[t, j] * x[t] @ W[topk_ids[t, j]].T."""
    pairs = moe_gemm_ref(x, weight, topk_ids, topk_weights)
    return sum_pairs(pairs, topk_ids.shape[1])


def fused_experts_ref(
    x: torch.Tensor,
    w13: MoEWeight,
    w2: MoEWeight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """SwiGLU experts: x [T, H] -> [T, H]. w13 [E, 2I, H] stacks gate over up (rows 0..I-1 the
    gate), w2 [E, H, I] is down; silu_and_mul runs on each pair's rounded gate_up output."""
    gate_up = moe_gemm_ref(x, w13, topk_ids)  # [T * k, 2I]
    act = silu_and_mul_ref(gate_up)  # [T * k, I]
    pairs = moe_gemm_ref(act, w2, topk_ids.reshape(-1, 1), topk_weights.reshape(-1, 1))
    return sum_pairs(pairs, topk_ids.shape[1])
