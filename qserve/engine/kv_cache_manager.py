"""Hands out KV cache blocks to requests: blocks or None, never an exception on "full".

A request can be forked (beam search): the child shares every block of its parent, ref counts
up. Full blocks are never written again, so only a shared partial last block needs care: the
first sequence that appends into it gets a copy (copy-on-write), scheduled as a block copy
`(src, dst)` that the model runner performs on the KV pages before the step's forward, as
vLLM's `blocks_to_copy`. The last holder writes into the original.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from qserve.engine.block_pool import BlockHash, BlockPool, KVCacheBlock, hash_block_tokens
from qserve.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_to_block_hashes: dict[str, list[BlockHash]] = {}
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        # blocks this step put in the prefix cache before the model wrote their K/V: taken out
        # again if the step fails (`uncache_step`), so no later prompt reuses unwritten pages
        self._step_cached: list[tuple[str, KVCacheBlock]] = []
        # copy-on-write copies this step: (src block id, dst block id), done before the forward
        self.blocks_to_copy: list[tuple[int, int]] = []

    def begin_step(self) -> None:
        self._step_cached.clear()
        self.blocks_to_copy = []

    def uncache_step(self) -> None:
        """The step failed: what it cached holds no K/V; forget it."""
        for request_id, block in self._step_cached:
            self.block_pool.uncache(block)
            self.num_cached_block.pop(request_id, None)
        self._step_cached.clear()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def block_hashes(self, request: Request) -> list[BlockHash]:
        """Keys of the request's full blocks so far, extended as tokens arrive. The request's
        cache salt goes into its first block's key, so it reaches every block of the chain."""
        hashes = self.req_to_block_hashes.setdefault(request.request_id, [])
        for i in range(len(hashes), request.num_tokens // self.block_size):
            parent, salt = (hashes[-1], b"") if hashes else (None, request.cache_salt_key)
            hashes.append(hash_block_tokens(parent, self._block_tokens(request, i), salt))
        return hashes

    def _block_tokens(self, request: Request, index: int) -> list[int]:
        return request.all_token_ids[index * self.block_size : (index + 1) * self.block_size]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of the request's full blocks, and its length in tokens.

        At least one token is always left to compute, so the request produces logits. A request
        that asks for prompt logprobs gets no hits (as in vLLM): cached positions have no logits
        to score the prompt with; its blocks are still cached for others."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        hits: list[KVCacheBlock] = []
        for i, block_hash in enumerate(self.block_hashes(request)):
            block = self.block_pool.get_cached_block(block_hash, self._block_tokens(request, i))
            if block is None:
                break
            hits.append(block)
        if hits and len(hits) * self.block_size >= request.num_tokens_to_compute:
            hits.pop()
        num_computed_tokens = len(hits) * self.block_size
        self.prefix_cache_stats.queries += request.num_tokens
        self.prefix_cache_stats.hits += num_computed_tokens
        return hits, num_computed_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones; a shared partial
        block they write into is copied first (copy-on-write).

        Returns the newly allocated blocks (the copy included), or None (nothing changed) when
        too few are free."""
        req_blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_required = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = num_required - len(req_blocks) - len(new_computed_blocks)
        cow_index = self._shared_partial_block(req_blocks, num_computed, num_new_tokens)
        # Hits that are currently free leave the free queue when touched.
        num_free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        num_needed = max(num_new_blocks, 0) + (cow_index is not None)
        if num_needed > self.block_pool.get_num_free_blocks() - num_free_hits:
            return None
        self.block_pool.touch(new_computed_blocks)
        req_blocks.extend(new_computed_blocks)
        copied = [] if cow_index is None else [self._copy_on_write(req_blocks, cow_index)]
        new_blocks = self.block_pool.get_new_blocks(max(num_new_blocks, 0))
        req_blocks.extend(new_blocks)
        self._cache_full_blocks(request, num_computed + num_new_tokens)
        return copied + new_blocks

    def _shared_partial_block(
        self, req_blocks: list[KVCacheBlock], num_computed: int, num_new_tokens: int
    ) -> int | None:
        """Index of the partly filled block the new tokens write into, when it is shared."""
        index = num_computed // self.block_size
        if num_new_tokens == 0 or num_computed % self.block_size == 0 or index >= len(req_blocks):
            return None
        return index if req_blocks[index].ref_cnt > 1 else None

    def _copy_on_write(self, req_blocks: list[KVCacheBlock], index: int) -> KVCacheBlock:
        """Give the request its own copy of a shared block; the others keep the original."""
        src = req_blocks[index]
        (dst,) = self.block_pool.get_new_blocks(1)
        self.block_pool.free_blocks([src])  # ref_cnt stays >= 1: other holders remain
        req_blocks[index] = dst
        self.blocks_to_copy.append((src.block_id, dst.block_id))
        return dst

    def fork(self, parent_id: str, child_id: str) -> None:
        """`child_id` shares every block of `parent_id` (ref counts up) and its block keys; a
        partial last block is copied by whichever of them appends into it first."""
        blocks = self.req_to_blocks.get(parent_id, [])
        self.block_pool.touch(blocks)
        self.req_to_blocks[child_id] = list(blocks)
        if parent_id in self.req_to_block_hashes:
            self.req_to_block_hashes[child_id] = list(self.req_to_block_hashes[parent_id])
        if parent_id in self.num_cached_block:
            self.num_cached_block[child_id] = self.num_cached_block[parent_id]

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register blocks that are full once this step's tokens are written."""
        if not self.enable_caching:
            return
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        start = self.num_cached_block.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self.block_hashes(request)
        blocks = self.req_to_blocks[request.request_id]
        for i in range(start, num_full):
            self.block_pool.cache_full_block(blocks[i], hashes[i], self._block_tokens(request, i))
            self._step_cached.append((request.request_id, blocks[i]))
        self.num_cached_block[request.request_id] = num_full

    def slot_usage(self, requests: list[Request]) -> tuple[int, int]:
        """(token slots holding computed tokens, slots of the blocks these requests hold).

        A block shared by several requests counts once."""
        filled: dict[int, int] = {}
        for request in requests:
            for i, block in enumerate(self.req_to_blocks.get(request.request_id, [])):
                n = min(self.block_size, max(request.num_computed_tokens - i * self.block_size, 0))
                filled[block.block_id] = max(filled.get(block.block_id, 0), n)
        return sum(filled.values()), len(filled) * self.block_size

    def free(self, request: Request) -> None:
        """Release a finished or preempted request's blocks, tail first (evicted first)."""
        self.release(request.request_id)

    def release(self, request_id: str) -> None:
        """Drop the references `request_id` holds (a request, or a fork that only holds blocks,
        as a finished beam does), tail first."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.block_pool.free_blocks(reversed(blocks))
        self.num_cached_block.pop(request_id, None)

    def forget(self, request: Request | str) -> None:
        """Drop per-request bookkeeping once a request (or a fork held by id) is gone for good."""
        request_id = request if isinstance(request, str) else request.request_id
        self.release(request_id)
        self.req_to_block_hashes.pop(request_id, None)
