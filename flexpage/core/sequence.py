"""One generation request as the scheduler and block manager see it.

A :class:`Sequence` is a growing list of token ids (prompt first, then the
tokens the model sampled) plus two progress counters:

* ``num_computed_tokens``: how many leading tokens have their KV in the device
  pool. Positions ``num_computed_tokens .. num_tokens - 1`` still need a forward
  pass. After a decode step samples a token, the new token is appended but not
  yet computed, so a decoding sequence sits at ``num_tokens - 1`` computed.
* ``num_cached_tokens``: how many prompt tokens were served from the prefix
  cache at admission (reporting only; never drives scheduling).

The class holds no policy and no blocks: the block manager keeps the block tables (keyed
by ``seq_id``), and the scheduler moves ``status`` and the counters.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterable
from typing import Any

from flexpage.core.block_pool import hash_block_tokens, salted_root

__all__ = ["Sequence", "SequenceStatus"]

# Process-wide arrival counter: creation order is arrival order unless the
# engine passes an explicit ``arrival_index``.
_arrival_counter = itertools.count()


class SequenceStatus(enum.Enum):
    """Where a sequence is in its lifetime."""

    WAITING = "waiting"  # queued; holds no device blocks
    RUNNING = "running"  # admitted; holds device blocks
    SWAPPED = "swapped"  # preempted to host memory; holds host blocks only
    FINISHED_STOPPED = "finished_stopped"  # hit EOS / a stop condition
    FINISHED_LENGTH = "finished_length"  # hit max_tokens / max_model_len / pool capacity
    FINISHED_ABORTED = "finished_aborted"  # cancelled by the client

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI-style ``finish_reason`` ("stop" | "length" | "abort"), or None."""
        return _FINISH_REASON.get(self)


_FINISHED = frozenset(
    {SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH, SequenceStatus.FINISHED_ABORTED}
)
_FINISH_REASON = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}


class Sequence:
    """Token ids and KV bookkeeping for one generation stream.

    ``request`` is an opaque slot for the engine (sampling params, detokenizer
    state, output queue...); core code never looks inside it.
    """

    __slots__ = (
        "seq_id",
        "token_ids",
        "num_prompt_tokens",
        "num_computed_tokens",
        "num_cached_tokens",
        "_block_hashes",
        "status",
        "arrival_index",
        "max_tokens",
        "request",
        "samples_to_fork",
        "kv_budget",
        "num_evicted_blocks",
        "cache_salt",
        "conversation",
        "draft_token_ids",
        "draft_branches",
        "beam_group",
    )

    def __init__(
        self,
        seq_id: int,
        prompt_token_ids: Iterable[int],
        *,
        max_tokens: int | None = None,
        request: Any = None,
        arrival_index: int | None = None,
        num_samples: int = 1,
        kv_budget: int | None = None,
        cache_salt: str | None = None,
        conversation: str | None = None,
    ) -> None:
        token_ids = [int(t) for t in prompt_token_ids]
        if not token_ids:
            raise ValueError(f"prompt_token_ids must be non-empty (seq_id={seq_id})")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 or None, got {max_tokens!r}")
        self.seq_id: int = seq_id
        self.token_ids: list[int] = token_ids
        self.num_prompt_tokens: int = len(token_ids)
        self.num_computed_tokens: int = 0
        self.num_cached_tokens: int = 0
        #: (block size, chained prefix-cache hashes of the full blocks so far): extended lazily,
        #: valid because token_ids only ever grow
        self._block_hashes: tuple[int, list[bytes]] = (0, [])
        self.status: SequenceStatus = SequenceStatus.WAITING
        self.arrival_index: int = next(_arrival_counter) if arrival_index is None else arrival_index
        self.max_tokens: int | None = max_tokens
        self.request: Any = request
        #: parallel sampling (``n > 1``): siblings this sequence forks once its prompt is computed
        #: (see :meth:`Scheduler.fork_parallel_samples`); 0 once forked and for every child
        self.samples_to_fork: int = num_samples - 1
        #: KV budget in tokens (per layer; a multiple of the block size): once its tokens are all
        #: computed, the block manager evicts whole blocks to stay within it. None: keep everything
        self.kv_budget: int | None = kv_budget
        #: logical blocks evicted to stay within ``kv_budget`` (set by the scheduler after each step)
        self.num_evicted_blocks: int = 0
        #: only sequences with the same salt share prefix-cache blocks (None: all unsalted ones)
        self.cache_salt: str | None = cache_salt
        #: the conversation this turn belongs to: names the owner of the blocks it publishes
        self.conversation: str | None = conversation
        #: speculative decoding: tokens proposed to follow ``token_ids``, verified in the next
        #: decode step (never part of ``token_ids``, the prefix cache or the output until accepted)
        self.draft_token_ids: list[int] = []
        #: further proposals beside ``draft_token_ids`` (each one continuation after the last
        #: token), verified with it as one tree (``max_branches > 1``)
        self.draft_branches: list[list[int]] = []
        #: beam search: the id its request's beams share (None: not a beam); the scheduler
        #: preempts, swaps in and admits a group's sequences together
        self.beam_group: int | None = None

    # -- derived sizes -----------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Positions still needing a forward pass (1 for a decoding sequence)."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def num_blocks_needed(self, block_size: int) -> int:
        """Blocks needed to hold KV for every current token (ceil division)."""
        return -(-len(self.token_ids) // block_size)

    def block_hashes(self, block_size: int, num_blocks: int) -> list[bytes]:
        """The chained content hashes (:func:`~flexpage.core.block_pool.hash_block_tokens`) of
        this sequence's first ``num_blocks`` full blocks of ``block_size`` tokens, or more:
        the prefix cache's keys. Computed once per block, on demand."""
        if self._block_hashes[0] != block_size:
            self._block_hashes = (block_size, [])
        hashes = self._block_hashes[1]
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(hash_block_tokens(hashes[-1] if hashes else salted_root(self.cache_salt),
                                            self.token_ids[i * block_size : (i + 1) * block_size]))
        return hashes

    # -- mutation ----------------------------------------------------------
    def append_token(self, token_id: int) -> None:
        """Append a sampled token. Its KV is computed by the *next* step."""
        self.token_ids.append(int(token_id))

    def fork(self, seq_id: int) -> Sequence:
        """A copy with the same tokens and progress but no blocks yet.

        Pair with :meth:`BlockManager.fork` (or :meth:`Scheduler.fork`) to share
        the parent's blocks. The child keeps the parent's ``arrival_index`` (it
        is part of the same request) and shares the ``request`` object.
        """
        child = Sequence(
            seq_id,
            self.token_ids,
            max_tokens=self.max_tokens,
            request=self.request,
            arrival_index=self.arrival_index,
            kv_budget=self.kv_budget,
            cache_salt=self.cache_salt,
            conversation=self.conversation,
        )
        child.num_prompt_tokens = self.num_prompt_tokens
        child.num_computed_tokens = self.num_computed_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.num_evicted_blocks = self.num_evicted_blocks
        child._block_hashes = (self._block_hashes[0], list(self._block_hashes[1]))
        child.status = self.status
        child.beam_group = self.beam_group
        return child

    def __repr__(self) -> str:
        return (
            f"Sequence(seq_id={self.seq_id}, status={self.status.name}, tokens={self.num_tokens}, "
            f"prompt={self.num_prompt_tokens}, computed={self.num_computed_tokens})"
        )
