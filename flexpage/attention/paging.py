"""From block tables to FlexAttention inputs: the paging translation.

One :class:`PagedBatch` is built per engine step from the block tables and lengths of
the scheduled sequences, and shared by every layer. It splits the batch into *groups*
by query length -- decode rows (one new token) and prefill rows (a chunk of new tokens,
with or without cached context) -- because the CPU kernel walks a whole query block per
key block: one decode row padded into a 64-row query block would do 64x the work.

For each group it builds the ``BlockMask`` index lists directly from the block tables with
array operations (no ``create_block_mask``; numpy on the host, handed over as tensors).
The recipe's :class:`~flexpage.attention.recipe.BlockRule` classifies every (query block,
key block) as invisible, wholly visible (the *full* list: the kernel skips the mask) or
partly visible (the *partial* list: the ``mask_mod`` runs).

The two groups read the pool differently, because they spend their time differently:

* **Decode rows read the pool in place.** A kernel key block is ``pages_per_block``
  aligned pages; it is full when the row owns all its pages and each is wholly visible.
  Physical slots become logical positions through ``page_to_logical[page]``, so a recipe
  sees only ``(b, h, q_pos, kv_pos)`` in sequence coordinates. Each key is read once.
* **Prefill rows read a gathered copy** (``AttentionGroup.kv_slots``): each row's keys in
  logical order, rows one after another, copied out of the pool once per layer. A query
  block reads every visible key block, and the partial blocks on the causal diagonal run
  the mask for every (query, key) pair: a page-table lookup there costs as much as the
  attention itself (bf16 4x256 prefill: 4.2 vs 2.1 ms for the same kernel with a plain
  causal mask), while the copy costs one read of the row's keys.

Picture of one prefill row (page size 4, 6 cached tokens, 5 new tokens)::

    logical pos : 0 1 2 3 | 4 5 6 7 | 8 9 10
    page        :  p=0       p=1       p=2
    query rows  :               q q q   q q      (positions 6..10)
    q block [6,10] vs p=0 -> full; p=1 -> partial (causal edge); p=2 -> partial
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from flexpage.attention.errors import check_arg
from flexpage.attention.kernel_blocks import aligned_runs, compact_block_lists, kernel_blocks, logical_blocks
from flexpage.attention.paging_inputs import check_paging_inputs
from flexpage.attention.recipe import Recipe
from flexpage.attention.thread_balance import PADDING_ROW, thread_balanced_layout

DECODE_Q_BLOCK = 1
PREFILL_Q_BLOCK = 32
#: one prompt length per query-length bucket the prefill kernels specialise on (query lengths
#: round up to powers of two: 2, 4, ... PREFILL_Q_BLOCK with one query block, then several);
#: warm-up runs each so that no request compiles a kernel
PREFILL_BUCKET_LENGTHS = (2, *(1 << k | 1 for k in range(1, PREFILL_Q_BLOCK.bit_length())))
#: tokens per kernel key block in prefill groups (their keys are gathered, so any size works)
PREFILL_KV_BLOCK = 128


def next_power_of_two(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class AttentionGroup:
    """Rows of the batch that share one padded query length and one ``BlockMask``."""

    token_index: Tensor  # [B, L] int64: flat token index per padded query row (num_tokens = padding)
    gather_index: Tensor  # [B*L] int64: token_index with padding clamped to a real row (its output is dropped)
    scatter_rows: Tensor  # [n] int64: which padded rows are real
    scatter_tokens: Tensor  # [n] int64: the flat token each real row's output belongs to
    q_block: int
    kv_block: int  # tokens per kernel key block
    kv_num_blocks: Tensor  # [B, 1, M] int32, partial key blocks per query block
    kv_indices: Tensor  # [B, 1, M, K] int32, key block ids, listed first (K: key blocks of the keys read)
    full_kv_num_blocks: Tensor  # [B, 1, M] int32
    full_kv_indices: Tensor  # [B, 1, M, K] int32
    row_seq: Tensor  # [B] int32, batch index of each row's sequence (what a recipe calls b)
    block_table: Tensor  # [B, J] int32, each row's block table
    q_start: Tensor  # [B] int32, logical position of each row's first query token
    seq_len: Tensor  # [B] int32, tokens in the pool for the row's sequence after this step
    page_to_logical: Tensor  # [num_pages] int32, logical page index of each physical page in use
    #: [kv_len] int64 pool slots the group reads, gathered: each row's keys in logical order,
    #: padded to whole key blocks (slot 0, the null page), rows one after another; key block
    #: ids count in this copy. None: the group reads the pool in place, block ids count in it
    #: (with ``kv_start`` set, each row's keys lie in logical order from ``kv_start[row]``:
    #: the virtual layout's rows; without it, through ``page_to_logical``)
    kv_slots: Tensor | None = None
    kv_start: Tensor | None = None  # [B] int32, where each row's keys start in the gathered copy (or the pool)
    #: the padded rows are exactly the batch's tokens in flat order (no padding, no other group):
    #: the queries need no gather and the output no scatter
    covers_batch_in_order: bool = False

    @property
    def rows(self) -> int:
        return self.token_index.shape[0]

    @property
    def q_len(self) -> int:
        return self.token_index.shape[1]


@dataclass(frozen=True)
class PagedBatch:
    """Everything attention needs for one step, computed once and used by all layers."""

    num_tokens: int
    page_size: int
    num_pages: int
    pages_per_block: int  # the kernel's key block is this many aligned pages
    groups: tuple[AttentionGroup, ...]
    #: every kernel key block holding pages in use holds one sequence's pages only (no shared
    #: prefix pages, no two sequences in one run): a listed block then holds no other row's
    #: pages, and the compiled kernel's mask can skip its ownership check
    one_owner_per_block: bool
    positions: Tensor  # [num_tokens] int64, logical position of every new token
    slots: Tensor  # [num_tokens] int64, pool slot each new token's K/V is written to


def build_paged_batch(
    block_tables: Tensor,
    seq_lens: Tensor,
    query_lens: Tensor,
    *,
    page_size: int,
    num_pages: int,
    recipe: Recipe,
    pages_per_block: int = 1,
    bucket: bool = True,
    num_threads: int | None = None,
    deterministic: bool = False,
    evicted_pages: bool = False,
    contiguous_rows: bool = False,
    deterministic_in_place: bool = False,
) -> PagedBatch:
    """Plan one step of paged attention.

    block_tables: [S, J] int, physical page ids per logical page (pad with 0, the null page).
                  Inside a sequence's length a null page is accepted only where ``recipe``'s
                  block rule says no query of the row can see it and no new token lands in
                  it: pages a sliding-window layer group gave back (they are never visited).
    seq_lens:     [S] int, tokens of each sequence in the pool after this step's writes
    query_lens:   [S] int, new tokens per sequence this step (>= 1); the flat token order
                  is sequence 0's new tokens, then sequence 1's, ...
    ``pages_per_block`` sets the kernel's key block to that many aligned pages (pages
    ``r*R .. r*R+R-1`` form kernel block ``r``; ``num_pages`` must be a multiple): the CPU
    kernel pays per key block visited, so an allocator that hands a sequence aligned runs
    of pages gets large key blocks while pages stay small for sharing. Any placement is
    still correct: a block that is not wholly owned and visible runs the mask.
    ``bucket`` rounds group row counts and query lengths up to powers of two so a
    serving run triggers a bounded number of compiled kernels. ``num_threads`` (default:
    torch's) is how many threads the kernel splits a group's rows between; rows are ordered
    so that each thread's share holds about the same number of tokens (see
    :func:`thread_balanced_layout`).

    ``deterministic`` plans every row so that its output does not depend on the rest of the
    batch (the engine's deterministic mode; run with ``FlexRunner(deterministic=True)``): decode
    rows read gathered keys with the prefill rows' query block (or the pool in place, see
    ``deterministic_in_place``), and each row visits its key blocks in logical order, all as
    partial blocks. The kernel visits partial blocks before full ones, and its online softmax
    rounds differently when the order changes: a decode row sees its last block whole, the
    same token inside a prefill query block sees it partly.

    ``deterministic_in_place``: in a deterministic plan, decode rows read the pool in place
    when each of their logical key blocks is one aligned run of pages in order (what the
    allocator hands a sequence that shares no prefix) and the kernel's key block is the
    gathered rows' (``pages_per_block * page_size == PREFILL_KV_BLOCK``): the same keys at the
    same offsets in the same blocks, visited in logical order, without the per-layer copy. The
    caller sets it where its kernels compute a row alike from the pool or from a copy (same
    dtype, no packing of K/V for AMX); if any decode row is not aligned, all are gathered.

    ``evicted_pages``: decode rows may hold the null page anywhere before their new token --
    blocks a KV budget evicted (:mod:`flexpage.core.eviction`); they read the pool in place
    and never list it. Without it such a page is a sequence longer than its blocks (an error).

    ``contiguous_rows``: every sequence's pages are consecutive from an aligned kernel key
    block (the virtual layout, :mod:`flexpage.core.row_pool`): every group reads the pool in
    place with logical position = slot - the row's first slot, a mask built from lengths
    alone (no page table, no gathered copy; decode rows still pack query heads).
    """
    check_arg(isinstance(pages_per_block, int) and pages_per_block >= 1, "pages_per_block", pages_per_block,
              "a positive int")
    check_arg(not (evicted_pages and deterministic), "evicted_pages", evicted_pages,
              "False in deterministic mode (its decode rows read gathered keys, which cannot skip evicted pages)")
    check_arg(num_threads is None or (isinstance(num_threads, int) and num_threads >= 1), "num_threads", num_threads,
              "None or a positive int")
    check_arg(num_pages % pages_per_block == 0, "num_pages", num_pages,
              f"a multiple of pages_per_block={pages_per_block}")
    check_arg(not (contiguous_rows and (deterministic or evicted_pages)), "contiguous_rows", contiguous_rows,
              "False with deterministic planning or evicted pages")
    # the plan is index arithmetic on small host arrays: numpy's per-op cost is a few times
    # lower than torch's, and the results are handed over as tensors without copies
    tables, seq_lens_n, query_lens_n = check_paging_inputs(block_tables, seq_lens, query_lens, page_size, num_pages,
                                                           recipe, decode_rows_skip_null_pages=evicted_pages)
    if tables.shape[1] == 1:  # one column would be one more compiled kernel (Dynamo specialises a size of 1)
        tables = np.pad(tables, ((0, 0), (0, 1)))
    starts = np.cumsum(query_lens_n) - query_lens_n
    num_tokens = int(query_lens_n.sum())
    positions, slots = _positions_and_slots(tables, seq_lens_n, query_lens_n, page_size)
    width = tables.shape[1]
    in_use = (np.arange(width)[None, :] < ((seq_lens_n + page_size - 1) // page_size)[:, None]) & (tables != 0)
    row_starts = None
    if contiguous_rows:
        row_starts = _row_starts(tables, in_use, page_size, pages_per_block)
        page_to_logical, one_owner = torch.empty(0, dtype=torch.int32), True
    else:
        page_to_logical = torch.from_numpy(_page_to_logical(tables, in_use, num_pages))
        one_owner = _one_owner_per_block(tables, in_use, pages_per_block, num_pages)
    is_decode = query_lens_n == 1
    threads = torch.get_num_threads() if num_threads is None else num_threads
    groups = []
    decode_in_place = not deterministic or (
        deterministic_in_place and pages_per_block * page_size == PREFILL_KV_BLOCK
        and aligned_runs(tables[is_decode], seq_lens_n[is_decode], page_size, pages_per_block))
    decode_q_block = DECODE_Q_BLOCK if decode_in_place else PREFILL_Q_BLOCK
    # decode rows read the pool in place (gathered too when deterministic, unless aligned), prefill rows a gathered copy
    for mask, q_block in ((is_decode, decode_q_block), (~is_decode, PREFILL_Q_BLOCK)):
        rows = np.flatnonzero(mask)
        if rows.size == 0:
            continue
        num_rows = next_power_of_two(rows.size) if bucket else rows.size
        work = query_lens_n[rows] * (seq_lens_n[rows] + _ROW_OVERHEAD_TOKENS)
        layout = thread_balanced_layout(work, num_rows, threads)
        groups.append(
            _build_group(
                np.where(layout == PADDING_ROW, PADDING_ROW, rows[layout]), tables, seq_lens_n, query_lens_n, starts,
                page_to_logical, num_tokens=num_tokens, num_pages=num_pages, page_size=page_size,
                q_block=q_block, pages_per_block=pages_per_block, recipe=recipe, bucket=bucket,
                gather=q_block > DECODE_Q_BLOCK, all_partial=deterministic, row_starts=row_starts,
            )
        )
    return PagedBatch(num_tokens, page_size, num_pages, pages_per_block, tuple(groups), one_owner,
                      torch.from_numpy(positions), torch.from_numpy(slots))


# a row's fixed cost in the kernel (per-row setup, its last partial key block), in tokens' worth
_ROW_OVERHEAD_TOKENS = 64
def token_positions(seq_lens: np.ndarray, query_lens: np.ndarray) -> np.ndarray:
    """Logical position of every new token, in flat order (sequence 0's new tokens, then 1's, ...)."""
    starts = np.cumsum(query_lens) - query_lens  # flat index of each sequence's first new token
    first = seq_lens - query_lens  # logical position of each sequence's first new token
    return np.repeat(first - starts, query_lens) + np.arange(int(query_lens.sum()))


def _positions_and_slots(
    tables: np.ndarray, seq_lens: np.ndarray, query_lens: np.ndarray, page_size: int,
) -> tuple[np.ndarray, np.ndarray]:
    seq_of_token = np.repeat(np.arange(len(query_lens)), query_lens)
    positions = token_positions(seq_lens, query_lens)
    pages = tables[seq_of_token, positions // page_size]
    return positions, pages * page_size + positions % page_size


def _row_starts(tables: np.ndarray, in_use: np.ndarray, page_size: int, pages_per_block: int) -> np.ndarray:
    """First slot of each sequence's row: its pages must be consecutive from an aligned kernel
    key block (``contiguous_rows``)."""
    first = tables[:, :1]
    expected = first + np.arange(tables.shape[1])[None, :]
    bad = np.flatnonzero((in_use & (tables != expected)).any(1) | (first[:, 0] % pages_per_block != 0))
    if bad.size:
        raise ValueError(f"block_tables: row {int(bad[0])} ({tables[bad[0]].tolist()}) is not consecutive pages from "
                         f"a multiple of pages_per_block={pages_per_block} (contiguous_rows)")
    return first[:, 0].astype(np.int64) * page_size


def _page_to_logical(tables: np.ndarray, in_use: np.ndarray, num_pages: int) -> np.ndarray:
    """Logical page index of every physical page in use (``in_use``: ``[S, J]`` table entries
    within their sequence's length, not null): ``[num_pages]`` int32.

    One table serves all rows because a physical page sits at the same logical index in
    every sequence that holds it (prefix sharing and copy-on-write share whole prefixes).
    Pages no row uses map to -1, and so does the null page 0 (padding, and pages a
    sliding-window group released: never a logical page of anyone). So the mask also checks
    that a page belongs to the row, wherever a key block holds several sequences' pages
    (see ``PagedBatch.one_owner_per_block``) and always in eager mode, which visits every slot.
    """
    num_seqs, width = tables.shape
    logical = np.broadcast_to(np.arange(width, dtype=np.int32), (num_seqs, width)).ravel()
    in_use = in_use.ravel()
    pages = tables.ravel()[in_use]
    table = np.full(num_pages, -1, dtype=np.int32)
    table[pages] = logical[in_use]
    clash = np.flatnonzero(table[pages] != logical[in_use])
    if clash.size:
        page = int(pages[clash[0]])
        raise ValueError(
            f"block_tables: physical page {page} appears at logical pages {int(logical[in_use][clash[0]])} and "
            f"{int(table[page])}; a shared page must hold the same positions in every sequence"
        )
    return table


def _one_owner_per_block(tables: np.ndarray, in_use: np.ndarray, pages_per_block: int, num_pages: int) -> bool:
    """Whether each kernel key block's in-use pages all belong to one sequence.

    Each in-use (sequence, page) entry writes its sequence into its block's slot; if any
    entry then reads back another sequence, two sequences share a block (a shared prefix
    page counts: two sequences hold it). O(table entries), no sort.
    """
    num_seqs, width = tables.shape
    blocks = tables[in_use] // pages_per_block
    seqs = np.broadcast_to(np.arange(num_seqs)[:, None], (num_seqs, width))[in_use]
    owner = np.full(-(-num_pages // pages_per_block), -1, dtype=np.int64)
    owner[blocks] = seqs
    return bool((owner[blocks] == seqs).all())


def _build_group(
    layout: np.ndarray,  # [kernel rows] the sequence each kernel row computes (PADDING_ROW: none)
    tables: np.ndarray,
    seq_lens: np.ndarray,
    query_lens: np.ndarray,
    starts: np.ndarray,
    page_to_logical: Tensor,
    *,
    num_tokens: int,
    num_pages: int,
    page_size: int,
    q_block: int,
    pages_per_block: int,
    recipe: Recipe,
    bucket: bool,
    gather: bool,
    all_partial: bool = False,
    row_starts: np.ndarray | None = None,  # [S] first slot of each sequence's row: read rows in place
) -> AttentionGroup:
    real_row = layout != PADDING_ROW
    rows, num_rows = layout[real_row], layout.size  # the real rows in kernel order
    max_q = int(query_lens[rows].max())
    q_len = next_power_of_two(max_q) if bucket else max_q
    # a fixed query block per group (short chunks are padded up to it): a changing block
    # size would be one more compiled kernel each time; decode rows (one query) stay one long
    if max_q > 1:
        q_len = -(-q_len // q_block) * q_block
    width = tables.shape[1]

    def padded(a: np.ndarray) -> np.ndarray:  # per real row -> per kernel row; padding rows: no tokens, null pages
        if num_rows == rows.size:
            return a
        out = np.zeros((num_rows, *a.shape[1:]), dtype=a.dtype)
        out[real_row] = a
        return out

    seq_len = padded(seq_lens[rows])
    q_count = padded(query_lens[rows])
    q_start = seq_len - q_count
    row_seq = padded(rows)
    table = padded(tables[rows])

    q_offsets = np.arange(q_len)
    token_index = np.where(q_offsets[None, :] < q_count[:, None], padded(starts[rows])[:, None] + q_offsets[None, :],
                           num_tokens)

    # query blocks [B, M, 1] against key ranges [1, 1, J]
    m = np.arange(-(-q_len // q_block))
    q_lo = (q_start[:, None] + m[None, :] * q_block)[:, :, None]
    q_rows = np.minimum(q_count[:, None] - m[None, :] * q_block, q_block)[:, :, None]
    q_hi = q_lo + q_rows - 1

    def verdicts(kv_lo: np.ndarray, kv_hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(may be visible, wholly visible) per (row, query block, key range)."""
        shape = (num_rows, m.size, kv_lo.shape[-1])
        may, every = (_as_bool(x, shape) for x in recipe.block_rule(
            *(torch.from_numpy(np.ascontiguousarray(a)) for a in (row_seq[:, None, None], q_lo, q_hi, kv_lo, kv_hi))))
        may = may & (q_rows > 0) & (kv_lo < seq_len[:, None, None])
        return may, every & may & (kv_hi < seq_len[:, None, None])

    kv_slots = kv_start = None
    if gather or row_starts is not None:  # the row's j-th key block holds its positions [j*K, (j+1)*K)
        kv_block = PREFILL_KV_BLOCK if row_starts is None else page_size * pages_per_block
        row_blocks = -(-seq_len // kv_block)
        kv_lo = (np.arange(max(1, int(row_blocks.max()))) * kv_block)[None, None, :]
        may, every = verdicts(kv_lo, kv_lo + kv_block - 1)
        partial, full = (may, np.zeros_like(may)) if all_partial else (may & ~every, every)
        if row_starts is None:  # a gathered copy: rows one after another
            first_block = np.cumsum(row_blocks) - row_blocks
            num_blocks = max(2, int(row_blocks.sum()))  # >= 2: Dynamo specialises a size of 1
            row_start = first_block * kv_block
            kv_slots = torch.from_numpy(_gather_slots(table, seq_len, page_size, row_start, num_blocks * kv_block))
        else:  # the pool's own rows (padding rows start at slot 0 and list nothing)
            row_start = padded(row_starts[rows])
            first_block = row_start // kv_block
            num_blocks = num_pages // pages_per_block
        block_ids = first_block[:, None] + np.arange(kv_lo.shape[-1])[None, :]  # past a row's blocks: never listed
        kv_start = torch.from_numpy(row_start.astype(np.int32))
    else:  # pages of the pool, read in place
        kv_block = page_size * pages_per_block
        num_blocks = num_pages // pages_per_block
        kv_lo = (np.arange(width) * page_size)[None, None, :]
        may, every = verdicts(kv_lo, kv_lo + page_size - 1)
        may = may & (table != 0)[:, None, :]  # pages a sliding window released
        if all_partial:  # deterministic: aligned runs (see aligned_runs), listed in logical order
            partial, full, block_ids = logical_blocks(may, table, pages_per_block)
        else:
            partial, full, block_ids = kernel_blocks(may, every & may, table, pages_per_block)
    # the kernel wants index rows as wide as its key-block count; entries past the counts are never read
    (kv_num_blocks, kv_indices), (full_kv_num_blocks, full_kv_indices) = compact_block_lists(
        partial, full, block_ids, num_blocks)
    flat = token_index.ravel()
    real = np.flatnonzero(flat < num_tokens)
    return AttentionGroup(
        token_index=torch.from_numpy(token_index),
        gather_index=torch.from_numpy(np.minimum(flat, num_tokens - 1)),
        scatter_rows=torch.from_numpy(real),
        scatter_tokens=torch.from_numpy(flat[real]),
        q_block=q_block,
        kv_block=kv_block,
        kv_num_blocks=torch.from_numpy(kv_num_blocks),
        kv_indices=torch.from_numpy(kv_indices),
        full_kv_num_blocks=torch.from_numpy(full_kv_num_blocks),
        full_kv_indices=torch.from_numpy(full_kv_indices),
        row_seq=torch.from_numpy(row_seq.astype(np.int32)),
        block_table=torch.from_numpy(table.astype(np.int32)),
        q_start=torch.from_numpy(q_start.astype(np.int32)),
        seq_len=torch.from_numpy(seq_len.astype(np.int32)),
        page_to_logical=page_to_logical,
        covers_batch_in_order=flat.size == num_tokens and bool((flat == np.arange(num_tokens)).all()),
        kv_slots=kv_slots,
        kv_start=kv_start,
    )


def idle_decode_group(batch: PagedBatch, rows: int = 2) -> AttentionGroup:
    """A decode group of ``rows`` padding rows over ``batch``'s pool that attends to nothing,
    shaped as :func:`build_paged_batch` shapes in-place decode groups.

    Why: a step program is compiled per set of groups, ~10 s each on 2 cores. With this group
    beside its prefill group, a prefill-only step runs the program of mixed steps instead of
    one of its own (:class:`~flexpage.model.compiled_step.CompiledStep`). The rows list no key
    block; their outputs go to token 0, which the batch's own group writes after them (groups
    run in order), so they change nothing."""
    def zeros(*shape: int, dtype: torch.dtype = torch.int32) -> Tensor:  # one tensor each: programs guard aliasing
        return torch.zeros(rows, *shape, dtype=dtype)

    kv_blocks = batch.num_pages // batch.pages_per_block
    return AttentionGroup(
        token_index=torch.full((rows, DECODE_Q_BLOCK), batch.num_tokens), gather_index=zeros(dtype=torch.long),
        scatter_rows=torch.arange(rows), scatter_tokens=zeros(dtype=torch.long), q_block=DECODE_Q_BLOCK,
        kv_block=batch.page_size * batch.pages_per_block, kv_num_blocks=zeros(1, 1), kv_indices=zeros(1, 1, kv_blocks),
        full_kv_num_blocks=zeros(1, 1), full_kv_indices=zeros(1, 1, kv_blocks), row_seq=zeros(),
        block_table=zeros(2), q_start=zeros(), seq_len=zeros(), page_to_logical=batch.groups[0].page_to_logical,
    )


def _gather_slots(table: np.ndarray, seq_len: np.ndarray, page_size: int, row_start: np.ndarray,
                  kv_len: int) -> np.ndarray:
    """``[kv_len]`` pool slots: row ``r``'s positions in order from ``row_start[r]``; slot 0 (the
    null page) everywhere else."""
    row = np.repeat(np.arange(seq_len.size), seq_len)
    position = np.arange(row.size) - np.repeat(np.cumsum(seq_len) - seq_len, seq_len)
    slots = np.zeros(kv_len, dtype=np.int64)
    slots[row_start[row] + position] = table[row, position // page_size] * page_size + position % page_size
    return slots


def _as_bool(verdict: Tensor | bool, shape: tuple[int, ...]) -> np.ndarray:
    return np.broadcast_to(torch.as_tensor(verdict, dtype=torch.bool).numpy(), shape)
