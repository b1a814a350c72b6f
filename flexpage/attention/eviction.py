"""KV eviction policies: how worth keeping each cached token is, as a small torch program.

An :class:`EvictionPolicy` scores tokens; the engine decides what to drop
(:mod:`flexpage.core.eviction`: whole blocks, never a sequence's first or newest). A
policy is given, for the tokens of some full blocks of one sequence:

* ``keys``:      ``[layers, kv_heads, tokens, head_dim]`` post-RoPE keys, as attention reads them
* ``values``:    ``[layers, kv_heads, tokens, head_dim]``
* ``positions``: ``[tokens]`` int64 logical positions

and returns ``[tokens]`` float scores, higher = more worth keeping. A block's score is the
mean of its tokens' scores; evicting a block drops its tokens in every layer. Policies live
in ``recipes/`` (``paged_eviction``, ``streaming_llm``, ``key_norm``, ``none``), one file each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import Tensor

TokenScores = Callable[[Tensor, Tensor, Tensor], Tensor]

__all__ = ["EvictionPolicy", "TokenScores"]


@dataclass(frozen=True)
class EvictionPolicy:
    """A named token-scoring function; ``token_scores=None`` never evicts (the ``none`` policy)."""

    name: str
    token_scores: TokenScores | None = None

    def __repr__(self) -> str:
        return f"EvictionPolicy({self.name!r})"
