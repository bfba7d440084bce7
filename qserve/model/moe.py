"""Sparse mixture-of-experts blocks (Mixtral, Qwen3-MoE) for a flat varlen batch.

    router (`gate`, a linear to one logit per expert) -> softmax over the experts in fp32
    -> top-k (topk_weights, topk_ids) -> renormalized to sum to 1 where the model does it
    -> out[t] = sum_k topk_weights[t, k] * expert[topk_ids[t, k]](x[t])   (SwiGLU experts)

vLLM's names: `select_experts` routes, `fused_moe` runs the experts over the step's tokens
grouped by expert (the token-expert pairs sorted by expert, their rows gathered once with
index_select; each chosen expert runs once over its contiguous slice; the outputs go back to
(token, k) order with index_copy_ and are summed weighted in one batched matmul), `FusedMoE`
holds the experts and `SparseMoeBlock` is the layer's MLP. Each expert keeps its three linears
as modules named as the checkpoint names them (`experts.N.w1` / `gate_proj`, ...:
`ModelConfig.expert_names`), so a quantized linear can be swapped in per expert by name, and
gate/up merge into one matmul per expert where their kernel path allows (`qserve.model.merge`).
On CUDA, a block whose experts' formats the Triton grouped GEMM takes has them stacked once
after loading and runs `ops.fused_experts` instead (`qserve.model.moe_fused`: its
`StackedExperts` replaces `FusedMoE`); on CPU the experts run grouped by expert as above.

Checkpoints: per-expert tensors as on the Hub and as transformers' `save_pretrained` writes
them load as they are; Mixtral's `block_sparse_moe.` prefix is read as `mlp.` (transformers 5's
renaming), and its experts' `gate_proj` / `up_proj` / `down_proj` as `w1` / `w3` / `w2` (the
names GPTQModel 7.6 writes Mixtral's quantized experts under on transformers 5); the fused
3-D layout of transformers 5's in-memory state dict (`experts.gate_up_proj` [E, 2I, H],
`experts.down_proj` [E, H, I]) is split per expert.
Quantized checkpoints hold each expert's linears quantized on their own (`experts.N.w1.qweight`,
...): the loader swaps a quantized linear in per expert, asking the scheme under the name the
checkpoint uses (`checkpoint_namer`); the router stays dense whatever the scheme says
(`is_router`), as in vLLM, whose MoE layers build it without a quantization config.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from qserve.kernels import ops
from qserve.model.config import ModelConfig
from qserve.model.merge import MergedLinear, merge_linears

Expert = Callable[[torch.Tensor], torch.Tensor]  # x [n, hidden] -> [n, hidden]
# (checkpoint's, ours) name parts read under our module names: transformers 5's renaming of
# Mixtral's block, and the per-expert names GPTQModel 7.6 gives Mixtral's experts (as the
# `defuser` package unfuses them) read as the Hub's.
CHECKPOINT_RENAMES = ((".block_sparse_moe.", ".mlp."),)
MIXTRAL_EXPERT_RENAMES = ((".gate_proj.", ".w1."), (".up_proj.", ".w3."), (".down_proj.", ".w2."))
Renames = list[tuple[str, str]]


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_weights fp32 [T, k], topk_ids int64 [T, k]): the top-k of
    the fp32 softmax over the experts, renormalized to sum to 1 if `renormalize`."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


def fused_moe(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    experts: Sequence[Expert],
) -> torch.Tensor:
    """sum_k topk_weights[t, k] * experts[topk_ids[t, k]](x[t]) for every token t of x [T, H],
    each chosen expert run once over all its tokens (a contiguous slice of the token-expert
    pairs sorted by expert). The weighted sum over k is one batched matmul in x's dtype (the
    weights rounded to it, as transformers' Qwen3-MoE does; fp32 accumulation in 16 bits).

    A fixed number of tensor ops besides the experts' own, however many experts run: the
    dispatch overhead stays flat from one decode token to a long prefill. Memory: three
    [num_tokens * top_k, hidden] buffers in x's dtype."""
    num_tokens, top_k = topk_ids.shape
    if num_tokens <= 1:  # one decode token (or none): its experts in turn, nothing to sort
        return _one_token_moe(x, topk_weights, topk_ids, experts)
    sorted_ids, order = topk_ids.reshape(-1).sort(stable=True)  # pairs grouped by expert
    counts = torch.bincount(sorted_ids, minlength=len(experts)).tolist()  # one host sync
    rows = x.index_select(0, order // top_k)  # each sorted pair's token
    outs = [experts[e](chunk) for e, chunk in enumerate(rows.split(counts)) if counts[e]]
    pairs = torch.empty(num_tokens * top_k, x.shape[1], dtype=outs[0].dtype, device=x.device)
    pairs.index_copy_(0, order, torch.cat(outs))  # back in (token, k) order
    weights = topk_weights.to(pairs.dtype).unsqueeze(1)  # [T, 1, k]
    return torch.bmm(weights, pairs.view(num_tokens, top_k, -1)).squeeze(1)


def _one_token_moe(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, experts: Sequence[Expert]
) -> torch.Tensor:
    if x.shape[0] == 0:
        return torch.zeros_like(x)
    outs = torch.cat([experts[e](x) for e in topk_ids[0].tolist()])  # [top_k, hidden]
    return torch.mm(topk_weights.to(outs.dtype), outs)


def fused_moe_per_token(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    experts: Sequence[Expert],
) -> torch.Tensor:
    """The naive reference of `fused_moe`: a Python loop over tokens and their top-k."""
    out = torch.zeros_like(x)
    for t, (ids, ws) in enumerate(zip(topk_ids.tolist(), topk_weights, strict=True)):
        for e, w in zip(ids, ws, strict=True):
            out[t : t + 1] += (experts[e](x[t : t + 1]) * w).to(out.dtype)
    return out


class ExpertMLP(nn.Module):
    """One expert: down(silu(gate(x)) * up(x)), its linears under the checkpoint's names
    (`names` = gate, up, down: Mixtral's w1, w3, w2; Qwen3-MoE's gate_proj, up_proj, down_proj)."""

    def __init__(
        self, hidden: int, inter: int, names: Sequence[str], linear: type[nn.Linear]
    ) -> None:
        super().__init__()
        self.names = tuple(names)
        shapes = ((hidden, inter), (hidden, inter), (inter, hidden))
        for name, (n_in, n_out) in zip(self.names, shapes, strict=True):
            self.add_module(name, linear(n_in, n_out, bias=False))
        self.gate_up: MergedLinear | None = None  # set by merge()

    def projections(self) -> tuple[nn.Module, nn.Module, nn.Module]:
        """(gate, up, down), whatever they are now (dense or swapped quantized linears)."""
        gate, up, down = (self._modules[name] for name in self.names)
        return gate, up, down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = self.projections()
        if self.gate_up is None:
            return down(F.silu(gate(x)) * up(x))
        return down(ops.silu_and_mul(self.gate_up(x)))

    def merge(self) -> bool:
        """Fuse gate/up into one matmul if their kernel path allows; True if merged."""
        gate, up, _ = self.projections()
        self.gate_up = merge_linears([gate, up])
        return self.gate_up is not None


class FusedMoE(nn.ModuleList):
    """The experts of one layer (module names `experts.N.*`), run grouped by expert."""

    def __init__(self, config: ModelConfig, linear: type[nn.Linear]) -> None:
        hidden, inter = config.hidden_size, config.moe_intermediate_size
        super().__init__(
            ExpertMLP(hidden, inter, config.expert_names, linear) for _ in range(config.num_experts)
        )

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        return fused_moe(x, topk_weights, topk_ids, list(self))


class SparseMoeBlock(nn.Module):
    """A decoder layer's MLP as a mixture of experts: the router `gate` (no bias, one logit per
    expert) picks `num_experts_per_tok` experts per token; their outputs are summed weighted."""

    def __init__(self, config: ModelConfig, linear: type[nn.Linear] = nn.Linear) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.gate = linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = FusedMoE(config, linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, hidden] -> [num_tokens, hidden]."""
        topk_weights, topk_ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        return self.experts(x, topk_weights, topk_ids)

    def merge(self) -> bool:
        """Fuse each expert's gate/up where the kernel paths allow; True if all merged (experts
        stacked for the fused kernel, `moe_fused`, have gate and up in one GEMM already)."""
        if not isinstance(self.experts, FusedMoE):
            return True
        return all([expert.merge() for expert in self.experts])


def is_router(model: nn.Module, name: str) -> bool:
    """Whether module `name` of `model` is the router of a sparse MoE block."""
    parent, _, child = name.rpartition(".")
    return child == "gate" and isinstance(model.get_submodule(parent), SparseMoeBlock)


def checkpoint_renames(checkpoint_names: Iterable[str], config: ModelConfig) -> Renames:
    """The (checkpoint's, ours) name parts that this checkpoint's MoE tensors need renamed."""
    if not config.num_experts:
        return []
    pairs = list(CHECKPOINT_RENAMES)
    if config.expert_names == ("w1", "w3", "w2"):  # Mixtral, whose MLPs are all experts
        pairs += MIXTRAL_EXPERT_RENAMES
    names = list(checkpoint_names)
    return [(old, new) for old, new in pairs if any(old in n for n in names)]


def checkpoint_namer(renames: Renames) -> Callable[[str], str]:
    """Our module name -> the name the checkpoint gives it (`renames` reversed)."""

    def name(module: str) -> str:
        dotted = f"{module}."
        for theirs, ours in renames:
            dotted = dotted.replace(ours, theirs)
        return dotted[:-1]

    return name


def moe_checkpoint_tensors(
    state: dict[str, torch.Tensor], config: ModelConfig, renames: Renames
) -> dict[str, torch.Tensor]:
    """`state` under our module names (`renames` applied), and fused 3-D expert tensors
    (transformers 5's in-memory layout) split into per-expert weights."""
    if not config.num_experts:
        return state
    out = {}
    for name, tensor in state.items():
        for old, new in renames:
            name = name.replace(old, new)
        out.update(_split_fused(name, tensor, config.expert_names))
    return out


def _split_fused(name: str, tensor: torch.Tensor, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """experts.gate_up_proj [E, 2I, H] -> experts.N.<gate>/<up>.weight [I, H] each;
    experts.down_proj [E, H, I] -> experts.N.<down>.weight; any other tensor as it is."""
    prefix, _, leaf = name.rpartition(".experts.")
    if not prefix or leaf not in ("gate_up_proj", "down_proj") or tensor.dim() != 3:
        return {name: tensor}
    gate, up, down = names
    split = {}
    for e, weight in enumerate(tensor.unbind(0)):
        stem = f"{prefix}.experts.{e}"
        if leaf == "down_proj":
            split[f"{stem}.{down}.weight"] = weight
        else:
            g, u = weight.chunk(2, dim=0)
            split[f"{stem}.{gate}.weight"], split[f"{stem}.{up}.weight"] = g, u
    return split
