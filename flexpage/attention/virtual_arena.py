"""KV memory as a reservation of address space that the OS backs page by page (vAttention).

The paged pool (:mod:`flexpage.attention.kv_pool`) claims all its memory up front. The
*virtual* layout reserves address space for every sequence's whole context instead --
``max_num_seqs`` rows of ``max_model_len`` tokens per layer -- and lets the kernel map a
physical 4 KiB page the first time a token lands on it (demand paging). A sequence's KV
then lies contiguous in one row, so attention needs no block tables; when it finishes,
``MADV_DONTNEED`` gives its pages back and the row reads zeros again.

Why this is safe to hold in a tensor:

* ``MAP_NORESERVE`` (Python 3.11's mmap lacks the name) reserves without committing, so a
  reservation far larger than RAM costs nothing; the bytes actually resident are capped by
  the engine (``kv_resident_bytes``), because the kernel's overcommit accounting no longer
  does it (and with ``vm.overcommit_memory=2`` the reservation is refused: see
  :class:`ArenaRefused`).
* The mapping is never closed by us: ``mmap.close()`` unmaps even while tensors made by
  ``torch.frombuffer`` still point into it (a later access is a SIGSEGV). The tensor holds a
  reference to the ``mmap`` object, so the memory is unmapped when the last view of it is
  garbage: no view can outlive it. Released rows stay mapped (zeros), never unmapped.
* ``MADV_NOHUGEPAGE``, even where transparent huge pages are ``always``: a first touch would
  otherwise claim 2 MiB per (layer, K/V, head) row of every sequence, the opposite of paying
  for what is used.
"""

from __future__ import annotations

import ctypes
import math
import mmap
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

#: ``mmap`` flag: reserve address space without committing memory (missing from Python 3.11's mmap)
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
PAGE_SIZE = mmap.PAGESIZE


class ArenaRefused(ValueError):
    """The OS would not reserve the arena's address space (strict overcommit, or a limit on
    the address space): the virtual KV layout cannot run with these settings here (a
    ValueError, as every bad setting is: ``flexpage serve`` prints it and exits 2)."""


class VirtualArena:
    """One ``MAP_NORESERVE`` mapping viewed as a tensor of ``shape``: the KV storage
    ``[..., slots, head_dim]`` (every leading index is one row of ``slots * head_dim``
    elements, a contiguous range of memory).

    :meth:`release` returns the pages of slot ranges to the OS; :meth:`resident_bytes` counts
    the pages in RAM now.
    """

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.shape = shape
        self.dtype = dtype
        self.nbytes = math.prod(shape) * dtype.itemsize
        try:
            self._map = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
        except OSError as error:
            raise ArenaRefused(
                f"kv_layout='virtual': the OS refused to reserve {self.nbytes / 2**30:.1f} GiB of address space "
                f"({error}; vm.overcommit_memory={overcommit_mode()}): lower max_num_seqs or max_model_len, "
                "or use kv_layout='paged'"
            ) from error
        if hasattr(mmap, "MADV_NOHUGEPAGE"):  # also where transparent huge pages are "always"
            self._map.madvise(mmap.MADV_NOHUGEPAGE)
        #: the storage tensor; it keeps ``self._map`` alive (torch.frombuffer references it)
        self.tensor = torch.frombuffer(self._map, dtype=dtype).view(shape)
        self._row_bytes = shape[-2] * shape[-1] * dtype.itemsize
        self._num_rows = math.prod(shape[:-2])

    def release(self, slot_ranges: Iterable[tuple[int, int]]) -> int:
        """Give back the whole pages inside slots ``[start, end)`` of every row; returns the
        bytes advised. The slots read zeros afterwards (the mapping stays)."""
        token_bytes = self.shape[-1] * self.dtype.itemsize
        released = 0
        for start, end in slot_ranges:
            lo, hi = start * token_bytes, end * token_bytes
            for row in range(self._num_rows):
                first = -(-(row * self._row_bytes + lo) // PAGE_SIZE) * PAGE_SIZE  # whole pages only
                last = (row * self._row_bytes + hi) // PAGE_SIZE * PAGE_SIZE
                if last > first:
                    self._map.madvise(mmap.MADV_DONTNEED, first, last - first)
                    released += last - first
        return released

    def resident_bytes(self) -> int:
        """Bytes of the arena in RAM now."""
        return resident_bytes(self.tensor)


_libc = ctypes.CDLL(None, use_errno=True)


def resident_bytes(tensor: torch.Tensor) -> int:
    """Bytes of ``tensor``'s memory (CPU) in RAM now: ``mincore`` over its pages, so other
    allocations of the process do not count, as they do in RSS."""
    start = tensor.data_ptr() // PAGE_SIZE * PAGE_SIZE
    length = tensor.data_ptr() + tensor.numel() * tensor.element_size() - start
    pages = -(-length // PAGE_SIZE)
    vec = (ctypes.c_ubyte * pages)()
    if _libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return int((np.frombuffer(vec, dtype=np.uint8) & 1).sum()) * PAGE_SIZE


def overcommit_mode() -> str:
    """``vm.overcommit_memory`` (0 heuristic, 1 always, 2 strict), or "unknown"."""
    return _read("/proc/sys/vm/overcommit_memory")


def transparent_huge_pages() -> str:
    """The transparent-huge-page mode in force (``always``, ``madvise`` or ``never``), or "unknown"."""
    text = _read("/sys/kernel/mm/transparent_hugepage/enabled")
    return text[text.find("[") + 1:text.find("]")] if "[" in text else text


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return "unknown"
