"""The bytes behind :class:`~flexpage.core.kv_tiers.KVTiers`: host slots and disk files.

The host tier is one tensor laid out like the pool's slots (``[L*2*H, slots*block_size,
D]``, all layers' K and V of a block side by side), an anonymous mapping left untouched
(:func:`~flexpage.attention.kv_pool.allocate_pool` without populating; ``torch.empty`` may
hand back memory the process used before, resident already): its resident memory grows
only as slots are first written and never passes ``host_bytes``. The disk tier writes
one safetensors file per block, atomically (a temporary name, then ``os.replace``), so a
process killed mid-write leaves a complete file or a stray temporary one, never a torn
entry under a real name. At start-up the directory is claimed with an exclusive lock (two
engines never share one) and whatever an earlier process left in it is deleted: tier keys
live in memory, so old files are unreachable.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import BinaryIO

import torch
from safetensors.torch import load_file, save

from flexpage.attention.kv_pool import KVPool, allocate_pool, block_slots
from flexpage.core.kv_tiers import TierOp, TierOpKind

__all__ = ["TierStorage"]

_PREFIX = "kv-"


class TierStorage:
    """Performs :class:`TierOp` s between a :class:`KVPool`, host memory and a directory."""

    def __init__(self, pool: KVPool, host_slots: int, disk_dir: str | os.PathLike[str] | None = None) -> None:
        self.pool = pool
        rows = pool.storage.numel() // (pool.num_slots * pool.head_dim)
        # 4 KB pages: a block's bytes are spread over every row, so 2 MB pages would make it all resident
        self.host = allocate_pool((rows, host_slots * pool.block_size, pool.head_dim), pool.dtype, populate=False,
                                  huge_pages=False)
        self.block_bytes = rows * pool.block_size * pool.head_dim * pool.storage.element_size()
        self.disk_dir: Path | None = None
        self.disk_bytes = 0  # bytes of this engine's tier files on disk now
        self._lock: BinaryIO | None = None
        if disk_dir is not None:
            self.disk_dir = Path(disk_dir)
            self.disk_dir.mkdir(parents=True, exist_ok=True)
            self._lock = open(self.disk_dir / ".lock", "wb")
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self._lock.close()
                raise ValueError(f"disk_kv_dir: {self.disk_dir} is in use by another flexpage engine") from None
            for stale in self.disk_dir.glob(f"{_PREFIX}*"):
                stale.unlink(missing_ok=True)

    def _file(self, file_id: int) -> Path:
        return self.disk_dir / f"{_PREFIX}{file_id}.safetensors"  # type: ignore[operator]

    def _host_slots(self, slots: list[int]) -> torch.Tensor:
        return block_slots(slots, self.pool.block_size)

    def apply(self, ops: list[TierOp]) -> None:
        """Run ``ops`` in order (consecutive spills or restores as one batched copy)."""
        i = 0
        while i < len(ops):
            kind = ops[i].kind
            j = i
            while j < len(ops) and ops[j].kind is kind:
                j += 1
            batch = ops[i:j]
            if kind is TierOpKind.SPILL:
                self.host[:, self._host_slots([op.dst for op in batch])] = self.pool.read_blocks([op.src for op in batch])
            elif kind is TierOpKind.RESTORE:
                self.pool.write_blocks([op.dst for op in batch], self.host[:, self._host_slots([op.src for op in batch])])
            else:
                for op in batch:
                    self._disk(op)
            i = j

    def _disk(self, op: TierOp) -> None:
        if op.kind in (TierOpKind.DEMOTE, TierOpKind.WRITE):
            path = self._file(op.dst)
            tmp = path.with_suffix(".tmp")
            data = (self.host[:, self._host_slots([op.src])] if op.kind is TierOpKind.DEMOTE
                    else self.pool.read_blocks([op.src]))
            tmp.write_bytes(save({"kv": data.contiguous()}))  # (save_file would make its own temporary file)
            os.replace(tmp, path)
            self.disk_bytes += path.stat().st_size
        elif op.kind is TierOpKind.LOAD:
            self.pool.write_blocks([op.dst], load_file(self._file(op.src))["kv"])
        elif op.kind is TierOpKind.DELETE:
            path = self._file(op.src)
            self.disk_bytes -= path.stat().st_size
            path.unlink()
        else:
            raise ValueError(f"unknown tier op {op!r}")

    def close(self) -> None:
        """Delete this engine's files and release the directory."""
        if self.disk_dir is not None and self._lock is not None:
            for path in self.disk_dir.glob(f"{_PREFIX}*"):
                path.unlink(missing_ok=True)
            self.disk_bytes = 0
            self._lock.close()
            self._lock = None
