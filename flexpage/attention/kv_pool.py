"""The global physical KV pool: one tensor pair per layer, shared by every sequence.

Memory layout per layer is ``[1, num_kv_heads, num_blocks * block_size, head_dim]``: the
shape FlexAttention wants for its key/value arguments (batch 1, broadcast over every
query row), so attention reads the pool in place, with no gather. A *slot* is one token
position in the pool: ``slot = block_id * block_size + offset``. Block 0 is the null
block; block tables pad with it, so padding reads harmless zeros.

On the CPU the pool is anonymous memory advised onto 2 MB pages and claimed in full as it
is made (:func:`allocate_pool`), as a serving engine reserves its KV cache up front:
attention's reads of a large pool take far fewer TLB misses than on 4 KB pages, and no
step pays for first-touch page faults (they made a 4 x 256-token prefill step ~13% slower).
:class:`KVPool` faults the pages in on a helper thread (:mod:`flexpage.background`) while the
model loads and compiles, on 4 KB pages from where 2 MB pages turn out slow to populate
(:func:`fault_in`). :meth:`KVPool.wait_until_resident` waits for it: ``LLM()`` does, and
``flexpage serve`` where asked; the engine's warm-up does not (the wait grows with the pool:
seconds per GiB on a VM that backs memory lazily), so a server is ready while its pool's pages
still come in behind it. A pool dropped while it populates stops its thread at the next 8 MB
chunk, and so does the process as it exits.

An int8 pool (``dtype=torch.int8``: the 8-bit KV cache) stores keys and values in int8 steps of
per-layer, per-head, per-channel scales (:attr:`KVPool.scales`, :mod:`flexpage.attention.kv_quant`):
:meth:`KVPool.write` quantises, attention folds the scales into the query and the output, and
blocks copy as bytes wherever they go.

The *virtual* layout (``layout="virtual"``) keeps this shape and these block ids over a
reservation of address space instead (:mod:`flexpage.attention.virtual_arena`): memory
arrives page by page as tokens are written and :meth:`KVPool.release` gives it back.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import mmap
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import ContextManager

import torch

from flexpage import background
from flexpage.attention.errors import check_arg
from flexpage.attention.kv_quant import quantize
from flexpage.attention.virtual_arena import VirtualArena

#: where K/V live: one pool of blocks claimed up front, or one reserved row per sequence
KV_LAYOUTS = ("paged", "virtual")


class KVPool:
    """Fixed-size paged key/value storage for all layers of one model."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        layout: str = "paged",
    ) -> None:
        """``layout``: ``"paged"`` claims the memory now (populated, see :func:`fault_in`); ``"virtual"``
        reserves address space that the OS backs page by page as tokens are written
        (:class:`~flexpage.attention.virtual_arena.VirtualArena`; CPU only), and
        :meth:`release` gives pages back."""
        for name, value in (
            ("num_layers", num_layers),
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            check_arg(isinstance(value, int) and value > 0, name, value, "a positive int")
        check_arg(num_blocks >= 2, "num_blocks", num_blocks, "at least 2 (block 0 is the null block)")
        check_arg(layout in KV_LAYOUTS, "layout", layout, f"one of {KV_LAYOUTS}")
        check_arg(dtype in _POOL_DTYPES, "dtype", dtype, f"one of {_POOL_DTYPES}")
        check_arg(layout == "paged" or torch.device(device).type == "cpu", "layout", layout,
                  "'paged' off the CPU (the virtual layout relies on the OS's demand paging)")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_layers, 2, 1, num_kv_heads, num_blocks * block_size, head_dim)
        self.layout = layout
        #: the virtual layout's reservation (None: paged)
        self.arena = VirtualArena(shape, dtype) if layout == "virtual" else None
        # one allocation for everything, so swap/copy of a block touches one tensor
        self.storage = self.arena.tensor if self.arena is not None else allocate_pool(
            shape, dtype, self.device, populate=False)
        #: steps (:meth:`ModelRunner.execute`) and the population of the pool's pages take turns,
        #: steps first: pages are faulted in while the engine is idle
        self.turns = StepsFirst()
        self._populating: threading.Thread | None = None
        if self.arena is None and _is_mapping(self.storage.device, self.storage.nbytes):
            # a helper thread (flexpage.background: LLM() waits for it, exit stops it), which
            # stops between chunks once this pool is dropped, handing the memory back
            stop = threading.Event()
            self._populating = background.start(
                functools.partial(fault_in, self.storage, stop=stop, turn=self.turns.chunk),
                name="flexpage-kv-populate", stop=stop)
            weakref.finalize(self, stop.set)
        self._layers = [(_separate_tensor(self.storage[i, 0]), _separate_tensor(self.storage[i, 1]))
                        for i in range(num_layers)]
        #: int8 pools: ``[num_layers, 2 (K, V), num_kv_heads, head_dim]`` float32 scales (ones until
        #: :meth:`set_scales`); None for float pools
        self.scales = (torch.ones(num_layers, 2, num_kv_heads, head_dim, device=self.device)
                       if dtype == torch.int8 else None)

    @property
    def quantized(self) -> bool:
        """Whether the pool holds int8 steps of :attr:`scales`."""
        return self.scales is not None

    def set_scales(self, scales: torch.Tensor) -> None:
        """Set an int8 pool's scales ``[num_layers, 2, num_kv_heads, head_dim]`` (in place: compiled
        steps hold the tensors), before anything is written: blocks already written would be read
        with the new scales."""
        check_arg(self.scales is not None, "set_scales", self.dtype, "an int8 pool")
        check_arg(tuple(scales.shape) == tuple(self.scales.shape), "scales", tuple(scales.shape),
                  f"shape {tuple(self.scales.shape)}")
        check_arg(bool((scales > 0).all()) and bool(scales.isfinite().all()), "scales", "some <= 0 or not finite",
                  "positive finite scales")
        self.scales.copy_(scales)

    def layer_scales(self, index: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(key scale, value scale) ``[num_kv_heads, head_dim]`` of one layer; None for float pools."""
        return None if self.scales is None else (self.scales[index, 0], self.scales[index, 1])

    @property
    def populating(self) -> bool:
        """Whether a paged pool's helper thread is still faulting its pages in."""
        return self._populating is not None and self._populating.is_alive()

    def wait_until_resident(self) -> None:
        """Return once every page of a paged pool is faulted in (at once for the other layouts)."""
        if self._populating is not None:
            self._populating.join()
            self._populating = None

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token occupies across all layers (K and V)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.storage.element_size()

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(key, value) of one layer: ``[1, H_kv, num_slots, D]`` each, over the memory of
        :attr:`storage` but (on the CPU) tensors of their own storage, so that a compiled
        step that writes every layer's K/V in place sees no two inputs alias (see
        :func:`_separate_tensor`)."""
        return self._layers[index]

    def write(self, index: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store new K/V for a batch of tokens in one vectorised scatter (an int8 pool quantises them).

        slots: [T] int64 pool slots; key/value: [T, H_kv, D].
        """
        k_pool, v_pool = self.layer(index)
        scales = self.layer_scales(index)
        if scales is not None:
            key, value = quantize(key, scales[0]), quantize(value, scales[1])
        write_kv(k_pool, v_pool, slots, key, value)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks ``src -> dst`` in every layer (copy-on-write)."""
        if not pairs:
            return
        src, dst = self._slot_ranges(pairs)
        view = self.storage.view(-1, self.num_slots, self.head_dim)
        view[:, dst] = view[:, src]

    def _slot_ranges(self, pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.tensor(pairs, dtype=torch.long, device=self.device)
        offsets = torch.arange(self.block_size, device=self.device)
        src = (ids[:, 0:1] * self.block_size + offsets).flatten()
        dst = (ids[:, 1:2] * self.block_size + offsets).flatten()
        return src, dst

    def read_blocks(self, blocks: list[int]) -> torch.Tensor:
        """All layers' K/V of some blocks, ``[L*2*H, len(blocks)*block_size, D]`` (for swapping out)."""
        slots = self._block_slots(blocks)
        return self.storage.view(-1, self.num_slots, self.head_dim)[:, slots].clone()

    def write_blocks(self, blocks: list[int], data: torch.Tensor) -> None:
        """Inverse of :meth:`read_blocks` (for swapping in)."""
        slots = self._block_slots(blocks)
        self.storage.view(-1, self.num_slots, self.head_dim)[:, slots] = data

    def release(self, block_ranges: list[tuple[int, int]]) -> int:
        """Return the memory of blocks ``[start, end)`` to the OS (virtual layout; the blocks
        read zeros afterwards); returns the bytes released. The paged layout keeps its memory."""
        if self.arena is None or not block_ranges:
            return 0
        return self.arena.release((start * self.block_size, end * self.block_size) for start, end in block_ranges)

    def _block_slots(self, blocks: list[int]) -> torch.Tensor:
        return block_slots(blocks, self.block_size, self.device)


#: what a pool may hold: a model's float dtype, or int8 steps of per-channel scales
_POOL_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8)


def block_slots(blocks: Sequence[int], block_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The slot indices of ``blocks``, block after block (slot = block * block_size + offset):
    how the pool and the host tiers laid out like it index whole blocks."""
    ids = torch.tensor(list(blocks), dtype=torch.long, device=device)
    return (ids[:, None] * block_size + torch.arange(block_size, device=device)).flatten()


def _separate_tensor(view: torch.Tensor) -> torch.Tensor:
    """``view`` (contiguous, on the CPU) as a tensor with a storage object of its own over the same memory.

    Why: a compiled graph that mutates two inputs sharing one storage treats them as views of
    a common base and copies the whole base around every in-place write (Inductor
    functionalisation): for the KV pool, every layer's pool copied per layer per step. Over
    distinct storage objects the in-place ``index_copy_`` stays in place. Both tensors keep
    the memory alive (the new one holds the old one's numpy view). Off the CPU the view is
    returned as it is.
    """
    if view.device.type != "cpu":
        return view
    raw = view.view(torch.uint8).numpy()  # shares the memory; numpy has no bfloat16, bytes suffice
    return torch.frombuffer(raw, dtype=view.dtype).view(view.shape)


_HUGE_PAGE = 2 << 20
#: ``madvise`` advice that faults a whole range in, writable (Linux 5.14; Python 3.11's mmap lacks the name)
_MADV_POPULATE_WRITE = 23
_MADV_NOHUGEPAGE = getattr(mmap, "MADV_NOHUGEPAGE", None)


def allocate_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu", *,
                  populate: bool = True, huge_pages: bool = True) -> torch.Tensor:
    """A zero-filled tensor for KV storage.

    On the CPU (from 2 MB up) it is an anonymous ``mmap``, advised onto 2 MB pages
    (``MADV_HUGEPAGE``, where transparent huge pages are ``madvise`` or ``always``) unless
    ``huge_pages`` is false (memory that should grow in 4 KB steps as it is written).
    ``populate`` faults every page in now: the first write to a fresh 2 MB page costs the
    kernel's page allocation and zeroing, which, left to the first steps that write there,
    made the KV scatter 7x slower (743 vs 113 us per layer for 1,024 tokens). Populating
    1 GiB takes ~0.1 s where 2 MB pages come cheap; where they do not, :func:`fault_in` puts
    the rest on 4 KB pages (:class:`KVPool` populates on a thread). Without it the
    OS hands out zeroed memory page by page as it is first written (demand paging: a
    pool's size is a reservation, not an allocation).
    """
    device = torch.device(device)
    nbytes = math.prod(shape) * dtype.itemsize
    if not _is_mapping(device, nbytes):
        return torch.zeros(shape, dtype=dtype, device=device)
    # anonymous and private (a shared mapping would be shmem, which gets no huge pages): zero-filled,
    # committed on first touch
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = "MADV_HUGEPAGE" if huge_pages else "MADV_NOHUGEPAGE"  # the latter also where THP is "always"
    if hasattr(mmap, advice):
        buffer.madvise(getattr(mmap, advice))
    if hasattr(mmap, "MADV_DONTFORK"):  # a forked child (flexpage.model.compile_ahead) gets no copy-on-write view
        buffer.madvise(mmap.MADV_DONTFORK)
    pool = torch.frombuffer(buffer, dtype=dtype).view(shape)  # the tensor keeps the mapping alive
    if populate:
        fault_in(pool)
    return pool


def _is_mapping(device: torch.device, nbytes: int) -> bool:
    """Whether :func:`allocate_pool` makes a pool of ``nbytes`` on ``device`` a mapping (else a
    plain tensor)."""
    return device.type == "cpu" and nbytes >= _HUGE_PAGE


#: bytes :func:`fault_in` populates per system call
_POPULATE_CHUNK = 8 << 20
#: populating slower than this (bytes/s) on 2 MB pages, the rest of a pool goes on 4 KB pages
SLOW_POPULATE_RATE = 2e9


class StepsFirst:
    """Steps on a pool and the population of its pages taking turns, steps first: a chunk of
    population waits until no step has run for ``idle_s`` (a serving engine between requests,
    not between the steps of one), and a step waits at most for the chunk in progress.

    Why: on the 2-core EPYC VM, whose host backs memory lazily (an 8 GiB pool populates at
    ~0.5 GB/s, a chunk of 8 MB in ~20 ms), a server's requests took 3-4x as long while the
    pool populated beside them, and still ~3x with a chunk between every two steps; steps
    that fault their own pages in cost nothing measurable. A plain lock starved the steps
    instead: the populating thread took it back before the waiting step woke."""

    def __init__(self, idle_s: float = 0.05) -> None:
        self.idle_s = idle_s
        self._state = threading.Condition()
        self._steps = 0  # running or waiting
        self._chunk = False  # a chunk in progress
        self._last_step = -math.inf  # time.monotonic() of the last step's end

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        with self._state:
            self._steps += 1
            self._state.wait_for(lambda: not self._chunk)
        try:
            yield
        finally:
            with self._state:
                self._steps -= 1
                self._last_step = time.monotonic()
                self._state.notify_all()

    @contextlib.contextmanager
    def chunk(self) -> Iterator[None]:
        with self._state:
            while True:
                self._state.wait_for(lambda: self._steps == 0)
                quiet = time.monotonic() - self._last_step
                if quiet >= self.idle_s:
                    break
                self._state.wait(self.idle_s - quiet)  # or until a step starts or ends: look again
            self._chunk = True
        try:
            yield
        finally:
            with self._state:
                self._chunk = False
                self._state.notify_all()


def fault_in(pool: torch.Tensor, slow_rate: float = SLOW_POPULATE_RATE, stop: threading.Event | None = None,
             turn: Callable[[], ContextManager[None]] | None = None) -> bool:
    """Fault every page of an :func:`allocate_pool` mapping in, writable; returns False where
    ``stop`` was set first (checked between chunks). The system calls run without the GIL
    (ctypes), so a thread can do it while Python goes on; each chunk runs inside ``turn()``
    (a pool's :meth:`StepsFirst.chunk`, so that it waits for steps).

    In chunks of 8 MB: populating holds the process's memory-map lock, which every ``mmap``
    of the other threads waits for, and a step waits for the chunk in progress. In one 1 GiB
    call on the Zen 3 VM, the imports and the model load running beside it (allocation-heavy)
    took 7.1 s instead of 3.5 s, and the populating itself 3.8 s instead of 1.7-2.3 s.

    Once a chunk populates slower than ``slow_rate`` bytes/s, the rest is advised onto 4 KB
    pages. On a virtual machine whose host backs guest memory on first touch and takes free
    memory back (the Firecracker VMs flexpage is tested on: virtio-balloon free page reporting
    hands free blocks of 128 KB and up to the host), 2 MB pages populated at 0.16 GB/s (1 GiB:
    3.6-4.9 s, the longest part of a warm start), 4 KB pages at ~3 GB/s from memory the guest
    reuses, and 2 MB pages it had freed just before at ~21 GB/s. The engine's throughput showed no
    difference between the page sizes there."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    start, nbytes = pool.data_ptr(), pool.nbytes
    may_be_huge = _MADV_NOHUGEPAGE is not None
    can_advise = True
    for offset in range(0, nbytes, _POPULATE_CHUNK):
        if stop is not None and stop.is_set():
            return False
        length = min(_POPULATE_CHUNK, nbytes - offset)
        with turn() if turn is not None else contextlib.nullcontext():
            began = time.perf_counter()
            can_advise = can_advise and libc.madvise(start + offset, length, _MADV_POPULATE_WRITE) == 0
            if not can_advise:  # an older kernel (before 5.14): touch every page of the chunk instead
                pool.view(-1).view(torch.uint8)[offset:offset + length:mmap.PAGESIZE].zero_()
            took = time.perf_counter() - began
        end = offset + length
        if may_be_huge and end < nbytes and length < slow_rate * took:
            libc.madvise(start + end, nbytes - end, _MADV_NOHUGEPAGE)
            may_be_huge = False
    return True


def write_kv(
    k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> None:
    """Scatter ``key``/``value`` ``[T, H_kv, D]`` into pools ``[1, H_kv, S, D]`` at ``slots`` ``[T]``."""
    _, num_heads, num_slots, head_dim = k_pool.shape
    expected = (slots.shape[0], num_heads, head_dim)
    check_arg(tuple(key.shape) == expected, "key", tuple(key.shape), f"shape {expected} (tokens, kv heads, head dim)")
    check_arg(tuple(value.shape) == expected, "value", tuple(value.shape), f"shape {expected}")
    check_arg(key.dtype == k_pool.dtype, "key.dtype", key.dtype, f"the pool dtype {k_pool.dtype}")
    check_arg(value.dtype == v_pool.dtype, "value.dtype", value.dtype, f"the pool dtype {v_pool.dtype}")
    # [T, H, D] -> [H, T, D] so one index_copy_ along the slot axis stores every head
    k_pool[0].index_copy_(1, slots, key.transpose(0, 1))
    v_pool[0].index_copy_(1, slots, value.transpose(0, 1))
