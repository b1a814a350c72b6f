"""Exact-state tests for flexpage.core's block pool / block manager.

In the style of vLLM's tests/v1/core/test_prefix_caching.py: block ids, ref
counts and eviction order are asserted exactly. A hypothesis state machine then
drives random operation sequences against a symbolic "shadow KV" (each slot
stores the token prefix whose KV it should hold) to check that prefix hits,
copy-on-write and swapping never let a sequence see the wrong KV.
"""

from __future__ import annotations

import sys
from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from shadow_kv import ShadowKV

from flexpage.core import BlockManager, BlockPool, NoFreeBlocksError, Sequence
from flexpage.core.kv_tiers import KVTiers
from flexpage.core.layer_groups import blocks_out_of_window


def compute(bm: BlockManager, seq: Sequence, n: int | None = None) -> list[tuple[int, int]]:
    """Runner stand-in: reserve slots for the next n positions and mark them computed."""
    n = seq.num_uncomputed_tokens if n is None else n
    copies = bm.append_slots(seq, n)
    seq.num_computed_tokens = bm.mark_computed(seq, n)
    return copies


def test_core_does_not_import_torch() -> None:
    import flexpage.core  # noqa: F401

    mods = [m for m in sys.modules if m.startswith("flexpage.core")]
    assert mods
    for name in mods:
        src = open(sys.modules[name].__file__).read()  # type: ignore[arg-type]
        assert "import torch" not in src and "from torch" not in src, name


# -- allocation -----------------------------------------------------------------------


def test_allocate_and_grow() -> None:
    bm = BlockManager(10, 4)
    seq = Sequence(0, range(10))
    assert bm.can_allocate(seq)
    assert bm.allocate(seq) == 0  # tokens served from the prefix cache: none yet
    assert bm.block_table(seq) == [1, 2, 3]
    assert compute(bm, seq) == []
    assert seq.num_computed_tokens == 10
    for tok, table in [(10, [1, 2, 3]), (11, [1, 2, 3]), (12, [1, 2, 3, 4])]:
        seq.append_token(tok)  # sampled; its KV is computed by the next step
        assert bm.append_slots(seq, 1) == []
        seq.num_computed_tokens = bm.mark_computed(seq, 1)
        assert bm.block_table(seq) == table
    s = bm.stats()
    assert (s.total, s.free, s.cached, s.used) == (10, 5, 0, 4)
    # Blocks 1..3 are full and computed, so indexed; block 4 is partial.
    assert [bm.pool.block_hash(b) is not None for b in bm.block_table(seq)] == [True, True, True, False]


def test_growing_sequences_fill_whole_runs() -> None:
    """With runs of 4 blocks, two sequences growing in turn each fill their own run
    (blocks 4-7 and 8-11) rather than interleaving; run 0 (blocks 1-3, beside the null
    block) is never whole, so it is used last."""
    bm = BlockManager(20, 4, run_length=4)
    a, b = Sequence(0, range(3)), Sequence(1, range(100, 103))
    for seq in (a, b):
        seq.num_computed_tokens = bm.allocate(seq)
        compute(bm, seq)
    for token in range(14):
        for seq in (a, b):
            seq.append_token(token)
            bm.append_slots(seq, 1)
            seq.num_computed_tokens = bm.mark_computed(seq, 1)
    assert bm.block_table(a) == [4, 5, 6, 7, 12]
    assert bm.block_table(b) == [8, 9, 10, 11, 16]


def test_runs_fall_back_to_loose_blocks_when_no_run_is_whole() -> None:
    bm = BlockManager(8, 4, run_length=4)  # run 0: blocks 1-3 (loose), run 1: blocks 4-7
    first = Sequence(0, range(8))
    first.num_computed_tokens = bm.allocate(first)
    assert bm.block_table(first) == [4, 5]
    second = Sequence(1, range(100, 120))
    second.num_computed_tokens = bm.allocate(second)
    assert sorted(bm.block_table(second)) == [1, 2, 3, 6, 7]
    bm.free(first)
    bm.free(second)
    assert bm.pool.num_free == 7 and bm.pool.num_free_runs == 1


def _full_pool_of_runs_of_4() -> BlockPool:
    """Runs of 4, every block in use: run 1 (blocks 4-7) and run 2 (8-11) filled first, as
    whole free runs, then run 0's blocks 1-3 (never whole: block 0 is the null block)."""
    pool, taken = BlockPool(12, run_length=4), []
    for length in (4, 4, 3):
        taken.append(pool.allocate())
        for _ in range(length - 1):
            taken.append(pool.allocate(after=taken[-1]))
    assert taken == [4, 5, 6, 7, 8, 9, 10, 11, 1, 2, 3] and pool.num_free == 0
    return pool


def test_a_growing_sequence_takes_any_free_block_of_its_run_before_leaving_it() -> None:
    """The kernel reads a run as one key block whatever the order of its pages: a free block
    anywhere in the caller's run beats the first block of another run."""
    pool = _full_pool_of_runs_of_4()
    for block in (9, 10, 5, 6):  # run 2's free blocks are the oldest
        pool.decref(block)
    assert pool.allocate(after=7) == 5  # not adjacent, same run
    assert pool.allocate(after=8) == 9  # the successor first when it is free
    assert pool.allocate(after=9) == 10


def test_without_free_or_idle_runs_a_new_block_goes_to_the_run_with_the_most_free_blocks() -> None:
    """Where a sequence must start among loose blocks, it starts where its next blocks can
    follow in the same run, not at whichever free block was released first."""
    pool = _full_pool_of_runs_of_4()
    for block in (6, 8, 9, 11):  # run 1: one free block (the oldest), run 2: three
        pool.decref(block)
    first = pool.allocate()
    assert first == 8
    assert pool.allocate(after=first) == 9
    assert pool.allocate(after=9) == 11
    assert pool.allocate(after=11) == 6  # run 2 is full: the only other free block
    assert pool.num_free == 0 and pool.num_free_runs == 0


def _pool_of_cached_runs(*owners_of_blocks_in_use: int) -> tuple[BlockPool, list[int]]:
    """Runs of 4: run 0 (blocks 1-3) free, runs 1 (4-7) and 2 (8-11) filled and released, run 1
    first, all blocks cached -- except that sequence ``i`` in ``owners_of_blocks_in_use`` keeps
    its first block in use."""
    pool, evicted = BlockPool(12, run_length=4), []
    pool.on_evict = lambda block_id, _hash: evicted.append(block_id)
    for run in (1, 2):
        blocks = [pool.allocate()] + [None] * 3
        for i in range(1, 4):
            blocks[i] = pool.allocate(after=blocks[i - 1])
        assert blocks == list(range(4 * run, 4 * run + 4))
        for block in blocks:
            pool.set_hash(block, f"run {run} block {block}".encode())
        for block in blocks[1 if run in owners_of_blocks_in_use else 0:]:
            pool.decref(block)
    return pool, evicted


def test_a_new_sequence_in_a_full_pool_takes_the_least_recently_released_idle_run_whole() -> None:
    """No wholly free run is left; the new sequence evicts every cached block of run 1 (the
    older idle run) and fills it, rather than scattering over run 0's loose free blocks or
    over single LRU evictions; run 2's cache stays."""
    pool, evicted = _pool_of_cached_runs()
    assert pool.num_free_runs == 0 and pool.num_free == 3
    first = pool.allocate()
    assert first == 4 and evicted == [4, 5, 6, 7] and pool.num_evictions == 4
    assert [pool.allocate(after=b) for b in (4, 5, 6)] == [5, 6, 7]
    assert all(pool.lookup(f"run 1 block {b}".encode()) is None for b in range(4, 8))
    assert [pool.lookup(f"run 2 block {b}".encode()) for b in range(8, 12)] == [8, 9, 10, 11]
    assert pool.num_cached == 4 and pool.num_free == 3


def test_a_run_with_a_block_in_use_is_never_reclaimed_whole() -> None:
    pool, evicted = _pool_of_cached_runs(1)  # run 1's first block is still in use
    assert pool.allocate() == 8 and evicted == [8, 9, 10, 11]
    assert pool.lookup(b"run 1 block 5") == 5  # run 1's cached blocks stay


def test_a_revived_block_makes_its_run_busy_and_its_release_makes_it_the_newest_idle_run() -> None:
    pool, evicted = _pool_of_cached_runs()
    pool.incref(4)  # a prefix hit on run 1
    assert pool.allocate() == 8 and evicted == [8, 9, 10, 11]
    pool.decref(4)
    assert pool.allocate() == 4 and evicted[4:] == [4, 5, 6, 7]


def test_without_free_or_idle_runs_a_sequence_fills_the_run_with_the_most_blocks_not_in_use() -> None:
    """Cached blocks count as room (they are evicted, the LRU order aside): a run of three
    cached blocks beats a lone free block elsewhere, and a growing sequence uses up its run
    before it leaves it."""
    pool, evicted = _full_pool_of_runs_of_4(), []
    pool.on_evict = lambda block_id, _hash: evicted.append(block_id)
    for block in (5, 6, 7):
        pool.set_hash(block, f"block {block}".encode())
        pool.decref(block)  # cached
    pool.decref(2)  # free
    first = pool.allocate()
    assert first == 5 and evicted == [5]
    assert [pool.allocate(after=first), pool.allocate(after=6)] == [6, 7] and evicted == [5, 6, 7]
    assert pool.allocate(after=7) == 2  # run 1 is full
    assert pool.num_free == 0 and pool.num_cached == 0


def test_prefix_hit_across_requests() -> None:
    bm = BlockManager(10, 4)
    a = Sequence(0, range(10))
    a.num_computed_tokens = bm.allocate(a)
    compute(bm, a)
    b = Sequence(1, list(range(8)) + [50, 51])
    b.num_computed_tokens = bm.allocate(b)
    assert bm.block_table(b) == [1, 2, 4]
    assert b.num_computed_tokens == 8
    assert [bm.pool.ref_count(i) for i in (1, 2, 3, 4)] == [2, 2, 1, 1]
    s = bm.stats()
    assert (s.prefix_cache_queries, s.prefix_cache_hits, s.used, s.free) == (20, 8, 4, 5)
    assert s.prefix_cache_hit_rate == pytest.approx(0.4)


def test_last_token_is_always_computed() -> None:
    bm = BlockManager(10, 4)
    a = Sequence(0, range(9))
    a.num_computed_tokens = bm.allocate(a)
    compute(bm, a)  # blocks 1, 2 full and hashed
    exact = Sequence(1, range(8))  # same 2 full blocks, but the last token must be computed
    assert bm.num_cached_prefix_tokens(exact) == 4
    exact.num_computed_tokens = bm.allocate(exact)
    assert bm.block_table(exact) == [1, 4]
    assert exact.num_computed_tokens == 4
    one_block = Sequence(2, range(4))
    one_block.num_computed_tokens = bm.allocate(one_block)
    assert bm.block_table(one_block) == [5]
    assert one_block.num_computed_tokens == 0


def test_shared_system_prompt_stored_once() -> None:
    bs, n_req = 16, 16
    bm = BlockManager(64, bs)
    system = list(range(1000, 1512))  # 512 tokens = 32 blocks
    seqs, cached = [], []
    for i in range(n_req):
        seq = Sequence(i, system + [i * 10 + k for k in range(8)])  # 520 tokens -> 33 blocks
        seq.num_computed_tokens = bm.allocate(seq)
        cached.append(seq.num_computed_tokens)
        compute(bm, seq)
        seqs.append(seq)
    assert bm.block_table(seqs[0]) == list(range(1, 34))
    assert cached == [0] + [512] * (n_req - 1)
    for i, seq in enumerate(seqs[1:], start=1):
        assert bm.block_table(seq) == list(range(1, 33)) + [33 + i]
    s = bm.stats()
    assert s.used == 32 + n_req  # the prompt's 32 blocks once, plus one tail block each
    assert s.free == 63 - 48
    assert bm.pool.ref_count(1) == bm.pool.ref_count(32) == n_req
    assert (s.prefix_cache_hits, s.prefix_cache_queries) == (15 * 512, 16 * 520)
    for seq in seqs:
        bm.free(seq)
    s = bm.stats()
    assert (s.used, s.cached, s.free) == (0, 32, 31)  # full prompt blocks stay cached; partial tails freed


def test_cached_blocks_survive_free_and_evict_lru_tail_first() -> None:
    bm = BlockManager(6, 4)
    a = Sequence(0, range(9))
    a.num_computed_tokens = bm.allocate(a)
    compute(bm, a)
    bm.free(a)
    assert bm.block_table(a) == [] and not bm.holds_blocks(a)
    bm.free(a)  # idempotent
    s = bm.stats()
    assert (s.free, s.cached, s.used) == (3, 2, 0)
    assert bm.pool.cached_block_ids() == [2, 1]  # a's tail is evicted before its head

    b = Sequence(1, range(100, 113))  # unrelated, 4 blocks: 3 free + 1 eviction
    b.num_computed_tokens = bm.allocate(b)
    assert bm.block_table(b) == [4, 5, 3, 2]
    assert bm.stats().evictions == 1
    assert bm.pool.cached_block_ids() == [1]
    bm.free(b)  # never computed: nothing hashed, all go back to the free list

    c = Sequence(2, [0, 1, 2, 3, 7, 7])  # hits a's first block, which survived
    c.num_computed_tokens = bm.allocate(c)
    assert bm.block_table(c) == [1, 2]
    assert c.num_computed_tokens == 4
    assert bm.stats().cached == 0  # block 1 was revived


def test_eviction_order_across_requests() -> None:
    bm = BlockManager(8, 4)
    a, b = Sequence(0, range(9)), Sequence(1, range(50, 59))
    for seq in (a, b):
        seq.num_computed_tokens = bm.allocate(seq)
        compute(bm, seq)
    assert (bm.block_table(a), bm.block_table(b)) == ([1, 2, 3], [4, 5, 6])
    bm.free(a)
    bm.free(b)
    assert bm.pool.cached_block_ids() == [2, 1, 5, 4]
    big = Sequence(2, range(200, 220))  # 5 blocks: 3 free, then evict 2 LRU
    big.num_computed_tokens = bm.allocate(big)
    assert bm.block_table(big) == [7, 3, 6, 2, 1]
    assert bm.pool.cached_block_ids() == [5, 4]
    assert bm.stats().evictions == 2


def test_revive_whole_cached_prefix() -> None:
    bm = BlockManager(10, 4)
    a = Sequence(0, range(9))
    a.num_computed_tokens = bm.allocate(a)
    compute(bm, a)
    bm.free(a)
    again = Sequence(1, range(9))
    assert bm.can_allocate(again)
    again.num_computed_tokens = bm.allocate(again)
    assert bm.block_table(again) == [1, 2, 4]
    assert bm.stats().cached == 0
    assert again.num_computed_tokens == 8


def test_concurrent_duplicate_prefix_is_not_double_indexed() -> None:
    bm = BlockManager(10, 4)
    a, b = Sequence(0, range(9)), Sequence(1, range(9))
    a.num_computed_tokens = bm.allocate(a)
    b.num_computed_tokens = bm.allocate(b)  # a not computed yet: no hit
    assert (bm.block_table(a), bm.block_table(b)) == ([1, 2, 3], [4, 5, 6])
    compute(bm, a)
    compute(bm, b)
    assert bm.pool.block_hash(4) is None and bm.pool.block_hash(1) is not None
    bm.free(a)
    bm.free(b)
    s = bm.stats()
    assert (s.cached, s.free) == (2, 7)


def test_follow_up_chat_turn_hits_prompt_and_answer() -> None:
    bm = BlockManager(16, 4)
    turn1 = Sequence(0, range(6))
    turn1.num_computed_tokens = bm.allocate(turn1)
    compute(bm, turn1)
    for tok in range(100, 106):  # sample 6 answer tokens, computing each previous one
        turn1.append_token(tok)
        compute(bm, turn1)
    assert turn1.num_tokens == 12 and turn1.num_computed_tokens == 12
    history = list(turn1.token_ids)
    bm.free(turn1)
    turn2 = Sequence(1, history + [7, 8, 9, 10, 11])
    assert bm.allocate(turn2) == 12  # cached: prompt + the model's answer
    assert bm.block_table(turn2)[:3] == [1, 2, 3]


def test_fork_copy_on_write() -> None:
    bm = BlockManager(10, 4)
    a = Sequence(0, range(6))
    a.num_computed_tokens = bm.allocate(a)
    compute(bm, a)
    b = a.fork(1)
    bm.fork(a, b)
    assert bm.block_table(b) == [1, 2] and b.num_computed_tokens == 6
    assert [bm.pool.ref_count(i) for i in (1, 2)] == [2, 2]
    a.append_token(100)
    b.append_token(200)
    assert bm.can_append_slots(a, 1)
    assert bm.append_slots(a, 1) == [(2, 3)]  # a writes into shared partial block 2 -> copy
    assert bm.block_table(a) == [1, 3]
    assert bm.append_slots(b, 1) == []  # block 2 is b's alone now
    assert bm.block_table(b) == [1, 2]
    assert [bm.pool.ref_count(i) for i in (1, 2, 3)] == [2, 1, 1]
    bm.free(a)
    bm.free(b)
    assert bm.stats().used == 0


def test_fork_at_block_boundary_needs_no_copy() -> None:
    bm = BlockManager(10, 4)
    a = Sequence(0, range(8))
    a.num_computed_tokens = bm.allocate(a)
    compute(bm, a)
    b = a.fork(1)
    bm.fork(a, b)
    a.append_token(1)
    b.append_token(2)
    assert bm.append_slots(a, 1) == [] and bm.append_slots(b, 1) == []
    assert (bm.block_table(a), bm.block_table(b)) == ([1, 2, 3], [1, 2, 4])


def test_swap_round_trip_without_prefix_cache() -> None:
    bm = BlockManager(8, 4, enable_prefix_caching=False, num_host_blocks=4)
    a = Sequence(0, range(10))
    a.num_computed_tokens = bm.allocate(a)
    compute(bm, a)
    assert bm.can_swap_out(a)
    assert bm.swap_out(a) == [(1, 0), (2, 1), (3, 2)]
    assert (bm.block_table(a), bm.host_block_tables(a)[0], a.num_computed_tokens) == ([], [0, 1, 2], 10)
    s = bm.stats()
    assert (s.used, s.free, s.host_used, s.host_free) == (0, 7, 3, 1)
    assert bm.can_swap_in(a)
    assert bm.swap_in(a) == [(0, 4), (1, 5), (2, 6)]
    assert (bm.block_table(a), bm.host_block_tables(a)[0], a.num_computed_tokens) == ([4, 5, 6], [], 10)
    assert bm.stats().host_free == 4
    bm.free(a)
    big = Sequence(1, range(20))  # 5 blocks > 4 host slots
    big.num_computed_tokens = bm.allocate(big)
    assert not bm.can_swap_out(big)
    with pytest.raises(NoFreeBlocksError):
        bm.swap_out(big)


def test_swap_in_reuses_blocks_still_cached_on_device() -> None:
    bm = BlockManager(8, 4, num_host_blocks=4)
    a = Sequence(0, range(10))
    a.num_computed_tokens = bm.allocate(a)
    compute(bm, a)
    assert bm.swap_out(a) == [(1, 0), (2, 1), (3, 2)]
    assert bm.stats().cached == 2
    assert bm.swap_in(a) == [(2, 4)]  # full blocks 1, 2 still cached: no copy
    assert bm.block_table(a) == [1, 2, 4]


def test_free_swapped_sequence_returns_host_slots() -> None:
    bm = BlockManager(8, 4, num_host_blocks=4)
    a = Sequence(0, range(5))
    a.num_computed_tokens = bm.allocate(a)
    bm.swap_out(a)
    bm.free(a)
    s = bm.stats()
    assert (s.host_free, s.used, bm.host_block_tables(a)[0]) == (4, 0, [])


def test_null_block_never_handed_out() -> None:
    bm = BlockManager(4, 4)
    seqs = [Sequence(i, [i] * 4) for i in range(3)]
    for seq in seqs:
        seq.num_computed_tokens = bm.allocate(seq)
    assert [bm.block_table(s) for s in seqs] == [[1], [2], [3]]
    extra = Sequence(9, [9])
    assert not bm.can_allocate(extra)
    with pytest.raises(NoFreeBlocksError):
        extra.num_computed_tokens = bm.allocate(extra)
    assert bm.null_block_id == 0 and bm.pool.ref_count(0) == 0


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        (dict(num_blocks=1, block_size=4), "num_blocks"),
        (dict(num_blocks=8, block_size=0), "block_size"),
        (dict(num_blocks=8, block_size=4, num_host_blocks=-1), "num_host_blocks"),
        (dict(num_blocks=8.0, block_size=4), "num_blocks"),
        (dict(num_blocks=8, block_size=4, run_length=0), "run_length"),
        (dict(num_blocks=8, block_size=4, group_windows=(None, 0)), "group_windows"),
        (dict(num_blocks=8, block_size=4, group_windows=()), "group_windows"),
    ],
)
def test_bad_config_names_the_argument(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        BlockManager(**kwargs)


def test_mark_computed_rejects_overrun() -> None:
    bm = BlockManager(8, 4)
    a = Sequence(0, range(5))
    a.num_computed_tokens = bm.allocate(a)
    with pytest.raises(ValueError, match="computed"):
        a.num_computed_tokens = bm.mark_computed(a, 6)
    bm.free(a)
    a.num_computed_tokens = bm.mark_computed(a, 1)  # freed (e.g. aborted mid-step): ignored
    assert a.num_computed_tokens == 0


def test_reset_prefix_cache() -> None:
    bm = BlockManager(8, 4)
    a = Sequence(0, range(9))
    a.num_computed_tokens = bm.allocate(a)
    compute(bm, a)
    bm.free(a)
    assert bm.reset_prefix_cache() == 2
    s = bm.stats()
    assert (s.cached, s.free) == (0, 7)
    assert bm.num_cached_prefix_tokens(Sequence(1, range(9))) == 0


# -- sliding-window release and layer groups ------------------------------------------------


def test_sliding_group_releases_blocks_out_of_every_window() -> None:
    """Full group 0 keeps every block; sliding group 1 (window 6, blocks of 4) keeps only what a
    query at >= num_computed_tokens can see: block i goes once (i+1)*4 <= computed - 5."""
    bm = BlockManager(20, 4, group_windows=(None, 6))
    seq = Sequence(0, range(10))
    assert bm.blocks_for_admission(seq) == 6 and bm.can_allocate(seq)
    seq.num_computed_tokens = bm.allocate(seq)
    assert bm.block_tables(seq) == [[1, 2, 3], [4, 5, 6]]
    compute(bm, seq)  # computed 10: the next query (10) sees 5..10, so block 0 (0..3) is dead
    assert bm.block_tables(seq) == [[1, 2, 3], [0, 5, 6]]
    s = bm.stats()
    assert (s.used, s.cached, s.released_window_blocks) == (5, 1, 1)  # block 4 was full: cached
    for token in range(10, 16):
        seq.append_token(token)
        compute(bm, seq)
    # computed 16: the next query sees 11..16: blocks 0, 1 (0..7) dead, block 2 (8..11) still needed
    assert bm.block_tables(seq) == [[1, 2, 3, 7], [0, 0, 6, 8]]
    assert (bm.stats().used, bm.stats().released_window_blocks) == (6, 2)
    bm.free(seq)
    s = bm.stats()
    assert s.used == 0 and s.free + s.cached == 19 and bm.block_tables(seq) == [[], []]


def test_a_fresh_block_never_evicts_another_groups_prefix_hit() -> None:
    """Full group 0 and sliding group 1 (window 6), nothing free: b's prefix hit revives two of
    a's released sliding blocks while group 0 needs one fresh block, which must evict another
    cached block, never a hit about to be revived (found by TestHybridMachine: block 10 sat
    in both of b's tables, `[[1, 2, 3, 4, 10], [0, 0, 9, 10, 8]]`)."""
    bm = BlockManager(13, 4, group_windows=(None, 6))
    tokens = [3, 3, 3, 3] + [0] * 17
    a = Sequence(0, tokens)
    a.num_computed_tokens = bm.allocate(a)
    compute(bm, a)  # computed 21: sliding blocks 0-3 released and cached; every block in use or cached
    assert bm.stats().free == 0 and bm.stats().cached == 4
    b = Sequence(1, tokens[:17])
    b.num_computed_tokens = bm.allocate(b)
    group0, group1 = bm.block_tables(b)
    assert b.num_computed_tokens == 16 and group0[:4] == bm.block_tables(a)[0][:4] and group1[:2] == [0, 0]
    assert not set(group0) & (set(group1) - {0})
    assert all(bm.pool.ref_count(block) >= 1 for block in group0 + group1 if block)


def test_sliding_only_prefix_hit_skips_released_blocks() -> None:
    """Window 6: a prefix hit of 3 blocks needs only the blocks a query at 12 still sees (1, 2);
    the dead first page starts out as the null block, so it is neither revived nor counted."""
    bm = BlockManager(12, 4, group_windows=(6,))
    a = Sequence(0, range(13))
    a.num_computed_tokens = bm.allocate(a)
    compute(bm, a)  # computed 13: blocks 0 and 1 (0..7) released, both cached
    assert bm.block_table(a) == [0, 0, 3, 4] and bm.stats().cached == 2
    b = Sequence(1, range(13))
    assert bm.num_cached_prefix_tokens(b) == 12
    free_before = bm.num_free_or_cached
    b.num_computed_tokens = bm.allocate(b)  # revives block 2, shares block 3, allocates one
    assert bm.block_table(b) == [0, 2, 3, 5] and b.num_computed_tokens == 12
    assert bm.num_free_or_cached == free_before - 2
    assert bm.pool.ref_count(1) == 0 and bm.pool.ref_count(3) == 2
    compute(bm, b)
    assert bm.block_table(b) == [0, 0, 3, 5]
    # a hybrid model needs the whole prefix in its full group, the window in its sliding group
    hybrid = BlockManager(12, 4, group_windows=(None, 6))
    c = Sequence(2, range(13))
    c.num_computed_tokens = hybrid.allocate(c)
    compute(hybrid, c)
    d = Sequence(3, range(13))
    d.num_computed_tokens = hybrid.allocate(d)
    assert d.num_computed_tokens == 12 and hybrid.block_tables(d)[1][0] == 0 and 0 not in hybrid.block_tables(d)[0]


def test_swap_and_fork_keep_released_entries_null() -> None:
    bm = BlockManager(20, 4, num_host_blocks=8, group_windows=(None, 5))
    seq = Sequence(0, range(14))
    seq.num_computed_tokens = bm.allocate(seq)
    compute(bm, seq)  # computed 14: sliding blocks 0, 1 released
    assert bm.block_tables(seq)[1][:2] == [0, 0]
    child = seq.fork(1)
    bm.fork(seq, child)
    assert bm.block_tables(child) == bm.block_tables(seq)
    pairs = bm.swap_out(seq)
    assert len(pairs) == 4 + 2 and len(bm.host_block_tables(seq)[1]) == 2  # live blocks only
    bm.swap_in(seq)
    assert bm.block_tables(seq)[1][:2] == [0, 0] and 0 not in bm.block_tables(seq)[1][2:]
    for s in (seq, child):
        bm.free(s)
    stats = bm.stats()
    assert stats.used == 0 and stats.host_used == 0


# -- property test ------------------------------------------------------------------------

PREFIXES = [[], [1, 2, 1, 2, 1, 2, 1, 2, 1], [3, 3, 3, 3, 0, 0, 0, 0]]


class BlockManagerMachine(RuleBasedStateMachine):
    prefix_caching = True
    run_length = 1
    group_windows: tuple[int | None, ...] = (None,)
    num_blocks = 9
    kv_budget: int | None = None  # tokens, given to every other new sequence
    tier_slots: tuple[int, int] = (0, 0)  # KVTiers' host and disk entries
    tier_policy = "retention"

    def __init__(self) -> None:
        super().__init__()
        self.bs = 4
        ticks = iter(range(1, 1 << 30))
        tiers = KVTiers(*self.tier_slots, policy=self.tier_policy, clock=lambda: float(next(ticks)))
        self.bm = BlockManager(self.num_blocks, self.bs, enable_prefix_caching=self.prefix_caching, num_host_blocks=8,
                               run_length=self.run_length, group_windows=self.group_windows, tiers=tiers)
        self.kv = ShadowKV(self.bs)
        self.live: dict[int, Sequence] = {}
        self.family: dict[int, int] = {}
        self.next_id = 0
        self.finished: list[list[int]] = []  # token ids of freed sequences: chats to continue

    def _pick(self, data: st.DataObject, pred) -> Sequence | None:
        ids = sorted(i for i, s in self.live.items() if pred(s))
        return self.live[data.draw(st.sampled_from(ids))] if ids else None

    def _ops(self) -> None:
        self.kv.apply(self.bm.drain_ops())

    def _compute(self, seq: Sequence, n: int) -> None:
        start = seq.num_computed_tokens
        self.bm.append_slots(seq, n)
        self._ops()  # in the order decided: a block spilled here may be a copy's destination
        for table in self.bm.block_tables(seq):
            for p in range(start, start + n):  # the runner only ever writes exclusively owned blocks
                block = table[p // self.bs]
                assert self.bm.pool.ref_count(block) == 1 and self.bm.pool.block_hash(block) is None
        self.kv.write(self.bm.block_tables(seq), seq, start, n, self._pruned(seq))
        blocks = self.bm.blocks_to_score(seq, n)
        assert seq.kv_budget is not None or not blocks
        self.bm.record_block_scores(seq, {i: (seq.seq_id * 31 + i * 17) % 7 for i in blocks})
        seq.num_computed_tokens = self.bm.mark_computed(seq, n)
        self._ops()  # pages packed into runs

    def _pruned(self, seq: Sequence) -> object:
        return ("pruned", self.family[seq.seq_id]) if self.bm.evicted_blocks(seq) else None

    @rule(
        prefix=st.sampled_from(PREFIXES),
        suffix=st.one_of(st.just([]), st.lists(st.integers(0, 3), max_size=14)),
        prefill=st.booleans(),
    )
    def add(self, prefix: list[int], suffix: list[int], prefill: bool) -> None:
        budget = self.kv_budget if self.next_id % 2 else None
        seq = Sequence(self.next_id, (prefix + suffix) or [0], kv_budget=budget)
        if not self.bm.can_allocate(seq):
            with pytest.raises(NoFreeBlocksError):
                seq.num_computed_tokens = self.bm.allocate(seq)
            return
        self._admit(seq)  # cache hits, and blocks restored behind a hole, carry exactly this prefix's KV
        assert seq.num_computed_tokens % self.bs == 0
        assert seq.num_computed_tokens <= seq.num_tokens - 1
        n = self.bm.computable_tokens(seq)
        if prefill and self.bm.can_append_slots(seq, n):
            self._compute(seq, n)

    @rule(data=st.data(), suffix=st.lists(st.integers(0, 3), min_size=1, max_size=6))
    def next_turn(self, data: st.DataObject, suffix: list[int]) -> None:
        """A chat's next turn: a freed sequence's tokens plus a new message."""
        if not self.finished:
            return
        seq = Sequence(self.next_id, data.draw(st.sampled_from(self.finished)) + suffix)
        if self.bm.can_allocate(seq):
            self._admit(seq)

    def _admit(self, seq: Sequence) -> None:
        seq.num_computed_tokens = self.bm.allocate(seq)
        self._ops()
        self.kv.check(self.bm.block_tables(seq), seq)
        self.kv.check_restored(self.bm, seq)
        self.live[seq.seq_id] = seq
        self.family[seq.seq_id] = seq.seq_id
        self.next_id += 1

    @rule(token=st.integers(4, 7))
    def pressure(self, token: int) -> None:
        """A sequence needing every free block and more: forces LRU eviction of cached blocks."""
        want = self.bm.stats().free // len(self.group_windows) + 1
        seq = Sequence(self.next_id, [token] * (want * self.bs))
        if self.bm.can_allocate(seq):
            self._admit(seq)

    @rule(data=st.data())
    def compute(self, data: st.DataObject) -> None:
        seq = self._pick(data, lambda s: self.bm.block_table(s) and s.num_uncomputed_tokens > 0)
        if seq is None:
            return
        n = data.draw(st.integers(1, self.bm.computable_tokens(seq)))
        if self.bm.can_append_slots(seq, n):
            self._compute(seq, n)

    @rule(data=st.data(), token=st.integers(0, 3))
    def sample(self, data: st.DataObject, token: int) -> None:
        seq = self._pick(data, lambda s: self.bm.block_table(s) and s.num_uncomputed_tokens == 0)
        if seq is not None:
            seq.append_token(token)

    @rule(data=st.data(), tokens=st.tuples(st.integers(0, 3), st.integers(0, 3)))
    def fork(self, data: st.DataObject, tokens: tuple[int, int]) -> None:
        parent = self._pick(data, lambda s: self.bm.block_table(s))
        if parent is None:
            return
        child = parent.fork(self.next_id)
        self.bm.fork(parent, child)
        self.live[child.seq_id] = child
        self.family[child.seq_id] = self.family[parent.seq_id]
        self.next_id += 1
        if parent.num_uncomputed_tokens == 0:  # parallel sampling: n tokens from the same logits
            parent.append_token(tokens[0])
            child.append_token(tokens[1])

    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq = self._pick(data, lambda s: True)
        if seq is not None:
            if seq.num_computed_tokens:
                self.finished.append(list(seq.token_ids))
            self.bm.free(seq)
            self.bm.free(seq)
            del self.live[seq.seq_id]

    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        seq = self._pick(data, lambda s: self.bm.block_table(s))
        if seq is None or not self.bm.can_swap_out(seq):
            return
        live = [b for table in self.bm.block_tables(seq) for b in table if b != 0]
        pairs = self.bm.swap_out(seq)
        assert [d for d, _ in pairs] == live
        self._ops()

    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        seq = self._pick(data, lambda s: self.bm.host_block_tables(s)[0])
        if seq is None or not self.bm.can_swap_in(seq):
            return
        self.bm.swap_in(seq)
        self._ops()

    @rule()
    def reset_prefix_cache(self) -> None:
        self.bm.reset_prefix_cache()
        self._ops()
        assert not self.kv.disk and (self.bm.tiers is None or len(self.bm.tiers) == 0)

    @invariant()
    def consistent(self) -> None:
        bm, live = self.bm, list(self.live.values())
        refs = Counter(b for s in live for t in self.bm.block_tables(s) for b in t if b != 0)
        for b in range(1, bm.num_blocks):
            assert bm.pool.ref_count(b) == refs.get(b, 0), b
        stats = bm.stats()
        assert stats.free + stats.cached + stats.used == stats.total - 1
        assert stats.used == len(refs)
        if bm.tiers is not None:  # every entry in exactly one tier, within its cap; a file per disk entry
            tiers = bm.tiers.stats()
            assert tiers.host_used <= tiers.host_capacity and tiers.disk_used <= tiers.disk_capacity
            assert len(bm.tiers) == tiers.host_used + tiers.disk_used and len(self.kv.disk) == tiers.disk_used
        assert stats.free == sum(bm.pool.is_free(b) for b in range(bm.num_blocks))
        hosts = [h for s in live for t in self.bm.host_block_tables(s) for h in t]
        assert len(hosts) == len(set(hosts)) == stats.host_used
        assert stats.released_window_blocks >= 0
        holders: dict[int, tuple[int, int, int]] = {}
        for s in live:
            assert not (self.bm.block_table(s) and self.bm.host_block_tables(s)[0])
            assert s.num_computed_tokens <= s.num_tokens
            if self.bm.host_block_tables(s)[0]:
                assert len(self.bm.host_block_tables(s)) == len(self.group_windows)
            for g, table in enumerate(self.bm.block_tables(s) if self.bm.block_table(s) else []):
                dead = blocks_out_of_window(self.group_windows[g], self.bs, s.num_computed_tokens)
                # released entries are exactly the leading pages no future query can see
                evicted = self.bm.evicted_blocks(s)
                assert table[:dead] == [0] * dead, (g, s)
                assert [i for i, b in enumerate(table[dead:], dead) if b == 0] == [i for i in evicted if i >= dead]
                assert len(table) * self.bs >= s.num_computed_tokens
                held = [b for b in table if b != 0]
                assert len(set(held)) == len(held)
                for i, b in enumerate(table[dead:], dead):
                    if b == 0:  # evicted
                        continue
                    if b in holders:  # shared: same group and position, same family or a hashed prefix block
                        grp, idx, fam = holders[b]
                        assert (grp, idx) == (g, i)
                        assert fam == self.family[s.seq_id] or bm.pool.block_hash(b) is not None
                    holders[b] = (g, i, self.family[s.seq_id])
            if self.bm.block_table(s):
                self.kv.check(self.bm.block_tables(s), s, self._pruned(s))
                tables = self.bm.block_tables(s)
                if s.kv_budget is not None and s.num_computed_tokens == s.num_tokens:  # within budget
                    kept = sum(any(t[i] != 0 for t in tables) for i in range(len(tables[0])))
                    newest_full = s.num_computed_tokens % self.bs == 0
                    assert kept <= s.kv_budget // self.bs - newest_full or not self.bm.evicted_blocks(s) and (
                        kept <= s.kv_budget // self.bs)
                if self.bm.evicted_blocks(s):  # the attention sink and the newest block stay
                    assert 0 not in self.bm.evicted_blocks(s) and len(tables[0]) - 1 not in self.bm.evicted_blocks(s)

    def teardown(self) -> None:
        for seq in list(self.live.values()):
            self.bm.free(seq)
        stats = self.bm.stats()
        assert stats.free + stats.cached == stats.total - 1
        assert stats.used == 0 and stats.host_free == stats.host_total


class TierMachine(BlockManagerMachine):
    """Host and disk tiers behind a small pool: spills, restores, loads, drops, holes."""

    tier_slots = (2, 3)


class HostTierLRUMachine(BlockManagerMachine):
    tier_slots = (4, 0)
    tier_policy = "lru"


class TierRunsMachine(BlockManagerMachine):
    tier_slots = (2, 2)
    run_length = 4


class TierHybridMachine(BlockManagerMachine):
    """Tiers with a sliding layer group (no holes there: a sliding group's hit depends on its window)."""

    tier_slots = (4, 2)
    group_windows = (None, 6)
    num_blocks = 17


class NoPrefixCacheMachine(BlockManagerMachine):
    prefix_caching = False


class RunsMachine(BlockManagerMachine):
    run_length = 4


class SlidingMachine(BlockManagerMachine):
    """Every layer slides (Mistral): window 3 < block size, blocks released as computing advances."""

    group_windows = (3,)


class HybridMachine(BlockManagerMachine):
    """A full and a sliding layer group (Gemma2) sharing one pool."""

    group_windows = (None, 6)
    num_blocks = 17


class HybridRunsMachine(BlockManagerMachine):
    group_windows = (None, 5, 5)
    num_blocks = 25
    run_length = 4
    prefix_caching = False


class BudgetMachine(BlockManagerMachine):
    """Every other sequence keeps at most 3 blocks once computed (PagedEviction's block rule)."""

    kv_budget = 12
    num_blocks = 13


class BudgetRunsMachine(BlockManagerMachine):
    """Budgets with runs of 4 blocks: kept pages get packed into runs (relocation copies)."""

    kv_budget = 12
    num_blocks = 25
    run_length = 4


class BudgetHybridMachine(BlockManagerMachine):
    """Budgets in a model with a full and a sliding layer group."""

    kv_budget = 16
    group_windows = (None, 6)
    num_blocks = 21


_machine_settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
for _machine in (BlockManagerMachine, NoPrefixCacheMachine, RunsMachine, SlidingMachine, HybridMachine,
                 HybridRunsMachine, BudgetMachine, BudgetRunsMachine, BudgetHybridMachine, TierMachine,
                 HostTierLRUMachine, TierRunsMachine, TierHybridMachine):
    _case = _machine.TestCase
    _case.settings = _machine_settings
    globals()[f"Test{_machine.__name__}"] = _case  # collected by pytest as TestBlockManagerMachine, ...
