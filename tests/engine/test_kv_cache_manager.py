from qserve.engine.kv_cache_manager import KVCacheManager
from qserve.engine.request import Request
from qserve.engine.sampling_params import SamplingParams


def make_request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=4))


def admit(manager: KVCacheManager, request: Request) -> list[int]:
    hits, num_computed = manager.get_computed_blocks(request)
    new = manager.allocate_slots(request, request.num_tokens - num_computed, hits)
    assert new is not None
    request.num_computed_tokens = request.num_tokens
    return manager.get_block_ids(request.request_id)


def test_allocate_counts_blocks_in_tokens():
    m = KVCacheManager(num_blocks=10, block_size=4)
    r = make_request("a", list(range(10)))
    assert admit(m, r) == [0, 1, 2]
    # two more tokens fit in block 2; a third needs block 3
    r.append_output_token_ids(100)
    assert m.allocate_slots(r, 1) == []
    r.num_computed_tokens += 1
    r.append_output_token_ids(101)
    assert m.allocate_slots(r, 1) == []
    r.num_computed_tokens += 1
    r.append_output_token_ids(102)
    assert [b.block_id for b in m.allocate_slots(r, 1)] == [3]


def test_allocate_returns_none_and_changes_nothing_when_full():
    m = KVCacheManager(num_blocks=2, block_size=4)
    r = make_request("a", list(range(12)))
    assert m.allocate_slots(r, 12) is None
    assert m.block_pool.get_num_free_blocks() == 2
    assert m.get_block_ids("a") == []


def test_prefix_hit_reuses_full_blocks_and_bumps_ref_counts():
    m = KVCacheManager(num_blocks=10, block_size=4)
    a = make_request("a", list(range(10)))
    assert admit(m, a) == [0, 1, 2]
    b = make_request("b", list(range(8)) + [50, 51, 52])
    hits, num_computed = m.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0, 1] and num_computed == 8
    new = m.allocate_slots(b, 3, hits)
    assert [x.block_id for x in new] == [3]
    assert m.get_block_ids("b") == [0, 1, 3]
    assert [m.block_pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    assert m.prefix_cache_stats.hits == 8 and m.prefix_cache_stats.queries == 21


def test_full_prompt_hit_leaves_one_token_to_compute():
    m = KVCacheManager(num_blocks=10, block_size=4)
    admit(m, make_request("a", list(range(8))))
    b = make_request("b", list(range(8)))
    hits, num_computed = m.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0] and num_computed == 4


def test_freed_cached_blocks_are_hit_and_evicted_lru_tail_first():
    m = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request("a", list(range(12)))
    assert admit(m, a) == [0, 1, 2]
    m.free(a)
    # free order: the unused block 3, then a's blocks tail first
    assert [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()] == [3, 2, 1, 0]
    # a newcomer with another prompt takes block 3 and then evicts a's tail (block 2)
    c = make_request("c", [9] * 8)
    assert admit(m, c) == [3, 2]
    # a's first two blocks are still cached
    again = make_request("a2", list(range(12)))
    hits, num_computed = m.get_computed_blocks(again)
    assert [h.block_id for h in hits] == [0, 1] and num_computed == 8


def test_free_hit_counts_against_free_capacity():
    m = KVCacheManager(num_blocks=2, block_size=4)
    a = make_request("a", list(range(5)))
    admit(m, a)
    m.free(a)  # blocks 0 (cached, full) and 1 are free
    b = make_request("b", list(range(4)) + [7, 7, 7, 7, 7])
    hits, num_computed = m.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0] and num_computed == 4
    # needs 2 new blocks but only block 1 is free once the hit is taken
    assert m.allocate_slots(b, 5, hits) is None
    assert m.block_pool.blocks[0].ref_cnt == 0


def test_no_caching_means_no_hits():
    m = KVCacheManager(num_blocks=10, block_size=4, enable_caching=False)
    admit(m, make_request("a", list(range(8))))
    hits, num_computed = m.get_computed_blocks(make_request("b", list(range(8))))
    assert hits == [] and num_computed == 0


# Two 16-token blocks whose Python tuple hashes are equal (CPython's tuple hash is not built to
# resist this; found by sorting 60M prefixes' states). As `hash((parent, tuple(ids)))` block keys
# they collided, and the second prompt was served the first one's KV cache.
COLLIDING_BLOCKS = (
    [15, 43407, 504, 2365, 314, 1132, 28, 260, 4132, 282, 1400, 30, 33, 4475, 30, 6634],
    [170, 29088, 504, 2365, 314, 1132, 28, 260, 4132, 282, 1400, 30, 33, 4475, 30, 0],
)


def test_python_hash_collision_is_not_a_cache_hit():
    a, b = COLLIDING_BLOCKS
    assert a != b and hash((None, tuple(a))) == hash((None, tuple(b)))
    m = KVCacheManager(num_blocks=10, block_size=16)
    admit(m, make_request("attacker", b + [7]))
    hits, num_computed = m.get_computed_blocks(make_request("victim", a + [7]))
    assert hits == [] and num_computed == 0


def test_cache_salt_isolates_prefixes():
    m = KVCacheManager(num_blocks=10, block_size=4)
    tokens = list(range(9))
    admit(m, Request("a", tokens, SamplingParams(max_tokens=4), cache_salt="tenant-1"))
    for salt, num_hit in ((None, 0), ("tenant-2", 0), ("tenant-1", 8)):
        request = Request("b", tokens, SamplingParams(max_tokens=4), cache_salt=salt)
        assert m.get_computed_blocks(request)[1] == num_hit
        m.forget(request)
