"""Prompt lookup: propose the tokens that followed the last time the sequence's ending occurred.

Saxena, "Prompt Lookup Decoding", 2023 (https://github.com/apoorvumang/prompt-lookup-decoding),
as vLLM's ``ngram`` method: take the sequence's last ``n`` tokens, for ``n`` from
``prompt_lookup_max`` down to ``prompt_lookup_min``; the longest ``n`` that also occurs
earlier in the prompt or output wins, and the ``k`` tokens after that occurrence are the
proposal. Text that copies from its input (summaries, rewrites, code edits, quotes) repeats
long runs, so the target model then accepts several tokens per forward pass.

Where an n-gram occurred several times, each occurrence may continue differently: with
``max_branches > 1`` the distinct continuations become branches of a :class:`DraftTree`,
verified together in one step. Order: longer matched n-grams first, and among equal ones
the **most recent** occurrence first (vLLM takes the earliest; the most recent is the
better guess in edited or repeated text, where the latest version is the one being copied).
A continuation cut short by the end of the sequence gives way to a longer one it is a
prefix of.

Cost: one vectorised pass over the sequence per call, O(L) for L tokens, plus O(m * n) for
the m earlier occurrences of the last token; at 4k tokens numpy's per-call overhead
dominates. ``python -m bench.ngram_proposer`` (4,096 tokens and growing, 49,152-token
vocabulary, k = 4, n in [2, 4], one or four branches alike): 49 us per call where a
passage is being copied, 9 us with nothing to copy, 134 us for a 7-token pattern repeated
585 times (a shared 2-vCPU Intel Xeon VM under load: upper bounds).
The token ids live in a per-sequence numpy mirror (:class:`SequenceTokens`) that copies only
the tokens appended since the last call, so a long prompt is converted once, not per step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from flexpage.speculative.config import SpeculativeConfig
from flexpage.speculative.tree import DraftTree

__all__ = ["NgramProposer", "SequenceTokens", "find_continuations"]


def find_continuations(tokens: np.ndarray, *, min_n: int, max_n: int, k: int,
                       max_branches: int = 1) -> list[list[int]]:
    """Up to ``max_branches`` distinct continuations (each 1..k tokens) of the longest suffix
    n-gram of ``tokens`` (``min_n <= n <= max_n``) that occurred earlier, best first.

    ``tokens``: 1-D int array, prompt then output. The earlier occurrence may overlap the
    suffix itself (``a b a b a`` continues its ``a b a`` with ``b a``), as in vLLM.
    """
    length = tokens.shape[0]
    if k < 1 or length < min_n + 1:
        return []
    # ends: where an earlier occurrence of the last token ends; matched: how many tokens of
    # the suffix match backwards from there (at most max_n)
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
    if not ends.shape[0]:
        return []
    back = np.arange(min(max_n, length - 1) + 1)
    index = ends[:, None] - back  # [m, n + 1]
    same = (index >= 0) & (tokens[np.maximum(index, 0)] == tokens[length - 1 - np.minimum(back, length - 1)])
    same[:, -1] = False  # a sentinel: the first mismatch is the matched length, at most max_n
    matched = same.argmin(axis=1)
    keep = matched >= min_n
    if not keep.any():
        return []
    ends, matched = ends[keep], matched[keep]
    order = np.lexsort((-ends, -matched))  # longest match first, then most recent
    best = int(ends[order[0]])
    if max_branches == 1 and best + k < length:  # k tokens follow the best match: no other can replace it
        return [tokens[best + 1 : best + 1 + k].tolist()]
    branches: list[list[int]] = []
    _add_distinct(branches, _continuations(tokens, ends[order], k), k, max_branches)
    return branches


def _continuations(tokens: np.ndarray, ends: np.ndarray, k: int) -> np.ndarray:
    """``[m, k]`` the tokens after each end, -1 past the sequence's end."""
    index = ends[:, None] + 1 + np.arange(k)
    return np.where(index < tokens.shape[0], tokens[np.minimum(index, tokens.shape[0] - 1)], -1)


def _add_distinct(branches: list[list[int]], rows: np.ndarray, k: int, max_branches: int) -> None:
    """Take ``rows`` in order: a new one is appended, one extending a shorter chosen branch
    replaces it in place, a prefix of a chosen one is dropped. Each row taken removes its
    duplicates at once (repetitive text has thousands), so this loops about
    ``max_branches`` + (rows cut short, at most k) times."""
    while rows.shape[0] and not (len(branches) == max_branches and all(len(b) == k for b in branches)):
        first, rows = rows[0], rows[1:]
        rows = rows[(rows != first).any(axis=1)]
        row = first.tolist()
        row = row[: row.index(-1)] if -1 in row else row
        for i, chosen in enumerate(branches):
            if row[: len(chosen)] == chosen:  # extends a chosen branch
                branches[i] = row
                break
            if chosen[: len(row)] == row:  # a prefix of a chosen branch: nothing new
                break
        else:
            if len(branches) < max_branches:
                branches.append(row)


class SequenceTokens:
    """A numpy mirror of one sequence's growing token list, updated by appending only.

    Why: converting a 4k-token Python list to numpy costs more than the whole lookup; a
    sequence's tokens only grow (rejected proposals are never appended), so each call copies
    just the new tail. If the list was changed in place (it no longer extends the mirror),
    the mirror is rebuilt.
    """

    def __init__(self) -> None:
        self._buffer = np.empty(256, dtype=np.int32)
        self._size = 0

    def sync(self, token_ids: Sequence[int]) -> np.ndarray:
        """The tokens as an int32 array view (valid until the next call)."""
        total = len(token_ids)
        if total < self._size or (self._size and token_ids[self._size - 1] != self._buffer[self._size - 1]):
            self._size = 0
        if total > self._buffer.shape[0]:
            grown = np.empty(max(total, 2 * self._buffer.shape[0]), dtype=np.int32)
            grown[: self._size] = self._buffer[: self._size]
            self._buffer = grown
        if total > self._size:
            self._buffer[self._size : total] = token_ids[self._size : total]
            self._size = total
        return self._buffer[:total]


class NgramProposer:
    """Prompt-lookup proposals for every running sequence, one :class:`SequenceTokens` each."""

    def __init__(self, config: SpeculativeConfig) -> None:
        if config.method != "ngram":
            raise ValueError(f"method: got {config.method!r}, NgramProposer needs 'ngram'")
        self.config = config
        self._sequences: dict[int, SequenceTokens] = {}

    def propose(self, seq_id: int, token_ids: Sequence[int], *, k: int | None = None) -> DraftTree:
        """The draft tree for sequence ``seq_id`` (prompt + output ``token_ids``), rooted at its
        last token; a root-only tree when nothing matched. ``k`` lowers the configured
        ``num_speculative_tokens`` (the room left before ``max_tokens``, an adaptive k)."""
        cfg = self.config
        k = cfg.num_speculative_tokens if k is None else min(k, cfg.num_speculative_tokens)
        tokens = self._sequences.setdefault(seq_id, SequenceTokens()).sync(token_ids)
        branches = find_continuations(tokens, min_n=cfg.prompt_lookup_min, max_n=cfg.prompt_lookup_max, k=k,
                                      max_branches=cfg.max_branches)
        return DraftTree.from_branches(int(token_ids[-1]), branches)

    def propose_chains(self, wanted: Sequence[tuple[int, Sequence[int], int]]) -> list[list[int]]:
        """Per ``(seq_id, token_ids, k)``, the best continuation's tokens (empty: no match)."""
        return [branches[0] if branches else [] for branches in self.propose_branches(wanted)]

    def propose_branches(self, wanted: Sequence[tuple[int, Sequence[int], int]]) -> list[list[list[int]]]:
        """Per ``(seq_id, token_ids, k)``, the distinct continuations, best first (empty: no match)."""
        return [self.propose(seq_id, token_ids, k=k).branches() for seq_id, token_ids, k in wanted]

    def warm_up(self) -> None:
        """Nothing to build: prompt lookup runs no model."""

    def release(self, seq_id: int) -> None:
        """Forget a finished or preempted sequence's mirror."""
        self._sequences.pop(seq_id, None)
