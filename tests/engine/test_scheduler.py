from collections import Counter

from qserve.engine.kv_cache_manager import KVCacheManager
from qserve.engine.request import Request, RequestStatus
from qserve.engine.sampling_params import SamplingParams
from qserve.engine.scheduler import Scheduler, SchedulerConfig


def make_scheduler(num_blocks=100, block_size=4, max_num_seqs=8, budget=64, caching=True):
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=1024
    )
    return Scheduler(config, KVCacheManager(num_blocks, block_size, caching))


def make_request(request_id: str, num_prompt: int, max_tokens: int = 8, first: int = 0) -> Request:
    prompt = [first + i for i in range(num_prompt)]
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def step(s: Scheduler, token: int = 1) -> dict[str, int]:
    out = s.schedule()
    s.update_from_output(
        out, {x.request.request_id: token for x in out.scheduled if x.needs_logits}
    )
    return {x.request.request_id: x.num_new_tokens for x in out.scheduled}


def test_prefill_then_decode_in_one_loop():
    s = make_scheduler()
    s.add_request(make_request("a", 10))
    s.add_request(make_request("b", 3))
    assert step(s) == {"a": 10, "b": 3}
    assert step(s) == {"a": 1, "b": 1}
    assert s.requests["a"].output_token_ids == [1, 1]


def test_chunked_prefill_under_token_budget_and_no_sample_mid_prompt():
    s = make_scheduler(budget=8)
    s.add_request(make_request("a", 20))
    s.add_request(make_request("b", 4))
    assert step(s) == {"a": 8}
    assert s.requests["a"].output_token_ids == []
    assert step(s) == {"a": 8}
    assert step(s) == {"a": 4, "b": 4}  # a finishes its prompt, b joins with the rest
    assert s.requests["a"].output_token_ids == [1]
    assert step(s) == {"a": 1, "b": 1}


def test_max_num_seqs_limits_running():
    s = make_scheduler(max_num_seqs=2)
    for r in "abc":
        s.add_request(make_request(r, 4))
    assert step(s) == {"a": 4, "b": 4}
    assert [r.request_id for r in s.waiting] == ["c"]


def test_finished_requests_leave_and_waiting_join():
    s = make_scheduler(max_num_seqs=1)
    s.add_request(make_request("a", 4, max_tokens=2))
    s.add_request(make_request("b", 4, max_tokens=1))
    assert step(s) == {"a": 4}
    assert step(s) == {"a": 1}  # a's second token: finished
    assert s.requests.get("a") is None
    assert step(s) == {"b": 4}
    assert not s.has_unfinished_requests()
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 100


def test_preempts_newest_and_recomputes_it_later():
    # 4 blocks of 4 tokens; a and b each hold 2 blocks after their 8-token prompts
    s = make_scheduler(num_blocks=4, caching=False)
    s.add_request(make_request("a", 8, max_tokens=4))
    s.add_request(make_request("b", 8, max_tokens=4, first=100))
    assert step(s) == {"a": 8, "b": 8}
    # a's 9th token needs a third block: b (the newest) is preempted
    out = s.schedule()
    assert out.preempted_req_ids == ["b"]
    assert [x.request.request_id for x in out.scheduled] == ["a"]
    b = s.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert list(s.waiting) == [b] and b.output_token_ids == [1]
    s.update_from_output(out, {"a": 2})
    while "a" in s.requests:
        step(s, 2)
    # b comes back and recomputes its prompt plus the token it had already produced
    assert step(s, 3) == {"b": 9}
    assert b.output_token_ids == [1, 3]
    assert s.num_preemptions == 1


def test_preempted_request_comes_back_through_the_prefix_cache():
    # blocks 0-1 hold a's prompt, 2-3 b's, block 4 is free
    s = make_scheduler(num_blocks=5, caching=True)
    s.add_request(make_request("a", 8, max_tokens=8))
    s.add_request(make_request("b", 8, max_tokens=8, first=100))
    step(s)
    out = s.schedule()  # a takes block 4; b finds none and preempts itself
    assert out.preempted_req_ids == ["b"]
    assert [x.request.request_id for x in out.scheduled] == ["a"]
    s.update_from_output(out, {"a": 1})
    free = s.kv_cache_manager.block_pool.free_block_queue.get_all_free_blocks()
    assert [blk.block_id for blk in free] == [3, 2]  # b's blocks, tail first, still cached
    while "a" in s.requests:
        step(s)  # a's 13th token evicts block 3, b's second block
    # b is recomputed: its first block is a prefix-cache hit, the other 5 tokens run again
    assert step(s) == {"b": 5}
    assert s.requests["b"].num_computed_tokens == 9


def test_abort_frees_blocks():
    s = make_scheduler()
    s.add_request(make_request("a", 10))
    s.add_request(make_request("b", 10))
    step(s)
    s.finish_requests(["a", "b"], RequestStatus.FINISHED_ABORTED)
    assert not s.has_unfinished_requests()
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 100


def test_waiting_sequences_are_admitted_fairly_between_groups():
    """Eight sequences of one client request ("big"), then a one-sequence request: the small
    one is admitted in the first step, not after the big one's sequences (first come, first
    served would have run big/0..3 first)."""
    s = make_scheduler(max_num_seqs=4)
    for i in range(8):
        request = make_request(f"big/{i}", 4)
        request.group = "big"
        s.add_request(request)
    s.add_request(make_request("small", 4, max_tokens=1))
    assert sorted(step(s)) == ["big/0", "big/1", "big/2", "small"]
    assert s.requests.get("small") is None  # finished after its one token
    assert sorted(step(s)) == ["big/0", "big/1", "big/2", "big/3"]


def test_preempted_requests_come_back_before_any_group():
    from qserve.engine.waiting_queue import WaitingQueue

    queue = WaitingQueue()
    a, b, c = make_request("a", 2), make_request("b", 2), make_request("c", 2)
    queue.append(a)
    queue.append(b)
    queue.appendleft(c)
    assert list(queue) == [c, a, b] and len(queue) == 3
    running = Counter({"c": 1})
    assert queue.peek(running) is c
    queue.remove(c)
    assert queue.peek(Counter({"a": 2})) is b
    queue.remove(b)
    queue.remove(a)
    assert not queue and queue.peek(Counter()) is None
