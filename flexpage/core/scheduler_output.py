"""What one scheduling step hands to the model runner.

Plain data only (ints, pairs of ints, and the :class:`Sequence` objects), so the
runner can turn it into tensors without knowing any scheduling policy.

For each :class:`ScheduledSequence` the runner computes KV for token positions
``start .. start + num_new_tokens - 1`` of ``seq.token_ids`` (slot of position
``p``: block ``block_manager.block_table(seq)[p // block_size]``, offset ``p % block_size``),
attending to all positions ``< start + num_new_tokens``; and, if ``sample`` is
True, samples the next token from the last position's logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flexpage.core.sequence import Sequence

__all__ = ["ScheduledSequence", "SchedulerOutput"]


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

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids[self.start : self.start + self.num_new_tokens]

    @property
    def is_prefill(self) -> bool:
        """Whether any prompt position (or recomputed history) is in this slice."""
        return not (self.num_new_tokens == 1 and self.sample and self.start >= self.seq.num_prompt_tokens)

    @property
    def is_prefill_chunk_final(self) -> bool:
        """Alias of :attr:`sample`."""
        return self.sample


@dataclass(slots=True)
class SchedulerOutput:
    """Everything the runner needs for one step. Apply copies in field order:
    ``blocks_to_swap_out``, ``blocks_to_swap_in``, ``blocks_to_copy``; then run."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) device
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    preempted: list[Sequence] = field(default_factory=list)
    #: Sequences the scheduler itself finished (FINISHED_LENGTH) instead of
    #: scheduling: reached ``max_model_len`` tokens, or a lone sequence that
    #: outgrew the whole pool. The engine should emit their final output.
    finished: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not (self.scheduled or self.blocks_to_swap_out or self.blocks_to_swap_in or self.blocks_to_copy)
