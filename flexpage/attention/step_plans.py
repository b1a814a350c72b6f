"""Plans of consecutive steps: a decode step that only adds one token to each row of the last
one reuses the last step's plan instead of building it anew.

Why: :func:`~flexpage.attention.paging.build_paged_batch` is ~60 small numpy and torch
operations whatever the batch: ~0.3 ms a step on its own and ~0.5 ms inside a batch-1 decode
step of SmolLM2-135M (~10 ms), whose projections push its data out of the caches. Between
two such steps the plan changes only in each row's length, unless a row's new token opens a
page or fills one (then which pages it sees, and which it sees whole, change too).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from torch import Tensor

from flexpage.attention.paging import PagedBatch, build_paged_batch
from flexpage.attention.recipe import Recipe, causal_rule

__all__ = ["StepPlans"]


@dataclasses.dataclass(frozen=True)
class _Planned:
    tables: np.ndarray
    seq_lens: np.ndarray
    options: dict[str, Any]
    batch: PagedBatch


class StepPlans:
    """:func:`~flexpage.attention.paging.build_paged_batch` for a sequence of steps, keyed by
    whatever tells the plans of one step apart (a recipe and its layer group).

    A step is *carried forward* from the last one of its key when every row decodes in both,
    the block tables are the same, each row's length is one more, the recipe's block rule is
    the plain causal one (``causal_rule``: what a row sees then depends on its length alone)
    and no row's new token is the first or the last of its page. Such a step's plan is the
    last one with each row's length, query start, position and slot one further: the same
    pages seen, the same pages seen whole, the same kernel rows (so also the same thread
    layout: only speed depends on it, and the next plan built anew balances it again).
    Deterministic plans, evicted pages and the virtual layout's rows are always built anew.
    """

    def __init__(self) -> None:
        self._last: dict[object, _Planned] = {}

    def plan(self, key: object, block_tables: Tensor, seq_lens: Tensor, query_lens: Tensor, *, recipe: Recipe,
             **options: Any) -> PagedBatch:
        """The plan :func:`build_paged_batch` gives for these arguments (``recipe`` and
        ``options`` as it takes them), carried forward from the last plan of ``key`` where it
        can be."""
        tables, lens = block_tables.numpy(), seq_lens.numpy()
        options = {"recipe": recipe, **options}
        last = self._last.get(key)
        batch = None
        if last is not None and _carries_forward(last, tables, lens, query_lens.numpy(), options):
            batch = _one_token_further(last.batch)
        if batch is None:
            batch = build_paged_batch(block_tables, seq_lens, query_lens, **options)
        self._last[key] = _Planned(tables.copy(), lens.copy(), options, batch)
        return batch


def _carries_forward(last: _Planned, tables: np.ndarray, seq_lens: np.ndarray, query_lens: np.ndarray,
                     options: dict[str, Any]) -> bool:
    if options != last.options or options["recipe"].block_rule is not causal_rule:
        return False
    if any(options.get(flag, False) for flag in ("deterministic", "evicted_pages", "contiguous_rows")):
        return False
    if len(last.batch.groups) != 1 or last.batch.groups[0].q_len != 1:  # the last step decoded only
        return False
    if seq_lens.shape != last.seq_lens.shape or tables.shape != last.tables.shape or not (query_lens == 1).all():
        return False
    if not (seq_lens == last.seq_lens + 1).all() or not np.array_equal(tables, last.tables):
        return False
    offset = (seq_lens - 1) % options["page_size"]  # of each new token in its page
    return not ((offset == 0) | (offset == options["page_size"] - 1)).any()


def _one_token_further(batch: PagedBatch) -> PagedBatch:
    """``batch``, a decode-only plan, with every row one token longer (padding rows stay empty)."""
    group = batch.groups[0]
    real = (group.seq_len > 0).to(group.seq_len.dtype)
    group = dataclasses.replace(group, seq_len=group.seq_len + real, q_start=group.q_start + real)
    return dataclasses.replace(batch, groups=(group,), positions=batch.positions + 1, slots=batch.slots + 1)
