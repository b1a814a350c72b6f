"""Prefix-LM: the first ``prefix_lengths[b]`` tokens of each sequence see each other both
ways; the rest is causal.

Raffel et al., "Exploring the Limits of Transfer Learning with a Unified Text-to-Text
Transformer" (T5), 2020, https://arxiv.org/abs/1910.10683; PaliGemma uses it for its image+prompt prefix.
"""

from torch import Tensor

from flexpage.attention.recipe import Recipe, causal_mask, causal_rule, or_masks, or_rules


def prefix_lm(prefix_lengths: Tensor) -> Recipe:
    """``prefix_lengths``: [num_seqs] int tensor, indexed by the sequence's batch index."""
    prefix_lengths = prefix_lengths.int()

    def prefix_mask(b: Tensor, h: Tensor, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        return kv_pos < prefix_lengths[b]

    def prefix_rule(b: Tensor, q_lo: Tensor, q_hi: Tensor, kv_lo: Tensor, kv_hi: Tensor) -> tuple[Tensor, Tensor]:
        limit = prefix_lengths[b]
        return kv_lo < limit, kv_hi < limit

    return Recipe(
        "prefix_lm",
        mask_mod=or_masks(causal_mask, prefix_mask),
        block_rule=or_rules(causal_rule, prefix_rule),
    )
