"""Folding per-input-channel scales s [K] into the op that produces a group of linears' input.

    y = W x = (W diag(s)) (diag(s)^-1 x)

The linears fed by x get W * s (columns), and the op before them absorbs 1/s: an RMSNorm weight,
or the output rows (and bias) of a previous linear (v_proj before o_proj, up_proj before
down_proj). The function of the block is unchanged; only the quantization difficulty moves.
Shared by AWQ and SmoothQuant.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from qserve.errors import QServeError

__all__ = [
    "scale_columns",
    "fold_into_norm",
    "fold_into_rows",
    "apply_scales",
    "clip_weight",
    "ScaleResult",
]


def scale_columns(W: Tensor, s: Tensor) -> Tensor:
    """W [N, K] * s [K] (per input channel)."""
    return W * s[None, :].to(W.dtype)


# Norms that scale by (1 + weight) (Gemma's): folding keeps 1 + weight' = (1 + weight) / s.
UNIT_OFFSET_NORMS = ("GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm")


def fold_into_norm(weight: Tensor, s: Tensor, offset: float = 0.0) -> Tensor:
    """RMSNorm weight [K] / s; a norm scaling by (offset + w) gets (offset + w) / s - offset."""
    if not offset:
        return weight / s.to(weight.dtype)
    return (weight + offset) / s.to(weight.dtype) - offset


def norm_offset(norm: nn.Module) -> float:
    """1.0 for the norms that scale by (1 + weight), else 0.0."""
    return 1.0 if type(norm).__name__ in UNIT_OFFSET_NORMS else 0.0


def fold_into_rows(W: Tensor, b: Tensor | None, s: Tensor) -> tuple[Tensor, Tensor | None]:
    """Previous linear W [K, K_in] (and bias [K]) with output channel k divided by s[k]."""
    W = W / s[:, None].to(W.dtype)
    return W, (None if b is None else b / s.to(b.dtype))


@torch.no_grad()
def apply_scales(prev: nn.Module, linears: list[nn.Linear], s: Tensor) -> None:
    """Fold 1/s into `prev` (a norm with `.weight` [K] or an nn.Linear) and s into `linears`."""
    if isinstance(prev, nn.Linear):
        W, b = fold_into_rows(prev.weight.data, prev.bias, s)
        prev.weight.data.copy_(W)
        if b is not None:
            prev.bias.data.copy_(b)
    else:
        prev.weight.data.copy_(fold_into_norm(prev.weight.data, s, norm_offset(prev)))
    for lin in linears:
        lin.weight.data.copy_(scale_columns(lin.weight.data, s))


def clip_weight(W: Tensor, max_val: Tensor, group_size: int) -> Tensor:
    """Clamp W [N, K] to [-max_val, max_val] per group (max_val [G, N])."""
    K = W.shape[1]
    gs = K if group_size == -1 else group_size
    m = max_val.t().repeat_interleave(gs, dim=1)[:, :K].to(W.dtype)  # [N, K]
    return torch.maximum(torch.minimum(W, m), -m)


@dataclass
class ScaleResult:
    """The outcome of an AWQ or SmoothQuant search, to save and replay on the same model.

    `scales`: "<prev module>" -> s [K], in the order they were folded (floating point cares);
    `linears`: "<prev module>" -> the linears it feeds; `clips`: "<linear>" -> max_val [G, N]
    (AWQ only). Names are full module names (model.layers.3.input_layernorm).
    """

    scales: dict[str, Tensor] = field(default_factory=dict)
    linears: dict[str, list[str]] = field(default_factory=dict)
    clips: dict[str, Tensor] = field(default_factory=dict)

    def save(self, path: str | Path) -> None:
        tensors = {f"scale:{k}": v.contiguous() for k, v in self.scales.items()}
        tensors |= {f"clip:{k}": v.contiguous() for k, v in self.clips.items()}
        meta = {f"linears:{k}": ",".join(v) for k, v in self.linears.items()}
        meta["order"] = ",".join(self.scales)
        save_file(tensors, str(path), metadata=meta)

    @classmethod
    def load(cls, path: str | Path) -> ScaleResult:
        try:
            with safe_open(str(path), "pt") as f:
                meta = f.metadata() or {}
            tensors = load_file(str(path))
        except (OSError, SafetensorError) as exc:
            raise QServeError(
                f"scales file {path} is not a saved scale search ({exc})", param="scales"
            ) from None
        result = cls()
        if any(key.split(":", 1)[0] not in ("scale", "clip") for key in tensors):
            raise QServeError(f"scales file {path} is not a saved scale search", "scales")
        for name in filter(None, meta.get("order", "").split(",")):
            if f"scale:{name}" not in tensors:
                raise QServeError(f"scales file {path} lacks the scales of {name}", "scales")
            result.scales[name] = tensors[f"scale:{name}"]
        for key, value in tensors.items():
            kind, name = key.split(":", 1)
            (result.scales if kind == "scale" else result.clips)[name] = value
        for key, value in meta.items():
            if key.startswith("linears:"):
                result.linears[key.split(":", 1)[1]] = value.split(",")
        return result

    @torch.no_grad()
    def apply(self, model: nn.Module, group_size: int = -1) -> None:
        """Fold every scale into `model`, then clamp the clipped linears."""
        modules = dict(model.named_modules())
        missing = [n for n in [*self.scales, *self.clips] if n not in modules]
        if missing:
            raise QServeError(f"scales do not match the model: it has no module {missing[0]}")
        for prev, s in self.scales.items():
            apply_scales(modules[prev], [modules[n] for n in self.linears[prev]], s)
        for name, max_val in self.clips.items():
            weight = modules[name].weight
            weight.data.copy_(clip_weight(weight.data, max_val, group_size))
