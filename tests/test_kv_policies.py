"""Exact-state tests of the block manager's smaller policies, each on its own: the prefix
plan (flexpage.core.prefix_plan), tiers and holes (flexpage.core.tier_policy), host swap
space (flexpage.core.swap_space) and the virtual layout's fork rows (flexpage.core.fork_rows).
"""

from __future__ import annotations

import pytest

from flexpage.core.block_pool import BlockPool
from flexpage.core.fork_rows import ForkRows
from flexpage.core.group_managers import TIERED
from flexpage.core.kv_ops import KVOp, TierOp, TierOpKind
from flexpage.core.kv_tiers import KVTiers
from flexpage.core.prefix_plan import PrefixPlan, plan_prefix
from flexpage.core.row_pool import RowPool
from flexpage.core.sequence import Sequence
from flexpage.core.swap_space import HostSwapSpace
from flexpage.core.tier_policy import Holes, TierPolicy

H = [bytes([i]) * 4 for i in range(5)]  # stand-in block hashes


def test_plan_prefix_finds_a_run_behind_a_hole_only_when_asked() -> None:
    cached = {H[0]: 1, H[1]: TIERED, H[3]: 7, H[4]: 8}
    lookup = lambda g, h: cached.get(h)  # noqa: E731
    plan = plan_prefix(H, lookup, (None,), 4, holes=True)
    assert plan == PrefixPlan([[1, TIERED, None, 7, 8]], 2, 3) and plan.reused_blocks == 4
    assert plan_prefix(H, lookup, (None,), 4, holes=False) == PrefixPlan([[1, TIERED]], 2, 2)
    assert plan_prefix(H[:3], lookup, (None,), 4, holes=True) == PrefixPlan([[1, TIERED]], 2, 2)


def test_plan_prefix_needs_only_a_sliding_groups_window() -> None:
    by_group = [{H[0]: 1, H[1]: 2, H[2]: 3}, {H[2]: 9}]  # group 1 dropped blocks 0, 1
    plan = plan_prefix(H[:3], lambda g, h: by_group[g].get(h), (None, 4), 4, holes=False)
    assert plan == PrefixPlan([[1, 2, 3], [0, 0, 9]], 3, 3)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_tier_policy_spills_what_the_pool_evicts_and_restores_it_with_its_owner() -> None:
    pool, ops, clock = BlockPool(4), [], Clock()
    tiers = KVTiers(2, clock=clock)
    policy = TierPolicy(tiers, pool, ops)
    block = pool.allocate()
    clock.now = 1.0
    assert pool.set_hash(block, H[0])
    policy.published(H[0], 0, "chat")
    assert policy.owner(block) == "chat" and policy.owner(2) is None
    clock.now = 2.0
    policy.released([[block, 0]])
    pool.decref(block)  # cached
    assert [pool.allocate() for _ in range(3)] == [2, 3, 1]  # the third evicts block 1: spilled
    assert ops == [TierOp(TierOpKind.SPILL, 1, 0)] and policy.holds(H[0]) and tiers.where(H[0]) == "host"
    assert policy.restore(H[0], 3) == "chat" and ops[-1] == TierOp(TierOpKind.RESTORE, 0, 3)
    assert tiers is policy.tiers and tiers.ops is ops
    pool.reset_prefix_cache()
    policy.reset()
    assert len(tiers) == 0 and not policy.holds(H[0])


def test_tier_policy_pins_keys_while_restoring() -> None:
    tiers = KVTiers(1)
    ops: list[KVOp] = []
    policy = TierPolicy(tiers, BlockPool(4), ops)
    policy.pin({H[1]})
    assert tiers.pinned == {H[1]}
    policy.pin(set())
    assert tiers.pinned == set()


def test_holes_jump_past_the_restored_range_once_the_hole_is_computed() -> None:
    holes = Holes()
    seq = Sequence(7, range(24))
    holes.open(7, PrefixPlan([[1, None, None, 4, 5]], 1, 3), 4)
    holes.open(8, PrefixPlan([[1, 2]], 2, 2), 4)  # no hole: nothing recorded
    assert holes.has_state(7) and not holes.has_state(8) and holes.num_hole_tokens == 8
    seq.num_computed_tokens = 4
    assert holes.computable_tokens(seq) == 8 and holes.reused_tokens(seq) == 12
    holes.fork(7, 9)
    assert holes.jump(7, 8) == 8 and holes.jump(7, 12) == 20 and not holes.has_state(7)
    seq.num_computed_tokens = 20
    assert holes.computable_tokens(seq) == 4 and holes.reused_tokens(seq) == 20
    assert holes.jump(9, 12) == 20  # the fork kept its own copy
    holes.drop(9)
    assert not holes.has_state(9)


def test_host_swap_space_hands_out_slots_first_freed_last() -> None:
    space = HostSwapSpace(4)
    assert space.swap_out(7, [[1, 2], [0, 3]]) == [(1, 0), (2, 1), (3, 2)]
    assert space.tables(7) == [[0, 1], [2]] and space.holds(7) and (space.num_used, space.num_free) == (3, 1)
    assert HostSwapSpace.num_live([[1, 2], [0, 3]]) == 3
    space.release(7)
    assert space.tables(7) is None and not space.holds(7) and space.num_free == 4
    assert space.swap_out(8, [[5, 6]]) == [(5, 3), (6, 0)]  # slot 3 was never used: first in the queue
    space.release(8)
    space.release(8)  # idempotent
    assert space.num_used == 0


def test_fork_rows_reserve_grow_copy_and_give_back() -> None:
    pool = RowPool(6, 4, 30)  # rows 1..6: blocks 4..27
    parent = [[pool.allocate(), pool.allocate(4)], [pool.allocate(), pool.allocate(8)]]
    assert parent == [[4, 5], [8, 9]]
    rows = ForkRows(pool)
    rows.reserve(7, [2, 2], 2)  # two forks to come: rows 3, 4 then 5, 6
    assert pool.num_used == 12
    parent[0].append(pool.allocate(5))  # the parent grew since admission
    taken, copies = rows.take(7, parent)
    assert taken == [[20, 21, 22], [24, 25]]  # the newest set, grown to the parent's length
    assert copies == [[(4, 20), (5, 21), (6, 22)], [(8, 24), (9, 25)]]
    rows.free(7)  # the unforked set goes back
    assert pool.num_used == 10 and all(pool.is_free(b) for b in (12, 13, 16, 17))
    with pytest.raises(ValueError, match="reserved no rows"):
        rows.take(7, parent)
