"""A compact forward pass for Llama-family decoders (Llama, Mistral, Qwen2, Qwen3).

Why it exists: in a batch-64 decode step of SmolLM2-135M, HF's own modules spend ~20 ms
in Python and small tensor ops around ~70 ms of matmuls (module calls, keyword plumbing,
``rotate_half``'s slices and concatenations, separate q/k/v and gate/up projections).
This forward runs the same arithmetic over the flat token batch with fewer, larger ops:

* one q|k|v projection and one gate|up projection per layer, with bf16 weights pre-packed
  for oneDNN (:mod:`flexpage.model.packed_linear`). The decoder takes the weights over:
  the HF modules' projection weights are released (or, unpacked, re-pointed at slices of
  the fused matrices), so no weight is stored twice and the HF layers cannot run after;
* RoPE applied to queries and keys together, ``x*cos + roll(x, D/2)*sin_signed``: the same
  products as HF's ``rotate_half`` (negation is exact);
* RMSNorm as HF computes it (float32 statistics, weight applied in the model dtype), through
  ``F.rms_norm``'s fused kernel (summation order may differ from HF's in the last bit).

Attention is not done here: ``forward`` calls ``attend(layer, q, k, v)``, which the
model runner binds to the paged KV pool. Other architectures (Gemma2/3, Bloom...) run
through HF's modules; :func:`supports` says which path a model takes.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from flexpage.attention.paging import next_power_of_two
from flexpage.model.gguf_linear import embedding
from flexpage.model.packed_linear import PackedLinear
from flexpage.model.tensor_parallel import TensorParallel

__all__ = ["CompactDecoder", "supports"]

#: model types whose decoder layer is RMSNorm -> attention (RoPE, optional q/k norm) ->
#: residual -> RMSNorm -> SwiGLU MLP -> residual, with a final RMSNorm and an LM head
_LLAMA_FAMILY = frozenset({"llama", "mistral", "qwen2", "qwen3"})

#: ``attend(layer, q [T, H, D], k [T, H_kv, D], v [T, H_kv, D]) -> [T, H, D]``
Attend = Callable[[int, Tensor, Tensor, Tensor], Tensor]
#: a projection's GGUF blocks, or None
_BlocksOf = Callable[[torch.nn.Linear], "Tensor | None"]


def supports(model: torch.nn.Module) -> bool:
    """True when ``model`` is a Llama-family causal LM this module computes exactly like HF."""
    config = model.config
    return (
        getattr(config, "model_type", None) in _LLAMA_FAMILY
        and getattr(config, "hidden_act", None) == "silu"
        and not getattr(config, "pretraining_tp", 1) > 1
        and getattr(config, "partial_rotary_factor", 1.0) == 1.0
        and hasattr(getattr(model, "model", None), "rotary_emb")
    )


@dataclass
class _Layer:
    qkv: PackedLinear
    o: PackedLinear
    gate_up: PackedLinear
    down: PackedLinear
    input_norm: Tensor
    post_norm: Tensor
    q_norm: Tensor | None  # Qwen3: RMSNorm over each head's dims before RoPE
    k_norm: Tensor | None


class CompactDecoder:
    """The decoder stack and LM head of a Llama-family HF model, over a flat token batch."""

    def __init__(self, model: torch.nn.Module, *, prepack: bool = True, row_tile: int | None = None,
                 parallel: TensorParallel | None = None, blocks: Mapping[str, Tensor] | None = None) -> None:
        """``row_tile``: every projection computes this many rows per call (deterministic mode,
        see :func:`~flexpage.model.packed_linear.tiled_rows`); None: one call per projection.

        ``parallel``: ``model`` holds this rank's share (:func:`~flexpage.model.sharding.shard_llama`):
        the embedding is looked up and the o and down projections' outputs summed across ranks,
        and the LM head's vocabulary slices are gathered.

        ``blocks``: weights as GGUF blocks by HF parameter name
        (:func:`~flexpage.model.gguf_linear.gguf_blocks`), computed from in place of the weights."""
        if not supports(model):
            raise ValueError(f"model: a {type(model).__name__} (model_type={model.config.model_type!r}) is not a "
                             f"Llama-family decoder ({', '.join(sorted(_LLAMA_FAMILY))} with SiLU MLPs)")
        base = model.model
        first = base.layers[0].self_attn
        self.num_heads = first.q_proj.out_features // first.head_dim
        self.num_kv_heads = first.k_proj.out_features // first.head_dim
        self.head_dim = first.head_dim
        self.scale = float(first.scaling)
        self.eps = float(base.norm.variance_epsilon)
        self.parallel = parallel
        self.vocab_size = model.config.get_text_config().vocab_size  # the LM head's rows may be padded
        self.embed = base.embed_tokens.weight
        self.final_norm = base.norm.weight
        names = {module: name for name, module in model.named_modules()}
        quantized = blocks or {}

        def blocks_of(linear: torch.nn.Module) -> Tensor | None:
            return quantized.get(f"{names[linear]}.weight")

        head = model.get_output_embeddings()
        tied = head.weight is self.embed
        self.lm_head = PackedLinear(head.weight, head.bias, prepack=prepack, row_tile=row_tile, blocks=blocks_of(head))
        self.hidden_size = self.embed.shape[1]
        # the embedding kept as GGUF blocks where the projections may be (one process, float32)
        usable = prepack and row_tile is None and parallel is None and self.embed.dtype == torch.float32
        self.embed_blocks = blocks_of(base.embed_tokens) if usable else None
        if self.embed_blocks is not None:
            self.embed = None
            _release(base.embed_tokens)
        if self.lm_head.owns_weight and (not tied or self.embed is None):  # a tied head's weight is the embedding
            _release(head)
        self.rotary = base.rotary_emb
        # a position's angles depend on the position alone in every RoPE type but these two
        rope_type = getattr(self.rotary, "rope_type", "default")
        self._rope_by_position = "dynamic" not in rope_type and rope_type != "longrope"
        self._rope_table: tuple[Tensor, Tensor] | None = None  # rope_tables of positions [0, len)
        self.layers = [self._take(layer, prepack, row_tile, blocks_of) for layer in base.layers]
        if self.lm_head.owns_weight:
            _copy_unpacked_weights(model)
        _return_freed_memory()

    @staticmethod
    def _take(layer: torch.nn.Module, prepack: bool, row_tile: int | None, blocks_of: _BlocksOf) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)

        def fused(*linears: torch.nn.Linear) -> PackedLinear:
            return _fused(prepack, row_tile, blocks_of, *linears)

        return _Layer(
            qkv=fused(attn.q_proj, attn.k_proj, attn.v_proj), o=fused(attn.o_proj),
            gate_up=fused(mlp.gate_proj, mlp.up_proj), down=fused(mlp.down_proj),
            input_norm=layer.input_layernorm.weight, post_norm=layer.post_attention_layernorm.weight,
            q_norm=None if q_norm is None else q_norm.weight, k_norm=None if k_norm is None else k_norm.weight,
        )

    @torch.no_grad()
    def prime(self, max_rows: int, max_sampled_rows: int) -> None:
        """Build the matmul kernels of every row bucket a step can meet (see
        :meth:`PackedLinear.prime`): ``max_rows`` tokens per step, ``max_sampled_rows`` of them
        sampled. oneDNN caches kernels by shape, so one linear per weight shape is enough."""
        by_shape = {(linear.in_features, linear.out_features): linear
                    for layer in self.layers for linear in (layer.qkv, layer.o, layer.gate_up, layer.down)}
        for linear in by_shape.values():
            linear.prime(max_rows)
        self.lm_head.prime(max_sampled_rows)

    @torch.no_grad()
    def forward(self, token_ids: Tensor, positions: Tensor, sample_rows: Tensor, attend: Attend) -> Tensor:
        """Logits ``[len(sample_rows), vocab]`` (model dtype) of a flat batch ``token_ids [T]``
        at logical ``positions [T]``; ``attend`` writes/reads the KV cache of each layer."""
        hidden = self.embed_tokens(token_ids)  # [T, hidden]
        cos, sin = self.rope_tables(positions)
        half = self.head_dim // 2
        tokens, heads, kv_heads, dim = token_ids.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        for index, layer in enumerate(self.layers):
            qkv = layer.qkv(self._norm(hidden, layer.input_norm))
            qk = qkv[:, : (heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim)
            if layer.q_norm is not None:
                qk = torch.cat((self._norm(qk[:, :heads], layer.q_norm), self._norm(qk[:, heads:], layer.k_norm)), 1)
            qk = qk * cos + qk.roll(half, -1) * sin
            v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
            out = attend(index, qk[:, :heads], qk[:, heads:], v)
            hidden = hidden + self._reduce(layer.o(out.reshape(tokens, heads * dim)))
            gate, up = layer.gate_up(self._norm(hidden, layer.post_norm)).chunk(2, -1)
            hidden = hidden + self._reduce(layer.down(F.silu(gate) * up))
        return self.logits(self.lm_head(self._norm(hidden[sample_rows], self.final_norm)))

    def embed_tokens(self, token_ids: Tensor) -> Tensor:
        """The embedding rows of ``token_ids`` (gathered from the rank that holds each)."""
        if self.embed_blocks is not None:
            return embedding(token_ids, self.embed_blocks, self.hidden_size)
        if self.parallel is None:
            return F.embedding(token_ids, self.embed)
        return self.parallel.embed(token_ids, self.embed)

    def logits(self, local: Tensor) -> Tensor:
        """The LM head's output over the whole vocabulary (this rank's slice: ``local``)."""
        if self.parallel is None:
            return local
        return self.parallel.gather_columns(local)[:, : self.vocab_size]

    def _reduce(self, partial: Tensor) -> Tensor:
        return partial if self.parallel is None else self.parallel.all_reduce(partial)

    def rope_tables(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """``cos, sin`` ``[T, 1, D]`` (model dtype) for ``x*cos + roll(x, D/2)*sin`` at ``positions``:
        ``sin``'s first half is negated, which makes the roll HF's ``rotate_half``.

        Where a position's angles depend on the position alone (not RoPE's dynamic or longrope
        types), rows of a table computed once by the same module, for positions up to a power of
        two past the largest asked for: HF's module costs ~40 us a call (~0.15 ms inside a
        batch-1 decode step), two row gathers a few."""
        if not self._rope_by_position:
            return self._rope_at(positions)
        needed = int(positions.max()) + 1 if positions.numel() else 1
        if self._rope_table is None or self._rope_table[0].shape[0] < needed:
            self._rope_table = self._rope_at(torch.arange(next_power_of_two(needed), device=positions.device))
        cos, sin = self._rope_table
        return cos.index_select(0, positions), sin.index_select(0, positions)

    def _rope_at(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        cos, sin = self.rotary(self.final_norm, positions[None])  # [1, T, D]; the tensor gives dtype and device
        half = self.head_dim // 2
        return cos[0, :, None], torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)[:, None]

    def _norm(self, x: Tensor, weight: Tensor) -> Tensor:
        return rms_norm(x, weight, self.eps)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """HF's LlamaRMSNorm: statistics in float32, the weight applied in the model dtype."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def _fused(prepack: bool, row_tile: int | None, blocks_of: _BlocksOf, *linears: torch.nn.Linear) -> PackedLinear:
    """One projection for several HF projections of the same input (outputs stacked by rows),
    with their GGUF blocks stacked alike where every one has them.

    The HF modules give their weights up: packed, their parameters are released (replaced
    by empty meta tensors, so a forgotten HF call fails loudly instead of running on stale
    weights); unpacked, they become views into the fused weight (a single projection is
    used as it is).
    """
    blocks = [blocks_of(linear) for linear in linears]
    stacked = None if any(b is None for b in blocks) else torch.cat(blocks)  # type: ignore[arg-type]
    if len(linears) == 1:
        fused = PackedLinear(linears[0].weight, linears[0].bias, prepack=prepack, row_tile=row_tile, blocks=stacked)
        if fused.owns_weight:
            _release(linears[0])
        return fused
    weight = torch.cat([linear.weight for linear in linears])
    biases = [linear.bias for linear in linears]
    bias = None if all(b is None for b in biases) else torch.cat(
        [b if b is not None else weight.new_zeros(linear.out_features) for b, linear in zip(biases, linears)])
    fused = PackedLinear(weight, bias, prepack=prepack, row_tile=row_tile, blocks=stacked)
    start = 0
    for linear in linears:
        rows = slice(start, start + linear.out_features)
        start += linear.out_features
        if fused.owns_weight:
            _release(linear)
            continue
        linear.weight = torch.nn.Parameter(weight[rows], requires_grad=False)
        if linear.bias is not None:
            linear.bias = torch.nn.Parameter(bias[rows], requires_grad=False)
    return fused


def _return_freed_memory() -> None:
    """Hand the released HF weights' memory back to the OS (glibc keeps freed heap memory for
    reuse, so without this the process's RSS stays ~one model copy higher: 946 vs 725 MB for
    SmolLM2-135M bf16). A no-op where the C library has no ``malloc_trim``."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):
        pass


def _copy_unpacked_weights(model: torch.nn.Module) -> None:
    """Give the weights still used as they are (embedding, norms) memory of their own.

    Why: transformers memory-maps a safetensors file whose dtype is the model's, and every
    weight is a view of that one mapping: while the embedding still points into it, the
    whole file stays mapped and resident after the projections were packed and released
    (SmolLM2-135M in float32: 2,464 MB of RSS after loading, 2,060 MB with this)."""
    for tensor in [*model.parameters(), *model.buffers()]:
        if not tensor.is_meta:
            tensor.data = tensor.data.clone()


def _release(linear: torch.nn.Linear) -> None:
    """Free an HF projection whose weight now lives packed elsewhere (empty meta tensors remain)."""
    for name, param in list(linear.named_parameters(recurse=False)):
        setattr(linear, name, torch.nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=False))
