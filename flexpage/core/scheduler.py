"""Iteration-level continuous batching over a :class:`BlockManager`.

Each :meth:`Scheduler.schedule` call plans one forward pass under a token
budget. Order of service, so that in-flight work never starves:

1. running sequences that are decoding (1 token each, plus the tokens proposed for it to
   verify -- speculative decoding -- where the budget and free blocks allow them without
   preempting anything), oldest admission first; when a block cannot be found for one,
   the most recently admitted running sequence is preempted (recompute: drop its KV and
   requeue it; swap: copy its KV to host memory) until it fits;
2. running sequences whose prefill is only partly done (chunked prefill);
3. swapped-out sequences, back in arrival order;
4. waiting sequences, in arrival order, while budget, ``max_num_seqs`` and free
   blocks above the watermark allow.

Every decision goes through the block manager, which sums over the model's layer groups
(one block table each, one shared pool; see :mod:`flexpage.core.layer_groups`), so a
sequence is admitted only when every group fits. Sliding-window groups give blocks back
as sequences advance (in ``mark_computed``), which is how a long Mistral/Gemma sequence
stays within a bounded number of blocks per sliding group.

Steps 3-4 are skipped in a step that preempted anything (the pool is under
pressure), and step 4 while anything is still swapped out (it goes first).
A waiting sequence is given blocks for *all* its tokens at admission, so a
prefill that is split into chunks never stalls half way for lack of blocks.

The engine loop is: ``out = schedule()``; run ``out.kv_ops`` in order and the model
over each scheduled slice; record ``out.scores``; ``mark_computed(out)``; append a
sampled token to every sequence whose ``ScheduledSequence.sample`` is True (and, after a
verification, ``accept_drafts``); call ``finish`` on those that stopped. KV operations
decided after the plan (``mark_computed`` packing kept pages, forks, frees) travel in the
next step's plan.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from flexpage.core.block_manager import BlockManager
from flexpage.core.scheduler_output import ScheduledSequence, SchedulerOutput
from flexpage.core.sequence import Sequence, SequenceStatus

__all__ = ["ScheduledSequence", "Scheduler", "SchedulerConfig", "SchedulerOutput"]

PREEMPTION_MODES = ("recompute", "swap")


@dataclass(slots=True)
class SchedulerConfig:
    """Batching limits and policies; ``__post_init__`` rejects bad values by name."""

    max_num_seqs: int = 256  # sequences admitted (running) at once
    max_num_batched_tokens: int = 2048  # tokens computed per step, across sequences
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"  # or "swap" (needs host blocks)
    watermark: float = 0.01  # fraction of usable blocks kept free at admission
    max_model_len: int = 2048  # longest prompt (+ output) a sequence may have

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.enable_chunked_prefill, bool):
            raise ValueError(f"enable_chunked_prefill must be a bool, got {self.enable_chunked_prefill!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if isinstance(self.watermark, bool) or not isinstance(self.watermark, (int, float)) or not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be a float in [0, 1), got {self.watermark!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}) when enable_chunked_prefill is False, or long prompts never fit a step"
            )


class Scheduler:
    """Owns the waiting / running / swapped queues and the preemption policy."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        if config.preemption_mode == "swap" and block_manager.num_host_blocks == 0:
            raise ValueError("preemption_mode='swap' needs a BlockManager with num_host_blocks > 0, got 0")
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order; the last is preempted first
        self.swapped: deque[Sequence] = deque()
        self._seqs: dict[int, Sequence] = {}
        self.num_preemptions = 0
        #: per sequence verifying a tree this step, its branches (forks living for one step,
        #: with negative ids that never meet a request's)
        self._branches: dict[int, list[Sequence]] = {}
        self._branch_ids = itertools.count(-1, -1)
        self.watermark_blocks = int(config.watermark * block_manager.num_usable_blocks)

    # -- queue management ------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence; rejects prompts that could never be scheduled."""
        if seq.seq_id in self._seqs:
            raise ValueError(f"seq_id {seq.seq_id} is already scheduled")
        if seq.status is not SequenceStatus.WAITING or self.block_manager.holds_blocks(seq):
            raise ValueError(f"sequence {seq.seq_id} must be WAITING and hold no blocks, got {seq!r}")
        if seq.num_tokens > self.config.max_model_len:
            raise ValueError(
                f"prompt of sequence {seq.seq_id} has {seq.num_tokens} tokens, more than "
                f"max_model_len={self.config.max_model_len}"
            )
        bm = self.block_manager
        need = bm.blocks_for_admission(seq)
        if need > bm.num_usable_blocks:
            groups = f" across {bm.num_groups} layer groups" if bm.num_groups > 1 else ""
            raise ValueError(
                f"prompt of sequence {seq.seq_id} ({seq.num_tokens} tokens) needs {need} blocks of "
                f"block_size={bm.block_size}{groups}, but the pool has num_blocks={bm.num_blocks} "
                f"({bm.num_usable_blocks} usable; block 0 is reserved)"
            )
        if bm.contiguous and bm.num_groups * (1 + seq.samples_to_fork) > bm.pool.num_rows:
            raise ValueError(
                f"sequence {seq.seq_id} with {1 + seq.samples_to_fork} parallel samples needs "
                f"{bm.num_groups * (1 + seq.samples_to_fork)} rows of the virtual KV arena, which has "
                f"{bm.pool.num_rows} (max_num_seqs x layer groups)"
            )
        self._seqs[seq.seq_id] = seq
        self._enqueue(self.waiting, seq)

    @staticmethod
    def _enqueue(queue: deque[Sequence], seq: Sequence) -> None:
        """Insert before the first queued sequence that arrived later (keeps arrival order)."""
        for i, other in enumerate(queue):
            if other.arrival_index > seq.arrival_index:
                queue.insert(i, seq)
                return
        queue.append(seq)

    def get(self, seq_id: int) -> Sequence | None:
        return self._seqs.get(seq_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Retire a sequence and free all of its blocks now."""
        if not status.is_finished:
            raise ValueError(f"status must be a FINISHED_* status, got {status}")
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
        self.block_manager.free(seq)
        seq.status = status
        self._seqs.pop(seq.seq_id, None)

    def abort(self, seq_id: int) -> Sequence | None:
        """Cancel a sequence wherever it is; returns it, or None if unknown/finished."""
        seq = self._seqs.get(seq_id)
        if seq is not None:
            self.finish(seq, SequenceStatus.FINISHED_ABORTED)
        return seq

    def fork(self, parent: Sequence, child_seq_id: int) -> Sequence:
        """Parallel sampling: a running child sharing ``parent``'s blocks (copy-on-write).

        Fork once the prompt is computed (typically right after the prefill
        step, before appending the n sampled tokens), never mid-prefill: shared
        blocks are then only ever un-shared by decodes, which may preempt.
        """
        if parent.status is not SequenceStatus.RUNNING:
            raise ValueError(f"can only fork a RUNNING sequence, got {parent!r}")
        if parent.num_uncomputed_tokens > 1:
            raise ValueError(f"cannot fork sequence {parent.seq_id} mid-prefill ({parent.num_uncomputed_tokens} tokens uncomputed)")
        if child_seq_id in self._seqs:
            raise ValueError(f"seq_id {child_seq_id} is already scheduled")
        child = parent.fork(child_seq_id)
        self.block_manager.fork(parent, child)
        self.running.insert(self.running.index(parent) + 1, child)
        self._seqs[child_seq_id] = child
        return child

    def fork_parallel_samples(self, sampled: list[Sequence],
                              new_seq_id: Callable[[], int]) -> list[tuple[int, Sequence]]:
        """The rows to sample after a forward pass, as ``(logits row, sequence)``.

        A sequence of an ``n > 1`` request whose prompt was just computed forks its ``n - 1``
        siblings here (sharing its blocks, copy-on-write) so that all ``n`` sample from the
        same logits row: the prompt is computed once.
        """
        rows: list[tuple[int, Sequence]] = []
        for row, seq in enumerate(sampled):
            rows.append((row, seq))
            forks = self.forks_due(seq)
            if forks:
                rows += [(row, self.fork(seq, new_seq_id())) for _ in range(forks)]
                seq.samples_to_fork = 0
        return rows

    @staticmethod
    def forks_due(seq: Sequence) -> int:
        """How many siblings :meth:`fork_parallel_samples` forks from ``seq`` after its next
        sample: its request's ``n - 1`` at the first output token, else none."""
        return seq.samples_to_fork if seq.num_output_tokens == 0 else 0

    def mark_computed(self, output: SchedulerOutput) -> None:
        """After the forward pass: advance every scheduled, still-live sequence (over its known
        tokens: proposed ones count once accepted, see :meth:`accept_drafts`)."""
        for item in output.scheduled:
            if item.seq.status is SequenceStatus.RUNNING:
                known = item.num_new_tokens - len(item.drafts)
                item.seq.num_computed_tokens = self.block_manager.mark_computed(item.seq, known)
                item.seq.num_evicted_blocks = len(self.block_manager.evicted_blocks(item.seq))

    def accept_drafts(self, seq: Sequence, num_accepted: int) -> None:
        """After a verification step, once the accepted proposals (and the token after them)
        are appended to ``seq``: their KV, computed this step, counts as computed (full blocks
        enter the prefix cache only now, with the accepted tokens' hashes); the slots of the
        rejected ones are rewritten by later steps, and blocks that hold only rejected
        positions go back to the pool. Where the accepted tokens are another branch's
        proposals, ``seq`` continues on that branch's blocks (their KV is at the right slots
        already); every other branch is released."""
        branches = self._branches.pop(seq.seq_id, [])
        if seq.status is SequenceStatus.RUNNING:
            bm = self.block_manager
            if num_accepted:
                first = seq.num_computed_tokens  # the root's KV counted already: the proposals follow it
                accepted = seq.token_ids[first : first + num_accepted]
                if seq.draft_token_ids[:num_accepted] != accepted:
                    chosen = next(b for b in branches if b.draft_token_ids[:num_accepted] == accepted)
                    bm.adopt_branch(seq, chosen)
                seq.num_computed_tokens = bm.mark_computed(seq, num_accepted)
            bm.truncate(seq, seq.num_tokens)
        for branch in branches:
            self.block_manager.drop_branch(branch)
        seq.draft_token_ids = []
        seq.draft_branches = []

    def release_branches(self) -> None:
        """Release the branches no verification accepted or dropped (their sequence ended or
        failed in the step): called at the end of every step."""
        for branches in self._branches.values():
            for branch in branches:
                self.block_manager.drop_branch(branch)
        self._branches.clear()

    def _drafts_that_fit(self, seq: Sequence, budget: int) -> tuple[tuple[int, ...], list[list[int]]]:
        """The proposed tokens of a decoding ``seq`` this step verifies, and its other branches:
        all of them if the token budget allows and the blocks they add leave one free block per
        running sequence; else the first branch alone if that fits, else none: a proposal never
        preempts anything, now or in this step's later decodes."""
        drafts, branches = seq.draft_token_ids, seq.draft_branches
        if not drafts:
            return (), []
        bm = self.block_manager
        spare = bm.pool.num_free_or_cached - len(self.running)
        extra = bm.blocks_to_append(seq, 1 + len(drafts)) - bm.blocks_to_append(seq, 1)
        if branches:
            rows = sum(1 + len(b) for b in branches)
            blocks = sum(bm.blocks_for_branch(seq, 1 + len(b)) for b in branches)
            if len(drafts) + rows > budget or spare < extra + blocks:  # a branch takes a block at least
                branches = seq.draft_branches = []
        if len(drafts) > budget or (extra and spare < extra):
            seq.draft_token_ids, seq.draft_branches = [], []
            return (), []
        return tuple(drafts), branches

    # -- the step ------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Plan the next forward pass (see the module docstring for the policy), with every KV
        operation decided since the last plan."""
        out = SchedulerOutput()
        self._schedule(out)
        bm = self.block_manager
        out.scores = [request for item in out.scheduled
                      for request in bm.score_requests(item.seq, item.num_new_tokens)]
        out.kv_ops = bm.drain_ops()
        return out

    def _schedule(self, out: SchedulerOutput) -> None:
        cfg, bm = self.config, self.block_manager
        budget = cfg.max_num_batched_tokens
        scheduled: set[int] = set()
        in_flight: set[bytes] = set()  # hashes of full blocks this step computes

        def take(seq: Sequence, n: int, proposals: tuple[tuple[int, ...], list[list[int]]] = ((), [])) -> None:
            nonlocal budget
            drafts, branches = proposals
            bm.append_slots(seq, n + len(drafts))
            in_flight.update(bm.hashes_filled_by(seq, n))
            start = seq.num_computed_tokens
            item = ScheduledSequence(seq, n + len(drafts), start, start + n == seq.num_tokens, drafts)
            for branch_drafts in branches:
                branch = seq.fork(next(self._branch_ids))
                branch.draft_token_ids = list(branch_drafts)
                bm.branch(seq, branch, 1 + len(branch_drafts))
                self._branches.setdefault(seq.seq_id, []).append(branch)
                item.branches.append(ScheduledSequence(branch, 1 + len(branch_drafts), start, True,
                                                       tuple(branch_drafts)))
            out.scheduled.append(item)
            scheduled.add(id(seq))
            budget -= item.num_rows

        def chunk(seq: Sequence) -> int:
            remaining = bm.computable_tokens(seq)
            if cfg.enable_chunked_prefill:
                return min(remaining, budget)
            return remaining if remaining <= budget else 0

        # 1. decodes, oldest admission first (a beam group's together); preempt from the newest end.
        for seq in list(self.running):
            if id(seq) in scheduled or seq.status is not SequenceStatus.RUNNING or seq.num_uncomputed_tokens != 1:
                continue
            if seq.num_tokens >= cfg.max_model_len:  # normally the engine stops it first
                self._finish_length(seq, out)
                continue
            unit = [s for s in self._group(seq, self.running) if s.num_uncomputed_tokens == 1]
            if budget < len(unit) or len(out.scheduled) + len(unit) > cfg.max_num_seqs:
                break
            if self._make_room(unit, out):
                for member in unit:
                    take(member, 1, self._drafts_that_fit(member, budget - 1))

        # 2. partially prefilled sequences (their blocks were reserved at admission).
        for seq in list(self.running):
            if id(seq) in scheduled or seq.num_uncomputed_tokens <= 1:
                continue
            if budget == 0 or len(out.scheduled) >= cfg.max_num_seqs:
                break
            n = chunk(seq)
            if n and bm.can_append_slots(seq, n):
                take(seq, n)

        if out.preempted:
            return

        # 3. swapped sequences come back before anything new is admitted.
        while self.swapped:
            unit = self._group(self.swapped[0], self.swapped)
            if len(self.running) + len(unit) > cfg.max_num_seqs or not self._can_swap_in(unit):
                break
            for seq in unit:
                self.swapped.remove(seq)
                bm.swap_in(seq)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                n = 1 if seq.num_uncomputed_tokens == 1 else chunk(seq)
                if n and n <= budget and len(out.scheduled) < cfg.max_num_seqs and bm.can_append_slots(seq, n):
                    take(seq, n)

        # 4. admit waiting sequences in arrival order (head-of-line: never skip one).
        while self.waiting and not self.swapped and budget > 0:
            seq = self.waiting[0]
            unit = self._group(seq, self.waiting)
            if len(self.running) + len(unit) > cfg.max_num_seqs or len(out.scheduled) + len(unit) > cfg.max_num_seqs:
                break
            if in_flight and bm.next_uncached_hash(seq) in in_flight:
                break  # an earlier admission computes this prefix now: next step shares it instead
            if not self._can_allocate(unit):
                if not self.running and len(unit) > 1:  # a readmitted beam group the empty pool cannot hold
                    for member in unit:
                        self._finish_length(member, out)
                    continue
                break
            remaining = seq.num_tokens - bm.num_cached_prefix_tokens(seq)
            if not cfg.enable_chunked_prefill and remaining > budget:
                break
            for member in unit:
                self.waiting.remove(member)
                member.num_computed_tokens = bm.allocate(member)
                if member.num_output_tokens == 0:  # report prompt tokens only, first admission
                    member.num_cached_tokens = bm.reused_tokens(member)
                member.status = SequenceStatus.RUNNING
                self.running.append(member)
                n = chunk(member)
                if n or member is seq:  # a later member may find this step's budget spent
                    take(member, n)

    def _watermark(self) -> int:
        # With nothing running, the watermark could only block progress forever.
        return self.watermark_blocks if self.running else 0

    @staticmethod
    def _group(seq: Sequence, queue: Iterable[Sequence]) -> list[Sequence]:
        """``seq`` and, for a beam, the other sequences of its beam group in ``queue``: what
        is scheduled, preempted, swapped in and admitted as one unit."""
        if seq.beam_group is None:
            return [seq]
        return [s for s in queue if s.beam_group == seq.beam_group]

    def _can_allocate(self, unit: list[Sequence]) -> bool:
        """Whether every sequence of ``unit`` can be admitted (counting each one's blocks in
        full: only the prefix cache shares between them at admission)."""
        bm = self.block_manager
        return self._fit_together(unit, bm.can_allocate, bm.blocks_for_admission)

    def _can_swap_in(self, unit: list[Sequence]) -> bool:
        bm = self.block_manager
        return self._fit_together(unit, bm.can_swap_in, lambda seq: sum(map(len, bm.host_block_tables(seq))))

    def _fit_together(self, unit: list[Sequence], fits: Callable[[Sequence, int], bool],
                      blocks: Callable[[Sequence], int]) -> bool:
        """Whether each sequence of ``unit`` ``fits`` with the watermark plus the ``blocks`` the
        ones before it take kept free."""
        taken = 0
        for seq in unit:
            if not fits(seq, self._watermark() + taken):
                return False
            taken += blocks(seq)
        return True

    def _make_room(self, unit: list[Sequence], out: SchedulerOutput) -> bool:
        """Preempt newest-first until every sequence of ``unit`` can take one more token;
        False if they lost (preempted, or finished: alone and still out of blocks)."""
        bm = self.block_manager
        while sum(bm.blocks_to_append(seq, 1) for seq in unit) > bm.pool.num_free_or_cached:
            victims = self._group(self.running[-1], self.running)
            if unit[0] in victims and len(victims) == len(self.running):
                # Alone (with its beam group) and still out of blocks: it can never grow.
                self._finish_length(unit[0], out)
                return False
            for victim in reversed(victims):
                self._preempt(victim, out)
            if unit[0] in victims:
                return False
        return True

    def _finish_length(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.finish(seq, SequenceStatus.FINISHED_LENGTH)
        out.finished.append(seq)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        seq.draft_token_ids = []  # proposed after tokens it may recompute: the next proposal is made afresh
        seq.draft_branches = []
        self.num_preemptions += 1
        out.preempted.append(seq)
        bm = self.block_manager
        for branch in self._branches.pop(seq.seq_id, []):
            bm.drop_branch(branch)
        if self.config.preemption_mode == "swap" and bm.can_swap_out(seq):
            bm.swap_out(seq)
            seq.status = SequenceStatus.SWAPPED
            self._enqueue(self.swapped, seq)
        else:
            bm.free(seq)
            seq.num_computed_tokens = 0  # recomputed from token_ids (outputs included) when readmitted
            seq.status = SequenceStatus.WAITING
            self._enqueue(self.waiting, seq)
