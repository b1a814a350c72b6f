"""Sliding-window attention: a token sees only the last ``window`` tokens, itself included.

Beltagy et al., "Longformer", 2020, https://arxiv.org/abs/2004.05150; used by Mistral and
Gemma2 (HF ``config.sliding_window``).
"""

from torch import Tensor

from flexpage.attention.recipe import Recipe, window_rule


def sliding_window(window: int) -> Recipe:
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"window: got {window!r}, expected a positive int")

    def mask_mod(b: Tensor, h: Tensor, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        return (q_pos >= kv_pos) & (q_pos - kv_pos < window)

    return Recipe(f"sliding_window({window})", mask_mod=mask_mod, block_rule=window_rule(window), window=window)
