"""Chunked local attention: a token sees the earlier tokens of its own chunk of ``chunk`` positions.

Llama 4 (Meta, 2025; HF ``config.attention_chunk_size``, 8192) runs it in three of every four
layers: memory per sequence stays bounded, and blocks behind the current chunk are released.
"""

from torch import Tensor

from flexpage.attention.recipe import Recipe


def chunked_local(chunk: int) -> Recipe:
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk: got {chunk!r}, expected a positive int")

    def mask_mod(b: Tensor, h: Tensor, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        return (q_pos >= kv_pos) & (q_pos // chunk == kv_pos // chunk)

    def block_rule(b: Tensor, q_lo: Tensor, q_hi: Tensor, kv_lo: Tensor, kv_hi: Tensor) -> tuple[Tensor, Tensor]:
        # queries q_lo..q_hi see keys from the start of q_lo's chunk up to q_hi
        may = (kv_lo <= q_hi) & (kv_hi >= q_lo // chunk * chunk)
        return may, (kv_hi <= q_lo) & (kv_lo // chunk == q_hi // chunk)

    # a query never sees further back than chunk - 1 positions: blocks behind it can go
    return Recipe(f"chunked_local({chunk})", mask_mod=mask_mod, block_rule=block_rule, window=chunk)
