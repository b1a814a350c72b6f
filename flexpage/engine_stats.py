"""The engine's counters and gauges, as the CLI summary and the server's /metrics read them."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flexpage.engine import LLMEngine

__all__ = ["engine_stats", "kv_utilization", "tier_stats"]


def engine_stats(engine: LLMEngine) -> dict[str, float]:
    """Counters the CLI summary and the server's /metrics export."""
    blocks = engine.block_manager.stats()
    spec = engine.speculator
    return {
        "num_requests_running": len(engine.scheduler.running),
        "num_requests_waiting": len(engine.scheduler.waiting) + len(engine.scheduler.swapped),
        "kv_blocks_total": blocks.total - 1,
        "kv_blocks_used": blocks.used,
        "kv_blocks_free": blocks.free,
        "kv_blocks_cached": blocks.cached,
        "kv_utilization": kv_utilization(engine),
        "prefix_cache_queries": blocks.prefix_cache_queries,
        "prefix_cache_hits": blocks.prefix_cache_hits,
        "prefix_cache_hit_rate": blocks.prefix_cache_hits / max(1, blocks.prefix_cache_queries),
        "preemptions": engine.scheduler.num_preemptions,
        "swapped_blocks": blocks.host_used,
        "released_window_blocks": blocks.released_window_blocks,
        "kv_evicted_blocks": blocks.evicted_budget_blocks,
        "kv_evicted_tokens": blocks.evicted_budget_blocks * engine.config.block_size,
        # a token takes a slot in every layer group (sliding groups give theirs back later)
        "kv_capacity_tokens": (blocks.total - 1) * engine.config.block_size // len(engine.layer_groups),
        "grammar_compiles": engine.grammars.misses,
        "grammar_cache_hits": engine.grammars.hits,
        # speculative decoding (vLLM's spec_decode counters): proposed tokens verified, accepted
        "spec_decode_num_draft_tokens": spec.num_draft_tokens if spec else 0,
        "spec_decode_num_accepted_tokens": spec.num_accepted_tokens if spec else 0,
        "spec_decode_num_drafts": spec.num_verifications if spec else 0,
        "spec_decode_num_tree_drafts": spec.num_tree_verifications if spec else 0,
        **tier_stats(engine),
        **engine.counters,
    }


def tier_stats(engine: LLMEngine) -> dict[str, float]:
    """The host and disk tiers behind the prefix cache (zeros without tiers)."""
    tiers = engine.block_manager.tiers
    block_bytes = engine.tier_storage.block_bytes if engine.tier_storage is not None else 0
    t = tiers.stats() if tiers is not None else None
    size = engine.config.block_size
    return {
        "kv_host_blocks_total": t.host_capacity if t else 0,
        "kv_host_blocks_used": t.host_used if t else 0,
        "kv_host_bytes_used": (t.host_used if t else 0) * block_bytes,
        "kv_disk_blocks_total": t.disk_capacity if t else 0,
        "kv_disk_blocks_used": t.disk_used if t else 0,
        "kv_disk_bytes_used": engine.tier_storage.disk_bytes if engine.tier_storage is not None else 0,
        "kv_spilled_tokens": (t.spilled_blocks if t else 0) * size,
        "kv_restored_host_tokens": (t.restored_host_blocks if t else 0) * size,
        "kv_restored_disk_tokens": (t.restored_disk_blocks if t else 0) * size,
        "kv_dropped_tokens": (t.dropped_blocks if t else 0) * size,
        "kv_released_tokens": (t.released_blocks if t else 0) * size,
        "kv_hole_recomputed_tokens": engine.block_manager.num_hole_tokens,
        **{f"conversation_{name}": value for name, value in engine.conversations.totals.items()},
    }


def kv_utilization(engine: LLMEngine) -> float:
    """Token states stored / token slots allocated, over the blocks live sequences hold."""
    filled: dict[int, int] = {}
    size = engine.config.block_size
    for seq in engine.scheduler.running:
        for table in engine.block_manager.block_tables(seq):
            for i, block in enumerate(table):
                if block == 0:  # given back by a sliding-window group
                    continue
                stored = min(size, max(0, seq.num_computed_tokens - i * size))
                filled[block] = max(filled.get(block, 0), stored)
    return sum(filled.values()) / (len(filled) * size) if filled else 1.0
