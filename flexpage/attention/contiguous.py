"""FlexAttention over contiguous per-row K/V (the layout HF transformers' caches use).

The HF backend (:mod:`flexpage.model.hf_backend`) runs recipes on HF's own cache
tensors ``[B, H_kv, S, D]``: there are no pages, but the same ideas apply -- the block
mask is built from lengths with tensor operations (never ``create_block_mask``), wholly
visible key blocks skip the mask, and the recipe sees logical positions (cache index
minus the row's left padding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from flexpage.attention import torch_patches
from flexpage.attention.flex import call_compiled, isa_kernel_options
from flexpage.attention.recipe import Recipe

KV_BLOCK = 128
PREFILL_Q_BLOCK = 32


@dataclass(frozen=True)
class RowLayout:
    """Where each row's real tokens are: ``valid[b, i]`` for cache index ``i``; ``shift[b]`` left padding."""

    valid: Tensor  # [B, S_kv] bool
    shift: Tensor  # [B] int64: logical position = absolute index - shift
    q_offset: int  # absolute index of the first query
    kv_offset: int  # absolute index of cache index 0


@dataclass(frozen=True)
class ContiguousMask:
    kv_num_blocks: Tensor
    kv_indices: Tensor
    full_kv_num_blocks: Tensor
    full_kv_indices: Tensor
    q_block: int


def build_contiguous_mask(layout: RowLayout, q_len: int, recipe: Recipe) -> ContiguousMask:
    """Block lists for queries ``[B, q_len]`` against keys ``[B, S_kv]`` from the recipe's block rule."""
    batch, kv_len = layout.valid.shape
    q_block = 1 if q_len == 1 else PREFILL_Q_BLOCK
    num_q_blocks = -(-q_len // q_block)
    num_kv_blocks = -(-kv_len // KV_BLOCK)
    shift = layout.shift[:, None, None]
    m = torch.arange(num_q_blocks)[None, :, None]
    q_lo = layout.q_offset + m * q_block - shift
    q_hi = layout.q_offset + torch.clamp((m + 1) * q_block, max=q_len) - 1 - shift
    j = torch.arange(num_kv_blocks)[None, None, :]
    kv_lo = layout.kv_offset + j * KV_BLOCK - shift
    kv_hi = layout.kv_offset + torch.clamp((j + 1) * KV_BLOCK, max=kv_len) - 1 - shift
    b = torch.arange(batch)[:, None, None]
    may, every = recipe.block_rule(b, q_lo, q_hi, kv_lo, kv_hi)
    padded = torch.nn.functional.pad(layout.valid, (0, num_kv_blocks * KV_BLOCK - kv_len))
    blocks = padded.view(batch, num_kv_blocks, KV_BLOCK)
    any_valid = blocks.any(-1)[:, None, :]
    all_valid = blocks.all(-1)[:, None, :]
    may = may & any_valid
    every = every & may & all_valid
    partial = may & ~every
    return ContiguousMask(*_compact(partial), *_compact(every), q_block=q_block)


def _compact(selected: Tensor) -> tuple[Tensor, Tensor]:
    order = torch.argsort((~selected).to(torch.int8), dim=-1, stable=True)
    return selected.sum(-1, dtype=torch.int32)[:, None], order.int()[:, None]


def _contiguous_attention(
    q: Tensor, k: Tensor, v: Tensor, kv_num_blocks: Tensor, kv_indices: Tensor, full_kv_num_blocks: Tensor,
    full_kv_indices: Tensor, valid: Tensor, shift: Tensor, q_offset: Tensor, kv_offset: Tensor,
    recipe: Recipe, q_block: int, scale: float | None, kernel_options: dict,
) -> Tensor:
    def positions(b: Tensor, q_idx: Tensor, kv_idx: Tensor) -> tuple[Tensor, Tensor]:
        return q_offset + q_idx - shift[b], kv_offset + kv_idx - shift[b]

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        ok = valid[b, kv_idx]
        if recipe.mask_mod is None:
            return ok
        q_pos, kv_pos = positions(b, q_idx, kv_idx)
        return ok & recipe.mask_mod(b, h, q_pos, kv_pos)

    score_mod = None
    if recipe.score_mod is not None:
        user_score = recipe.score_mod

        def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            q_pos, kv_pos = positions(b, q_idx, kv_idx)
            return user_score(score, b, h, q_pos, kv_pos)

    block_mask = BlockMask.from_kv_blocks(
        kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, BLOCK_SIZE=(q_block, KV_BLOCK),
        mask_mod=mask_mod, seq_lengths=(q.shape[2], k.shape[2]), compute_q_blocks=False,
    )
    return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                          enable_gqa=q.shape[1] != k.shape[1], kernel_options=kernel_options)


# static by default (floats such as a soft-cap stay constants), with the per-call sizes marked dynamic
_compiled_contiguous_attention = torch.compile(_contiguous_attention, dynamic=False, fullgraph=True)


def _mark_dynamic(q: Tensor, k: Tensor, v: Tensor, mask: ContiguousMask, layout: RowLayout) -> None:
    for t, dims in ((q, (0, 2)), (k, (0, 2)), (v, (0, 2)), (layout.valid, (0, 1)), (layout.shift, (0,)),
                    (mask.kv_num_blocks, (0, 2)), (mask.kv_indices, (0, 2, 3)),
                    (mask.full_kv_num_blocks, (0, 2)), (mask.full_kv_indices, (0, 2, 3))):
        for dim in dims:
            torch._dynamo.maybe_mark_dynamic(t, dim)


def contiguous_attention(
    q: Tensor, k: Tensor, v: Tensor, layout: RowLayout, recipe: Recipe, *,
    scale: float | None = None, compile: bool = True, mask: ContiguousMask | None = None,
) -> Tensor:
    """q: [B, H, L, D]; k, v: [B, H_kv, S, D] -> [B, H, L, D]."""
    mask = mask or build_contiguous_mask(layout, q.shape[2], recipe)
    fn = _compiled_contiguous_attention if compile else _contiguous_attention
    if compile:
        torch_patches.install()
        _mark_dynamic(q, k, v, mask, layout)
    return call_compiled(
        fn, q, k, v, mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices,
        layout.valid, layout.shift, torch.tensor(layout.q_offset), torch.tensor(layout.kv_offset),
        recipe, mask.q_block, scale, isa_kernel_options(q.device),
    )
