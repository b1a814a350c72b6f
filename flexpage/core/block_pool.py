"""Physical KV blocks: ref counts, the prefix-cache index and eviction.

Every device block is in exactly one of three states:

* **free**: ref count 0, no hash. Holds nothing worth keeping.
* **cached**: ref count 0 but still indexed by its content hash. Its KV is
  valid and a later request with the same prefix can revive it, but it may be
  evicted (hash dropped) whenever a fresh block is needed. Without runs (below),
  cached blocks are evicted least-recently-released first, and only when no block
  is free.
* **used**: ref count > 0 (referenced by that many block-table entries).

Block 0 is the NULL block: never handed out, never counted. Padding entries in
block tables point at it, so a stray read through padding hits harmless memory.

A warm prefix cache survives for as long as the pool has wholly free runs; past that,
allocation places blocks where the attention kernel reads them cheaply and evicts what is
in the way (see below).

**Runs.** Blocks ``r*R .. r*R+R-1`` form run ``r`` (``run_length`` R). The attention
kernel reads a run as one key block, and pays per key block it visits, so a sequence
should fill whole runs: :meth:`BlockPool.allocate` continues the caller's run while it has
a block not in use (any: the order of pages within a run does not matter to the kernel; a
free one first, else the run's least recently released cached block is evicted) and
otherwise starts a wholly free run. When none is left -- a pool that has served for a while
is full of cached blocks -- it takes the least recently released *idle* run (no block in
use, some cached), evicting that run's cached blocks together, and then the run with the
most blocks not in use, where the caller's next blocks can follow (placement only affects
speed, never correctness; cached blocks are evicted by place, least recently released
first only within a run). Without idle runs, a full pool scattered every new sequence over
blocks of other runs: once the cache had filled the pool, decode rows of the 48-prompt
workload visited ~3x the key blocks they needed and throughput fell to 0.81x that of an
engine without prefix caching (``bench/pool_reuse.py``). Taking the oldest free block
wherever it lay, then the globally least recently released cached block, and continuing a
run only at the very next block, did the same to sequences coming and going in a full pool:
decode rows of the multi-turn chat workload visited 5x the key blocks they needed
(``bench/multiturn.py``). This is vAttention's point -- attention wants contiguous KV --
kept within PagedAttention's small blocks.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable
from collections.abc import Sequence as SequenceABC

__all__ = ["NULL_BLOCK_ID", "BlockHash", "BlockPool", "NoFreeBlocksError", "hash_block_tokens", "salted_root"]

NULL_BLOCK_ID = 0

#: Content hash of a full block, chained over its parent's hash (sha256 digest).
BlockHash = bytes

_ROOT_HASH = b"flexpage-prefix-root"


def hash_block_tokens(parent: BlockHash | None, token_ids: SequenceABC[int]) -> BlockHash:
    """Hash of a full block's tokens chained over the previous block's hash.

    Chaining means equal hashes imply equal *whole prefixes*, which is what KV
    reuse needs (a token's KV depends on every token before it). sha256 rather
    than ``hash()`` so that a crafted prompt cannot collide with another
    request's prefix and read its KV.
    """
    h = hashlib.sha256(_ROOT_HASH if parent is None else parent)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def salted_root(salt: str | None) -> BlockHash | None:
    """The parent hash of a sequence's first block: None (shared by every request) or one
    derived from ``salt``, so that only requests with the same salt share KV (vLLM's
    ``cache_salt``; the server salts a conversation with its API key)."""
    if salt is None:
        return None
    return hashlib.sha256(_ROOT_HASH + b"/salt/" + salt.encode()).digest()


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation is attempted without checking capacity first."""


class BlockPool:
    """Ref-counted device blocks with a content-hash index (prefix cache)."""

    def __init__(self, num_blocks: int, run_length: int = 1) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the reserved null block), got {num_blocks}")
        if run_length < 1:
            raise ValueError(f"run_length must be >= 1, got {run_length}")
        self.num_blocks = num_blocks
        self.run_length = run_length
        self._ref: list[int] = [0] * num_blocks
        self._hash: list[BlockHash | None] = [None] * num_blocks
        # free blocks: whole free runs (oldest first), and loose free blocks (in runs partly in
        # use or cached) per run
        num_runs = -(-num_blocks // run_length)
        self._free_runs: OrderedDict[int, None] = OrderedDict()
        self._run_loose: list[dict[int, None]] = [{} for _ in range(num_runs)]
        self._num_loose = 0
        # per run: blocks in use and cached blocks; idle runs (none in use, some cached, never
        # run 0, which holds the null block), least recently released first
        self._run_used = [0] * num_runs
        self._run_cached: list[dict[int, None]] = [{} for _ in range(num_runs)]  # least recently released first
        self._idle_runs: OrderedDict[int, None] = OrderedDict()
        # runs not wholly free, filed by their blocks not in use (free or cached): where a
        # sequence starts when no run is wholly free or idle
        self._runs_by_available: list[dict[int, None]] = [{} for _ in range(run_length + 1)]
        self._filed_available = [0] * num_runs
        for block_id in range(1, num_blocks):
            self._release(block_id)
        # ref-0 hashed blocks, least recently released first.
        self._cached: OrderedDict[int, None] = OrderedDict()
        self._by_hash: dict[BlockHash, int] = {}
        self._num_used = 0
        self.num_evictions = 0
        #: called with (block id, hash) just before a cached block is evicted for reuse, while its
        #: KV is still intact: the block manager spills it to the host tier there
        self.on_evict: Callable[[int, BlockHash], None] | None = None

    # -- counters ------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return self._num_loose + self.run_length * len(self._free_runs)

    @property
    def num_free_runs(self) -> int:
        """Runs whose every block is free: where new sequences start."""
        return len(self._free_runs)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_used(self) -> int:
        return self._num_used

    @property
    def num_free_or_cached(self) -> int:
        """Blocks an allocation can obtain right now (evicting if needed)."""
        return self.num_free + len(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def block_hash(self, block_id: int) -> BlockHash | None:
        return self._hash[block_id]

    def cached_block_ids(self) -> list[int]:
        """Ref-0 cached blocks in eviction order (first is evicted first)."""
        return list(self._cached)

    def is_free(self, block_id: int) -> bool:
        return block_id != NULL_BLOCK_ID and self._ref[block_id] == 0 and self._hash[block_id] is None

    # -- free-block bookkeeping ------------------------------------------------
    def _release(self, block_id: int) -> None:
        run = block_id // self.run_length
        loose = self._run_loose[run]
        if len(loose) + 1 == self.run_length:  # the whole run is free again
            self._num_loose -= len(loose)
            loose.clear()
            self._free_runs[run] = None
        else:
            loose[block_id] = None
            self._num_loose += 1
        self._refile(run)

    def _take(self, block_id: int) -> None:
        run = block_id // self.run_length
        loose = self._run_loose[run]
        if run in self._free_runs:  # breaking a whole run: its other blocks become loose
            del self._free_runs[run]
            loose.update(dict.fromkeys(b for b in self._run_blocks(run) if b != block_id))
            self._num_loose += len(loose)
        else:
            del loose[block_id]
            self._num_loose -= 1
        self._refile(run)

    def _refile(self, run: int) -> None:
        """File ``run`` under its blocks not in use, after a change (wholly free runs: not filed)."""
        available = 0 if run in self._free_runs else len(self._run_loose[run]) + len(self._run_cached[run])
        filed = self._filed_available[run]
        if available != filed:
            if filed:
                del self._runs_by_available[filed][run]
            if available:
                self._runs_by_available[available][run] = None
            self._filed_available[run] = available

    def _most_available_run(self) -> int:
        """The run with the most blocks not in use (the earliest filed of those); one must exist."""
        return next(next(iter(runs)) for runs in reversed(self._runs_by_available) if runs)

    def _take_in_run(self, run: int, preferred: int | None = None) -> int:
        """A free block of ``run`` (``preferred`` if free), else its least recently released
        cached block, evicted; the run must have either."""
        loose = self._run_loose[run]
        if loose:
            block_id = preferred if preferred in loose else next(iter(loose))
            self._take(block_id)
        else:
            block_id = next(iter(self._run_cached[run]))
            self._evict(block_id)
        return block_id

    def _run_blocks(self, run: int) -> range:
        return range(run * self.run_length, min((run + 1) * self.run_length, self.num_blocks))

    def _unindex(self, block_id: int) -> BlockHash:
        """Take a cached block out of the prefix cache (it is then neither cached nor free: the
        caller decides); returns the hash it had."""
        del self._cached[block_id]
        block_hash = self._hash[block_id]
        del self._by_hash[block_hash]  # type: ignore[arg-type]
        self._hash[block_id] = None
        del self._run_cached[block_id // self.run_length][block_id]
        self._refile(block_id // self.run_length)
        return block_hash  # type: ignore[return-value]

    def _evict(self, block_id: int) -> None:
        """Evict a cached block for reuse: unindexed, counted, reported to ``on_evict``."""
        block_hash = self._unindex(block_id)
        self.num_evictions += 1
        if self.on_evict is not None:
            self.on_evict(block_id, block_hash)

    def _reclaim_idle_run(self) -> int:
        """Evict every cached block of the least recently released idle run; returns the run,
        now wholly free."""
        run, _ = self._idle_runs.popitem(last=False)
        for block_id in self._run_blocks(run):
            if block_id in self._cached:
                self._evict(block_id)
                self._release(block_id)
        return run

    # -- transitions ---------------------------------------------------------
    def allocate(self, after: int | None = None) -> int:
        """A fresh block with ref count 1.

        ``after`` is the block that precedes the new one in the caller's block table: while
        its run has a block not in use, the new block is one of them (its successor first, a
        free block before a cached one, which is evicted). Otherwise the first block of a
        wholly free run, else of the least recently released idle run (its cached blocks
        evicted), else a block of the run with the most blocks not in use, where the caller's
        next blocks can follow (a free one first, else a cached one is evicted).
        """
        if after is not None and self._filed_available[after // self.run_length]:
            block_id = self._take_in_run(after // self.run_length, preferred=after + 1)
        elif self._free_runs or self._idle_runs:
            run = next(iter(self._free_runs)) if self._free_runs else self._reclaim_idle_run()
            block_id = max(run * self.run_length, 1)
            self._take(block_id)
        elif self._num_loose or self._cached:
            block_id = self._take_in_run(self._most_available_run())
        else:
            raise NoFreeBlocksError("no free or cached device blocks left")
        self._ref[block_id] = 1
        self._num_used += 1
        self._run_used[block_id // self.run_length] += 1
        self._idle_runs.pop(block_id // self.run_length, None)
        return block_id

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The block holding this content hash (used or cached), if any."""
        return self._by_hash.get(block_hash)

    def incref(self, block_id: int) -> None:
        """Add a reference; revives a cached block (it can no longer be evicted)."""
        if block_id == NULL_BLOCK_ID:
            raise ValueError("the null block cannot be referenced")
        if self._ref[block_id] == 0:
            if block_id not in self._cached:
                raise ValueError(f"block {block_id} is free; only used or cached blocks can be shared")
            del self._cached[block_id]
            run = block_id // self.run_length
            del self._run_cached[run][block_id]
            self._refile(run)
            self._run_used[run] += 1
            self._idle_runs.pop(run, None)
            self._num_used += 1
        self._ref[block_id] += 1

    def decref(self, block_id: int) -> None:
        """Drop a reference. At zero the block becomes cached (if hashed) or free."""
        ref = self._ref[block_id]
        if ref <= 0 or block_id == NULL_BLOCK_ID:
            raise ValueError(f"block {block_id} is not in use (ref_count={ref})")
        self._ref[block_id] = ref - 1
        if ref == 1:
            self._num_used -= 1
            run = block_id // self.run_length
            self._run_used[run] -= 1
            if self._hash[block_id] is not None:
                self._cached[block_id] = None  # most recently released: evicted last
                self._run_cached[run][block_id] = None
                self._refile(run)
            else:
                self._release(block_id)
            if run and not self._run_used[run] and self._run_cached[run]:
                self._idle_runs[run] = None
                self._idle_runs.move_to_end(run)  # most recently released: reclaimed last

    def set_hash(self, block_id: int, block_hash: BlockHash) -> bool:
        """Index a used, fully computed block by its content hash.

        Returns False (and leaves the block unindexed) when another block
        already holds this content: two requests computed the same prefix
        concurrently. The duplicate simply returns to the free list when
        released, which keeps the index a one-to-one map.
        """
        if self._ref[block_id] <= 0:
            raise ValueError(f"block {block_id} must be in use to be hashed")
        current = self._hash[block_id]
        if current is not None:
            return current == block_hash
        if block_hash in self._by_hash:
            return False
        self._hash[block_id] = block_hash
        self._by_hash[block_hash] = block_id
        return True

    def reset_prefix_cache(self) -> int:
        """Evict every cached (ref-0) block; returns how many were dropped."""
        dropped = 0
        while self._cached:
            block_id = next(iter(self._cached))
            self._unindex(block_id)
            self._release(block_id)
            dropped += 1
        self._idle_runs.clear()  # each was free and cached blocks only: wholly free now
        return dropped
