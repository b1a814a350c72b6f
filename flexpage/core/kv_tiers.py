"""Where the prefix cache's blocks go when the pool needs them back: host and disk tiers.

The pool's prefix cache (:mod:`flexpage.core.block_pool`) keeps every full, computed block
indexed by its chained content hash after its sequence ends, so the next turn of a chat
(prompt = history + new message) finds the history's KV. Under load those cached blocks
are the first thing the pool takes back. With tiers (Pensieve, EuroSys'25) a block the pool
evicts is *spilled* to a host-memory tier instead of lost; when the host tier is full its
least valuable entry moves to a disk tier (if there is one) or is dropped, and the disk
tier drops its least valuable entry when full. A later request whose prefix hashes to a
tiered block *restores* it into a fresh pool block instead of recomputing it.

**Value.** Pensieve's retention value of a tiered block is ``V = cost(position) / idle``:
the time recomputing it would take (attention over everything before it, so it grows with
the block's position) over the time since it was last used. The lowest value goes first:
of one idle conversation the leading blocks go first, and those are the cheapest to
recompute -- the block manager recomputes a missing head in front of restored blocks.
``policy="lru"`` (least recently used first) is there for comparison.

**Copies the pool still holds go first**, under either policy. An entry stays in its tier
after a restore, so while its conversation runs (and until the pool takes the block back)
the tier holds a second copy of what the pool has: losing it loses nothing, and a later
spill copies the block again (a ~20 us copy against recomputing it). Ranked by idle time,
they would be the last to go (a running conversation is the most recently used), and the
tier would drop the idle histories that the next turns need.

Entries are keyed like the pool (:func:`~flexpage.core.layer_groups.group_key`) and stay
in their tier after a restore (a later spill of the same content costs nothing). This
module is bookkeeping only: it appends :class:`TierOp` s to ``ops`` in the order they must run; the
model runner's tier storage moves the bytes.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass

from flexpage.core.block_pool import BlockHash
from flexpage.core.kv_ops import KVOp, TierOp, TierOpKind

__all__ = ["TIER_POLICIES", "KVTiers", "TierOp", "TierOpKind", "TierStats"]

TIER_POLICIES = ("retention", "lru")


@dataclass(slots=True)
class _Entry:
    on_disk: bool
    slot: int  # host slot, or disk file id
    position: int  # logical block index in its sequence: what recomputing it would cost
    last_used: float
    owner: str | None = None  # the conversation that computed it


@dataclass(frozen=True, slots=True)
class TierStats:
    host_capacity: int  # entries (blocks)
    host_used: int
    disk_capacity: int
    disk_used: int
    spilled_blocks: int  # blocks the pool evicted into the tiers (kept or not)
    restored_host_blocks: int  # hits served from host memory
    restored_disk_blocks: int  # hits served from disk
    demoted_blocks: int  # host -> disk moves (and spills straight to disk)
    dropped_blocks: int  # entries gone for good (recompute if needed again)
    released_blocks: int  # entries let go while the pool held the same content (spilled again if needed)


class KVTiers:
    """Host and disk tiers behind the pool's prefix cache (see the module docstring)."""

    def __init__(self, host_slots: int, disk_slots: int = 0, *, policy: str = "retention",
                 cost: Callable[[int], float] = lambda position: 1.0 + position,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``cost(position)``: relative time to recompute the block at logical index ``position``
        (only ratios matter); ``clock``: seconds, monotonic (tests pass a fake one)."""
        for name, value in (("host_slots", host_slots), ("disk_slots", disk_slots)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if host_slots == 0 and disk_slots > 0:
            raise ValueError("a disk tier needs a host tier in front of it (host_slots > 0)")
        if policy not in TIER_POLICIES:
            raise ValueError(f"policy must be one of {TIER_POLICIES}, got {policy!r}")
        self.host_slots, self.disk_slots, self.policy = host_slots, disk_slots, policy
        self.cost = cost
        self.clock = clock
        self._entries: dict[BlockHash, _Entry] = {}
        self._free_host = list(range(host_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._num_disk = 0
        self._next_file = 0
        #: where the byte movements go, in the order they must run; the block manager hands
        #: its own list in, so tier copies and block copies keep one order
        self.ops: list[KVOp] = []
        #: keys no eviction may touch (the block manager sets them while it restores them)
        self.pinned: set[BlockHash] = set()
        #: whether the pool holds a key's content (used or cached): the block manager sets it
        self.in_pool: Callable[[BlockHash], bool] = lambda key: False
        self._counts = dict.fromkeys(("spilled", "host_hits", "disk_hits", "demoted", "dropped", "released"), 0)

    @property
    def enabled(self) -> bool:
        return self.host_slots > 0

    def __contains__(self, key: BlockHash) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def where(self, key: BlockHash) -> str | None:
        """``"host"``, ``"disk"`` or None."""
        entry = self._entries.get(key)
        return None if entry is None else ("disk" if entry.on_disk else "host")

    def stats(self) -> TierStats:
        c = self._counts
        return TierStats(self.host_slots, self.host_slots - len(self._free_host), self.disk_slots, self._num_disk,
                         c["spilled"], c["host_hits"], c["disk_hits"], c["demoted"], c["dropped"], c["released"])

    # -- moving blocks -----------------------------------------------------------------------
    def spill(self, key: BlockHash, device_block: int, position: int, last_used: float,
              owner: str | None = None) -> None:
        """The pool is about to reuse ``device_block`` (content ``key``, logical index
        ``position``, last read by a request at ``last_used``): keep a copy in the host tier,
        or, if it is worth less than everything there, on disk or nowhere. Content already
        tiered costs nothing."""
        if not self.enabled:
            return
        entry = self._entries.get(key)
        if entry is not None:
            entry.last_used = max(entry.last_used, last_used)
            return
        entry = _Entry(False, -1, position, last_used, owner)
        self._counts["spilled"] += 1
        if not self._free_host:
            for victim in self._victims(False, self.host_slots, key, entry):
                if victim == key:  # worth less than every host entry: straight down
                    self._move_down(key, entry, device_block)
                    return
                if self._resident(victim, key):
                    self._release(victim)
                else:
                    self._move_down(victim, self._entries[victim])
        entry.slot = self._free_host.pop()
        self._entries[key] = entry
        self.ops.append(TierOp(TierOpKind.SPILL, device_block, entry.slot))

    def restore(self, key: BlockHash, device_block: int) -> str | None:
        """Copy tiered content ``key`` into the fresh ``device_block``; the entry stays.
        Returns the entry's owner."""
        entry = self._entries[key]
        entry.last_used = self.clock()
        kind = TierOpKind.LOAD if entry.on_disk else TierOpKind.RESTORE
        self.ops.append(TierOp(kind, entry.slot, device_block))
        self._counts["disk_hits" if entry.on_disk else "host_hits"] += 1
        return entry.owner

    def blocks_by_owner(self) -> dict[str | None, tuple[int, int]]:
        """``owner -> (host blocks, disk blocks)``."""
        counts: dict[str | None, tuple[int, int]] = {}
        for entry in self._entries.values():
            host, disk = counts.get(entry.owner, (0, 0))
            counts[entry.owner] = (host, disk + 1) if entry.on_disk else (host + 1, disk)
        return counts

    def clear(self) -> int:
        """Drop every entry (disk files are deleted by the ops this queues); returns how many."""
        dropped = len(self._entries)
        for entry in self._entries.values():
            if entry.on_disk:
                self.ops.append(TierOp(TierOpKind.DELETE, entry.slot))
            else:
                self._free_host.append(entry.slot)
        self._entries.clear()
        self._num_disk = 0
        return dropped

    # -- policy --------------------------------------------------------------------------------
    def _value(self, entry: _Entry, now: float) -> float:
        if self.policy == "lru":
            return entry.last_used
        return self.cost(entry.position) / max(now - entry.last_used, 1e-6)

    def _resident(self, key: BlockHash, arriving: BlockHash) -> bool:
        """Whether the pool holds ``key``'s content, so the tier's copy can go at no loss (the
        block arriving from the pool is on its way out of it)."""
        return key != arriving and self.in_pool(key)

    def _victims(self, on_disk: bool, capacity: int, key: BlockHash, entry: _Entry) -> list[BlockHash]:
        """The lowest-value entries of a tier, counting ``entry`` (arriving as ``key``) among
        them: copies the pool still holds first, then by the policy's value; 1/64 of the
        tier's capacity at once (at least one), so that a stream of spills ranks the tier
        once per batch rather than once per block. Pinned entries never go."""
        now = self.clock()
        candidates = {k: e for k, e in self._entries.items() if e.on_disk == on_disk and k not in self.pinned}
        candidates[key] = entry
        return heapq.nsmallest(max(1, capacity // 64), candidates,
                               key=lambda k: (not self._resident(k, key), self._value(candidates[k], now)))

    def _release(self, key: BlockHash) -> None:
        """Let go of the tier's copy of content the pool holds (no loss: see the module docstring)."""
        entry = self._entries.pop(key)
        if entry.on_disk:
            self.ops.append(TierOp(TierOpKind.DELETE, entry.slot))
            self._num_disk -= 1
        else:
            self._free_host.append(entry.slot)
        self._counts["released"] += 1

    def _move_down(self, key: BlockHash, entry: _Entry, device_block: int | None = None) -> None:
        """``entry`` leaves the host tier (or, with ``device_block``, never enters it): to disk
        if there is one and it is worth more than what disk would drop for it, else gone."""
        if not entry.on_disk and device_block is None:
            self._free_host.append(entry.slot)
        keep = self.disk_slots > 0
        if keep and self._num_disk == self.disk_slots:
            victims = self._victims(True, self.disk_slots, key, entry)
            for victim in victims:
                if victim == key:
                    continue
                if self._resident(victim, key):
                    self._release(victim)
                else:
                    self.ops.append(TierOp(TierOpKind.DELETE, self._entries.pop(victim).slot))
                    self._num_disk -= 1
                    self._counts["dropped"] += 1
            keep = key not in victims
        if not keep:
            self._entries.pop(key, None)
            self._counts["dropped"] += 1
            return
        file_id, self._next_file = self._next_file, self._next_file + 1
        if device_block is None:
            self.ops.append(TierOp(TierOpKind.DEMOTE, entry.slot, file_id))
        else:
            self.ops.append(TierOp(TierOpKind.WRITE, device_block, file_id))
        entry.on_disk, entry.slot = True, file_id
        self._entries[key] = entry
        self._num_disk += 1
        self._counts["demoted"] += 1
