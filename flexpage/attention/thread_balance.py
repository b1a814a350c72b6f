"""Which kernel thread gets which rows: an order of a group's rows that balances the threads."""

from __future__ import annotations

import numpy as np

__all__ = ["thread_balanced_order"]

# keep the batch order unless balancing shortens the busiest thread's share by more than this
_MIN_BALANCE_GAIN = 0.05


def thread_balanced_order(work: np.ndarray, num_rows: int, num_threads: int) -> np.ndarray:
    """A permutation of a group's rows that gives each kernel thread about equal ``work``.

    The CPU kernel hands each thread one contiguous range of its (row, head, query block)
    items, so rows ``[0, num_rows/T)`` go to the first thread and so on (padding rows, which
    cost nothing, come last). With a few long sequences on one side the other threads wait:
    on ``bench/attention.py``'s batch-32 row the two halves of the batch hold 36k and 53k
    tokens. Longest row first into the least loaded share with room left; the identity
    (batch order, which lets an all-decode step skip its query gather) unless that shortens
    the busiest share by more than 5%. Only speed depends on the order, never the result.
    """
    n = work.size
    identity = np.arange(n)
    if num_threads <= 1 or n <= 1:
        return identity
    share = -(-num_rows // num_threads)
    in_order = int(np.add.reduceat(work, np.arange(0, n, share)).max())
    if (1 - _MIN_BALANCE_GAIN) * in_order <= work.sum() / num_threads:  # no order can beat the mean share by more
        return identity
    capacity = [min(share, max(0, n - t * share)) for t in range(num_threads)]  # real rows fill shares in order
    load = [0] * num_threads
    members: list[list[int]] = [[] for _ in range(num_threads)]
    for row in np.argsort(-work, kind="stable").tolist():
        t = min((t for t in range(num_threads) if len(members[t]) < capacity[t]), key=load.__getitem__)
        members[t].append(row)
        load[t] += int(work[row])
    if max(load) > (1 - _MIN_BALANCE_GAIN) * in_order:
        return identity
    return np.array([row for rows in members for row in rows], dtype=np.int64)
