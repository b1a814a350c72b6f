"""Tree verification: each proposed token sees the prefix, its ancestors and itself.

Miao et al., "SpecInfer: Accelerating Large Language Model Serving with Tree-based
Speculative Inference and Verification", 2024, https://arxiv.org/abs/2305.09781 (tree
attention); Cai et al., "Medusa", 2024, https://arxiv.org/abs/2401.10774.

A draft tree of sequence ``b`` runs as query rows ``tree_start[b] + i``, node ``i`` at
*storage* position ``tree_start[b] + i`` (where its K/V is written), parents before
children. The mask is one table lookup::

    q \\ kv   prefix   0  1  2  3        tree 0 ─ 1 ─ 2
    node 0     all     x                        └── 3
    node 1     all     x  x
    node 2     all     x  x  x
    node 3     all     x  x     x         (node 3 does not see its sibling 2)

``ancestors[b, i, j]``: node ``j`` is node ``i`` or an ancestor of it. Rows before the tree
(``q_pos < tree_start[b]``) are causal, so a sequence verifying nothing sets ``tree_start``
at or past its last query, and a chain tree *is* the causal mask.

A node's position in the *text* is ``tree_start + depth``, not its storage slot: siblings
share a text position. Position-dependent recipes (sliding window, ALiBi, chunks) must see
text positions, so give the layer's own recipe as ``inner``: its mods are evaluated at text
positions and AND-ed with the tree mask. (``compose(tree, sliding_window(w))`` measures in
storage positions; that is exact for a chain, not for a branching tree.)

The tables are read at run time: allocate them once (``max_nodes`` = the largest tree) and
``copy_`` each step's trees in (:func:`flexpage.speculative.tree.mask_tables`), or every new
tensor makes a new recipe object and a new kernel. ``window`` is ``inner``'s: a node sees
keys back to its *text* position minus the window, so blocks fall out of the window as
counted from the tree root (the committed length), not from the last node's storage slot.
"""

import torch
from torch import Tensor

from flexpage.attention.recipe import Recipe, and_rules


def tree_verification(tree_start: Tensor, ancestors: Tensor, depths: Tensor | None = None,
                      inner: Recipe | None = None) -> Recipe:
    """tree_start: ``[S]`` int, storage position of each sequence's tree root (its last token);
    ancestors: ``[S, T, T]`` bool; depths: ``[S, T]`` int, needed with ``inner``."""
    if ancestors.dim() != 3 or ancestors.shape[1] != ancestors.shape[2] or ancestors.shape[0] != tree_start.shape[0]:
        raise ValueError(f"ancestors: got shape {tuple(ancestors.shape)}, expected [S, T, T] with "
                         f"S = {tree_start.shape[0]} (tree_start's length)")
    if inner is not None and (depths is None or depths.shape != ancestors.shape[:2]):
        raise ValueError(f"depths: got {None if depths is None else tuple(depths.shape)}, expected shape "
                         f"{tuple(ancestors.shape[:2])} with inner (its mods see text positions)")
    last = ancestors.shape[1] - 1

    def node(b: Tensor, pos: Tensor) -> Tensor:
        return (pos - tree_start[b]).clamp(0, last)

    def tree_mask(b: Tensor, h: Tensor, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        in_tree = (kv_pos >= tree_start[b]) & (q_pos >= tree_start[b])
        return (q_pos >= kv_pos) & (~in_tree | ancestors[b, node(b, q_pos), node(b, kv_pos)])

    def tree_rule(b: Tensor, q_lo: Tensor, q_hi: Tensor, kv_lo: Tensor, kv_hi: Tensor) -> tuple[Tensor, Tensor]:
        start = tree_start[b]  # causal before the tree; inside it ancestors precede
        return kv_lo <= q_hi, (kv_hi <= q_lo) & ((kv_hi < start) | (q_hi < start))

    if inner is None:
        return Recipe("tree_verification", mask_mod=tree_mask, block_rule=tree_rule)

    def text(b: Tensor, pos: Tensor) -> Tensor:
        return torch.where(pos < tree_start[b], pos, tree_start[b] + depths[b, node(b, pos)])

    mask, score, rule = inner.mask_mod, inner.score_mod, inner.block_rule

    def mask_mod(b: Tensor, h: Tensor, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        seen = tree_mask(b, h, q_pos, kv_pos)
        return seen if mask is None else seen & mask(b, h, text(b, q_pos), text(b, kv_pos))

    def score_mod(s: Tensor, b: Tensor, h: Tensor, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        return score(s, b, h, text(b, q_pos), text(b, kv_pos))

    def inner_rule(b: Tensor, q_lo: Tensor, q_hi: Tensor, kv_lo: Tensor, kv_hi: Tensor) -> tuple[Tensor, Tensor]:
        # text positions of the storage range [lo, hi] lie in [min(lo, start), hi]: ask the
        # inner rule about that wider range (may_see over-, sees_all under-approximates)
        start = tree_start[b]
        return rule(b, q_lo.minimum(start), q_hi, kv_lo.minimum(start), kv_hi)

    return Recipe(f"tree_verification({inner.name})", mask_mod=mask_mod,
                  score_mod=None if score is None else score_mod,
                  block_rule=tree_rule if mask is None else and_rules(tree_rule, inner_rule), window=inner.window)
