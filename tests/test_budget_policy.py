"""Exact-state tests of the KV budget policy (flexpage.core.budget_policy) on a bare pool.

The coordinator-level behaviour (prefill then decode, sharing, swapping) is in
``test_kv_budget_blocks.py``; here the policy's own state and decisions are checked.
"""

from __future__ import annotations

from flexpage.core.block_pool import BlockPool
from flexpage.core.budget_policy import KVBudgetPolicy
from flexpage.core.kv_ops import BlockOpKind
from flexpage.core.scheduler_output import ScoreRequest
from flexpage.core.sequence import Sequence


def make(num_blocks: int = 20, run_length: int = 1):
    pool = BlockPool(num_blocks, run_length)
    log: list[tuple[BlockOpKind, list[tuple[int, int]]]] = []
    return pool, KVBudgetPolicy(pool, 4, lambda kind, pairs: log.append((kind, pairs))), log


def test_scores_then_evicts_the_lowest_scored_middle_blocks() -> None:
    pool, budget, log = make()
    table = [pool.allocate() for _ in range(5)]
    seq = Sequence(0, range(20), kv_budget=12)  # 3 blocks
    assert budget.blocks_to_score(seq, [table], 20) == [0, 1, 2, 3, 4]
    assert budget.blocks_to_score(Sequence(1, range(20)), [table], 20) == []  # no budget, nothing to score
    budget.record(0, {0: 5.0, 1: 1.0, 2: 3.0, 3: 2.0, 4: 9.0})
    assert budget.blocks_to_score(seq, [table], 20) == []
    budget.evict_over_budget(seq, [table], 20)  # the newest block is full: keep 2 (sink and newest)
    assert table == [1, 0, 0, 0, 5] and budget.evicted_blocks(0) == [1, 2, 3]
    assert budget.hash_limit(0) == 5 and budget.num_evicted_blocks == 3 and log == []
    assert [pool.is_free(b) for b in (2, 3, 4)] == [True, True, True]
    budget.evict_over_budget(seq, [table], 20)  # within budget now
    assert table == [1, 0, 0, 0, 5] and budget.num_evicted_blocks == 3


def test_a_shared_block_only_loses_this_sequences_reference() -> None:
    pool, budget, _ = make()
    tables = [[pool.allocate() for _ in range(4)], [pool.allocate() for _ in range(4)]]  # two groups
    pool.incref(2)  # another sequence shares logical block 1 of group 0
    seq = Sequence(0, range(14), kv_budget=12)
    budget.record(0, {1: 0.0, 2: 1.0})
    budget.evict_over_budget(seq, tables, 14)  # newest block partial: keep 3 of 4
    assert tables == [[1, 0, 3, 4], [5, 0, 7, 8]] and budget.evicted_blocks(0) == [1]
    assert pool.ref_count(2) == 1 and pool.is_free(6) and budget.num_evicted_blocks == 2


def test_score_requests_cover_the_groups_holding_every_block() -> None:
    _, budget, _ = make()
    seq = Sequence(0, range(12), kv_budget=12)
    tables = [[1, 2, 3], [0, 5, 6]]  # a sliding group gave its block 0 back
    assert budget.score_requests(seq, tables, 12) == [ScoreRequest(0, [0, 1, 2], [[1, 2, 3]], [0, 4, 8])]
    budget.record(0, {0: 1.0})
    assert budget.score_requests(seq, tables, 12) == [ScoreRequest(0, [1, 2], [[2, 3], [5, 6]], [4, 8])]


def test_scattered_kept_pages_are_copied_into_one_run() -> None:
    pool, budget, log = make(40, run_length=8)
    table = [pool.allocate(), pool.allocate(), pool.allocate()]
    assert table == [8, 16, 24]  # one page in each of runs 1, 2, 3 (run 0 holds the null block)
    budget.pack_runs(table)
    assert table == [32, 33, 34] and log == [(BlockOpKind.COPY, [(8, 32)]), (BlockOpKind.COPY, [(16, 33)]),
                                             (BlockOpKind.COPY, [(24, 34)])]
    assert [pool.is_free(b) for b in (8, 16, 24)] == [True, True, True]
    budget.pack_runs(table)
    assert len(log) == 3  # packed: nothing more to do


def test_a_fork_inherits_a_copy_of_the_state_and_drop_forgets_it() -> None:
    pool, budget, _ = make()
    table = [pool.allocate() for _ in range(5)]
    budget.record(0, {1: 0.0, 2: 0.0, 3: 0.0})
    budget.evict_over_budget(Sequence(0, range(20), kv_budget=12), [table], 20)
    budget.fork(0, 1)
    assert budget.evicted_blocks(1) == [1, 2, 3] and budget.hash_limit(1) == 5
    budget.record(1, {5: 1.0})
    longer = [table + [6]]  # block 4 was never scored by sequence 0; sequence 1 scored up to 5
    assert budget.blocks_to_score(Sequence(0, range(24), kv_budget=12), longer, 24) == [4, 5]
    assert budget.blocks_to_score(Sequence(1, range(24), kv_budget=12), longer, 24) == []
    assert budget.evicted(0) == {1, 2, 3}
    budget.drop(1)
    assert not budget.has_state(1) and budget.evicted_blocks(1) == [] and budget.hash_limit(1) is None
    budget.fork(7, 0)  # a parent without state: the child starts fresh
    assert not budget.has_state(0)
