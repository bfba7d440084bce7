"""Pipeline-parallel model stages (issue 24): what stage r of `world` builds, loads and passes on.

The decoder layers are split into `world` contiguous ranges (`stage_layers`: as even as they
go, the earlier stages taking the remainder, as vLLM's `get_pp_indices`). Stage r's model is an
ordinary model of its layers only (`rank_config`: num_hidden_layers, and its slice of the
per-layer settings), loaded from the checkpoint's tensors of those layers renamed to local
indices (`shard_state`); embeddings, the final norm and lm_head are whole on every stage. Each
step, stage 0 embeds the tokens, and every stage runs its layers on what the previous one sent
(hidden states and the residual stream, `send` / `recv` point to point); the last stage applies
the final norm and sends the result back to stage 0, which computes logits and samples.

    stage = PPRank(rank, world, num_layers)
    load_model(path, dtype, pp=stage)  # rank_config, shard_state, attach (model.model.stage)

The stages run one after the other: no micro-batches yet, so pipeline parallelism splits a
model's memory, not its time. Llama family without mixtures of experts only; tensor and
pipeline parallelism are not combined yet.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch
from torch import nn

from qserve.errors import QServeError
from qserve.model.config import ModelConfig

__all__ = ["PPRank", "stage_layers"]

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def stage_layers(num_layers: int, rank: int, world: int) -> tuple[int, int]:
    """[start, end) of stage `rank`'s decoder layers: even ranges, earlier stages one more."""
    base, extra = divmod(num_layers, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


@dataclasses.dataclass(frozen=True)
class PPRank:
    """This process's stage: `rank` of `world`, over a model of `num_layers` decoder layers."""

    rank: int
    world: int
    num_layers: int

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
        if config.family != "llama":
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

    def recv(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The previous stage's hidden states and residual stream, shaped as `like`."""
        import torch.distributed as dist

        hidden, residual = torch.empty_like(like), torch.empty_like(like)
        dist.recv(hidden, self.rank - 1)
        dist.recv(residual, self.rank - 1)
        return hidden, residual

    def send(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        import torch.distributed as dist

        dist.send(hidden.contiguous(), self.rank + 1)
        dist.send(residual.contiguous(), self.rank + 1)

    def send_final(self, hidden: torch.Tensor) -> None:
        """The last stage's normed hidden states, to stage 0 (which computes logits)."""
        import torch.distributed as dist

        dist.send(hidden.contiguous(), 0)

    def recv_final(self, like: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        hidden = torch.empty_like(like)
        dist.recv(hidden, self.world - 1)
        return hidden
