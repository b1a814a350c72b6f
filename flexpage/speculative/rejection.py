"""Verification: which proposed tokens the target model accepts, and the token that follows.

The target model scores every node of a :class:`DraftTree` in one forward pass: row ``i`` of
its logits is the next-token distribution after node ``i``'s path (row 0: after the root,
the sequence's last token). From those rows:

* **Greedy** (temperature 0): walk from the root; at each node take the child whose token is
  the target's argmax there; where none is, emit the argmax instead and stop; at a leaf emit
  the argmax after it (the *bonus* token). Output = the same tokens plain greedy decoding
  would produce, 1 to depth + 1 of them per step.
* **Sampling** (temperature > 0): speculative sampling (Leviathan et al., "Fast Inference from
  Transformers via Speculative Decoding", 2023, https://arxiv.org/abs/2211.17192; Chen et al.,
  "Accelerating LLM Decoding with Speculative Sampling", 2023, https://arxiv.org/abs/2302.01318):
  accept a token ``x`` drawn from the draft's ``q`` with probability ``min(1, p(x) / q(x))``;
  at the first rejection draw from the residual ``norm(max(p - q, 0))``. Every emitted token
  is then distributed exactly as the target's ``p``. An n-gram proposal is a point mass
  (``q(x) = 1``): accept with probability ``p(x)``, else draw from ``p`` with ``x`` removed.
* **Trees** (several children per node): recursive rejection sampling (Miao et al., SpecInfer,
  2024, https://arxiv.org/abs/2305.09781, "multi-step speculative sampling"): try the children
  in order against the residual left by the rejections before them; if all are rejected,
  draw from the last residual. Exact when each child's token was drawn independently from
  its own ``q`` -- or is a distinct point mass, as n-gram branches are.

``target_probs`` are the *processed* distributions (temperature, top-k/top-p/min-p,
penalties and grammar masks applied per node, as the sampler would for that path); greedy
verification takes the argmax of the same processed logits.

Randomness: per sequence, ``num_drafts`` uniforms (one per proposed node, node ``i`` uses the
``i-1``-th), then ``V`` Exponential(1) values for the final draw (the exponential race
``argmax(r / E)`` the sampler uses), from the sequence's own generator (seeded requests);
rows without one draw from the shared generator, all at once. How many values a step
draws depends only on the shapes, never on the outcome, so a seeded request's tokens do not
depend on the batch it ran in; chain and tree draw alike, so a chain verified either way
with the same seed gives the same tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from flexpage.speculative.tree import DraftTree

__all__ = ["ChainOutput", "Verified", "greedy_chain", "rejection_sample_chain", "verify_tree",
           "verify_tree_greedy"]


@dataclass(frozen=True)
class Verified:
    """One sequence's verification: ``token_ids`` to append (accepted proposals, then one token
    from the target), ``accepted_nodes`` the tree nodes of the accepted proposals (their KV
    slots survive; every other node's are rolled back)."""

    token_ids: list[int]
    accepted_nodes: list[int]

    @property
    def num_accepted(self) -> int:
        return len(self.accepted_nodes)

    @property
    def scoring_nodes(self) -> list[int]:
        """The logits row that produced each of ``token_ids`` (for logprobs): root, then the path."""
        return [0, *self.accepted_nodes]


@dataclass(frozen=True)
class ChainOutput:
    """A batch of chains: ``token_ids`` ``[B, K+1]`` (emitted tokens first, -1 after),
    ``num_accepted`` ``[B]`` proposals accepted (row ``b`` emits ``num_accepted[b] + 1`` tokens)."""

    token_ids: Tensor
    num_accepted: Tensor

    def tolist(self) -> list[list[int]]:
        """Per row, the tokens to append: :class:`~flexpage.executor.plan.StepResult`'s ``token_ids``."""
        return [row[: n + 1] for row, n in zip(self.token_ids.tolist(), self.num_accepted.tolist())]


def _draws(num_drafts: int, vocab: int, generator: torch.Generator | None, device: torch.device,
           dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """One sequence's randomness: uniforms ``[num_drafts]``, then Exponential(1) ``[vocab]``."""
    uniforms = torch.rand(num_drafts, generator=generator, dtype=dtype, device=device)
    race = torch.empty(vocab, dtype=dtype, device=device).exponential_(generator=generator)
    return uniforms, race.clamp_min_(1e-10)


def _batch_draws(rows: int, num_drafts: int, vocab: int, generators: Sequence[torch.Generator | None] | None,
                 generator: torch.Generator | None, device: torch.device,
                 dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``[B, K]`` uniforms and ``[B, V]`` race values: a row with its own generator draws as
    :func:`_draws` does; the others draw together from ``generator`` (two calls, not 2B)."""
    if generators is not None and len(generators) != rows:
        raise ValueError(f"generators: got {len(generators)} for {rows} rows")
    own = [None] * rows if generators is None else list(generators)
    uniforms = torch.empty(rows, num_drafts, dtype=dtype, device=device)
    race = torch.empty(rows, vocab, dtype=dtype, device=device)
    shared = [row for row, g in enumerate(own) if g is None]
    if shared:
        index = torch.tensor(shared, device=device)
        uniforms[index] = torch.rand(len(shared), num_drafts, generator=generator, dtype=dtype, device=device)
        race[index] = torch.empty(len(shared), vocab, dtype=dtype, device=device).exponential_(generator=generator)
    for row, g in enumerate(own):
        if g is not None:
            uniforms[row], race[row] = _draws(num_drafts, vocab, g, device, dtype)
    return uniforms, race.clamp_min_(1e-10)


def _emitted(draft_tokens: Tensor, num_accepted: Tensor, final: Tensor) -> Tensor:
    """``[B, K+1]``: the accepted drafts, the final token at ``num_accepted``, -1 after."""
    rows, k = draft_tokens.shape
    out = torch.full((rows, k + 1), -1, dtype=torch.int64, device=draft_tokens.device)
    keep = torch.arange(k, device=draft_tokens.device) < num_accepted[:, None]
    out[:, :k] = torch.where(keep, draft_tokens.long(), -1)
    out[torch.arange(rows, device=out.device), num_accepted] = final.long()
    return out


def _check_chain(draft_tokens: Tensor, num_drafts: Tensor, target_rows: int) -> None:
    if draft_tokens.dim() != 2 or num_drafts.shape != draft_tokens.shape[:1]:
        raise ValueError(f"draft_tokens [B, K] and num_drafts [B]: got shapes {tuple(draft_tokens.shape)} and "
                         f"{tuple(num_drafts.shape)}")
    if target_rows != draft_tokens.shape[1] + 1:
        raise ValueError(f"target rows: got {target_rows}, expected K + 1 = {draft_tokens.shape[1] + 1}")
    if bool(((num_drafts < 0) | (num_drafts > draft_tokens.shape[1])).any()):
        raise ValueError(f"num_drafts: got {num_drafts.tolist()}, expected values in [0, {draft_tokens.shape[1]}]")


def _accepted_prefix(accept: Tensor) -> Tensor:
    """``[B]`` length of the leading run of True in each row of ``accept`` ``[B, K]``."""
    return accept.long().cumprod(dim=-1).sum(dim=-1)


def greedy_chain(draft_tokens: Tensor, num_drafts: Tensor, target_argmax: Tensor) -> ChainOutput:
    """Greedy verification of a batch of chains.

    draft_tokens:  ``[B, K]`` proposed tokens (row ``b``'s first ``num_drafts[b]`` count)
    num_drafts:    ``[B]``
    target_argmax: ``[B, K+1]`` the target's token after the root and after each proposal
    """
    _check_chain(draft_tokens, num_drafts, target_argmax.shape[1])
    k = draft_tokens.shape[1]
    valid = torch.arange(k, device=draft_tokens.device) < num_drafts[:, None]
    num_accepted = _accepted_prefix(valid & (draft_tokens == target_argmax[:, :k]))
    final = target_argmax.gather(1, num_accepted[:, None]).squeeze(1)
    return ChainOutput(_emitted(draft_tokens, num_accepted, final), num_accepted)


def rejection_sample_chain(
    draft_tokens: Tensor,
    num_drafts: Tensor,
    target_probs: Tensor,
    draft_probs: Tensor | None = None,
    *,
    generators: Sequence[torch.Generator | None] | None = None,
    generator: torch.Generator | None = None,
) -> ChainOutput:
    """Speculative sampling of a batch of chains, vectorised over the batch and positions.

    draft_tokens: ``[B, K]`` proposed tokens (row ``b``'s first ``num_drafts[b]`` count)
    num_drafts:   ``[B]``
    target_probs: ``[B, K+1, V]`` the target's processed distribution after the root and
                  after each proposal
    draft_probs:  ``[B, K, V]`` the distribution each proposal was drawn from; None: point
                  masses (n-gram proposals)
    generators:   per row, its own generator (seeded requests) or None for ``generator``
    """
    _check_chain(draft_tokens, num_drafts, target_probs.shape[1])
    rows, k = draft_tokens.shape
    vocab = target_probs.shape[-1]
    uniforms, race = _batch_draws(rows, k, vocab, generators, generator, target_probs.device, target_probs.dtype)
    drafts = draft_tokens.long().clamp(0, vocab - 1)
    p_x = target_probs[:, :k].gather(2, drafts[..., None]).squeeze(2)  # [B, K]
    q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs.gather(2, drafts[..., None]).squeeze(2)
    valid = torch.arange(k, device=drafts.device) < num_drafts[:, None]
    num_accepted = _accepted_prefix(valid & (uniforms * q_x < p_x))  # u < p/q: probability min(1, p/q)

    index = torch.arange(rows, device=drafts.device)
    p_last = target_probs[index, num_accepted]  # [B, V]: where the final token comes from
    residual = p_last
    if k:
        at = num_accepted.clamp(max=k - 1)
        if draft_probs is None:
            q_last = torch.zeros_like(p_last).scatter_(1, drafts[index, at][:, None], 1.0)
        else:
            q_last = draft_probs[index, at]
        rejected = (num_accepted < num_drafts)[:, None]
        residual = torch.where(rejected, (p_last - q_last).clamp_min(0), p_last)
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_last)  # p == q: nothing left
    final = (residual / race).argmax(dim=-1)
    return ChainOutput(_emitted(draft_tokens, num_accepted, final), num_accepted)


def _check_tree(tree: DraftTree, rows: int, name: str) -> None:
    if rows != tree.num_nodes:
        raise ValueError(f"{name}: got {rows} rows, expected one per tree node ({tree.num_nodes})")


def verify_tree_greedy(tree: DraftTree, target_argmax: Sequence[int] | Tensor) -> Verified:
    """Greedy verification of one tree; ``target_argmax[i]``: the target's token after node ``i``."""
    _check_tree(tree, len(target_argmax), "target_argmax")
    argmax = [int(t) for t in target_argmax]
    kids = tree.child_lists()
    node, accepted = 0, []
    while True:
        match = next((c for c in kids[node] if tree.tokens[c] == argmax[node]), None)
        if match is None:
            return Verified([tree.tokens[n] for n in accepted] + [argmax[node]], accepted)
        accepted.append(match)
        node = match


def verify_tree(tree: DraftTree, target_probs: Tensor, draft_probs: Tensor | None = None, *,
                generator: torch.Generator | None = None) -> Verified:
    """Recursive rejection sampling of one tree.

    target_probs: ``[N, V]`` the target's processed distribution after each node
    draft_probs:  ``[N, V]``, row ``i`` the distribution node ``i``'s token was drawn from
                  (row 0 unused); None: every proposal is a point mass (n-gram branches)
    """
    _check_tree(tree, target_probs.shape[0], "target_probs")
    if draft_probs is not None:
        _check_tree(tree, draft_probs.shape[0], "draft_probs")
    uniforms, race = _draws(tree.num_nodes - 1, target_probs.shape[1], generator, target_probs.device,
                            target_probs.dtype)
    kids = tree.child_lists()
    node, accepted = 0, []
    while True:
        residual = target_probs[node]
        for child in kids[node]:
            x = tree.tokens[child]
            q = draft_probs[child] if draft_probs is not None else None
            q_x = 1.0 if q is None else float(q[x])
            if float(uniforms[child - 1]) * q_x < float(residual[x]):
                break
            if q is not None:
                left = (residual - q).clamp_min(0)
            else:  # a point mass: the residual is the distribution without x
                left = residual.index_fill(0, torch.tensor([x], device=residual.device), 0.0)
            total = left.sum()
            if total > 0:  # else p == q: the rejection had probability 0, keep what there was
                residual = left / total
        else:
            final = int((residual / race).argmax())
            return Verified([tree.tokens[n] for n in accepted] + [final], accepted)
        accepted.append(child)
        node = child
