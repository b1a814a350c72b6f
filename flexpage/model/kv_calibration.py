"""The 8-bit KV cache's scales, calibrated at start-up on text the model encodes itself.

Why at start-up and not from the first requests: the scales are static
(:mod:`flexpage.attention.kv_quant`), so every block in the pool, the prefix cache and the
tiers means the same; taken from users' first prompts they would depend on who came first.
The calibration text is Python's own documentation (``pydoc_data.topics``, in every CPython):
prose, code and lists, fixed for a Python version, no download. One forward of the compact
decoder over :data:`CALIBRATION_TOKENS` of it, with plain causal attention (no pool), records
each layer's per-head, per-channel absolute maxima of the keys (after RoPE, as the pool stores
them) and values. The fake-quantisation study (``bench/kv_quant_accuracy.py``) calibrated on
this text and scored another part of it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from flexpage.attention.kv_quant import calibration_scales
from flexpage.model.compact import CompactDecoder

__all__ = ["CALIBRATION_TOKENS", "calibration_token_ids", "calibrate_kv_scales"]

#: tokens of calibration text: 1.6-2.2 s of a bf16 SmolLM2 start-up on 2 shared cores (the forward is eager)
CALIBRATION_TOKENS = 1024


def calibration_token_ids(tokenizer: object, tokens: int = CALIBRATION_TOKENS) -> list[int]:
    """The first ``tokens`` token ids of Python's topic documentation under ``tokenizer``."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[key] for key in sorted(topics))
    return list(tokenizer(text[: tokens * 8]).input_ids[:tokens])  # ~4 characters a token: 8 is plenty


@torch.no_grad()
def calibrate_kv_scales(decoder: CompactDecoder, token_ids: Sequence[int]) -> Tensor:
    """Scales ``[layers, 2 (K, V), kv_heads, head_dim]`` from one causal forward over ``token_ids``."""
    if len(token_ids) < 2:
        raise ValueError(f"kv calibration: got {len(token_ids)} token ids, expected at least 2")
    ids = torch.tensor(list(token_ids), dtype=torch.long)
    layers = len(decoder.layers)
    maxima = torch.zeros(layers, 2, decoder.num_kv_heads, decoder.head_dim)
    groups = decoder.num_heads // decoder.num_kv_heads

    def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:  # [T, H(_kv), D]
        maxima[layer, 0] = k.float().abs().amax(0)
        maxima[layer, 1] = v.float().abs().amax(0)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.repeat_interleave(groups, 1).transpose(0, 1),
            v.repeat_interleave(groups, 1).transpose(0, 1), is_causal=True, scale=decoder.scale)
        return out.transpose(0, 1)

    decoder.forward(ids, torch.arange(len(ids)), torch.tensor([len(ids) - 1]), attend)
    return torch.stack((calibration_scales(maxima[:, 0]), calibration_scales(maxima[:, 1], rope_pairs=False)), 1)
