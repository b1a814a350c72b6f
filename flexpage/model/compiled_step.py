"""A whole step of a Llama-family model as one compiled graph.

Why: layer by layer, a step is hundreds of small eager ops and 30 compiled attention calls,
each crossing Dynamo's guards and AOTAutograd's wrappers (~150 us a call on the 2-core test
machine). Here every layer -- norms, the packed projections, RoPE, the KV write into the
pool, paged FlexAttention, the MLP -- and the final norm and LM head over the sampled rows
are traced into one ``torch.compile`` graph: one guard check per step, elementwise ops
fused by Inductor. Decode rows read the pool in place and prefill rows a gathered copy of
their keys, as in :class:`~flexpage.attention.flex.FlexRunner`; a step holds either or both.
In the virtual layout both read each sequence's row of the pool in place. Under tensor
parallelism the graph holds the rank's collectives too (the embedding's and the row-parallel
projections' sums, the logits' gather; :mod:`flexpage.model.tensor_parallel`).

What makes the graph cheap to build and to run:

* **One compiled layer.** A layer's two halves are ``torch.compiler.nested_compile_region``
  functions: traced and compiled once, called for every layer (30 inlined layers took 165 s
  to compile on 2 cores; with the regions, 24 s).
* **KV written in place.** Each layer's K and V pools are tensors of their own storage
  (:meth:`flexpage.attention.kv_pool.KVPool.layer`), written with ``index_copy_`` in the graph:
  views of one shared storage made Inductor copy whole pools around every write.
* **8-bit KV** (an int8 pool): each layer's K/V are quantised as they are written, its key
  scale multiplies the queries and its value scale the attention output
  (:mod:`flexpage.attention.kv_quant`); decode rows read the 8-bit pool in place, prefill rows
  widen their gathered copy.
* **Packed weights as inputs**, so that one graph serves every layer; Inductor lowers the
  oneDNN call through :mod:`flexpage.backends.cpu.packed_linear_lowering`. A projection kept as
  GGUF blocks passes them instead (its weight is None) and runs ``flexpage::block_linear``
  (:mod:`flexpage.model.gguf_linear`).
* **Two graphs per model.** Token rows are padded to the packed linears' buckets
  (:func:`~flexpage.model.packed_linear.padded_rows`) outside the graph, the per-step sizes
  are dynamic and padded to at least 2 (Dynamo specialises a size of 1), and tensors keep
  standard strides: one graph for decode steps, one for steps with prefill rows. The
  projections that read blocks are told the rows before the padding (two one-value tensors,
  not sizes the graph specialises on) and skip the rest: a batch-1 decode step computes one
  row, not two (a 1B Llama's projections: ~40 vs ~50 ms). A prefill-only
  step runs the mixed steps' graph beside an idle decode group
  (:func:`~flexpage.attention.paging.idle_decode_group`): a third graph cost ~10 s of a cold
  start for no speed (deterministic mode keeps its own prefill graph).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from flexpage.attention.flex import (
    _gathered_group_attention, _group_attention, gathered_attention_dtype, kernel_options_for,
)
from flexpage.attention.kv_pool import KVPool
from flexpage.attention.kv_quant import quantize, scale_output, scale_queries
from flexpage.attention.paging import AttentionGroup, PagedBatch, idle_decode_group
from flexpage.attention.recipe import Recipe
from flexpage.backends.cpu import torch_patches
from flexpage.backends.cpu.saved_programs import Program, SavedProgram, compiled_program
from flexpage.model.compact import CompactDecoder, rms_norm
from flexpage.model.gguf_linear import MAX_BLOCK_ROWS, block_linear, block_or_packed_linear, embedding
from flexpage.model.packed_linear import PackedLinear, padded_rows, tiled_linear
from flexpage.model.tensor_parallel import TensorParallel

__all__ = ["CompiledStep"]


@dataclass(frozen=True)
class _Shape:
    """The constants a compiled step is specialised on (one program per distinct value)."""

    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    scale: float
    packed: bool  # projections run oneDNN's packed kernel (else F.linear)
    #: deterministic mode: projections run in calls of exactly this many rows, as eager ones do
    #: (:func:`~flexpage.model.packed_linear.tiled_linear`); None: one call per projection
    row_tile: int | None
    qk_norm: bool  # Qwen3: RMSNorm over each head's dims before RoPE
    page_size: int
    pages_per_block: int
    recipe: Recipe
    kernel_options: tuple[tuple[str, object], ...]
    #: the dtype rows over gathered keys attend in (:func:`~flexpage.attention.flex.gathered_attention_dtype`)
    gathered_dtype: torch.dtype
    #: tensor parallelism: this rank's group (the graph holds its collectives), None: one process
    parallel: TensorParallel | None = None
    vocab_size: int = 0  # the LM head's real rows (padded for tensor parallelism)
    hidden: int = 0  # the embedding's columns (an embedding kept as GGUF blocks is uint8)


class CompiledStep:
    """Runs the steps of a :class:`CompactDecoder` through one compiled graph each."""

    def __init__(self, decoder: CompactDecoder, recipe: Recipe, pool: KVPool, pages_per_block: int, *,
                 deterministic: bool = False) -> None:
        """``deterministic``: steps planned with ``build_paged_batch(deterministic=True)``, run
        with the deterministic attention kernels and the decoder's row tiles (every projection
        of the decoder must have one): each row's logits are the same bits in any step."""
        if not torch_patches.install().active:
            raise RuntimeError("the compiled step needs flexpage's Inductor patches (torch_patches.install())")
        self.decoder = decoder
        linears = [linear for layer in decoder.layers for linear in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        linears.append(decoder.lm_head)
        # projections kept as GGUF blocks run the block kernel whatever the others do
        packed = {linear.packed for linear in linears if linear.blocks is None} or {True}
        if len(packed) != 1:
            raise ValueError("the compiled step needs every projection packed, or none")
        row_tiles = {linear.row_tile for linear in linears}
        if len(row_tiles) != 1 or (None in row_tiles) == deterministic:
            raise ValueError(f"deterministic={deterministic} needs {'every' if deterministic else 'no'} projection "
                             f"row-tiled; got row tiles {sorted(row_tiles, key=str)}")
        options = kernel_options_for(pool.device, None, deterministic=deterministic)
        self.shape = _Shape(
            heads=decoder.num_heads, kv_heads=decoder.num_kv_heads, head_dim=decoder.head_dim, eps=decoder.eps,
            scale=decoder.scale, packed=packed.pop(), row_tile=row_tiles.pop(),
            qk_norm=decoder.layers[0].q_norm is not None,
            page_size=pool.block_size, pages_per_block=pages_per_block, recipe=recipe,
            kernel_options=tuple(sorted(options.items())),
            gathered_dtype=gathered_attention_dtype(decoder.final_norm.dtype, pool.device, deterministic),
            parallel=decoder.parallel, vocab_size=decoder.vocab_size, hidden=decoder.hidden_size,
        )
        self.layer_weights = tuple(
            (layer.input_norm, *_weights(layer.qkv), layer.q_norm, layer.k_norm, *_weights(layer.o),
             layer.post_norm, *_weights(layer.gate_up), *_weights(layer.down))
            for layer in decoder.layers
        )
        # (K, V) per layer; an int8 pool's (K, V, key scale, value scale)
        self.layer_pools = tuple((*pool.layer(i), *(pool.layer_scales(i) or ())) for i in range(len(decoder.layers)))
        self.head = (decoder.final_norm, *_weights(decoder.lm_head))
        self.embed = decoder.embed if decoder.embed_blocks is None else decoder.embed_blocks
        #: what the graph specialises on in the weights and pools, whose tensors it does not guard
        self.layout = _layout((self.layer_weights, self.layer_pools, self.head))
        # steps of up to this many rows read the projections' blocks (bf16 models that keep both)
        self._block_rows = MAX_BLOCK_ROWS if any(l.blocks is not None and l.weight is not None for l in linears) else 0
        self.steps_run = 0  # steps this object ran (tests and profiles read it)

    @staticmethod
    def accepts(batch: PagedBatch) -> bool:
        """True for a step this graph runs: at most one group of decode rows and one of prefill
        rows, as the engine plans them."""
        kinds = [_kind(group) for group in batch.groups]
        return len(kinds) == len(set(kinds)) and None not in kinds

    @torch.no_grad()
    def __call__(self, token_ids: Tensor, positions: Tensor, sample_rows: Tensor, batch: PagedBatch) -> Tensor:
        """Logits ``[len(sample_rows), vocab]`` (model dtype) of the step ``batch``."""
        program, args, dynamic = self._program_and_arguments(token_ids, positions, sample_rows, batch)
        self.steps_run += 1
        return program(args, dynamic)[: sample_rows.shape[0]]

    def ahead_of_time(self, token_ids: Tensor, positions: Tensor, sample_rows: Tensor,
                      batch: PagedBatch) -> Callable[[], None] | None:
        """A function that compiles and saves the program a step like ``batch`` runs, without
        running it (:mod:`flexpage.model.compile_ahead`); None where there is nothing to do
        ahead: the program is saved already, or is not saved at all (tensor parallelism)."""
        program, args, dynamic = self._program_and_arguments(token_ids, positions, sample_rows, batch)
        if not isinstance(program, SavedProgram) or program.is_saved():
            return None
        return functools.partial(program.compile_and_save, args, dynamic)

    def _program_and_arguments(self, token_ids: Tensor, positions: Tensor, sample_rows: Tensor, batch: PagedBatch,
                               ) -> tuple[Program, list, list[tuple[Tensor, int]]]:
        """The program of the step ``batch``, its arguments and their sizes that vary by step."""
        tokens, sampled = token_ids.shape[0], sample_rows.shape[0]
        rows = self._padded_rows(tokens)
        token_ids = F.pad(token_ids, (0, rows - tokens))
        positions = F.pad(positions, (0, rows - tokens))
        sample_rows = F.pad(sample_rows, (0, self._padded_rows(sampled) - sampled))
        cos, sin = self.decoder.rope_tables(positions)
        # the K/V rows to write and their slots, at least two (a lone token's written twice)
        kv_rows = _at_least_two(torch.arange(tokens))
        step_inputs = [token_ids, cos, sin, _at_least_two(batch.slots), kv_rows, sample_rows]
        dynamic = [(t, 0) for t in step_inputs]
        # the rows before the padding, for the projections that compute from blocks
        valid = [torch.tensor(tokens), torch.tensor(sampled)]
        groups = batch.groups
        if self.shape.row_tile is None and [_kind(g) for g in groups] == ["prefill"]:
            groups = (idle_decode_group(batch), *groups)  # the mixed steps' program: one fewer to compile
        plan: list[Tensor] = []
        for group in groups:
            plan.extend(_PLANS[_kind(group)](group, dynamic))  # type: ignore[index]
        program = _program(self.shape, tuple((_kind(g), g.q_block, g.kv_block) for g in groups), self.layout)
        args = [self.embed, self.layer_weights, self.layer_pools, self.head, *step_inputs, *valid, *plan]
        return program, args, dynamic

    def _padded_rows(self, rows: int) -> int:
        """The rows a projection computes for ``rows`` inputs: the packed linears' bucket (one
        oneDNN kernel per bucket), whole row tiles, or (at least two of) the rows themselves where
        the projections read their blocks (whose work grows with every row)."""
        tile = self.shape.row_tile
        if tile is not None:
            return -(-rows // tile) * tile
        return max(rows, 2) if rows <= self._block_rows else padded_rows(rows, self.decoder.lm_head.row_step)


def _weights(linear: PackedLinear) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """A projection's weight (None where it is kept as GGUF blocks), its blocks (or None) and its
    bias, as the graph takes them."""
    return linear.weight, linear.blocks, linear.bias


def _kind(group: AttentionGroup) -> str | None:
    if group.kv_start is None:  # pages of the pool through the page table
        return "decode" if group.q_len == 1 else None
    if group.kv_slots is not None:  # a gathered copy of the keys: decode rows too in deterministic plans
        return "gathered_decode" if group.q_len == 1 else "prefill"
    return "row_decode" if group.q_len == 1 else "row_prefill"  # the virtual layout's rows


# Every per-step size the graph sees is at least 2: Dynamo specialises sizes of 1, and each
# specialisation is one more graph to compile (~20 s each on 2 cores). Groups are padded with
# rows that attend to nothing (as bucketing pads them), prefill groups to two query blocks,
# and index lists of one entry repeat it (index_copy of equal values).
_MIN_SIZE = 2


def _pad_to(t: Tensor, dim: int, size: int) -> Tensor:
    """``t`` zero-padded along ``dim`` to ``size``."""
    missing = size - t.shape[dim]
    if missing <= 0:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim) + [0, missing]
    return F.pad(t, pad)


def _standard_strides(t: Tensor) -> Tensor:
    """``t`` with row-major strides, also along its dims of size 1 (numpy and ``F.pad`` give
    those different strides, and the graph's guards check them: one more graph each)."""
    return t.clone(memory_format=torch.contiguous_format) if t.dim() > 2 else t


def _at_least_two(index: Tensor) -> Tensor:
    """An index list of one entry as two copies of it (index_copy of equal values)."""
    return torch.cat((index,) * _MIN_SIZE) if index.shape[0] == 1 else index  # cat: a fifth of repeat's cost


def _decode_plan(group: AttentionGroup, dynamic: list[tuple[Tensor, int]]) -> list[Tensor]:
    """A decode group's per-step tensors; their sizes that vary between steps go to ``dynamic``
    (as :func:`flexpage.attention.flex._mark_dynamic_rows` marks them)."""
    rows = max(group.rows, _MIN_SIZE)
    row_tensors = [_standard_strides(_pad_to(t, 0, rows)) for t in (
        group.kv_num_blocks, group.kv_indices, group.full_kv_num_blocks, group.full_kv_indices, group.row_seq,
        group.block_table, group.q_start, group.seq_len, group.gather_index)]
    scatter_rows, scatter_tokens = _at_least_two(group.scatter_rows), _at_least_two(group.scatter_tokens)
    plan = [group.page_to_logical, *row_tensors, scatter_rows, scatter_tokens]
    dynamic.extend((t, 0) for t in plan[1:])
    dynamic.append((plan[6], 1))  # the block table: pages per row grow with the longest sequence
    return plan


def _row_decode_plan(group: AttentionGroup, dynamic: list[tuple[Tensor, int]]) -> list[Tensor]:
    """A virtual-layout decode group's per-step tensors (as :func:`_decode_plan`, with each
    row's first slot in place of the page table)."""
    rows = max(group.rows, _MIN_SIZE)
    plan = [_standard_strides(_pad_to(t, 0, rows)) for t in (
        group.kv_num_blocks, group.kv_indices, group.full_kv_num_blocks, group.full_kv_indices, group.row_seq,
        group.q_start, group.seq_len, group.kv_start, group.gather_index)]
    plan += [_at_least_two(group.scatter_rows), _at_least_two(group.scatter_tokens)]
    dynamic.extend((t, 0) for t in plan)
    return plan


def _prefill_plan(group: AttentionGroup, dynamic: list[tuple[Tensor, int]]) -> list[Tensor]:
    """A prefill group's per-step tensors (as :func:`flexpage.attention.flex._mark_dynamic_gathered`);
    the query gather comes as ``[rows, query length]``, which gives the graph both sizes. In
    the virtual layout (no gathered copy) the key slots are left out. Decode rows over gathered
    keys (deterministic plans) keep their query length of one: it is not a per-step size."""
    rows = max(group.rows, _MIN_SIZE)
    q_len = 1 if group.q_len == 1 else max(group.q_len, _MIN_SIZE * group.q_block)
    q_blocks = q_len // group.q_block
    blocks = [_standard_strides(_pad_to(_pad_to(t, 2, q_blocks), 0, rows)) for t in (
        group.kv_num_blocks, group.kv_indices, group.full_kv_num_blocks, group.full_kv_indices)]
    per_row = [_pad_to(t, 0, rows) for t in (group.row_seq, group.q_start, group.seq_len, group.kv_start)]
    gather = _pad_to(_pad_to(group.gather_index.view(group.rows, group.q_len), 1, q_len), 0, rows)
    # scatter_rows count in the flattened [rows, query length] gather: renumber for the new length
    scatter_rows = group.scatter_rows // group.q_len * q_len + group.scatter_rows % group.q_len
    keys = [group.kv_slots] if group.kv_slots is not None else []
    plan = [*blocks, *per_row, *keys, gather, _at_least_two(scatter_rows), _at_least_two(group.scatter_tokens)]
    varying = ((0, 2), (0, 2, 3), (0, 2), (0, 2, 3), (0,), (0,), (0,), (0,), *[(0,)] * len(keys), (0, 1), (0,), (0,))
    dynamic.extend((t, dim) for t, dims in zip(plan, varying) for dim in dims if t.shape[dim] > 1)
    return plan


_PLANS = {"decode": _decode_plan, "prefill": _prefill_plan, "gathered_decode": _prefill_plan,
          "row_decode": _row_decode_plan, "row_prefill": _prefill_plan}
_PLAN_SIZES = {"decode": 12, "prefill": 12, "gathered_decode": 12, "row_decode": 11, "row_prefill": 11}


@functools.cache
def _program(shape: _Shape, groups: tuple[tuple[str, int, int], ...], layout: tuple) -> Program:
    """The compiled step for one model shape, one set of attention groups ((kind, query block,
    key block) each) and one :func:`_layout` of weights and pools, shared by every runner of
    those: saved on disk for the next process (:mod:`flexpage.backends.cpu.saved_programs`), except
    under tensor parallelism (the graph holds the rank's process group) or where a constant
    cannot be named by its content."""
    return compiled_program(_forward(shape, groups), shape, groups, layout, unguarded=_UNGUARDED,
                            saved=shape.parallel is None)


#: the step's arguments whose tensors a saved program does not guard (checking the ~600 tensors
#: of 30 layers' weights and pools cost 300-500 us a step, 2-3% of a batch-1 decode, and
#: rebuilding their guards ~0.2 s per program at start-up; torch cannot save the guards of
#: oneDNN-packed weights at all): :func:`_layout` puts their shapes, strides and dtypes in the
#: program's key and in :func:`_program`'s cache key instead
_UNGUARDED = ("layer_weights", "layer_pools", "head")


def _layout(value: object) -> object:
    """``value``'s tensors by shape, strides and dtype (oneDNN's opaque ones by shape and dtype),
    in its nesting of tuples; None stays None."""
    if isinstance(value, tuple):
        return tuple(_layout(item) for item in value)
    if value is None:
        return None
    if value.is_mkldnn:
        return ("mkldnn", tuple(value.shape), value.dtype)
    return (tuple(value.shape), value.stride(), value.dtype, value.device.type)


def _forward(shape: _Shape, groups: tuple[tuple[str, int, int], ...]) -> Callable[..., Tensor]:
    """The step's forward for one model shape and one set of attention groups."""
    heads, kv_heads, dim = shape.heads, shape.kv_heads, shape.head_dim
    group_size = heads // kv_heads
    kernel_options = dict(shape.kernel_options)

    def linear(x: Tensor, weight: Tensor | None, blocks: Tensor | None, bias: Tensor | None, valid_rows: Tensor,
               ) -> Tensor:
        """``x @ weight.T + bias``; where from blocks, rows from ``valid_rows`` on (padding) are not computed."""
        if blocks is not None:
            if weight is None:
                return block_linear(x, blocks, bias, valid_rows)
            return block_or_packed_linear(x, blocks, weight, bias, valid_rows)
        if shape.row_tile is not None:
            return tiled_linear(x, weight, bias, shape.packed, shape.row_tile)
        if shape.packed:
            return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        return F.linear(x, weight, bias)

    def norm(x: Tensor, weight: Tensor) -> Tensor:
        return rms_norm(x, weight, shape.eps)

    def reduce(partial: Tensor) -> Tensor:  # row-parallel projections: sum the ranks' shares
        return partial if shape.parallel is None else shape.parallel.all_reduce(partial)

    def decode_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor, page_to_logical: Tensor, kv_num_blocks: Tensor,
                         kv_indices: Tensor, full_kv_num_blocks: Tensor, full_kv_indices: Tensor, row_seq: Tensor,
                         block_table: Tensor, q_start: Tensor, seq_len: Tensor, gather_index: Tensor,
                         scatter_rows: Tensor, scatter_tokens: Tensor) -> tuple[Tensor, Tensor]:
        """Decode rows over the pool in place, query heads packed into rows per kv head (as
        FlexRunner's decode path); returns (outputs of the real rows, their token indices)."""
        rows = gather_index.shape[0]
        q = q.index_select(0, gather_index).view(rows, kv_heads, group_size, dim)
        out = _group_attention(
            q, k_pool, v_pool, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, row_seq,
            block_table, q_start, seq_len, page_to_logical, shape.recipe, shape.page_size, shape.pages_per_block,
            1, group_size, True, shape.scale, kernel_options,
        )
        return out.reshape(rows, heads * dim).index_select(0, scatter_rows), scatter_tokens

    def row_decode_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor, kv_block: int, kv_num_blocks: Tensor,
                             kv_indices: Tensor, full_kv_num_blocks: Tensor, full_kv_indices: Tensor, row_seq: Tensor,
                             q_start: Tensor, seq_len: Tensor, kv_start: Tensor, gather_index: Tensor,
                             scatter_rows: Tensor, scatter_tokens: Tensor) -> tuple[Tensor, Tensor]:
        """Decode rows over their rows of the pool (virtual layout), query heads packed per kv head."""
        rows = gather_index.shape[0]
        q = q.index_select(0, gather_index).view(rows, kv_heads, group_size, dim)
        out = _gathered_group_attention(
            q, k_pool, v_pool, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, row_seq, q_start,
            seq_len, kv_start, shape.recipe, 1, kv_block, shape.scale, kernel_options, group_size,
        )
        return out.reshape(rows, heads * dim).index_select(0, scatter_rows), scatter_tokens

    def prefill_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor, q_block: int, kv_block: int,
                          kv_num_blocks: Tensor, kv_indices: Tensor, full_kv_num_blocks: Tensor,
                          full_kv_indices: Tensor, row_seq: Tensor, q_start: Tensor, seq_len: Tensor, kv_start: Tensor,
                          *keys_and_rows: Tensor) -> tuple[Tensor, Tensor]:
        """Prefill rows over a gathered copy of their keys (as FlexRunner's prefill path), or
        over their rows of the pool in place (virtual layout: no ``kv_slots``)."""
        *kv_slots, gather_index, scatter_rows, scatter_tokens = keys_and_rows
        rows, q_len = gather_index.shape
        q = q.index_select(0, gather_index.flatten())
        # decode rows over gathered keys (deterministic plans) pack query heads per kv head
        heads_per_kv = group_size if q_len == 1 else 1
        q = q.view(rows, kv_heads, group_size, dim) if q_len == 1 else q.view(rows, q_len, heads, dim).transpose(1, 2)
        dtype, k, v = q.dtype, k_pool, v_pool
        if kv_slots:
            q = q.to(shape.gathered_dtype)
            k = k_pool[0].index_select(1, kv_slots[0])[None].to(shape.gathered_dtype)
            v = v_pool[0].index_select(1, kv_slots[0])[None].to(shape.gathered_dtype)
        out = _gathered_group_attention(
            q, k, v, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, row_seq, q_start, seq_len,
            kv_start, shape.recipe, q_block, kv_block, shape.scale, kernel_options, heads_per_kv,
        ).to(dtype)
        out = out.reshape(rows, heads * dim) if q_len == 1 else out.transpose(1, 2).reshape(rows * q_len, heads * dim)
        return out.index_select(0, scatter_rows), scatter_tokens

    @torch.compiler.nested_compile_region
    def attention_inputs(hidden: Tensor, valid_rows: Tensor, cos: Tensor, sin: Tensor, input_norm: Tensor,
                         qkv_w: Tensor, qkv_blocks: Tensor | None, qkv_b: Tensor | None, q_norm: Tensor | None,
                         k_norm: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        rows = hidden.shape[0]
        qkv = linear(norm(hidden, input_norm), qkv_w, qkv_blocks, qkv_b, valid_rows)
        qk = qkv[:, : (heads + kv_heads) * dim].view(rows, heads + kv_heads, dim)
        if shape.qk_norm:
            qk = torch.cat((norm(qk[:, :heads], q_norm), norm(qk[:, heads:], k_norm)), 1)
        qk = qk * cos + qk.roll(dim // 2, -1) * sin
        v = qkv[:, (heads + kv_heads) * dim :].view(rows, kv_heads, dim)
        return qk[:, :heads].contiguous(), qk[:, heads:].contiguous(), v.contiguous()

    @torch.compiler.nested_compile_region
    def attention_and_mlp(hidden: Tensor, valid_rows: Tensor, q: Tensor, k_pool: Tensor, v_pool: Tensor, o_w: Tensor,
                          o_blocks: Tensor | None, o_b: Tensor | None, post_norm: Tensor, gate_up_w: Tensor,
                          gate_up_blocks: Tensor | None, gate_up_b: Tensor | None, down_w: Tensor,
                          down_blocks: Tensor | None, down_b: Tensor | None, value_scale: Tensor | None,
                          *plan: Tensor) -> Tensor:
        out = hidden.new_zeros(hidden.shape[0], heads * dim)  # padding rows attend to nothing
        start = 0
        for kind, q_block, kv_block in groups:
            group_plan = plan[start:start + _PLAN_SIZES[kind]]
            start += _PLAN_SIZES[kind]
            if kind == "decode":
                rows_out, tokens = decode_attention(q, k_pool, v_pool, *group_plan)
            elif kind == "row_decode":
                rows_out, tokens = row_decode_attention(q, k_pool, v_pool, kv_block, *group_plan)
            else:
                rows_out, tokens = prefill_attention(q, k_pool, v_pool, q_block, kv_block, *group_plan)
            out = out.index_copy(0, tokens, rows_out)
        if value_scale is not None:  # an int8 pool: the values' scales, folded out of the kernels
            out = scale_output(out.view(-1, heads, dim), value_scale).view(out.shape)
        hidden = hidden + reduce(linear(out, o_w, o_blocks, o_b, valid_rows))
        gate, up = linear(norm(hidden, post_norm), gate_up_w, gate_up_blocks, gate_up_b, valid_rows).chunk(2, -1)
        return hidden + reduce(linear(F.silu(gate) * up, down_w, down_blocks, down_b, valid_rows))

    def forward(embed: Tensor, layer_weights: tuple, layer_pools: tuple, head: tuple, token_ids: Tensor,
                cos: Tensor, sin: Tensor, slots: Tensor, kv_rows: Tensor, sample_rows: Tensor, valid_rows: Tensor,
                valid_samples: Tensor, *plan: Tensor) -> Tensor:
        if embed.dtype == torch.uint8:  # GGUF blocks
            hidden = embedding(token_ids, embed, shape.hidden)
        elif shape.parallel is None:
            hidden = F.embedding(token_ids, embed)
        else:
            hidden = shape.parallel.embed(token_ids, embed)
        for weights, (k_pool, v_pool, *kv_scales) in zip(layer_weights, layer_pools):
            (input_norm, qkv_w, qkv_blocks, qkv_b, q_norm, k_norm, o_w, o_blocks, o_b, post_norm, gu_w, gu_blocks, gu_b,
             down_w, down_blocks, down_b) = weights
            q, k, v = attention_inputs(hidden, valid_rows, cos, sin, input_norm, qkv_w, qkv_blocks, qkv_b, q_norm,
                                       k_norm)
            k, v = k.index_select(0, kv_rows), v.index_select(0, kv_rows)
            value_scale = None
            if kv_scales:  # an int8 pool (see the module docstring)
                key_scale, value_scale = kv_scales
                k, v, q = quantize(k, key_scale), quantize(v, value_scale), scale_queries(q, key_scale)
            # in place, on tensors that alias nothing else in the graph (see the module docstring)
            k_pool.index_copy_(2, slots, k.transpose(0, 1)[None])
            v_pool.index_copy_(2, slots, v.transpose(0, 1)[None])
            hidden = attention_and_mlp(hidden, valid_rows, q, k_pool, v_pool, o_w, o_blocks, o_b, post_norm, gu_w,
                                       gu_blocks, gu_b, down_w, down_blocks, down_b, value_scale, *plan)
        final_norm, lm_w, lm_blocks, lm_b = head
        logits = linear(norm(hidden[sample_rows], final_norm), lm_w, lm_blocks, lm_b, valid_samples)
        if shape.parallel is None:
            return logits
        return shape.parallel.gather_columns(logits)[:, : shape.vocab_size]

    return forward
