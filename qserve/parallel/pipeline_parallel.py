"""Pipeline-parallel model stages (issue 24): what stage r of `world` builds, loads and passes on.

The decoder layers are split into `world` contiguous ranges (`stage_layers`: as even as they
go, the earlier stages taking the remainder, as vLLM's `get_pp_indices`). Stage r's model is an
ordinary model of its layers only (`rank_config`: num_hidden_layers, and its slice of the
per-layer settings), loaded from the checkpoint's tensors of those layers renamed to local
indices (`shard_state`); embeddings, the final norm and lm_head are whole on every stage. Each
step, stage 0 embeds the tokens, and every stage runs its layers on what the previous one sent
(hidden states and the residual stream, point to point); the last stage applies the final norm
and sends the result back to stage 0, which computes logits and samples.

A step's sequences are cut into up to `--pipeline-micro-batches` (default: the stage count)
micro-batches of about equal token counts, each of at least MIN_MICRO_BATCH_TOKENS tokens
(`micro_batches`, GPipe's fill): a stage sends micro-batch m on without waiting and starts
m + 1, so the stages overlap instead of running one after the other.

    stage = PPRank(rank, world, num_layers)
    load_model(path, dtype, pp=stage)  # rank_config, shard_state, attach (model.model.stage)

A step is still one step: rank 0 schedules the next only when this one's logits are back
(vLLM's virtual engines, several steps in flight, are not built). Llama family and Gemma 3
(which has no residual stream between layers: only hidden states pass) without mixtures of
experts. With tensor parallelism as well, each stage is a tensor-parallel
group and states pass between the processes of the same tensor-parallel rank.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch
from torch import nn

from qserve.errors import QServeError
from qserve.model.config import ModelConfig

__all__ = ["PPRank", "micro_batches", "stage_layers"]

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# A micro-batch smaller than this costs more than the overlap gains: each one reads all of a
# stage's weights, so a decode step of a few sequences runs about as long whole as halved
# (Qwen2.5-Coder-0.5B fp32 at PP=2: a batch of 8 decoding 503 ms a step in turn, 546 in two
# micro-batches; 8 prompts of 128 tokens 6.17 s in turn, 4.46 s in two).
MIN_MICRO_BATCH_TOKENS = 32


def stage_layers(num_layers: int, rank: int, world: int) -> tuple[int, int]:
    """[start, end) of stage `rank`'s decoder layers: even ranges, earlier stages one more."""
    base, extra = divmod(num_layers, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


@dataclasses.dataclass(frozen=True)
class PPRank:
    """This process's stage: `rank` of `world`, over a model of `num_layers` decoder layers,
    each step cut into up to `micro_batches` micro-batches (1: the stages run in turn). With
    tensor parallelism too, every stage is `tp_size` processes and this one is `tp_rank` of
    its stage, global rank stage * tp_size + tp_rank; it passes states to and from the
    processes of the same tp_rank."""

    rank: int
    world: int
    num_layers: int
    micro_batches: int = 1
    tp_size: int = 1
    tp_rank: int = 0

    def peer(self, stage: int) -> int:
        """The global rank of `stage`'s process that this one talks to."""
        return stage * self.tp_size + self.tp_rank

    def __post_init__(self) -> None:
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise QServeError(f"pipeline-parallel rank {self.rank} outside a world of {self.world}")
        if self.num_layers < self.world:
            raise QServeError(
                f"--pipeline-parallel-size {self.world} is more stages than the model's "
                f"{self.num_layers} decoder layers"
            )

    @property
    def layers(self) -> tuple[int, int]:
        return stage_layers(self.num_layers, self.rank, self.world)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.world - 1

    # what `loader.load_model(..., pp=...)` calls (the model code does not import this package)
    def rank_config(self, config: ModelConfig) -> ModelConfig:
        """The config of a model of this stage's layers only."""
        if config.family not in ("llama", "gemma3"):
            raise QServeError(f"pipeline parallelism does not take {config.architecture} yet")
        if config.num_experts:
            raise QServeError("pipeline parallelism does not take mixture-of-experts models yet")
        start, end = self.layers
        types = config.layer_types[start:end] if config.layer_types else config.layer_types
        return dataclasses.replace(config, num_hidden_layers=end - start, layer_types=types)

    def shard_state(
        self, state: dict[str, torch.Tensor], quantization: Any = None
    ) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors this stage loads: its layers (renumbered from 0) and every
        tensor outside the layers."""
        start, end = self.layers
        out = {}
        for name, tensor in state.items():
            match = _LAYER.match(name)
            if match is None:
                out[name] = tensor
                continue
            i = int(match.group(1))
            if start <= i < end:
                out[f"model.layers.{i - start}.{name[match.end() :]}"] = tensor
        return out

    def attach(self, model: nn.Module) -> None:
        """Make the decoder stack pass its states on (`LlamaModel.stage`)."""
        model.model.stage = self

    # -- what the decoder stack calls each step -----------------------------------------------

    def forward(
        self,
        stack: nn.Module,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: Any,
    ) -> torch.Tensor:
        """This stage's part of one step (`stack`: the decoder stack of its layers, LlamaModel
        or Gemma3Model), over the step's micro-batches (`micro_batches`) in order: stage 0
        embeds, the others receive the previous stage's hidden states (and residual stream,
        where the stack has one, `has_residual`); each sends its result on without
        waiting (so stage s runs micro-batch m + 1 while stage s + 1 runs m), the last stage
        its normed states to stage 0. Stage 0 returns the whole batch's normed states."""
        import torch.distributed as dist

        dtype = stack.embed_tokens.weight.dtype
        width = stack.embed_tokens.weight.shape[1]
        parts = micro_batches(attn_metadata.query_lens_cpu, self.micro_batches)
        states = 2 if stack.has_residual else 1  # hidden states, and the residual stream
        finals = []  # stage 0: posted first, so the last stage's sends complete while it works
        for m, (_, (t0, t1)) in enumerate(parts if self.is_first else []):
            buf = torch.empty(t1 - t0, width, dtype=dtype)
            finals.append((buf, dist.irecv(buf, self.peer(self.world - 1), tag=m)))
        sends = []  # (tensor, work): the tensors stay alive until their sends complete
        for m, ((s0, s1), (t0, t1)) in enumerate(parts):
            md = attn_metadata if len(parts) == 1 else attn_metadata.seqs(s0, s1)
            if self.is_first:
                hidden, residual = stack.embed(input_ids[t0:t1]), None
            else:
                hidden, *rest = self._recv(m, states, t1 - t0, width, dtype)
                residual = rest[0] if rest else None
            hidden, residual = stack.decode_layers(hidden, residual, positions[t0:t1],
                                                   kv_caches, md)  # fmt: skip
            if self.is_last:
                out = stack.final_norm(hidden, residual).contiguous()
                sends.append((out, dist.isend(out, self.peer(0), tag=m)))
                continue
            for i, t in enumerate((hidden, residual)[:states]):
                t = t.contiguous()
                sends.append((t, dist.isend(t, self.peer(self.rank + 1), tag=2 * m + i)))
        for _, work in sends + finals:
            work.wait()
        if self.is_first:
            return torch.cat([buf for buf, _ in finals])
        return torch.empty(0, width, dtype=dtype)  # the step's result is on stage 0

    def _recv(
        self, m: int, states: int, tokens: int, width: int, dtype: torch.dtype
    ) -> list[torch.Tensor]:
        """The previous stage's hidden states (and residual stream) of micro-batch m."""
        import torch.distributed as dist

        out = [torch.empty(tokens, width, dtype=dtype) for _ in range(states)]
        for i, t in enumerate(out):
            dist.recv(t, self.peer(self.rank - 1), tag=2 * m + i)
        return out


def micro_batches(
    query_lens: list[int], parts: int, min_tokens: int = MIN_MICRO_BATCH_TOKENS
) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """A step's sequences cut into at most `parts` contiguous micro-batches of about equal
    token counts, none meant to be under `min_tokens` (a sequence is never cut):
    [((first seq, end seq), (first token, end token))]. Every stage computes the same cut from
    the step's query lengths."""
    parts = max(1, min(parts, sum(query_lens) // min_tokens))
    prefix = [0]
    for q in query_lens:
        prefix.append(prefix[-1] + q)
    cuts = [0]
    for k in range(1, parts):  # after how many sequences, nearest the k-th equal share
        target = prefix[-1] * k / parts
        options = range(cuts[-1] + 1, len(query_lens))
        if options:
            cuts.append(min(options, key=lambda j: abs(prefix[j] - target)))
    cuts.append(len(query_lens))
    cuts = sorted(set(cuts))
    return [((a, b), (prefix[a], prefix[b])) for a, b in zip(cuts, cuts[1:])]
