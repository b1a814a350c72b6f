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
  ``i`` in every group). A sliding group replaces the leading pages nobody can see any
  more with the null block 0 (see :meth:`BlockManager.num_released
  <flexpage.core.block_manager.BlockManager.num_released>`).

A model with one kind of layer has a single group holding every layer: exactly the
layout from before groups existed.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass
from typing import Any

__all__ = ["LayerGroup", "layer_windows", "plan_layer_groups"]


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
