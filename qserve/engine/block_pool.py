"""The pool of KV cache blocks: a free queue with O(1) removal, ref counts and the prefix cache.

Block size is counted in tokens. Every block object exists from the start; allocating pops the
head of the free queue, freeing pushes to the tail. A free block keeps its hash (and stays in the
prefix cache) until it is handed out again, so the free queue doubles as the LRU eviction order.

Block keys are sha256 digests (as vLLM's default `sha256` prefix-caching hash): Python's `hash()`
of a tuple of token ids can be made to collide on purpose, which would hand one client another's
KV cache. A hit also compares the block's token ids, a cheap second guard.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

BlockHash = bytes
ROOT_HASH = bytes(32)  # the parent of a prompt's first block


def hash_block_tokens(
    parent_block_hash: BlockHash | None, token_ids: Sequence[int], extra_keys: bytes = b""
) -> BlockHash:
    """A full block's key: sha256 of its parent's key, its token ids (int64 each) and
    `extra_keys` (a request's cache salt, on its first block), so equal keys mean equal
    prefixes under equal salts."""
    digest = hashlib.sha256(parent_block_hash or ROOT_HASH)
    digest.update(array("q", token_ids).tobytes())
    digest.update(extra_keys)
    return digest.digest()


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] = ()  # of a cached block, checked on every hit
    prev_free_block: KVCacheBlock | None = field(default=None, repr=False)
    next_free_block: KVCacheBlock | None = field(default=None, repr=False)


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks, so a cache hit can leave the middle of it in O(1)."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = 0
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free_block
        if block is self._tail or block is None:
            raise ValueError("no free block left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        assert block.prev_free_block is not None and block.next_free_block is not None
        block.prev_free_block.next_free_block = block.next_free_block
        block.next_free_block.prev_free_block = block.prev_free_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        blocks, block = [], self._head.next_free_block
        while block is not None and block is not self._tail:
            blocks.append(block)
            block = block.next_free_block
        return blocks


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of blocks held by requests (free cached blocks count as free)."""
        return 1.0 - self.get_num_free_blocks() / self.num_blocks

    def get_cached_block(
        self, block_hash: BlockHash, token_ids: Sequence[int]
    ) -> KVCacheBlock | None:
        """The cached block under `block_hash`, if it holds exactly `token_ids`."""
        block = self.cached_block_hash_to_block.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop blocks off the free queue head (evicting their cached hash), ref count 1."""
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"cannot get {num_blocks} blocks, {self.get_num_free_blocks()} free")
        blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            self._maybe_evict_cached_block(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached_block_hash_to_block.get(block.block_hash) is block:
            del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None
        block.token_ids = ()

    def uncache(self, block: KVCacheBlock) -> None:
        """Take a block out of the prefix cache (its K/V were never written)."""
        self._maybe_evict_cached_block(block)

    def cache_full_block(
        self, block: KVCacheBlock, block_hash: BlockHash, token_ids: Sequence[int]
    ) -> None:
        """Register a block whose tokens are all known; the first block with a hash wins."""
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self.cached_block_hash_to_block.setdefault(block_hash, block)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits; a free hit leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference; blocks reaching zero go to the free queue tail in the given order
        (callers pass a request's blocks in reverse so that chain tails are evicted first)."""
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)
