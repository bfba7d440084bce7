"""The Llama family (Llama, Mistral, Qwen2, Qwen3, Phi-3) written for a flat varlen batch over
paged KV.

Module names mirror Hugging Face's so checkpoint keys load directly (`model.layers.0.self_attn.
q_proj.weight`, ...). q/k/v and gate/up stay separate `Linear` modules: quantized layers are
swapped in per module by name. After loading, `merge_projections` fuses each group whose kernel
path allows it into one matmul (`qserve.model.merge`); the forward passes take either form.
Phi-3's checkpoints hold them fused already: its layers have `qkv_proj` and `gate_up_proj`
modules (q, k, v and gate, up in that order along the output dim), quantized as one linear each.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from qserve.kernels import ops
from qserve.kernels.model_ops_ref import rope_cos_sin
from qserve.model.attention import Attention, AttentionMetadata
from qserve.model.config import ModelConfig, RopeScaling
from qserve.model.merge import MergedLinear, merge_linears

RopeCosSin = tuple[torch.Tensor, torch.Tensor]  # cos, sin: [num_tokens, 1, head_dim] each


class Linear(nn.Linear):
    """nn.Linear through `ops.linear` (16-bit batches on CPUs without native bf16 accumulate
    in fp32: several times faster there)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, cast back before the weight (as Hugging Face's LlamaRMSNorm).

    forward(x) -> normed; forward(x, residual) -> (normed x + residual, x + residual), vLLM's
    fused add + norm (on CPU the sum is written into `residual` in place)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return ops.rms_norm(x, self.weight, self.eps, residual)


def rope_inv_freq(
    head_dim: int,
    theta: float,
    scaling: RopeScaling | None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Inverse frequencies, fp32 [head_dim // 2], with optional Llama 3.1 scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    return inv_freq if scaling is None else _llama3_scale(inv_freq, scaling)


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


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, bias = config.hidden_size, config.attention_bias
        self.qkv_sizes = [config.q_size, config.kv_size, config.kv_size]
        self.fused = config.fused_projections
        self.qkv_proj: MergedLinear | None = None  # set by merge(), or the checkpoint's (Phi-3)
        if self.fused:
            self.qkv_proj = Linear(hidden, sum(self.qkv_sizes), bias=bias)
        else:
            self.q_proj = Linear(hidden, config.q_size, bias=bias)
            self.k_proj = Linear(hidden, config.kv_size, bias=bias)
            self.v_proj = Linear(hidden, config.kv_size, bias=bias)
        self.o_proj = Linear(config.q_size, hidden, bias=config.o_proj_bias)
        self.head_dim = config.head_dim
        eps = config.rms_norm_eps
        self.q_norm = RMSNorm(config.head_dim, eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, eps) if config.qk_norm else None
        self.attn = Attention(
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            scale=config.head_dim**-0.5,
        )

    def forward(
        self,
        hidden: torch.Tensor,
        rope: Rope,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        if self.qkv_proj is None:
            q, k, v = self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)
        else:  # views into one [num_tokens, q + 2 kv] output
            q, k, v = self.qkv_proj(hidden).split_with_sizes(self.qkv_sizes, dim=-1)
        if self.q_norm is not None:
            q, k = self._head_norm(self.q_norm, q), self._head_norm(self.k_norm, k)
        q, k = rope.apply(q, k)  # [num_tokens, num_heads / num_kv_heads * head_dim]
        out = self.attn(q, k, v, kv_cache, attn_metadata)  # [num_tokens, num_heads * head_dim]
        return self.o_proj(out)

    def _head_norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm over each head_dim slice of x [num_tokens, heads * head_dim] (Qwen3)."""
        return norm(x.reshape(-1, self.head_dim)).view(x.shape[0], -1)

    def merge(self) -> bool:
        """Fuse q/k/v into one matmul if their kernel path allows; True if merged."""
        if self.fused:
            return True
        self.qkv_proj = merge_linears([self.q_proj, self.k_proj, self.v_proj])
        return self.qkv_proj is not None


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, inter, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.fused = config.fused_projections
        self.gate_up_proj: MergedLinear | None = None  # set by merge(), or the checkpoint's
        if self.fused:
            self.gate_up_proj = Linear(hidden, 2 * inter, bias=bias)
        else:
            self.gate_proj = Linear(hidden, inter, bias=bias)
            self.up_proj = Linear(hidden, inter, bias=bias)
        self.down_proj = Linear(inter, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))

    def merge(self) -> bool:
        """Fuse gate/up into one matmul if their kernel path allows; True if merged."""
        if self.fused:
            return True
        self.gate_up_proj = merge_linears([self.gate_proj, self.up_proj])
        return self.gate_up_proj is not None


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: Rope,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) -> (this layer's MLP output, the residual stream before it), as
        vLLM: the next norm adds them (the first layer gets residual None)."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rope, kv_cache, attn_metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        rope = self.rotary_emb(positions, attn_metadata)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, rope, kv_cache, attn_metadata)
        if residual is None:  # no layers
            return self.norm(hidden)
        return self.norm(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    """The Llama family's causal LM over a flat batch of new tokens from many sequences."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.load_report = None  # loader.LoadReport: scheme and kernel paths, set at load
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding matrix with lm_head when the config says so (and lm_head is a
        plain linear: a quantized lm_head has its own tensors)."""
        if self.config.tie_word_embeddings and isinstance(self.lm_head, nn.Linear):
            self.lm_head.weight = self.model.embed_tokens.weight

    def merge_projections(self) -> list[str]:
        """Fuse q/k/v and gate/up in every layer where the kernel paths allow (after loading
        and preparing the weights); the merged kinds, vLLM's names: qkv_proj, gate_up_proj."""
        layers = self.model.layers
        qkv = [layer.self_attn.merge() for layer in layers]
        gate_up = [layer.mlp.merge() for layer in layers]
        kinds = [("qkv_proj", qkv), ("gate_up_proj", gate_up)]
        return [kind for kind, done in kinds if done and all(done)]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: int64 [num_tokens] -> final-norm hidden [num_tokens, hidden]."""
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_seqs, hidden] -> fp32 logits [num_seqs, vocab]."""
        return self.lm_head(hidden).float()
