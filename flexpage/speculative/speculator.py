"""The engine's side of speculative decoding: what each decoding sequence proposes this step.

Before each step the engine calls :meth:`Speculator.propose` over the running sequences; it
sets ``seq.draft_token_ids`` (the scheduler verifies them in the sequence's decode slice when
the token budget and free blocks allow). After the step the engine reports each
verification (:meth:`Speculator.verified`), which adapts that sequence's k:

* **per sequence**: k returns to the configured k after a fully accepted proposal (a copy
  under way tends to go on; against growing k by one per step, 1.03x tokens/s on
  ``bench.speculative``'s grounded workload at batch 1 with k = 3 and with k = 10, medians of 5
  alternating rounds) and drops to one more than the accepted count otherwise; a proposal
  rejected outright makes the sequence
  skip proposing for 1, 2, 4, then 8 steps (up to 64 with a draft model; reset by any
  acceptance), so text with nothing worth copying costs the n-gram lookup and little else;
* **under load**: with more than ``disable_by_batch_size`` sequences decoding (vLLM's key of
  the same name), nothing is proposed: a batch of decodes already reads each weight once for
  many tokens, so extra rows cost compute the batch could spend on other sequences.

What a request never speculates on: a grammar (its matcher would have to accept and roll
back proposals), a KV budget (refused with the engine option, see :mod:`flexpage.features`),
``num_speculative_tokens=0`` in its :class:`~flexpage.sampling_params.SamplingParams`, and
its last token before ``max_tokens`` or ``max_model_len`` (no proposal runs past either).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence as Seq
from dataclasses import dataclass
from typing import Protocol

from flexpage.core.sequence import Sequence, SequenceStatus
from flexpage.speculative.config import SpeculativeConfig
from flexpage.speculative.ngram import NgramProposer

__all__ = ["Proposer", "Speculator"]

_log = logging.getLogger(__name__)

#: the most steps a sequence whose proposals keep failing waits before proposing again: prompt
#: lookup costs microseconds, a draft model a forward per proposed token plus catching up on
#: the tokens it skipped (``bench.speculative --draft-layers 4``: a draft that is almost never
#: right cost 0.86x at 8 steps)
MAX_BACKOFF = {"ngram": 8, "draft_model": 64}


@dataclass(slots=True)
class _Adaptive:
    k: int
    skip: int = 0  # steps left without proposing
    backoff: int = 0  # the next skip after a proposal rejected outright


class Proposer(Protocol):
    """What proposes tokens: :class:`~flexpage.speculative.ngram.NgramProposer` or
    :class:`~flexpage.speculative.draft_model.DraftModelProposer`."""

    def propose_chains(self, wanted: Seq[tuple[int, Seq[int], int]]) -> list[list[int]]:
        """Per ``(seq_id, token_ids, k)``, at most ``k`` tokens that may follow ``token_ids``."""
        ...

    def propose_branches(self, wanted: Seq[tuple[int, Seq[int], int]]) -> list[list[list[int]]]:
        """Per ``(seq_id, token_ids, k)``, up to ``max_branches`` distinct continuations of at
        most ``k`` tokens each, best first (prompt lookup only: a draft model proposes chains)."""
        ...

    def release(self, seq_id: int) -> None:
        """Forget a sequence that left the running batch."""
        ...

    def warm_up(self) -> None:
        """Build what the first proposals would otherwise wait for (a draft model's kernels)."""
        ...


class Speculator:
    """Proposals for decoding sequences, adapted per sequence and to the batch (see the module
    docstring); counts what it proposed and what was accepted."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, proposer: Proposer | None = None) -> None:
        """``proposer``: None for prompt lookup over ``config`` (a draft model's proposer is
        built by the engine, which knows the target's dtype and pool)."""
        self.config = config
        self.max_model_len = max_model_len
        self.proposer: Proposer = NgramProposer(config) if proposer is None else proposer
        self._state: dict[int, _Adaptive] = {}
        #: proposed tokens that were verified, and how many of them were accepted
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_verifications = 0
        #: verifications of several branches at once (``max_branches > 1``)
        self.num_tree_verifications = 0

    def propose(self, running: Iterable[Sequence]) -> None:
        """Set ``draft_token_ids`` of every running sequence (empty where nothing is proposed)."""
        running = list(running)
        decoding = [s for s in running if s.status is SequenceStatus.RUNNING and s.num_uncomputed_tokens == 1]
        live = {s.seq_id for s in running}
        for seq_id in [i for i in self._state if i not in live]:
            del self._state[seq_id]
            self.proposer.release(seq_id)
        for seq in running:
            seq.draft_token_ids, seq.draft_branches = [], []
        if len(decoding) > self.config.disable_by_batch_size:
            return
        wanted = [(seq, k) for seq in decoding if (k := self._k(seq))]
        asked = [(seq.seq_id, seq.token_ids, k) for seq, k in wanted]
        try:
            if self.config.max_branches > 1:
                proposals = self.proposer.propose_branches(asked)
            else:
                proposals = [[chain] for chain in self.proposer.propose_chains(asked)]
        except Exception:  # a draft model's forward failed: this step decodes without proposals
            _log.exception("speculative decoding: the proposer failed; this step proposes nothing")
            return
        for (seq, _), branches in zip(wanted, proposals):
            if branches and branches[0]:
                seq.draft_token_ids, seq.draft_branches = branches[0], branches[1:]

    def _k(self, seq: Sequence) -> int:
        """How many tokens ``seq`` may propose this step (0: none)."""
        request = seq.request
        params = getattr(request, "params", None)
        wanted = self.config.num_speculative_tokens
        if params is not None and params.num_speculative_tokens is not None:
            wanted = min(wanted, params.num_speculative_tokens)
        if not wanted or seq.kv_budget is not None or getattr(request, "grammars", None):
            return 0
        state = self._state.setdefault(seq.seq_id, _Adaptive(wanted))
        if state.skip:
            state.skip -= 1
            return 0
        room = self.max_model_len - seq.num_tokens - 1  # the token after the proposals needs a slot too
        if seq.max_tokens is not None:
            room = min(room, seq.max_tokens - seq.num_output_tokens - 1)
        return max(0, min(state.k, wanted, room))

    def verified(self, seq: Sequence, num_drafts: int, num_accepted: int, *, whole: bool | None = None,
                 tree: bool = False) -> None:
        """Record one verification of ``seq``'s ``num_drafts`` proposed tokens (here and in its
        request's ``speculation`` counts) and adapt its k. ``whole``: the accepted tokens were
        one whole branch (default: all ``num_drafts`` were accepted, as for a chain); ``tree``:
        several branches were verified."""
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        self.num_verifications += 1
        self.num_tree_verifications += tree
        counts = getattr(seq.request, "speculation", None)
        if counts is not None:
            counts.draft_tokens += num_drafts
            counts.accepted_tokens += num_accepted
            counts.verifications += 1
        state = self._state.get(seq.seq_id)
        if state is None:
            return
        if num_accepted == num_drafts if whole is None else whole:
            state.k = self.config.num_speculative_tokens
        else:
            state.k = max(1, num_accepted + 1)
        if num_accepted:
            state.backoff = 0
        else:
            state.backoff = min(MAX_BACKOFF[self.config.method], max(1, 2 * state.backoff))
            state.skip = state.backoff

    @property
    def acceptance_rate(self) -> float:
        """Accepted / verified proposed tokens (0.0 before any verification)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
