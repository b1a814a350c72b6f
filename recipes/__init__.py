"""Attention variants as recipes: logical ``mask_mod``/``score_mod`` programs, one per file.

Each module exposes a factory returning a :class:`flexpage.attention.recipe.Recipe`.
Recipes never see pages; :mod:`flexpage.attention.paging` translates for them. KV eviction
policies (:class:`flexpage.attention.eviction.EvictionPolicy`: which blocks a sequence over
its KV budget gives up) live here too, one per file.
"""

from flexpage.recipes.alibi import alibi
from flexpage.recipes.attention_sinks import attention_sinks
from flexpage.recipes.causal import causal
from flexpage.recipes.chunked_local import chunked_local
from flexpage.recipes.document import document_mask
from flexpage.recipes.key_norm import key_norm
from flexpage.recipes.no_eviction import no_eviction
from flexpage.recipes.paged_eviction import paged_eviction
from flexpage.recipes.prefix_lm import prefix_lm
from flexpage.recipes.sliding_window import sliding_window
from flexpage.recipes.softcap import softcap
from flexpage.recipes.streaming_llm import streaming_llm
from flexpage.recipes.tree_verification import tree_verification
from flexpage.attention.recipe import compose

__all__ = ["alibi", "attention_sinks", "causal", "chunked_local", "compose", "document_mask", "key_norm",
           "no_eviction", "paged_eviction", "prefix_lm", "sliding_window", "softcap", "streaming_llm",
           "tree_verification"]
