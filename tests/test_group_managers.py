"""Exact-state tests of the per-layer-group managers (flexpage.core.group_managers).

Each test drives one manager over its own pool and asserts block ids, ref counts and the
pool's free order exactly (vLLM's test_prefix_caching style). With ``run_length`` 1 a pool
hands out its free blocks oldest-freed first, and a manager frees a table tail first.
"""

from __future__ import annotations

import pytest

from flexpage.core.block_pool import NULL_BLOCK_ID, BlockPool
from flexpage.core.group_managers import (
    TIERED,
    FullAttentionManager,
    SlidingWindowManager,
    make_group_manager,
)
from flexpage.core.layer_groups import group_key


def no_restore(i: int, block_id: int) -> None:
    raise AssertionError(f"nothing is tiered here (block {i} -> {block_id})")


def test_full_attention_grows_shares_copies_on_write_and_frees_tail_first() -> None:
    pool = BlockPool(10)
    m = FullAttentionManager(pool, 4, 0)
    assert m.allocate(7, [], 3, no_restore) == [1, 2, 3]
    assert m.blocks_to_append(7, 2, 4) == 1 and m.append_slots(7, 2, 4) == [] and m.table(7) == [1, 2, 3, 4]
    m.fork(7, 8)
    assert m.table(8) == [1, 2, 3, 4] and m.table(8) is not m.table(7)
    assert [pool.ref_count(b) for b in (1, 2, 3, 4)] == [2, 2, 2, 2]
    assert m.blocks_to_append(8, 3, 5) == 2  # block 4 un-shared, block 5 new
    assert m.append_slots(8, 3, 5) == [(4, 5)] and m.table(8) == [1, 2, 3, 5, 6]
    assert pool.ref_count(4) == 1 and m.table(7) == [1, 2, 3, 4]
    m.free(8)  # 6 then 5 go back; 1..3 stay referenced by sequence 7
    assert m.table(8) == [] and 8 not in m.tables
    assert [pool.allocate() for _ in range(5)] == [7, 8, 9, 6, 5]
    m.remove_skipped_blocks(7, 16, ())  # full attention keeps every block
    assert m.table(7) == [1, 2, 3, 4] and m.num_released_blocks == 0 and m.num_skipped(1000) == 0


def test_a_hit_costs_its_revived_cached_blocks_and_tiered_entries_are_restored_in_place() -> None:
    pool = BlockPool(10)
    m = FullAttentionManager(pool, 4, 0)
    cached = pool.allocate()
    pool.set_hash(cached, b"a")
    pool.decref(cached)  # block 1: cached
    assert m.blocks_to_allocate([1], 3) == 3  # two fresh blocks and the cached one revived
    pool.incref(1)
    assert m.blocks_to_allocate([1, TIERED], 3) == 2  # 1 is in use now: free to share
    pool.decref(1)
    m.take_hits([1, TIERED])
    restored: list[tuple[int, int]] = []
    assert m.allocate(7, [1, TIERED], 3, lambda i, b: restored.append((i, b))) == [1, 2, 3]
    assert restored == [(1, 2)] and pool.ref_count(1) == 1
    assert m.key(b"h") == b"h" and FullAttentionManager(pool, 4, 2).key(b"h") == group_key(2, b"h") != b"h"


def test_sliding_window_releases_leading_blocks_across_budget_holes() -> None:
    pool = BlockPool(10)
    m = SlidingWindowManager(pool, 4, 1, window=5)
    assert m.allocate(7, [], 5, no_restore) == [1, 2, 3, 4, 5]
    assert m.num_skipped(14) == 2 and m.num_skipped(16) == 3
    pool.decref(2)  # a KV budget evicted logical block 1
    m.tables[7][1] = NULL_BLOCK_ID
    m.remove_skipped_blocks(7, 16, {1})  # blocks 0..2 out of every query's window
    assert m.table(7) == [0, 0, 0, 4, 5] and m.num_released_blocks == 2
    assert [pool.is_free(b) for b in (1, 2, 3)] == [True, True, True]
    m.remove_skipped_blocks(7, 16, {1})
    assert m.num_released_blocks == 2  # a released leading run stops the scan
    assert m.blocks_to_append(7, 4, 6) == 1 and m.append_slots(7, 4, 6) == [] and m.table(7) == [0, 0, 0, 4, 5, 6]
    m.fork(7, 8)
    assert m.table(8) == [0, 0, 0, 4, 5, 6] and pool.ref_count(4) == 2
    m.free(7)
    m.free(8)
    assert pool.num_used == 0


def test_swap_in_shares_what_the_pool_still_holds_and_restores_nulls() -> None:
    pool = BlockPool(10)
    full = FullAttentionManager(pool, 4, 0)
    kept = pool.allocate()  # block 1: content "a" still cached on the device
    pool.set_hash(kept, b"a")
    pool.decref(kept)
    published: list[tuple[int, bytes, int]] = []
    pairs = full.swap_in(7, [10, 11, 12], 12, (), [b"a", b"b"], lambda b, k, i: published.append((b, k, i)))
    assert full.table(7) == [1, 2, 3] and pairs == [(11, 2), (12, 3)]
    assert published == [(2, b"b", 1)] and pool.ref_count(1) == 1
    sliding = SlidingWindowManager(pool, 4, 1, window=5)
    # 14 computed: blocks 0, 1 out of the window; logical block 3 evicted by a budget
    assert sliding.swap_in(8, [20, 21], 14, {3}, [], published.append) == [(20, 4), (21, 5)]
    assert sliding.table(8) == [0, 0, 4, 0, 5] and len(published) == 1


@pytest.mark.parametrize("window, keep, kind", [(None, False, FullAttentionManager), (5, False, SlidingWindowManager),
                                                (5, True, FullAttentionManager)])
def test_make_group_manager_picks_the_table_rule(window, keep, kind) -> None:
    m = make_group_manager(BlockPool(4), 4, 0, window, keep_window=keep)
    assert type(m) is kind and m.window == (window if kind is SlidingWindowManager else None)
