"""Per-sequence block tables on top of the :class:`BlockPool`.

Position ``p`` of a sequence lives in slot ``p % block_size`` of device block
``seq.block_table[p // block_size]``. The manager decides those ids; the model
runner only reads them plus the small lists of block copies this module
returns. Copies must be applied before the forward pass that uses the blocks,
in this order: swap-outs (device -> host), swap-ins (host -> device), then
copy-on-write copies (device -> device). Each list is safe to apply as one
batched gather-then-scatter.

Prefix caching: a block is indexed by its chained content hash only once it is
full *and its KV is computed* (:meth:`BlockManager.mark_computed`), so prompts
and generated tokens alike become reusable, e.g. the next chat turn hits
prompt + the model's earlier answer. A lookup never covers the last token of
a sequence: the model must compute at least one position to produce logits.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from flexpage.core.block_pool import NULL_BLOCK_ID, BlockHash, BlockPool, NoFreeBlocksError, hash_block_tokens
from flexpage.core.sequence import Sequence

__all__ = ["BlockManager", "BlockStats"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


@dataclass(frozen=True, slots=True)
class BlockStats:
    """Snapshot of pool occupancy and prefix-cache effectiveness.

    ``free + cached + used == total - 1`` always (block 0 is the null block).
    """

    total: int  # device blocks including the null block
    free: int  # ref 0, no cached content (never used or evicted)
    cached: int  # ref 0, still findable by hash; evictable
    used: int  # ref > 0
    host_total: int
    host_used: int
    host_free: int
    prefix_cache_queries: int  # tokens looked up at admission
    prefix_cache_hits: int  # tokens served from the cache at admission
    evictions: int  # cached blocks whose content was dropped for reuse

    @property
    def num_free_or_cached(self) -> int:
        """Blocks available to admissions (cached ones are evicted on demand)."""
        return self.free + self.cached

    @property
    def usage(self) -> float:
        """Fraction of usable blocks referenced by live sequences."""
        return self.used / max(1, self.total - 1)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


class BlockManager:
    """Allocates, shares, copies, swaps and frees KV blocks for sequences."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        num_host_blocks: int = 0,
        run_length: int = 1,
    ) -> None:
        """``run_length``: blocks per aligned run, the attention kernel's key block (see BlockPool)."""
        _check_int("num_blocks", num_blocks, 2)
        _check_int("block_size", block_size, 1)
        _check_int("num_host_blocks", num_host_blocks, 0)
        _check_int("run_length", run_length, 1)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.num_host_blocks = num_host_blocks
        self.pool = BlockPool(num_blocks, run_length)
        self._host_free: deque[int] = deque(range(num_host_blocks))
        self._prefix_queries = 0
        self._prefix_hits = 0

    null_block_id = NULL_BLOCK_ID

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_or_cached(self) -> int:
        return self.pool.num_free_or_cached

    def stats(self) -> BlockStats:
        return BlockStats(
            total=self.num_blocks,
            free=self.pool.num_free,
            cached=self.pool.num_cached,
            used=self.pool.num_used,
            host_total=self.num_host_blocks,
            host_used=self.num_host_blocks - len(self._host_free),
            host_free=len(self._host_free),
            prefix_cache_queries=self._prefix_queries,
            prefix_cache_hits=self._prefix_hits,
            evictions=self.pool.num_evictions,
        )

    def reset_prefix_cache(self) -> int:
        """Drop all cached (unreferenced) blocks; returns how many."""
        return self.pool.reset_prefix_cache()

    # -- prefix cache ----------------------------------------------------------
    def _hashes(self, seq: Sequence, num_full_blocks: int) -> list[BlockHash]:
        """``seq.block_hashes`` extended to cover ``num_full_blocks`` blocks."""
        hashes, bs = seq.block_hashes, self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None, seq.token_ids[i * bs : (i + 1) * bs]))
        return hashes

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix, leaving >= 1 token to compute."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for block_hash in self._hashes(seq, max_blocks)[:max_blocks]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def hashes_filled_by(self, seq: Sequence, num_new_tokens: int) -> list[BlockHash]:
        """Hashes of the blocks that computing the next ``num_new_tokens`` positions fills."""
        old_full = seq.num_computed_tokens // self.block_size
        new_full = (seq.num_computed_tokens + num_new_tokens) // self.block_size
        return self._hashes(seq, new_full)[old_full:new_full] if new_full > old_full else []

    def next_uncached_hash(self, seq: Sequence) -> BlockHash | None:
        """Hash of the first prompt block a fresh allocation would have to compute (None: all cached)."""
        if not self.enable_prefix_caching:
            return None
        hits = len(self._cached_prefix(seq))
        if hits >= (seq.num_tokens - 1) // self.block_size:
            return None
        return self._hashes(seq, hits + 1)[hits]

    def num_cached_prefix_tokens(self, seq: Sequence) -> int:
        """Tokens :meth:`allocate` would take from the cache right now (no side effects)."""
        return len(self._cached_prefix(seq)) * self.block_size

    # -- admission ---------------------------------------------------------------
    def _blocks_to_allocate(self, seq: Sequence, hits: list[int]) -> int:
        # Reviving a cached hit consumes an evictable block just like a fresh one.
        revived = sum(1 for b in hits if self.pool.ref_count(b) == 0)
        return seq.num_blocks_needed(self.block_size) - len(hits) + revived

    def can_allocate(self, seq: Sequence, watermark_blocks: int = 0) -> bool:
        """Whether :meth:`allocate` fits while keeping ``watermark_blocks`` spare."""
        need = self._blocks_to_allocate(seq, self._cached_prefix(seq))
        return self.pool.num_free_or_cached - need >= watermark_blocks

    def allocate(self, seq: Sequence) -> None:
        """Give a waiting sequence blocks for all its tokens, reusing cached prefix blocks.

        Sets ``num_computed_tokens`` to the cached prefix length. Also used to
        re-admit a recompute-preempted sequence: its generated tokens are part
        of ``token_ids`` and hit the cache like the prompt does.
        """
        if seq.block_table or seq.host_block_table:
            raise ValueError(f"sequence {seq.seq_id} already holds blocks")
        hits = self._cached_prefix(seq)
        if self._blocks_to_allocate(seq, hits) > self.pool.num_free_or_cached:
            raise NoFreeBlocksError(f"not enough blocks to allocate sequence {seq.seq_id}")
        for block_id in hits:
            self.pool.incref(block_id)
        table = list(hits)
        for _ in range(seq.num_blocks_needed(self.block_size) - len(hits)):
            table.append(self._allocate_after(table))
        seq.block_table = table
        cached = len(hits) * self.block_size
        seq.num_computed_tokens = cached
        if seq.num_output_tokens == 0:  # report prompt tokens only, first admission
            seq.num_cached_tokens = cached
        if self.enable_prefix_caching:
            self._prefix_queries += seq.num_tokens
            self._prefix_hits += cached

    # -- growth and copy-on-write --------------------------------------------------
    def _blocks_to_append(self, seq: Sequence, num_new_tokens: int) -> int:
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if not seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} holds no device blocks (allocate or swap_in first)")
        table, bs = seq.block_table, self.block_size
        needed = _cdiv(seq.num_computed_tokens + num_new_tokens, bs)
        first = seq.num_computed_tokens // bs
        cow = sum(1 for i in range(first, min(needed, len(table))) if self.pool.ref_count(table[i]) > 1)
        return max(0, needed - len(table)) + cow

    def can_append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self._blocks_to_append(seq, num_new_tokens) <= self.pool.num_free_or_cached

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Make positions ``num_computed_tokens .. +num_new_tokens`` writable.

        Adds blocks at the end as needed and un-shares (copy-on-write) any
        block in that range that another sequence also references. Returns the
        ``(src, dst)`` device block copies the runner must perform first.
        """
        if self._blocks_to_append(seq, num_new_tokens) > self.pool.num_free_or_cached:
            raise NoFreeBlocksError(f"not enough blocks to append {num_new_tokens} tokens to {seq.seq_id}")
        table, bs = seq.block_table, self.block_size
        needed = _cdiv(seq.num_computed_tokens + num_new_tokens, bs)
        copies: list[tuple[int, int]] = []
        for i in range(seq.num_computed_tokens // bs, min(needed, len(table))):
            src = table[i]
            if self.pool.ref_count(src) > 1:
                dst = self.pool.allocate(table[i - 1] if i else None)
                self.pool.decref(src)
                table[i] = dst
                copies.append((src, dst))
        while len(table) < needed:
            table.append(self._allocate_after(table))
        return copies

    def _allocate_after(self, table: list[int]) -> int:
        """A new block for the end of ``table``, continuing its last block's run if possible."""
        return self.pool.allocate(table[-1] if table else None)

    def mark_computed(self, seq: Sequence, num_new_tokens: int) -> None:
        """Record that the runner computed the next ``num_new_tokens`` positions.

        Newly *full* blocks are indexed in the prefix cache. A sequence without
        device blocks (finished or aborted mid-step) is ignored.
        """
        if not seq.block_table:
            return
        new_computed = seq.num_computed_tokens + num_new_tokens
        if num_new_tokens < 0 or new_computed > seq.num_tokens:
            raise ValueError(
                f"mark_computed({num_new_tokens}) on sequence {seq.seq_id} would give "
                f"{new_computed} computed tokens of {seq.num_tokens}"
            )
        if _cdiv(new_computed, self.block_size) > len(seq.block_table):
            raise ValueError(f"sequence {seq.seq_id}: positions up to {new_computed} have no slots (append_slots first)")
        old_full = seq.num_computed_tokens // self.block_size
        new_full = new_computed // self.block_size
        seq.num_computed_tokens = new_computed
        if self.enable_prefix_caching and new_full > old_full:
            hashes = self._hashes(seq, new_full)
            for i in range(old_full, new_full):
                self.pool.set_hash(seq.block_table[i], hashes[i])

    # -- sharing and release -----------------------------------------------------------
    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let ``child`` (e.g. from :meth:`Sequence.fork`) share all of ``parent``'s blocks.

        Nothing is copied now; the first write into a shared partial block
        triggers copy-on-write in :meth:`append_slots`.
        """
        if not parent.block_table:
            raise ValueError(f"parent sequence {parent.seq_id} holds no device blocks")
        if child.block_table or child.host_block_table:
            raise ValueError(f"child sequence {child.seq_id} already holds blocks")
        for block_id in parent.block_table:
            self.pool.incref(block_id)
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens

    def free(self, seq: Sequence) -> None:
        """Release every device and host block of ``seq`` at once (idempotent).

        Blocks are released tail first, so a sequence's later blocks are
        evicted before its earlier ones: a cached prefix stays reachable longer.
        """
        for block_id in reversed(seq.block_table):
            self.pool.decref(block_id)
        seq.block_table = []
        self._host_free.extend(seq.host_block_table)
        seq.host_block_table = []
        seq.num_computed_tokens = 0

    # -- host swap tier ------------------------------------------------------------------
    def can_swap_out(self, seq: Sequence) -> bool:
        return bool(seq.block_table) and len(seq.block_table) <= len(self._host_free)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move ``seq``'s KV to host slots; returns ``(device_block, host_block)`` copies.

        ``num_computed_tokens`` is kept: the KV still exists, just on the host.
        """
        if not self.can_swap_out(seq):
            raise NoFreeBlocksError(f"cannot swap out sequence {seq.seq_id}: not enough host blocks")
        pairs = [(block_id, self._host_free.popleft()) for block_id in seq.block_table]
        for block_id in reversed(seq.block_table):
            self.pool.decref(block_id)
        seq.block_table = []
        seq.host_block_table = [host for _, host in pairs]
        return pairs

    def can_swap_in(self, seq: Sequence, watermark_blocks: int = 0) -> bool:
        if not seq.host_block_table:
            return False
        return self.pool.num_free_or_cached - len(seq.host_block_table) >= watermark_blocks

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Bring a swapped sequence back; returns ``(host_block, device_block)`` copies.

        Full computed blocks whose content is still on the device (shared with
        another sequence or still cached) are reused instead of copied.
        """
        if not self.can_swap_in(seq):
            raise NoFreeBlocksError(f"cannot swap in sequence {seq.seq_id}")
        num_full = seq.num_computed_tokens // self.block_size
        hashes = self._hashes(seq, num_full) if self.enable_prefix_caching else []
        table: list[int] = []
        pairs: list[tuple[int, int]] = []
        for i, host in enumerate(seq.host_block_table):
            block_id = self.pool.lookup(hashes[i]) if i < num_full and hashes else None
            if block_id is not None:
                self.pool.incref(block_id)
            else:
                block_id = self._allocate_after(table)
                pairs.append((host, block_id))
                if i < num_full and hashes:
                    self.pool.set_hash(block_id, hashes[i])
            table.append(block_id)
        self._host_free.extend(seq.host_block_table)
        seq.host_block_table = []
        seq.block_table = table
        return pairs
