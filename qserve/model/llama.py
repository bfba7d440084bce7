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

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from qserve.kernels import ops
from qserve.model.attention import Attention, AttentionMetadata
from qserve.model.config import ModelConfig
from qserve.model.merge import MergedLinear, merge_linears
from qserve.model.moe import SparseMoeBlock
from qserve.model.rotary import Rope, RotaryEmbedding


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


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
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
            scale=config.attention_scale or config.head_dim**-0.5,
            sliding_window=config.layer_window(layer),
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
    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Mixtral, Qwen3-MoE: a mixture of experts in the layers the config names (moe.py)
        moe = layer in config.moe_layers
        self.mlp = SparseMoeBlock(config, Linear) if moe else LlamaMLP(config)

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
            LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)
        # a pipeline-parallel stage (qserve.parallel.pipeline_parallel.PPRank): its layers
        # take the previous stage's states and pass theirs on; None: the whole model here
        self.stage: Any = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        if self.stage is not None:  # its layers, in micro-batches between the stages
            return self.stage.forward(self, input_ids, positions, kv_caches, attn_metadata)
        hidden = self.embed(input_ids)  # [num_tokens, hidden]
        hidden, residual = self.decode_layers(hidden, None, positions, kv_caches, attn_metadata)
        return self.final_norm(hidden, residual)

    # what a pipeline stage runs (`PPRank.forward`): embed (stage 0), the layers on the states
    # the previous stage sent, the final norm (last stage)
    has_residual = True  # the layers carry a residual stream beside the hidden states

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def decode_layers(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decoder layers on (hidden, residual stream); residual None before the first."""
        rope = self.rotary_emb(positions, attn_metadata)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, rope, kv_cache, attn_metadata)
        return hidden, residual

    def final_norm(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        return self.norm(hidden) if residual is None else self.norm(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    """The Llama family's causal LM over a flat batch of new tokens from many sequences."""

    model_class: type[nn.Module] = LlamaModel  # the decoder stack (Gemma 3 has its own)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = self.model_class(config)
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
