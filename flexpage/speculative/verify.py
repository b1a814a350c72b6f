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
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from flexpage.model.sampler import (TokenHistory, TokenLogprobs, apply_min_tokens, apply_penalties, gather_logprobs,
                                    row_argmax, sampling_probs)
from flexpage.sampling_params import SamplingParams
from flexpage.speculative.rejection import greedy_chain, rejection_sample_chain

__all__ = ["verify_chains"]


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
