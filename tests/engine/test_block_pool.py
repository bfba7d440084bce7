from qserve.engine.block_pool import (
    BlockPool,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    hash_block_tokens,
)


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def test_free_queue_pops_head_appends_tail_and_removes_from_middle():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    assert q.popleft().block_id == 0
    q.remove(blocks[2])
    q.append(blocks[0])
    assert [b.block_id for b in q.get_all_free_blocks()] == [1, 3, 4, 0]
    assert q.num_free_blocks == 4


def test_get_new_blocks_in_order_with_ref_count_one():
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.get_num_free_blocks() == 3
    assert free_ids(pool) == [3, 4, 5]


def test_free_blocks_go_to_the_tail_in_the_given_order():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [3, 2, 1, 0]


def test_shared_block_is_freed_only_at_ref_count_zero():
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and pool.get_num_free_blocks() == 1
    pool.free_blocks([block])
    assert pool.get_num_free_blocks() == 2


def test_cached_free_block_is_evicted_when_reused():
    pool = BlockPool(1)
    (block,) = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [1, 2])
    pool.cache_full_block(block, h, [1, 2])
    pool.free_blocks([block])
    assert pool.get_cached_block(h, [1, 2]) is block  # free but still cached
    pool.touch([block])  # a hit takes it back out of the free queue
    assert pool.get_num_free_blocks() == 0
    pool.free_blocks([block])
    (again,) = pool.get_new_blocks(1)
    assert again is block and block.block_hash is None
    assert pool.get_cached_block(h, [1, 2]) is None


def test_hash_chains_parent():
    a = hash_block_tokens(None, [1, 2, 3])
    assert hash_block_tokens(a, [4]) != hash_block_tokens(None, [4])
    assert hash_block_tokens(a, [4]) == hash_block_tokens(hash_block_tokens(None, [1, 2, 3]), [4])


def test_hash_is_sha256_of_parent_tokens_and_extra_keys():
    a = hash_block_tokens(None, [1, 2, 3])
    assert isinstance(a, bytes) and len(a) == 32
    assert hash_block_tokens(None, [1, 2, 3], b"salt:x") != a
    assert hash_block_tokens(None, [1, 2, 3], b"salt:x") != hash_block_tokens(None, [1, 2, 3], b"y")


def test_a_hit_must_hold_the_same_tokens():
    """The token check guards a hit even if two keys ever collided."""
    pool = BlockPool(1)
    (block,) = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [1, 2])
    pool.cache_full_block(block, h, [1, 2])
    assert pool.get_cached_block(h, [1, 3]) is None
    assert pool.get_cached_block(h, [1, 2]) is block
