"""Block pool and KV-cache manager: reference counts, prefix caching, all-or-nothing
allocation, fork with copy-on-write, swap. Tiny pools: block size 4, 8–16 blocks."""

import pytest

from kvcache.block_pool import BlockPool, KVCacheError, hash_block_tokens
from kvcache.manager import KVCacheManager

BS = 4


def test_allocate_and_free_keep_counts():
    pool = BlockPool(8)
    blocks = pool.allocate(3)
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert (pool.num_free_blocks, pool.num_used_blocks) == (5, 3)
    pool.touch(blocks[:1])
    pool.free(blocks)
    assert blocks[0].ref_cnt == 1 and pool.num_used_blocks == 1
    pool.free(blocks[:1])
    assert pool.num_free_blocks == 8


def test_double_free_is_an_error_and_changes_nothing():
    pool = BlockPool(8)
    a, b = pool.allocate(2)
    pool.free([a])
    with pytest.raises(KVCacheError, match="double free of block"):
        pool.free([b, a])
    assert b.ref_cnt == 1 and pool.num_free_blocks == 7


def test_allocate_more_than_free_raises():
    with pytest.raises(KVCacheError):
        BlockPool(2).allocate(3)


def test_lookup_rechecks_tokens_on_hash_hit():
    pool = BlockPool(4)
    block = pool.allocate(1)[0]
    assert pool.cache(block, 12345, [1, 2, 3, 4])
    assert pool.lookup(12345, [1, 2, 3, 4]) is block
    assert pool.lookup(12345, [9, 9, 9, 9]) is None     # same hash, other tokens: a collision


def test_hash_chains_on_parent_and_extra_keys():
    h1 = hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(h1, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])
    assert hash_block_tokens(None, [1, 2, 3, 4], "lora-a") != h1


def test_eviction_hands_out_uncached_first_then_lru_cached():
    pool = BlockPool(4)
    a, b, c, d = pool.allocate(4)
    pool.cache(a, 1, [0] * BS)
    pool.cache(b, 2, [1] * BS)
    pool.free([a])          # cached, freed first: least recently used
    pool.free([b])          # cached
    pool.free([c])          # uncached: goes to the front
    assert pool.allocate(1)[0] is c
    assert pool.allocate(1)[0] is a and pool.lookup(1, [0] * BS) is None   # LRU evicted
    assert pool.lookup(2, [1] * BS) is b                                  # still revivable


def test_freeing_a_table_evicts_its_tail_before_its_head():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    for i, blk in enumerate(blocks):
        pool.cache(blk, 100 + i, [i] * BS)
    pool.free(blocks)
    assert pool.allocate(1)[0] is blocks[2]


def test_allocate_slots_is_all_or_nothing():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    assert kv.allocate_slots("a", list(range(20)), 0, 20) == 0     # 5 blocks
    before = (kv.num_free_blocks, kv.block_ids("a"))
    assert kv.allocate_slots("b", list(range(16)), 0, 16) is None   # needs 4, 3 free
    assert (kv.num_free_blocks, kv.block_ids("a")) == before
    assert "b" not in kv.block_tables


def test_allocate_slots_reserves_lookahead_and_reports_first_changed_index():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    tokens = list(range(5))
    assert kv.allocate_slots("a", tokens, 0, 5, num_lookahead_tokens=3) == 0
    assert len(kv.block_ids("a")) == 2                      # 8 slots
    assert kv.allocate_slots("a", tokens + [9], 5, 1, num_lookahead_tokens=2) == 2  # appended
    assert len(kv.block_ids("a")) == 2                      # 5 + 1 + 2 = 8 fits
    assert kv.allocate_slots("a", tokens + [9, 9], 6, 1, num_lookahead_tokens=2) == 2
    assert len(kv.block_ids("a")) == 3


def test_prefix_hit_shares_full_blocks_and_leaves_one_token_to_compute():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    prompt = list(range(100, 112))                          # exactly 3 full blocks
    kv.allocate_slots("a", prompt, 0, 12)
    hit, n = kv.get_computed_blocks("b", prompt)
    assert n == 8 and [b.block_id for b in hit] == kv.block_ids("a")[:2]   # capped at len-1
    longer = prompt + [7, 7, 7]
    hit, n = kv.get_computed_blocks("c", longer)
    assert n == 12
    assert kv.allocate_slots("c", longer, 0, 3, new_computed_blocks=hit) == 0
    assert kv.block_ids("c")[:3] == kv.block_ids("a")
    assert [kv.pool.blocks[i].ref_cnt for i in kv.block_ids("a")] == [2, 2, 2]
    other, n = kv.get_computed_blocks("d", prompt + [1], extra_keys="adapter-2")
    assert n == 0 and not other


def test_freed_cached_blocks_are_revived_by_a_later_hit():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    prompt = list(range(9))
    kv.allocate_slots("a", prompt, 0, 9)
    ids = kv.block_ids("a")
    kv.free("a")
    assert kv.num_free_blocks == 8
    hit, n = kv.get_computed_blocks("b", prompt)
    assert n == 8 and [b.block_id for b in hit] == ids[:2]
    kv.allocate_slots("b", prompt, 0, 1, new_computed_blocks=hit)
    assert kv.block_ids("b")[:2] == ids[:2] and kv.num_free_blocks == 5


def test_free_without_blocks_is_an_error():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    kv.allocate_slots("a", [1, 2], 0, 2)
    kv.free("a")
    with pytest.raises(KVCacheError, match="holds no blocks"):
        kv.free("a")
    with pytest.raises(KVCacheError):
        kv.free("never-seen")


def test_fork_shares_blocks_and_copies_partial_block_on_write():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    tokens = list(range(6))                                  # 1 full + 1 partial block
    kv.allocate_slots("p", tokens, 0, 6)
    kv.fork("p", "p#1", num_computed_tokens=6)
    assert kv.block_ids("p#1") == kv.block_ids("p")
    assert [kv.pool.blocks[i].ref_cnt for i in kv.block_ids("p")] == [2, 2]
    first = kv.allocate_slots("p#1", tokens + [50], 6, 1)
    assert first == 1                                        # table changed at the copied block
    (src, dst), = kv.take_blocks_to_copy()
    assert src == kv.block_ids("p")[1] and dst == kv.block_ids("p#1")[1] and src != dst
    assert kv.block_ids("p#1")[0] == kv.block_ids("p")[0]    # the full block stays shared
    assert kv.allocate_slots("p", tokens + [60], 6, 1) == 2  # parent now sole owner: no copy
    assert kv.take_blocks_to_copy() == []


def test_fork_with_no_room_for_the_copy_fails_cleanly():
    kv = KVCacheManager(num_blocks=2, block_size=BS)
    kv.allocate_slots("p", [1, 2, 3, 4, 5], 0, 5)
    kv.fork("p", "p#1", 5)
    assert kv.allocate_slots("p#1", [1, 2, 3, 4, 5, 6], 5, 1) is None
    assert kv.take_blocks_to_copy() == [] and kv.block_ids("p#1") == kv.block_ids("p")


def test_swap_out_and_in_return_block_mappings():
    kv = KVCacheManager(num_blocks=8, block_size=BS, num_cpu_blocks=4)
    tokens = list(range(7))
    kv.allocate_slots("a", tokens, 0, 7)
    device = kv.block_ids("a")
    out = kv.swap_out("a")
    assert [g for g, _ in out] == device and kv.num_free_blocks == 8
    assert kv.cpu_pool.num_used_blocks == 2
    back = kv.swap_in("a", tokens + [1], 7, 1)
    assert [c for c, _ in back] == [c for _, c in out]
    assert [g for _, g in back] == kv.block_ids("a") and kv.cpu_pool.num_used_blocks == 0


def test_swap_out_fails_cleanly_when_cpu_pool_is_full():
    kv = KVCacheManager(num_blocks=8, block_size=BS, num_cpu_blocks=1)
    kv.allocate_slots("a", list(range(8)), 0, 8)
    assert kv.swap_out("a") is None
    assert len(kv.block_ids("a")) == 2 and kv.cpu_pool.num_used_blocks == 0


def test_sliding_window_frees_blocks_behind_the_window_and_reports_them():
    """W = 6, blocks of 4: once 13 tokens are computed, the next query (position 13) reads
    positions 8.. only, so blocks 0 and 1 are freed and their entries become the null block;
    the cache a request holds stays bounded however long it decodes."""
    kv = KVCacheManager(num_blocks=8, block_size=BS, sliding_window=6)
    null = kv.null_block.block_id
    assert kv.num_free_blocks == 7                            # one reserved: the null block
    tokens = list(range(13))
    assert kv.allocate_slots("a", tokens, 0, 13) == 0         # a 13-token prompt: 4 blocks
    ids = kv.block_ids("a")
    assert null not in ids and kv.num_free_blocks == 3
    assert kv.allocate_slots("a", tokens + [1], 13, 1) == 0   # decode at 13: blocks 0, 1 go
    assert kv.block_ids("a") == [null, null] + ids[2:] and kv.num_free_blocks == 5
    assert kv.allocate_slots("a", tokens + [1, 2], 14, 1) == 4   # nothing new slid out
    for n in range(15, 200):                                  # a long decode: 3 blocks held
        kv.allocate_slots("a", list(range(n + 1)), n, 1)
        assert sum(b != null for b in kv.block_ids("a")) <= 3
    assert kv.num_window_freed == (199 - 6 + 1) // BS                  # 48 of 50 entries
    kv.free("a")
    assert kv.num_free_blocks == 7 and kv.null_block.ref_cnt == 1


def test_sliding_window_release_survives_a_failed_allocation():
    """The release happens even when the allocation that noticed it has no room; the next
    successful call reports the nulled entries."""
    kv = KVCacheManager(num_blocks=5, block_size=BS, sliding_window=4)
    kv.allocate_slots("a", list(range(12)), 0, 12)            # 3 blocks
    kv.allocate_slots("b", [9], 0, 1)                         # the last free block
    assert kv.allocate_slots("a", list(range(24)), 12, 12) is None  # needs 3 more, 2 freed
    assert kv.block_ids("a")[:2] == [kv.null_block.block_id] * 2 and kv.num_free_blocks == 2
    assert kv.allocate_slots("a", list(range(13)), 12, 1) == 0      # reported from entry 0


def test_sliding_window_prefix_hit_keeps_only_the_window_and_swaps_skip_nulls():
    """A long cached prefix is taken and at once trimmed to its window; swap out copies only
    the live blocks and swap in gives the table back with its null entries; fork shares
    them."""
    kv = KVCacheManager(num_blocks=12, block_size=BS, num_cpu_blocks=8, sliding_window=5)
    null = kv.null_block.block_id
    prompt = list(range(100, 117))                            # 4 full blocks + 1
    kv.allocate_slots("a", prompt, 0, 17)
    hit, n = kv.get_computed_blocks("b", prompt)
    assert n == 16
    assert kv.allocate_slots("b", prompt, 0, 1, new_computed_blocks=hit) == 0
    assert kv.block_ids("b")[:3] == [null] * 3                # 16 - 5 + 1 = 12: 3 blocks out
    assert kv.block_ids("b")[3] == kv.block_ids("a")[3]       # the window's block is shared
    kv.fork("b", "b#1", 17)
    assert kv.block_ids("b#1") == kv.block_ids("b")
    out = kv.swap_out("b")
    assert [g for g, _ in out] == kv.block_ids("b#1")[3:]     # the live blocks only
    assert kv.cpu_pool.num_used_blocks == 2
    back = kv.swap_in("b", prompt + [1], 17, 1)
    assert kv.block_ids("b")[:3] == [null] * 3 and len(back) == 2
    for rid in ("a", "b", "b#1"):
        kv.free(rid)
    assert kv.num_free_blocks == 11 and kv.cpu_pool.num_used_blocks == 0
