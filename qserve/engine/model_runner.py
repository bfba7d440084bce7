"""The only place that builds tensors: a flat varlen batch in, one sampled token per request out."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import nn

from qserve.engine.decode_graphs import DecodeGraphs
from qserve.engine.prompt_logprobs import PromptSpan, compute_prompt_logprobs, prompt_spans
from qserve.engine.sampler import Logprobs, Sampler, SamplingMetadata
from qserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from qserve.engine.structured_outputs import apply_grammar_bitmask
from qserve.model.attention import AttentionMetadata, make_kv_cache
from qserve.model.config import ModelConfig
from qserve.parallel.workers import StepMessage, Workers


@dataclass(frozen=True)
class KVCacheSpec:
    num_blocks: int
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        """K and V, every layer: 2 x block_size x num_kv_heads x head_dim x dtype bytes x layers."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * elem * self.num_layers

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @classmethod
    def from_memory(
        cls, config: ModelConfig, memory: int, block_size: int, dtype: torch.dtype
    ) -> KVCacheSpec:
        spec = cls(
            0,
            block_size,
            config.num_hidden_layers,
            config.num_key_value_heads,
            config.head_dim,
            dtype,
        )
        return replace(spec, num_blocks=memory // spec.bytes_per_block)


@dataclass(frozen=True)
class DecodeGraphsConfig:
    """What sizes the compiled decode step's graphs: the batch and context limits."""

    max_num_seqs: int
    max_model_len: int


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # int64 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens]
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # int64 [num_sampling_rows]: last token of each sampling request
    sampling_rows: list[ScheduledRequest]
    prompt_spans: list[PromptSpan]  # prompt tokens this step scores (prompt logprobs)


@dataclass
class SampledToken:
    token_id: int
    logprobs: Logprobs | None


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, SampledToken]  # request id -> its token, for requests that sampled
    prompt_logprobs: dict[str, list[Logprobs]]  # request id -> this step's prompt entries
    # beam search: request id -> log_softmax over the vocabulary, fp32 [vocab_size]
    beam_logprobs: dict[str, torch.Tensor] = field(default_factory=dict)


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        model_config: ModelConfig,
        kv_spec: KVCacheSpec,
        device: str,
        decode_graphs: DecodeGraphsConfig | None = None,
    ) -> None:
        self.model = model
        self.model_config = model_config
        self.kv_spec = kv_spec
        self.device = torch.device(device)
        self.kv_caches = [
            make_kv_cache(
                kv_spec.num_blocks,
                kv_spec.block_size,
                kv_spec.num_kv_heads,
                kv_spec.head_dim,
                kv_spec.dtype,
                device,
            )
            for _ in range(kv_spec.num_layers)
        ]
        self.sampler = Sampler()
        self.workers: Workers | None = None  # parallel ranks 1.. (set by the engine)
        self.decode_graphs: DecodeGraphs | None = None  # the compiled decode step
        if decode_graphs is not None:
            max_blocks = -(-decode_graphs.max_model_len // kv_spec.block_size)
            self.decode_graphs = DecodeGraphs(
                model, self.kv_caches, decode_graphs.max_num_seqs, max_blocks
            )

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: a token for each request that reached its last known token, and the
        prompt logprobs of the prompt positions it ran for requests that ask for them."""
        try:
            return self._execute_model(out)
        except RuntimeError as exc:  # a collective a tensor-parallel peer left
            if self.workers is None:
                raise
            raise self.workers.collective_failed(exc) from None

    @torch.inference_mode()
    def _execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.copy_blocks(out.blocks_to_copy)
        batch = self.prepare_inputs(out.scheduled)
        if self.workers is not None:  # the other ranks run their part of the same step
            rows = batch.logits_indices if batch.sampling_rows else None
            self.workers.send(
                StepMessage(batch.input_ids, batch.positions, batch.attn_metadata,
                            out.blocks_to_copy, rows, batch.prompt_spans)
            )  # fmt: skip
        logits, prompt_logprobs = self.graph_logits(batch), {}
        if logits is None:
            md = batch.attn_metadata
            hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, md)
            prompt_logprobs = compute_prompt_logprobs(self.model, hidden, batch.prompt_spans)
            if not batch.sampling_rows:
                return ModelRunnerOutput({}, prompt_logprobs)
            logits = self.model.compute_logits(hidden[batch.logits_indices])
        rows = batch.sampling_rows
        if not any(s.request.is_beam for s in rows):
            return ModelRunnerOutput(self.sample(logits, rows), prompt_logprobs)
        sampled = [i for i, s in enumerate(rows) if not s.request.is_beam]
        tokens = self.sample(logits[sampled], [rows[i] for i in sampled]) if sampled else {}
        beam_logprobs = {
            s.request.request_id: self.beam_row(logits[i], s)
            for i, s in enumerate(rows)
            if s.request.is_beam
        }
        return ModelRunnerOutput(tokens, prompt_logprobs, beam_logprobs)

    @torch.inference_mode()
    def run_forward(self, message: StepMessage) -> None:
        """A worker's step: rank 0's batch through this rank's part of the model, then the
        logits rank 0 computes, in its order (a vocab-parallel lm_head gathers them from every
        rank); only rank 0 uses them."""
        self.copy_blocks(message.blocks_to_copy)
        md = message.attn_metadata
        hidden = self.model(message.input_ids, message.positions, self.kv_caches, md)
        if not self._computes_logits():
            return
        compute_prompt_logprobs(self.model, hidden, message.prompt_spans)
        if message.logits_indices is not None:
            self.model.compute_logits(hidden[message.logits_indices])

    def _computes_logits(self) -> bool:
        """Whether this rank's lm_head takes part in the logits (tensor parallel: every rank of
        stage 0, a vocab-parallel one gathers; pipeline stages > 0 leave them to stage 0)."""
        stage = getattr(self.model.model, "stage", None)
        return stage is None or stage.is_first

    def graph_logits(self, batch: ModelInput) -> torch.Tensor | None:
        """A decode batch's logits through the compiled decode step; None: run it eagerly."""
        md = batch.attn_metadata
        decode = len(batch.sampling_rows) == len(md.query_lens_cpu) == batch.input_ids.shape[0]
        if self.decode_graphs is None or not decode or batch.prompt_spans:
            return None
        return self.decode_graphs.logits(batch.input_ids, batch.positions, md)

    def copy_blocks(self, blocks_to_copy: list[tuple[int, int]]) -> None:
        """Copy-on-write: each (src, dst) block's K and V pages, every layer, before the step
        writes into dst. All sources are read before any destination is written."""
        if not blocks_to_copy:
            return
        src, dst = (torch.tensor(ids, device=self.device) for ids in zip(*blocks_to_copy))
        for kv_cache in self.kv_caches:  # [2, num_blocks, block_size, num_kv_heads, head_dim]
            kv_cache[:, dst] = kv_cache[:, src]

    @staticmethod
    def beam_row(logits: torch.Tensor, row: ScheduledRequest) -> torch.Tensor:
        """A beam's log-probabilities over the vocabulary (fp32 [vocab]), at its temperature
        (0 or 1: the model's own, as transformers' beam search scores)."""
        temperature = row.request.sampling_params.temperature
        logits = logits.float()
        if temperature not in (0.0, 1.0):
            logits = logits / temperature
        return torch.log_softmax(logits, dim=-1)

    def prepare_inputs(self, scheduled: list[ScheduledRequest]) -> ModelInput:
        bs = self.kv_spec.block_size
        query_lens = [s.num_new_tokens for s in scheduled]
        seq_lens = [s.num_computed_tokens + s.num_new_tokens for s in scheduled]
        token_ids: list[int] = []
        positions: list[int] = []
        for s, end in zip(scheduled, seq_lens):
            token_ids += s.request.all_token_ids[s.num_computed_tokens : end]
            positions += range(s.num_computed_tokens, end)
        block_tables = self._block_tables(scheduled)
        pos = torch.tensor(positions, dtype=torch.int64)
        seq_idx = torch.repeat_interleave(torch.arange(len(scheduled)), torch.tensor(query_lens))
        slot_mapping = block_tables[seq_idx, pos // bs].to(torch.int64) * bs + pos % bs
        query_start_loc = torch.zeros(len(scheduled) + 1, dtype=torch.int32)
        query_start_loc[1:] = torch.cumsum(torch.tensor(query_lens), 0)
        rows = [i for i, s in enumerate(scheduled) if s.needs_logits]
        md = AttentionMetadata(
            slot_mapping=slot_mapping.to(self.device),
            block_tables=block_tables.to(self.device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=self.device),
            query_start_loc=query_start_loc.to(self.device),
            seq_lens_cpu=seq_lens,
            query_lens_cpu=query_lens,
            prompt_lens_cpu=[s.request.num_prompt_tokens for s in scheduled],
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
        )
        return ModelInput(
            input_ids=torch.tensor(token_ids, dtype=torch.int64, device=self.device),
            positions=pos.to(self.device),
            attn_metadata=md,
            logits_indices=(query_start_loc[1:][rows] - 1).to(torch.int64).to(self.device),
            sampling_rows=[scheduled[i] for i in rows],
            prompt_spans=prompt_spans(scheduled, query_start_loc[:-1].tolist()),
        )

    @staticmethod
    def _block_tables(scheduled: list[ScheduledRequest]) -> torch.Tensor:
        """int32 [num_seqs, max_blocks], padded with block 0 (never read past seq_lens)."""
        width = max(len(s.block_ids) for s in scheduled)
        table = torch.zeros(len(scheduled), width, dtype=torch.int32)
        for i, s in enumerate(scheduled):
            table[i, : len(s.block_ids)] = torch.tensor(s.block_ids, dtype=torch.int32)
        return table

    def sample(self, logits: torch.Tensor, rows: list[ScheduledRequest]) -> dict[str, SampledToken]:
        requests = [s.request for s in rows]
        logits = logits.float()
        apply_grammar_bitmask(logits, requests)  # structured outputs: only what the grammar allows
        generators = {i: r.generator for i, r in enumerate(requests) if r.generator is not None}
        metadata = SamplingMetadata.from_requests(
            [r.sampling_params for r in requests],
            [r.prompt_token_ids for r in requests],
            [r.output_token_ids for r in requests],
            generators,
            requests[0].eos_token_ids,
            logits.shape[-1],
            self.device,
            [r.token_controls for r in requests],
        )
        result = self.sampler(logits, metadata)
        logprobs = result.logprobs or [None] * len(requests)
        return {
            r.request_id: SampledToken(t, lp)
            for r, t, lp in zip(requests, result.sampled_token_ids, logprobs)
        }
