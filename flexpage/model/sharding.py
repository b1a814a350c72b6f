"""Which slice of a Llama-family model each tensor-parallel rank keeps (Megatron-style).

* column-parallel (output rows split): q|k|v by heads, gate|up by intermediate features;
* row-parallel (input columns split): o and down; their partial outputs are summed by one
  all-reduce each, and their bias, if any, is added once (rank 0 keeps it);
* vocabulary-parallel: the embedding and the LM head by vocabulary rows, padded with zero rows
  to a multiple of the rank count.

Ranks hold contiguous runs of heads (rank ``r``: query heads ``[r*H/N, (r+1)*H/N)`` and the KV
heads they read), so grouped-query attention's head-to-KV-head map is the same on every rank.
:func:`shard_llama` slices the HF modules in place, before the compact forward takes them over.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flexpage.model.tensor_parallel import padded_vocab

__all__ = ["check_shardable", "shard_llama", "shard_rows"]


def check_shardable(config: object, size: int) -> None:
    """Raise ValueError naming the count that ``size`` ranks cannot split evenly."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor_parallel_size: got {size!r}, expected a positive int")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    counts = (("attention heads", heads), ("key/value heads", kv_heads),
              ("MLP intermediate features", config.intermediate_size))
    uneven = [f"{count} {name}" for name, count in counts if count % size]
    if uneven:
        raise ValueError(f"tensor_parallel_size={size}: the model has {' and '.join(uneven)}, which {size} ranks "
                         "cannot split evenly (use a size that divides every head count)")


def shard_rows(t: Tensor, rank: int, size: int, dim: int = 0) -> Tensor:
    """Rank ``rank``'s contiguous 1/``size`` of ``t`` along ``dim`` (a copy: the full tensor can be freed)."""
    return t.chunk(size, dim)[rank].clone()


def _keep(module: torch.nn.Module, name: str, value: Tensor | None) -> None:
    setattr(module, name, None if value is None else torch.nn.Parameter(value, requires_grad=False))


@torch.no_grad()
def shard_llama(model: torch.nn.Module, rank: int, size: int) -> None:
    """Cut a Llama-family HF model down to rank ``rank``'s share, in place (see the module docstring)."""
    config = model.config
    check_shardable(config, size)
    base = model.model
    for layer in base.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for linear in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):  # column-parallel
            _keep(linear, "weight", shard_rows(linear.weight, rank, size))
            _keep(linear, "bias", None if linear.bias is None else shard_rows(linear.bias, rank, size))
            linear.out_features //= size
        for linear in (attn.o_proj, mlp.down_proj):  # row-parallel
            _keep(linear, "weight", shard_rows(linear.weight, rank, size, dim=1))
            if linear.bias is not None and rank:
                _keep(linear, "bias", torch.zeros_like(linear.bias))
            linear.in_features //= size
    embed, head = base.embed_tokens, model.get_output_embeddings()
    tied = head.weight is embed.weight
    _keep(embed, "weight", shard_rows(_pad_rows(embed.weight, size), rank, size))
    if tied:
        head.weight = embed.weight
    else:
        _keep(head, "weight", shard_rows(_pad_rows(head.weight, size), rank, size))
        if head.bias is not None:
            _keep(head, "bias", shard_rows(_pad_rows(head.bias, size), rank, size))


def _pad_rows(t: Tensor, size: int) -> Tensor:
    """``t`` with zero rows appended up to :func:`padded_vocab` rows."""
    missing = padded_vocab(t.shape[0], size) - t.shape[0]
    return torch.cat((t, t.new_zeros(missing, *t.shape[1:]))) if missing else t
