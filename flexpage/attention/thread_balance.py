"""Which kernel thread gets which rows: a layout of a group's rows that balances the threads."""

from __future__ import annotations

import numpy as np

__all__ = ["PADDING_ROW", "thread_balanced_layout"]

#: a row slot of the kernel that computes nothing (the group is padded to a bucketed row count)
PADDING_ROW = -1

# keep the batch order unless balancing shortens the busiest thread's share by more than this
_MIN_BALANCE_GAIN = 0.05


def thread_balanced_layout(work: np.ndarray, num_rows: int, num_threads: int) -> np.ndarray:
    """The row each of a group's ``num_rows`` kernel row slots computes (:data:`PADDING_ROW`
    for padding), so that each kernel thread gets about equal ``work``.

    The CPU kernel hands each thread one contiguous range of its (row, head, query block)
    items, so slots ``[0, num_rows/T)`` go to the first thread and so on. Padding rows cost
    nothing, so by default they are spread over the shares as evenly as the real rows: at
    the end of the group they left the last thread idle (48 equal decode rows padded to 64
    gave one thread 32 rows, the other 16). Longest row first into the least loaded share
    with room left replaces batch order when that shortens the busiest share by more than 5%
    (batch order lets an unpadded all-decode step skip its query gather); the layout is never
    busier than batch order with the padding at the end. Only speed depends on the layout,
    never the result.
    """
    n = work.size
    threads = max(1, num_threads)
    share = -(-num_rows // threads)
    sizes = [max(0, min(share, num_rows - t * share)) for t in range(threads)]

    def in_order(counts: list[int]) -> list[list[int]]:
        bounds = np.cumsum([0, *counts])
        return [list(range(bounds[t], bounds[t + 1])) for t in range(threads)]

    def busiest(members: list[list[int]]) -> int:
        return max(int(work[rows].sum()) for rows in members)

    even = [min(size, n // threads + (t < n % threads)) for t, size in enumerate(sizes)]
    for t in range(threads):  # real rows a short last share cannot take go where there is room
        even[t] += max(0, min(sizes[t] - even[t], n - sum(even)))
    filled = [min(size, max(0, n - sum(sizes[:t]))) for t, size in enumerate(sizes)]
    members = min([in_order(even), in_order(filled)], key=busiest)  # padding spread wins ties
    if threads > 1 and n > 1 and (1 - _MIN_BALANCE_GAIN) * busiest(members) > work.sum() / threads:
        load = [0] * threads
        balanced: list[list[int]] = [[] for _ in range(threads)]
        for row in np.argsort(-work, kind="stable").tolist():
            t = min((t for t in range(threads) if len(balanced[t]) < sizes[t]), key=load.__getitem__)
            balanced[t].append(row)
            load[t] += int(work[row])
        if max(load) <= (1 - _MIN_BALANCE_GAIN) * busiest(members):
            members = balanced
    layout = np.full(num_rows, PADDING_ROW, dtype=np.int64)
    for t, rows in enumerate(members):
        layout[t * share:t * share + len(rows)] = rows
    return layout
