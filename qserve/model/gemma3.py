"""Gemma 3 (text) for a flat varlen batch over paged KV, as transformers' Gemma3ForCausalLM.

What differs from the Llama family (`qserve.model.llama`, whose attention and MLP modules this
reuses, so that loading, quantized layers and merged projections work the same):

    embeddings times sqrt(hidden) (rounded to the weights' dtype), tied to lm_head
    RMSNorm with weight (1 + w), in fp32 and cast back after the weight, also on q and k
    four norms per layer: before and after attention, before and after the MLP
    gelu-tanh MLP; q.k scaled by query_pre_attn_scalar ** -0.5
    sliding-window (local) layers on their own RoPE base, full (global) ones on rope_theta
    final logits optionally soft-capped: cap * tanh(logits / cap)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from qserve.model.attention import AttentionMetadata
from qserve.model.config import ModelConfig
from qserve.model.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from qserve.model.rotary import Rope, RotaryEmbedding


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + w), computed in fp32 and cast back at the end (Gemma3RMSNorm)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3Attention(LlamaAttention):
    """Llama's attention (window and scale from the config) with Gemma's q/k norms."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__(config, layer)
        self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)


class Gemma3MLP(LlamaMLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma3Attention(config, layer)
        self.mlp = Gemma3MLP(config)
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.is_sliding = config.layer_window(layer) is not None

    def forward(
        self,
        hidden: torch.Tensor,
        rope: Rope,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(hidden), rope, kv_cache, attn_metadata)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp)


class Gemma3Model(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_scale = config.embed_scale or 1.0
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)  # global layers
        local = dataclasses.replace(
            config, rope_theta=config.local_rope_theta or config.rope_theta, rope_scaling=None
        )
        self.rotary_emb_local = RotaryEmbedding(local)
        self.stage: Any = None  # a pipeline-parallel stage, as LlamaModel's

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        if self.stage is not None:
            return self.stage.forward(self, input_ids, positions, kv_caches, attn_metadata)
        hidden = self.embed(input_ids)
        hidden, _ = self.decode_layers(hidden, None, positions, kv_caches, attn_metadata)
        return self.final_norm(hidden, None)

    has_residual = False  # each layer adds its own output back (post-norms)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        embeds = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        return embeds * torch.tensor(self.embed_scale, dtype=embeds.dtype)

    def decode_layers(
        self,
        hidden: torch.Tensor,
        residual: None,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, None]:
        ropes = {
            False: self.rotary_emb(positions, attn_metadata),
            True: self.rotary_emb_local(positions, attn_metadata),
        }
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(hidden, ropes[layer.is_sliding], kv_cache, attn_metadata)
        return hidden, None

    def final_norm(self, hidden: torch.Tensor, residual: None) -> torch.Tensor:
        return self.norm(hidden)


class Gemma3ForCausalLM(LlamaForCausalLM):
    model_class = Gemma3Model

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else cap * torch.tanh(logits / cap)
