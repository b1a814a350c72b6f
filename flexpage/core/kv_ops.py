"""The KV operations a step's plan carries: every byte movement the bookkeeping decided.

The block manager and the tiers append to one list as they decide (a copy-on-write copy,
a swap, a spill to host memory, a row given back to the OS), so the list is in causal
order: an op never reads a block that an earlier op of the list has not yet filled, and a
block that is reused was read by every op before its reuse. The executor runs the list in
that order before the step's forward pass (consecutive ops of one kind may run as one
batched gather-then-scatter: no op of a run reads another's destination).

Two families, one per owner of the bytes:

* :class:`BlockOp` -- between pool blocks, the swap space and the OS (the runner's pool);
* :class:`TierOp` -- between pool blocks, the prefix cache's host slots and disk files
  (the tier storage; :mod:`flexpage.core.kv_tiers` decides them).

Plain data (ints and enums), so a plan can cross a process boundary as a few integers.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Union

__all__ = ["BlockOp", "BlockOpKind", "KVOp", "TierOp", "TierOpKind"]


class BlockOpKind(str, Enum):
    SWAP_OUT = "swap_out"  # device block -> swap-space block (preemption by swapping)
    SWAP_IN = "swap_in"  # swap-space block -> device block
    COPY = "copy"  # device block -> device block (copy-on-write, packing runs, forks by copy)
    RELEASE = "release"  # device blocks [src, dst) hold nothing: their memory may go back to the OS


@dataclass(frozen=True, slots=True)
class BlockOp:
    """One block movement of the pool; ``src``/``dst`` are block ids as the kind says."""

    kind: BlockOpKind
    src: int
    dst: int


class TierOpKind(str, Enum):
    SPILL = "spill"  # device block -> host slot
    RESTORE = "restore"  # host slot -> device block
    DEMOTE = "demote"  # host slot -> disk file
    WRITE = "write"  # device block -> disk file (a spill worth less than the whole host tier)
    LOAD = "load"  # disk file -> device block
    DELETE = "delete"  # disk file removed (dst unused)


@dataclass(frozen=True, slots=True)
class TierOp:
    """One byte movement of the tiers; ``src`` and ``dst`` are device block ids, host slots or
    disk file ids as the kind says. Ops must run in the order given (a host slot may be
    demoted and then reused by a spill within one step)."""

    kind: TierOpKind
    src: int
    dst: int = -1


KVOp = Union[BlockOp, TierOp]
