"""Blocks of the virtual KV layout: one reserved row per sequence, a cap on what is resident.

In the virtual layout (vAttention; :mod:`flexpage.attention.virtual_arena`) the address
space holds ``num_rows`` rows of ``row_length`` blocks, enough for one sequence of
``max_model_len`` tokens each, and the OS backs a block with memory when it is first
written. A sequence takes a wholly free row for its first block and the next block of the
same row for each later one, so its KV lies in one contiguous range and attention reads it
without a block table. What limits admission is therefore not the address space but the
memory in use: at most ``capacity`` blocks are held at once (``kv_resident_bytes``), and
the scheduler sees exactly that as the pool's free blocks.

Rows that become wholly free are queued for their memory to be given back
(:meth:`RowPool.drain_released_rows`: the step's plan ends with them, and the executor
``MADV_DONTNEED``\\ s them); a row taken again before that keeps its pages and is simply overwritten.

What the layout cannot do: two sequences never hold the same block (no prefix sharing, no
copy-on-write; forks copy), and a row reserved for ``max_model_len`` tokens is used as far
as its sequence reaches. Row 0 holds the null block and is never handed out.
"""

from __future__ import annotations

from flexpage.core.block_pool import BlockPool, NoFreeBlocksError

__all__ = ["RowPool"]


class RowPool(BlockPool):
    """A :class:`BlockPool` whose runs are rows: allocation never leaves a sequence's row."""

    def __init__(self, num_rows: int, row_length: int, capacity: int) -> None:
        for name, value, minimum in (("num_rows", num_rows, 1), ("row_length", row_length, 1),
                                     ("capacity", capacity, 1)):
            if not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name}: got {value!r}, expected an int >= {minimum}")
        self._released_rows: dict[int, None] = {}  # rows wholly free again, in the order they became so
        super().__init__((num_rows + 1) * row_length, row_length)
        for block_id in range(1, row_length):  # row 0: the null block's, never handed out
            self._take(block_id)
        self._released_rows.clear()  # fresh rows hold no memory
        self.num_rows = num_rows
        self.capacity = capacity

    @property
    def num_free(self) -> int:
        """Blocks that may still be taken: the resident cap minus the blocks in use."""
        return max(0, self.capacity - self.num_used)

    def allocate(self, after: int | None = None) -> int:
        """The first block of a wholly free row (``after`` None), else the block after ``after``."""
        if self.num_used >= self.capacity:
            raise NoFreeBlocksError(f"all {self.capacity} resident blocks are in use")
        if after is None:
            if not self._free_runs:
                raise NoFreeBlocksError(f"all {self.num_rows} rows of the virtual KV arena are taken")
            block_id = next(iter(self._free_runs)) * self.run_length
        else:
            block_id = after + 1
            if block_id % self.run_length == 0 or not self.is_free(block_id):
                raise NoFreeBlocksError(f"block {after} ends its row (a sequence is at most one row long)")
        self._take(block_id)
        self._ref[block_id] = 1
        self._num_used += 1
        return block_id

    def set_hash(self, block_id: int, block_hash: bytes) -> bool:
        """Never indexed: the virtual layout shares no blocks (prefix caching is off)."""
        return False

    def _release(self, block_id: int) -> None:
        super()._release(block_id)
        run = block_id // self.run_length
        if run in self._free_runs:
            self._released_rows[run] = None

    def _take(self, block_id: int) -> None:
        self._released_rows.pop(block_id // self.run_length, None)
        super()._take(block_id)

    def drain_released_rows(self) -> list[tuple[int, int]]:
        """Block ranges ``[start, end)`` of rows freed since the last call and still free:
        their memory can go back to the OS."""
        rows, self._released_rows = self._released_rows, {}
        return [(row * self.run_length, (row + 1) * self.run_length) for row in rows]
