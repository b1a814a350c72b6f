"""Prompt lookup (vLLM's ``ngram`` method): the longest suffix n-gram that occurred earlier,
the k tokens that followed it; several occurrences become several branches, longest match
first, then most recent."""

from __future__ import annotations

import random

import numpy as np
import pytest

from flexpage.speculative.config import SpeculativeConfig
from flexpage.speculative.ngram import NgramProposer, SequenceTokens, find_continuations
from flexpage.speculative.tree import DraftTree


def lookup(tokens: list[int], *, min_n: int, max_n: int, k: int, branches: int = 1) -> list[list[int]]:
    return find_continuations(np.array(tokens, dtype=np.int32), min_n=min_n, max_n=max_n, k=k,
                              max_branches=branches)


def test_vllm_docstring_example():
    # [4, 2, 3] does not recur; [2, 3] does, followed by only three tokens
    assert lookup([1, 2, 3, 4, 2, 3], min_n=2, max_n=3, k=4) == [[4, 2, 3]]


def test_longer_match_beats_a_more_recent_shorter_one():
    #            0  1  2  3  4  5  6  7  8  9 10 11 12
    tokens = [7, 8, 9, 1, 2, 5, 8, 9, 3, 4, 7, 8, 9]
    # suffix 7 8 9 occurred at 0..2 (then 1 2); 8 9 alone more recently at 6..7 (then 3 4)
    assert lookup(tokens, min_n=2, max_n=3, k=2) == [[1, 2]]
    assert lookup(tokens, min_n=2, max_n=3, k=2, branches=2) == [[1, 2], [3, 4]]
    # with max_n = 2 both are 2-gram matches: the most recent first
    assert lookup(tokens, min_n=2, max_n=2, k=2, branches=2) == [[3, 4], [1, 2]]


def test_below_min_n_nothing_is_proposed():
    tokens = [5, 1, 2, 6, 3, 2]  # only the 1-gram "2" recurs
    assert lookup(tokens, min_n=2, max_n=4, k=3) == []
    assert lookup(tokens, min_n=1, max_n=4, k=3) == [[6, 3, 2]]
    assert lookup([9], min_n=1, max_n=3, k=3) == []  # nothing earlier to match
    assert lookup([1, 2, 1, 2], min_n=2, max_n=2, k=0) == []


def test_match_may_overlap_the_suffix():
    # "a b a" ends at 2 and at 4 (the suffix); the occurrence at 0..2 is followed by b a
    assert lookup([1, 2, 1, 2, 1], min_n=3, max_n=3, k=4) == [[2, 1]]


def test_repeated_continuations_are_one_branch():
    tokens = [1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2, 3, 9, 1, 2]
    # "1 2" occurred four times, followed by 3 (three times) or 4; most recent first: 3 9 ..., 4 1 ..., 3 1 ...
    assert lookup(tokens, min_n=2, max_n=2, k=2, branches=4) == [[3, 9], [4, 1], [3, 1]]
    assert lookup(tokens, min_n=2, max_n=2, k=1, branches=4) == [[3], [4]]


def test_a_continuation_cut_short_gives_way_to_one_that_extends_it():
    tokens = [4, 1, 2, 3, 4, 1, 2, 3, 4, 1]
    # "4 1" most recently at 4..5 -> 2 3 4 1 (k = 4); at 0..1 -> 2 3 4 1 as well
    assert lookup(tokens, min_n=2, max_n=2, k=4, branches=2) == [[2, 3, 4, 1]]
    tokens = [1, 2, 3, 4, 5, 6, 1, 2, 3, 1, 2]
    # "1 2" most recently at 6..7, followed by only 3 1 2 (the end); at 0..1 by 3 4 5 6:
    # both kept, they differ at the second token
    assert lookup(tokens, min_n=2, max_n=2, k=4, branches=2) == [[3, 1, 2], [3, 4, 5, 6]]
    tokens = [1, 2, 3, 4, 1, 2, 3]
    # suffix "1 2 3" occurred at 0..2: continuation 4 1 2 3, running into the suffix itself
    assert lookup(tokens, min_n=1, max_n=3, k=4) == [[4, 1, 2, 3]]
    tokens = [8, 9, 5, 6, 7, 0, 8, 9, 5, 8, 9]
    # "8 9" at 6..7 -> 5 8 9 (cut by the end, 3 tokens); at 0..1 -> 5 6 7 0: differs, both kept
    assert lookup(tokens, min_n=2, max_n=2, k=4, branches=3) == [[5, 8, 9], [5, 6, 7, 0]]
    tokens = [8, 9, 5, 8, 7, 0, 8, 9, 5, 8]
    # suffix "5 8" at 2..3 -> 7 0 8 9; then 1-gram matches of "8": at 6 -> 9 5 8 (cut short),
    # at 0 -> 9 5 8 7, which extends it and takes its place (its rank, its longer tail)
    assert lookup(tokens, min_n=1, max_n=2, k=4, branches=3) == [[7, 0, 8, 9], [9, 5, 8, 7]]


def brute_force(tokens: list[int], *, min_n: int, max_n: int, k: int, branches: int) -> list[list[int]]:
    """The specification restated with plain loops: rank every earlier end of the last token by
    (matched length, recency), keep matches of at least min_n, take distinct continuations,
    a cut-short one giving way to a longer one it is a prefix of."""
    last = len(tokens) - 1
    ranked = []
    for end in range(last):
        n = 0
        while n < max_n and end - n >= 0 and tokens[end - n] == tokens[last - n]:
            n += 1
        if n >= min_n:
            ranked.append((n, end))
    ranked.sort(reverse=True)
    chosen: list[list[int]] = []
    for _, end in ranked:
        cont = tokens[end + 1 : end + 1 + k]
        for i, have in enumerate(chosen):
            if cont[: len(have)] == have:
                chosen[i] = cont
                break
            if have[: len(cont)] == cont:
                break
        else:
            if len(chosen) < branches:
                chosen.append(cont)
    return chosen if k >= 1 else []


def test_matches_a_brute_force_statement_of_the_rule():
    rng = random.Random(0)
    for case in range(400):
        tokens = [rng.randrange(rng.choice((2, 3, 5))) for _ in range(rng.randrange(1, 40))]
        min_n = rng.randrange(1, 4)
        max_n = rng.randrange(min_n, 6)
        k, branches = rng.randrange(1, 6), rng.randrange(1, 4)
        want = brute_force(tokens, min_n=min_n, max_n=max_n, k=k, branches=branches)
        got = lookup(tokens, min_n=min_n, max_n=max_n, k=k, branches=branches)
        assert got == want, f"case {case}: {tokens} n=[{min_n},{max_n}] k={k} branches={branches}"


# ---- the proposer: config, per-sequence mirror, the tree ---------------------------------------


def ngram(k: int = 3, low: int = 1, high: int = 3, branches: int = 1) -> NgramProposer:
    return NgramProposer(SpeculativeConfig("ngram", k, prompt_lookup_min=low, prompt_lookup_max=high,
                                           max_branches=branches))


def test_proposer_returns_a_tree_rooted_at_the_last_token():
    tokens = [1, 2, 3, 1, 2, 4, 1, 2]
    tree = ngram(k=2, low=2, high=2, branches=2).propose(7, tokens)
    assert tree == DraftTree.from_branches(2, [[4, 1], [3, 1]])
    assert tree.tokens == (2, 4, 1, 3, 1) and tree.parents == (-1, 0, 1, 0, 3)
    assert ngram(k=2, low=2, high=2).propose(7, tokens) == DraftTree.chain(2, [4, 1])


def test_nothing_matched_is_a_root_only_tree():
    tree = ngram(low=2).propose(0, [1, 2, 3, 4])
    assert tree.tokens == (4,) and tree.proposals == () and tree.num_nodes == 1


def test_k_can_only_be_lowered_per_call():
    proposer = ngram(k=3, low=1, high=1)
    tokens = [5, 6, 7, 8, 9, 5]
    assert proposer.propose(0, tokens).proposals == (6, 7, 8)
    assert proposer.propose(0, tokens, k=1).proposals == (6,)
    assert proposer.propose(0, tokens, k=10).proposals == (6, 7, 8)
    assert proposer.propose(0, tokens, k=0).proposals == ()  # e.g. one token left before max_tokens


def test_the_method_must_be_ngram():
    with pytest.raises(ValueError, match=r"method: got 'draft_model', NgramProposer needs 'ngram'"):
        NgramProposer(SpeculativeConfig("draft_model", 2, model="/m/tiny"))


def test_sequence_mirror_copies_only_what_was_appended():
    mirror = SequenceTokens()
    tokens = list(range(300))  # past the first buffer: it grows
    assert mirror.sync(tokens).tolist() == tokens
    before = mirror._buffer
    tokens.append(7)
    view = mirror.sync(tokens)
    assert view.tolist() == tokens and mirror._buffer is before  # appended in place
    tokens[-1] = 8  # changed in place: rebuilt, not stale
    assert mirror.sync(tokens).tolist() == tokens
    assert mirror.sync(tokens[:10]).tolist() == tokens[:10]  # shorter: rebuilt


def test_one_mirror_per_sequence_and_release():
    proposer = ngram(k=2, low=1, high=1)
    assert proposer.propose(1, [3, 4, 5, 3]).proposals == (4, 5)
    assert proposer.propose(2, [6, 7, 6]).proposals == (7, 6)
    assert proposer.propose(1, [3, 4, 5, 3, 4]).proposals == (5, 3)
    proposer.release(1)
    proposer.release(1)  # twice is harmless
    assert set(proposer._sequences) == {2}
