"""Per-sequence block tables on top of the :class:`BlockPool`.

Position ``p`` of a sequence lives in slot ``p % block_size`` of device block
``block_table(seq)[p // block_size]``. The manager owns those tables (keyed by sequence
id) and decides their ids; the model runner only reads them plus the KV operations this
module decides (:mod:`flexpage.core.kv_ops`). The manager never writes a :class:`Sequence`: progress
(``num_computed_tokens``) belongs to the scheduler, which sets it from what
:meth:`BlockManager.allocate` and :meth:`BlockManager.mark_computed` return.

Every byte movement it decides -- swaps, copy-on-write copies, relocations, tier spills
and restores, rows given back to the OS -- is appended to one list in the order it was
decided, which is an order that is safe to run; :meth:`BlockManager.drain_ops` hands the
list to the step's plan (the scheduler calls it), and the executor runs it before the
forward pass that uses the blocks. Methods that decide copies also return them (tests read
them), but the list is the contract.

Prefix caching: a block is indexed by its chained content hash only once it is
full *and its KV is computed* (:meth:`BlockManager.mark_computed`), so prompts
and generated tokens alike become reusable, e.g. the next chat turn hits
prompt + the model's earlier answer. A lookup never covers the last token of
a sequence: the model must compute at least one position to produce logits.

Layer groups and sliding windows (the rules are in :mod:`flexpage.core.layer_groups`): the
manager keeps one positional table per layer group (``block_tables(seq)``), all drawing from
one :class:`BlockPool`. A sliding group's blocks that fall out of every query's window are
decref'd (free, or prefix-cached when full and hashed) and their entries become the null
block 0. Host tables hold the live blocks only; swap-in restores the leading nulls from
``num_computed_tokens``.

KV budgets (:mod:`flexpage.core.eviction`): a sequence with ``kv_budget`` evicts whole
blocks once all its tokens are computed; the evicted entries become the null block in every
group's table (the kept blocks keep their logical indices, hence their positions). The
policy's scores arrive through :meth:`BlockManager.record_block_scores` for the blocks
:meth:`BlockManager.blocks_to_score` names. An evicting sequence publishes no prefix-cache
hash for blocks it completes after its first eviction (their KV saw a pruned context), and
an evicted block that another sequence shares (prefix cache, fork) only loses this
sequence's reference. Kept pages scattered over many of the kernel's key blocks are copied
into whole runs (``COPY`` ops, run before the next forward pass).

Tiers (:mod:`flexpage.core.kv_tiers`): with a :class:`KVTiers`, a cached block the pool
evicts is spilled to host memory (or disk) instead of lost, and a prefix lookup that misses
the pool but finds the block in a tier restores it into a fresh block (tier ops, in the
same list as the block copies). When a tier
dropped a conversation's *leading* blocks but kept later ones (the retention value drops
the cheapest to recompute first), the hit has a hole: allocation restores the later blocks,
the scheduler computes only the hole (:meth:`BlockManager.computable_tokens`), and
:meth:`BlockManager.mark_computed` then jumps past the restored range. A causal query in the
hole never reads the blocks after it, so the result equals a full recompute. Holes need
every layer group to be full attention (a sliding group's hit depends on its window).

Virtual layout (``virtual_rows``; :mod:`flexpage.core.row_pool`): each sequence's table is
one row of consecutive blocks per layer group, ``num_blocks`` caps the blocks in use, and
nothing is shared: no prefix caching, sliding groups keep their blocks (their row stays
contiguous), and :meth:`BlockManager.fork` copies the parent's blocks into rows the parent
reserved at admission for its ``n - 1`` siblings (``COPY`` ops).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from typing import Final

from flexpage.core.block_pool import NULL_BLOCK_ID, BlockHash, BlockPool, NoFreeBlocksError
from flexpage.core.block_stats import BlockStats
from flexpage.core.eviction import blocks_to_evict, runs_are_scattered
from flexpage.core.kv_ops import BlockOp, BlockOpKind, KVOp
from flexpage.core.kv_tiers import KVTiers
from flexpage.core.layer_groups import blocks_out_of_window, group_key, prefix_hit
from flexpage.core.row_pool import RowPool
from flexpage.core.scheduler_output import ScoreRequest
from flexpage.core.sequence import Sequence

__all__ = ["BlockManager", "BlockStats"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


@dataclass(slots=True)
class _Held:
    """The blocks the manager holds for one sequence, per layer group."""

    device: list[list[int]]  # device block ids; a sliding group's leading released entries are 0
    host: list[list[int]]  # host slot ids while swapped out (live blocks only)
    evicted: set[int] = field(default_factory=set)  # logical blocks given up for the KV budget
    scores: dict[int, float] = field(default_factory=dict)  # eviction policy's score per held block
    scored_upto: int = 0  # every held full block below this index has a score
    #: leading blocks this sequence may publish to the prefix cache; None: all (never evicted)
    hash_limit: int | None = None
    #: (start, end) tokens restored from the cache behind a hole that is computed first: once
    #: num_computed_tokens reaches start it jumps to end (see the module docstring)
    resume: tuple[int, int] | None = None


#: a prefix-plan entry whose block is in a tier: allocation restores it into a fresh block
_TIERED: Final = -1


@dataclass(slots=True)
class _PrefixPlan:
    """What a fresh allocation of a sequence can reuse.

    ``ids[g][i]``: group ``g``'s block for logical block ``i`` -- a pool block to share, the
    null block (out of a sliding window), ``_TIERED`` (restore from a tier) or None (compute:
    the hole ``computed .. resume_start``). Blocks ``0 .. computed`` and
    ``resume_start .. len(ids[0])`` are reused.
    """

    ids: list[list[int | None]]
    computed: int
    resume_start: int

    @property
    def reused_blocks(self) -> int:
        return self.computed + len(self.ids[0]) - self.resume_start


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
        group_windows: SequenceABC[int | None] = (None,),
        tiers: KVTiers | None = None,
        virtual_rows: int = 0,
    ) -> None:
        """``run_length``: blocks per aligned run, the attention kernel's key block (see BlockPool).

        ``group_windows``: one entry per layer group (see :mod:`flexpage.core.layer_groups`),
        None for full attention or the sliding window ``W`` of the group's layers.

        ``tiers``: where evicted prefix-cache blocks go (see :mod:`flexpage.core.kv_tiers`);
        needs prefix caching.

        ``virtual_rows``: the virtual layout's rows (0: paged); each is ``run_length`` blocks
        and ``num_blocks - 1`` blocks may be in use at once (see the module docstring).
        """
        group_windows = tuple(group_windows)
        if not group_windows or len(group_windows) > 0xFFFF:
            raise ValueError(f"group_windows must have 1..65535 entries, got {len(group_windows)}")
        for w in group_windows:
            if w is not None:
                _check_int("group_windows entry", w, 1)
        _check_int("num_blocks", num_blocks, 2)
        _check_int("block_size", block_size, 1)
        _check_int("num_host_blocks", num_host_blocks, 0)
        _check_int("run_length", run_length, 1)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.num_host_blocks = num_host_blocks
        _check_int("virtual_rows", virtual_rows, 0)
        if virtual_rows and self.enable_prefix_caching:
            raise ValueError("enable_prefix_caching: the virtual KV layout shares no blocks; set it False")
        #: the virtual layout: each sequence's table is rows of consecutive blocks (see RowPool)
        self.contiguous = bool(virtual_rows)
        self.pool = RowPool(virtual_rows, run_length, num_blocks - 1) if virtual_rows else BlockPool(num_blocks, run_length)
        self._reserved: dict[int, list[list[list[int]]]] = {}  # by seq_id: rows for forks (virtual)
        self._host_free: deque[int] = deque(range(num_host_blocks))
        self._prefix_queries = 0
        self._prefix_hits = 0
        self.group_windows = group_windows
        self.num_released_blocks = 0
        self.num_evicted_blocks = 0  # table entries given up for KV budgets
        #: the KV operations decided since the last :meth:`drain_ops`, in the order they must run
        self._ops: list[KVOp] = []
        self._held: dict[int, _Held] = {}  # by seq_id; dropped by free()
        self.tiers = tiers if tiers is not None and tiers.enabled and self.enable_prefix_caching else None
        if self.tiers is not None:
            self.tiers.in_pool = lambda key: self.pool.lookup(key) is not None
            self.tiers.ops = self._ops  # one list: a spilled block may be a later copy's destination
        #: of each hashed pool block: its logical block index, when a sequence last released it and
        #: the conversation that computed it (None: no conversation)
        self._block_info: dict[BlockHash, tuple[int, float, str | None]] = {}
        self.num_hole_tokens = 0  # tokens recomputed in front of blocks restored behind a hole
        if self.tiers is not None:
            self.pool.on_evict = self._spill

    null_block_id = NULL_BLOCK_ID

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    def _released(self, group: int, num_computed_tokens: int) -> int:
        if self.contiguous:  # a row stays whole (attention never reads past a window anyway)
            return 0
        return blocks_out_of_window(self.group_windows[group], self.block_size, num_computed_tokens)

    def _empty(self) -> list[list[int]]:
        return [[] for _ in self.group_windows]

    def _of(self, seq: Sequence) -> _Held:
        held = self._held.get(seq.seq_id)
        if held is None:
            held = self._held[seq.seq_id] = _Held(self._empty(), self._empty())
        return held

    # -- what a sequence holds (read-only views for the scheduler and the runner) ------------
    def block_tables(self, seq: Sequence) -> list[list[int]]:
        """``seq``'s device block ids per layer group (do not modify)."""
        held = self._held.get(seq.seq_id)
        return held.device if held is not None else self._empty()

    def block_table(self, seq: Sequence) -> list[int]:
        """Group 0's device table: the only one for a model with a single kind of layer."""
        return self.block_tables(seq)[0]

    def host_block_tables(self, seq: Sequence) -> list[list[int]]:
        """``seq``'s host slot ids per layer group while it is swapped out (do not modify)."""
        held = self._held.get(seq.seq_id)
        return held.host if held is not None else self._empty()

    def holds_blocks(self, seq: Sequence) -> bool:
        """Whether ``seq`` holds any device block or host slot."""
        held = self._held.get(seq.seq_id)
        return held is not None and (any(held.device) or any(held.host))

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
            released_window_blocks=self.num_released_blocks,
            evicted_budget_blocks=self.num_evicted_blocks,
        )

    def reset_prefix_cache(self) -> int:
        """Drop all cached (unreferenced) blocks and every tier's entries; returns how many
        pool blocks."""
        dropped = self.pool.reset_prefix_cache()
        self._block_info = {key: v for key, v in self._block_info.items() if self.pool.lookup(key) is not None}
        if self.tiers is not None:
            self.tiers.clear()
        return dropped

    # -- tiers ----------------------------------------------------------------------------------
    def _publish(self, block_id: int, key: BlockHash, index: int, owner: str | None) -> None:
        """Index a computed block in the prefix cache (remembering, for the tiers, its position
        and owner)."""
        if self.pool.set_hash(block_id, key) and self.tiers is not None:
            self._block_info[key] = (index, self.tiers.clock(), owner)

    def _spill(self, block_id: int, key: BlockHash) -> None:
        position, last_used, owner = self._block_info.pop(key, (0, 0.0, None))
        self.tiers.spill(key, block_id, position, last_used, owner)  # type: ignore[union-attr]

    def cached_block_owner(self, block_id: int) -> str | None:
        """The conversation that computed a hashed pool block (None: unknown or none)."""
        key = self.pool.block_hash(block_id)
        info = self._block_info.get(key) if key is not None else None
        return info[2] if info is not None else None

    def drain_ops(self) -> list[KVOp]:
        """The KV operations decided since the last call, in the order they must run, ending
        with the virtual layout's rows freed since then and still free (nothing in the list
        touches them after their release: a row taken again is not released)."""
        ops = list(self._ops)
        self._ops.clear()  # the tiers append to this same list
        if isinstance(self.pool, RowPool):
            ops += [BlockOp(BlockOpKind.RELEASE, start, end) for start, end in self.pool.drain_released_rows()]
        return ops

    def _log(self, kind: BlockOpKind, pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
        self._ops.extend(BlockOp(kind, src, dst) for src, dst in pairs)
        return pairs

    # -- prefix cache ----------------------------------------------------------
    def _hashes(self, seq: Sequence, num_full_blocks: int) -> list[BlockHash]:
        """The chained hashes of ``seq``'s first ``num_full_blocks`` blocks (or more)."""
        return seq.block_hashes(self.block_size, num_full_blocks)

    def _lookup(self, group: int, block_hash: BlockHash) -> int | None:
        key = group_key(group, block_hash)
        block_id = self.pool.lookup(key)
        if block_id is None and self.tiers is not None and key in self.tiers:
            return _TIERED
        return block_id

    def _cached_prefix(self, seq: Sequence) -> _PrefixPlan:
        """What allocating ``seq`` now would reuse: the longest prefix cached (pool or tiers) in
        every group, and with tiers, a later run of cached blocks behind a hole (>= 1 token left)."""
        if not self.enable_prefix_caching:
            return _PrefixPlan(self._empty(), 0, 0)
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hashes = self._hashes(seq, max_blocks)[:max_blocks]
        ids: list[list[int | None]] = prefix_hit(hashes, self._lookup, self.group_windows, self.block_size)  # type: ignore[assignment]
        computed = len(ids[0])
        if self.tiers is None or any(w is not None for w in self.group_windows):
            return _PrefixPlan(ids, computed, computed)
        groups = range(self.num_groups)
        start = next((i for i in range(computed, max_blocks)
                      if all(self._lookup(g, hashes[i]) is not None for g in groups)), max_blocks)
        end = start
        while end < max_blocks and all(self._lookup(g, hashes[end]) is not None for g in groups):
            end += 1
        if end == start:  # nothing cached behind the first miss
            return _PrefixPlan(ids, computed, computed)
        for g in groups:
            ids[g] += [None] * (start - computed) + [self._lookup(g, hashes[i]) for i in range(start, end)]
        return _PrefixPlan(ids, computed, start)

    def hashes_filled_by(self, seq: Sequence, num_new_tokens: int) -> list[BlockHash]:
        """Hashes of the blocks that computing the next ``num_new_tokens`` positions fills."""
        old_full = seq.num_computed_tokens // self.block_size
        new_full = (seq.num_computed_tokens + num_new_tokens) // self.block_size
        return self._hashes(seq, new_full)[old_full:new_full] if new_full > old_full else []

    def next_uncached_hash(self, seq: Sequence) -> BlockHash | None:
        """Hash of the first prompt block a fresh allocation would have to compute (None: all cached)."""
        if not self.enable_prefix_caching:
            return None
        hits = self._cached_prefix(seq).computed
        if hits >= (seq.num_tokens - 1) // self.block_size:
            return None
        return self._hashes(seq, hits + 1)[hits]

    def num_cached_prefix_tokens(self, seq: Sequence) -> int:
        """Tokens :meth:`allocate` would take from the cache right now (no side effects)."""
        return self._cached_prefix(seq).reused_blocks * self.block_size

    # -- admission ---------------------------------------------------------------
    def _blocks_to_allocate(self, seq: Sequence, plan: _PrefixPlan) -> int:
        # Reviving a cached hit consumes an evictable block just like a fresh one; the null
        # entries of a sliding group's hit (already out of its window) need no block at all.
        need = seq.num_blocks_needed(self.block_size)
        total = 0
        for group_hits in plan.ids:
            fresh = sum(1 for b in group_hits if b is None or b == _TIERED
                        or (b != NULL_BLOCK_ID and self.pool.ref_count(b) == 0))
            total += need - len(group_hits) + fresh
        return total

    def blocks_for_admission(self, seq: Sequence) -> int:
        """Blocks a fresh allocation of ``seq`` takes with an empty prefix cache (all groups;
        in the virtual layout also the copies for its forks)."""
        return seq.num_blocks_needed(self.block_size) * self.num_groups * self._copies(seq)

    def _copies(self, seq: Sequence) -> int:
        """How many copies of its blocks a fresh allocation of ``seq`` holds: one, or in the
        virtual layout one per parallel sample still to fork (it shares nothing)."""
        return 1 + seq.samples_to_fork if self.contiguous else 1

    def can_allocate(self, seq: Sequence, watermark_blocks: int = 0) -> bool:
        """Whether :meth:`allocate` fits while keeping ``watermark_blocks`` spare."""
        return self._fits(seq, self._cached_prefix(seq), watermark_blocks)

    def _fits(self, seq: Sequence, plan: _PrefixPlan, watermark_blocks: int = 0) -> bool:
        copies = self._copies(seq)
        if self.contiguous and self.pool.num_free_runs < self.num_groups * copies:
            return False
        return self.pool.num_free_or_cached - self._blocks_to_allocate(seq, plan) * copies >= watermark_blocks

    def allocate(self, seq: Sequence) -> int:
        """Give a waiting sequence blocks for all its tokens, reusing cached prefix blocks.

        Returns the number of leading tokens whose KV came from the cache: the sequence's
        ``num_computed_tokens`` from now on. Also used to re-admit a recompute-preempted
        sequence: its generated tokens are part of ``token_ids`` and hit the cache like the
        prompt does.
        """
        if self.holds_blocks(seq):
            raise ValueError(f"sequence {seq.seq_id} already holds blocks")
        plan = self._cached_prefix(seq)
        if not self._fits(seq, plan):
            raise NoFreeBlocksError(f"not enough blocks to allocate sequence {seq.seq_id}")
        # every group's hits first: a fresh block may evict a cached block, which must not
        # be a hit another group is about to revive (it would then sit in two groups' tables)
        for group_hits in plan.ids:
            for block_id in group_hits:
                if block_id is not None and block_id not in (NULL_BLOCK_ID, _TIERED):
                    self.pool.incref(block_id)
        hashes = self._hashes(seq, len(plan.ids[0]))
        tiered = {group_key(g, hashes[i]) for g, group_hits in enumerate(plan.ids)
                  for i, b in enumerate(group_hits) if b == _TIERED}
        if self.tiers is not None:  # fresh blocks may spill others: never drop what is restored here
            self.tiers.pinned = tiered
        tables = []
        for g, group_hits in enumerate(plan.ids):
            table: list[int] = []
            for i in range(seq.num_blocks_needed(self.block_size)):
                entry = group_hits[i] if i < len(group_hits) else None
                if entry is not None and entry != _TIERED:
                    table.append(entry)
                    continue
                table.append(self._allocate_after(table))
                if entry == _TIERED:
                    owner = self.tiers.restore(group_key(g, hashes[i]), table[-1])  # type: ignore[union-attr]
                    self._publish(table[-1], group_key(g, hashes[i]), i, owner)
            tables.append(table)
        if self.tiers is not None:
            self.tiers.pinned = set()
        held = self._of(seq)
        held.device = tables
        if self._copies(seq) > 1:
            self._reserved[seq.seq_id] = [[self._fresh_row(len(table)) for table in tables]
                                          for _ in range(seq.samples_to_fork)]
        bs = self.block_size
        if plan.resume_start > plan.computed:
            held.resume = (plan.resume_start * bs, len(plan.ids[0]) * bs)
            self.num_hole_tokens += (plan.resume_start - plan.computed) * bs
        if self.enable_prefix_caching:
            self._prefix_queries += seq.num_tokens
            self._prefix_hits += plan.reused_blocks * bs
        return plan.computed * bs

    def computable_tokens(self, seq: Sequence) -> int:
        """Positions the runner may compute next in one go: all uncomputed ones, or up to a
        hole's end when blocks restored behind it wait (see the module docstring)."""
        held = self._held.get(seq.seq_id)
        if held is not None and held.resume is not None:
            return held.resume[0] - seq.num_computed_tokens
        return seq.num_uncomputed_tokens

    def reused_tokens(self, seq: Sequence) -> int:
        """Of a just-allocated sequence, the tokens whose KV came from the cache: its
        ``num_computed_tokens`` plus any restored behind a hole."""
        held = self._held.get(seq.seq_id)
        resume = held.resume if held is not None else None
        return seq.num_computed_tokens + (resume[1] - resume[0] if resume is not None else 0)

    # -- growth and copy-on-write --------------------------------------------------
    def _blocks_to_append(self, seq: Sequence, num_new_tokens: int) -> int:
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        tables = self.block_tables(seq)
        if not tables[0]:
            raise ValueError(f"sequence {seq.seq_id} holds no device blocks (allocate or swap_in first)")
        bs = self.block_size
        needed = _cdiv(seq.num_computed_tokens + num_new_tokens, bs)
        first = seq.num_computed_tokens // bs  # >= every sliding group's released prefix
        total = 0
        for table in tables:
            cow = sum(1 for i in range(first, min(needed, len(table))) if self.pool.ref_count(table[i]) > 1)
            total += max(0, needed - len(table)) + cow
        return total

    def can_append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self._blocks_to_append(seq, num_new_tokens) <= self.pool.num_free_or_cached

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Make positions ``num_computed_tokens .. +num_new_tokens`` writable.

        Adds blocks at the end as needed and un-shares (copy-on-write) any
        block in that range that another sequence also references. Returns the
        ``(src, dst)`` device block copies (logged as ``COPY`` ops).
        """
        if self._blocks_to_append(seq, num_new_tokens) > self.pool.num_free_or_cached:
            raise NoFreeBlocksError(f"not enough blocks to append {num_new_tokens} tokens to {seq.seq_id}")
        bs = self.block_size
        needed = _cdiv(seq.num_computed_tokens + num_new_tokens, bs)
        copies: list[tuple[int, int]] = []
        for table in self._of(seq).device:
            for i in range(seq.num_computed_tokens // bs, min(needed, len(table))):
                src = table[i]
                if self.pool.ref_count(src) > 1:
                    dst = self._allocate_after(table[:i])
                    self.pool.decref(src)
                    table[i] = dst
                    copies.append((src, dst))
            while len(table) < needed:
                table.append(self._allocate_after(table))
        return self._log(BlockOpKind.COPY, copies)

    def _fresh_row(self, num_blocks: int) -> list[int]:
        table: list[int] = []
        for _ in range(num_blocks):
            table.append(self._allocate_after(table))
        return table

    def _allocate_after(self, table: list[int]) -> int:
        """A new block for the end of ``table``, continuing its last block's run if possible."""
        last = table[-1] if table else NULL_BLOCK_ID
        return self.pool.allocate(last if last != NULL_BLOCK_ID else None)

    def _release_out_of_window(self, tables: list[list[int]], num_computed_tokens: int,
                               evicted: set[int]) -> None:
        """Give back the leading blocks of sliding groups that no query can see any more."""
        for g, table in enumerate(tables):
            i = min(self._released(g, num_computed_tokens), len(table)) - 1
            # released entries form a leading run, with the budget's evicted holes inside it
            while i >= 0 and (table[i] != NULL_BLOCK_ID or i in evicted):
                if table[i] != NULL_BLOCK_ID:
                    self.pool.decref(table[i])
                    table[i] = NULL_BLOCK_ID
                    self.num_released_blocks += 1
                i -= 1

    # -- KV budgets ------------------------------------------------------------------
    def blocks_to_score(self, seq: Sequence, num_new_tokens: int) -> list[int]:
        """Logical blocks of a sequence with a KV budget that are full once the next
        ``num_new_tokens`` positions are computed and still lack a policy score."""
        held = self._held.get(seq.seq_id)
        if seq.kv_budget is None or held is None or not held.device[0]:
            return []
        new_full = min((seq.num_computed_tokens + num_new_tokens) // self.block_size, len(held.device[0]))
        return [i for i in range(held.scored_upto, new_full)
                if i not in held.evicted and any(table[i] != NULL_BLOCK_ID for table in held.device)]

    def score_requests(self, seq: Sequence, num_new_tokens: int) -> list[ScoreRequest]:
        """What the executor must score for :meth:`blocks_to_score`: one request of every block
        over the layer groups holding them all, or, where a sliding group gave some back, one
        request per block over the groups that still hold it."""
        blocks = self.blocks_to_score(seq, num_new_tokens)
        if not blocks:
            return []
        tables, bs = self.block_tables(seq), self.block_size
        holding = [table for table in tables if all(table[i] != NULL_BLOCK_ID for i in blocks)]
        if holding:
            return [ScoreRequest(seq.seq_id, blocks, [[table[i] for i in blocks] for table in holding],
                                 [i * bs for i in blocks])]
        return [ScoreRequest(seq.seq_id, [i], [[table[i]] for table in tables if table[i] != NULL_BLOCK_ID], [i * bs])
                for i in blocks]

    def record_block_scores(self, seq: Sequence, scores: dict[int, float]) -> None:
        """Store the eviction policy's scores for blocks :meth:`blocks_to_score` named."""
        held = self._of(seq)
        held.scores.update(scores)
        if scores:
            held.scored_upto = max(held.scored_upto, max(scores) + 1)

    def evicted_blocks(self, seq: Sequence) -> list[int]:
        """Logical blocks ``seq`` gave up to stay within its KV budget, ascending."""
        held = self._held.get(seq.seq_id)
        return sorted(held.evicted) if held is not None else []

    def _evict_over_budget(self, seq: Sequence, held: _Held, num_computed: int) -> None:
        width = len(held.device[0])
        live = [i for i in range(width) if any(table[i] != NULL_BLOCK_ID for table in held.device)]
        budget_blocks = seq.kv_budget // self.block_size  # type: ignore[operator]
        victims = blocks_to_evict(live, held.scores, budget_blocks, num_computed % self.block_size == 0)
        if not victims:
            return
        if held.hash_limit is None:
            held.hash_limit = num_computed // self.block_size
        for i in victims:
            for table in held.device:
                if table[i] != NULL_BLOCK_ID:
                    self.pool.decref(table[i])
                    table[i] = NULL_BLOCK_ID
                    self.num_evicted_blocks += 1
            held.evicted.add(i)
            held.scores.pop(i, None)
        for table in held.device:
            self._pack_runs(table)

    def _pack_runs(self, table: list[int]) -> None:
        """Copy a table's unshared pages into whole runs when they are scattered over many more
        of the kernel's key blocks than they fill (only if free blocks allow it)."""
        held_pages = [b for b in table if b != NULL_BLOCK_ID]
        if not runs_are_scattered(held_pages, self.pool.run_length):
            return
        movable = [i for i, b in enumerate(table) if b != NULL_BLOCK_ID and self.pool.ref_count(b) == 1]
        if len(movable) > self.pool.num_free:  # packing is for speed: never evict cached blocks for it
            return
        sources, last = [], None
        for i in movable:  # every destination first: none of them can be a source
            last = self.pool.allocate(last)
            sources.append(table[i])
            self._log(BlockOpKind.COPY, [(table[i], last)])
            table[i] = last
        for block_id in sources:
            self.pool.decref(block_id)

    def mark_computed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Record that the runner computed positions ``num_computed_tokens .. +num_new_tokens``.

        Newly *full* blocks are indexed in the prefix cache, and sliding groups give back
        what no later query sees. Returns the sequence's new ``num_computed_tokens`` (the
        caller stores it). A sequence without device blocks (finished or aborted mid-step)
        is left as it is.
        """
        tables = self.block_tables(seq)
        if not tables[0]:
            return seq.num_computed_tokens
        new_computed = seq.num_computed_tokens + num_new_tokens
        if num_new_tokens < 0 or new_computed > seq.num_tokens:
            raise ValueError(
                f"mark_computed({num_new_tokens}) on sequence {seq.seq_id} would give "
                f"{new_computed} computed tokens of {seq.num_tokens}"
            )
        if _cdiv(new_computed, self.block_size) > len(tables[0]):
            raise ValueError(f"sequence {seq.seq_id}: positions up to {new_computed} have no slots (append_slots first)")
        held = self._of(seq)
        old_full = seq.num_computed_tokens // self.block_size
        new_full = new_computed // self.block_size
        if held.hash_limit is not None:  # blocks completed after an eviction saw a pruned context
            new_full = min(new_full, held.hash_limit)
        if self.enable_prefix_caching and new_full > old_full:
            hashes = self._hashes(seq, new_full)
            for g, table in enumerate(tables):
                for i in range(old_full, new_full):  # never released yet: those lie below old_full
                    self._publish(table[i], group_key(g, hashes[i]), i, seq.conversation)
        if held.resume is not None and new_computed == held.resume[0]:  # the hole is computed
            new_computed, held.resume = held.resume[1], None
        self._release_out_of_window(tables, new_computed, held.evicted)  # hashed first: released full blocks stay cached
        if seq.kv_budget is not None and new_computed == seq.num_tokens:  # prompt done: only decodes from here
            self._evict_over_budget(seq, held, new_computed)
        return new_computed

    # -- sharing and release -----------------------------------------------------------
    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let ``child`` (e.g. from :meth:`Sequence.fork`: same tokens and progress) share all
        of ``parent``'s blocks.

        Nothing is copied now; the first write into a shared partial block
        triggers copy-on-write in :meth:`append_slots`. In the virtual layout the child gets
        rows the parent reserved at admission, and the parent's blocks are copied into them
        (``COPY`` ops).
        """
        tables = self.block_tables(parent)
        if not tables[0]:
            raise ValueError(f"parent sequence {parent.seq_id} holds no device blocks")
        if self.holds_blocks(child):
            raise ValueError(f"child sequence {child.seq_id} already holds blocks")
        if self.contiguous:
            self._fork_by_copy(parent, child, tables)
            return
        for table in tables:
            for block_id in table:
                if block_id != NULL_BLOCK_ID:
                    self.pool.incref(block_id)
        parent_held = self._held[parent.seq_id]
        self._held[child.seq_id] = _Held([list(table) for table in tables], self._empty(), set(parent_held.evicted),
                                         dict(parent_held.scores), parent_held.scored_upto, parent_held.hash_limit,
                                         parent_held.resume)

    def _fork_by_copy(self, parent: Sequence, child: Sequence, tables: list[list[int]]) -> None:
        reserved = self._reserved.get(parent.seq_id)
        if not reserved:
            raise ValueError(f"parent sequence {parent.seq_id} reserved no rows for forks (virtual layout: "
                             "admit it with samples_to_fork set)")
        rows = reserved.pop()
        if not reserved:
            del self._reserved[parent.seq_id]
        for table, row in zip(tables, rows):
            while len(row) < len(table):  # the parent grew since admission
                row.append(self._allocate_after(row))
            self._log(BlockOpKind.COPY, list(zip(table, row)))
        self._held[child.seq_id] = _Held(rows, self._empty())

    def free(self, seq: Sequence) -> None:
        """Release every device and host block of ``seq`` at once (idempotent); the
        sequence's KV is gone, so its ``num_computed_tokens`` no longer holds.

        Blocks are released tail first, so a sequence's later blocks are
        evicted before its earlier ones: a cached prefix stays reachable longer.
        """
        for rows in self._reserved.pop(seq.seq_id, []):
            for row in rows:
                for block_id in reversed(row):
                    self.pool.decref(block_id)
        held = self._held.pop(seq.seq_id, None)
        if held is None:
            return
        if self.tiers is not None:  # the retention value counts idle time from here
            now = self.tiers.clock()
            for table in held.device:
                for block_id in table:
                    key = self.pool.block_hash(block_id)
                    if key is not None and key in self._block_info:
                        position, _, owner = self._block_info[key]
                        self._block_info[key] = (position, now, owner)
        for table in held.device:
            for block_id in reversed(table):
                if block_id != NULL_BLOCK_ID:
                    self.pool.decref(block_id)
        for host_table in held.host:
            self._host_free.extend(host_table)

    # -- host swap tier ------------------------------------------------------------------
    @staticmethod
    def _num_live(tables: list[list[int]]) -> int:
        return sum(1 for table in tables for b in table if b != NULL_BLOCK_ID)

    def can_swap_out(self, seq: Sequence) -> bool:
        tables = self.block_tables(seq)
        return bool(tables[0]) and self._num_live(tables) <= len(self._host_free)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move ``seq``'s KV to host slots; returns ``(device_block, host_block)`` copies.

        ``num_computed_tokens`` is kept: the KV still exists, just on the host. Released
        (null) entries of sliding groups are not copied: host tables hold live blocks only.
        """
        if not self.can_swap_out(seq):
            raise NoFreeBlocksError(f"cannot swap out sequence {seq.seq_id}: not enough host blocks")
        held = self._of(seq)
        pairs: list[tuple[int, int]] = []
        host_tables = []
        for table in held.device:
            host_table = []
            for block_id in table:
                if block_id != NULL_BLOCK_ID:
                    host_table.append(self._host_free.popleft())
                    pairs.append((block_id, host_table[-1]))
            host_tables.append(host_table)
        for table in held.device:
            for block_id in reversed(table):
                if block_id != NULL_BLOCK_ID:
                    self.pool.decref(block_id)
        held.device, held.host = self._empty(), host_tables
        return self._log(BlockOpKind.SWAP_OUT, pairs)

    def can_swap_in(self, seq: Sequence, watermark_blocks: int = 0) -> bool:
        host_tables = self.host_block_tables(seq)
        if not host_tables[0]:
            return False
        # host tables hold live blocks only (and host slot 0 is an ordinary slot)
        if self.contiguous and self.pool.num_free_runs < self.num_groups:
            return False
        return self.pool.num_free_or_cached - sum(map(len, host_tables)) >= watermark_blocks

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Bring a swapped sequence back; returns ``(host_block, device_block)`` copies.

        Full computed blocks whose content is still on the device (shared with
        another sequence or still cached) are reused instead of copied.
        """
        if not self.can_swap_in(seq):
            raise NoFreeBlocksError(f"cannot swap in sequence {seq.seq_id}")
        held = self._of(seq)
        num_full = seq.num_computed_tokens // self.block_size
        if held.hash_limit is not None:  # later blocks were never published: their KV is this sequence's own
            num_full = min(num_full, held.hash_limit)
        hashes = self._hashes(seq, num_full) if self.enable_prefix_caching else []
        tables: list[list[int]] = []
        pairs: list[tuple[int, int]] = []
        for g, host_table in enumerate(held.host):
            table = [NULL_BLOCK_ID] * self._released(g, seq.num_computed_tokens)
            for host in host_table:
                while len(table) in held.evicted:
                    table.append(NULL_BLOCK_ID)
                i = len(table)
                block_id = self.pool.lookup(group_key(g, hashes[i])) if i < num_full and hashes else None
                if block_id is not None:
                    self.pool.incref(block_id)
                else:
                    block_id = self._allocate_after(table)
                    pairs.append((host, block_id))
                    if i < num_full and hashes:
                        self._publish(block_id, group_key(g, hashes[i]), i, seq.conversation)
                table.append(block_id)
            tables.append(table)
            self._host_free.extend(host_table)
        held.host, held.device = self._empty(), tables
        return self._log(BlockOpKind.SWAP_IN, pairs)
