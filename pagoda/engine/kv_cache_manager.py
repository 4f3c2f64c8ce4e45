"""Paged KV cache bookkeeping: which fixed-size blocks each request owns, and prefix caching.

`BlockPool` owns the blocks (ref counts, an LRU free queue, the hash -> block map);
`KVCacheManager` maps requests to block lists. Pure Python, no torch: the runner only ever sees
block ids. Block 0 is the null block that pads block tables and is never handed out. With a
sliding window the blocks that fall wholly out of it go back to the pool (their prefix-cache
entries kept until evicted) and the null block takes their place in the request's list.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator, Sequence

    from pagoda.engine.request import Request

# Parent of a request's first block: a fixed 32-byte value keeps every hash input laid out as
# (32-byte parent, block_size int64 tokens, extra keys), so no two inputs can collide by layout.
_ROOT_HASH = hashlib.sha256(b"pagoda.prefix_cache.v1").digest()


def hash_block_tokens(
    parent_hash: bytes | None, token_ids: Sequence[int], extra_keys: tuple = ()
) -> bytes:
    """Chained block hash H(parent, tokens, extra_keys).

    sha256 rather than Python's `hash()`: it is randomized per process, and a collision would
    silently serve another prompt's KV.
    """
    h = hashlib.sha256(_ROOT_HASH if parent_hash is None else parent_hash)
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


@dataclass(eq=False, slots=True)
class KVCacheBlock:
    """One block's metadata. The free-queue links live here so that removal is O(1)."""

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None  # set while the block is in the prefix-cache map
    prev_free: KVCacheBlock | None = field(default=None, repr=False)
    next_free: KVCacheBlock | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Doubly linked list of free blocks in eviction order (head is evicted first).

    A cached block stays in this queue while free; a prefix hit pulls it out of the middle,
    which is why this is a linked list and not a deque.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        # Sentinels remove every empty-list special case; a block is queued iff prev_free is set.
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        assert block is not self._tail, "popleft from an empty free queue"
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"block {block.block_id} is not free"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        assert block.prev_free is None, f"block {block.block_id} is already free"
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free

    def __len__(self) -> int:
        return self.num_free_blocks


class BlockPool:
    """All blocks, their ref counts, the free queue and the prefix-cache map.

    Blocks never handed out yet exist only as a count: they are handed out first, in id order,
    as if they stood at the head of the free queue, and get their metadata object then. So a
    pool of millions of blocks (a small model on a large GPU) costs nothing to create.
    """

    def __init__(self, num_blocks: int) -> None:
        self.null_block = KVCacheBlock(0)
        self.null_block.ref_cnt = 1  # pinned: never freed, never queued
        self.blocks = [self.null_block]  # blocks [0, len) have objects; the rest are fresh
        self._num_fresh = num_blocks - 1
        self.free_queue = FreeBlockQueue(())  # blocks freed after use, in eviction order
        self.cached_blocks: dict[bytes, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out, including free blocks still holding cached KV."""
        return self._num_fresh + self.free_queue.num_free_blocks

    def ref_cnt(self, block_id: int) -> int:
        """References to a block (0 for one never handed out)."""
        return self.blocks[block_id].ref_cnt if block_id < len(self.blocks) else 0

    def free_block_ids(self) -> list[int]:
        """Every free block id in the order they would be handed out (fresh ones first)."""
        first = len(self.blocks)
        fresh = range(first, first + self._num_fresh)
        return [*fresh, *(b.block_id for b in self.free_queue)]

    def get_new_blocks(self, num_blocks: int) -> list[int]:
        """Fresh blocks first, then the head of the free queue, evicting their cached KV."""
        assert num_blocks <= self.num_free_blocks, "caller must check num_free_blocks"
        new_ids = []
        for _ in range(num_blocks):
            if self._num_fresh:
                block = KVCacheBlock(len(self.blocks))
                self.blocks.append(block)
                self._num_fresh -= 1
            else:
                block = self.free_queue.popleft()
            if block.block_hash is not None:
                # Its KV is about to be overwritten: no prefix may hit it any more.
                del self.cached_blocks[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            new_ids.append(block.block_id)
        return new_ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on (prefix-hit) blocks, pulling free ones out of the queue."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference each; blocks reaching zero join the queue tail in the given order."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_cnt > 0 and block_id != 0, f"double free of block {block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_block(self, block_id: int, block_hash: bytes) -> None:
        """Register a full block under its hash, unless that content is cached already."""
        block = self.blocks[block_id]
        if block.block_hash is not None:
            return  # a prefix hit: already in the map
        # Same content computed twice (e.g. two requests admitted before either was cached):
        # keep the existing mapping, this copy simply is not shareable.
        if block_hash in self.cached_blocks:
            return
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block

    def reset_prefix_cache(self) -> None:
        for block in self.cached_blocks.values():
            block.block_hash = None
        self.cached_blocks.clear()


class KVCacheManager:
    """Per-request block lists on top of a `BlockPool`, with chained-hash prefix caching."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        sliding_window: int | None = None,
    ) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}"
            )
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if sliding_window is not None and (
            isinstance(sliding_window, bool)
            or not isinstance(sliding_window, int)
            or sliding_window < 1
        ):
            raise ValueError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        # Every attention layer sees only the last `sliding_window` keys (None: all of them).
        self.sliding_window = sliding_window
        self.block_pool = BlockPool(num_blocks)
        self._req_blocks: dict[str, list[int]] = {}
        # Leading full blocks of each request already offered to the hash map, so that a decode
        # step only ever hashes the one block it fills.
        self._num_cached_blocks: dict[str, int] = {}
        # Leading entries of each request's list that are the null block (out of the window).
        self._num_dropped_blocks: dict[str, int] = {}
        self._queried_tokens = 0
        self._hit_tokens = 0

    # -- queries ---------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of allocatable blocks held by requests (free cached blocks count as free)."""
        return 1.0 - self.block_pool.num_free_blocks / (self.num_blocks - 1)

    @property
    def prefix_cache_stats(self) -> tuple[int, int]:
        """(prompt tokens looked up, tokens served from the cache), counted once per admission."""
        return self._queried_tokens, self._hit_tokens

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block ids; the same list object for as long as it holds blocks."""
        return self._req_blocks[request_id]

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest run of cached full blocks at the start of the request, and its token count.

        At most num_tokens - 1 tokens are reported: the last token must be computed so that the
        model produces logits to sample from.
        """
        if not self.enable_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._hash_blocks(request, max_blocks)
        cached = self.block_pool.cached_blocks
        hashes = request.block_hashes
        hit: list[int] = []
        for i in range(max_blocks):
            block = cached.get(hashes[i])
            if block is None:
                break
            hit.append(block.block_id)
        return hit, len(hit) * self.block_size

    # -- state changes ---------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_block_ids: Sequence[int] = (),
        num_lookahead_tokens: int = 0,
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones.

        `new_computed_block_ids` are prefix-hit blocks from `get_computed_blocks`, not yet
        counted in `request.num_computed_tokens`. `num_lookahead_tokens` more slots are
        reserved past them (a draft model writes its proposals' KV there after the step); they
        are never hashed. Returns the newly allocated block ids, or None (and changes nothing)
        when the free pool cannot cover them.
        """
        bs = self.block_size
        req_id = request.request_id
        req_blocks = self._req_blocks.get(req_id)
        num_hit = len(new_computed_block_ids)
        # Blocks wholly before the window of the first token computed now are never read again.
        num_dropped = self._num_out_of_window(request.num_computed_tokens + num_hit * bs)
        if req_blocks is not None and not new_computed_block_ids:
            # Fast path, taken by most decode steps: the tokens fit in the blocks already owned
            # and no block becomes full or leaves the window, so there is nothing to do.
            num_total = request.num_computed_tokens + num_new_tokens
            if (
                num_total + num_lookahead_tokens <= len(req_blocks) * bs
                and (
                    not self.enable_caching
                    or min(num_total, request.num_tokens) // bs
                    <= self._num_cached_blocks.get(req_id, 0)
                )
                and num_dropped <= self._num_dropped_blocks.get(req_id, 0)
            ):
                return []
        pool = self.block_pool
        num_owned = len(req_blocks) if req_blocks is not None else 0
        assert not (new_computed_block_ids and num_owned), "prefix hits only for a fresh request"

        num_total = request.num_computed_tokens + num_hit * bs + num_new_tokens
        num_slots = num_total + num_lookahead_tokens
        num_new_blocks = max(0, -(-num_slots // bs) - num_owned - num_hit)
        # Hits out of the window are not taken at all (their entries become the null block); a
        # hit on a free cached block takes it out of the free queue as well.
        hit_ids = list(new_computed_block_ids)
        num_skipped = min(num_dropped, num_hit)
        num_hit_free = sum(1 for b in hit_ids[num_skipped:] if pool.blocks[b].ref_cnt == 0)
        # Owned blocks leaving the window now are freed before the new ones are taken.
        num_leaving = max(0, min(num_dropped, num_owned) - self._num_dropped_blocks.get(req_id, 0))
        if num_new_blocks + num_hit_free > pool.num_free_blocks + num_leaving:
            return None

        if req_blocks is None:
            req_blocks = self._req_blocks[req_id] = []
            if self.enable_caching and request.num_computed_tokens == 0:
                # Counted here rather than in get_computed_blocks so that a request that waits
                # several steps for blocks is counted once.
                self._queried_tokens += request.num_tokens
                self._hit_tokens += num_hit * bs
        if num_hit:
            pool.touch(hit_ids[num_skipped:])
            req_blocks.extend([0] * num_skipped + hit_ids[num_skipped:])
            self._num_cached_blocks[req_id] = num_hit
            self._num_dropped_blocks[req_id] = num_skipped
        self._drop_out_of_window(req_id, req_blocks, num_dropped)
        new_ids = pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_ids)

        if self.enable_caching:
            # Only blocks whose tokens are all known can be hashed; this step fills them.
            num_full = min(num_total, request.num_tokens) // bs
            num_cached = self._num_cached_blocks.get(req_id, 0)
            if num_full > num_cached:
                self._hash_blocks(request, num_full)
                hashes = request.block_hashes
                for i in range(num_cached, num_full):
                    # 0: dropped before its last token was known (a window of 1 with a pending
                    # token): its KV is gone, so it is simply not offered.
                    if req_blocks[i]:
                        pool.cache_block(req_blocks[i], hashes[i])
                self._num_cached_blocks[req_id] = num_full
        return new_ids

    def free(self, request: Request) -> None:
        """Release the request's blocks; a request without blocks (aborted early) is a no-op.

        Blocks are queued tail first, so a prompt's last block is evicted before its first:
        the first blocks are the ones other prompts are most likely to share.
        """
        block_ids = self._req_blocks.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        num_dropped = self._num_dropped_blocks.pop(request.request_id, 0)
        if block_ids:
            # The list itself is left intact: the runner may still hold this step's reference.
            self.block_pool.free(reversed(block_ids[num_dropped:]))

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (e.g. after new weights); blocks in use are untouched."""
        self.block_pool.reset_prefix_cache()

    # -- internals -------------------------------------------------------------------------

    def _num_out_of_window(self, first_pos: int) -> int:
        """Leading blocks no query at position >= first_pos can see (0 without a window).

        Query i sees keys j > i - W, so keys before first_pos - W + 1 are never read again.
        """
        if self.sliding_window is None:
            return 0
        return max(0, first_pos - self.sliding_window + 1) // self.block_size

    def _drop_out_of_window(self, req_id: str, req_blocks: list[int], num_dropped: int) -> None:
        """Free the request's blocks before `num_dropped` and put the null block in their place.

        The list keeps its length, so positions still map to their block index. A freed block
        keeps its hash: until the pool hands it out again it is a valid prefix-cache hit for
        other requests (its content is exactly what its chained hash says). Freeing while a
        step that reads it may still run is safe: a reuse is written by a later step, and the
        device runs steps in stream order.
        """
        done = self._num_dropped_blocks.get(req_id, 0)
        num_dropped = min(num_dropped, len(req_blocks))
        if num_dropped <= done:
            return
        freed = req_blocks[done:num_dropped]
        req_blocks[done:num_dropped] = [0] * (num_dropped - done)
        self._num_dropped_blocks[req_id] = num_dropped
        # Oldest last in the queue: a prompt's first blocks are the most likely to be shared.
        self.block_pool.free(reversed(freed))

    def _hash_blocks(self, request: Request, num_blocks: int) -> None:
        """Extend `request.block_hashes` to its first `num_blocks` full blocks.

        Hashes depend on content only, so they survive preemption and are computed once.
        """
        hashes = request.block_hashes
        if len(hashes) >= num_blocks:
            return
        bs = self.block_size
        tokens = request.all_token_ids
        assert num_blocks * bs <= len(tokens), "only full blocks are hashed"
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), num_blocks):
            start = i * bs
            parent = hash_block_tokens(
                parent, tokens[start : start + bs], request.extra_keys(start, start + bs)
            )
            hashes.append(parent)
