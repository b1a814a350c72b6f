"""KV budgets as a policy the block manager composes: score, evict whole blocks, pack runs.

A sequence with ``kv_budget`` evicts whole logical blocks once all its tokens are computed
(the rule is :func:`flexpage.core.eviction.blocks_to_evict`); an evicted entry becomes the
null block in every group's table, so the kept blocks keep their logical indices, hence
their positions. The policy's scores arrive through :meth:`KVBudgetPolicy.record` for the
blocks :meth:`KVBudgetPolicy.blocks_to_score` names.

An evicting sequence publishes no prefix-cache hash for blocks it completes after its first
eviction (their KV saw a pruned context: :meth:`KVBudgetPolicy.hash_limit`), and an evicted
block that another sequence shares (prefix cache, fork) only loses this sequence's
reference. Kept pages scattered over many of the kernel's key blocks are copied into whole
runs (``COPY`` ops, logged through ``log`` in the order decided, run before the next
forward pass).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from flexpage.core.block_pool import NULL_BLOCK_ID, BlockPool
from flexpage.core.eviction import blocks_to_evict, runs_are_scattered
from flexpage.core.kv_ops import BlockOpKind
from flexpage.core.scheduler_output import ScoreRequest
from flexpage.core.sequence import Sequence

__all__ = ["KVBudgetPolicy"]

Log = Callable[[BlockOpKind, list[tuple[int, int]]], object]


@dataclass(slots=True)
class _Budget:
    """One sequence's budget state."""

    evicted: set[int] = field(default_factory=set)  # logical blocks given up
    scores: dict[int, float] = field(default_factory=dict)  # the eviction policy's score per held block
    scored_upto: int = 0  # every held full block below this index has a score
    #: leading blocks this sequence may publish to the prefix cache; None: all (never evicted)
    hash_limit: int | None = None

    def copy(self) -> _Budget:
        return _Budget(set(self.evicted), dict(self.scores), self.scored_upto, self.hash_limit)


class KVBudgetPolicy:
    """Per-sequence budget state and the evictions it decides (see the module docstring)."""

    def __init__(self, pool: BlockPool, block_size: int, log: Log) -> None:
        self.pool = pool
        self.block_size = block_size
        self._log = log
        self._state: dict[int, _Budget] = {}  # by seq_id
        self.num_evicted_blocks = 0  # table entries given up, over all groups

    def _of(self, seq_id: int) -> _Budget:
        state = self._state.get(seq_id)
        if state is None:
            state = self._state[seq_id] = _Budget()
        return state

    def has_state(self, seq_id: int) -> bool:
        return seq_id in self._state

    def evicted(self, seq_id: int) -> Collection[int]:
        """Logical blocks ``seq_id`` gave up (do not modify)."""
        state = self._state.get(seq_id)
        return state.evicted if state is not None else ()

    def evicted_blocks(self, seq_id: int) -> list[int]:
        return sorted(self.evicted(seq_id))

    def hash_limit(self, seq_id: int) -> int | None:
        state = self._state.get(seq_id)
        return state.hash_limit if state is not None else None

    # -- scores ------------------------------------------------------------------------------
    def blocks_to_score(self, seq: Sequence, tables: list[list[int]], num_new_tokens: int) -> list[int]:
        """Logical blocks of ``seq`` (with a budget and ``tables``) that are full once the next
        ``num_new_tokens`` positions are computed and still lack a score."""
        if seq.kv_budget is None or not tables[0]:
            return []
        state = self._state.get(seq.seq_id) or _Budget()
        new_full = min((seq.num_computed_tokens + num_new_tokens) // self.block_size, len(tables[0]))
        return [i for i in range(state.scored_upto, new_full)
                if i not in state.evicted and any(table[i] != NULL_BLOCK_ID for table in tables)]

    def score_requests(self, seq: Sequence, tables: list[list[int]], num_new_tokens: int) -> list[ScoreRequest]:
        """What the executor must score for :meth:`blocks_to_score`: one request of every block
        over the layer groups holding them all, or, where a sliding group gave some back, one
        request per block over the groups that still hold it."""
        blocks = self.blocks_to_score(seq, tables, num_new_tokens)
        if not blocks:
            return []
        bs = self.block_size
        holding = [table for table in tables if all(table[i] != NULL_BLOCK_ID for i in blocks)]
        if holding:
            return [ScoreRequest(seq.seq_id, blocks, [[table[i] for i in blocks] for table in holding],
                                 [i * bs for i in blocks])]
        return [ScoreRequest(seq.seq_id, [i], [[table[i]] for table in tables if table[i] != NULL_BLOCK_ID], [i * bs])
                for i in blocks]

    def record(self, seq_id: int, scores: dict[int, float]) -> None:
        """Store the policy's scores for blocks :meth:`blocks_to_score` named."""
        state = self._of(seq_id)
        state.scores.update(scores)
        if scores:
            state.scored_upto = max(state.scored_upto, max(scores) + 1)

    # -- eviction ----------------------------------------------------------------------------
    def evict_over_budget(self, seq: Sequence, tables: list[list[int]], num_computed: int) -> None:
        """Give up the blocks over ``seq``'s budget in every group's table (all its tokens are
        computed), then pack each table's scattered pages into runs."""
        state = self._of(seq.seq_id)
        width = len(tables[0])
        live = [i for i in range(width) if any(table[i] != NULL_BLOCK_ID for table in tables)]
        budget_blocks = seq.kv_budget // self.block_size  # type: ignore[operator]
        victims = blocks_to_evict(live, state.scores, budget_blocks, num_computed % self.block_size == 0)
        if not victims:
            return
        if state.hash_limit is None:
            state.hash_limit = num_computed // self.block_size
        for i in victims:
            for table in tables:
                if table[i] != NULL_BLOCK_ID:
                    self.pool.decref(table[i])
                    table[i] = NULL_BLOCK_ID
                    self.num_evicted_blocks += 1
            state.evicted.add(i)
            state.scores.pop(i, None)
        for table in tables:
            self.pack_runs(table)

    def pack_runs(self, table: list[int]) -> None:
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

    # -- lifetime ----------------------------------------------------------------------------
    def fork(self, parent_id: int, child_id: int) -> None:
        """``child_id`` shares ``parent_id``'s blocks, so it inherits its budget state."""
        state = self._state.get(parent_id)
        self._state.pop(child_id, None)
        if state is not None:
            self._state[child_id] = state.copy()

    def drop(self, seq_id: int) -> None:
        self._state.pop(seq_id, None)
