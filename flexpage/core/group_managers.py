"""One small manager per kind of layer group: the block tables of one group, per sequence.

vLLM v1's ``single_type_kv_cache_manager`` in our terms (the rules are in
:mod:`flexpage.core.layer_groups`): :class:`BlockManager` (the coordinator) holds one manager
per layer group, all drawing from one :class:`BlockPool`, and calls them in group order, so
the block ids they hand out are those one loop over the groups would hand out.

* :class:`FullAttentionManager` -- a table lives as long as its sequence;
* :class:`SlidingWindowManager` -- the leading blocks that no current or future query can
  see any more are given back (:func:`blocks_out_of_window`) and their entries become the
  null block 0, so its table is always ``[0] * released + live`` (budget holes aside).

A manager owns its tables (``tables[seq_id]``; a sequence without device blocks has none)
and does what touches one table at a time: allocating it from a prefix hit, growing it,
copy-on-write un-sharing, window release, forking by sharing, rebuilding it on swap-in and
freeing it tail first. It decides block ids only; the copies it decides are returned to the
coordinator, which logs them (:mod:`flexpage.core.kv_ops`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from flexpage.core.block_pool import NULL_BLOCK_ID, BlockHash, BlockPool
from flexpage.core.layer_groups import blocks_out_of_window, group_key

__all__ = ["TIERED", "FullAttentionManager", "GroupManager", "SlidingWindowManager", "allocate_after",
           "make_group_manager"]

#: a prefix-hit entry whose block is in a tier: allocation restores it into a fresh block
TIERED = -1


def allocate_after(pool: BlockPool, table: list[int]) -> int:
    """A new block for the end of ``table``, continuing its last block's run if possible."""
    last = table[-1] if table else NULL_BLOCK_ID
    return pool.allocate(last if last != NULL_BLOCK_ID else None)


class GroupManager:
    """The block tables of one layer group (``group``: its index, which names its cache keys)."""

    window: int | None = None

    def __init__(self, pool: BlockPool, block_size: int, group: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.group = group
        self.tables: dict[int, list[int]] = {}  # by seq_id; absent: no device blocks
        self.num_released_blocks = 0  # blocks given back early (sliding windows)

    def table(self, seq_id: int) -> list[int]:
        """``seq_id``'s device table (do not modify); empty when it holds none."""
        return self.tables.get(seq_id, [])

    def key(self, block_hash: BlockHash) -> BlockHash:
        """The prefix-cache key of this group's block for ``block_hash``."""
        return group_key(self.group, block_hash)

    def num_skipped(self, num_computed_tokens: int) -> int:
        """Leading blocks no query at a position ``>= num_computed_tokens`` reads."""
        return 0

    # -- admission -------------------------------------------------------------------------
    def blocks_to_allocate(self, hits: Sequence[int | None], num_blocks: int) -> int:
        """Pool blocks a table of ``num_blocks`` built on ``hits`` consumes: new ones and cached
        hits revived (a cached block is evictable, so reviving it costs one); null entries
        (out of a window) cost nothing."""
        fresh = sum(1 for b in hits if b is None or b == TIERED
                    or (b != NULL_BLOCK_ID and self.pool.ref_count(b) == 0))
        return num_blocks - len(hits) + fresh

    def take_hits(self, hits: Sequence[int | None]) -> None:
        """Reference the pool blocks of a prefix hit (before any fresh block is allocated: a
        fresh block may evict a cached one that is a hit)."""
        for block_id in hits:
            if block_id is not None and block_id not in (NULL_BLOCK_ID, TIERED):
                self.pool.incref(block_id)

    def allocate(self, seq_id: int, hits: Sequence[int | None], num_blocks: int,
                 restore: Callable[[int, int], None]) -> list[int]:
        """Build ``seq_id``'s table of ``num_blocks``: the hits (already referenced), then fresh
        blocks; a ``TIERED`` entry gets a fresh block and ``restore(index, block_id)``."""
        table: list[int] = []
        for i in range(num_blocks):
            entry = hits[i] if i < len(hits) else None
            if entry is not None and entry != TIERED:
                table.append(entry)
                continue
            table.append(allocate_after(self.pool, table))
            if entry == TIERED:
                restore(i, table[-1])
        self.tables[seq_id] = table
        return table

    # -- growth and copy-on-write ----------------------------------------------------------
    def blocks_to_append(self, seq_id: int, first: int, needed: int) -> int:
        """Pool blocks that growing to ``needed`` entries and un-sharing entries
        ``first .. needed`` take."""
        table = self.table(seq_id)
        cow = sum(1 for i in range(first, min(needed, len(table))) if self.pool.ref_count(table[i]) > 1)
        return max(0, needed - len(table)) + cow

    def append_slots(self, seq_id: int, first: int, needed: int) -> list[tuple[int, int]]:
        """Un-share (copy-on-write) entries ``first .. needed`` and grow the table to ``needed``;
        returns the ``(src, dst)`` copies."""
        table = self.tables[seq_id]
        copies: list[tuple[int, int]] = []
        for i in range(first, min(needed, len(table))):
            src = table[i]
            if self.pool.ref_count(src) > 1:
                dst = allocate_after(self.pool, table[:i])
                self.pool.decref(src)
                table[i] = dst
                copies.append((src, dst))
        while len(table) < needed:
            table.append(allocate_after(self.pool, table))
        return copies

    def remove_skipped_blocks(self, seq_id: int, num_computed_tokens: int, evicted: Collection[int]) -> None:
        """Give back the leading blocks no query can see any more (none for full attention)."""

    def truncate(self, seq_id: int, num_blocks: int) -> None:
        """Give back the table's entries from ``num_blocks`` on (rolled-back positions), tail first."""
        table = self.tables[seq_id]
        while len(table) > num_blocks:
            block_id = table.pop()
            if block_id != NULL_BLOCK_ID:
                self.pool.decref(block_id)

    # -- sharing, swapping, release ----------------------------------------------------------
    def fork(self, parent_id: int, child_id: int) -> None:
        """Let ``child_id`` share every block of ``parent_id``'s table."""
        table = self.tables[parent_id]
        for block_id in table:
            if block_id != NULL_BLOCK_ID:
                self.pool.incref(block_id)
        self.tables[child_id] = list(table)

    def adopt(self, seq_id: int, other_id: int) -> None:
        """Give ``seq_id`` the table of ``other_id`` (which no longer has one), releasing the
        blocks of its own that the adopted table does not share, tail first."""
        own = self.tables[seq_id]
        self.tables[seq_id] = self.tables.pop(other_id)
        for block_id in reversed(own):
            if block_id != NULL_BLOCK_ID:
                self.pool.decref(block_id)

    def swap_in(self, seq_id: int, host_table: list[int], num_computed_tokens: int, evicted: Collection[int],
                keys: Sequence[BlockHash], publish: Callable[[int, BlockHash, int], None]) -> list[tuple[int, int]]:
        """Rebuild ``seq_id``'s table from its live host slots: leading skipped entries and
        budget-evicted ones are null, a block whose content the pool still holds (``keys[i]``,
        this group's key of logical block ``i``) is shared, the rest are fresh blocks, published
        under their key (``publish(block_id, key, i)``). Returns the ``(host, device)`` copies."""
        table = [NULL_BLOCK_ID] * self.num_skipped(num_computed_tokens)
        pairs: list[tuple[int, int]] = []
        for host in host_table:
            while len(table) in evicted:
                table.append(NULL_BLOCK_ID)
            i = len(table)
            block_id = self.pool.lookup(keys[i]) if i < len(keys) else None
            if block_id is not None:
                self.pool.incref(block_id)
            else:
                block_id = allocate_after(self.pool, table)
                pairs.append((host, block_id))
                if i < len(keys):
                    publish(block_id, keys[i], i)
            table.append(block_id)
        self.tables[seq_id] = table
        return pairs

    def free(self, seq_id: int) -> None:
        """Drop ``seq_id``'s table, releasing its blocks tail first (a cached prefix outlives
        the blocks after it)."""
        for block_id in reversed(self.tables.pop(seq_id, [])):
            if block_id != NULL_BLOCK_ID:
                self.pool.decref(block_id)


class FullAttentionManager(GroupManager):
    """A full-attention group: every block is read by every later query."""


class SlidingWindowManager(GroupManager):
    """A sliding-window group (window ``W``): gives back the blocks every query has passed."""

    def __init__(self, pool: BlockPool, block_size: int, group: int, window: int) -> None:
        super().__init__(pool, block_size, group)
        self.window = window

    def num_skipped(self, num_computed_tokens: int) -> int:
        return blocks_out_of_window(self.window, self.block_size, num_computed_tokens)

    def remove_skipped_blocks(self, seq_id: int, num_computed_tokens: int, evicted: Collection[int]) -> None:
        table = self.tables[seq_id]
        i = min(self.num_skipped(num_computed_tokens), len(table)) - 1
        # released entries form a leading run, with the budget's evicted holes inside it
        while i >= 0 and (table[i] != NULL_BLOCK_ID or i in evicted):
            if table[i] != NULL_BLOCK_ID:
                self.pool.decref(table[i])
                table[i] = NULL_BLOCK_ID
                self.num_released_blocks += 1
            i -= 1


def make_group_manager(pool: BlockPool, block_size: int, group: int, window: int | None,
                       keep_window: bool = False) -> GroupManager:
    """The manager for a group with ``window`` (None: full attention). ``keep_window``: the
    group keeps every block (the virtual layout's rows stay whole; attention never reads past
    a window anyway), which is full attention's table rule."""
    if window is None or keep_window:
        return FullAttentionManager(pool, block_size, group)
    return SlidingWindowManager(pool, block_size, group, window)
