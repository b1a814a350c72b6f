"""Attention sinks + sliding window: every query sees the first ``sinks`` tokens and its last ``window``.

Xiao et al., "Efficient Streaming Language Models with Attention Sinks" (StreamingLLM), 2024,
https://arxiv.org/abs/2309.17453: the first tokens soak up attention mass, so keeping them
lets a windowed model run far past its window. The sinks stay, so no block is released.
"""

from torch import Tensor

from flexpage.attention.recipe import Recipe, and_rules, causal_rule, or_rules, window_rule


def attention_sinks(sinks: int, window: int) -> Recipe:
    if not (isinstance(sinks, int) and isinstance(window, int) and sinks >= 1 and window >= 1):
        raise ValueError(f"sinks, window: got {sinks!r}, {window!r}, expected positive ints")

    def mask_mod(b: Tensor, h: Tensor, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        return (q_pos >= kv_pos) & ((kv_pos < sinks) | (q_pos - kv_pos < window))

    def sink_rule(b: Tensor, q_lo: Tensor, q_hi: Tensor, kv_lo: Tensor, kv_hi: Tensor) -> tuple[Tensor, Tensor]:
        return kv_lo < sinks, kv_hi < sinks

    rule = or_rules(and_rules(causal_rule, sink_rule), window_rule(window))
    return Recipe(f"attention_sinks({sinks},{window})", mask_mod=mask_mod, block_rule=rule)
