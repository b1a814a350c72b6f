"""Per-sequence block tables on top of the :class:`BlockPool`: a coordinator over small managers.

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

The shape is vLLM v1's KV cache coordinator. :class:`BlockManager` composes:

* one manager per layer group (:mod:`flexpage.core.group_managers`: full attention, or a
  sliding window that gives leading blocks back; rules in :mod:`flexpage.core.layer_groups`),
  all drawing from one pool and always called in group order;
* prefix caching (here): a block is indexed by its chained content hash only once it is
  full *and its KV is computed* (:meth:`BlockManager.mark_computed`), so prompts and
  generated tokens alike become reusable; what an allocation reuses is a
  :class:`~flexpage.core.prefix_plan.PrefixPlan` (a hit needs every group);
* policies, each in its own module: KV budgets (:mod:`flexpage.core.budget_policy`: evict
  whole blocks across all groups, pack runs), tiers and holes
  (:mod:`flexpage.core.tier_policy`), host swap space (:mod:`flexpage.core.swap_space`) and
  the virtual layout's rows reserved for forks (:mod:`flexpage.core.fork_rows`).

Virtual layout (``virtual_rows``; :mod:`flexpage.core.row_pool`): one row of consecutive
blocks per group and sequence, ``num_blocks`` caps the blocks in use, nothing is shared (no
prefix caching; sliding groups keep their blocks, so every group gets full attention's
manager) and forks copy into rows reserved at admission (:mod:`flexpage.core.fork_rows`).
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC

from flexpage.core.block_pool import NULL_BLOCK_ID, BlockHash, BlockPool, NoFreeBlocksError
from flexpage.core.block_stats import BlockStats
from flexpage.core.budget_policy import KVBudgetPolicy
from flexpage.core.fork_rows import ForkRows
from flexpage.core.group_managers import TIERED, GroupManager, make_group_manager
from flexpage.core.kv_ops import BlockOp, BlockOpKind, KVOp
from flexpage.core.kv_tiers import KVTiers
from flexpage.core.prefix_plan import PrefixPlan, plan_prefix
from flexpage.core.row_pool import RowPool
from flexpage.core.scheduler_output import ScoreRequest
from flexpage.core.sequence import Sequence
from flexpage.core.swap_space import HostSwapSpace
from flexpage.core.tier_policy import Holes, TierPolicy

__all__ = ["BlockManager", "BlockStats"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


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
        None for full attention or the sliding window ``W`` of the group's layers. ``tiers``:
        where evicted prefix-cache blocks go (:mod:`flexpage.core.kv_tiers`; needs prefix
        caching). ``virtual_rows``: the virtual layout's rows (0: paged); each is ``run_length``
        blocks and ``num_blocks - 1`` blocks may be in use at once (see the module docstring).
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
        _check_int("virtual_rows", virtual_rows, 0)
        if virtual_rows and self.enable_prefix_caching:
            raise ValueError("enable_prefix_caching: the virtual KV layout shares no blocks; set it False")
        #: the virtual layout: each sequence's table is rows of consecutive blocks (see RowPool)
        self.contiguous = bool(virtual_rows)
        self.pool = RowPool(virtual_rows, run_length, num_blocks - 1) if virtual_rows else BlockPool(num_blocks, run_length)
        self.group_windows = group_windows
        #: the KV operations decided since the last :meth:`drain_ops`, in the order they must run
        self._ops: list[KVOp] = []
        self.managers: list[GroupManager] = [make_group_manager(self.pool, block_size, g, w, self.contiguous)
                                             for g, w in enumerate(group_windows)]
        self.swap_space = HostSwapSpace(num_host_blocks)
        self.budget = KVBudgetPolicy(self.pool, block_size, self._log)
        self.holes = Holes()
        self.fork_rows = ForkRows(self.pool) if self.contiguous else None
        enabled = tiers is not None and tiers.enabled and self.enable_prefix_caching
        self.tier_policy = TierPolicy(tiers, self.pool, self._ops) if enabled else None  # type: ignore[arg-type]
        self.tiers = tiers if enabled else None
        self._prefix_queries = 0
        self._prefix_hits = 0

    null_block_id = NULL_BLOCK_ID

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def num_host_blocks(self) -> int:
        return self.swap_space.num_host_blocks

    @property
    def num_released_blocks(self) -> int:  # given back early by sliding groups
        return sum(m.num_released_blocks for m in self.managers)

    @property
    def num_evicted_blocks(self) -> int:  # table entries given up for KV budgets
        return self.budget.num_evicted_blocks

    @property
    def num_hole_tokens(self) -> int:  # recomputed in front of blocks restored behind a hole
        return self.holes.num_hole_tokens

    def _empty(self) -> list[list[int]]:
        return [[] for _ in self.group_windows]

    # -- what a sequence holds (read-only views for the scheduler and the runner) ------------
    def block_tables(self, seq: Sequence) -> list[list[int]]:
        """``seq``'s device block ids per layer group (do not modify)."""
        return [m.table(seq.seq_id) for m in self.managers]

    def block_table(self, seq: Sequence) -> list[int]:
        """Group 0's device table: the only one for a model with a single kind of layer."""
        return self.managers[0].table(seq.seq_id)

    def host_block_tables(self, seq: Sequence) -> list[list[int]]:
        """``seq``'s host slot ids per layer group while it is swapped out (do not modify)."""
        return self.swap_space.tables(seq.seq_id) or self._empty()

    def holds_blocks(self, seq: Sequence) -> bool:
        """Whether ``seq`` holds any device block or host slot."""
        return any(self.block_tables(seq)) or self.swap_space.holds(seq.seq_id)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_or_cached(self) -> int:
        return self.pool.num_free_or_cached

    def stats(self) -> BlockStats:
        pool, host = self.pool, self.swap_space
        return BlockStats(total=self.num_blocks, free=pool.num_free, cached=pool.num_cached, used=pool.num_used,
                          host_total=host.num_host_blocks, host_used=host.num_used, host_free=host.num_free,
                          prefix_cache_queries=self._prefix_queries, prefix_cache_hits=self._prefix_hits,
                          evictions=pool.num_evictions, released_window_blocks=self.num_released_blocks,
                          evicted_budget_blocks=self.num_evicted_blocks)

    def reset_prefix_cache(self) -> int:
        """Drop all cached (unreferenced) blocks and every tier's entries; returns how many
        pool blocks."""
        dropped = self.pool.reset_prefix_cache()
        if self.tier_policy is not None:
            self.tier_policy.reset()
        return dropped

    def cached_block_owner(self, block_id: int) -> str | None:
        """The conversation that computed a hashed pool block (None: unknown or none)."""
        return self.tier_policy.owner(block_id) if self.tier_policy is not None else None

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

    def _publish(self, block_id: int, key: BlockHash, index: int, owner: str | None) -> None:
        """Index a computed block in the prefix cache (the tiers remember its position and owner)."""
        if self.pool.set_hash(block_id, key) and self.tier_policy is not None:
            self.tier_policy.published(key, index, owner)

    def _lookup(self, group: int, block_hash: BlockHash) -> int | None:
        key = self.managers[group].key(block_hash)
        block_id = self.pool.lookup(key)
        if block_id is None and self.tier_policy is not None and self.tier_policy.holds(key):
            return TIERED
        return block_id

    def _cached_prefix(self, seq: Sequence) -> PrefixPlan:
        """What allocating ``seq`` now would reuse: the longest prefix cached (pool or tiers) in
        every group, and with tiers, a later run of cached blocks behind a hole (>= 1 token left)."""
        if not self.enable_prefix_caching:
            return PrefixPlan(self._empty(), 0, 0)  # type: ignore[arg-type]
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hashes = self._hashes(seq, max_blocks)[:max_blocks]
        holes = self.tier_policy is not None and all(w is None for w in self.group_windows)
        return plan_prefix(hashes, self._lookup, self.group_windows, self.block_size, holes)

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

    def _fits(self, seq: Sequence, plan: PrefixPlan, watermark_blocks: int = 0) -> bool:
        copies = self._copies(seq)
        if self.contiguous and self.pool.num_free_runs < self.num_groups * copies:
            return False
        need = seq.num_blocks_needed(self.block_size)
        blocks = sum(m.blocks_to_allocate(hits, need) for m, hits in zip(self.managers, plan.ids))
        return self.pool.num_free_or_cached - blocks * copies >= watermark_blocks

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
        for m, hits in zip(self.managers, plan.ids):
            m.take_hits(hits)
        hashes = self._hashes(seq, len(plan.ids[0]))
        tier_policy = self.tier_policy
        if tier_policy is not None:  # fresh blocks may spill others: never drop what is restored here
            tier_policy.pin({m.key(hashes[i]) for m, hits in zip(self.managers, plan.ids)
                             for i, b in enumerate(hits) if b == TIERED})
        need = seq.num_blocks_needed(self.block_size)
        for m, hits in zip(self.managers, plan.ids):
            def restore(i: int, block_id: int, m: GroupManager = m) -> None:
                owner = tier_policy.restore(m.key(hashes[i]), block_id)  # type: ignore[union-attr]
                self._publish(block_id, m.key(hashes[i]), i, owner)
            m.allocate(seq.seq_id, hits, need, restore)
        if tier_policy is not None:
            tier_policy.pin(set())
        if self.fork_rows is not None and seq.samples_to_fork:
            self.fork_rows.reserve(seq.seq_id, [need] * self.num_groups, seq.samples_to_fork)
        self.holes.open(seq.seq_id, plan, self.block_size)
        if self.enable_prefix_caching:
            self._prefix_queries += seq.num_tokens
            self._prefix_hits += plan.reused_blocks * self.block_size
        return plan.computed * self.block_size

    def computable_tokens(self, seq: Sequence) -> int:
        """Positions the runner may compute next in one go: all uncomputed ones, or up to a
        hole's end when blocks restored behind it wait (see :mod:`flexpage.core.tier_policy`)."""
        return self.holes.computable_tokens(seq)

    def reused_tokens(self, seq: Sequence) -> int:
        """Of a just-allocated sequence, the tokens whose KV came from the cache: its
        ``num_computed_tokens`` plus any restored behind a hole."""
        return self.holes.reused_tokens(seq)

    # -- growth and copy-on-write --------------------------------------------------
    def blocks_to_append(self, seq: Sequence, num_new_tokens: int) -> int:
        """Pool blocks :meth:`append_slots` would take for ``num_new_tokens`` more positions."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if not self.block_table(seq):
            raise ValueError(f"sequence {seq.seq_id} holds no device blocks (allocate or swap_in first)")
        needed = _cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size)
        first = seq.num_computed_tokens // self.block_size  # >= every sliding group's released prefix
        return sum(m.blocks_to_append(seq.seq_id, first, needed) for m in self.managers)

    def can_append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_to_append(seq, num_new_tokens) <= self.pool.num_free_or_cached

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Make positions ``num_computed_tokens .. +num_new_tokens`` writable.

        Adds blocks at the end as needed and un-shares (copy-on-write) any
        block in that range that another sequence also references. Returns the
        ``(src, dst)`` device block copies (logged as ``COPY`` ops).
        """
        if self.blocks_to_append(seq, num_new_tokens) > self.pool.num_free_or_cached:
            raise NoFreeBlocksError(f"not enough blocks to append {num_new_tokens} tokens to {seq.seq_id}")
        needed = _cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size)
        first = seq.num_computed_tokens // self.block_size
        copies = [pair for m in self.managers for pair in m.append_slots(seq.seq_id, first, needed)]
        return self._log(BlockOpKind.COPY, copies)

    # -- KV budgets (see :mod:`flexpage.core.budget_policy`) -----------------------------
    def blocks_to_score(self, seq: Sequence, num_new_tokens: int) -> list[int]:
        """Logical blocks of a sequence with a KV budget that are full once the next
        ``num_new_tokens`` positions are computed and still lack a policy score."""
        return self.budget.blocks_to_score(seq, self.block_tables(seq), num_new_tokens)

    def score_requests(self, seq: Sequence, num_new_tokens: int) -> list[ScoreRequest]:
        """What the executor must score for :meth:`blocks_to_score` (see the budget policy)."""
        return self.budget.score_requests(seq, self.block_tables(seq), num_new_tokens)

    def record_block_scores(self, seq: Sequence, scores: dict[int, float]) -> None:
        """Store the eviction policy's scores for blocks :meth:`blocks_to_score` named."""
        self.budget.record(seq.seq_id, scores)

    def evicted_blocks(self, seq: Sequence) -> list[int]:
        """Logical blocks ``seq`` gave up to stay within its KV budget, ascending."""
        return self.budget.evicted_blocks(seq.seq_id)

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
        old_full = seq.num_computed_tokens // self.block_size
        new_full = new_computed // self.block_size
        hash_limit = self.budget.hash_limit(seq.seq_id)
        if hash_limit is not None:  # blocks completed after an eviction saw a pruned context
            new_full = min(new_full, hash_limit)
        if self.enable_prefix_caching and new_full > old_full:
            hashes = self._hashes(seq, new_full)
            for m, table in zip(self.managers, tables):
                for i in range(old_full, new_full):  # never released yet: those lie below old_full
                    self._publish(table[i], m.key(hashes[i]), i, seq.conversation)
        new_computed = self.holes.jump(seq.seq_id, new_computed)  # past blocks restored behind a computed hole
        evicted = self.budget.evicted(seq.seq_id)
        for m in self.managers:  # hashed first: released full blocks stay cached
            m.remove_skipped_blocks(seq.seq_id, new_computed, evicted)
        if seq.kv_budget is not None and new_computed == seq.num_tokens:  # prompt done: only decodes from here
            self.budget.evict_over_budget(seq, tables, new_computed)
        return new_computed

    def truncate(self, seq: Sequence, num_positions: int) -> None:
        """Give back the blocks after the one holding position ``num_positions - 1``: slots
        appended for proposed tokens that were rejected (never published: only
        :meth:`mark_computed` publishes, and only what it is told was computed)."""
        if self.block_table(seq):
            for m in self.managers:
                m.truncate(seq.seq_id, _cdiv(num_positions, self.block_size))

    # -- speculative branches -----------------------------------------------------------
    def blocks_for_branch(self, seq: Sequence, num_new_tokens: int) -> int:
        """Pool blocks :meth:`branch` takes for a branch of ``num_new_tokens`` positions."""
        start = seq.num_computed_tokens
        return len(self.managers) * (_cdiv(start + num_new_tokens, self.block_size) - start // self.block_size)

    def branch(self, seq: Sequence, branch: Sequence, num_new_tokens: int) -> None:
        """Give ``branch`` (a fork of ``seq``: same tokens and progress) positions
        ``num_computed_tokens .. +num_new_tokens`` of its own: it shares ``seq``'s blocks
        before them, and the block holding the first one is copied if partly computed.

        A branch is a second continuation of ``seq`` verified in the same step (speculative
        trees): its rows write their K/V into its own slots and read the shared prefix in
        place, so each row sees the prefix, its branch's earlier tokens and itself -- the tree
        mask, realised by block tables. :meth:`adopt_branch` keeps it, :meth:`drop_branch`
        releases it.
        """
        if self.fork_rows is not None:
            raise ValueError("speculative branches need shared blocks; the virtual layout shares none")
        if self.holds_blocks(branch):
            raise ValueError(f"branch sequence {branch.seq_id} already holds blocks")
        if self.blocks_for_branch(seq, num_new_tokens) > self.pool.num_free_or_cached:
            raise NoFreeBlocksError(f"not enough blocks for a branch of {num_new_tokens} tokens of {seq.seq_id}")
        start = seq.num_computed_tokens
        first, needed = start // self.block_size, _cdiv(start + num_new_tokens, self.block_size)
        # the block holding ``start`` may be a copy this step makes (``seq``'s own copy-on-write):
        # copy from that copy's source, so that no copy reads another's destination
        pending = {op.dst: op.src for op in self._ops if isinstance(op, BlockOp) and op.kind is BlockOpKind.COPY}
        for m in self.managers:
            m.fork(seq.seq_id, branch.seq_id)
            m.truncate(branch.seq_id, _cdiv(start, self.block_size))
            copies = m.append_slots(branch.seq_id, first, needed)
            self._log(BlockOpKind.COPY, [(pending.get(src, src), dst) for src, dst in copies])

    def adopt_branch(self, seq: Sequence, branch: Sequence) -> None:
        """Let ``seq`` continue with ``branch``'s blocks (its proposals were the accepted ones):
        ``seq``'s own slots after the shared prefix go back to the pool, ``branch`` holds none."""
        for m in self.managers:
            m.adopt(seq.seq_id, branch.seq_id)

    def drop_branch(self, branch: Sequence) -> None:
        """Release a branch's blocks (idempotent): its proposals were rejected, or its
        sequence ended in the step that verified them."""
        for m in self.managers:
            m.free(branch.seq_id)

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
        if self.fork_rows is not None:
            rows, copies = self.fork_rows.take(parent.seq_id, tables)
            for m, row, pairs in zip(self.managers, rows, copies):
                self._log(BlockOpKind.COPY, pairs)
                m.tables[child.seq_id] = row
            self.budget.drop(child.seq_id)
            self.holes.drop(child.seq_id)
            return
        for m in self.managers:
            m.fork(parent.seq_id, child.seq_id)
        self.budget.fork(parent.seq_id, child.seq_id)
        self.holes.fork(parent.seq_id, child.seq_id)

    def free(self, seq: Sequence) -> None:
        """Release every device and host block of ``seq`` at once (idempotent); the
        sequence's KV is gone, so its ``num_computed_tokens`` no longer holds.

        Blocks are released tail first, so a sequence's later blocks are
        evicted before its earlier ones: a cached prefix stays reachable longer.
        """
        if self.fork_rows is not None:
            self.fork_rows.free(seq.seq_id)
        if self.tier_policy is not None and self._known(seq):  # the retention value counts idle time from here
            self.tier_policy.released(self.block_tables(seq))
        for m in self.managers:
            m.free(seq.seq_id)
        self.swap_space.release(seq.seq_id)
        self.budget.drop(seq.seq_id)
        self.holes.drop(seq.seq_id)

    def _known(self, seq: Sequence) -> bool:  # whether any part keeps state for seq
        return self.holds_blocks(seq) or self.budget.has_state(seq.seq_id) or self.holes.has_state(seq.seq_id)

    # -- host swap tier ------------------------------------------------------------------
    def can_swap_out(self, seq: Sequence) -> bool:
        tables = self.block_tables(seq)
        return bool(tables[0]) and HostSwapSpace.num_live(tables) <= self.swap_space.num_free

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move ``seq``'s KV to host slots; returns ``(device_block, host_block)`` copies.

        ``num_computed_tokens`` is kept: the KV still exists, just on the host. Released
        (null) entries of sliding groups are not copied: host tables hold live blocks only.
        """
        if not self.can_swap_out(seq):
            raise NoFreeBlocksError(f"cannot swap out sequence {seq.seq_id}: not enough host blocks")
        pairs = self.swap_space.swap_out(seq.seq_id, self.block_tables(seq))
        for m in self.managers:
            m.free(seq.seq_id)
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
        num_full = seq.num_computed_tokens // self.block_size
        hash_limit = self.budget.hash_limit(seq.seq_id)
        if hash_limit is not None:  # later blocks were never published: their KV is this sequence's own
            num_full = min(num_full, hash_limit)
        hashes = self._hashes(seq, num_full)[:num_full] if self.enable_prefix_caching else []
        evicted = self.budget.evicted(seq.seq_id)

        def publish(block_id: int, key: BlockHash, i: int) -> None:
            self._publish(block_id, key, i, seq.conversation)

        pairs = [pair for m, host_table in zip(self.managers, self.host_block_tables(seq))
                 for pair in m.swap_in(seq.seq_id, host_table, seq.num_computed_tokens, evicted,
                                       [m.key(h) for h in hashes], publish)]
        self.swap_space.release(seq.seq_id)
        return self._log(BlockOpKind.SWAP_IN, pairs)
