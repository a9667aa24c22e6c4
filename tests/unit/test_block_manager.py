"""BlockPool and KVCacheManager: exact block ids, ref counts, free order."""
from __future__ import annotations

import pytest

from forge_service.kv_cache.block_pool import BlockPool
from forge_service.kv_cache.manager import KVCacheManager


def test_pool_allocates_in_order_and_exhaustion_returns_none():
    pool = BlockPool(5)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(0) == []
    assert pool.allocate(3) is None  # never partial
    assert pool.num_free == 2
    assert pool.allocate(2) == [3, 4]
    assert pool.allocate(1) is None
    assert pool.num_free == 0 and pool.num_blocks == 5


def test_pool_free_queue_is_fifo():
    pool = BlockPool(4)
    pool.allocate(4)
    pool.free([2])
    pool.free([0, 3])
    assert pool.free_block_ids() == [2, 0, 3]
    assert pool.allocate(2) == [2, 0]
    assert pool.free_block_ids() == [3]


def test_pool_ref_counts():
    pool = BlockPool(3)
    a = pool.allocate(2)
    pool.incref([a[0]])
    assert pool.ref_counts == [2, 1, 0]
    pool.free(a)
    assert pool.ref_counts == [1, 0, 0]
    assert pool.free_block_ids() == [2, 1]
    pool.free([a[0]])
    assert pool.free_block_ids() == [2, 1, 0]
    with pytest.raises(AssertionError):
        pool.free([0])


def test_pool_cached_block_survives_free_until_reused():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.cache_block(a, block_hash=111)
    pool.cache_block(b, block_hash=222)
    pool.free([a, b, c])  # queue: a, b, c
    assert pool.get_cached_block(222) == b
    # A prefix hit revives b from the middle of the free queue.
    pool.incref([b])
    assert pool.free_block_ids() == [a, c]
    assert pool.ref_counts[b] == 1
    # Reusing a (the least recently freed) evicts its hash; b keeps its.
    assert pool.allocate(1) == [a]
    assert pool.get_cached_block(111) is None
    assert pool.block_hashes[a] is None
    assert pool.get_cached_block(222) == b


def test_pool_cache_block_keeps_the_first_block_for_a_hash():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache_block(a, 7)
    pool.cache_block(b, 7)
    assert pool.get_cached_block(7) == a and pool.block_hashes[b] is None


def test_manager_grows_tables_at_block_boundaries():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    assert kv.allocate_slots("a", 1) == [0]
    assert kv.allocate_slots("a", 4) == [0]
    assert kv.allocate_slots("a", 5) == [0, 1]
    assert kv.allocate_slots("b", 9) == [2, 3, 4]
    assert kv.allocate_slots("a", 8) == [0, 1]
    assert kv.block_ids("a") == [0, 1] and kv.block_ids("b") == [2, 3, 4]
    assert (kv.num_used_blocks, kv.num_free_blocks) == (5, 1)
    assert kv.usage == pytest.approx(5 / 6)


def test_manager_returns_copies_of_tables():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    table = kv.allocate_slots("a", 2)
    kv.allocate_slots("a", 3)
    assert table == [0]
    assert kv.block_ids("a") == [0, 1]


def test_manager_shortage_allocates_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    kv.allocate_slots("a", 3)
    assert kv.allocate_slots("a", 7) is None  # needs 2 more, 1 free
    assert kv.block_ids("a") == [0, 1] and kv.num_free_blocks == 1
    assert kv.allocate_slots("b", 5) is None
    assert kv.block_ids("b") == [] and kv.num_free_blocks == 1


def test_manager_free_is_idempotent_and_frees_tail_first():
    kv = KVCacheManager(num_blocks=4, block_size=1)
    kv.allocate_slots("a", 3)
    kv.free("a")
    kv.free("a")
    kv.free("never-seen")
    assert kv.num_free_blocks == 4 and kv.usage == 0.0
    assert kv.pool.free_block_ids() == [3, 2, 1, 0]
    assert kv.allocate_slots("b", 2) == [3, 2]


# ---- automatic prefix caching ---------------------------------------------------------------

def computed(kv: KVCacheManager, request_id: str, tokens: list[int]) -> list[int]:
    """Allocate and mark all of `tokens` computed, as the scheduler does after a step."""
    table = kv.allocate_slots(request_id, len(tokens))
    kv.cache_computed(request_id, len(tokens), lambda a, b: tokens[a:b])
    return table


def test_prefix_blocks_are_shared_and_outlive_their_request():
    kv = KVCacheManager(num_blocks=8, block_size=4, prefix_caching=True)
    first = computed(kv, "a", list(range(10)))  # blocks for [0..3], [4..7] are full; [8, 9] is not
    assert kv.match_prefix("b", list(range(9)) + [99]) == 8  # both full blocks match
    assert kv.block_ids("b") == first[:2]
    assert kv.pool.ref_counts[first[0]] == 2
    kv.free("a")
    kv.free("b")
    assert kv.num_used_blocks == 0
    # freed but still cached: a later request with the same prefix finds them
    assert kv.match_prefix("c", list(range(8)) + [5]) == 8
    assert kv.block_ids("c") == first[:2]


def test_prefix_match_needs_the_whole_prefix_and_leaves_a_token_to_compute():
    kv = KVCacheManager(num_blocks=8, block_size=4, prefix_caching=True)
    computed(kv, "a", list(range(8)))
    assert kv.match_prefix("b", [7] + list(range(1, 8)) + [1]) == 0  # first block differs: nothing
    assert kv.block_ids("b") == []
    # exactly 8 tokens: the last block is not shared whole, its first 3 tokens are copied
    assert kv.match_prefix("c", list(range(8))) == 7
    assert kv.pending_copy("c") == (kv.block_ids("a")[1], kv.block_ids("c")[1], 3)
    assert kv.match_prefix("d", list(range(4)) + [9, 9, 9, 9, 9]) == 4  # block 2 differs at once
    assert kv.pending_copy("d") is None


def test_a_hit_that_ends_inside_a_block_copies_its_tokens_into_a_block_of_its_own():
    kv = KVCacheManager(num_blocks=4, block_size=4, prefix_caching=True)
    a = computed(kv, "a", list(range(12)))  # three full blocks
    kv.allocate_slots("z", 1)
    kv.free("a")  # cached, in the free queue: a[2], the partial source, is at its front
    kv.free("z")
    assert kv.pool.free_block_ids()[0] == a[2]
    assert kv.match_prefix("b", list(range(10)) + [77, 78]) == 10  # 2 blocks whole, 2 tokens of a[2]
    own = kv.block_ids("b")[2]
    assert kv.block_ids("b")[:2] == a[:2] and own not in a  # allocating it did not evict a[2]
    assert kv.pending_copy("b") == (a[2], own, 2)
    assert kv.pool.ref_counts[a[2]] == 1  # held until copied
    # the scheduler allocates the rest; after the step the source goes back to the free queue
    assert kv.allocate_slots("b", 12) == [*a[:2], own]
    kv.copy_done("b")
    assert kv.pending_copy("b") is None and kv.pool.ref_counts[a[2]] == 0
    assert kv.pool.get_cached_block(kv.pool.block_hashes[a[2]]) == a[2]  # still cached
    kv.free("b")
    assert kv.num_used_blocks == 0


def test_the_longest_partial_hit_wins_and_freeing_before_the_copy_lets_go_of_the_source():
    kv = KVCacheManager(num_blocks=8, block_size=4, prefix_caching=True)
    x = computed(kv, "x", [1, 2, 3, 4, 5, 6, 7, 8])
    y = computed(kv, "y", [1, 2, 3, 4, 5, 6, 0, 0])
    assert kv.match_prefix("b", [1, 2, 3, 4, 5, 6, 7, 9, 9]) == 7  # x's second block: 3 tokens
    assert kv.pending_copy("b")[::2] == (x[1], 3)
    assert kv.match_prefix("c", [1, 2, 3, 4, 5, 6, 0, 9]) == 7  # y's: 3 tokens
    assert kv.pending_copy("c")[::2] == (y[1], 3)
    assert kv.match_prefix("d", [1, 2, 3, 4, 5, 9]) == 5  # both begin with 5: either will do
    source, _, count = kv.pending_copy("d")
    assert source in (x[1], y[1]) and count == 1
    before = kv.pool.ref_counts[source]
    kv.free("d")  # admission gave up (or the request ended) before its first step
    assert kv.pool.ref_counts[source] == before - 1 and kv.pending_copy("d") is None
    for r in ("x", "y", "b", "c"):
        kv.free(r)
    assert kv.num_used_blocks == 0


def test_an_evicted_block_is_no_longer_a_partial_source():
    kv = KVCacheManager(num_blocks=3, block_size=4, prefix_caching=True)
    computed(kv, "a", list(range(8)))
    kv.free("a")
    computed(kv, "x", [50] * 12)  # reuses a's blocks
    kv.free("x")
    assert kv.match_prefix("b", list(range(6))) == 0 and kv.pending_copy("b") is None
    assert kv.match_prefix("c", [50] * 6) == 5  # the new content is found instead


def test_prefix_caching_off_by_default_and_evicted_blocks_are_forgotten():
    plain = KVCacheManager(num_blocks=4, block_size=4)
    computed(plain, "a", list(range(8)))
    assert plain.match_prefix("b", list(range(9))) == 0
    kv = KVCacheManager(num_blocks=2, block_size=4, prefix_caching=True)
    computed(kv, "a", list(range(8)))
    kv.free("a")
    computed(kv, "x", [50] * 8)  # reuses both blocks: the old keys are dropped
    kv.free("x")
    assert kv.match_prefix("b", list(range(9))) == 0
