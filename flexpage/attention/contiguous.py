"""FlexAttention over contiguous per-row K/V (the layout HF transformers' caches use).

The HF backend (:mod:`flexpage.model.hf_backend`) runs recipes on HF's own cache
tensors ``[B, H_kv, S, D]``: there are no pages, but the same ideas as the paged path apply
-- the block mask is built from lengths with tensor operations (never ``create_block_mask``),
wholly visible key blocks skip the mask, the recipe sees logical positions (cache index
minus the row's left padding), the kernel is flexpage's tuned CPU template, and decode
queries pack the query heads that share a kv head into rows (``[B, H_kv, G, D]``: each key
block is read once per kv head, not once per query head).

One compiled program per recipe and call kind (prefill, decode) serves every call, saved on
disk and called directly, not through Dynamo (:mod:`flexpage.backends.cpu.saved_programs`). Its
sizes are dynamic and kept off Dynamo's 0/1 specialisations (index lists and query-block
lists padded to at least two entries; queries always in HF's ``[B, L, H, D]`` memory order),
so a new prompt or cache length compiles nothing: a model needs one graph for prefill and
one for decode per (recipe, batch of one or more) -- see ``tests/test_hf_backend.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from flexpage.attention.flex import kernel_options_for
from flexpage.attention.recipe import Recipe
from flexpage.backends.cpu import torch_patches
from flexpage.backends.cpu.saved_programs import Program, compiled_program

KV_BLOCK = 128
PREFILL_Q_BLOCK = 32
_MIN_LISTED = 2  # index and query-block lists are padded to this: Dynamo specialises a size of 1


@dataclass(frozen=True)
class RowLayout:
    """Where each row's real tokens are: ``valid[b, i]`` for cache index ``i``; ``shift[b]`` left padding."""

    valid: Tensor  # [B, S_kv] bool
    shift: Tensor  # [B] int64: logical position = absolute index - shift
    q_offset: int | Tensor  # absolute index of the first query (a 0-d tensor from HF's static cache)
    kv_offset: int  # absolute index of cache index 0


@dataclass(frozen=True)
class ContiguousMask:
    """One forward pass's block lists for one recipe, and each row's logical start positions."""

    kv_num_blocks: Tensor
    kv_indices: Tensor
    full_kv_num_blocks: Tensor
    full_kv_indices: Tensor
    q_block: int
    q_start: Tensor  # [B]: logical position of query 0
    kv_start: Tensor  # [B]: logical position of cache index 0


def build_contiguous_mask(layout: RowLayout, q_len: int, recipe: Recipe) -> ContiguousMask:
    """Block lists for queries ``[B, q_len]`` against keys ``[B, S_kv]`` from the recipe's block rule."""
    batch, kv_len = layout.valid.shape
    q_block = 1 if q_len == 1 else PREFILL_Q_BLOCK
    num_q_blocks = -(-q_len // q_block)
    num_kv_blocks = -(-kv_len // KV_BLOCK)
    q_start = layout.q_offset - layout.shift
    kv_start = layout.kv_offset - layout.shift
    m = torch.arange(num_q_blocks)[None, :, None]
    q_lo = q_start[:, None, None] + m * q_block
    q_hi = q_start[:, None, None] + torch.clamp((m + 1) * q_block, max=q_len) - 1
    j = torch.arange(num_kv_blocks)[None, None, :]
    kv_lo = kv_start[:, None, None] + j * KV_BLOCK
    kv_hi = kv_start[:, None, None] + torch.clamp((j + 1) * KV_BLOCK, max=kv_len) - 1
    b = torch.arange(batch)[:, None, None]
    may, every = recipe.block_rule(b, q_lo, q_hi, kv_lo, kv_hi)
    padded = torch.nn.functional.pad(layout.valid, (0, num_kv_blocks * KV_BLOCK - kv_len))
    blocks = padded.view(batch, num_kv_blocks, KV_BLOCK)
    any_valid = blocks.any(-1)[:, None, :]
    all_valid = blocks.all(-1)[:, None, :]
    may = may & any_valid
    every = every & may & all_valid
    partial = may & ~every
    if q_block > 1 and num_q_blocks < _MIN_LISTED:  # a query block past the last one: visits nothing
        partial, every = (torch.nn.functional.pad(t, (0, 0, 0, _MIN_LISTED - num_q_blocks)) for t in (partial, every))
    return ContiguousMask(*_compact(partial), *_compact(every), q_block=q_block, q_start=q_start, kv_start=kv_start)


def _compact(selected: Tensor) -> tuple[Tensor, Tensor]:
    """``[B, M, J]`` bools -> (counts ``[B, 1, M]``, ids ``[B, 1, M, max(J, 2)]``), listed blocks first."""
    order = torch.argsort((~selected).to(torch.int8), dim=-1, stable=True).int()
    if order.shape[-1] < _MIN_LISTED:  # entries past the count are never read
        order = torch.nn.functional.pad(order, (0, _MIN_LISTED - order.shape[-1]))
    return selected.sum(-1, dtype=torch.int32)[:, None].contiguous(), order[:, None].contiguous()


def _contiguous_attention(
    q: Tensor, k: Tensor, v: Tensor, kv_num_blocks: Tensor, kv_indices: Tensor, full_kv_num_blocks: Tensor,
    full_kv_indices: Tensor, valid: Tensor, q_start: Tensor, kv_start: Tensor,
    recipe: Recipe, q_block: int, heads_per_kv: int, scale: float | None, kernel_options: dict,
) -> Tensor:
    """``heads_per_kv`` > 1: decode queries packed as ``[B, H_kv, G, D]`` (row ``g`` is query head
    ``h * G + g``, all at the row's one query position); else ``[B, H, L, D]``."""
    g = heads_per_kv

    def positions(b: Tensor, q_idx: Tensor, kv_idx: Tensor) -> tuple[Tensor, Tensor]:
        query = q_start[b] if g > 1 else q_start[b] + q_idx
        return query, kv_start[b] + kv_idx

    def query_head(h: Tensor, q_idx: Tensor) -> Tensor:
        return h * g + q_idx if g > 1 else h

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        ok = valid[b, kv_idx]
        if recipe.mask_mod is None:
            return ok
        q_pos, kv_pos = positions(b, q_idx, kv_idx)
        return ok & recipe.mask_mod(b, query_head(h, q_idx), q_pos, kv_pos)

    score_mod = None
    if recipe.score_mod is not None:
        user_score = recipe.score_mod

        def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            q_pos, kv_pos = positions(b, q_idx, kv_idx)
            return user_score(score, b, query_head(h, q_idx), q_pos, kv_pos)

    block_mask = BlockMask.from_kv_blocks(
        kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, BLOCK_SIZE=(q_block * g, KV_BLOCK),
        mask_mod=mask_mod, seq_lengths=(q.shape[2], k.shape[2]), compute_q_blocks=False,
    )
    return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                          enable_gqa=q.shape[1] != k.shape[1], kernel_options=kernel_options)


def _program(recipe: Recipe, q_block: int, heads_per_kv: int, scale: float | None,
             kernel_options: tuple[tuple[str, object], ...]) -> Program:
    """The compiled attention for one set of constants (static shapes but for the sizes each
    call names: floats such as a soft-cap stay constants), saved on disk for the next process
    (:mod:`flexpage.backends.cpu.saved_programs`) unless the recipe cannot be named by its content."""

    def attention(q: Tensor, k: Tensor, v: Tensor, kv_num_blocks: Tensor, kv_indices: Tensor,
                  full_kv_num_blocks: Tensor, full_kv_indices: Tensor, valid: Tensor, q_start: Tensor,
                  kv_start: Tensor) -> Tensor:
        return _contiguous_attention(q, k, v, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, valid,
                                     q_start, kv_start, recipe, q_block, heads_per_kv, scale, dict(kernel_options))

    return compiled_program(attention, "contiguous", recipe, q_block, heads_per_kv, scale, kernel_options)


def _dynamic_sizes(q: Tensor, k: Tensor, v: Tensor, mask: ContiguousMask, valid: Tensor,
                   packed: bool) -> list[tuple[Tensor, int]]:
    """The (tensor, dim) sizes that vary between calls (marked dynamic where a call compiles)."""
    queries = (0,) if packed else (0, 2)
    return [(t, dim) for t, dims in (
        (q, queries), (k, (0, 2)), (v, (0, 2)), (valid, (0, 1)), (mask.q_start, (0,)), (mask.kv_start, (0,)),
        (mask.kv_num_blocks, (0, 2)), (mask.kv_indices, (0, 2, 3)), (mask.full_kv_num_blocks, (0, 2)),
        (mask.full_kv_indices, (0, 2, 3))) for dim in dims]


def contiguous_attention(
    q: Tensor, k: Tensor, v: Tensor, layout: RowLayout, recipe: Recipe, *,
    scale: float | None = None, compile: bool = True, mask: ContiguousMask | None = None,
) -> Tensor:
    """q: [B, H, L, D]; k, v: [B, H_kv, S, D] -> [B, L, H, D], what HF's attention modules reshape
    into the o projection's input (contiguous from the compiled kernel: no copy there)."""
    batch, heads, q_len, dim = q.shape
    mask = mask or build_contiguous_mask(layout, q_len, recipe)
    # queries in [B, L, H, D] memory order: the kernel writes its output in the same order,
    # so the result needs no copy (HF's queries usually are; one memory order, one graph)
    if not _in_hf_order(q):
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    heads_per_kv = heads // k.shape[1] if q_len == 1 else 1
    if heads_per_kv > 1:
        q = q.reshape(batch, k.shape[1], heads_per_kv, dim)
    tensors = (q, k, v, mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices,
               layout.valid, mask.q_start, mask.kv_start)
    constants = (recipe, mask.q_block, heads_per_kv, scale)
    if torch.compiler.is_compiling():  # inside the user's compiled model: one graph with it
        out = _contiguous_attention(*tensors, *constants, dict(_traced_kernel_options(q.device)))
    elif compile:
        program = _compiled(q.device, *constants)
        out = program(tensors, _dynamic_sizes(q, k, v, mask, layout.valid, packed=heads_per_kv > 1))
    else:
        out = _contiguous_attention(*tensors, *constants, _kernel_options(q.device))
    return out.reshape(batch, 1, heads, dim) if heads_per_kv > 1 else out.transpose(1, 2)


def _in_hf_order(q: Tensor) -> bool:
    """Whether ``q`` ``[B, H, L, D]`` is laid out as ``[B, L, H, D]`` (``is_contiguous`` of its
    transpose, in Python: this runs in every layer, where each dispatched call costs microseconds)."""
    batch, heads, length, dim = q.shape
    s_batch, s_head, s_length, s_dim = q.stride()
    return ((s_dim == 1 or dim == 1) and (s_head == dim or heads == 1) and (s_length == heads * dim or length == 1)
            and (s_batch == length * heads * dim or batch == 1))


_COMPILED: dict[tuple, Program] = {}


def _compiled(device: torch.device, recipe: Recipe, q_block: int, heads_per_kv: int, scale: float | None) -> Program:
    """:func:`_program` for a call's constants, with flexpage's patches in and their kernel
    options: one per process and set of constants, found by one dict lookup per call."""
    key = (device, recipe, q_block, heads_per_kv, scale)
    if key not in _COMPILED:
        torch_patches.install()
        _COMPILED[key] = _program(recipe, q_block, heads_per_kv, scale, tuple(_kernel_options(device).items()))
    return _COMPILED[key]


_KERNEL_OPTIONS: dict[tuple[torch.device, bool], dict] = {}


def _kernel_options(device: torch.device) -> dict:
    """The paged kernels' options (flexpage's tuned CPU template where installed, the ISA),
    one dict per device and patch state."""
    key = (device, torch_patches.tuning_active())
    if key not in _KERNEL_OPTIONS:
        _KERNEL_OPTIONS[key] = kernel_options_for(device, None)
    return _KERNEL_OPTIONS[key]


@torch._dynamo.assume_constant_result
def _traced_kernel_options(device: torch.device) -> tuple[tuple[str, object], ...]:
    """:func:`_kernel_options`' items for a compiled model's trace, which calls this for real
    (once, at trace time) and uses the result as a constant. So flexpage's Inductor patches go
    in before Inductor lowers the model's graph -- without them the CPU template fails on mods
    that read tensors the graph computes (see :mod:`flexpage.backends.cpu.inductor_fix`)."""
    torch_patches.install()
    return tuple(_kernel_options(device).items())
