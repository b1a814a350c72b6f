"""PagedEviction: keep the tokens whose values are large relative to their keys.

Chitty-Venkata et al., "PagedEviction: Structured Block-wise KV Cache Pruning for Efficient
Large Language Model Inference", 2025, https://arxiv.org/abs/2509.04377. A token's importance
is ``||V||_2 / ||K||_2`` averaged over heads (and here over layers): a large value moves the
output, a large key draws attention everywhere and so says little about this token. No
attention probabilities are needed, so it works with fused kernels that never write them.
"""

from torch import Tensor

from flexpage.attention.eviction import EvictionPolicy


def paged_eviction() -> EvictionPolicy:
    def token_scores(keys: Tensor, values: Tensor, positions: Tensor) -> Tensor:
        ratio = values.float().norm(dim=-1) / keys.float().norm(dim=-1).clamp_min(1e-6)
        return ratio.mean(dim=(0, 1))

    return EvictionPolicy("paged_eviction", token_scores)
