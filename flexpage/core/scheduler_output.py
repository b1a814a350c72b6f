"""What one scheduling step hands to the executor: the core's half of the step's plan.

Plain data only (ints, KV operations, and the :class:`Sequence` objects), so the
executor can turn it into tensors without knowing any scheduling policy:
:func:`step_inputs` flattens the scheduled slices into the runner's rows, ``kv_ops`` are
every byte movement in the order it must run, ``scores`` the blocks whose eviction scores
the forward pass must produce.

For each :class:`ScheduledSequence` the runner computes KV for token positions
``start .. start + num_new_tokens - 1`` of ``seq.token_ids`` (slot of position
``p``: block ``block_manager.block_table(seq)[p // block_size]``, offset ``p % block_size``),
attending to all positions ``< start + num_new_tokens``; and, if ``sample`` is
True, samples the next token from the last position's logits. A decode slice that verifies
proposed tokens (speculative decoding) runs ``drafts`` after the sequence's last token, as
positions ``start + 1 ..``, and every one of its rows' logits is sampled; its ``branches``
(other proposals of the same sequence, verified with it as a tree) run the same way on
blocks of their own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from flexpage.core.kv_ops import BlockOp, BlockOpKind, KVOp
from flexpage.core.sequence import Sequence

__all__ = ["ScheduledSequence", "SchedulerOutput", "ScoreRequest", "StepInputs", "step_inputs"]


@dataclass(slots=True)
class ScheduledSequence:
    """One sequence's slice of this step: positions ``start .. start + num_new_tokens - 1``."""

    seq: Sequence
    num_new_tokens: int
    #: ``seq.num_computed_tokens`` when scheduled: the first position computed this step.
    start: int
    #: True when this slice reaches the end of ``seq.token_ids``: the runner must
    #: sample a token from the last position's logits (decodes and final prefill chunks).
    sample: bool
    #: proposed tokens after the sequence's last token, verified this step (counted in
    #: ``num_new_tokens``; their KV is rolled back where they are rejected)
    drafts: tuple[int, ...] = ()
    #: further proposals verified beside ``drafts`` as one tree: each a fork of ``seq`` whose
    #: slice (``start``, ``num_new_tokens``, ``drafts``) is its branch, run on its own blocks
    #: (:meth:`BlockManager.branch`) right after this slice's rows
    branches: list[ScheduledSequence] = field(default_factory=list)

    @property
    def num_rows(self) -> int:
        """Rows of the forward pass this slice runs, its branches' included."""
        return self.num_new_tokens + sum(branch.num_new_tokens for branch in self.branches)

    @property
    def num_logits_rows(self) -> int:
        """Logits rows a sampling slice produces: its last token's, one per proposal, and its
        branches' (each: its root's and one per proposal)."""
        return 1 + len(self.drafts) + sum(branch.num_new_tokens for branch in self.branches)

    @property
    def token_ids(self) -> list[int]:
        known = self.num_new_tokens - len(self.drafts)
        return [*self.seq.token_ids[self.start : self.start + known], *self.drafts]

    @property
    def is_prefill(self) -> bool:
        """Whether any prompt position (or recomputed history) is in this slice."""
        return not (self.num_new_tokens == 1 + len(self.drafts) and self.sample
                    and self.start >= self.seq.num_prompt_tokens)

    @property
    def is_prefill_chunk_final(self) -> bool:
        """Alias of :attr:`sample`."""
        return self.sample


@dataclass(frozen=True, slots=True)
class ScoreRequest:
    """Blocks of one sequence with a KV budget, filled this step, whose eviction-policy scores
    the executor computes after the forward pass (one score per block, from every layer
    group listed)."""

    seq_id: int
    blocks: list[int]  # logical block indices
    pages: list[list[int]]  # per layer group holding them: each block's physical page
    first_positions: list[int]  # each block's first logical position


@dataclass
class StepInputs:
    """The rows of one forward pass, in the runner's terms (:func:`step_inputs` builds it)."""

    token_ids: list[int]  # flat, sequence after sequence
    block_tables: list[list[int]]
    seq_lens: list[int]  # tokens in the pool per sequence after this step
    query_lens: list[int]  # new tokens per sequence this step
    sample_rows: list[int]  # flat index of each token whose logits are wanted
    #: per layer group, per sequence (``[group][seq]``); empty: one group, ``block_tables``
    group_block_tables: list[list[list[int]]] = field(default_factory=list)
    #: some sequence's tables hold blocks its KV budget evicted (null entries before its tokens)
    evicted_pages: bool = False


@dataclass(slots=True)
class SchedulerOutput:
    """The core's plan of one step: run ``kv_ops`` in order, then the forward pass over
    ``scheduled``, then score ``scores``' blocks."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    #: every KV operation (swaps, tier copies, copy-on-write, relocations, released rows) in the
    #: order it must run, before the forward pass
    kv_ops: list[KVOp] = field(default_factory=list)
    scores: list[ScoreRequest] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    #: Sequences the scheduler itself finished (FINISHED_LENGTH) instead of
    #: scheduling: reached ``max_model_len`` tokens, or a lone sequence that
    #: outgrew the whole pool. The engine should emit their final output.
    finished: list[Sequence] = field(default_factory=list)

    def _pairs(self, kind: BlockOpKind) -> list[tuple[int, int]]:
        return [(op.src, op.dst) for op in self.kv_ops if isinstance(op, BlockOp) and op.kind is kind]

    @property
    def blocks_to_copy(self) -> list[tuple[int, int]]:
        """``(src, dst)`` device copies among ``kv_ops`` (copy-on-write, relocations)."""
        return self._pairs(BlockOpKind.COPY)

    @property
    def blocks_to_swap_out(self) -> list[tuple[int, int]]:
        """``(device, host)`` swap-outs among ``kv_ops``."""
        return self._pairs(BlockOpKind.SWAP_OUT)

    @property
    def blocks_to_swap_in(self) -> list[tuple[int, int]]:
        """``(host, device)`` swap-ins among ``kv_ops``."""
        return self._pairs(BlockOpKind.SWAP_IN)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_rows for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not (self.scheduled or self.kv_ops)


def step_inputs(scheduled: Iterable[ScheduledSequence],
                block_tables: Callable[[Sequence], list[list[int]]]) -> StepInputs:
    """The flat rows of ``scheduled`` slices; ``block_tables(seq)`` gives a sequence's table
    per layer group (:meth:`BlockManager.block_tables`).

    A slice that verifies proposed tokens becomes one *decode row* per token, each the
    sequence cut just after that token (same block table, one more position each): a chain
    is causal, so row ``j`` attending to the first ``start + j + 1`` positions is exactly its
    mask, and decode rows read the pool in place -- a verification step costs what a decode
    step of as many rows does, not a prefill chunk's gathered keys (SmolLM2's forward, one
    sequence: 11.5 ms for a decode step, 14.3 ms with a 2-token chunk, 11.6 ms as 2 decode rows).
    The rows' K/V are all written before attention reads them, layer by layer, as for any step.
    A slice's branches follow it, each as decode rows over its own block table.
    """
    inputs = StepInputs([], [], [], [], [])
    for item in (piece for whole in scheduled for piece in (whole, *whole.branches)):
        seq = item.seq
        inputs.token_ids.extend(item.token_ids)
        tables = block_tables(seq)
        cuts = range(item.start + 1, item.start + item.num_new_tokens + 1) if item.drafts else \
            [item.start + item.num_new_tokens]
        for seq_len in cuts:
            inputs.block_tables.append(tables[0])
            if len(tables) > 1:  # one table per layer group
                if not inputs.group_block_tables:
                    inputs.group_block_tables = [[] for _ in tables]
                for group, table in zip(inputs.group_block_tables, tables):
                    group.append(table)
            inputs.seq_lens.append(seq_len)
            inputs.query_lens.append(1 if item.drafts else item.num_new_tokens)
        inputs.evicted_pages |= seq.num_evicted_blocks > 0
        if item.sample:  # the last row, and the rows of proposed tokens before it
            last = len(inputs.token_ids)
            inputs.sample_rows.extend(range(last - 1 - len(item.drafts), last))
    return inputs
