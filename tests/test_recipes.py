"""Every attention recipe, run paged and compiled, against independent dense formulas.

Each recipe in ``recipes/`` (and the compositions sliding window + soft-capping and
ALiBi + sliding window) is checked three ways:

1. its logical ``mask_mod``/``score_mod`` equal the hand-written formula in
   ``attention_reference`` (dense, no paging);
2. its ``block_rule`` is *conservative* (hypothesis): over random (query range, key range)
   pairs, ``may_see=False`` only where the dense mask is all False and ``sees_all=True``
   only where it is all True -- otherwise the kernel would skip visible pages or skip the
   mask on partly hidden ones;
3. one compiled ``FlexRunner`` call on a mixed decode + prefill batch with shuffled and
   shared pages agrees with the float64 reference.

A recipe defined here, in the test file, must work the same way without touching
``flexpage/`` (the promise of ``recipes/__init__``: recipes are plain logical programs).
The causal recipe itself is covered by ``test_paged_attention.py``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attention_reference import (
    Alibi,
    AttentionSinks,
    BatchSpec,
    Both,
    Causal,
    ChunkedLocal,
    DenseVariant,
    Documents,
    Geometry,
    PagedCase,
    PrefixLM,
    SlidingWindow,
    Softcap,
    alibi_slopes_reference,
    dense_mask,
    rel_err,
)
from flexpage.attention.recipe import Recipe, causal_rule, compose
from flexpage.recipes.alibi import alibi, alibi_slopes
from flexpage.recipes.attention_sinks import attention_sinks
from flexpage.recipes.causal import causal
from flexpage.recipes.chunked_local import chunked_local
from flexpage.recipes.document import document_mask
from flexpage.recipes.prefix_lm import prefix_lm
from flexpage.recipes.sliding_window import sliding_window
from flexpage.recipes.softcap import softcap

pytestmark = pytest.mark.usefixtures("compile_budget", "single_torch_thread")

PAGE_SIZE = 16
NUM_PAGES = 48
TABLE_WIDTH = 8
MAX_LEN = TABLE_WIDTH * PAGE_SIZE
GEOMETRY = Geometry("fp32-gqa6/2-d64", torch.float32, q_heads=6, kv_heads=2, head_dim=64, tol=1e-5)

# decode rows (32, 40), short prefill chunks (5, 5) and long ones (40, 33) in ONE call;
# rows 0/1 share page 0, rows 1/4 share pages 0-1; every table is a random permutation
MIXED = BatchSpec(
    "mixed",
    seq_lens=(32, 40, 48, 56, 96, 70),
    query_lens=(1, 1, 5, 5, 40, 33),
    shared_prefix=((0, 1, 1), (1, 4, 2)),
)
PREFILL = BatchSpec("prefill", seq_lens=(48, 70), query_lens=(48, 40))

# prefix-LM: per sequence; some prefixes end inside the new tokens (rows 4, 5), one covers
# the whole sequence (2), one is longer than the sequence (3), one is empty (1)
PREFIX_LENGTHS = [20, 0, 48, 60, 80, 50]

# packed documents: the first position of every document, per sequence. Row 0's decode token
# starts a document (it sees only itself); boundaries fall on page edges (16, 64) and inside
# the new tokens (44, 90, 38, 50)
DOCUMENT_STARTS = [[0, 10, 31], [0, 16, 20], [0, 44], [0, 8, 16, 50], [0, 30, 60, 64, 90], [0, 37, 38, 50]]


def document_ids(starts: list[list[int]], max_len: int) -> list[list[int]]:
    ids = []
    for row in starts:
        ids.append([sum(1 for s in row if s <= pos) - 1 for pos in range(max_len)])
    return ids


DOCUMENT_IDS = document_ids(DOCUMENT_STARTS, MAX_LEN)


# ---- a recipe written here, outside flexpage/ -----------------------------------------------


def dilated_mask(b, h, q_pos, kv_pos):
    """Causal, but only every third token back (q, q-3, q-6, ...)."""
    return (kv_pos <= q_pos) & ((q_pos - kv_pos) % 3 == 0)


def dilated_rule(b, q_lo, q_hi, kv_lo, kv_hi):
    may, _ = causal_rule(b, q_lo, q_hi, kv_lo, kv_hi)
    return may, may & (kv_lo == kv_hi) & (q_lo == q_hi) & ((q_lo - kv_lo) % 3 == 0)


def head_temperature(score, b, h, q_pos, kv_pos):
    """A tanh-free score mod: per-head temperature."""
    return score * (0.5 + 0.25 * h)


DILATED = Recipe("dilated3+head_temperature", mask_mod=dilated_mask, score_mod=head_temperature,
                 block_rule=dilated_rule)


class Dilated(DenseVariant):
    def mask(self, seq, q_pos, kv_pos):
        return (kv_pos <= q_pos) & ((q_pos - kv_pos) % 3 == 0)

    def scores(self, s, seq, q_pos, kv_pos):
        heads = torch.arange(s.shape[0], dtype=torch.float64)[:, None, None]
        return s * (0.5 + 0.25 * heads)


class DilatedMaskOnly(Dilated):
    def scores(self, s, seq, q_pos, kv_pos):
        return s


# ---- the recipes under test, each with its dense formula ---------------------------------


class Case:
    def __init__(self, name: str, recipe: Recipe, variant: DenseVariant, q_scale: float = 1.0):
        self.name, self.recipe, self.variant, self.q_scale = name, recipe, variant, q_scale

    def __str__(self) -> str:
        return self.name


CASES = [
    Case("alibi", alibi(6), Alibi(6)),
    Case("sliding_window", sliding_window(24), SlidingWindow(24)),
    Case("chunked_local", chunked_local(24), ChunkedLocal(24)),
    Case("attention_sinks", attention_sinks(20, 24), AttentionSinks(20, 24)),
    Case("softcap", softcap(2.0), Softcap(2.0), q_scale=4.0),
    Case("prefix_lm", prefix_lm(torch.tensor(PREFIX_LENGTHS)), PrefixLM(PREFIX_LENGTHS)),
    Case("document_mask", document_mask(torch.tensor(DOCUMENT_IDS)), Documents(DOCUMENT_IDS)),
    Case("sliding_window+softcap", compose(sliding_window(20), softcap(2.0)), Both(SlidingWindow(20), Softcap(2.0)),
         q_scale=4.0),
    Case("alibi+sliding_window", compose(alibi(6), sliding_window(20)), Both(Alibi(6), SlidingWindow(20))),
    Case("custom:dilated+head_temperature", DILATED, Dilated()),
]
CASE_IDS = [c.name for c in CASES]


def paged_case(case: Case, spec: BatchSpec = MIXED, *, recipe: Recipe | None = None, seed: int = 0) -> PagedCase:
    return PagedCase(spec, GEOMETRY, recipe or case.recipe, page_size=PAGE_SIZE, num_pages=NUM_PAGES,
                     width=TABLE_WIDTH, seed=seed, q_scale=case.q_scale)


# ---- 1. the logical programs equal the formulas -----------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_recipe_mask_and_score_equal_the_dense_formula(case: Case):
    """Evaluated densely at logical positions (no paging), the recipe is the formula."""
    heads = GEOMETRY.q_heads
    h = torch.arange(heads)[:, None, None]
    q_pos = torch.arange(MAX_LEN)[None, :, None]
    kv_pos = torch.arange(MAX_LEN)[None, None, :]
    g = torch.Generator().manual_seed(0)
    for seq in range(MIXED.num_seqs):
        b = torch.tensor(seq)
        want = case.variant.mask(seq, q_pos[0], kv_pos[0]).expand(heads, MAX_LEN, MAX_LEN)
        got = case.recipe.mask_mod(b, h, q_pos, kv_pos).expand(heads, MAX_LEN, MAX_LEN)
        assert torch.equal(got, want), f"{case}: mask differs for sequence {seq}"
        s = torch.randn(heads, MAX_LEN, MAX_LEN, generator=g, dtype=torch.float64) * 4
        want_s = case.variant.scores(s, seq, q_pos[0], kv_pos[0])
        got_s = s if case.recipe.score_mod is None else case.recipe.score_mod(s, b, h, q_pos, kv_pos)
        torch.testing.assert_close(got_s.double()[want], want_s[want], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("num_heads", [1, 2, 3, 4, 6, 8, 12, 16, 24])
def test_alibi_slopes_follow_the_paper(num_heads: int):
    torch.testing.assert_close(alibi_slopes(num_heads).double(),
                               torch.tensor(alibi_slopes_reference(num_heads), dtype=torch.float64))


# ---- 2. block rules are conservative --------------------------------------------------------


def _check_rule(case: Case, b: int, q_lo: int, q_hi: int, kv_lo: int, kv_hi: int) -> None:
    t = torch.tensor
    may, every = case.recipe.block_rule(t(b), t(q_lo), t(q_hi), t(kv_lo), t(kv_hi))
    visible = dense_mask(case.variant, b, torch.arange(q_lo, q_hi + 1), torch.arange(kv_lo, kv_hi + 1))
    if not bool(may):
        assert not visible.any(), f"{case}: may_see=False but q[{q_lo},{q_hi}] sees kv[{kv_lo},{kv_hi}] (b={b})"
    if bool(every):
        assert visible.all(), f"{case}: sees_all=True but q[{q_lo},{q_hi}] misses part of kv[{kv_lo},{kv_hi}] (b={b})"


ranges = st.tuples(st.integers(0, MAX_LEN - 1), st.integers(0, 40)).map(lambda t: (t[0], min(t[0] + t[1], MAX_LEN - 1)))


@pytest.mark.parametrize("case", CASES + [Case("causal", causal(), Causal())], ids=CASE_IDS + ["causal"])
@settings(max_examples=300, deadline=None)
@given(b=st.integers(0, MIXED.num_seqs - 1), q=ranges, kv=ranges)
def test_block_rule_is_conservative(case: Case, b: int, q: tuple[int, int], kv: tuple[int, int]):
    _check_rule(case, b, *q, *kv)


@pytest.mark.parametrize("case", CASES + [Case("causal", causal(), Causal())], ids=CASE_IDS + ["causal"])
def test_block_rule_is_conservative_on_the_page_grid(case: Case):
    """Exhaustively for page-aligned key ranges and single / 32-row query blocks, as the planner asks."""
    for b in range(MIXED.num_seqs):
        for kv_lo in range(0, MAX_LEN, PAGE_SIZE):
            for q_lo in range(0, MAX_LEN, 3):
                for rows in (1, 32):
                    _check_rule(case, b, q_lo, min(q_lo + rows - 1, MAX_LEN - 1), kv_lo, kv_lo + PAGE_SIZE - 1)


def test_block_rules_actually_prune_and_skip_masks():
    """Conservative is not vacuous: the causal and window rules find hidden and fully visible pages."""
    t = torch.tensor
    may, every = causal().block_rule(t(0), t(40), t(40), t(48), t(63))
    assert not may
    may, every = causal().block_rule(t(0), t(40), t(40), t(0), t(15))
    assert may and every
    may, every = sliding_window(8).block_rule(t(0), t(40), t(40), t(0), t(15))
    assert not may


# ---- 3. paged, compiled, mixed batch vs the reference ------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_recipe_paged_compiled_matches_reference(case: Case):
    step = paged_case(case)
    assert {g.q_len == 1 for g in step.batch.groups} == {True, False}, "decode and prefill rows in one call"
    ref = step.reference(case.variant)
    # the case is discriminating: the recipe changes the result compared to plain causal attention
    assert rel_err(ref, step.reference(Causal())) > 1e-2, f"{case}: indistinguishable from causal"
    err = rel_err(step.run(compile=True), ref)
    assert err < GEOMETRY.tol, f"{case}: relative error {err:.2e}"


def test_new_mask_recipe_without_block_rule_is_correct():
    """``Recipe``'s docstring: "the default :func:`unknown_rule` is always correct but visits
    every page". A user recipe that gives only a ``mask_mod`` must therefore be correct.

    BUG (flexpage/attention/recipe.py, ``Recipe.block_rule: BlockRule = causal_rule``): the
    actual default is ``causal_rule``, whose ``sees_all`` marks every page wholly before the
    query as fully visible, so the kernel skips the user's mask there and the dilated mask
    silently becomes plain causal attention on those pages.
    """
    recipe = Recipe("dilated-default-rule", mask_mod=dilated_mask)
    step = PagedCase(PREFILL, GEOMETRY, recipe, page_size=PAGE_SIZE, num_pages=NUM_PAGES, width=TABLE_WIDTH)
    err = rel_err(step.run(compile=True), step.reference(DilatedMaskOnly()))
    assert err < GEOMETRY.tol, f"relative error {err:.2e}"


# ---- bad recipe arguments ----------------------------------------------------------------------


def test_bad_recipe_arguments_are_rejected():
    with pytest.raises(ValueError, match=r"window: got 0, expected a positive int"):
        sliding_window(0)
    with pytest.raises(ValueError, match=r"cap: got 0.0, expected a positive number"):
        softcap(0.0)
    with pytest.raises(ValueError, match=r"slopes: got shape \(3,\), expected \(6,\)"):
        alibi(6, slopes=torch.ones(3))
