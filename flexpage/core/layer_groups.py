"""Attention layers grouped by how much KV they keep: one block table per group.

A *full-attention* layer reads every earlier position, so its blocks live as long as the
sequence. A *sliding-window* layer (window ``W``: the query at ``q`` sees ``q-W+1 .. q``)
never reads a position again once every current and future query is past it, so its
blocks can be given back early. Models that mix both (Gemma2/3: alternating local and
global layers) therefore need a separate block table for each kind.

Design (vLLM's hybrid allocator, simplified):

* layers are split into **groups of equal size** ``S`` = the layer count of the rarest
  kind; a kind with more layers is split into several groups (Gemma3, 5 local : 1 global,
  gets five local groups per global one). Full-attention groups come first, so group 0
  (``BlockManager.block_table(seq)``) is a complete table whenever the model has full layers;
* the KV pool holds ``S`` layers per block: physical block ``b`` of layer slot ``j``
  belongs to whichever group's table holds ``b``, and layer ``j`` of that group reads it.
  All groups draw from **one** :class:`~flexpage.core.block_pool.BlockPool`, so
  admission, copy-on-write, swapping and prefix caching stay one accounting problem and
  a block id means the same thing to every part of the engine;
* each sequence carries one positional table per group (logical page ``i`` is entry
  ``i`` in every group). A sliding group (window ``W``) gives back, as soon as
  ``num_computed_tokens`` moves past them, the leading blocks whose every position is
  outside the window of every current and future query (queries only move forward, so the
  next query is at ``>= num_computed_tokens``): :func:`blocks_out_of_window` of them. Their
  table entries become the null block 0, so a sliding table is always
  ``[0] * released + live``. Released pages are never read: the attention planner accepts a
  null page only where the layer's own mask rule says no query of the row can see it.
* prefix caching works per group: a block of one group holds other layers' KV than the
  same tokens in another group, so cache keys name the group (:func:`group_key`), and a hit
  of ``h`` blocks needs, in every group, the blocks that a query at position
  ``h * block_size`` can still see -- all ``h`` for full attention, only the window's for a
  sliding group (its leading entries start out null): :func:`prefix_hit`.

A model with one kind of layer has a single group holding every layer.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass
from typing import Any

from flexpage.core.block_pool import NULL_BLOCK_ID, BlockHash

__all__ = ["LayerGroup", "blocks_out_of_window", "group_key", "layer_windows", "plan_layer_groups", "prefix_hit"]


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """Layers sharing one block table. ``window`` None: full attention."""

    window: int | None
    layers: tuple[int, ...]


def layer_windows(text_config: Any) -> list[int | None]:
    """The sliding window of every decoder layer of an HF text config (None: full attention).

    ``layer_types`` (Gemma2/3, Qwen2/3, recent HF configs) names each layer's kind; without
    it a set ``sliding_window`` applies to every layer (Mistral), unless the config turns it
    off (``use_sliding_window=False``). The model runner checks at every forward pass that
    the layers really apply these windows, so a config read wrong fails loudly.
    """
    num_layers = int(text_config.num_hidden_layers)
    window = getattr(text_config, "sliding_window", None)
    if not window or getattr(text_config, "use_sliding_window", True) is False:
        return [None] * num_layers
    types = getattr(text_config, "layer_types", None)
    if types is None:
        return [int(window)] * num_layers
    if len(types) != num_layers:
        raise ValueError(f"layer_types: {len(types)} entries for num_hidden_layers={num_layers}")
    return [int(window) if kind == "sliding_attention" else None for kind in types]


def plan_layer_groups(windows: SequenceABC[int | None]) -> tuple[LayerGroup, ...]:
    """Split layers (``windows[i]`` for layer ``i``) into equal-size groups, full attention first."""
    if not windows:
        raise ValueError("windows: need at least one layer")
    for w in windows:
        if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 1):
            raise ValueError(f"windows: got {w!r}, expected None or an int >= 1")
    kinds: dict[int | None, list[int]] = {}
    for layer, w in enumerate(windows):
        kinds.setdefault(w, []).append(layer)
    order = sorted(kinds, key=lambda w: (w is not None, kinds[w][0]))  # full attention first
    size = min(len(layers) for layers in kinds.values())
    return tuple(
        LayerGroup(w, tuple(kinds[w][i : i + size])) for w in order for i in range(0, len(kinds[w]), size)
    )


def blocks_out_of_window(window: int | None, block_size: int, num_computed_tokens: int) -> int:
    """Leading blocks of a table that no query at a position ``>= num_computed_tokens`` sees.

    A query at ``q`` sees ``q-W+1 .. q``, so block ``i`` (positions ``i*bs .. i*bs+bs-1``)
    is dead once ``i*bs + bs - 1 < num_computed_tokens - W + 1``. Always 0 for full attention
    (``window`` None). The block of the last computed token is always kept (this only
    matters for ``W == 1``), so a table that holds blocks is never all null.
    """
    if window is None:
        return 0
    return max(0, (num_computed_tokens - max(window, 2) + 1) // block_size)


def group_key(group: int, block_hash: BlockHash) -> BlockHash:
    """The prefix-cache key of a block of ``group`` (group 0 uses the plain chained hash)."""
    return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")


def prefix_hit(
    hashes: SequenceABC[BlockHash],
    lookup: Callable[[int, BlockHash], int | None],
    windows: SequenceABC[int | None],
    block_size: int,
) -> list[list[int]]:
    """Per group, the block ids of the longest prefix of ``hashes`` that every group can serve.

    ``lookup(group, hash)`` is a group's cached block for a block hash, or None. All groups'
    lists have the same length ``h``; a sliding group's leading
    ``blocks_out_of_window(window, block_size, h * block_size)`` entries are the null block
    (out of the window of the first query that follows the hit, so not needed). No hit:
    one empty list per group.
    """
    limit = len(hashes)  # full-attention groups need every block: stop at their first miss
    for g, window in enumerate(windows):
        if window is None:
            limit = next((i for i in range(limit) if lookup(g, hashes[i]) is None), limit)
    by_group = [[lookup(g, h) for h in hashes[:limit]] for g in range(len(windows))]
    last_miss = []  # last_miss[g][h]: index of the last missing block below h (-1: none)
    for ids in by_group:
        marks, last = [-1], -1
        for i, b in enumerate(ids):
            last = i if b is None else last
            marks.append(last)
        last_miss.append(marks)
    for h in range(limit, 0, -1):
        dead = [blocks_out_of_window(w, block_size, h * block_size) for w in windows]
        if all(last_miss[g][h] < dead[g] for g in range(len(windows))):
            return [[NULL_BLOCK_ID] * dead[g] + ids[dead[g]:h] for g, ids in enumerate(by_group)]  # type: ignore[operator]
    return [[] for _ in windows]
