"""StreamingLLM: keep the attention sink and the most recent tokens.

Xiao et al., "Efficient Streaming Language Models with Attention Sinks", 2024,
https://arxiv.org/abs/2309.17453. The score is the position, so the oldest blocks go first;
the engine never evicts the first block (the sink) or the newest.
"""

from torch import Tensor

from flexpage.attention.eviction import EvictionPolicy


def streaming_llm() -> EvictionPolicy:
    def token_scores(keys: Tensor, values: Tensor, positions: Tensor) -> Tensor:
        return positions.float()

    return EvictionPolicy("streaming_llm", token_scores)
