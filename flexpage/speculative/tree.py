"""Proposed tokens of one sequence as a tree, and the tables verification needs.

A :class:`DraftTree` is rooted at the sequence's **last token** (node 0: already sampled, its KV
is written in the verification step, and its logits row scores the first proposed token).
Every other node is one proposed token; a chain is the tree where node ``i``'s parent is
``i - 1``. Several proposals that share a prefix share its nodes, so the step runs each
distinct token once::

    branches [7, 8, 9] and [7, 8, 5] and [4]   ->   node : 0  1  2  3  4  5
    (root token 3)                                   token: 3  7  8  9  5  4
                                                    parent: -  0  1  2  2  0
    3 ─ 7 ─ 8 ─ 9
    │       └── 5
    └── 4

Nodes are numbered in depth-first order, first branch first: a parent always precedes its
children (the attention mask relies on it: ancestors sit at smaller storage positions), and
the first branch -- the proposer's favourite -- occupies storage slots ``1..len`` exactly as
a chain would, so when it is accepted its KV needs no moving. Children keep the order the
branches were given in; verification tries them in that order.

In the verification step node ``i`` is query row ``tree_start + i`` of the sequence (its
storage position, where its K/V is written) while its position in the text, for RoPE and
for position-dependent recipes, is ``tree_start + depth[i]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["DraftTree", "count_proposals", "mask_tables"]


@dataclass(frozen=True)
class DraftTree:
    """``tokens[i]``/``parents[i]`` of node ``i``; node 0 is the root (``parents[0] == -1``).

    Siblings may repeat a token (independent draft-model samples may coincide, and recursive
    rejection sampling gives each its own chance); :meth:`from_branches` merges them.
    """

    tokens: tuple[int, ...]
    parents: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents) or not self.tokens:
            raise ValueError(f"tokens/parents: got {len(self.tokens)} tokens and {len(self.parents)} parents, "
                             "expected the same number >= 1 (node 0 is the root)")
        if self.parents[0] != -1:
            raise ValueError(f"parents[0]: got {self.parents[0]}, expected -1 (node 0 is the root)")
        for node, parent in enumerate(self.parents[1:], start=1):
            if not 0 <= parent < node:
                raise ValueError(f"parents[{node}]: got {parent}, expected a node in [0, {node}) "
                                 "(parents precede their children)")

    @classmethod
    def chain(cls, root_token: int, proposal: Sequence[int]) -> DraftTree:
        """The tree of one proposed continuation: node ``i`` is ``proposal[i-1]``."""
        return cls(tuple(int(t) for t in (root_token, *proposal)), tuple(range(-1, len(proposal))))

    @classmethod
    def from_branches(cls, root_token: int, branches: Sequence[Sequence[int]]) -> DraftTree:
        """Merge continuations into a trie (shared prefixes become shared nodes), depth-first
        with the first branch first, children in the order their branches came."""
        if len(branches) <= 1:
            return cls.chain(root_token, branches[0] if branches else ())
        children: list[dict[int, int]] = [{}]  # per trie node: token -> trie node, in insertion order
        trie_tokens = [int(root_token)]
        for branch in branches:
            node = 0
            for token in branch:
                token = int(token)
                if token not in children[node]:
                    children[node][token] = len(trie_tokens)
                    trie_tokens.append(token)
                    children.append({})
                node = children[node][token]
        tokens, parents = [], []
        stack = [(0, -1)]  # (trie node, parent's index in the output)
        while stack:
            node, parent = stack.pop()
            index = len(tokens)
            tokens.append(trie_tokens[node])
            parents.append(parent)
            stack.extend((child, index) for child in reversed(children[node].values()))
        return cls(tuple(tokens), tuple(parents))

    @property
    def num_nodes(self) -> int:
        """Query rows the tree needs in a verification step (root included)."""
        return len(self.tokens)

    @property
    def proposals(self) -> tuple[int, ...]:
        """The proposed tokens, node 1 onwards (empty: nothing to verify)."""
        return self.tokens[1:]

    def child_lists(self) -> list[list[int]]:
        """Per node, its children in the order verification tries them."""
        kids: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for node, parent in enumerate(self.parents[1:], start=1):
            kids[parent].append(node)
        return kids

    def depths(self) -> np.ndarray:
        """``[N]`` int64: edges from the root (root 0); the text position is ``tree_start + depth``."""
        depth = np.zeros(self.num_nodes, dtype=np.int64)
        for node in range(1, self.num_nodes):
            depth[node] = depth[self.parents[node]] + 1
        return depth

    def ancestors(self) -> np.ndarray:
        """``[N, N]`` bool: ``[i, j]`` is True where node ``j`` is node ``i`` or one of its
        ancestors -- exactly the tree keys query row ``i`` may attend to."""
        table = np.eye(self.num_nodes, dtype=bool)
        for node in range(1, self.num_nodes):
            table[node] |= table[self.parents[node]]
        return table

    def branches(self) -> list[list[int]]:
        """The root-to-leaf token paths (root excluded), in node order; inverse of :meth:`from_branches`."""
        leaves = sorted(set(range(1, self.num_nodes)) - set(self.parents))
        paths = []
        for leaf in leaves:
            path, node = [], leaf
            while node > 0:
                path.append(self.tokens[node])
                node = self.parents[node]
            paths.append(path[::-1])
        return paths


def count_proposals(branches: Sequence[Sequence[int]]) -> int:
    """The distinct proposed tokens of continuations of one sequence (a prefix several share
    counts once): the nodes of their tree, root excluded."""
    if len(branches) <= 1:
        return len(branches[0]) if branches else 0
    return DraftTree.from_branches(0, branches).num_nodes - 1


def mask_tables(trees: Sequence[DraftTree | None], max_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """The per-step tables of :func:`flexpage.recipes.tree_verification.tree_verification`, one
    row per sequence of the batch: ``ancestors`` ``[S, max_nodes, max_nodes]`` bool and ``depths``
    ``[S, max_nodes]`` int32. A sequence verifying nothing (``None``) gets a one-node tree; its
    ``tree_start`` must then lie at or past its last query position, making it plain causal.

    Allocate the recipe's tensors once at ``max_nodes = max tree size`` and ``copy_`` these in
    each step: kernels are cached per recipe object, so a new tensor would mean a new kernel."""
    ancestors = np.zeros((len(trees), max_nodes, max_nodes), dtype=bool)
    depths = np.zeros((len(trees), max_nodes), dtype=np.int32)
    for row, tree in enumerate(trees):
        tree = tree or DraftTree((0,), (-1,))
        if tree.num_nodes > max_nodes:
            raise ValueError(f"trees[{row}]: {tree.num_nodes} nodes, expected at most max_nodes={max_nodes}")
        n = tree.num_nodes
        ancestors[row, :n, :n] = tree.ancestors()
        depths[row, :n] = tree.depths()
    return ancestors, depths
