"""Rotary position embeddings: inverse frequencies (plain, linear, Llama 3.1, LongRoPE), the
cos/sin cache indexed by position, and the rotation of one step's tokens."""

from __future__ import annotations

import math

import torch
from torch import nn

from qserve.kernels import ops
from qserve.kernels.model_ops_ref import rope_cos_sin
from qserve.model.attention import AttentionMetadata
from qserve.model.config import ModelConfig, RopeScaling

RopeCosSin = tuple[torch.Tensor, torch.Tensor]  # cos, sin: [num_tokens, 1, head_dim] each


def rope_inv_freq(
    head_dim: int,
    theta: float,
    scaling: RopeScaling | None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Inverse frequencies, fp32 [head_dim // 2], with optional Llama 3.1 or linear scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":  # positions divided by factor
        return inv_freq / scaling.factor
    return _llama3_scale(inv_freq, scaling)


def _llama3_scale(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def longrope_inv_freq(
    head_dim: int, theta: float, factors: tuple[float, ...], device: torch.device | str | None
) -> torch.Tensor:
    """LongRoPE's inverse frequencies: the plain ones divided by one factor each."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    ext = torch.tensor(factors, dtype=torch.float32, device=device)
    return 1.0 / (ext * theta**exponents)


def _cos_sin_cache(inv_freq: torch.Tensor, num_positions: int) -> torch.Tensor:
    positions = torch.arange(num_positions, dtype=torch.int64, device=inv_freq.device).float()
    freqs = positions[:, None] * inv_freq[None, :]  # [num_positions, head_dim // 2]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


class RotaryEmbedding(nn.Module):
    """Rotate-half (neox) RoPE with a cos/sin cache indexed by position.

    LongRoPE (Phi-3) keeps two caches in one: rows [0, original) with the short factors, then
    rows for every position with the long factors, both times attention_factor. A token takes
    the long rows when transformers would: when its sequence's prompt, or the sequence up to the
    token itself, is longer than `original_max_position_embeddings` (transformers switches per
    forward call: the whole prompt, then one token at a time), so a prompt chunked or recomputed
    after preemption rotates exactly as it would in one piece.

    cos_sin_cache: fp32 [max_position_embeddings, head_dim] = cat(cos(freqs), sin(freqs)),
    freqs = position * inv_freq ([max_pos, head_dim // 2]). A non-persistent buffer: the loader
    rebuilds it with `init_cache` after the weights land on a device.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.max_position = config.max_position_embeddings
        self.theta = config.rope_theta
        self.scaling = config.rope_scaling
        # Built on the default device (cheap under `torch.device("meta")`; see init_cache).
        self.register_buffer("cos_sin_cache", self._compute_cache(None), persistent=False)

    @property
    def longrope(self) -> bool:
        return self.scaling is not None and self.scaling.rope_type == "longrope"

    def _compute_cache(self, device: torch.device | str | None) -> torch.Tensor:
        if self.longrope:
            return self._longrope_cache(device)
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling, device)
        return _cos_sin_cache(inv_freq, self.max_position)

    def _longrope_cache(self, device: torch.device | str | None) -> torch.Tensor:
        s = self.scaling
        short = longrope_inv_freq(self.head_dim, self.theta, s.short_factor, device)
        long = longrope_inv_freq(self.head_dim, self.theta, s.long_factor, device)
        caches = (
            _cos_sin_cache(short, s.original_max_position_embeddings),
            _cos_sin_cache(long, self.max_position),
        )
        return torch.cat(caches) * s.attention_factor

    def init_cache(self, device: torch.device | str) -> None:
        self.cos_sin_cache = self._compute_cache(device)

    def forward(
        self, positions: torch.Tensor, attn_metadata: AttentionMetadata | None = None
    ) -> Rope:
        """The rotation of one step's tokens (positions int64 [num_tokens]), for every layer."""
        if self.longrope:
            positions = self._longrope_rows(positions, attn_metadata)
        return Rope(positions, self.cos_sin_cache, self.head_dim)

    def _longrope_rows(self, positions: torch.Tensor, md: AttentionMetadata | None) -> torch.Tensor:
        """Each token's row of the cache: its position, past the short rows if it goes long."""
        original = self.scaling.original_max_position_embeddings
        prompt_lens = torch.zeros_like(positions)
        if md is not None and md.prompt_lens_cpu:
            lens, counts = torch.tensor(md.prompt_lens_cpu), torch.tensor(md.query_lens_cpu)
            prompt_lens = torch.repeat_interleave(lens, counts).to(positions.device)
        long = torch.maximum(prompt_lens, positions + 1) > original
        return positions + long.to(positions.dtype) * original


class Rope:
    """RoPE of one step: `apply(q, k)` in every layer. The torch path gathers cos/sin once per
    step (on first use); the C++ path on CPU reads the cache by position and rotates in place."""

    def __init__(self, positions: torch.Tensor, cos_sin_cache: torch.Tensor, head_dim: int):
        self.positions = positions
        self.cos_sin_cache = cos_sin_cache
        self.head_dim = head_dim
        self._cos_sin: RopeCosSin | None = None

    def cos_sin(self, dtype: torch.dtype) -> RopeCosSin:
        if self._cos_sin is None or self._cos_sin[0].dtype != dtype:
            self._cos_sin = rope_cos_sin(self.cos_sin_cache, self.positions, dtype)
        return self._cos_sin

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [num_tokens, num_heads * head_dim], k [num_tokens, num_kv_heads * head_dim]."""
        return ops.rope_neox(
            q, k, self.positions, self.cos_sin_cache, self.head_dim, cos_sin=self.cos_sin
        )
