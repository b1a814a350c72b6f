"""No eviction: the full cache, whatever the budget (the baseline every policy is compared with)."""

from flexpage.attention.eviction import EvictionPolicy


def no_eviction() -> EvictionPolicy:
    return EvictionPolicy("none")
