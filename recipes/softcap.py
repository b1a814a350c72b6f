"""Logit soft-capping: ``cap * tanh(score / cap)`` keeps attention logits in ``(-cap, cap)``.

Gemma 2 team, "Gemma 2: Improving Open Language Models at a Practical Size", 2024,
https://arxiv.org/abs/2408.00118 (HF ``config.attn_logit_softcapping``). Causal.
"""

import torch
from torch import Tensor

from flexpage.attention.recipe import Recipe


def softcap(cap: float) -> Recipe:
    if not cap > 0:
        raise ValueError(f"cap: got {cap!r}, expected a positive number")

    def score_mod(score: Tensor, b: Tensor, h: Tensor, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        return cap * torch.tanh(score / cap)

    return Recipe(f"softcap({cap})", score_mod=score_mod)
