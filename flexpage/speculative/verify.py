"""Verification inside the engine's step: the sampler's processing, then the chain verifiers.

A sequence that proposed ``k`` tokens has ``k + 1`` logits rows in the step (after its last
token, then after each proposal). Row ``j`` is processed exactly as the sampler would
process the next token after the first ``j`` proposals: penalties and ``min_tokens`` see
the history extended by them, then temperature, top-k/top-p/min-p. Greedy rows accept while
the processed argmax agrees (:func:`~flexpage.speculative.rejection.greedy_chain`: the same
tokens as one-at-a-time greedy decoding); sampled rows use speculative sampling with the
proposals as point masses (:func:`~flexpage.speculative.rejection.rejection_sample_chain`:
every token distributed as the target's). Logprobs, where asked for, are those of the raw
logits row each emitted token came from, as :func:`~flexpage.model.sampler.sample` reports them.

A sequence that proposed several continuations (branches) is verified as one tree
(:func:`verify_branches`): each branch's rows come one after another, a node several
branches share is scored by the first one's row, and the tree verifiers of
:mod:`~flexpage.speculative.rejection` walk it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from flexpage.model.sampler import (TokenHistory, TokenLogprobs, apply_min_tokens, apply_penalties, gather_logprobs,
                                    row_argmax, sampling_probs)
from flexpage.sampling_params import SamplingParams
from flexpage.speculative.rejection import greedy_chain, rejection_sample_chain, verify_tree, verify_tree_greedy
from flexpage.speculative.tree import DraftTree

__all__ = ["verify_branches", "verify_chains"]


def verify_chains(
    logits: Tensor,
    drafts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    histories: Sequence[TokenHistory],
    generators: Sequence[torch.Generator | None],
    eos_token_id: int | None = None,
    *,
    generator: torch.Generator | None = None,
) -> list[tuple[list[int], list[TokenLogprobs | None]]]:
    """Verify one chain of proposals per sequence.

    Args:
        logits: ``[sum(len(d) + 1 for d in drafts), V]``: each sequence's rows one after another.
        drafts: per sequence, its proposed tokens (may be empty: plain sampling of one row).
        params, histories, generators: per sequence, as :func:`~flexpage.model.sampler.sample`
            takes them (the history before the proposals).
        eos_token_id: masked while a row is below ``min_tokens``.
        generator: shared generator of rows without their own.

    Returns:
        per sequence, the tokens to append (the accepted proposals, then the target's token
        after them) and each one's logprobs (None where the request asked for none).
    """
    counts = [len(d) + 1 for d in drafts]
    if logits.shape[0] != sum(counts):
        raise ValueError(f"logits: {logits.shape[0]} rows, expected {sum(counts)} (one per proposal, plus one, "
                         f"per sequence)")
    row_params = [p for p, n in zip(params, counts) for _ in range(n)]
    row_histories = [TokenHistory(h.prompt_ids, [*h.output_ids, *d[:j]])
                     for d, h, n in zip(drafts, histories, counts) for j in range(n)]
    x = apply_penalties(logits, row_params, row_histories)
    x = apply_min_tokens(x, row_params, row_histories, eos_token_id)

    batch, k = len(drafts), max(counts) - 1
    starts = torch.tensor([0, *counts]).cumsum(0)[:-1]
    # [B, k + 1]: flat row of each sequence's j-th row (padding repeats its last row)
    index = starts[:, None] + torch.minimum(torch.arange(k + 1)[None, :], torch.tensor(counts)[:, None] - 1)
    draft_tokens = torch.tensor([[*d, *[0] * (k - len(d))] for d in drafts], dtype=torch.long).reshape(batch, k)
    num_drafts = torch.tensor([len(d) for d in drafts])

    emitted = greedy_chain(draft_tokens, num_drafts, row_argmax(x)[index]).tolist()
    sampled = [b for b, p in enumerate(params) if not p.is_greedy]
    if sampled:
        pick = torch.tensor(sampled)
        flat = index[pick].reshape(-1)
        probs = sampling_probs(x[flat], [params[b] for b in sampled for _ in range(k + 1)])
        probs = probs.reshape(len(sampled), k + 1, -1)
        chains = rejection_sample_chain(draft_tokens[pick], num_drafts[pick], probs,
                                        generators=[generators[b] for b in sampled], generator=generator)
        for b, tokens in zip(sampled, chains.tolist()):
            emitted[b] = tokens

    results = []
    for b, tokens in enumerate(emitted):
        logprobs: list[TokenLogprobs | None] = [None] * len(tokens)
        if params[b].logprobs is not None:
            rows = starts[b] + torch.arange(len(tokens))
            logprobs = gather_logprobs(logits[rows], torch.tensor(tokens), [params[b]] * len(tokens))
        results.append((tokens, logprobs))
    return results


def verify_branches(
    logits: Tensor,
    branches: Sequence[Sequence[int]],
    params: SamplingParams,
    history: TokenHistory,
    generator: torch.Generator | None,
    eos_token_id: int | None = None,
    *,
    shared: torch.Generator | None = None,
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """Verify one sequence's continuations of its last token as one tree.

    Args:
        logits: ``[sum(len(b) + 1 for b in branches), V]``: each branch's rows in turn (after
            the last token, then after each of the branch's tokens).
        branches: the proposed continuations, best first (verification tries them in order).
        params, history, generator: the sequence's, as for :func:`verify_chains`.
        shared: the generator used when ``generator`` is None.

    Returns:
        the tokens to append (an accepted path, then the target's token after it) and each
        one's logprobs (None where the request asked for none).
    """
    counts = [len(b) + 1 for b in branches]
    if logits.shape[0] != sum(counts):
        raise ValueError(f"logits: {logits.shape[0]} rows, expected {sum(counts)} (one per proposal, plus one, "
                         f"per branch)")
    tree = DraftTree.from_branches(0, branches)
    rows, paths = _node_rows(tree, branches)
    n = tree.num_nodes
    x = logits[rows]
    histories = [TokenHistory(history.prompt_ids, [*history.output_ids, *path]) for path in paths]
    x = apply_penalties(x, [params] * n, histories)
    x = apply_min_tokens(x, [params] * n, histories, eos_token_id)
    if params.is_greedy:
        verified = verify_tree_greedy(tree, row_argmax(x))
    else:
        verified = verify_tree(tree, sampling_probs(x, [params] * n), generator=generator or shared)
    tokens = verified.token_ids
    logprobs: list[TokenLogprobs | None] = [None] * len(tokens)
    if params.logprobs is not None:
        scoring = [rows[node] for node in verified.scoring_nodes]
        logprobs = gather_logprobs(logits[scoring], torch.tensor(tokens), [params] * len(tokens))
    return tokens, logprobs


def _node_rows(tree: DraftTree, branches: Sequence[Sequence[int]]) -> tuple[list[int], list[list[int]]]:
    """Per node of ``tree`` (made from ``branches``), the first logits row that scores the
    token after it, and its path of tokens from the root."""
    kids = tree.child_lists()
    rows, paths = [0] + [-1] * (tree.num_nodes - 1), [[] for _ in range(tree.num_nodes)]
    offset = 0
    for branch in branches:
        node = 0
        for j, token in enumerate(branch, start=1):
            node = next(c for c in kids[node] if tree.tokens[c] == token)
            if rows[node] < 0:
                rows[node], paths[node] = offset + j, list(branch[:j])
        offset += len(branch) + 1
    return rows, paths
