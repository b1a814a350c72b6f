"""What a fresh allocation of a sequence can reuse from the prefix cache and its tiers.

A lookup never covers a sequence's last token (the model must compute at least one position
to produce logits). The longest prefix every layer group can serve comes first
(:func:`flexpage.core.layer_groups.prefix_hit`: a full-attention group needs every block, a
sliding group only its window's). With tiers and only full-attention groups, a conversation
whose *leading* blocks a tier dropped but whose later blocks it kept still reuses those:
the plan names the hole in front of them, which the scheduler computes first (a causal query
in the hole never reads the blocks after it, so the result equals a full recompute).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass

from flexpage.core.block_pool import BlockHash
from flexpage.core.layer_groups import prefix_hit

__all__ = ["PrefixPlan", "plan_prefix"]


@dataclass(slots=True)
class PrefixPlan:
    """What a fresh allocation of a sequence can reuse.

    ``ids[g][i]``: group ``g``'s block for logical block ``i`` -- a pool block to share, the
    null block (out of a sliding window), ``TIERED`` (restore from a tier) or None (compute:
    the hole ``computed .. resume_start``). Blocks ``0 .. computed`` and
    ``resume_start .. len(ids[0])`` are reused.
    """

    ids: list[list[int | None]]
    computed: int
    resume_start: int

    @property
    def reused_blocks(self) -> int:
        return self.computed + len(self.ids[0]) - self.resume_start


def plan_prefix(hashes: SequenceABC[BlockHash], lookup: Callable[[int, BlockHash], int | None],
                windows: SequenceABC[int | None], block_size: int, holes: bool) -> PrefixPlan:
    """The plan for a sequence whose reusable blocks hash to ``hashes`` (never its last token's).

    ``lookup(group, hash)``: the group's pool block, ``TIERED`` or None. ``holes``: look for a
    run of blocks cached in every group behind the first miss (tiers, full attention only).
    """
    ids: list[list[int | None]] = prefix_hit(hashes, lookup, windows, block_size)  # type: ignore[assignment]
    computed = len(ids[0])
    if not holes:
        return PrefixPlan(ids, computed, computed)
    max_blocks, groups = len(hashes), range(len(windows))
    start = next((i for i in range(computed, max_blocks)
                  if all(lookup(g, hashes[i]) is not None for g in groups)), max_blocks)
    end = start
    while end < max_blocks and all(lookup(g, hashes[end]) is not None for g in groups):
        end += 1
    if end == start:  # nothing cached behind the first miss
        return PrefixPlan(ids, computed, computed)
    for g in groups:
        ids[g] += [None] * (start - computed) + [lookup(g, hashes[i]) for i in range(start, end)]
    return PrefixPlan(ids, computed, start)
