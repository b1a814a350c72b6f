"""The virtual layout's rows reserved for forks: a parent's siblings are copies, not shares.

In the virtual layout (:mod:`flexpage.core.row_pool`) nothing is shared, so a sequence
admitted with ``samples_to_fork`` siblings to come takes, at admission, one more row per
layer group for each of them (admission counts them: ``BlockManager.blocks_for_admission``).
A fork takes the newest reserved set, grows it to the parent's length and copies the
parent's blocks into it (``COPY`` ops, logged by the block manager); what was never forked
is given back when the parent is freed.
"""

from __future__ import annotations

from flexpage.core.block_pool import BlockPool
from flexpage.core.group_managers import allocate_after

__all__ = ["ForkRows"]


class ForkRows:
    """Rows reserved for each sequence's forks, one set (a row per layer group) per fork."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self._reserved: dict[int, list[list[list[int]]]] = {}  # by seq_id

    def reserve(self, seq_id: int, row_lengths: list[int], forks: int) -> None:
        """Take ``forks`` sets of fresh rows, ``row_lengths[g]`` blocks for group ``g``."""
        self._reserved[seq_id] = [[self._fresh_row(n) for n in row_lengths] for _ in range(forks)]

    def _fresh_row(self, num_blocks: int) -> list[int]:
        row: list[int] = []
        for _ in range(num_blocks):
            row.append(allocate_after(self.pool, row))
        return row

    def take(self, seq_id: int, tables: list[list[int]]) -> tuple[list[list[int]], list[list[tuple[int, int]]]]:
        """The newest set of rows ``seq_id`` reserved, grown to its ``tables``' lengths, and per
        group the ``(src, dst)`` copies that fill them."""
        reserved = self._reserved.get(seq_id)
        if not reserved:
            raise ValueError(f"parent sequence {seq_id} reserved no rows for forks (virtual layout: "
                             "admit it with samples_to_fork set)")
        rows = reserved.pop()
        if not reserved:
            del self._reserved[seq_id]
        copies = []
        for table, row in zip(tables, rows):
            while len(row) < len(table):  # the parent grew since admission
                row.append(allocate_after(self.pool, row))
            copies.append(list(zip(table, row)))
        return rows, copies

    def free(self, seq_id: int) -> None:
        """Give back the rows ``seq_id`` reserved and never forked into, tail first."""
        for rows in self._reserved.pop(seq_id, []):
            for row in rows:
                for block_id in reversed(row):
                    self.pool.decref(block_id)
