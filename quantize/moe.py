"""Mixture-of-experts blocks for calibration: per-expert linears that see only their tokens.

transformers 5 keeps a sparse MoE block's experts as fused 3-D parameters
(`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]) and its router as a
`TopKRouter` holding a bare weight, so no expert has a linear module whose inputs a hook could
see. `prepare_moe` replaces each such block, before calibration, by a `CalibrationMoe` that
computes the same function with nn.Linear children named as checkpoints name them:

    gate                        the router, [E, H]: softmax in fp32 -> top-k -> (renormalized)
    experts.N.<gate|up|down>    Mixtral's w1 / w3 / w2, Qwen3-MoE's gate_proj / up_proj / down_proj

Its forward routes as transformers does, then calls each expert once on exactly the tokens routed
to it (rows in (k, token) order, as transformers' eager experts gather them), so a forward
pre-hook on an expert's linear collects the hidden states of its routed tokens and nothing else:
an expert no token is routed to is not called at all. Each call records the token rows it got
(`CalibrationExpert.routed_tokens`), which GPTAQ uses to pair them with the float model's inputs
at the same tokens (`float_expert_input`).

The weights of the new linears are views of the fused tensors (no copy); blocks still on the
meta device (calibration offloaded to disk) are replaced on meta and read per expert later.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from qserve.quantize.arch import ArchSpec, MoeSpec
from qserve.quantize.capture import collect_inputs

__all__ = ["CalibrationExpert", "CalibrationMoe", "prepare_moe", "route", "float_expert_input"]


def route(logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """Router logits [T, E] -> (weights fp32 [T, k], expert ids [T, k]), transformers' routing."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class CalibrationExpert(nn.Module):
    """One SwiGLU expert, down(act(gate(x)) * up(x)), its linears under the checkpoint's names."""

    def __init__(self, hidden: int, inter: int, names: tuple[str, str, str], act: Any) -> None:
        super().__init__()
        self.names = names
        shapes = ((hidden, inter), (hidden, inter), (inter, hidden))
        for name, (n_in, n_out) in zip(names, shapes, strict=True):
            self.add_module(name, nn.Linear(n_in, n_out, bias=False))
        self.act = act
        self.routed_tokens: Tensor | None = None  # the token rows of its last call

    def forward(self, x: Tensor) -> Tensor:
        gate, up, down = (self._modules[n] for n in self.names)
        return down(self.act(gate(x)) * up(x))


class CalibrationMoe(nn.Module):
    """A sparse MoE block (router `gate`, `experts` list) whose experts run on their tokens."""

    def __init__(
        self, hidden: int, inter: int, num_experts: int, top_k: int, renormalize: bool,
        names: tuple[str, str, str], act: Any,
    ) -> None:  # fmt: skip
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(
            CalibrationExpert(hidden, inter, names, act) for _ in range(num_experts)
        )

    def forward(self, hidden: Tensor) -> Tensor:
        """hidden [..., H] -> [..., H]: sum_k weight[t, k] * expert[id[t, k]](x[t])."""
        x = hidden.reshape(-1, hidden.shape[-1])
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        out = torch.zeros_like(x)
        by_k = ids.t()  # [k, T]: rows of each expert in (k, token) order
        for e, expert in enumerate(self.experts):
            k_pos, tokens = torch.where(by_k == e)
            if tokens.numel() == 0:
                continue
            expert.routed_tokens = tokens
            y = expert(x[tokens]) * weights[tokens, k_pos, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        return out.reshape(hidden.shape)


def prepare_moe(model: nn.Module, spec: ArchSpec) -> int:
    """Replace every transformers sparse MoE block of `model` by its CalibrationMoe (in place;
    blocks already replaced are left alone). Returns how many were replaced."""
    if spec.moe is None:
        return 0
    replaced = 0
    for block in model.get_submodule(spec.blocks):
        parent, _, child = spec.moe.block.rpartition(".")
        owner = block.get_submodule(parent) if parent else block
        hf = getattr(owner, child)
        fused = hasattr(getattr(hf, "experts", None), "gate_up_proj")
        if isinstance(hf, CalibrationMoe) or not fused:
            continue  # replaced already, or a dense MLP (Qwen3-MoE's mlp_only_layers)
        setattr(owner, child, _from_transformers(hf, spec.moe, model.config))
        replaced += 1
    return replaced


def _from_transformers(hf: nn.Module, moe: MoeSpec, config: Any) -> CalibrationMoe:
    gate_up, down = hf.experts.gate_up_proj, hf.experts.down_proj  # [E, 2I, H], [E, H, I]
    num_experts, two_inter, hidden = gate_up.shape
    inter = two_inter // 2
    renormalize = moe.renormalize is None or bool(getattr(config, moe.renormalize))
    with torch.device("meta"):
        new = CalibrationMoe(
            hidden, inter, num_experts, hf.gate.top_k, renormalize, moe.experts, hf.experts.act_fn
        )
    new.requires_grad_(False)
    if gate_up.is_meta:
        return new
    g, u, d = moe.experts
    state = {"gate.weight": hf.gate.weight.detach()}
    for e in range(num_experts):
        state[f"experts.{e}.{g}.weight"] = gate_up[e, :inter].detach()
        state[f"experts.{e}.{u}.weight"] = gate_up[e, inter:].detach()
        state[f"experts.{e}.{d}.weight"] = down[e].detach()
    new.load_state_dict(state, assign=True)
    return new


def float_expert_input(fp_block: nn.Module, name: str, x_fp: Tensor) -> Tensor:
    """The input of expert linear `name` in the float block `fp_block` when its expert runs on
    the float MoE inputs `x_fp` [n, H] (the rows of the tokens the quantized block routed to it)."""
    expert = fp_block.get_submodule(name.rpartition(".")[0])
    linear = fp_block.get_submodule(name)
    return collect_inputs(expert, {name: linear}, [x_fp], {}, lambda _, v: v)[name]
