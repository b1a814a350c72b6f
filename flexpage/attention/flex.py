"""The compiled paged attention call: logical recipe mods wrapped in the paging translation.

:class:`FlexRunner` is the one call a model layer makes: it takes the flat new-token
queries ``[T, H, D]`` and one layer's pool, and runs one FlexAttention kernel per group of
a :class:`~flexpage.attention.paging.PagedBatch` (decode rows, prefill rows).

Decode rows (``_group_attention``) read the pool in place. Two layout choices make the
CPU kernel fast there (it pays per (query block, head, key block) visited): query heads
that share a kv head are packed into query rows (``[B, H_kv, L*G, D]``), so each key block
is loaded once per kv head; and a key block is ``pages_per_block`` aligned pages, which
the allocator fills with one sequence's pages. The paging-wrapped mods undo both:
``q_idx // G`` is the query token, ``h*G + q_idx % G`` the query head, ``page_to_logical``
the logical position of a physical slot.

Prefill rows (``_gathered_group_attention``) read a copy of their own keys in logical order
(``AttentionGroup.kv_slots``), so the mods see logical positions directly: the page-table
lookup per masked (query, key) pair cost as much as the attention (see paging.py). The
kernel broadcasts kv heads itself; the queries are a view of the flat batch. On CPUs
without AMX, bf16/fp16 rows attend in float32 (:func:`gathered_attention_dtype`).

Compilation: both functions are wrapped once by ``torch.compile`` (``dynamic=False``, the
per-step sizes marked dynamic) at module level; the recipe, page size, block sizes and
kernel options are Python constants, so the compiled variants a run can trigger are bounded
by (dtype, head dims, recipe) x {decode x {mask with or without the ownership check: see
``PagedBatch.one_owner_per_block``}, prefill}, plus the 0/1 specialisations Dynamo makes for
a group with one row or one query block. ``FlexRunner(compile=False)`` runs the same
program eagerly (it materialises scores: for debugging only).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from flexpage.attention.errors import check_arg
from flexpage.attention.kv_quant import scale_output, scale_queries
from flexpage.attention.paging import AttentionGroup, PagedBatch
from flexpage.attention.recipe import Recipe
from flexpage.backends.cpu import torch_patches
from flexpage.backends.cpu.description import describe
from flexpage.backends.cpu.kernel_options import VEC_ISA_OPTION, attention_kernel_options, isa_options  # noqa: F401


def _group_attention(
    q: Tensor,  # [B, H_kv, L*G, D]: query heads packed into rows (row l*G + g is head h*G + g)
    k_pool: Tensor,  # [1, H_kv, S, D]
    v_pool: Tensor,
    kv_num_blocks: Tensor,
    kv_indices: Tensor,
    full_kv_num_blocks: Tensor,
    full_kv_indices: Tensor,
    row_seq: Tensor,
    block_table: Tensor,
    q_start: Tensor,
    seq_len: Tensor,
    page_to_logical: Tensor,
    recipe: Recipe,
    page_size: int,
    pages_per_block: int,
    q_block: int,
    heads_per_kv: int,
    check_owner: bool,
    scale: float | None,
    kernel_options: dict | None,
) -> Tensor:
    g = heads_per_kv
    # integer division is scalar code in the CPU kernel's vectorised mask: use shifts for the
    # page size (a power of two), and skip the query-row division where every row is one token
    page_shift = page_size.bit_length() - 1 if page_size & (page_size - 1) == 0 else None

    def logical(b: Tensor, q_idx: Tensor, kv_idx: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if page_shift is None:
            page, offset = kv_idx // page_size, kv_idx % page_size
        else:
            page, offset = kv_idx >> page_shift, kv_idx & (page_size - 1)
        logical_page = page_to_logical[page]
        kv_pos = logical_page * page_size + offset
        # the compiled kernel only visits key blocks listed for row b, where other rows' pages
        # sit only if a block holds several sequences' pages; eager mode visits every slot
        owned = logical_page >= 0
        if check_owner:
            owned = owned & (block_table[b, logical_page.clamp(min=0)] == page)
        valid = owned & (kv_pos < seq_len[b])
        # recipes may index tables by position: keep positions in range even where masked
        last = (seq_len[b] - 1).clamp(min=0)
        query = q_start[b] if q_block == 1 else q_start[b] + q_idx // g  # decode: one token per row
        q_pos = torch.minimum(query, last)
        return q_pos, torch.minimum(kv_pos.clamp(min=0), last), valid

    def query_head(h: Tensor, q_idx: Tensor) -> Tensor:
        return h * g + q_idx % g

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        q_pos, kv_pos, valid = logical(b, q_idx, kv_idx)
        if recipe.mask_mod is None:
            return valid
        return valid & recipe.mask_mod(row_seq[b], query_head(h, q_idx), q_pos, kv_pos)

    score_mod = None
    if recipe.score_mod is not None:
        user_score = recipe.score_mod

        def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            q_pos, kv_pos, _ = logical(b, q_idx, kv_idx)
            return user_score(score, row_seq[b], query_head(h, q_idx), q_pos, kv_pos)

    block_mask = BlockMask.from_kv_blocks(
        kv_num_blocks,
        kv_indices,
        full_kv_num_blocks,
        full_kv_indices,
        BLOCK_SIZE=(q_block * g, page_size * pages_per_block),
        mask_mod=mask_mod,
        seq_lengths=(q.shape[2], k_pool.shape[2]),
        compute_q_blocks=False,
    )
    return flex_attention(q, k_pool, v_pool, score_mod=score_mod, block_mask=block_mask, scale=scale,
                          kernel_options=kernel_options)


def _gathered_group_attention(
    q: Tensor,  # [B, H, L, D]: a strided view of the flat queries ([B, H_kv, L*G, D] packed, see heads_per_kv)
    k: Tensor,  # [1, H_kv, S, D]: each row's keys in logical order from kv_start[row]
    v: Tensor,
    kv_num_blocks: Tensor,
    kv_indices: Tensor,
    full_kv_num_blocks: Tensor,
    full_kv_indices: Tensor,
    row_seq: Tensor,
    q_start: Tensor,
    seq_len: Tensor,
    kv_start: Tensor,
    recipe: Recipe,
    q_block: int,
    kv_block: int,
    scale: float | None,
    kernel_options: dict | None,
    heads_per_kv: int = 1,
) -> Tensor:
    """Rows whose keys lie in logical order from ``kv_start[b]`` -- prefill rows over gathered
    keys, or any row of the virtual layout over the pool itself: logical position = key index
    - the row's start, so the mask needs no page table (``kv_start[b]`` is one value per row:
    a scalar in the kernel). ``heads_per_kv`` > 1: query heads packed into rows per kv head
    (decode rows, as :func:`_group_attention`)."""
    g = heads_per_kv

    def positions(b: Tensor, q_idx: Tensor, kv_idx: Tensor) -> tuple[Tensor, Tensor]:
        # recipes may index tables by position: keep positions in range even where masked
        last = (seq_len[b] - 1).clamp(min=0)
        if g == 1:
            query = q_start[b] + q_idx
        else:  # packed heads; decode rows hold one token each (no division in the vectorised mask)
            query = q_start[b] if q_block == 1 else q_start[b] + q_idx // g
        return torch.minimum(query, last), (kv_idx - kv_start[b]).clamp(min=0).clamp(max=last)

    def query_head(h: Tensor, q_idx: Tensor) -> Tensor:
        return h * g + q_idx % g if g > 1 else h

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        kv_pos = kv_idx - kv_start[b]
        valid = (kv_pos >= 0) & (kv_pos < seq_len[b])  # the compiled kernel visits the row's blocks only; eager all
        if recipe.mask_mod is None:
            return valid
        q_pos, kv_pos = positions(b, q_idx, kv_idx)
        return valid & recipe.mask_mod(row_seq[b], query_head(h, q_idx), q_pos, kv_pos)

    score_mod = None
    if recipe.score_mod is not None:
        user_score = recipe.score_mod

        def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            q_pos, kv_pos = positions(b, q_idx, kv_idx)
            return user_score(score, row_seq[b], query_head(h, q_idx), q_pos, kv_pos)

    block_mask = BlockMask.from_kv_blocks(
        kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, BLOCK_SIZE=(q_block * g, kv_block),
        mask_mod=mask_mod, seq_lengths=(q.shape[2], k.shape[2]), compute_q_blocks=False,
    )
    return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                          enable_gqa=q.shape[1] != k.shape[1], kernel_options=kernel_options)


@functools.cache
def gathered_attention_dtype(dtype: torch.dtype, device: torch.device,
                             deterministic: bool = False) -> torch.dtype:
    """The dtype rows over a gathered copy of their keys attend in (prefill rows; in a
    deterministic plan, decode rows outside aligned runs too): ``dtype``, except where the
    device's kernels run a reduced precision slower than float32 -- on a CPU, bf16/fp16 where
    they can neither pack for AMX nor run AVX512-BF16 dot products
    (:meth:`~flexpage.backends.cpu.description.CPUDescription.attention_dtype`).

    There the reduced-precision kernel is the stock vector micro-gemm, which widens every
    load to float32 and rounds the probabilities back before ``P @ V``; float32 inputs run the
    tuned template's row-blocked float32 path instead (bf16 prefill rows on stock micro-gemms:
    1.04-1.68x contiguous SDPA's time, as float32 0.80-1.08x; ``bench/prefill.py``). The gather
    copies the keys anyway, so widening them costs one wider write, and the result is no less exact.

    ``deterministic``: always ``dtype``. Deterministic decode rows read the pool in place
    where they can (``build_paged_batch(deterministic_in_place=True)``), and must compute as
    the same token's row over a gathered copy does.
    """
    if deterministic or device.type != "cpu":
        return dtype
    return describe().attention_dtype(dtype)


@functools.cache
def deterministic_decode_in_place(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether deterministic plans let aligned decode rows read the pool in place
    (``build_paged_batch(deterministic_in_place=True)``): on CPUs whose kernels for ``dtype``
    do not pack K/V for AMX. A packing kernel over the pool in place is untried in
    deterministic mode (no AMX machine was at hand), so there decode rows keep the gathered copy."""
    return device.type == "cpu" and not describe().packs_for_amx(dtype)


def isa_kernel_options(device: torch.device) -> dict:
    """A kernel option naming the CPU vector ISA Inductor compiles for (empty off the CPU; see
    :mod:`flexpage.backends.cpu.kernel_options`). Every compiled flexpage kernel carries it."""
    return isa_options() if device.type == "cpu" else {}


def kernel_options_for(device: torch.device, kernel_options: dict | None, *, deterministic: bool = False) -> dict:
    """The kernel options of flexpage's paged kernels: the caller's, and the device backend's
    (on the CPU the ISA and the tuned template, in its deterministic form if asked: see
    :func:`flexpage.backends.cpu.kernel_options.attention_kernel_options`)."""
    if device.type != "cpu":
        return dict(kernel_options or {})
    return attention_kernel_options(kernel_options, deterministic)


def check_deterministic_supported(compile: bool) -> None:
    """Raise at start-up, not at the first step, where deterministic CPU attention cannot hold
    (see :func:`kernel_options_for`)."""
    if compile:
        torch_patches.install()
    kernel_options_for(torch.device("cpu"), None, deterministic=True)


def raised_compile_limits() -> contextlib.AbstractContextManager:
    """Dynamo's recompile limits raised for flexpage's shared compiled attention, as a context manager.

    One code object serves every recipe, dtype, head geometry and group kind of every model
    in the process (a serving run needs 6-12 per recipe, see docs/architecture.md): above
    Dynamo's default of 8, after which ``fullgraph=True`` fails hard. Dynamo's config is per
    thread, so a user's own compiled code keeps its limits. The engine enters this once per
    step (around the model's forward); patching it around every layer's call cost ~40 us.
    """
    return torch._dynamo.config.patch(recompile_limit=1024, accumulated_recompile_limit=8192)


def call_compiled(fn: Callable[..., Tensor], *args: object) -> Tensor:
    """Call a shared compiled attention function; if Dynamo's recompile limit stops it (a
    caller outside :func:`raised_compile_limits`, e.g. the HF backend), retry with it raised."""
    try:
        return fn(*args)
    except torch._dynamo.exc.FailOnRecompileLimitHit:
        with raised_compile_limits():
            return fn(*args)

_compiled_group_attention = torch.compile(_group_attention, dynamic=False, fullgraph=True)
_compiled_gathered_group_attention = torch.compile(_gathered_group_attention, dynamic=False, fullgraph=True)


def _mark_dynamic_gathered(q: Tensor, k: Tensor, v: Tensor, group: AttentionGroup) -> None:
    """Rows, query length and key length (of a gathered copy; the pool's stays static) vary
    between steps; heads and head size stay static."""
    in_place = group.kv_slots is None
    keys = () if in_place else (2,)
    queries = (0,) if in_place and group.q_len == 1 else (0, 2)  # packed decode rows: [B, H_kv, G, D]
    for t, dims in ((q, queries), (k, keys), (v, keys), (group.kv_num_blocks, (0, 2)),
                    (group.kv_indices, (0, 2, 3)),
                    (group.full_kv_num_blocks, (0, 2)), (group.full_kv_indices, (0, 2, 3)),
                    (group.row_seq, (0,)), (group.q_start, (0,)), (group.seq_len, (0,)), (group.kv_start, (0,))):
        for dim in dims:
            torch._dynamo.maybe_mark_dynamic(t, dim)


def _mark_dynamic_rows(q: Tensor, group: AttentionGroup) -> None:
    """Only the row count and query length vary between steps; everything else stays static.

    Keeping the pool and head sizes static matters twice: static sizes give the kernel its
    best code, and the CPU template misnames size symbols once a kernel has ten or more.
    """
    for t in (q, group.kv_num_blocks, group.kv_indices, group.full_kv_num_blocks, group.full_kv_indices,
              group.row_seq, group.block_table, group.q_start, group.seq_len):
        torch._dynamo.maybe_mark_dynamic(t, 0)
    torch._dynamo.maybe_mark_dynamic(group.block_table, 1)  # pages per row grow with the longest sequence
    if group.q_len > 1:
        torch._dynamo.maybe_mark_dynamic(q, 2)
        for t in (group.kv_num_blocks, group.kv_indices, group.full_kv_num_blocks, group.full_kv_indices):
            torch._dynamo.maybe_mark_dynamic(t, 2)


class FlexRunner:
    """Runs paged attention for one model: holds the recipe and the compile switch.

    ``deterministic``: a query row's output is the same bits in any batch (the batches must be
    planned with ``build_paged_batch(..., deterministic=True)``, so every row reads its keys in
    the same logical blocks); the CPU kernels then take one path for every call shape (see
    :mod:`flexpage.backends.cpu.template_tuning`).
    """

    def __init__(self, recipe: Recipe, *, compile: bool = True, scale: float | None = None,
                 kernel_options: dict | None = None, deterministic: bool = False) -> None:
        self.recipe = recipe
        self.compile = compile
        self.scale = scale
        self.deterministic = deterministic
        if compile:
            torch_patches.install()
        self.kernel_options = kernel_options
        self._options: dict[torch.device, dict] = {}  # kernel_options_for, per device (built once, not per call)

    def _kernel_options(self, device: torch.device) -> dict:
        if device not in self._options:
            self._options[device] = kernel_options_for(device, self.kernel_options, deterministic=self.deterministic)
        return self._options[device]

    def __call__(self, q: Tensor, k_pool: Tensor, v_pool: Tensor, batch: PagedBatch,
                 kv_scales: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """q: [T, H, D] new-token queries in flat order -> [T, H, D] attention output.

        ``kv_scales``: an int8 pool's (key scale, value scale) ``[H_kv, D]``
        (:meth:`~flexpage.attention.kv_pool.KVPool.layer_scales`): the key scale is folded into
        the query and the value scale into the output (:mod:`~flexpage.attention.kv_quant`), so
        the kernels read the 8-bit blocks as they are."""
        if k_pool.dtype == torch.int8:
            check_arg(kv_scales is not None, "kv_scales", None, "(key scale, value scale) for an int8 pool")
            q = scale_queries(q, kv_scales[0])
            if not self.compile:  # eager flex_attention multiplies in one dtype: a widened copy (debugging only)
                k_pool, v_pool = k_pool.to(q.dtype), v_pool.to(q.dtype)
            return scale_output(self._attend(q, k_pool, v_pool, batch), kv_scales[1])
        return self._attend(q, k_pool, v_pool, batch)

    def _attend(self, q: Tensor, k_pool: Tensor, v_pool: Tensor, batch: PagedBatch) -> Tensor:
        check_arg(q.dim() == 3 and q.shape[0] == batch.num_tokens, "q", tuple(q.shape),
                  f"[num_tokens={batch.num_tokens}, heads, head_dim]")
        check_arg(k_pool.dim() == 4 and k_pool.shape[0] == 1, "k_pool", tuple(k_pool.shape), "[1, kv_heads, slots, head_dim]")
        check_arg(q.shape[2] == k_pool.shape[3], "q head_dim", q.shape[2], f"the pool's head_dim {k_pool.shape[3]}")
        check_arg(q.shape[1] % k_pool.shape[1] == 0, "q heads", q.shape[1],
                  f"a multiple of the pool's {k_pool.shape[1]} kv heads")
        check_arg(q.dtype == k_pool.dtype or k_pool.dtype == torch.int8, "q.dtype", q.dtype,
                  f"the pool dtype {k_pool.dtype}")
        check_arg(k_pool.shape[2] == batch.num_pages * batch.page_size, "k_pool slots", k_pool.shape[2],
                  f"{batch.num_pages} pages x {batch.page_size}")
        if len(batch.groups) == 1 and batch.groups[0].covers_batch_in_order:  # e.g. an all-decode step
            return self._run_group(q, k_pool, v_pool, batch, batch.groups[0])
        out = q.new_empty(q.shape)
        for group in batch.groups:
            o = self._run_group(q, k_pool, v_pool, batch, group)
            _scatter_rows(out, o, group)
        return out

    def _run_group(self, q: Tensor, k_pool: Tensor, v_pool: Tensor, batch: PagedBatch, group: AttentionGroup) -> Tensor:
        """One kernel call for ``group``; returns its output ``[rows * q_len, H, D]`` in padded row order."""
        if group.kv_start is not None:
            return self._run_gathered_group(q, k_pool, v_pool, group)
        fn = _compiled_group_attention if self.compile else _group_attention
        rows, q_len, heads, dim = group.rows, group.q_len, q.shape[1], q.shape[2]
        kv_heads = k_pool.shape[1]
        g = heads // kv_heads
        # pack each kv head's query heads into query rows: [B, L, H_kv, G, D] -> [B, H_kv, L*G, D],
        # so the kernel loads every key block once per kv head rather than once per query head
        q_rows = _contiguous_rows(q) if group.covers_batch_in_order else q.index_select(0, group.gather_index)
        q_group = q_rows.reshape(rows, q_len, kv_heads, g, dim).permute(0, 2, 1, 3, 4)
        q_group = q_group.reshape(rows, kv_heads, q_len * g, dim)
        if self.compile:
            _mark_dynamic_rows(q_group, group)
        o = call_compiled(
            fn, q_group, k_pool, v_pool, group.kv_num_blocks, group.kv_indices,
            group.full_kv_num_blocks, group.full_kv_indices, group.row_seq, group.block_table, group.q_start,
            group.seq_len, group.page_to_logical, self.recipe, batch.page_size, batch.pages_per_block,
            group.q_block, g, not (self.compile and batch.one_owner_per_block), self.scale,
            self._kernel_options(q.device),
        )
        return o.view(rows, kv_heads, q_len, g, dim).permute(0, 2, 1, 3, 4).reshape(rows * q_len, heads, dim)

    def _run_gathered_group(self, q: Tensor, k_pool: Tensor, v_pool: Tensor, group: AttentionGroup) -> Tensor:
        """Rows over keys in logical order: a gathered copy, or the pool's rows in place (virtual layout)."""
        rows, q_len, heads, dim = group.rows, group.q_len, q.shape[1], q.shape[2]
        kv_heads = k_pool.shape[1]
        g = heads // kv_heads if q_len == 1 else 1  # decode rows pack query heads
        q_rows = _contiguous_rows(q) if group.covers_batch_in_order else q.index_select(0, group.gather_index)
        if g > 1:
            q_group = q_rows.view(rows, kv_heads, g, dim)  # [B, H_kv, G, D]: one token per row
        else:
            q_group = q_rows.view(rows, q_len, heads, dim).transpose(1, 2)  # [B, H, L, D]
        if group.kv_slots is None:
            k, v = k_pool, v_pool
        else:
            compute = gathered_attention_dtype(q.dtype, q.device, self.deterministic)
            q_group = q_group.to(compute)
            k = k_pool[0].index_select(1, group.kv_slots)[None].to(compute)  # [1, H_kv, S, D]
            v = v_pool[0].index_select(1, group.kv_slots)[None].to(compute)
        fn = _compiled_gathered_group_attention if self.compile else _gathered_group_attention
        if self.compile:
            _mark_dynamic_gathered(q_group, k, v, group)
        o = call_compiled(
            fn, q_group, k, v, group.kv_num_blocks, group.kv_indices, group.full_kv_num_blocks, group.full_kv_indices,
            group.row_seq, group.q_start, group.seq_len, group.kv_start, self.recipe, group.q_block, group.kv_block,
            self.scale, self._kernel_options(q.device), g,
        )
        o = o.to(q.dtype)
        if g > 1:
            return o.reshape(rows, heads, dim)
        return o.transpose(1, 2).reshape(rows * q_len, heads, dim)  # a view where the kernel kept q's layout


def _contiguous_rows(q: Tensor) -> Tensor:
    """``q`` as a contiguous ``[T, H, D]``, as a gathered batch is: the compiled kernels specialise
    on strides, and a model's queries are often a slice of a fused q|k|v projection (another row
    stride), which made every in-order batch a second compiled variant."""
    return q.contiguous()


def _scatter_rows(out: Tensor, o: Tensor, group: AttentionGroup) -> None:
    out.index_copy_(0, group.scatter_tokens, o.index_select(0, group.scatter_rows))
