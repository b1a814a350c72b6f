"""Key-norm eviction: keep the tokens with small keys.

Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression",
2024, https://arxiv.org/abs/2406.11430: tokens with a low key L2 norm draw high attention,
so the score is the inverse key norm, averaged over layers and heads.
"""

from torch import Tensor

from flexpage.attention.eviction import EvictionPolicy


def key_norm() -> EvictionPolicy:
    def token_scores(keys: Tensor, values: Tensor, positions: Tensor) -> Tensor:
        return (1.0 / keys.float().norm(dim=-1).clamp_min(1e-6)).mean(dim=(0, 1))

    return EvictionPolicy("key_norm", token_scores)
