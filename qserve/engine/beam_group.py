"""One prompt's beam search in the engine: its live beams are scheduler requests on forked blocks.

The first beam computes the prompt. Each round, once every live beam has its log-probabilities
(`Request.beam_logprobs`, filled by the model runner), `beam_search_step` picks the next beams;
a beam continued once goes on as the same request, one continued again is forked (sharing all
of its blocks; the partial last block is copied by whichever writes first), and a beam that is
not continued is finished at once, freeing its blocks. A finished hypothesis keeps its parent's
blocks under an id of its own until it falls out of the best k or the search ends. Beams wait
for each other (a beam whose round is done is skipped, or parked when preempted), so the
search is the same however the scheduler runs them, preempted and recomputed included.
"""

from __future__ import annotations

import torch

from qserve.engine.beam_search import BeamSearchParams, BeamSearchState, beam_search_step
from qserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from qserve.engine.request import Request, RequestStatus
from qserve.engine.sampler import Logprobs
from qserve.engine.scheduler import Scheduler


class BeamSearchRequest:
    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        root: Request,
        params: BeamSearchParams,
        scheduler: Scheduler,
        metrics: RequestMetrics,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.scheduler = scheduler
        self.metrics = metrics
        self.state = BeamSearchState()
        root.is_beam = True
        self.beams = [root]  # the live beams, aligned with self.state.running
        self.holds: dict[int, str] = {}  # finished hypothesis key -> the id holding its blocks
        self._num_forks = 0
        scheduler.add_request(root)

    @property
    def finished(self) -> bool:
        return self.state.done

    @property
    def ready(self) -> bool:
        """Every live beam has this round's log-probabilities."""
        return all(b.beam_logprobs is not None for b in self.beams)

    def advance(self) -> None:
        """One round of the search: hold new hypotheses' blocks, fork, prune, append."""
        rows = torch.stack([b.beam_logprobs for b in self.beams])  # [num_beams, vocab]
        eos = self.beams[0].eos_token_ids
        state = beam_search_step(self.state, rows, self.params, eos)
        self._update_holds(state)
        if state.done:
            self.state = state
            self.release()
            return
        self.beams = self._next_beams(state)
        self.state = state

    def _update_holds(self, state: BeamSearchState) -> None:
        kv = self.scheduler.kv_cache_manager
        keys = {h.key for h in state.finished}
        for h in state.finished:
            if h.key not in self.holds:
                self.holds[h.key] = f"{self.request_id}-done{h.key}"
                kv.fork(self.beams[h.beam.parent].request_id, self.holds[h.key])
        for key in [k for k in self.holds if k not in keys]:
            kv.forget(self.holds.pop(key))

    def _next_beams(self, state: BeamSearchState) -> list[Request]:
        children: list[Request] = []
        continued: set[int] = set()
        for beam in state.running:  # forks first: a child copies its parent's tokens
            parent = self.beams[beam.parent]
            if beam.parent in continued:
                children.append(self._fork(parent))
            else:
                continued.add(beam.parent)
                children.append(parent)
        pruned = [b.request_id for i, b in enumerate(self.beams) if i not in continued]
        self.scheduler.finish_requests(pruned, RequestStatus.FINISHED_ABORTED)
        for child, beam in zip(children, state.running):
            child.append_output_token_ids(beam.token_ids[-1])
            child.beam_logprobs = None
            self.scheduler.resume(child)
        return children

    def _fork(self, parent: Request) -> Request:
        self._num_forks += 1
        child = parent.fork(f"{self.request_id}-beam{self._num_forks}")
        self.scheduler.fork_request(parent, child)
        return child

    def release(self) -> None:
        """Finish every live beam and drop every hold: all blocks go back."""
        ids = [b.request_id for b in self.beams]
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        for hold in self.holds.values():
            self.scheduler.kv_cache_manager.forget(hold)
        self.holds.clear()

    def output(self, tokenizer: object) -> RequestOutput:
        """The best `beam_width` sequences, best first, with their cumulative logprobs."""
        outputs = []
        for i, h in enumerate(self.state.finished):
            ids = list(h.beam.token_ids)
            shown = ids
            if h.finish_reason == "stop" and not self.params.include_stop_str_in_output:
                shown = ids[:-1]  # the EOS is not text
            logprobs = [
                Logprobs(t, lp, rank, [], [])
                for t, lp, rank in zip(ids, h.beam.logprobs, h.beam.ranks)
            ]
            text = tokenizer.decode(shown)  # type: ignore[attr-defined]
            outputs.append(
                CompletionOutput(
                    i,
                    text,
                    ids,
                    text,
                    ids,
                    logprobs,
                    h.finish_reason,
                    cumulative_logprob=h.beam.cum_logprob,
                )  # fmt: skip
            )
        root = self.beams[0]
        return RequestOutput(
            self.request_id, self.prompt, root.prompt_token_ids, outputs, True, self.metrics
        )
