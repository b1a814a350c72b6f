"""Attention variants as recipes: logical ``mask_mod``/``score_mod`` programs, one per file.

Each module exposes a factory returning a :class:`flexpage.attention.recipe.Recipe`.
Recipes never see pages; :mod:`flexpage.attention.paging` translates for them.
"""

from recipes.alibi import alibi
from recipes.causal import causal
from recipes.document import document_mask
from recipes.prefix_lm import prefix_lm
from recipes.sliding_window import sliding_window
from recipes.softcap import softcap
from flexpage.attention.recipe import compose

__all__ = ["alibi", "causal", "compose", "document_mask", "prefix_lm", "sliding_window", "softcap"]
