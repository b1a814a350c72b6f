"""Verification of proposed tokens.

Greedy: exact acceptance lengths. Sampling: the tokens that come out are distributed as the
*target's*, whatever the draft -- checked statistically on a synthetic target and draft that
are Markov chains over a 6-token vocabulary (the next-token distribution depends on the
previous token, so a token scored by the wrong row shows up): for every emitted token we
count (previous token, token) pairs and compare them with the target's transition rows.

Tolerance: total variation distance between the counted pairs and ``count(previous) *
P[previous]`` below 0.03 over 20,000 verification steps (>= 20,000 pairs; under the null
the distance is about 0.01, and the classic bug of drawing from ``p`` instead of the
residual after a rejection moves the first token's distribution by 0.16, see
``test_the_tolerance_catches_a_wrong_residual``).
Every random draw is seeded.
"""

from __future__ import annotations

import pytest
import torch

from flexpage.speculative.rejection import (
    greedy_chain,
    rejection_sample_chain,
    verify_tree,
    verify_tree_greedy,
)
from flexpage.speculative.tree import DraftTree

V = 6
STEPS = 20_000
TOLERANCE = 0.03
ROOT = 0


def markov(seed: int, sharpness: float) -> torch.Tensor:
    """``[V, V]`` float64 transition rows (row = previous token)."""
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(V, V, generator=g, dtype=torch.float64) * sharpness, dim=-1)


P = markov(1, 1.5)  # the target
Q = markov(2, 1.0)  # the draft: a different chain


def pair_counts(outputs: list[list[int]]) -> torch.Tensor:
    """``[V, V]`` counts of (previous, emitted) over every emitted token, the root before the first."""
    counts = torch.zeros(V, V, dtype=torch.float64)
    for tokens in outputs:
        prev = ROOT
        for token in tokens:
            counts[prev, token] += 1
            prev = token
    return counts


def distance_from_target(counts: torch.Tensor) -> float:
    """Total variation between the counted pairs and what the target predicts for the same
    previous tokens."""
    expected = counts.sum(dim=1, keepdim=True) * P
    return float((counts - expected).abs().sum() / (2 * counts.sum()))


def first_token_distance(outputs: list[list[int]]) -> float:
    counts = torch.bincount(torch.tensor([tokens[0] for tokens in outputs]), minlength=V).double()
    return float((counts / counts.sum() - P[ROOT]).abs().sum() / 2)


def sample_chains(rows: int, length: int, g: torch.Generator, start: int = ROOT) -> torch.Tensor:
    """``[rows, length]`` independent walks of the draft chain from ``start``."""
    previous = torch.full((rows,), start)
    steps = []
    for _ in range(length):
        previous = torch.multinomial(Q[previous], 1, generator=g).squeeze(1)
        steps.append(previous)
    return torch.stack(steps, dim=1)


# ---- sampling keeps the target's distribution --------------------------------------------


def test_chain_with_a_draft_distribution_keeps_the_target_distribution():
    k = 3
    g = torch.Generator().manual_seed(10)
    drafts = sample_chains(STEPS, k, g)  # [B, K] from the draft
    path = torch.cat([torch.full((STEPS, 1), ROOT), drafts], dim=1)  # [B, K+1]: the root, then the drafts
    target = P[path]  # [B, K+1, V]: row i scores the token after path[:, i]
    draft = Q[path[:, :k]]  # [B, K, V]: what drafts[:, i] was drawn from
    out = rejection_sample_chain(drafts, torch.full((STEPS,), k), target, draft,
                                 generator=torch.Generator().manual_seed(11))
    outputs = out.tolist()
    accepted = out.num_accepted.double().mean()
    assert 0.3 < accepted < 2.7, f"mean accepted {accepted:.2f}: the test should see accepts and rejects"
    assert first_token_distance(outputs) < TOLERANCE
    assert distance_from_target(pair_counts(outputs)) < TOLERANCE


def test_point_mass_proposals_keep_the_target_distribution():
    """n-gram proposals: fixed tokens, ``q`` a point mass. Token 5 after 2 is likely, 3 after 5
    less so; the draft tokens never change, only the target's randomness decides."""
    proposal = [2, 5, 3]
    drafts = torch.tensor([proposal] * STEPS)
    target = P[torch.tensor([ROOT, *proposal])].expand(STEPS, -1, -1)
    out = rejection_sample_chain(drafts, torch.full((STEPS,), 3), target, generator=torch.Generator().manual_seed(12))
    outputs = out.tolist()
    assert first_token_distance(outputs) < TOLERANCE
    assert distance_from_target(pair_counts(outputs)) < TOLERANCE
    # accepting the first proposal has probability p(2 | root), exactly
    assert abs(float((out.num_accepted >= 1).double().mean()) - float(P[ROOT, 2])) < 0.015


def test_two_branch_tree_of_point_masses_keeps_the_target_distribution():
    """Root -> 2 -> 5 and root -> 4 (two n-gram matches): the second branch is tried against
    the target with token 2 removed."""
    tree = DraftTree.from_branches(ROOT, [[2, 5], [4]])
    assert tree.tokens == (ROOT, 2, 5, 4)
    target = P[torch.tensor(tree.tokens)]  # row i scores the token after node i
    g = torch.Generator().manual_seed(13)
    results = [verify_tree(tree, target, generator=g) for _ in range(STEPS)]
    outputs = [r.token_ids for r in results]
    assert first_token_distance(outputs) < TOLERANCE
    assert distance_from_target(pair_counts(outputs)) < TOLERANCE
    second_branch = sum(r.accepted_nodes[:1] == [3] for r in results) / STEPS
    assert abs(second_branch - float(P[ROOT, 4])) < 0.015  # (1 - p(2)) * p(4) / (1 - p(2))


def test_tree_of_independent_draft_samples_keeps_the_target_distribution():
    """Two children of the root drawn independently from the draft (they may coincide), each
    with one child of its own: SpecInfer's multi-step speculative sampling."""
    g = torch.Generator().manual_seed(14)
    verify_g = torch.Generator().manual_seed(15)
    first, second = sample_chains(STEPS, 2, g), sample_chains(STEPS, 2, g)  # two independent branches each step
    outputs = []
    for (a, a2), (b, b2) in zip(first.tolist(), second.tolist()):
        tree = DraftTree((ROOT, a, a2, b, b2), (-1, 0, 1, 0, 3))
        draft = Q[torch.tensor([ROOT, ROOT, a, ROOT, b])]  # row i: what node i was drawn from
        outputs.append(verify_tree(tree, P[torch.tensor(tree.tokens)], draft, generator=verify_g).token_ids)
    assert first_token_distance(outputs) < TOLERANCE
    assert distance_from_target(pair_counts(outputs)) < TOLERANCE


def test_the_tolerance_catches_a_wrong_residual():
    """The null distance is ~0.01; drawing from ``p`` instead of ``max(p - q, 0)`` after a
    rejection shifts the first token's distribution by 0.16, five times the tolerance."""
    p, q = P[ROOT], Q[ROOT]
    overlap = torch.minimum(p, q)
    wrong = overlap + (1 - overlap.sum()) * p
    assert float((wrong - p).abs().sum() / 2) > 5 * TOLERANCE


def test_seeded_rows_do_not_depend_on_the_batch():
    """A row with its own generator gets the same tokens alone or among others."""
    k = 3
    g = torch.Generator().manual_seed(16)
    drafts = sample_chains(8, k, g)
    path = torch.cat([torch.full((8, 1), ROOT), drafts], dim=1)
    target, draft = P[path], Q[path[:, :k]]
    gens = [torch.Generator().manual_seed(100 + i) for i in range(8)]
    together = rejection_sample_chain(drafts, torch.full((8,), k), target, draft, generators=gens).tolist()
    for row in range(8):
        alone = rejection_sample_chain(drafts[row:row + 1], torch.tensor([k]), target[row:row + 1],
                                       draft[row:row + 1], generators=[torch.Generator().manual_seed(100 + row)])
        assert alone.tolist() == [together[row]]


def test_a_chain_verified_as_a_tree_gives_the_same_tokens():
    """Same seed, same draws: the tree walk and the batched chain agree token for token."""
    k = 3
    g = torch.Generator().manual_seed(17)
    for seed, proposal in enumerate(sample_chains(200, k, g).tolist()):
        path = torch.tensor([ROOT, *proposal])
        chain = rejection_sample_chain(torch.tensor([proposal]), torch.tensor([k]), P[path][None], Q[path[:k]][None],
                                       generators=[torch.Generator().manual_seed(seed)]).tolist()[0]
        tree = DraftTree.chain(ROOT, proposal)
        draft_rows = torch.cat([Q[:1], Q[path[:k]]])  # row 0 unused
        walked = verify_tree(tree, P[path], draft_rows, generator=torch.Generator().manual_seed(seed))
        assert walked.token_ids == chain, f"seed {seed}"


def test_rows_with_fewer_drafts_and_none():
    """``num_drafts`` below K: the row's bonus comes from row ``num_drafts``; 0 drafts is
    plain sampling from the root's row."""
    target = torch.zeros(2, 3, V, dtype=torch.float64)
    target[:, :, 1] = 1.0  # certain: token 1 everywhere
    target[0, 1] = torch.nn.functional.one_hot(torch.tensor(4), V)  # after row 0's first draft: 4
    drafts = torch.tensor([[1, 3], [2, 2]])
    out = rejection_sample_chain(drafts, torch.tensor([1, 0]), target, generator=torch.Generator().manual_seed(0))
    assert out.tolist() == [[1, 4], [1]]
    assert out.num_accepted.tolist() == [1, 0]


def test_draft_equal_to_target_accepts_everything():
    k = 4
    drafts = torch.tensor([[1, 2, 3, 4]])
    probs = P[torch.tensor([ROOT, 1, 2, 3, 4])][None]
    out = rejection_sample_chain(drafts, torch.tensor([k]), probs, probs[:, :k],
                                 generator=torch.Generator().manual_seed(3))
    assert out.num_accepted.tolist() == [k]  # u < p/q = 1 always


# ---- greedy ------------------------------------------------------------------------------------


def test_greedy_chain_acceptance_lengths():
    target = torch.tensor([[5, 6, 7, 8],   # all three drafts agree: + bonus 8
                           [5, 6, 7, 8],   # disagrees at the second: 5, then the target's 6
                           [5, 6, 7, 8],   # disagrees at once: only the target's 5
                           [5, 6, 7, 8]])  # one draft, agreed: bonus from row 1
    drafts = torch.tensor([[5, 6, 7], [5, 9, 7], [1, 6, 7], [5, 0, 0]])
    out = greedy_chain(drafts, torch.tensor([3, 3, 3, 1]), target)
    assert out.num_accepted.tolist() == [3, 1, 0, 1]
    assert out.tolist() == [[5, 6, 7, 8], [5, 6], [5], [5, 6]]
    assert out.token_ids.tolist() == [[5, 6, 7, 8], [5, 6, -1, -1], [5, -1, -1, -1], [5, 6, -1, -1]]


def test_greedy_tree_follows_the_branch_the_target_agrees_with():
    tree = DraftTree.from_branches(3, [[7, 8, 9], [7, 8, 5], [4]])
    assert tree.tokens == (3, 7, 8, 9, 5, 4)
    #                                  after node: 0  1  2  3  4  5
    assert verify_tree_greedy(tree, [7, 8, 5, 0, 1, 2]).token_ids == [7, 8, 5, 1]  # second leaf + bonus
    assert verify_tree_greedy(tree, [7, 8, 5, 0, 1, 2]).accepted_nodes == [1, 2, 4]
    assert verify_tree_greedy(tree, [4, 8, 5, 0, 1, 2]).token_ids == [4, 2]  # the last branch
    assert verify_tree_greedy(tree, [6, 8, 5, 0, 1, 2]).token_ids == [6]  # no child agrees
    assert verify_tree_greedy(tree, [7, 1, 5, 0, 1, 2]).token_ids == [7, 1]
    result = verify_tree_greedy(tree, [7, 8, 9, 0, 1, 2])
    assert (result.token_ids, result.accepted_nodes, result.scoring_nodes) == ([7, 8, 9, 0], [1, 2, 3], [0, 1, 2, 3])


def test_greedy_tree_on_a_chain_equals_greedy_chain():
    g = torch.Generator().manual_seed(4)
    for _ in range(100):
        proposal = torch.randint(0, 3, (4,), generator=g)
        argmax = torch.randint(0, 3, (5,), generator=g)
        chain = greedy_chain(proposal[None], torch.tensor([4]), argmax[None]).tolist()[0]
        assert verify_tree_greedy(DraftTree.chain(9, proposal.tolist()), argmax).token_ids == chain


def test_shapes_are_checked():
    with pytest.raises(ValueError, match=r"target rows: got 3, expected K \+ 1 = 4"):
        greedy_chain(torch.zeros(1, 3, dtype=torch.long), torch.tensor([3]), torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"num_drafts: got \[4\], expected values in \[0, 3\]"):
        greedy_chain(torch.zeros(1, 3, dtype=torch.long), torch.tensor([4]), torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"target_probs: got 2 rows, expected one per tree node \(3\)"):
        verify_tree(DraftTree.chain(0, [1, 2]), torch.ones(2, V) / V)
