"""Continuous batching: each step decides {request: number of new tokens}. Pure Python, no torch.

Running requests are served first (decodes and unfinished prompt chunks), then waiting ones are
admitted while the token budget, `max_num_seqs` and the KV cache allow, fairly between the
client requests they came from (`WaitingQueue`). When a running request
cannot get a block, the newest running request is preempted: its blocks are freed and it goes
back to the head of the waiting queue, to be recomputed later (from the prefix cache when its
blocks survived). Nothing is lost and the output does not change.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from qserve.engine.kv_cache_manager import KVCacheManager
from qserve.engine.request import Request, RequestStatus
from qserve.engine.waiting_queue import WaitingQueue


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class ScheduledRequest:
    request: Request
    num_computed_tokens: int  # before this step
    num_new_tokens: int
    block_ids: list[int]

    @property
    def needs_logits(self) -> bool:
        """True when this step reaches the end of the known tokens, so its logits are used."""
        return self.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.waiting = WaitingQueue()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        self.kv_cache_manager.begin_step()
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted_req_ids:
            self._schedule_waiting(out, budget)
        for s in out.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._allocate_or_preempt(request, num_new, out):
                break
            out.scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
            i += 1
        return budget

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Allocate for a running request, preempting the newest ones until it fits."""
        while self.kv_cache_manager.allocate_slots(request, num_new) is None:
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted_req_ids.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        running_per_group = Counter(r.group for r in self.running)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek(running_per_group)
            assert request is not None
            hits, num_computed = self.kv_cache_manager.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_computed, budget)
            if self.kv_cache_manager.allocate_slots(request, num_new, hits) is None:
                break
            self.waiting.remove(request)
            running_per_group[request.group] += 1
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed
            self.running.append(request)
            out.scheduled.append(self._scheduled(request, num_new))
            budget -= num_new

    def _scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
        return ScheduledRequest(request, request.num_computed_tokens, num_new, block_ids)

    def update_from_output(
        self, out: SchedulerOutput, sampled_token_ids: dict[str, int]
    ) -> list[Request]:
        """Append each sampled token and finish requests that stop. Returns the requests that
        got a new token this step (finished ones included)."""
        updated = []
        for s in out.scheduled:
            request = s.request
            token_id = sampled_token_ids.get(request.request_id)
            if token_id is None or request.is_finished:
                continue  # a prompt chunk that did not reach the end yet
            request.append_output_token_ids(token_id)
            if request.check_stop():
                self._free_finished(request)
            updated.append(request)
        return updated

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """Finish requests from outside (a stop string matched, an abort)."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.status != RequestStatus.RUNNING:
                self.waiting.remove(request)
            request.status = status
            self._free_finished(request)

    def _free_finished(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        self.kv_cache_manager.forget(request)
        del self.requests[request.request_id]
