"""From page verdicts to the key-block lists a FlexAttention ``BlockMask`` holds.

:func:`~flexpage.attention.paging.build_paged_batch` asks the recipe's block rule, page by
page, whether a query block may see a page and whether it sees all of it. The kernel works
in key blocks of ``pages_per_block`` pages, so these functions turn page verdicts into
kernel-block verdicts (:func:`kernel_blocks`; rows in aligned runs read blocks in logical
order instead, :func:`logical_blocks`) and list them partial-first and full-first
(:func:`compact_block_lists`), with numpy only: no ``create_block_mask``.
"""

from __future__ import annotations

import numpy as np

__all__ = ["aligned_runs", "compact_block_lists", "kernel_blocks", "logical_blocks"]

_NO_BLOCK = np.iinfo(np.int64).max  # sorts after every real block id


def kernel_blocks(
    may: np.ndarray, every: np.ndarray, table: np.ndarray, pages_per_block: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Page verdicts ``[B, M, J]`` -> kernel-block verdicts: partial ``[B, M, J]``, full ``[B, M, J]``, ids ``[B, J]``.

    Kernel block ``r`` covers pages ``r*R .. r*R+R-1``. A row lists it if any of its pages
    there may be visible; it is *full* (mask skipped) only when all ``R`` pages belong to
    the row and each is wholly visible -- otherwise other rows' pages, or free ones, sit in
    it and the mask's ownership check must run. Blocks are found per row by sorting its
    pages by block id (segments of equal ids), so the cost follows the block table, not
    the pool.
    """
    if pages_per_block == 1:
        return may & ~every, every, table
    num_rows, num_q, width = may.shape
    row = np.arange(num_rows)[:, None]
    block_of_page = np.where(may.any(1), table // pages_per_block, _NO_BLOCK)  # [B, J]
    order = np.argsort(block_of_page, axis=-1, kind="stable")
    sorted_blocks = block_of_page[row, order]
    new_segment = np.ones_like(sorted_blocks, dtype=bool)
    new_segment[:, 1:] = sorted_blocks[:, 1:] != sorted_blocks[:, :-1]
    segment = np.cumsum(new_segment, -1) - 1  # [B, J] segment index of each sorted page
    # per (row, query block, segment): any page may be visible / number of wholly visible pages
    flat_seg = (np.arange(num_rows * num_q)[:, None] * width
                + np.repeat(segment, num_q, axis=0)).ravel()  # [B*M*J] into a [B, M, J] table
    sort = (row[:, :, None], np.arange(num_q)[None, :, None], order[:, None, :])  # [B, M, J] in sorted order
    any_may = np.zeros(num_rows * num_q * width, dtype=bool)
    any_may[flat_seg[may[sort].ravel()]] = True
    num_every = np.bincount(flat_seg, weights=every[sort].ravel(),
                            minlength=num_rows * num_q * width).reshape(num_rows, num_q, width)
    block_ids = np.full_like(sorted_blocks, _NO_BLOCK)
    block_ids[row, segment] = sorted_blocks
    real = (block_ids != _NO_BLOCK)[:, None, :]
    full = real & (num_every == pages_per_block)
    partial = real & any_may.reshape(num_rows, num_q, width) & ~full
    return partial, full, np.where(real[:, 0], block_ids, 0)


def aligned_runs(tables: np.ndarray, seq_lens: np.ndarray, page_size: int, pages_per_block: int) -> bool:
    """Whether each row's logical pages ``j*R .. j*R+R-1`` in use are the pages of one aligned
    run ``r*R ..`` in order: then logical key block ``j`` is kernel block ``r``, slot for slot."""
    pages = np.arange(tables.shape[1])
    in_use = pages[None, :] < -(-seq_lens // page_size)[:, None]
    first = tables[:, pages // pages_per_block * pages_per_block]  # the page each block's run starts with
    aligned = (tables == first + pages % pages_per_block) & (first % pages_per_block == 0) & (tables != 0)
    return bool((aligned | ~in_use).all())


def logical_blocks(may: np.ndarray, table: np.ndarray, pages_per_block: int,
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Page verdicts ``[B, M, J]`` of rows in aligned runs -> kernel blocks in logical order:
    partial ``[B, M, K]`` (every listed block), full (none), ids ``[B, K]``."""
    num_rows, num_q, width = may.shape
    blocks = -(-width // pages_per_block)
    pad = blocks * pages_per_block - width
    may = np.pad(may, ((0, 0), (0, 0), (0, pad))).reshape(num_rows, num_q, blocks, pages_per_block).any(-1)
    ids = table[:, ::pages_per_block] // pages_per_block
    return may, np.zeros_like(may), ids


def compact_block_lists(
    partial: np.ndarray, full: np.ndarray, ids: np.ndarray, width_out: int
) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """Partial and full key blocks, each listed first: ``[B, M, J]`` bools + ids ``[B, J]`` ->
    (counts ``[B,1,M]`` int32, ids ``[B,1,M,width_out]`` int32) for each. One sort serves both lists."""
    key = np.where(partial, 0, np.where(full, 1, 2)).astype(np.int8)
    order = np.argsort(key, axis=-1, kind="stable")
    row, query_block = np.arange(key.shape[0])[:, None, None], np.arange(key.shape[1])[None, :, None]
    ordered = ids[row, order]
    num_partial = partial.sum(-1, dtype=np.int32)
    num_full = full.sum(-1, dtype=np.int32)
    width = min(ordered.shape[-1], width_out)  # listed blocks are distinct, so at most width_out of them
    full_start = np.minimum(np.arange(width)[None, None, :] + num_partial[..., None], ordered.shape[-1] - 1)
    full_ordered = ordered[row, query_block, full_start]
    lists = []
    for counts, listed in ((num_partial, ordered[..., :width]), (num_full, full_ordered)):
        # only the first ``counts`` entries are ever read; zeros (not garbage) keep eager mode and repr safe
        out = np.zeros((*ordered.shape[:2], width_out), dtype=np.int32)
        out[..., :width] = listed
        lists.append((counts[:, None], out[:, None]))
    return tuple(lists)
