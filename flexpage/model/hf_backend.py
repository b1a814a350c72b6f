"""``attn_implementation="flexpage"`` for HF transformers.

Registers two functions under the name ``flexpage``: the attention function (in
``AttentionInterface``) and its mask builder (in ``AttentionMaskInterface``). HF builds
masks per registered implementation, so an attention function registered alone would run
with no causal mask at all. Our mask builder returns a small :class:`FlexpageMask` (the
rows' padding and offsets) instead of a dense 4D tensor; the attention function turns it
into a block mask once per forward pass and layer kind and reuses it in every layer.

Model features map to recipes through the engine's own mapping
(:func:`flexpage.model.layer_recipes.recipe_for`): GQA -> ``enable_gqa`` (decode: query heads
packed per kv head, see :mod:`flexpage.attention.contiguous`); ``sliding_window``
(Mistral, Gemma2/3 local layers) -> :func:`flexpage.recipes.sliding_window`; ``softcap``
(Gemma2's ``attn_logit_softcapping``) -> :func:`flexpage.recipes.softcap`.

Each layer's call runs one shared compiled kernel; inside ``torch.compile(model)`` the attention
is traced into the model's graph instead (docs/hf-backend.md). ``FLEXPAGE_COMPILE=0`` runs the
same program eagerly (slow; for debugging).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from torch import Tensor

from flexpage.attention.contiguous import ContiguousMask, RowLayout, build_contiguous_mask, contiguous_attention
from flexpage.attention.recipe import Recipe
from flexpage.model.layer_recipes import recipe_for

IMPLEMENTATION_NAME = "flexpage"


@dataclass
class FlexpageMask:
    """What HF's mask step hands our attention function: row layout plus a per-recipe block-mask cache."""

    layout: RowLayout
    q_length: int
    #: run the compiled program (``FLEXPAGE_COMPILE`` is not ``"0"``), read once per forward pass
    compile: bool = True
    _built: dict[Recipe, ContiguousMask] = field(default_factory=dict)  # keyed by recipe object, not name
    #: HF's mask step treats an ``attention_mask`` whose ``ndim`` is not 2 as already built: ``generate``
    #: with a static cache builds the step's mask ahead and hands it to the forward
    ndim = 4

    def block_mask(self, recipe: Recipe) -> ContiguousMask:
        if recipe not in self._built:
            self._built[recipe] = build_contiguous_mask(self.layout, self.q_length, recipe)
        return self._built[recipe]


def flexpage_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,  # noqa: ANN001 - HF's own factory; the recipe is chosen per layer instead
    attention_mask: Tensor | None = None,
    device: torch.device | str = "cpu",
    **kwargs: object,
) -> FlexpageMask:
    """HF mask-interface entry: describe padding and offsets, defer the block mask to the layer."""
    if isinstance(attention_mask, FlexpageMask):  # built ahead by ``generate`` for this very step
        return attention_mask
    # a static cache gives the query offset as a tensor (no graph break in a compiled model)
    q_offset = q_offset if isinstance(q_offset, Tensor) else int(q_offset)
    kv_offset = int(kv_offset)
    if attention_mask is None:
        valid = torch.ones(batch_size, kv_length, dtype=torch.bool, device=device)
        shift = torch.zeros(batch_size, dtype=torch.long, device=device)
    else:
        full = attention_mask.to(torch.bool)
        # left padding: logical position = absolute index - leading padding tokens
        shift = torch.where(full.any(-1), full.int().argmax(-1), 0).long()
        valid = full[:, kv_offset : kv_offset + kv_length]
        if valid.shape[1] < kv_length:  # the cache holds positions the 2D mask does not cover yet
            valid = torch.nn.functional.pad(valid, (0, kv_length - valid.shape[1]), value=True)
    return FlexpageMask(RowLayout(valid, shift, q_offset, kv_offset), q_length,
                        compile=os.environ.get("FLEXPAGE_COMPILE", "1") != "0")


def flexpage_attention_forward(
    module: torch.nn.Module,
    query: Tensor,  # [B, H, L, D]
    key: Tensor,  # [B, H_kv, S, D]
    value: Tensor,
    attention_mask: FlexpageMask | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: object,
) -> tuple[Tensor, None]:
    if attention_mask is None or not isinstance(attention_mask, FlexpageMask):
        batch, _, q_len, _ = query.shape
        kv_len = key.shape[2]
        attention_mask = flexpage_mask(batch, q_len, kv_len, q_offset=kv_len - q_len, device=query.device)
    if kwargs.get("s_aux") is not None:
        raise ValueError("s_aux: attention sinks are not supported by attn_implementation='flexpage'")
    recipe = recipe_for(sliding_window, softcap)
    out = contiguous_attention(
        query, key, value, attention_mask.layout, recipe, scale=scaling, compile=attention_mask.compile,
        mask=attention_mask.block_mask(recipe),
    )
    return out, None



def register() -> None:
    """Make ``attn_implementation="flexpage"`` available (idempotent; called by ``import flexpage``)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION_NAME, flexpage_attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION_NAME, flexpage_mask)
