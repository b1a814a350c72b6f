"""ALiBi: a per-head linear penalty on distance instead of position embeddings. Causal.

Press et al., "Train Short, Test Long: Attention with Linear Biases", 2022,
https://arxiv.org/abs/2108.12409 (Bloom, MPT, Falcon-RW).
"""

import math

import torch
from torch import Tensor

from flexpage.attention.recipe import Recipe


def alibi_slopes(num_heads: int) -> Tensor:
    """The paper's geometric slopes, with the interleaving rule for non-power-of-two heads (as in Bloom)."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2.0 ** (-8.0 / closest)
    slopes = [base ** (i + 1) for i in range(closest)]
    if closest < num_heads:
        extra_base = 2.0 ** (-4.0 / closest)
        slopes += [extra_base ** (2 * i + 1) for i in range(num_heads - closest)]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi(num_heads: int, slopes: Tensor | None = None) -> Recipe:
    slopes = alibi_slopes(num_heads) if slopes is None else slopes.float()
    if slopes.shape != (num_heads,):
        raise ValueError(f"slopes: got shape {tuple(slopes.shape)}, expected ({num_heads},)")

    def score_mod(score: Tensor, b: Tensor, h: Tensor, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        return score + slopes[h] * (kv_pos - q_pos)

    return Recipe(f"alibi({num_heads})", score_mod=score_mod)
