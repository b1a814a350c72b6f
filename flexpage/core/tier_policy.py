"""Tiers behind the prefix cache as a policy the block manager composes: spill, restore, holes.

With a :class:`~flexpage.core.kv_tiers.KVTiers`, a cached block the pool evicts is spilled
to host memory (or disk) instead of lost (:class:`TierPolicy` hooks the pool's eviction),
and a prefix lookup that misses the pool but finds the block in a tier restores it into a
fresh block. Tier ops go to the block manager's one list of KV ops, in the order decided (a
spilled block may be a later copy's destination). The retention value needs each hashed
block's logical position, when a sequence last released it and the conversation that
computed it: :class:`TierPolicy` remembers them from publication on.

When a tier dropped a conversation's *leading* blocks but kept later ones, the hit has a
hole (:mod:`flexpage.core.prefix_plan`): allocation restores the later blocks, the scheduler
computes only the hole (:meth:`Holes.computable_tokens`), and once the hole is computed the
sequence's progress jumps past the restored range (:meth:`Holes.jump`).
"""

from __future__ import annotations

from collections.abc import Iterable

from flexpage.core.block_pool import BlockHash, BlockPool
from flexpage.core.kv_ops import KVOp
from flexpage.core.kv_tiers import KVTiers
from flexpage.core.prefix_plan import PrefixPlan
from flexpage.core.sequence import Sequence

__all__ = ["Holes", "TierPolicy"]


class TierPolicy:
    """Connects the pool's prefix cache to ``tiers`` (enabled) and logs their ops into ``ops``."""

    def __init__(self, tiers: KVTiers, pool: BlockPool, ops: list[KVOp]) -> None:
        self.tiers = tiers
        self.pool = pool
        tiers.in_pool = lambda key: pool.lookup(key) is not None
        tiers.ops = ops  # one list: a spilled block may be a later copy's destination
        #: of each hashed pool block: its logical block index, when a sequence last released it
        #: and the conversation that computed it (None: no conversation)
        self._block_info: dict[BlockHash, tuple[int, float, str | None]] = {}
        pool.on_evict = self._spill

    def holds(self, key: BlockHash) -> bool:
        """Whether a tier holds content ``key``."""
        return key in self.tiers

    def published(self, key: BlockHash, index: int, owner: str | None) -> None:
        """The pool indexed a block under ``key`` (logical index ``index``, computed by ``owner``)."""
        self._block_info[key] = (index, self.tiers.clock(), owner)

    def _spill(self, block_id: int, key: BlockHash) -> None:
        position, last_used, owner = self._block_info.pop(key, (0, 0.0, None))
        self.tiers.spill(key, block_id, position, last_used, owner)

    def restore(self, key: BlockHash, block_id: int) -> str | None:
        """Copy tiered content ``key`` into the fresh ``block_id``; returns its owner."""
        return self.tiers.restore(key, block_id)

    def pin(self, keys: set[BlockHash]) -> None:
        """While blocks are restored: fresh blocks may spill others, never drop these keys."""
        self.tiers.pinned = keys

    def owner(self, block_id: int) -> str | None:
        """The conversation that computed a hashed pool block (None: unknown or none)."""
        key = self.pool.block_hash(block_id)
        info = self._block_info.get(key) if key is not None else None
        return info[2] if info is not None else None

    def released(self, tables: Iterable[list[int]]) -> None:
        """A sequence lets go of ``tables``: the retention value counts idle time from now."""
        now = self.tiers.clock()
        for table in tables:
            for block_id in table:
                key = self.pool.block_hash(block_id)
                if key is not None and key in self._block_info:
                    position, _, owner = self._block_info[key]
                    self._block_info[key] = (position, now, owner)

    def reset(self) -> None:
        """After the pool dropped its cached blocks: forget them, and empty every tier."""
        self._block_info = {key: v for key, v in self._block_info.items() if self.pool.lookup(key) is not None}
        self.tiers.clear()


class Holes:
    """Sequences allocated with blocks restored behind a hole, until the hole is computed."""

    def __init__(self) -> None:
        #: by seq_id: (start, end) tokens restored behind the hole: once num_computed_tokens
        #: reaches start it jumps to end
        self._resume: dict[int, tuple[int, int]] = {}
        self.num_hole_tokens = 0  # tokens recomputed in front of blocks restored behind a hole

    def open(self, seq_id: int, plan: PrefixPlan, block_size: int) -> None:
        """Record ``plan``'s hole, if it has one, for the just-allocated ``seq_id``."""
        if plan.resume_start > plan.computed:
            self._resume[seq_id] = (plan.resume_start * block_size, len(plan.ids[0]) * block_size)
            self.num_hole_tokens += (plan.resume_start - plan.computed) * block_size

    def has_state(self, seq_id: int) -> bool:
        return seq_id in self._resume

    def computable_tokens(self, seq: Sequence) -> int:
        resume = self._resume.get(seq.seq_id)
        return resume[0] - seq.num_computed_tokens if resume is not None else seq.num_uncomputed_tokens

    def reused_tokens(self, seq: Sequence) -> int:
        resume = self._resume.get(seq.seq_id)
        return seq.num_computed_tokens + (resume[1] - resume[0] if resume is not None else 0)

    def jump(self, seq_id: int, num_computed_tokens: int) -> int:
        """``seq_id``'s progress once ``num_computed_tokens`` are computed: past the restored
        range when that completes the hole."""
        resume = self._resume.get(seq_id)
        if resume is not None and num_computed_tokens == resume[0]:
            del self._resume[seq_id]
            return resume[1]
        return num_computed_tokens

    def fork(self, parent_id: int, child_id: int) -> None:
        resume = self._resume.get(parent_id)
        self._resume.pop(child_id, None)
        if resume is not None:
            self._resume[child_id] = resume

    def drop(self, seq_id: int) -> None:
        self._resume.pop(seq_id, None)

