"""The compiled decode step: one graph per padded batch size (vLLM's
`cudagraph_capture_sizes`), captured on first use and replayed for every later decode step;
a step graph (`step_graph`) on CPU, a CUDA graph (`cuda_graph`) on CUDA.

A decode batch (every request one new token, every one sampling, no prompt logprobs) of B
requests is padded to the smallest capture size S >= B and its inputs copied into that size's
static tensors: token ids, positions, slot mapping, sequence lengths, and block tables as wide
as `max_model_len` needs, so every step of that size has the same shapes, and host-known bounds
(one query token a row, `max_blocks_per_seq` blocks a sequence) in place of the values the
attention launcher would otherwise read. Padding rows write no KV (slot -1, which the cache
write skips), attend over one token of block 0, and their logits are dropped. The first step
of a size runs eagerly while it is captured; the graph's output is then the logits [S, vocab].
Anything else (prompt chunks, mixed batches, B above the largest size), and every step after a
model turned out not capturable, runs eager.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from qserve.engine.cuda_graph import CudaStepGraph
from qserve.engine.step_graph import NotCapturable, StepGraph, UnavailableList
from qserve.model.attention import AttentionMetadata

logger = logging.getLogger("qserve")


def capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's default: 1, 2, 4, then every multiple of 8, up to max_num_seqs (and it)."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs]
    sizes += range(8, max_num_seqs, 8)
    return [*sizes, max_num_seqs]


@dataclass
class StaticInputs:
    """One capture size's input tensors; a step's values are copied in before each replay."""

    input_ids: torch.Tensor  # int64 [S]
    positions: torch.Tensor  # int64 [S]
    slot_mapping: torch.Tensor  # int64 [S]
    block_tables: torch.Tensor  # int32 [S, max_blocks_per_seq]
    seq_lens: torch.Tensor  # int32 [S]
    query_start_loc: torch.Tensor  # int32 [S + 1]: 0 .. S, one token a row
    max_seq_len: int  # the longest sequence the block tables can hold

    @classmethod
    def make(
        cls, size: int, max_blocks_per_seq: int, block_size: int, device: torch.device
    ) -> StaticInputs:
        return cls(
            input_ids=torch.zeros(size, dtype=torch.int64, device=device),
            positions=torch.zeros(size, dtype=torch.int64, device=device),
            slot_mapping=torch.full((size,), -1, dtype=torch.int64, device=device),
            block_tables=torch.zeros(size, max_blocks_per_seq, dtype=torch.int32, device=device),
            seq_lens=torch.ones(size, dtype=torch.int32, device=device),
            query_start_loc=torch.arange(size + 1, dtype=torch.int32, device=device),
            max_seq_len=max_blocks_per_seq * block_size,
        )

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> None:
        """Rows [0, B) from a step's batch; padding rows [B, S) write nothing and read block 0."""
        n, width = input_ids.shape[0], md.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(md.slot_mapping)
        self.slot_mapping[n:] = -1
        self.block_tables[:n, :width].copy_(md.block_tables)
        self.block_tables[n:, 0] = 0
        self.seq_lens[:n].copy_(md.seq_lens)
        self.seq_lens[n:] = 1

    def metadata(self) -> AttentionMetadata:
        """The metadata a captured step sees: static tensors, and Python lists it may not read."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping,
            block_tables=self.block_tables,
            seq_lens=self.seq_lens,
            query_start_loc=self.query_start_loc,
            seq_lens_cpu=UnavailableList("seq_lens_cpu"),
            query_lens_cpu=UnavailableList("query_lens_cpu"),
            prompt_lens_cpu=UnavailableList("prompt_lens_cpu"),
            max_query_len=1,
            max_seq_len=self.max_seq_len,
        )


class DecodeGraphs:
    """The step graphs of one model runner, by capture size."""

    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[torch.Tensor],
        max_num_seqs: int,
        max_blocks_per_seq: int,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = capture_sizes(max_num_seqs)
        self.max_blocks_per_seq = max_blocks_per_seq
        self.graphs: dict[int, StepGraph | CudaStepGraph] = {}
        self.inputs: dict[int, StaticInputs] = {}
        self.not_capturable: str | None = None  # why, once a capture failed: eager from then on
        self.device = kv_caches[0].device
        self.block_size = kv_caches[0].shape[2]
        self._pool: object | None = None  # the CUDA graphs' shared memory pool

    def size_for(self, num_tokens: int) -> int | None:
        """The capture size a decode batch of `num_tokens` rows pads to; None past the largest."""
        return next((s for s in self.sizes if s >= num_tokens), None)

    def logits(
        self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor | None:
        """fp32 logits [B, vocab] of a decode batch through its size's graph (captured now if
        it is the size's first step); None when this batch or this model runs eager. The
        tensor is the graph's output, rewritten by the next replay."""
        n = input_ids.shape[0]
        size = self.size_for(n)
        if self.not_capturable is not None or size is None:
            return None
        inputs = self.inputs.get(size)
        if inputs is None:
            inputs = self.inputs[size] = StaticInputs.make(
                size, self.max_blocks_per_seq, self.block_size, self.device
            )
        inputs.fill(input_ids, positions, md)
        graph = self.graphs.get(size)
        if graph is not None:
            return graph.replay()[:n]
        try:
            graph = self._capture(inputs)
        except NotCapturable as exc:  # the eager rerun rewrites the same KV slots
            self.not_capturable = str(exc)
            logger.info("decode steps run eager: %s", exc)
            return None
        self.graphs[size] = graph
        logger.info(
            "captured the decode step for batch size %d in %.0f ms (%s)",
            size, 1e3 * graph.capture_seconds, graph.summary(),
        )  # fmt: skip
        return graph.output[:n]

    def _capture(self, inputs: StaticInputs) -> StepGraph | CudaStepGraph:
        def step() -> torch.Tensor:
            return self._step(inputs)

        if self.device.type != "cuda":
            return StepGraph.capture(step)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return CudaStepGraph.capture(step, self._pool)

    def _step(self, inputs: StaticInputs) -> torch.Tensor:
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.metadata())
        return self.model.compute_logits(hidden)
