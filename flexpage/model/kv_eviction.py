"""The model side of KV budgets: naming an eviction policy and scoring blocks with it.

The block manager (:mod:`flexpage.core.eviction`) decides which blocks a sequence over its
budget gives up, from one number per block; this module computes those numbers with the
policy's ``token_scores`` over the keys and values already in the pool.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flexpage.attention.eviction import EvictionPolicy
from flexpage.attention.kv_pool import KVPool
from flexpage.attention.kv_quant import dequantize
from flexpage.core.scheduler_output import ScoreRequest
from flexpage.model.layer_recipes import load_object
from flexpage.model.tensor_parallel import TensorParallel

__all__ = ["EVICTION_POLICIES", "block_scores", "block_scores_over_ranks", "resolve_eviction_policy"]


def _builtin() -> dict[str, EvictionPolicy]:
    from flexpage.recipes.key_norm import key_norm
    from flexpage.recipes.no_eviction import no_eviction
    from flexpage.recipes.paged_eviction import paged_eviction
    from flexpage.recipes.streaming_llm import streaming_llm

    return {p.name: p for p in (paged_eviction(), streaming_llm(), key_norm(), no_eviction())}


#: the policies ``--kv-eviction`` knows by name
EVICTION_POLICIES = ("paged_eviction", "streaming_llm", "key_norm", "none")


def resolve_eviction_policy(choice: str | EvictionPolicy) -> EvictionPolicy:
    """A policy by name (:data:`EVICTION_POLICIES`), ``"module:attr"`` / ``"file.py[:attr]"``, or as given."""
    if isinstance(choice, EvictionPolicy):
        return choice
    if not isinstance(choice, str):
        raise ValueError(f"kv_eviction: got {type(choice).__name__}, expected a policy name {EVICTION_POLICIES}, "
                         "'module:attr', 'file.py[:attr]' or an EvictionPolicy")
    builtin = _builtin()
    if choice in builtin:
        return builtin[choice]
    if ":" in choice or choice.endswith(".py"):
        return load_object(choice, EvictionPolicy, "kv_eviction")
    raise ValueError(f"kv_eviction: got {choice!r}, expected one of {EVICTION_POLICIES}, "
                     "'module:attr' or 'file.py[:attr]'")


@torch.inference_mode()
def block_scores_over_ranks(pool: KVPool, policy: EvictionPolicy, requests: Sequence[ScoreRequest],
                            parallel: TensorParallel) -> list[list[float]]:
    """:func:`block_scores` of every request, each rank scoring its own KV heads and the ranks'
    scores averaged: every rank holds the same number of heads, so for a policy that averages
    over heads (every built-in one does) this is the score of all heads, as in one process.
    Every rank of the group calls it with the same requests."""
    local = [block_scores(pool, policy, r.pages, r.first_positions) for r in requests]
    flat = torch.tensor([score for scores in local for score in scores], dtype=torch.float32)
    mean = (parallel.all_reduce(flat) / parallel.size).tolist()
    out, start = [], 0
    for scores in local:
        out.append(mean[start:start + len(scores)])
        start += len(scores)
    return out


@torch.inference_mode()
def block_scores(pool: KVPool, policy: EvictionPolicy, pages: Sequence[Sequence[int]],
                 first_positions: Sequence[int]) -> list[float]:
    """One score per block: the mean of ``policy``'s token scores over the block's tokens.

    pages:           per layer group, the physical page of each block (the same logical block
                     in every group; a group's layers are the pool's layers at its page)
    first_positions: logical position of each block's first token
    """
    if policy.token_scores is None or not first_positions:
        return [0.0] * len(first_positions)
    bs, heads, dim = pool.block_size, pool.num_kv_heads, pool.head_dim
    count = len(first_positions)
    # [layers*2*heads, blocks*bs, dim] per group -> [layers, 2, heads, tokens, dim], groups' layers stacked
    kv = torch.cat([pool.read_blocks(list(group_pages)).view(-1, 2, heads, count * bs, dim) for group_pages in pages])
    if pool.quantized:  # int8 steps (one layer group: the pool's layers are the model's) -> real K/V
        kv = dequantize(kv, pool.scales[:, :, :, None])
    positions = (torch.tensor(first_positions, dtype=torch.int64)[:, None] + torch.arange(bs)).flatten()
    scores = policy.token_scores(kv[:, 0], kv[:, 1], positions)
    if tuple(scores.shape) != (count * bs,):
        raise ValueError(f"eviction policy {policy.name!r}: token_scores returned shape {tuple(scores.shape)}, "
                         f"expected ({count * bs},): one score per token")
    return scores.float().view(count, bs).mean(dim=1).tolist()
