"""Draft trees and the tree-attention recipe (``recipes/tree_verification.py``).

A proposed token sees the whole prefix, its ancestors and itself, nothing else. Checked
three ways, each against something written independently of the recipe:

1. dense masks over positions: a chain tree is exactly the causal mask (alone and composed
   with a sliding window); a branching tree is the mask its parent pointers spell;
2. the block rule is conservative on the page grid;
3. attention itself: ``flex_attention`` in eager mode on one branching tree against a float64
   softmax over keys listed by hand, and a paged batch (trees, a decode row and a prefill
   chunk, shuffled pages) against ``attention_reference``'s float64 oracle -- also with the
   layer's own recipe (sliding window, ALiBi) evaluated at the nodes' text positions.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from attention_reference import Alibi, BatchSpec, Both, DenseVariant, Geometry, PagedCase, SlidingWindow, rel_err
from flexpage.attention.recipe import compose
from flexpage.recipes.alibi import alibi
from flexpage.recipes.sliding_window import sliding_window
from flexpage.recipes.tree_verification import tree_verification
from flexpage.speculative.tree import DraftTree, mask_tables

pytestmark = pytest.mark.usefixtures("single_torch_thread")

# root 3 -> 7 -> 8 -> {9, 5}, root -> 4     (nodes 0..5: tokens 3 7 8 9 5 4)
BRANCHY = DraftTree.from_branches(3, [[7, 8, 9], [7, 8, 5], [4]])


# ---- the tree itself -------------------------------------------------------------------------


def test_branches_merge_into_a_trie_depth_first_first_branch_first():
    assert BRANCHY.tokens == (3, 7, 8, 9, 5, 4)
    assert BRANCHY.parents == (-1, 0, 1, 2, 2, 0)
    assert BRANCHY.depths().tolist() == [0, 1, 2, 3, 3, 1]
    assert BRANCHY.child_lists() == [[1, 5], [2], [3, 4], [], [], []]
    assert BRANCHY.branches() == [[7, 8, 9], [7, 8, 5], [4]]
    assert BRANCHY.proposals == (7, 8, 9, 5, 4)
    assert DraftTree.from_branches(3, [[7, 8]]) == DraftTree.chain(3, [7, 8]) == DraftTree((3, 7, 8), (-1, 0, 1))
    assert DraftTree.from_branches(3, []) == DraftTree((3,), (-1,))
    assert DraftTree.from_branches(3, [[7, 8], [7, 8]]).num_nodes == 3  # duplicates merge


def test_ancestor_table_of_the_docstring_picture():
    assert BRANCHY.ancestors().astype(int).tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 0, 1, 0],  # node 4 (token 5) does not see its sibling 3
        [1, 0, 0, 0, 0, 1],
    ]


def test_malformed_trees_are_refused():
    with pytest.raises(ValueError, match=r"parents\[0\]: got 0, expected -1"):
        DraftTree((1, 2), (0, 0))
    with pytest.raises(ValueError, match=r"parents\[2\]: got 2, expected a node in \[0, 2\)"):
        DraftTree((1, 2, 3), (-1, 0, 2))
    with pytest.raises(ValueError, match=r"got 2 tokens and 1 parents"):
        DraftTree((1, 2), (-1,))


def test_mask_tables_pad_each_tree_and_give_rows_without_one_a_root():
    ancestors, depths = mask_tables([DraftTree.chain(1, [2]), None, BRANCHY], max_nodes=6)
    assert ancestors.shape == (3, 6, 6) and depths.shape == (3, 6)
    assert ancestors[0, :2, :2].tolist() == [[True, False], [True, True]] and not ancestors[0, 2:].any()
    assert ancestors[1].sum() == 1 and ancestors[1, 0, 0]
    assert (ancestors[2] == BRANCHY.ancestors()).all() and depths[2].tolist() == [0, 1, 2, 3, 3, 1]
    with pytest.raises(ValueError, match=r"trees\[0\]: 6 nodes, expected at most max_nodes=4"):
        mask_tables([BRANCHY], max_nodes=4)


# ---- dense masks over positions -----------------------------------------------------------------


def recipe_for(trees: list[DraftTree | None], starts: list[int], *, inner=None, max_nodes: int = 8):
    ancestors, depths = mask_tables(trees, max_nodes)
    return tree_verification(torch.tensor(starts), torch.from_numpy(ancestors), torch.from_numpy(depths), inner=inner)


def dense(recipe, seq: int, length: int) -> torch.Tensor:
    """``[length, length]`` the recipe's mask over all positions of sequence ``seq``."""
    q = torch.arange(length)[:, None]
    kv = torch.arange(length)[None, :]
    return recipe.mask_mod(torch.tensor(seq), torch.tensor(0), q, kv).expand(length, length)


def allowed_by_parents(tree: DraftTree, start: int, length: int, window: int | None = None) -> torch.Tensor:
    """The tree mask written from the parent pointers alone: before the tree causal; a node
    sees the prefix and every node on its walk up to the root. ``window`` counts back from
    text positions: a node's is ``start`` + its depth (the steps of that walk)."""
    mask = torch.zeros(length, length, dtype=torch.bool)
    for q in range(length):
        if q < start:
            mask[q, : q + 1] = True
            continue
        mask[q, :start] = True
        walk = q - start
        while walk >= 0:
            mask[q, start + walk] = True
            walk = tree.parents[walk]
    if window is not None:
        text = torch.tensor([pos if pos < start else start + _depth(tree, pos - start) for pos in range(length)])
        mask &= text[:, None] - text[None, :] < window
    return mask


def _depth(tree: DraftTree, node: int) -> int:
    depth = 0
    while tree.parents[node] >= 0:
        node, depth = tree.parents[node], depth + 1
    return depth


def test_a_chain_tree_is_exactly_the_causal_mask():
    """Over every position of each sequence (the prefix, then its nodes: nothing lies past
    the last node in a verification step)."""
    chains = [DraftTree.chain(1, [2, 3, 4]), DraftTree.chain(1, [5]), DraftTree.chain(1, [])]
    starts = [10, 3, 0]
    recipe = recipe_for(chains, starts)
    for seq, (tree, start) in enumerate(zip(chains, starts)):
        length = start + tree.num_nodes
        assert torch.equal(dense(recipe, seq, length), torch.ones(length, length, dtype=torch.bool).tril())


def test_a_chain_tree_composed_with_a_sliding_window_is_the_sliding_window():
    recipe = compose(recipe_for([DraftTree.chain(1, [2, 3, 4, 5])], starts=[9]), sliding_window(4))
    positions = torch.arange(14)
    want = (positions[:, None] >= positions[None, :]) & (positions[:, None] - positions[None, :] < 4)
    assert torch.equal(dense(recipe, 0, 14), want)


def test_a_branching_tree_is_the_mask_its_parents_spell():
    recipe = recipe_for([BRANCHY, BRANCHY], starts=[7, 2])
    for seq, start in enumerate((7, 2)):
        length = start + BRANCHY.num_nodes
        assert torch.equal(dense(recipe, seq, length), allowed_by_parents(BRANCHY, start, length)), f"start {start}"
    assert dense(recipe, 0, 13)[7 + 4].tolist() == [True] * 7 + [True, True, True, False, True, False]


def test_rows_before_the_tree_are_causal():
    """A prefill chunk or a sequence verifying nothing: tree_start past its last query."""
    recipe = recipe_for([None, BRANCHY], starts=[100, 12])
    assert torch.equal(dense(recipe, 0, 30), torch.ones(30, 30, dtype=torch.bool).tril())
    assert torch.equal(dense(recipe, 1, 12), torch.ones(12, 12, dtype=torch.bool).tril())


def test_inner_recipe_sees_text_positions():
    """Sliding window 3 inside the tree: node 4 (token 5, depth 3, text position start+3) sees
    back to start+1 in text positions, i.e. nodes 1 and 2 and itself, not the root."""
    start = 6  # 12 positions: the prefix, then the 6 nodes
    recipe = recipe_for([BRANCHY], starts=[start], inner=sliding_window(3))
    want = allowed_by_parents(BRANCHY, start, 12, window=3)
    assert torch.equal(dense(recipe, 0, 12), want)
    assert dense(recipe, 0, 12)[start + 4].nonzero().flatten().tolist() == [start + 1, start + 2, start + 4]
    # in storage positions node 4 sits at start+4: a plain composition would hide node 1 from it
    storage = dense(compose(recipe_for([BRANCHY], starts=[start]), sliding_window(3)), 0, 12)
    assert storage[start + 4].nonzero().flatten().tolist() == [start + 2, start + 4]


def test_inner_recipe_needs_depths():
    with pytest.raises(ValueError, match=r"depths: got None, expected shape \(1, 6\) with inner"):
        tree_verification(torch.tensor([0]), torch.from_numpy(BRANCHY.ancestors()[None]), inner=sliding_window(4))
    with pytest.raises(ValueError, match=r"ancestors: got shape \(6, 6\), expected \[S, T, T\]"):
        tree_verification(torch.tensor([0]), torch.from_numpy(BRANCHY.ancestors()))


# ---- the block rule is conservative ---------------------------------------------------------------


@pytest.mark.parametrize("inner", [None, sliding_window(3)], ids=["tree", "tree+window"])
def test_block_rule_is_conservative_on_the_page_grid(inner):
    starts = [5, 16, 40]  # the tree starts mid-page, on a page edge, past every query (no tree)
    trees = [BRANCHY, BRANCHY, None]
    recipe = recipe_for(trees, starts, inner=inner)
    t = torch.tensor
    for seq, start in enumerate(starts):
        full = dense(recipe, seq, 32)
        for kv_lo in range(0, 32, 4):
            for q_lo in range(32):
                for rows in (1, 8):
                    q_hi, kv_hi = min(q_lo + rows - 1, 31), kv_lo + 3
                    may, every = recipe.block_rule(t(seq), t(q_lo), t(q_hi), t(kv_lo), t(kv_hi))
                    seen = full[q_lo : q_hi + 1, kv_lo : kv_hi + 1]
                    assert bool(may) or not seen.any(), f"seq {seq}: skips a visible page q[{q_lo},{q_hi}] kv{kv_lo}"
                    assert not bool(every) or seen.all(), f"seq {seq}: skips the mask on q[{q_lo},{q_hi}] kv{kv_lo}"


def test_block_rule_still_prunes_and_marks_whole_prefix_pages():
    recipe = recipe_for([BRANCHY], starts=[16])
    t = torch.tensor
    assert recipe.block_rule(t(0), t(16), t(21), t(0), t(7)) == (True, True)  # the prefix: wholly visible
    may, every = recipe.block_rule(t(0), t(16), t(21), t(16), t(19))
    assert may and not every  # the tree's own page: the mask runs
    assert not recipe.block_rule(t(0), t(16), t(17), t(24), t(31))[0]  # past the tree


# ---- attention: flex_attention eager, and a paged batch ------------------------------------------


def test_flex_attention_over_a_branching_tree_matches_softmax_over_hand_listed_keys():
    """One sequence, 5 prefix tokens then BRANCHY's 6 nodes at positions 5..10."""
    prefix, heads, dim = 5, 2, 8
    length = prefix + BRANCHY.num_nodes
    sees = {0: [0], 1: [0, 1], 2: [0, 1, 2], 3: [0, 1, 2, 3], 4: [0, 1, 2, 4], 5: [0, 5]}  # node: tree nodes
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, length, dim, generator=g, dtype=torch.float64) for _ in range(3))
    recipe = recipe_for([BRANCHY], starts=[prefix], max_nodes=6)
    block_mask = create_block_mask(recipe.mask_mod, 1, 1, length, length, device="cpu", BLOCK_SIZE=4)
    out = flex_attention(q, k, v, block_mask=block_mask)
    for node, seen in sees.items():
        keys = list(range(prefix)) + [prefix + j for j in seen]
        row = prefix + node
        scores = (q[0, :, row] [:, None, :] * k[0, :, keys]).sum(-1) / math.sqrt(dim)  # [H, keys]
        want = torch.softmax(scores, dim=-1)[:, None, :] @ v[0, :, keys]
        torch.testing.assert_close(out[0, :, row], want[:, 0], rtol=1e-10, atol=1e-10)


class TreeVariant(DenseVariant):
    """The dense oracle of one batch: per sequence a tree (or None) whose root sits at
    ``starts[seq]``; ``window``/``slopes`` (optional) at text positions."""

    def __init__(self, trees, starts, window=None, alibi_heads=None):
        self.trees, self.starts, self.window = trees, starts, window
        self.alibi = Alibi(alibi_heads) if alibi_heads else None

    def text(self, seq: int, pos: torch.Tensor) -> torch.Tensor:
        start, tree = self.starts[seq], self.trees[seq]
        if tree is None:
            return pos
        depth = torch.tensor([_depth(tree, n) for n in range(tree.num_nodes)])
        return torch.where(pos < start, pos, start + depth[(pos - start).clamp(0, tree.num_nodes - 1)])

    def mask(self, seq, q_pos, kv_pos):
        tree, start = self.trees[seq], self.starts[seq]
        length = int(max(q_pos.max(), kv_pos.max())) + 1
        full = torch.ones(length, length, dtype=torch.bool).tril() if tree is None else \
            allowed_by_parents(tree, start, length, window=self.window)
        if tree is None and self.window is not None:
            full &= SlidingWindow(self.window).mask(seq, torch.arange(length)[:, None], torch.arange(length)[None, :])
        return full[q_pos, kv_pos]

    def scores(self, s, seq, q_pos, kv_pos):
        return s if self.alibi is None else self.alibi.scores(s, seq, self.text(seq, q_pos), self.text(seq, kv_pos))


TINY = Geometry("fp32-gqa2/1-d16", torch.float32, q_heads=2, kv_heads=1, head_dim=16, tol=1e-5)
# seq 0: 21 cached tokens then BRANCHY (6 rows, root at 21); seq 1: a decode row; seq 2: a chain
# of 4 nodes rooted at 30; seq 3: a prefill chunk of 9 tokens, no tree
TREE_BATCH = BatchSpec("trees+decode+prefill", seq_lens=(27, 19, 34, 40), query_lens=(6, 1, 4, 9))
TREES = [BRANCHY, None, DraftTree.chain(2, [6, 7, 8]), None]
STARTS = [21, 18, 30, 40]


def paged_tree_case(recipe) -> PagedCase:
    return PagedCase(TREE_BATCH, TINY, recipe, page_size=4, num_pages=48, width=12, seed=3)


def test_paged_batch_of_trees_matches_the_float64_oracle():
    step = paged_tree_case(recipe_for(TREES, STARTS))
    want = step.reference(TreeVariant(TREES, STARTS))
    assert rel_err(want, step.reference()) > 1e-2, "the tree mask must change the result"
    err = rel_err(step.run(compile=False), want)
    assert err < TINY.tol, f"relative error {err:.2e}"


@pytest.mark.parametrize("inner, variant", [
    (sliding_window(5), TreeVariant(TREES, STARTS, window=5)),
    (alibi(2), TreeVariant(TREES, STARTS, alibi_heads=2)),
], ids=["sliding_window", "alibi"])
def test_paged_batch_with_the_layers_own_recipe_at_text_positions(inner, variant):
    step = paged_tree_case(recipe_for(TREES, STARTS, inner=inner))
    want = step.reference(variant)
    err = rel_err(step.run(compile=False), want)
    assert err < TINY.tol, f"relative error {err:.2e}"
    # the plain composition measures in storage positions: wrong for the branching tree
    storage = paged_tree_case(compose(recipe_for(TREES, STARTS), inner)).run(compile=False)
    assert rel_err(storage, want) > 1e-3
