"""Attention variants as recipes: logical ``mask_mod``/``score_mod`` programs, one per file.

Each module exposes a factory returning a :class:`flexpage.attention.recipe.Recipe`.
Recipes never see pages; :mod:`flexpage.attention.paging` translates for them.
"""

from flexpage.recipes.alibi import alibi
from flexpage.recipes.attention_sinks import attention_sinks
from flexpage.recipes.causal import causal
from flexpage.recipes.chunked_local import chunked_local
from flexpage.recipes.document import document_mask
from flexpage.recipes.prefix_lm import prefix_lm
from flexpage.recipes.sliding_window import sliding_window
from flexpage.recipes.softcap import softcap
from flexpage.attention.recipe import compose

__all__ = ["alibi", "attention_sinks", "causal", "chunked_local", "compose", "document_mask", "prefix_lm",
           "sliding_window", "softcap"]
