"""The engine: schedule, run the model, sample, detokenize; one `step()` at a time."""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import replace
from typing import Any

import torch

from qserve.config import EngineConfig
from qserve.engine.beam_group import BeamSearchRequest
from qserve.engine.beam_search import BeamSearchParams
from qserve.engine.context_length import check_context_length
from qserve.engine.detokenizer import IncrementalDetokenizer
from qserve.engine.kv_cache_manager import KVCacheManager
from qserve.engine.logits_processors import TokenControls, check_token_ids, tokenize_bad_words
from qserve.engine.model_runner import (
    DecodeGraphsConfig,
    KVCacheSpec,
    ModelRunner,
    SampledToken,
)
from qserve.engine.output_processor import (
    RequestState,
    SampleState,
    make_request_output,
)
from qserve.engine.outputs import RequestMetrics, RequestOutput
from qserve.engine.request import Request, RequestStatus
from qserve.engine.sampler import make_generator
from qserve.engine.sampling_params import RequestOutputKind, SamplingParams
from qserve.engine.scheduler import Scheduler, SchedulerConfig
from qserve.engine.startup_log import log_startup
from qserve.engine.stats import EngineStats
from qserve.engine.structured_outputs import StructuredOutputManager
from qserve.errors import QServeError
from qserve.kernels.attention_ref import is_fp8
from qserve.model.config import ModelConfig
from qserve.model.loader import LoadReport, load_model, load_tokenizer
from qserve.model.quant import activation_dtype
from qserve.model.resolve import resolve_model
from qserve.parallel.pipeline_parallel import PPRank
from qserve.parallel.tensor_parallel import TPRank
from qserve.parallel.workers import start_workers

logger = logging.getLogger("qserve")


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        path = resolve_model(config.model)
        self.model_config = ModelConfig.from_pretrained(path)
        self.dtype = config.torch_dtype(self.model_config.torch_dtype)
        if self.model_config.quantization is not None and config.dtype == "auto":
            self.dtype = activation_dtype(self.model_config.torch_dtype, config.device)
        self.workers, tp, pp = start_workers(config, path, self.dtype, self.model_config)
        try:
            self._load(path, tp, pp)
        except BaseException:
            self.close()
            raise

    def _load(self, path: Any, tp: TPRank | None, pp: PPRank | None) -> None:
        config = self.config
        model, rank_config = load_model(path, self.dtype, config.device, tp=tp, pp=pp)
        self.load_report: LoadReport = model.load_report
        self.tokenizer = load_tokenizer(path)
        self.eos_token_ids = self.model_config.eos_token_ids
        kv_spec = self._kv_cache_spec(rank_config)
        self.max_model_len = self._max_model_len(kv_spec)
        if self.workers is not None:
            self.workers.send(kv_spec)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len),
            KVCacheManager(kv_spec.num_blocks, kv_spec.block_size, config.enable_prefix_caching),
        )
        graphs = (
            None
            if config.enforce_eager or self.workers is not None
            else DecodeGraphsConfig(config.max_num_seqs, self.max_model_len)
        )
        self.model_runner = ModelRunner(model, self.model_config, kv_spec, config.device, graphs)
        self.model_runner.workers = self.workers
        self._structured_outputs: StructuredOutputManager | None = None  # made on first use
        # bad_words -> their token sequences (a batch of prompts shares one request's words)
        self._bad_words_token_ids = functools.lru_cache(maxsize=64)(
            functools.partial(tokenize_bad_words, self.tokenizer, self.model_config.vocab_size)
        )
        self.requests: dict[str, RequestState] = {}
        # scheduler request id -> (the user's request, that one of its n samples)
        self._samples: dict[str, tuple[RequestState, SampleState]] = {}
        self._beam_searches: dict[str, BeamSearchRequest] = {}  # by request id (= beams' group)
        log_startup(self, path, kv_spec)

    def close(self) -> None:
        """Stop the tensor- or pipeline-parallel workers, if any (also done at exit)."""
        if getattr(self, "workers", None) is not None:
            self.workers.close()

    def _kv_cache_spec(self, rank_config: ModelConfig) -> KVCacheSpec:
        """Blocks of this rank's KV heads (all of them without tensor parallelism)."""
        kv_dtype = self.config.kv_torch_dtype(self.dtype)
        spec = KVCacheSpec.from_memory(
            rank_config, self.config.kv_cache_memory_bytes, self.config.block_size, kv_dtype
        )
        if spec.num_blocks < 1:
            raise QServeError(
                f"kv_cache_memory {self.config.kv_cache_memory} is smaller than one KV block "
                f"({spec.bytes_per_block} bytes)"
            )
        if is_fp8(kv_dtype) and not self.load_report.has_kv_scales:
            logger.warning(
                "FP8 KV cache without calibrated scales in the checkpoint (%d of %d layers have "
                "them): using k_scale = v_scale = 1.0 where missing",
                self.load_report.num_kv_scaled_layers,
                self.load_report.num_layers,
            )
        return spec

    def _max_model_len(self, kv_spec: KVCacheSpec) -> int:
        """The model's context, capped by what the KV cache holds; an explicit longer one fails."""
        wanted = self.config.max_model_len
        if wanted is not None and wanted > kv_spec.num_tokens:
            raise QServeError(
                f"max_model_len {wanted} needs more KV cache than kv_cache_memory "
                f"{self.config.kv_cache_memory} holds ({kv_spec.num_tokens} tokens)"
            )
        context = self.model_config.max_context_len
        if wanted is not None and wanted > context:
            raise QServeError(
                f"max_model_len {wanted} is longer than the model's context {context}"
            )
        return min(wanted or context, kv_spec.num_tokens)

    # -- requests ------------------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        group: str | None = None,
    ) -> None:
        """Queue `params.n` samples of `prompt`: the first computes the prompt, the others fork
        its blocks before its last token (`Scheduler._fork_samples`). Requests share
        prefix-cache blocks only with requests of the same `cache_salt` (None: with every
        unsalted request). `group` names the client request this one is part of (default:
        itself), between which the scheduler shares the running slots fairly."""
        if request_id in self.requests:
            raise QServeError(f"request id {request_id!r} is already in use", param="request_id")
        prompt_ids = self.tokenize(prompt)
        self._check_prompt(prompt_ids, params)
        controls = self._token_controls(params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        samples = [
            self._new_sample(request_id, i, prompt_ids, params, arrival, cache_salt, group)
            for i in range(params.n)
        ]
        for sample in samples:
            sample.request.token_controls = controls
        state = RequestState(
            request_id,
            prompt if isinstance(prompt, str) else None,
            prompt_ids,
            samples,
            RequestMetrics(arrival),
            params.output_kind,
        )
        self.requests[request_id] = state
        for sample in samples:
            self._samples[sample.request.request_id] = (state, sample)
        first, *others = [s.request for s in samples]
        if len(prompt_ids) > 1:  # the others fork from the first before the last prompt token
            first.forks = others
            others = []
        for request in (first, *others):
            self.scheduler.add_request(request)

    def add_beam_search_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: BeamSearchParams,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """Queue a beam search of `prompt`; its output (FINAL_ONLY) holds the best
        `beam_width` sequences. Generation stops at the end of the context, as `generate`'s."""
        if request_id in self.requests or request_id in self._beam_searches:
            raise QServeError(f"request id {request_id!r} is already in use", param="request_id")
        prompt_ids = self.tokenize(prompt)
        sampling = SamplingParams(
            temperature=params.temperature, max_tokens=params.max_tokens, ignore_eos=True
        )
        self._check_prompt(prompt_ids, sampling)
        max_tokens = min(params.max_tokens, self.max_model_len - len(prompt_ids))
        params = replace(params, max_tokens=max_tokens)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        root = Request(
            f"{request_id}-beam0", prompt_ids, sampling, self.eos_token_ids, self.max_model_len,
            None, arrival, cache_salt, request_id,
        )  # fmt: skip
        text = prompt if isinstance(prompt, str) else None
        self._beam_searches[request_id] = BeamSearchRequest(
            request_id, text, root, params, self.scheduler, RequestMetrics(arrival)
        )

    def _check_prompt(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise QServeError("the prompt is empty", param="prompt")
        check_context_length(len(prompt_ids), params, self.max_model_len)
        vocab = self.model_config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise QServeError(f"prompt token ids must be in [0, {vocab})", param="prompt")
        check_token_ids(params, vocab)

    def _token_controls(self, params: SamplingParams) -> TokenControls | None:
        """allowed_token_ids, logit_bias and bad_words as tensors and token ids, once."""
        bad_words = self._bad_words_token_ids(tuple(params.bad_words)) if params.bad_words else ()
        return TokenControls.build(params, bad_words)

    @property
    def structured_outputs(self) -> StructuredOutputManager:
        """The grammar compiler for this tokenizer (built on the first constrained request)."""
        if self._structured_outputs is None:
            vocab = self.model_config.vocab_size
            self._structured_outputs = StructuredOutputManager(self.tokenizer, vocab)
        return self._structured_outputs

    def _new_sample(
        self,
        request_id: str,
        index: int,
        prompt_ids: list[int],
        params: SamplingParams,
        arrival: float,
        cache_salt: str | None,
        group: str | None,
    ) -> SampleState:
        child_params = params.child_params(index) if params.n > 1 else params
        child_id = request_id if params.n == 1 else f"{index}_{request_id}"
        request = Request(
            child_id,
            prompt_ids,
            child_params,
            self.eos_token_ids,
            self.max_model_len,
            make_generator(child_params, self.config.device),
            arrival,
            cache_salt,
            request_id if group is None else group,
        )
        if child_params.structured_outputs is not None:
            request.grammar = self.structured_outputs.matcher(child_params.structured_outputs)
        detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids, child_params)
        logprobs = [] if child_params.logprobs is not None else None
        return SampleState(index, request, detokenizer, logprobs)

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Finish requests now and free their blocks (a client went away)."""
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        for request_id in ids:
            search = self._beam_searches.pop(request_id, None)
            if search is not None:
                search.release()
            state = self.requests.pop(request_id, None)
            if state is None:
                continue
            children = [s.request.request_id for s in state.samples]
            self.scheduler.finish_requests(children, RequestStatus.FINISHED_ABORTED)
            for child in children:
                self._samples.pop(child, None)

    def request_ids(self) -> list[str]:
        """The requests in the engine (running, waiting or with samples left)."""
        return list(self.requests) + list(self._beam_searches)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- the loop ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        try:
            result = self.model_runner.execute_model(out)
        except BaseException:
            # Blocks cached for this step were never written: no later prompt may hit them.
            self.scheduler.kv_cache_manager.uncache_step()
            raise
        for request_id, entries in result.prompt_logprobs.items():
            self.scheduler.requests[request_id].add_prompt_logprobs(entries)
        token_ids = {req_id: s.token_id for req_id, s in result.sampled.items()}
        updated = self.scheduler.update_from_output(out, token_ids)
        beam_outputs = self._advance_beam_searches(result.beam_logprobs)
        return self._process_outputs(updated, result.sampled) + beam_outputs

    def _advance_beam_searches(self, rows: dict[str, torch.Tensor]) -> list[RequestOutput]:
        """Give beams their log-probabilities; advance the searches whose beams all have them.
        A finished search's output is returned once, and the search forgotten."""
        searches: dict[str, BeamSearchRequest] = {}
        for beam_id, row in rows.items():
            beam = self.scheduler.requests[beam_id]
            beam.beam_logprobs = row
            searches[beam.group] = self._beam_searches[beam.group]
        outputs = []
        now = time.monotonic()
        for search in searches.values():
            if search.ready:
                search.advance()
            search.metrics.first_token_time = search.metrics.first_token_time or now
            if search.finished:
                search.metrics.last_token_time = search.metrics.finished_time = now
                del self._beam_searches[search.request_id]
                outputs.append(search.output(self.tokenizer))
        return outputs

    def _process_outputs(
        self, updated: list[Request], sampled: dict[str, SampledToken]
    ) -> list[RequestOutput]:
        now = time.monotonic()
        touched: dict[str, tuple[RequestState, list[SampleState]]] = {}
        for request in updated:
            state, sample = self._samples[request.request_id]
            self._update_sample(state, sample, sampled[request.request_id])
            touched.setdefault(state.request_id, (state, []))[1].append(sample)
        outputs = []
        for state, advanced in touched.values():
            state.metrics.first_token_time = state.metrics.first_token_time or now
            state.metrics.last_token_time = now
            if state.finished:
                state.metrics.finished_time = now
                self._forget(state)
            elif state.output_kind == RequestOutputKind.FINAL_ONLY:
                continue
            outputs.append(make_request_output(state, advanced))
        return outputs

    def _update_sample(self, state: RequestState, sample: SampleState, token: SampledToken) -> None:
        request = sample.request
        stop_terminated = request.status == RequestStatus.FINISHED_STOPPED
        stop_string = sample.detokenizer.update([token.token_id], stop_terminated)
        if stop_string is not None and not request.is_finished:
            self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)
            request.stop_reason = stop_string
        if sample.logprobs is not None and token.logprobs is not None:
            sample.logprobs.append(token.logprobs)
        if request.is_finished:
            state.finished_samples.add(sample.index)

    def _forget(self, state: RequestState) -> None:
        self.requests.pop(state.request_id, None)
        for sample in state.samples:
            self._samples.pop(sample.request.request_id, None)

    # -- stats ---------------------------------------------------------------------------------

    def get_stats(self) -> EngineStats:
        kv = self.scheduler.kv_cache_manager
        live_slots, allocated_slots = kv.slot_usage(self.scheduler.running)
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=kv.usage,
            kv_live_slots=live_slots,
            kv_allocated_slots=allocated_slots,
            num_free_blocks=kv.block_pool.get_num_free_blocks(),
            num_blocks=kv.block_pool.num_blocks,
            prefix_cache_hit_rate=kv.prefix_cache_stats.hit_rate,
            num_preemptions=self.scheduler.num_preemptions,
        )
