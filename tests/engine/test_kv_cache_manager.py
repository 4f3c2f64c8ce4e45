"""KV cache manager: exact block ids, prefix hits, LRU eviction order and the free queue.

Every test drives a small pool (block_size 16, ten blocks: the null block plus nine) and pins the
ids handed out, so any change to allocation or eviction order shows up here.
"""

from __future__ import annotations

import pytest

from pagoda.engine.kv_cache_manager import BlockPool, KVCacheManager, hash_block_tokens
from pagoda.engine.request import Request
from pagoda.sampling_params import SamplingParams

BS = 16


def make_request(req_id: str, tokens, **kwargs) -> Request:
    return Request(req_id, list(tokens), SamplingParams(max_tokens=16), **kwargs)


def free_ids(kv: KVCacheManager) -> list[int]:
    return kv.block_pool.free_block_ids()


def ref_cnts(kv: KVCacheManager, ids) -> list[int]:
    return [kv.block_pool.ref_cnt(i) for i in ids]


def admit(kv: KVCacheManager, req: Request) -> tuple[list[int], int]:
    """Admit like the scheduler does: look up hits, allocate the rest of the prompt."""
    hit_ids, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit, hit_ids) is not None
    req.num_computed_tokens = num_hit
    return hit_ids, num_hit


def test_fresh_pool_hands_out_ids_in_order_and_never_the_null_block():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=True)
    req = make_request("a", range(40))
    assert kv.allocate_slots(req, 40) == [1, 2, 3]
    assert kv.get_block_ids("a") == [1, 2, 3]
    assert kv.num_free_blocks == 6
    assert kv.usage == pytest.approx(3 / 9)
    other = make_request("b", range(1000, 1000 + 6 * BS))
    assert kv.allocate_slots(other, 6 * BS) == [4, 5, 6, 7, 8, 9]
    assert kv.num_free_blocks == 0 and kv.usage == 1.0
    assert kv.allocate_slots(make_request("c", [1]), 1) is None


def test_block_ids_list_is_live_and_decode_allocates_one_block_per_block_size_tokens():
    kv = KVCacheManager(10, BS)
    req = make_request("a", range(20))
    assert kv.allocate_slots(req, 20) == [1, 2]
    live = kv.get_block_ids("a")
    req.num_computed_tokens = 20
    new_blocks = []
    for t in range(12):  # decode tokens 20..31 fit in block 2; token 32 needs block 3
        req.append_output_token_ids(100 + t)
        new_blocks.append(kv.allocate_slots(req, 1))
        req.num_computed_tokens += 1
    assert new_blocks == [[]] * 12
    req.append_output_token_ids(200)
    assert kv.allocate_slots(req, 1) == [3]
    assert kv.get_block_ids("a") is live and live == [1, 2, 3]
    # Block 2 became full during decode: hashed once, cached, and shareable.
    assert len(req.block_hashes) == 2
    assert kv.block_pool.cached_blocks[req.block_hashes[1]].block_id == 2


def test_second_request_with_same_prompt_hits_its_full_blocks():
    kv = KVCacheManager(10, BS)
    a = make_request("a", range(33))
    admit(kv, a)
    assert kv.get_block_ids("a") == [1, 2, 3]
    b = make_request("b", range(33))
    assert admit(kv, b) == ([1, 2], 32)
    assert kv.get_block_ids("b") == [1, 2, 4]
    assert ref_cnts(kv, [1, 2, 3, 4]) == [2, 2, 1, 1]
    assert kv.prefix_cache_stats == (66, 32)


def test_different_extra_keys_never_share_blocks():
    kv = KVCacheManager(10, BS)
    admit(kv, make_request("a", range(33)))
    assert kv.get_computed_blocks(make_request("lora", range(33), lora_key="adapter-1")) == ([], 0)

    # Same placeholder tokens, different images at tokens [20, 24): block 0 is shared, block 1
    # (tokens 16..31) is not.
    admit(kv, make_request("img1", range(500, 533), mm_hashes=[(20, 4, "img-A")]))
    img2 = make_request("img2", range(500, 533), mm_hashes=[(20, 4, "img-B")])
    hit_ids, num_hit = kv.get_computed_blocks(img2)
    assert num_hit == 16 and hit_ids == kv.get_block_ids("img1")[:1]
    assert img2.extra_keys(0, 16) == () and img2.extra_keys(16, 32) == ("img-B",)


def test_hit_reports_at_most_num_tokens_minus_one():
    kv = KVCacheManager(10, BS)
    admit(kv, make_request("a", range(32)))
    assert kv.get_block_ids("a") == [1, 2]
    # Both blocks are cached, but the last token must be computed to get logits.
    assert kv.get_computed_blocks(make_request("b", range(32))) == ([1], 16)


def test_only_full_blocks_are_cached():
    kv = KVCacheManager(10, BS)
    a = make_request("a", range(40))
    admit(kv, a)
    pool = kv.block_pool
    assert len(pool.cached_blocks) == 2 and len(a.block_hashes) == 2
    assert [pool.blocks[i].block_hash is not None for i in (1, 2, 3)] == [True, True, False]


def test_free_queue_is_lru_and_each_request_is_freed_tail_first():
    kv = KVCacheManager(10, BS)
    a, b = make_request("a", range(40)), make_request("b", range(100, 120))
    admit(kv, a)
    admit(kv, b)
    assert kv.get_block_ids("a") == [1, 2, 3] and kv.get_block_ids("b") == [4, 5]
    kv.free(a)
    kv.free(b)
    assert free_ids(kv) == [6, 7, 8, 9, 3, 2, 1, 5, 4]

    # 7 blocks evict the never-used ones, then a's partial block 3, then a's LAST full block.
    c = make_request("c", range(1000, 1000 + 7 * BS))
    assert kv.allocate_slots(c, 7 * BS) == [6, 7, 8, 9, 3, 2, 1]
    assert free_ids(kv) == [5, 4]
    # a's blocks were all evicted; b's first block (4) survives because 5 goes first.
    assert kv.get_computed_blocks(make_request("a2", range(40))) == ([], 0)
    assert kv.get_computed_blocks(make_request("b2", range(100, 120))) == ([4], 16)


def test_eviction_drops_the_hash_so_only_the_surviving_prefix_hits():
    kv = KVCacheManager(10, BS)
    a = make_request("a", range(40))
    admit(kv, a)
    kv.free(a)  # queue: 4..9, then 3, 2, 1
    c = make_request("c", range(1000, 1000 + 8 * BS))
    assert kv.allocate_slots(c, 8 * BS) == [4, 5, 6, 7, 8, 9, 3, 2]
    assert [h in kv.block_pool.cached_blocks for h in a.block_hashes] == [True, False]
    assert kv.get_computed_blocks(make_request("a2", range(40))) == ([1], 16)


def test_prefix_hit_on_a_free_block_takes_it_out_of_the_free_queue():
    kv = KVCacheManager(10, BS)
    a = make_request("a", range(33))
    admit(kv, a)
    kv.free(a)
    assert free_ids(kv) == [4, 5, 6, 7, 8, 9, 3, 2, 1]
    b = make_request("b", range(33))
    assert admit(kv, b) == ([1, 2], 32)
    assert kv.get_block_ids("b") == [1, 2, 4]
    assert free_ids(kv) == [5, 6, 7, 8, 9, 3]
    assert kv.num_free_blocks == 6
    assert ref_cnts(kv, [1, 2, 4]) == [1, 1, 1]
    # The rest of the pool never hands out the reused blocks.
    c = make_request("c", range(1000, 1000 + 6 * BS))
    assert kv.allocate_slots(c, 6 * BS) == [5, 6, 7, 8, 9, 3]


def test_allocation_failure_changes_nothing_and_counts_free_hit_blocks():
    kv = KVCacheManager(10, BS)
    a = make_request("a", range(33))
    admit(kv, a)
    kv.free(a)
    c = make_request("c", range(1000, 1000 + 7 * BS))
    assert kv.allocate_slots(c, 7 * BS) == [4, 5, 6, 7, 8, 9, 3]
    assert free_ids(kv) == [2, 1]  # both still cached
    stats = kv.prefix_cache_stats

    # Hits on 1 and 2 consume both free blocks; the third block has nowhere to come from.
    b = make_request("b", range(33))
    hit_ids, num_hit = kv.get_computed_blocks(b)
    assert (hit_ids, num_hit) == ([1, 2], 32)
    assert kv.allocate_slots(b, 1, hit_ids) is None
    assert free_ids(kv) == [2, 1] and ref_cnts(kv, [1, 2]) == [0, 0]
    assert [kv.block_pool.cached_blocks[h].block_id for h in a.block_hashes] == [1, 2]
    assert kv.prefix_cache_stats == stats
    with pytest.raises(KeyError):
        kv.get_block_ids("b")


def test_free_returns_every_block_and_is_safe_without_blocks():
    kv = KVCacheManager(10, BS)
    kv.free(make_request("never-allocated", [1, 2, 3]))
    a = make_request("a", range(70))
    admit(kv, a)
    assert kv.num_free_blocks == 4
    kv.free(a)
    kv.free(a)
    assert kv.num_free_blocks == 9 and kv.usage == 0.0
    assert ref_cnts(kv, range(1, 10)) == [0] * 9


def test_shared_blocks_stay_allocated_until_the_last_owner_frees_them():
    kv = KVCacheManager(10, BS)
    a, b = make_request("a", range(33)), make_request("b", range(33))
    admit(kv, a)
    admit(kv, b)
    kv.free(a)
    assert free_ids(kv) == [5, 6, 7, 8, 9, 3]
    assert ref_cnts(kv, [1, 2]) == [1, 1]
    kv.free(b)
    assert free_ids(kv) == [5, 6, 7, 8, 9, 3, 4, 2, 1]


def test_duplicate_content_keeps_the_existing_mapping():
    kv = KVCacheManager(10, BS)
    a, b = make_request("a", range(33)), make_request("b", range(33))
    assert kv.allocate_slots(a, 33) == [1, 2, 3]
    assert kv.allocate_slots(b, 33) == [4, 5, 6]  # no lookup: computed a second time
    pool = kv.block_pool
    assert [pool.cached_blocks[h].block_id for h in b.block_hashes] == [1, 2]
    assert pool.blocks[4].block_hash is None and pool.blocks[5].block_hash is None
    kv.free(b)
    assert kv.get_computed_blocks(make_request("c", range(33))) == ([1, 2], 32)


def test_caching_disabled_never_hashes_or_hits():
    kv = KVCacheManager(10, BS, enable_caching=False)
    a = make_request("a", range(33))
    admit(kv, a)
    kv.free(a)
    b = make_request("b", range(33))
    assert admit(kv, b) == ([], 0)
    assert kv.get_block_ids("b") == [4, 5, 6]
    assert a.block_hashes == [] and b.block_hashes == []
    assert kv.block_pool.cached_blocks == {}
    assert kv.prefix_cache_stats == (0, 0)


def test_reset_prefix_cache_forgets_every_block():
    kv = KVCacheManager(10, BS)
    a = make_request("a", range(33))
    admit(kv, a)
    kv.reset_prefix_cache()
    assert kv.get_computed_blocks(make_request("b", range(33))) == ([], 0)
    kv.free(a)
    assert kv.num_free_blocks == 9


def test_block_hash_is_chained_and_deterministic():
    h0 = hash_block_tokens(None, range(16))
    assert h0 == hash_block_tokens(None, list(range(16)))
    assert len(h0) == 32  # sha256: identical in every process, unlike hash()
    h1 = hash_block_tokens(h0, range(16, 32))
    assert h1 != hash_block_tokens(None, range(16, 32))
    assert h1 != hash_block_tokens(h0, range(16, 32), ("lora",))
    req = make_request("a", range(40))
    admit(KVCacheManager(10, BS), req)
    assert req.block_hashes == [h0, h1]


def test_rejects_a_pool_without_usable_blocks():
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheManager(1, BS)


# ---- sliding window: blocks wholly out of the window go back to the pool ---------------------


def prefill(kv: KVCacheManager, req: Request) -> None:
    """Admit and compute the whole prompt in one step."""
    admit(kv, req)
    req.num_computed_tokens = req.num_tokens


def decode(kv: KVCacheManager, req: Request, token: int) -> list[int] | None:
    """One decode step as the scheduler runs it (the token is already known)."""
    req.append_output_token_ids(token)
    new = kv.allocate_slots(req, 1)
    if new is not None:
        req.num_computed_tokens += 1
    return new


def test_window_frees_blocks_that_no_later_query_can_see():
    """W = 20: the token at position p sees keys p - 19 .. p, so block 0 (keys 0-15) leaves
    once p >= 35 and block 1 (16-31) once p >= 51. Freed entries become the null block and the
    list keeps its length, so position // block_size still indexes the right entry."""
    kv = KVCacheManager(10, BS, sliding_window=20)
    a = make_request("a", range(40))
    prefill(kv, a)  # prefill of 40: the first query sees every key, nothing dropped
    assert kv.get_block_ids("a") == [1, 2, 3]
    live = kv.get_block_ids("a")
    assert decode(kv, a, 500) == []  # computes position 40: keys >= 21 visible
    assert live == [0, 2, 3] and kv.get_block_ids("a") is live
    assert kv.num_free_blocks == 7 and ref_cnts(kv, [1]) == [0]
    # positions 41..50: block 1 is still needed by position 50; 48 starts block index 3
    new = [decode(kv, a, t) for t in range(501, 511)]
    assert new == [[]] * 7 + [[4]] + [[]] * 2
    assert live == [0, 2, 3, 4]
    assert decode(kv, a, 511) == []  # position 51 sees keys >= 32
    assert live == [0, 0, 3, 4] and kv.num_free_blocks == 7
    kv.free(a)  # only the blocks still owned are returned; no double free of the dropped ones
    assert kv.num_free_blocks == 9 and ref_cnts(kv, range(1, 10)) == [0] * 9


def test_no_window_keeps_every_block():
    kv = KVCacheManager(10, BS, sliding_window=None)
    a = make_request("a", range(40))
    prefill(kv, a)
    for t in range(30):
        decode(kv, a, 500 + t)
    assert kv.get_block_ids("a") == [1, 2, 3, 4, 5]  # 70 tokens


def test_chunked_prefill_drops_blocks_before_the_chunk_window():
    """Chunk [32, 48) of a prompt with W = 8: its first query (32) sees keys >= 25, so block
    0 is dropped before the chunk's blocks are taken; block 1 (16-31) is still needed."""
    kv = KVCacheManager(10, BS, sliding_window=8)
    a = make_request("a", range(60))
    assert kv.allocate_slots(a, 32) == [1, 2]
    a.num_computed_tokens = 32
    assert kv.allocate_slots(a, 16) == [3]
    assert kv.get_block_ids("a") == [0, 2, 3]
    assert free_ids(kv)[-1] == 1  # back in the pool, newest in the LRU order


def test_leaving_blocks_count_towards_the_allocation():
    """A full pool: the block a decode leaves behind pays for the one it needs."""
    kv = KVCacheManager(4, BS, sliding_window=16)
    a = make_request("a", range(48))
    assert kv.allocate_slots(a, 48) == [1, 2, 3]
    a.num_computed_tokens = 48
    assert kv.num_free_blocks == 0
    # position 48 sees keys >= 33: blocks 0 and 1 leave; block 3 for positions 48-63 is new
    assert decode(kv, a, 7) == [2]
    assert kv.get_block_ids("a") == [0, 0, 3, 2] and free_ids(kv) == [1]


def test_allocation_failure_with_a_window_changes_nothing():
    kv = KVCacheManager(4, BS, sliding_window=40)
    a = make_request("a", range(48))
    assert kv.allocate_slots(a, 48) == [1, 2, 3]
    a.num_computed_tokens = 48
    a.append_output_token_ids(5)
    # position 48 sees keys >= 9: nothing leaves, and the pool is empty
    assert kv.allocate_slots(a, 1) is None
    assert kv.get_block_ids("a") == [1, 2, 3] and kv.num_free_blocks == 0


def test_dropped_blocks_stay_cached_for_other_requests_until_evicted():
    """A dropped block keeps its hash while free: a new request with the same prompt hits it
    (its KV is exactly what the chained hash names). Once the pool hands it out again the hash
    is gone, so the prefix stops matching there: no stale block is ever served."""
    kv = KVCacheManager(8, BS, sliding_window=20)
    a = make_request("a", range(40))
    prefill(kv, a)
    decode(kv, a, 500)
    assert kv.get_block_ids("a") == [0, 2, 3]
    b = make_request("b", range(40))
    assert kv.get_computed_blocks(b) == ([1, 2], 32)
    # evict everything free (block 1 included) with another request
    c = make_request("c", range(1000, 1000 + 5 * BS))
    assert kv.allocate_slots(c, 5 * BS) == [4, 5, 6, 7, 1]
    assert kv.get_computed_blocks(b) == ([], 0)


def test_prefix_hit_skips_blocks_before_the_first_window():
    """With W = 8 a request whose first 48 prompt tokens hit sees keys >= 41 only: hit blocks
    0 and 1 are not taken (null entries, not referenced), block 2 is."""
    kv = KVCacheManager(10, BS, sliding_window=8)
    a = make_request("a", range(50))
    admit(kv, a)
    assert kv.get_block_ids("a") == [1, 2, 3, 4]
    kv.free(a)
    b = make_request("b", range(50))
    hit_ids, num_hit = kv.get_computed_blocks(b)
    assert (hit_ids, num_hit) == ([1, 2, 3], 48)
    assert kv.allocate_slots(b, 2, hit_ids) == [5]  # positions 48, 49 need one more block
    assert kv.get_block_ids("b") == [0, 0, 3, 5]
    assert ref_cnts(kv, [1, 2, 3, 5]) == [0, 0, 1, 1]
    assert kv.prefix_cache_stats == (50 + 50, 48)
    kv.free(b)
    assert kv.num_free_blocks == 9


def test_bad_window():
    for bad in (0, -3, 2.0, True):
        with pytest.raises(ValueError, match="sliding_window must be None or an int >= 1"):
            KVCacheManager(10, BS, sliding_window=bad)


def test_huge_pool_creates_block_metadata_only_when_handed_out():
    """A small model on a large GPU gets millions of blocks: the pool holds them as a count,
    hands them out in id order before any freed block (as the free queue's head), and a block
    gets its metadata when first handed out."""
    pool = BlockPool(50_000_000)
    assert len(pool.blocks) == 1 and pool.num_free_blocks == 50_000_000 - 1
    a = pool.get_new_blocks(2)
    assert a == [1, 2] and len(pool.blocks) == 3
    pool.free(a)
    assert pool.get_new_blocks(1) == [3]  # fresh before the freed (LRU) ones
    assert pool.ref_cnt(1) == 0 and pool.ref_cnt(3) == 1 and pool.ref_cnt(10**6) == 0
    assert pool.num_free_blocks == 50_000_000 - 2
    small = BlockPool(4)
    ids = small.get_new_blocks(3)
    small.free([ids[1], ids[0]])
    assert small.free_block_ids() == [2, 1] and small.get_new_blocks(2) == [2, 1]
