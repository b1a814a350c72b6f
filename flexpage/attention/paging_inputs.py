"""Validation of one step's paging inputs: block tables, sequence and query lengths.

Bad tables would make the kernel read another sequence's KV or the null page, silently;
every check names the argument and the offending value (see :func:`check_arg`).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from flexpage.attention.errors import check_arg
from flexpage.attention.recipe import Recipe

__all__ = ["check_paging_inputs"]


def check_paging_inputs(
    block_tables: Tensor, seq_lens: Tensor, query_lens: Tensor, page_size: int, num_pages: int,
    recipe: Recipe | None = None, *, decode_rows_skip_null_pages: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validate the plan's inputs; returns them as int64 numpy arrays (tables, seq_lens, query_lens).

    ``decode_rows_skip_null_pages``: rows with one new token may hold the null page anywhere
    before it -- blocks a KV budget evicted (see :mod:`flexpage.core.eviction`). True when
    such rows read the pool in place, where the plan never lists a null page; rows that read
    a gathered copy of their keys would see its zeros as keys.
    """
    check_arg(block_tables.dim() == 2, "block_tables", tuple(block_tables.shape), "a 2-D [num_seqs, max_pages] tensor")
    num_seqs, width = block_tables.shape
    check_arg(not block_tables.is_floating_point(), "block_tables.dtype", block_tables.dtype, "an integer dtype")
    check_arg(tuple(seq_lens.shape) == (num_seqs,), "seq_lens", tuple(seq_lens.shape), f"shape ({num_seqs},)")
    check_arg(tuple(query_lens.shape) == (num_seqs,), "query_lens", tuple(query_lens.shape), f"shape ({num_seqs},)")
    tables = block_tables.cpu().numpy().astype(np.int64)
    seq_lens_n = seq_lens.cpu().numpy().astype(np.int64)
    query_lens_n = query_lens.cpu().numpy().astype(np.int64)
    if num_seqs == 0:
        return tables, seq_lens_n, query_lens_n
    lo, hi = int(tables.min()), int(tables.max())
    check_arg(lo >= 0 and hi < num_pages, "block_tables", f"page ids in [{lo}, {hi}]", f"ids in [0, {num_pages - 1}] (pool size {num_pages})")
    qmin, smax = int(query_lens_n.min()), int(seq_lens_n.max())
    check_arg(qmin >= 1, "query_lens", f"min {qmin}", "at least one new token per sequence")
    bad = np.flatnonzero(query_lens_n > seq_lens_n)
    check_arg(bad.size == 0, "query_lens", _first(query_lens_n, bad), f"<= seq_lens ({_first(seq_lens_n, bad)})")
    capacity = width * page_size
    check_arg(smax <= capacity, "seq_lens", f"max {smax}", f"<= the {capacity} slots of {width} pages per block table row")
    needed = (seq_lens_n + page_size - 1) // page_size
    null_used = np.argwhere((tables == 0) & (np.arange(width)[None, :] < needed[:, None]))
    if null_used.size:
        rows, pages = null_used[:, 0], null_used[:, 1]
        q_lo = (seq_lens_n - query_lens_n)[rows]
        kv_lo = pages * page_size
        kv_hi = kv_lo + page_size - 1
        # a released page (sliding window) is fine: nobody can see it and nothing is written there
        missing = kv_hi >= q_lo
        evicted_ok = (query_lens_n[rows] == 1) & decode_rows_skip_null_pages
        if recipe is None:
            missing = np.ones_like(missing)
        else:
            may, _ = recipe.block_rule(*(torch.from_numpy(a) for a in (rows, q_lo, seq_lens_n[rows] - 1, kv_lo, kv_hi)))
            visible = np.broadcast_to(torch.as_tensor(may, dtype=torch.bool).numpy(), missing.shape)
            missing = missing | (visible & ~evicted_ok)
        bad = np.flatnonzero(missing)
        if bad.size:
            row, page = int(rows[bad[0]]), int(pages[bad[0]])
            raise ValueError(
                f"block_tables: row {row} has seq_lens {int(seq_lens_n[row])}, which needs {int(needed[row])} pages, "
                f"but its page {page} is the null page 0 (a sequence longer than its blocks; only pages "
                "outside every query's window may be released, and pages a KV budget evicted only from rows "
                "that decode and read the pool in place)"
            )
    return tables, seq_lens_n, query_lens_n


def _first(values: np.ndarray, idx: np.ndarray) -> int | None:
    return int(values[idx[0]]) if idx.size else None
