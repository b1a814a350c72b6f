"""Host swap space: where a preempted sequence's KV waits (swap out, swap in).

``num_host_blocks`` host slots, handed out first-freed-last (a FIFO of free slots). A
sequence swapped out holds one host table per layer group with its *live* blocks only: the
null entries of a sliding group (out of its window) and of a KV budget (evicted) are not
copied, and swap-in restores them from the sequence's progress and budget state. Host slot
0 is an ordinary slot. The block manager decides the device side and logs the copies.
"""

from __future__ import annotations

from collections import deque

from flexpage.core.block_pool import NULL_BLOCK_ID

__all__ = ["HostSwapSpace"]


class HostSwapSpace:
    """Host slots and the host tables of swapped-out sequences."""

    def __init__(self, num_host_blocks: int) -> None:
        self.num_host_blocks = num_host_blocks
        self._free: deque[int] = deque(range(num_host_blocks))
        self._tables: dict[int, list[list[int]]] = {}  # by seq_id, one per layer group

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_host_blocks - len(self._free)

    def tables(self, seq_id: int) -> list[list[int]] | None:
        """``seq_id``'s host slot ids per layer group (do not modify); None when not swapped."""
        return self._tables.get(seq_id)

    def holds(self, seq_id: int) -> bool:
        return any(self._tables.get(seq_id, ()))

    @staticmethod
    def num_live(tables: list[list[int]]) -> int:
        """Blocks of device ``tables`` a swap-out copies (null entries are not)."""
        return sum(1 for table in tables for b in table if b != NULL_BLOCK_ID)

    def swap_out(self, seq_id: int, device_tables: list[list[int]]) -> list[tuple[int, int]]:
        """Give ``seq_id`` a host slot per live device block; returns the ``(device, host)``
        copies, group by group in table order. The caller checked :attr:`num_free`."""
        pairs: list[tuple[int, int]] = []
        host_tables = []
        for table in device_tables:
            host_table = []
            for block_id in table:
                if block_id != NULL_BLOCK_ID:
                    host_table.append(self._free.popleft())
                    pairs.append((block_id, host_table[-1]))
            host_tables.append(host_table)
        self._tables[seq_id] = host_tables
        return pairs

    def release(self, seq_id: int) -> None:
        """``seq_id``'s host slots are free again (swapped in, or freed)."""
        for host_table in self._tables.pop(seq_id, []):
            self._free.extend(host_table)
