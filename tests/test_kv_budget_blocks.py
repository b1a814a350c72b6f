"""KV budgets in the block manager: which blocks go, exact block counts, sharing and swapping.

Pure bookkeeping (no torch). The engine side -- scores from real keys and values, logits
against a dense reference over the kept tokens -- is in ``test_kv_budget.py``; random
operation sequences mixing budgets with fork, swap and free are in ``test_block_manager.py``'s
``Budget*Machine`` state machines.
"""

from __future__ import annotations

import pytest

from flexpage.core import BlockManager, Sequence
from flexpage.core.eviction import blocks_to_evict, runs_are_scattered
from flexpage.core.kv_ops import BlockOpKind


def run_prefill(bm: BlockManager, seq: Sequence, scores: dict[int, float]) -> None:
    """Runner stand-in: compute the whole prompt, with the policy's block ``scores``."""
    seq.num_computed_tokens = bm.allocate(seq)
    n = seq.num_uncomputed_tokens
    bm.append_slots(seq, n)
    assert bm.blocks_to_score(seq, n) == sorted(scores)
    bm.record_block_scores(seq, scores)
    seq.num_computed_tokens = bm.mark_computed(seq, n)


def decode(bm: BlockManager, seq: Sequence, token: int, score: float = 0.0) -> None:
    seq.append_token(token)
    bm.append_slots(seq, 1)
    bm.record_block_scores(seq, dict.fromkeys(bm.blocks_to_score(seq, 1), score))
    seq.num_computed_tokens = bm.mark_computed(seq, 1)


def held(bm: BlockManager, seq: Sequence) -> list[int]:
    return [i for i, b in enumerate(bm.block_table(seq)) if b != 0]


# -- the rule ------------------------------------------------------------------------------

def test_lowest_scores_go_but_never_the_first_or_the_newest_block():
    scores = {0: -9.0, 1: 5.0, 2: 1.0, 3: 9.0, 4: 2.0, 5: 7.0, 6: 0.0}
    assert blocks_to_evict(range(8), scores, budget_blocks=5, newest_is_full=False) == [2, 4, 6]
    assert blocks_to_evict(range(8), scores, budget_blocks=5, newest_is_full=True) == [1, 2, 4, 6]
    assert blocks_to_evict(range(8), scores, budget_blocks=8, newest_is_full=False) == []


def test_ties_evict_the_oldest_block_first():
    assert blocks_to_evict([0, 2, 3, 5, 6], dict.fromkeys(range(7), 1.0), 4, newest_is_full=False) == [2]


def test_a_budget_under_three_blocks_is_refused():
    with pytest.raises(ValueError, match="budget_blocks must be >= 3"):
        blocks_to_evict(range(5), {}, budget_blocks=2, newest_is_full=False)


def test_scattered_runs():
    assert not runs_are_scattered([4, 5, 6, 7, 8], run_length=4)  # 2 runs for 5 pages
    assert runs_are_scattered([1, 5, 9, 13], run_length=4)  # 4 runs for 4 pages
    assert not runs_are_scattered([1, 5, 9, 13], run_length=1)


# -- the block manager -------------------------------------------------------------------------

@pytest.mark.parametrize("prefix_caching", [False, True])
def test_prefill_over_budget_keeps_the_first_newest_and_best_blocks(prefix_caching):
    bm = BlockManager(40, 4, enable_prefix_caching=prefix_caching)
    seq = Sequence(0, range(30), kv_budget=16)  # 8 blocks, the last holding 2 tokens; budget 4 blocks
    before = bm.stats()
    run_prefill(bm, seq, {0: 0.0, 1: 5.0, 2: 1.0, 3: 9.0, 4: 2.0, 5: 7.0, 6: 0.5})
    assert held(bm, seq) == [0, 3, 5, 7]
    assert bm.evicted_blocks(seq) == [1, 2, 4, 6]
    after = bm.stats()
    assert after.used == 4 and after.evicted_budget_blocks == 4
    assert after.num_free_or_cached == before.num_free_or_cached - 4  # 8 taken, 4 given back
    if not prefix_caching:
        assert after.free == before.free - 4


def test_decode_gives_up_one_block_each_time_the_newest_fills():
    bm = BlockManager(40, 4, enable_prefix_caching=False)
    seq = Sequence(0, range(14), kv_budget=12)  # 4 blocks, the last holding 2 tokens; budget 3
    run_prefill(bm, seq, {0: 0.0, 1: 3.0, 2: 1.0})
    assert held(bm, seq) == [0, 1, 3]
    free = bm.stats().free
    decode(bm, seq, 100, score=2.0)  # 15 tokens: block 3 not yet full
    assert held(bm, seq) == [0, 1, 3] and bm.stats().free == free
    decode(bm, seq, 101, score=2.0)  # 16 tokens: block 3 full, the next token needs a block -> one goes
    assert held(bm, seq) == [0, 3]  # block 1 was the only candidate: block 3 is the newest
    assert bm.stats().free == free + 1
    decode(bm, seq, 102)  # block 4 starts
    assert held(bm, seq) == [0, 3, 4] and bm.stats().free == free


def test_eviction_drops_only_this_sequences_reference_to_a_shared_block():
    bm = BlockManager(40, 4, enable_prefix_caching=False)
    parent = Sequence(0, range(20))  # no budget
    parent.num_computed_tokens = bm.allocate(parent)
    bm.append_slots(parent, 20)
    parent.num_computed_tokens = bm.mark_computed(parent, 19)
    child = parent.fork(1)
    child.kv_budget = 12
    bm.fork(parent, child)
    shared = list(bm.block_table(parent))
    bm.record_block_scores(child, dict.fromkeys(bm.blocks_to_score(child, 1), 1.0))
    child.num_computed_tokens = bm.mark_computed(child, 1)  # 20 tokens: 5 full blocks, budget 3 -> keep 2
    assert held(bm, child) == [0, 4]
    assert bm.block_table(parent) == shared  # untouched
    assert all(bm.pool.ref_count(b) == 1 for b in shared[1:4])  # only the child's references went


def test_a_pruned_sequence_publishes_no_later_block_to_the_prefix_cache():
    bm = BlockManager(40, 4)
    seq = Sequence(0, range(14), kv_budget=12)
    run_prefill(bm, seq, {0: 0.0, 1: 3.0, 2: 1.0})
    published = [bm.pool.block_hash(b) is not None for b in bm.block_table(seq)]
    assert published == [True, True, False, False]  # the prompt's full blocks, hashed before the eviction
    for token in (100, 101, 102, 103, 104, 105):
        decode(bm, seq, token)
    assert all(bm.pool.block_hash(b) is None for b in bm.block_table(seq)[2:] if b)
    # a request continuing this text reuses only the blocks computed before the eviction
    follow_up = Sequence(1, seq.token_ids + [7])
    assert bm.num_cached_prefix_tokens(follow_up) <= 3 * 4


def test_swap_round_trip_keeps_evicted_blocks_out():
    bm = BlockManager(40, 4, enable_prefix_caching=False, num_host_blocks=10)
    seq = Sequence(0, range(30), kv_budget=16)
    run_prefill(bm, seq, {0: 0.0, 1: 5.0, 2: 1.0, 3: 9.0, 4: 2.0, 5: 7.0, 6: 0.5})
    device = list(bm.block_table(seq))
    out = bm.swap_out(seq)
    assert [d for d, _ in out] == [b for b in device if b]
    assert bm.stats().used == 0
    back = bm.swap_in(seq)
    table = bm.block_table(seq)
    assert [i for i, b in enumerate(table) if b] == [0, 3, 5, 7] and len(table) == len(device)
    assert [h for h, _ in back] == [h for _, h in out]


def test_kept_pages_scattered_over_runs_are_packed_into_whole_runs():
    bm = BlockManager(64, 4, enable_prefix_caching=False, run_length=8)
    seq = Sequence(0, range(4 * 24 + 1), kv_budget=16)  # 25 blocks over 4 runs of 8
    run_prefill(bm, seq, {i: float(i % 3 == 0) for i in range(24)})
    pages = [b for b in bm.block_table(seq) if b]
    moves = [(op.src, op.dst) for op in bm.drain_ops() if op.kind is BlockOpKind.COPY]
    assert len(pages) == 4 and len({p // 8 for p in pages}) == 1  # one run instead of up to 4
    assert [dst for _, dst in moves] == pages
    assert bm.drain_ops() == []
    assert bm.stats().used == 4
