"""Which blocks a sequence over its KV budget gives up (PagedEviction's rule), in pure Python.

A sequence with a budget of ``C`` tokens (``Sequence.kv_budget``, a multiple of the block
size) keeps at most ``C / block_size`` logical blocks once all its tokens are computed. Its
first block (the attention sink) and its newest block are never evicted; among the others
the lowest-scoring ones go, oldest first on ties. Scores come from an eviction policy
(:class:`flexpage.attention.eviction.EvictionPolicy`, computed by the model runner from the
blocks' keys and values); this module only compares numbers.

The same rule serves both phases of PagedEviction: after a prompt's prefill the sequence
drops to its budget at once; in decode, each time the newest block fills it gives up one
block, so the next token's block fits within the budget.

An evicted block leaves the sequence's block tables (the entry becomes the null block), so
the kept tokens keep their logical positions -- the paging translation maps each page to
its index in the table -- and attention simply never lists the evicted pages.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["blocks_to_evict", "runs_are_scattered"]


def blocks_to_evict(live: Sequence[int], scores: Mapping[int, float], budget_blocks: int,
                    newest_is_full: bool) -> list[int]:
    """Logical block indices to evict, lowest score first.

    live:           the sequence's held logical blocks, ascending (the last is the newest)
    scores:         score per logical block (higher = more worth keeping); a block without
                    one is kept while any scored candidate remains
    budget_blocks:  blocks the budget allows (>= 3: the first, the newest and one more)
    newest_is_full: the next token starts a new block, so one more block is given up now
    """
    if budget_blocks < 3:
        raise ValueError(f"budget_blocks must be >= 3 (first, newest and one more), got {budget_blocks}")
    target = budget_blocks - 1 if newest_is_full else budget_blocks
    excess = len(live) - target
    if excess <= 0:
        return []
    first = 0  # the attention sink: logical block 0, if the sequence still holds it
    candidates = [i for i in live[:-1] if i != first]
    unscored = float("inf")
    candidates.sort(key=lambda i: (scores.get(i, unscored), i))
    return sorted(candidates[:excess])


def runs_are_scattered(pages: Sequence[int], run_length: int, slack: int = 1) -> bool:
    """Whether ``pages`` touch more kernel key blocks (aligned runs of ``run_length`` pages)
    than they would packed together, plus ``slack``.

    The attention kernel pays per key block it visits, however few of its pages a row still
    holds: after an eviction the kept pages are worth copying into whole runs once they are
    spread over many more runs than they fill.
    """
    if run_length <= 1 or not pages:
        return False
    packed = -(-len(pages) // run_length)
    return len({p // run_length for p in pages}) > packed + slack
