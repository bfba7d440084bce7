"""Pure-torch references of the decoder's small per-layer ops (also the path off CPU).

    rms_norm_ref(x, weight, eps)                 -> out
    rms_norm_ref(x, weight, eps, residual)       -> (out, residual + x)    vLLM's fused_add_rms_norm
    rope_neox_ref(q, k, positions, cos_sin_cache, head_dim) -> (q, k)      rotate-half RoPE
    silu_and_mul_ref(x)                          -> silu(x[..., :D]) * x[..., D:]  (vLLM's)

RMSNorm is computed in fp32 and cast back before the weight, as Hugging Face's LlamaRMSNorm;
RoPE multiplies in the activation dtype with cos/sin cast to it, as Hugging Face's Llama.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [..., H] -> weight * dtype(x32 / rms(x32)). With `residual`: normalizes x + residual
    and also returns that sum (the new residual stream)."""
    src = x if residual is None else x + residual
    x32 = src.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * x32.to(src.dtype)
    return out if residual is None else (out, src)


def rope_cos_sin(
    cos_sin_cache: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [num_tokens, 1, head_dim] in `dtype` from the fp32 cache [max_pos, head_dim]
    (cos half | sin half)."""
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [num_tokens, head_dim // 2]
    cos = torch.cat((cos, cos), dim=-1)[:, None, :].to(dtype)
    sin = torch.cat((sin, sin), dim=-1)[:, None, :].to(dtype)
    return cos, sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope_ref(
    x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], head_dim: int
) -> torch.Tensor:
    """x [num_tokens, heads * head_dim] rotated by the cos/sin of each token's position."""
    cos, sin = cos_sin
    heads = x.view(x.shape[0], -1, head_dim)  # [num_tokens, heads, head_dim]
    return (heads * cos + _rotate_half(heads) * sin).view(x.shape)


def rope_neox_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
    cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq * D], k [T, Hk * D] -> rotated copies. `cos_sin`: already gathered from the
    cache for these positions in q's dtype (a model gathers them once per step)."""
    if cos_sin is None:
        cos_sin = rope_cos_sin(cos_sin_cache, positions, q.dtype)
    return apply_rope_ref(q, cos_sin, head_dim), apply_rope_ref(k, cos_sin, head_dim)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2D], the fused gate/up projection's output -> silu(gate) * up [..., D], in x's
    dtype as Hugging Face's LlamaMLP computes it."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
