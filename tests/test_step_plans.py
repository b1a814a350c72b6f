"""Plans carried from one decode step to the next (flexpage.attention.step_plans) are the plans
``build_paged_batch`` builds for the same step, field for field; steps that change more than
each row's length are built anew."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import flexpage.attention.step_plans as step_plans
from flexpage.attention.paging import AttentionGroup, PagedBatch, build_paged_batch
from flexpage.attention.step_plans import StepPlans
from flexpage.recipes.causal import causal
from flexpage.recipes.sliding_window import sliding_window

PAGE_SIZE = 4
NUM_PAGES = 64


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the plans StepPlans builds anew (the rest it carries forward)."""
    built: list[int] = []

    def counted(*args, **kwargs) -> PagedBatch:
        built.append(1)
        return build_paged_batch(*args, **kwargs)

    monkeypatch.setattr(step_plans, "build_paged_batch", counted)
    return built


def tables_for(rows: int, pages_per_row: int, seed: int) -> torch.Tensor:
    """Shuffled pages (never the null page 0), each row's table already holding the pages it grows into."""
    pages = torch.randperm(NUM_PAGES - 1, generator=torch.Generator().manual_seed(seed))[: rows * pages_per_row] + 1
    return pages.view(rows, pages_per_row).to(torch.int32)


def assert_same_plan(got: PagedBatch, want: PagedBatch) -> None:
    for field in dataclasses.fields(PagedBatch):
        a, b = getattr(got, field.name), getattr(want, field.name)
        if field.name == "groups":
            assert len(a) == len(b)
            for group_a, group_b in zip(a, b):
                for group_field in dataclasses.fields(AttentionGroup):
                    x, y = getattr(group_a, group_field.name), getattr(group_b, group_field.name)
                    if isinstance(x, torch.Tensor):
                        assert x.dtype == y.dtype and torch.equal(x, y), group_field.name
                    else:
                        assert x == y, group_field.name
        elif isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b), field.name
        else:
            assert a == b, field.name


@pytest.mark.parametrize("pages_per_block", [1, 2])
@pytest.mark.parametrize(("first_lens", "num_threads"), [((1, 6, 13), 1), ((9, 9, 9, 9), 2), ((3, 18), None)])
def test_decode_steps_carried_forward_equal_plans_built_anew(builds: list[int], pages_per_block: int,
                                                             first_lens: tuple[int, ...], num_threads: int | None):
    """Rows decoding one token a step through several pages: every step's plan is the one
    build_paged_batch gives, and the steps whose new tokens neither open nor fill a page are
    carried forward (not built)."""
    plans = StepPlans()
    tables = tables_for(len(first_lens), pages_per_row=8, seed=len(first_lens))
    options = dict(page_size=PAGE_SIZE, num_pages=NUM_PAGES, recipe=causal(), pages_per_block=pages_per_block,
                   num_threads=num_threads)
    lens = np.array(first_lens)
    expected_builds = 0
    for step in range(12):
        seq_lens, query_lens = torch.from_numpy(lens.copy()), torch.ones(len(lens), dtype=torch.int64)
        got = plans.plan("layer group 0", tables, seq_lens, query_lens, **options)
        assert_same_plan(got, build_paged_batch(tables, seq_lens, query_lens, **options))
        offsets = (lens - 1) % PAGE_SIZE
        expected_builds += step == 0 or bool(((offsets == 0) | (offsets == PAGE_SIZE - 1)).any())
        lens = lens + 1
    assert len(builds) == expected_builds < 12


def test_steps_that_change_more_than_lengths_are_built_anew(builds: list[int]):
    """A prefill row, two tokens at once, another block table, another recipe or another key:
    each step is planned by build_paged_batch, not carried (8-token pages: no new token below
    opens or fills one)."""
    plans = StepPlans()
    tables = tables_for(2, pages_per_row=4, seed=0)
    window = sliding_window(8)
    options = dict(page_size=8, num_pages=NUM_PAGES, pages_per_block=1)

    def plan(lens: tuple[int, int], *, table: torch.Tensor = tables, query_lens: tuple[int, int] = (1, 1),
             recipe=causal(), key: str = "a") -> None:
        seq_lens, new_tokens = torch.tensor(lens), torch.tensor(query_lens)
        got = plans.plan(key, table, seq_lens, new_tokens, recipe=recipe, **options)
        assert_same_plan(got, build_paged_batch(table, seq_lens, new_tokens, recipe=recipe, **options))

    plan((2, 10))
    plan((3, 11))  # carried
    plan((4, 13), query_lens=(1, 2))  # a prefill row
    plan((5, 14))  # after a step that did not only decode
    plan((6, 15))  # carried
    plan((8, 17))  # two tokens further
    plan((9, 18), table=tables.flip(0).contiguous())  # another table
    plan((10, 19), recipe=window)  # another recipe
    plan((11, 20), recipe=window)  # a rule other than the plain causal one
    plan((12, 21), key="b")  # no earlier plan under this key
    plan((13, 22), key="b")  # carried
    assert len(builds) == 8
