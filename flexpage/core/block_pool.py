"""Physical KV blocks: ref counts, the prefix-cache index and LRU eviction.

Every device block is in exactly one of three states:

* **free**: ref count 0, no hash. Holds nothing worth keeping.
* **cached**: ref count 0 but still indexed by its content hash. Its KV is
  valid and a later request with the same prefix can revive it, but it may be
  evicted (hash dropped) whenever a fresh block is needed and no free block is
  left. Cached blocks are evicted least-recently-released first.
* **used**: ref count > 0 (referenced by that many block-table entries).

Block 0 is the NULL block: never handed out, never counted. Padding entries in
block tables point at it, so a stray read through padding hits harmless memory.

Allocation prefers free blocks and only then evicts cached ones, so a warm
prefix cache survives for as long as the pool has slack (with runs, an idle run's cached
blocks go before loose free blocks: see below).

**Runs.** Blocks ``r*R .. r*R+R-1`` form run ``r`` (``run_length`` R). The attention
kernel reads a run as one key block, and pays per key block it visits, so a sequence
should fill whole runs: :meth:`BlockPool.allocate` continues the caller's run when the
next block is free and otherwise starts a wholly free run. When none is left -- a pool
that has served for a while is full of cached blocks -- it takes the least recently
released *idle* run (no block in use, some cached), evicting that run's cached blocks
together, and only then falls back to loose free blocks and single LRU evictions
(placement only affects speed, never correctness). Without idle runs, a full pool
scattered every new sequence over blocks of other runs: once the cache had filled the
pool, decode rows of the 48-prompt workload visited ~3x the key blocks they needed and
throughput fell to 0.81x that of an engine without prefix caching (``bench/pool_reuse.py``). This is vAttention's point -- attention wants contiguous KV --
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
        # free blocks: whole free runs (oldest first), and loose free blocks in runs partly in use
        num_runs = -(-num_blocks // run_length)
        self._run_free = [0] * num_runs
        self._free_runs: OrderedDict[int, None] = OrderedDict()
        self._loose: OrderedDict[int, None] = OrderedDict()
        # per run: blocks in use and cached blocks; idle runs (none in use, some cached, never
        # run 0, which holds the null block), least recently released first
        self._run_used = [0] * num_runs
        self._run_cached = [0] * num_runs
        self._idle_runs: OrderedDict[int, None] = OrderedDict()
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
        return len(self._loose) + self.run_length * len(self._free_runs)

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
        self._run_free[run] += 1
        if self._run_free[run] == self.run_length:  # the whole run is free again
            for other in self._run_blocks(run):
                if other != block_id:
                    del self._loose[other]
            self._free_runs[run] = None
        else:
            self._loose[block_id] = None

    def _take(self, block_id: int) -> None:
        run = block_id // self.run_length
        if run in self._free_runs:  # breaking a whole run: its other blocks become loose
            del self._free_runs[run]
            for other in self._run_blocks(run):
                if other != block_id:
                    self._loose[other] = None
        else:
            del self._loose[block_id]
        self._run_free[run] -= 1

    def _run_blocks(self, run: int) -> range:
        return range(run * self.run_length, min((run + 1) * self.run_length, self.num_blocks))

    def _unindex(self, block_id: int) -> BlockHash:
        """Take a cached block out of the prefix cache (it is then neither cached nor free: the
        caller decides); returns the hash it had."""
        del self._cached[block_id]
        block_hash = self._hash[block_id]
        del self._by_hash[block_hash]  # type: ignore[arg-type]
        self._hash[block_id] = None
        self._run_cached[block_id // self.run_length] -= 1
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

        ``after`` is the block that precedes the new one in the caller's block table:
        its successor is taken when free and in the same run. Otherwise the first block
        of a wholly free run, else of the least recently released idle run (its cached
        blocks evicted), else any free block, else the LRU cached block is evicted.
        """
        nxt = None if after is None else after + 1
        if nxt is not None and nxt % self.run_length and nxt < self.num_blocks and self.is_free(nxt):
            block_id = nxt
            self._take(block_id)
        elif self._free_runs or self._idle_runs:
            run = next(iter(self._free_runs)) if self._free_runs else self._reclaim_idle_run()
            block_id = max(run * self.run_length, 1)
            self._take(block_id)
        elif self._loose:
            block_id = next(iter(self._loose))
            self._take(block_id)
        elif self._cached:
            block_id = next(iter(self._cached))
            self._evict(block_id)
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
            self._run_cached[run] -= 1
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
                self._run_cached[run] += 1
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
