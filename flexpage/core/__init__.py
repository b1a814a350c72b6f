"""Pure-Python bookkeeping for the serving engine: sequences, KV blocks, scheduling.

Nothing in this package imports torch. It only decides *which* token positions
are computed each step and *where* their KV lives (block ids); the model runner
turns those decisions into tensor work. Keeping it plain Python makes the
policies (prefix caching, copy-on-write, swapping, preemption, chunked prefill)
cheap to test exhaustively.

Layers, bottom up:

* :mod:`flexpage.core.sequence`: one request's token ids and progress counters.
* :mod:`flexpage.core.layer_groups`: attention layers grouped by window (full /
  sliding), one block table per group.
* :mod:`flexpage.core.block_pool`: physical blocks, ref counts, the prefix-cache
  hash index and LRU eviction.
* :mod:`flexpage.core.block_stats`: a snapshot of pool occupancy for metrics.
* :mod:`flexpage.core.block_manager`: per-sequence block tables on top of the
  pool (allocate, append, fork/copy-on-write, swap to host, free): a coordinator over
  one manager per layer group (:mod:`flexpage.core.group_managers`: full attention,
  sliding window) and policies it composes (:mod:`flexpage.core.prefix_plan`,
  :mod:`flexpage.core.budget_policy`, :mod:`flexpage.core.tier_policy`,
  :mod:`flexpage.core.swap_space`, :mod:`flexpage.core.fork_rows`).
* :mod:`flexpage.core.scheduler`: iteration-level continuous batching.
* :mod:`flexpage.core.scheduler_output`: the per-step plan handed to the runner.
"""

from flexpage.core.block_manager import BlockManager, BlockStats
from flexpage.core.block_pool import NULL_BLOCK_ID, BlockPool, NoFreeBlocksError
from flexpage.core.layer_groups import LayerGroup, layer_windows, plan_layer_groups
from flexpage.core.scheduler import Scheduler, SchedulerConfig
from flexpage.core.scheduler_output import ScheduledSequence, SchedulerOutput
from flexpage.core.sequence import Sequence, SequenceStatus

__all__ = [
    "NULL_BLOCK_ID",
    "BlockManager",
    "BlockPool",
    "BlockStats",
    "LayerGroup",
    "NoFreeBlocksError",
    "ScheduledSequence",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "Sequence",
    "SequenceStatus",
    "layer_windows",
    "plan_layer_groups",
]
