"""A snapshot of the KV block pool, for metrics and admission decisions."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BlockStats"]


@dataclass(frozen=True, slots=True)
class BlockStats:
    """Snapshot of pool occupancy and prefix-cache effectiveness.

    ``free + cached + used == total - 1`` always (block 0 is the null block).
    """

    total: int  # device blocks including the null block
    free: int  # ref 0, no cached content (never used or evicted)
    cached: int  # ref 0, still findable by hash; evictable
    used: int  # ref > 0
    host_total: int
    host_used: int
    host_free: int
    prefix_cache_queries: int  # tokens looked up at admission
    prefix_cache_hits: int  # tokens served from the cache at admission
    evictions: int  # cached blocks whose content was dropped for reuse
    #: blocks sliding-window layer groups gave back early (out of every query's window)
    released_window_blocks: int = 0
    #: block-table entries sequences gave up to stay within their KV budget
    evicted_budget_blocks: int = 0

    @property
    def num_free_or_cached(self) -> int:
        """Blocks available to admissions (cached ones are evicted on demand)."""
        return self.free + self.cached

    @property
    def usage(self) -> float:
        """Fraction of usable blocks referenced by live sequences."""
        return self.used / max(1, self.total - 1)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
