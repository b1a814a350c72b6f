"""The KV cache as people want to watch it: every pool block's state and owner, the tiers
behind the pool, conversations and requests -- one JSON-able dict (``GET /v1/kv``), drawn
live by ``flexpage top`` and as a PNG by ``bench/multiturn.py``.

Block states, one character per pool block (block 0, the null block, is left out):

* ``.`` free: holds nothing worth keeping;
* ``c`` cached: no sequence holds it, its KV is indexed by content and can be reused (or
  spilled to the host tier when the pool needs the block);
* ``u`` used by one sequence; ``s`` shared by several (prefix hits, parallel samples).

Owners: a running request's blocks belong to its conversation (or ``request <id>``); a cached
block to the conversation that computed it (or ``prefix cache``).
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["BLOCK_STATES", "kv_view"]

BLOCK_STATES = {".": "free", "c": "cached", "u": "used", "s": "shared"}
_CACHE_OWNER = "prefix cache"


def kv_view(engine: Any, max_conversations: int = 64, max_requests: int = 128) -> dict[str, Any]:
    """A snapshot of ``engine``'s KV cache (call it on the engine's thread)."""
    bm = engine.block_manager
    pool = bm.pool
    owners: list[str | None] = [None]
    index: dict[str, int] = {}

    def owner_id(label: str) -> int:
        if label not in index:
            index[label] = len(owners)
            owners.append(label)
        return index[label]

    owner_of = [0] * (pool.num_blocks - 1)
    requests = []
    for request in engine.requests.values():
        label = request.conversation or f"request {request.request_id}"
        blocks = 0
        for seq in request.seqs:
            for table in bm.block_tables(seq):
                for block in table:
                    if block:
                        owner_of[block - 1] = owner_id(label)
                        blocks += 1
        if len(requests) < max_requests:
            seq = request.seqs[0]
            requests.append({"id": request.request_id, "conversation": request.conversation,
                             "status": seq.status.value, "prompt_tokens": len(request.prompt_token_ids),
                             "output_tokens": seq.num_output_tokens, "computed_tokens": seq.num_computed_tokens,
                             "cached_tokens": request.num_cached_tokens, "blocks": blocks})
    states = []
    pool_blocks: dict[str, int] = {}
    for block in range(1, pool.num_blocks):
        ref = pool.ref_count(block)
        if ref:
            states.append("s" if ref > 1 else "u")
        elif pool.block_hash(block) is not None:
            states.append("c")
            owner_of[block - 1] = owner_id(bm.cached_block_owner(block) or _CACHE_OWNER)
        else:
            states.append(".")
        if owner_of[block - 1]:
            label = owners[owner_of[block - 1]]
            pool_blocks[label] = pool_blocks.get(label, 0) + 1  # type: ignore[index]
    stats = engine.stats()
    return {
        "block_size": engine.config.block_size,
        "blocks": "".join(states),
        "owner_of": owner_of,
        "owners": owners,
        "pool": {name: states.count(char) for char, name in BLOCK_STATES.items()},
        "tiers": _tiers(engine, stats),
        "conversations": _conversations(engine, pool_blocks, max_conversations),
        "requests": requests,
        "rates": {
            "prefix_cache_hit_rate": stats["prefix_cache_hit_rate"],
            "history_reuse_rate": stats["conversation_reused_tokens"] / max(1, stats["conversation_history_tokens"]),
            **{name: stats[name] for name in ("kv_spilled_tokens", "kv_restored_host_tokens", "kv_restored_disk_tokens",
                                              "kv_dropped_tokens", "kv_released_tokens",
                                              "kv_hole_recomputed_tokens", "conversation_recomputed_tokens",
                                              "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")},
        },
    }


def _tiers(engine: Any, stats: dict[str, float]) -> dict[str, Any]:
    tiers = engine.block_manager.tiers
    block_bytes = engine.tier_storage.block_bytes if engine.tier_storage is not None else 0
    return {
        "policy": tiers.policy if tiers is not None else None,
        "recompute_cost_slope": engine.recompute_cost_slope,  # per token of context; see KVTiers
        "host": {"blocks_total": stats["kv_host_blocks_total"], "blocks_used": stats["kv_host_blocks_used"],
                 "bytes_total": stats["kv_host_blocks_total"] * block_bytes, "bytes_used": stats["kv_host_bytes_used"]},
        "disk": {"blocks_total": stats["kv_disk_blocks_total"], "blocks_used": stats["kv_disk_blocks_used"],
                 "bytes_used": stats["kv_disk_bytes_used"],
                 "dir": str(engine.tier_storage.disk_dir) if engine.tier_storage and engine.tier_storage.disk_dir else None},
    }


def _conversations(engine: Any, pool_blocks: dict[str, int], limit: int) -> list[dict[str, Any]]:
    tiers = engine.block_manager.tiers
    tiered = tiers.blocks_by_owner() if tiers is not None else {}
    now = time.monotonic()
    out = []
    for conversation_id, conv in engine.conversations.items()[:limit]:
        host, disk = tiered.get(conversation_id, (0, 0))
        out.append({"id": conversation_id, "turns": conv.turns, "idle_s": round(now - conv.last_active, 3),
                    "history_tokens": conv.history_tokens, "reused_tokens": conv.reused_tokens,
                    "recomputed_tokens": conv.recomputed_tokens, "pool_blocks": pool_blocks.get(conversation_id, 0),
                    "host_blocks": host, "disk_blocks": disk})
    return out
