"""Forked requests share blocks; a shared partial block is copied by the first that appends into
it (copy-on-write). Exact block ids, ref counts and free-queue contents at each stage."""

from qserve.engine.kv_cache_manager import KVCacheManager
from qserve.engine.request import Request, RequestStatus
from qserve.engine.sampling_params import SamplingParams
from qserve.engine.scheduler import Scheduler, SchedulerConfig


def make_request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=4))


def admit(m: KVCacheManager, request: Request) -> list[int]:
    assert m.allocate_slots(request, request.num_tokens) is not None
    request.num_computed_tokens = request.num_tokens
    return m.get_block_ids(request.request_id)


def fork(m: KVCacheManager, parent: Request, child_id: str) -> Request:
    child = parent.fork(child_id)
    m.fork(parent.request_id, child_id)
    return child


def append(m: KVCacheManager, request: Request, token: int) -> list[int] | None:
    """Append one token and allocate its slot; the ids of the blocks allocated for it."""
    request.append_output_token_ids(token)
    new = m.allocate_slots(request, 1)
    if new is None:
        return None
    request.num_computed_tokens += 1
    return [b.block_id for b in new]


def ref_counts(m: KVCacheManager) -> list[int]:
    return [b.ref_cnt for b in m.block_pool.blocks]


def free_ids(m: KVCacheManager) -> list[int]:
    return [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()]


def test_fork_shares_every_block():
    m = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", list(range(6)))
    assert admit(m, a) == [0, 1]
    b = fork(m, a, "b")
    assert m.get_block_ids("b") == [0, 1]
    assert ref_counts(m)[:3] == [2, 2, 0]
    assert free_ids(m) == [2, 3, 4, 5, 6, 7]
    assert b.all_token_ids == a.all_token_ids and b.output_token_ids is not a.output_token_ids


def test_copy_on_write_of_the_shared_partial_block():
    m = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", list(range(6)))
    admit(m, a)
    m.begin_step()
    b = fork(m, a, "b")
    # b writes position 6 into the shared block 1: it gets block 2, a copy of block 1
    assert append(m, b, 100) == [2]
    assert m.blocks_to_copy == [(1, 2)]
    assert m.get_block_ids("b") == [0, 2] and m.get_block_ids("a") == [0, 1]
    assert ref_counts(m)[:3] == [2, 1, 1]
    # a is now block 1's only holder: it writes in place, nothing is copied
    assert append(m, a, 200) == []
    assert m.blocks_to_copy == [(1, 2)]
    c = fork(m, a, "c")
    assert append(m, c, 300) == [3]  # position 7, still in block 1, shared with a: copied
    assert m.blocks_to_copy == [(1, 2), (1, 3)]
    assert append(m, a, 201) == []  # a fills block 1 in place
    # a full shared block is never copied: the next token opens a new block
    m.begin_step()
    d = fork(m, a, "d")
    assert append(m, d, 400) == [4] and m.blocks_to_copy == []
    assert m.get_block_ids("c") == [0, 3] and m.get_block_ids("d") == [0, 1, 4]
    assert ref_counts(m)[:5] == [4, 2, 1, 1, 1]


def test_copy_on_write_needs_a_free_block_or_changes_nothing():
    m = KVCacheManager(num_blocks=2, block_size=4)
    a = make_request("a", list(range(6)))
    admit(m, a)
    b = fork(m, a, "b")
    b.append_output_token_ids(100)
    assert m.allocate_slots(b, 1) is None
    assert m.get_block_ids("b") == [0, 1] and ref_counts(m) == [2, 2]
    assert m.blocks_to_copy == []


def test_pruned_beam_and_finished_request_return_every_block():
    m = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", list(range(6)))
    admit(m, a)
    b = fork(m, a, "b")
    c = fork(m, a, "c")
    assert append(m, b, 1) == [2]
    assert append(m, c, 2) == [3]
    assert append(m, a, 3) == []  # the last holder of block 1
    assert ref_counts(m)[:4] == [3, 1, 1, 1]
    # a finished beam keeps its blocks as a hold, under an id of its own
    m.fork("c", "c-finished")
    assert ref_counts(m)[:4] == [4, 1, 1, 2]
    # beam b falls out of the top k: its own block 2 goes back at once
    m.forget(b)
    assert ref_counts(m)[:4] == [3, 1, 0, 2]
    assert free_ids(m) == [4, 5, 6, 7, 2]
    # the request ends: the live beams and the hold are released, every block is free
    for request_id in ("a", "c", "c-finished"):
        m.forget(request_id)
    assert ref_counts(m) == [0] * 8
    assert sorted(free_ids(m)) == list(range(8))
    assert m.req_to_blocks == {} and m.req_to_block_hashes == {}


def test_scheduler_forks_running_beam_and_schedules_the_copy():
    m = KVCacheManager(num_blocks=8, block_size=4)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64), m)
    a = make_request("a", list(range(6)))
    a.is_beam = True
    s.add_request(a)
    out = s.schedule()
    assert [r.request.request_id for r in out.scheduled] == ["a"] and out.blocks_to_copy == []
    b = a.fork("b")
    s.fork_request(a, b)
    assert b in s.running and b.num_computed_tokens == 6
    # a beam whose round is done (nothing new to compute) is skipped
    b.append_output_token_ids(7)
    out = s.schedule()
    assert [(r.request.request_id, r.num_new_tokens) for r in out.scheduled] == [("b", 1)]
    assert out.blocks_to_copy == [(1, 2)]
    assert out.scheduled[0].block_ids == [0, 2]


def scheduled(out) -> list[tuple[str, int, list[int]]]:
    return [(r.request.request_id, r.num_new_tokens, r.block_ids) for r in out.scheduled]


def test_n_samples_fork_before_the_last_prompt_token():
    """n = 3 on a 6-token prompt (blocks of 4): the first sample computes 5 tokens; then the
    other two join it on blocks [0, 1], and each computes token 6 into the shared partial
    block 1: the first two to write get copies, the last writes the original."""
    m = KVCacheManager(num_blocks=8, block_size=4)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64), m)
    a, b, c = (make_request(i, list(range(6))) for i in "abc")
    a.forks = [b, c]
    s.add_request(a)
    out = s.schedule()
    assert scheduled(out) == [("a", 5, [0, 1])] and not out.scheduled[0].needs_logits
    assert ref_counts(m)[:3] == [1, 1, 0]
    out = s.schedule()
    assert a.forks == [] and [r.request_id for r in s.running] == ["a", "b", "c"]
    assert scheduled(out) == [("a", 1, [0, 2]), ("b", 1, [0, 3]), ("c", 1, [0, 1])]
    assert out.blocks_to_copy == [(1, 2), (1, 3)]
    assert all(r.needs_logits for r in out.scheduled)
    assert ref_counts(m)[:5] == [3, 1, 1, 1, 0]
    for request_id in "abc":
        s.finish_requests([request_id], RequestStatus.FINISHED_ABORTED)
    assert ref_counts(m) == [0] * 8 and sorted(free_ids(m)) == list(range(8))


def test_n_samples_past_max_num_seqs_wait_as_requests_of_their_own():
    m = KVCacheManager(num_blocks=8, block_size=4)
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), m)
    a, b, c = (make_request(i, list(range(8))) for i in "abc")
    a.forks = [b, c]
    s.add_request(a)
    assert scheduled(s.schedule()) == [("a", 7, [0, 1])]
    # block 0 is full and cached: c, waiting, will find it; the partial block 1 is forked to b
    out = s.schedule()
    assert scheduled(out) == [("a", 1, [0, 2]), ("b", 1, [0, 1])]
    assert out.blocks_to_copy == [(1, 2)] and list(s.waiting) == [c]
