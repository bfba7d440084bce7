"""Continuous batching: each step decides {request: number of new tokens}. Pure Python, no torch.

Running requests are served first (decodes and unfinished prompt chunks), then waiting ones are
admitted while the token budget, `max_num_seqs` and the KV cache allow, fairly between the
client requests they came from (`WaitingQueue`). When a running request
cannot get a block, the newest running request is preempted: its blocks are freed and it goes
back to the head of the waiting queue, to be recomputed later (from the prefix cache when its
blocks survived). Nothing is lost and the output does not change.

Beam search forks requests (`fork_request`): a child shares its parent's blocks and joins it,
running or waiting. So do the samples of an n > 1 request: the first computes the prompt but
its last token, then the others are forked from it and each computes that token itself. A beam
whose log-probabilities for this round are in (`Request.beam_logprobs`) has nothing to compute
until its search advances: it is skipped while running, and when preempted it is parked outside
the waiting queue until `resume`. When nothing else can run, such idle beams are preempted to
admit a waiting one, so a search whose beams do not all fit at once still advances.
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
    # copy-on-write of shared blocks: (src, dst) block ids, copied before the forward
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)

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
        # preempted beams that wait for their search to advance, outside the waiting queue
        self.parked: dict[str, Request] = {}
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def fork_request(self, parent: Request, child: Request) -> None:
        """Add `child`, a copy of `parent`'s tokens, sharing its blocks: running beside a running
        parent, else waiting to be computed (a parked or waiting parent holds no blocks)."""
        self.kv_cache_manager.fork(parent.request_id, child.request_id)
        self.requests[child.request_id] = child
        if parent.status == RequestStatus.RUNNING:
            child.status = RequestStatus.RUNNING
            child.num_computed_tokens = parent.num_computed_tokens
            self.running.append(child)
            return
        child.status, child.num_computed_tokens = RequestStatus.PREEMPTED, 0
        self.waiting.appendleft(child)

    def _fork_samples(self, parent: Request) -> None:
        """The n > 1 siblings of `parent`, which has computed all but its last prompt token,
        join it on its blocks; those past `max_num_seqs` wait as requests of their own (sharing
        the prompt's full blocks through the prefix cache)."""
        room = max(self.config.max_num_seqs - len(self.running), 0)
        forks, parent.forks = parent.forks, []
        for child in forks[:room]:
            self.fork_request(parent, child)
        for child in forks[room:]:
            self.add_request(child)

    def resume(self, request: Request) -> None:
        """A parked beam has a new token: back to the head of the waiting queue."""
        if self.parked.pop(request.request_id, None) is not None:
            self.waiting.appendleft(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.parked)

    def schedule(self) -> SchedulerOutput:
        self.kv_cache_manager.begin_step()
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted_req_ids:
            self._schedule_waiting(out, budget)
        for s in out.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
        out.blocks_to_copy = list(self.kv_cache_manager.blocks_to_copy)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.forks and request.num_computed_tokens == request.num_tokens - 1:
                self._fork_samples(request)
            num_new = min(request.num_tokens_to_compute - request.num_computed_tokens, budget)
            if num_new == 0:  # a beam waiting for its search to advance
                i += 1
                continue
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
        if request.beam_logprobs is not None:
            self.parked[request.request_id] = request
        else:
            self.waiting.appendleft(request)

    def _preempt_idle(self, out: SchedulerOutput) -> bool:
        """Preempt the newest running request with nothing to compute (a beam whose round is
        done), to make room for a waiting one; False when there is none."""
        for request in reversed(self.running):
            if request.num_computed_tokens == request.num_tokens:
                self.running.remove(request)
                self._preempt(request)
                out.preempted_req_ids.append(request.request_id)
                return True
        return False

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        running_per_group = Counter(r.group for r in self.running)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek(running_per_group)
            assert request is not None
            hits, num_computed = self.kv_cache_manager.get_computed_blocks(request)
            num_new = min(request.num_tokens_to_compute - num_computed, budget)
            if self.kv_cache_manager.allocate_slots(request, num_new, hits) is None:
                if out.scheduled or not self._preempt_idle(out):
                    break
                continue
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
            parked = self.parked.pop(request_id, None) is not None
            if not parked and request.status != RequestStatus.RUNNING:
                self.waiting.remove(request)
            request.status = status
            self._free_finished(request)

    def _free_finished(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        self.kv_cache_manager.forget(request)
        del self.requests[request.request_id]
