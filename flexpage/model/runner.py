"""The model runner: one forward pass over a flat token batch with paged KV.

Two ways to run the layers around attention (``model_impl``, as in vLLM):

* ``"flexpage"``: Llama-family models (Llama, Mistral, Qwen2, Qwen3) run through
  :class:`~flexpage.model.compact.CompactDecoder`, the same arithmetic as HF's modules with
  fused projections and far fewer ops (SmolLM2's batch-64 decode step: see
  docs/throughput-benchmark.md);
* ``"transformers"``: HF's own modules compute everything but attention (embeddings,
  RoPE, MLPs, norms: whatever the architecture needs); their attention call lands in
  :func:`paged_attention_forward` (registered as ``attn_implementation="flexpage_paged"``).
  The per-step state travels as an explicit keyword argument (``flexpage_step``) through
  HF's ``**kwargs`` plumbing.

``"auto"`` (the default) takes the compact path where it exists. Either way the attention
call writes the new K/V into the pool and runs the paged FlexAttention program, and the
step's state is passed explicitly -- no globals, so a sharded runner per process needs no
rewrite.

The batch is flat: ``T`` token ids hold every scheduled token of every sequence (HF's
modules get them as ``input_ids [1, T]``, ``position_ids [1, T]``), with their logical
positions; only the rows that sample a token go through the LM head (``sample_rows``,
HF's ``logits_to_keep``).

Layer groups (see :mod:`flexpage.core.layer_groups`): layers are grouped by attention
kind (full / sliding window) into groups of equal size ``S``; the pool stores ``S`` layers
per block and each group has its own block table per sequence. Layer ``l`` of group ``g``
(``j``-th in it) writes and reads pool layer slot ``j`` through group ``g``'s tables, so a
block id serves one group at a time and a sliding group's released pages (the null block
in its tables) are simply never visited. A model with one kind of layer has one group of
every layer: one table, a pool of all layers, as before.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import chain, groupby

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from flexpage.backends.cpu import torch_patches
from flexpage.attention.flex import (
    FlexRunner, check_deterministic_supported, deterministic_decode_in_place, raised_compile_limits,
)
from flexpage.attention.kv_pool import KVPool, block_slots
from flexpage.attention.kv_quant import storage_dtype
from flexpage.attention.paging import PagedBatch, build_paged_batch, next_power_of_two, token_positions
from flexpage.attention.recipe import Recipe, offset_heads
from flexpage.attention.step_plans import StepPlans
from flexpage.config import MODEL_IMPLS
from flexpage.core.kv_ops import BlockOp, BlockOpKind
from flexpage.core.layer_groups import LayerGroup, plan_layer_groups
from flexpage.core.scheduler_output import StepInputs
from flexpage.features import check_features
from flexpage.model import gguf_linear
from flexpage.model.compact import CompactDecoder, supports
from flexpage.model.compiled_step import CompiledStep
from flexpage.model.int8_weights import int8_blocks
from flexpage.model.kv_calibration import calibrate_kv_scales
from flexpage.model.layer_recipes import model_recipes, recipe_for
from flexpage.model.packed_linear import tiled_rows
from flexpage.model.sharding import shard_llama
from flexpage.model.tensor_parallel import TensorParallel

IMPLEMENTATION_NAME = "flexpage_paged"
#: rows per projection call in deterministic mode (see ModelRunner): every call the same
#: shape, so every row is summed by the same kernel
DETERMINISTIC_ROW_TILE = 64


@dataclass
class PagedStep:
    """The per-step context every attention layer reads (passed as ``flexpage_step``)."""

    pool: KVPool
    block_tables: Tensor
    seq_lens: Tensor
    query_lens: Tensor
    compile: bool
    pages_per_block: int = 1
    #: plan and run attention so that a row's output does not depend on the batch (see ModelRunner)
    deterministic: bool = False
    #: every layer's recipe; ``recipes_from_model``: the model's own (HF's attention kwargs must
    #: ask for exactly these), not a user's replacement
    recipes: tuple[Recipe, ...] = ()
    recipes_from_model: bool = True
    #: keyed by recipe object (never by name: two instances of one parameterised recipe differ)
    batches: dict[tuple[Recipe, int], PagedBatch] = field(default_factory=dict)
    runners: dict[tuple[Recipe, float | None], FlexRunner] = field(default_factory=dict)
    #: layer groups: each group's tables (group 0's is ``block_tables``), and for each layer
    #: its group and its slot in the pool. Empty: one group of every layer (slot = layer).
    group_tables: tuple[Tensor, ...] = ()
    layer_group: tuple[int, ...] = ()
    layer_slot: tuple[int, ...] = ()
    evicted_pages: bool = False  # see StepInputs.evicted_pages
    #: every sequence's table is one row of consecutive blocks (the virtual layout)
    contiguous_rows: bool = False
    #: the runner's plans of earlier steps, which a decode step may carry forward (None: build each plan)
    plans: StepPlans | None = None

    def batch_for(self, recipe: Recipe, group: int = 0) -> PagedBatch:
        key = (recipe, group)
        if key not in self.batches:
            plan = build_paged_batch if self.plans is None else functools.partial(self.plans.plan, key)
            self.batches[key] = plan(
                self.group_tables[group] if group else self.block_tables, self.seq_lens, self.query_lens,
                page_size=self.pool.block_size, num_pages=self.pool.num_blocks, recipe=recipe,
                pages_per_block=self.pages_per_block, deterministic=self.deterministic,
                evicted_pages=self.evicted_pages, contiguous_rows=self.contiguous_rows,
                deterministic_in_place=deterministic_decode_in_place(self.pool.dtype, self.pool.device),
            )
        return self.batches[key]

    def recipe_of(self, layer: int, sliding_window: int | None, softcap: float | None) -> Recipe:
        """The recipe layer ``layer`` runs, given the window and soft cap HF's module passes.

        With the model's own recipes HF's arguments must ask for exactly the recipe the layer
        groups were planned from (a layer attending with another window than its group's would
        read released blocks): a config read wrong fails here. A user's recipe replaces them.
        """
        recipe = self.recipes[layer]
        if self.recipes_from_model and recipe_for(sliding_window, softcap) is not recipe:
            raise ValueError(
                f"layer {layer}: attends with sliding_window={sliding_window}, softcap={softcap}, but the "
                f"model's recipes give it {recipe.name} (the model config's layer kinds were read wrong)"
            )
        return recipe


def paged_attention_forward(
    module: torch.nn.Module,
    query: Tensor,  # [1, H, T, D]
    key: Tensor,  # [1, H_kv, T, D]
    value: Tensor,
    attention_mask: object,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    flexpage_step: PagedStep | None = None,
    **kwargs: object,
) -> tuple[Tensor, None]:
    if flexpage_step is None:
        raise ValueError("flexpage_step: got None; attn_implementation='flexpage_paged' runs only inside ModelRunner")
    recipe = flexpage_step.recipe_of(module.layer_idx, sliding_window, softcap)
    out = _attend(flexpage_step, module.layer_idx, recipe, scaling,
                  query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1))  # [T, H, D]
    return out[None], None


def _attend(step: PagedStep, layer: int, recipe: Recipe, scale: float | None, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Write this layer's new K/V ``[T, H_kv, D]`` into the pool, then attend with ``q`` ``[T, H, D]``."""
    batch = step.batch_for(recipe, step.layer_group[layer] if step.layer_group else 0)
    slot = step.layer_slot[layer] if step.layer_slot else layer
    k_pool, v_pool = step.pool.layer(slot)
    step.pool.write(slot, batch.slots, k, v)
    runner_key = (recipe, scale)
    if runner_key not in step.runners:
        step.runners[runner_key] = FlexRunner(recipe, compile=step.compile, scale=scale,
                                              deterministic=step.deterministic)
    return step.runners[runner_key](q, k_pool, v_pool, batch, step.pool.layer_scales(slot))


def _no_mask(*args: object, **kwargs: object) -> None:
    """Masks come from block tables inside the attention call; HF's mask step has nothing to do."""
    return None


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION_NAME, paged_attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION_NAME, _no_mask)


class ModelRunner:
    """Owns the model and the KV pool of one process; turns StepInputs into logits."""

    def __init__(self, model: torch.nn.Module, *, num_blocks: int, block_size: int, compile: bool = True,
                 num_host_blocks: int = 0, blocks_per_attention_block: int = 1, model_impl: str = "auto",
                 recipes: Sequence[Recipe] | None = None, deterministic: bool = False,
                 compile_step: bool = True, kv_layout: str = "paged",
                 parallel: TensorParallel | None = None, gguf_path: str | None = None,
                 int8_weights: bool = False, kv_cache_dtype: str = "auto",
                 kv_calibration_ids: Sequence[int] | None = None) -> None:
        """``recipes``: one per decoder layer (:func:`~flexpage.model.layer_recipes.engine_recipes`);
        None: the model's own (:func:`~flexpage.model.layer_recipes.model_recipes`).

        ``deterministic``: every token's logits are the same bits whatever else shares its steps,
        however its prompt was chunked and whether its prefix came from the cache. Projections
        run in calls of :data:`DETERMINISTIC_ROW_TILE` rows
        (:func:`~flexpage.model.packed_linear.tiled_rows`) and attention plans and kernels keep
        one summation order per row (``build_paged_batch(deterministic=True)``); norms,
        activations and the LM head's softmax already work row by row.

        ``compile_step``: steps of the compact forward run as one compiled graph each
        (:class:`~flexpage.model.compiled_step.CompiledStep`) where it applies: compiled,
        on the CPU, one layer group and one recipe for every layer (deterministic too: the
        graph runs the same row tiles and attention kernels).

        ``kv_layout``: ``"paged"``, or ``"virtual"``: the pool is reserved address space backed
        on first write (:class:`~flexpage.attention.virtual_arena.VirtualArena`), every block
        table is one row of consecutive blocks, and attention reads the rows in place
        (``build_paged_batch(contiguous_rows=True)``); :meth:`release` gives rows' memory back.

        ``parallel``: this process is one rank of a tensor-parallel group and keeps its share of
        the model (:func:`~flexpage.model.sharding.shard_llama`, on the compact forward) and
        of the pool: its KV heads, with the block tables every rank shares. Every rank must
        execute the same steps (:class:`~flexpage.executor.tensor_parallel.TensorParallelExecutor`).

        ``gguf_path``: the GGUF ``model`` was converted from. On the compact forward (not
        deterministic, one process), projections and the LM head it holds as Q4_1 or Q8_0 are
        computed from those blocks (:mod:`~flexpage.model.gguf_linear`): in float32 always, in
        bf16 where the CPU has AVX512-BF16 (on AMX CPUs for steps of a few rows).

        ``int8_weights``: quantise the projections and the LM head to int8 per output channel
        (:mod:`~flexpage.model.int8_weights`) and compute them with the same kernel; needs the
        compact forward, one process, not deterministic, and the kernel (x86 with AVX2).

        ``kv_cache_dtype``: ``"auto"`` (the model's dtype) or ``"int8"``: the pool holds 8-bit K/V
        (:mod:`~flexpage.attention.kv_quant`), its scales calibrated here by one forward over
        ``kv_calibration_ids`` (:mod:`~flexpage.model.kv_calibration`); needs the compact forward
        and one layer group.
        """
        if model_impl not in MODEL_IMPLS:
            raise ValueError(f"model_impl: got {model_impl!r}, expected one of {MODEL_IMPLS}")
        if model_impl == "flexpage" and not supports(model):
            raise ValueError(f"model_impl: 'flexpage' has no compact forward for model_type="
                             f"{model.config.model_type!r}; use 'auto' or 'transformers'")
        register()
        if compile:
            # Inductor's imports (~1 s), before the pool's pages are faulted in on a thread: beside it
            # they took 2-3x longer (both wait on the process's memory-map lock)
            torch_patches.install()
        config = model.config
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        num_heads = text_config.num_attention_heads
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // num_heads
        self.model = model
        self.model.set_attn_implementation(IMPLEMENTATION_NAME)
        self.current_step: PagedStep | None = None  # read by attention modules HF does not route kwargs to
        own = model_recipes(config)
        self.layer_recipes = own if recipes is None else tuple(recipes)
        if len(self.layer_recipes) != len(own):
            raise ValueError(f"recipes: got {len(self.layer_recipes)}, expected one per layer ({len(own)})")
        self.recipes_from_model = self.layer_recipes == own
        if config.model_type == "bloom":
            _route_bloom_attention(model, self)
        self.dtype = next(model.parameters()).dtype
        self.deterministic = deterministic
        if deterministic:
            check_deterministic_supported(compile)
            if kv_layout != "paged":
                check_features(("deterministic", "virtual"))
        row_tile = DETERMINISTIC_ROW_TILE if deterministic else None
        self.parallel = parallel
        if parallel is not None:
            check_parallel_supported(model, model_impl, deterministic)
            shard_llama(model, parallel.rank, parallel.size)
            heads_per_rank = num_heads // parallel.size
            self.layer_recipes = tuple(offset_heads(r, parallel.rank * heads_per_rank) for r in self.layer_recipes)
        compact = model_impl != "transformers" and supports(model)
        blocks = None
        if int8_weights:
            missing = self._block_kernel_missing(compact, row_tile, parallel)
            if missing is not None:
                raise ValueError(f"quantization: 'int8' needs {missing}")
            blocks = int8_blocks(model)
        elif gguf_path is not None and self._block_kernel_missing(compact, row_tile, parallel) is None:
            blocks = gguf_linear.gguf_blocks(gguf_path, model)
        self.compact = CompactDecoder(model, row_tile=row_tile, parallel=parallel, blocks=blocks) if compact else None
        if self.compact is None and row_tile is not None:
            _tile_linear_rows(model, row_tile)
        self.blocks_per_attention_block = blocks_per_attention_block
        self.layer_groups = layer_groups_for(self.layer_recipes)
        self._layer_group = [0] * text_config.num_hidden_layers
        self._layer_slot = [0] * text_config.num_hidden_layers
        for g, group in enumerate(self.layer_groups):
            for j, layer in enumerate(group.layers):
                self._layer_group[layer], self._layer_slot[layer] = g, j
        kv_dtype = storage_dtype(kv_cache_dtype, self.dtype)
        if kv_dtype == torch.int8:  # refused before the pool is claimed
            self._check_calibration(kv_calibration_ids)
        self.pool = KVPool(
            num_layers=len(self.layer_groups[0].layers),  # layers per block: one group's
            # whole attention blocks: the blocks past num_blocks are never handed out
            num_blocks=-(-num_blocks // blocks_per_attention_block) * blocks_per_attention_block,
            block_size=block_size,
            num_kv_heads=(self.compact.num_kv_heads if parallel is not None  # this rank's
                          else getattr(text_config, "num_key_value_heads", None) or num_heads),
            head_dim=head_dim,
            dtype=kv_dtype,
            layout=kv_layout,
        )
        if self.pool.quantized:
            self.pool.set_scales(calibrate_kv_scales(self.compact, kv_calibration_ids))
        self.compile = compile
        self.compiled_step = (
            CompiledStep(self.compact, self.layer_recipes[0], self.pool, blocks_per_attention_block,
                         deterministic=deterministic)
            if compile_step and compile and self.compact is not None
            and self.pool.device.type == "cpu" and len(self.layer_groups) == 1 and len(set(self.layer_recipes)) == 1
            and torch_patches.install().active else None
        )
        self._runners: dict[tuple[str, float | None], FlexRunner] = {}
        self._plans = StepPlans()  # decode steps carry the last plan forward (flexpage.attention.step_plans)
        # the host tier for preemption by swapping: same layout as the pool's slots
        self.num_host_blocks = num_host_blocks
        rows = self.pool.storage.shape[0] * 2 * self.pool.num_kv_heads
        self.host = torch.zeros(rows, num_host_blocks * block_size, head_dim, dtype=self.pool.dtype)

    def _check_calibration(self, token_ids: Sequence[int] | None) -> None:
        """Raise unless an int8 pool's scales can be calibrated over ``token_ids`` (see ``kv_cache_dtype``)."""
        if self.compact is None or len(self.layer_groups) > 1:
            raise ValueError("kv_cache_dtype: 'int8' needs the compact forward (a Llama-family model, model_impl "
                             "'auto' or 'flexpage') and one kind of attention layer (one layer group)")
        if not token_ids:
            raise ValueError("kv_calibration_ids: an int8 KV cache needs calibration token ids "
                             "(flexpage.model.kv_calibration.calibration_token_ids(tokenizer))")

    def _block_kernel_missing(self, compact: bool, row_tile: int | None,
                              parallel: TensorParallel | None) -> str | None:
        """The first thing computing projections from blocks (:mod:`~flexpage.model.gguf_linear`)
        needs and this runner lacks; None: nothing. The kernel is built only if all else is there."""
        if not compact:
            return "the compact forward (a Llama-family model, model_impl 'auto' or 'flexpage')"
        if parallel is not None:
            return "one process"
        if row_tile is not None:
            return "a non-deterministic engine"
        if self.dtype not in (torch.float32, torch.bfloat16):
            return "float32 or bfloat16 weights"
        if not gguf_linear.available():
            return "the block kernel (x86 with AVX2/FMA/F16C and a C++ compiler)"
        return None

    def execute(self, inputs: StepInputs) -> Tensor:
        """Forward the flat batch; returns float32 logits ``[len(sample_rows), vocab]``. The
        KV pool's pages are faulted in between steps, not beside them (:class:`~flexpage.attention.kv_pool.StepsFirst`)."""
        with self.pool.turns.step():
            return self._execute(inputs)

    @torch.no_grad()
    def _execute(self, inputs: StepInputs) -> Tensor:
        step, token_ids, positions, sample_rows = self._step(inputs)
        with raised_compile_limits():  # once per step, not per layer (see flexpage.attention.flex)
            if self.compiled_step is not None:
                batch = step.batch_for(self.layer_recipes[0])
                if self.compiled_step.accepts(batch):
                    return self.compiled_step(token_ids, positions, sample_rows, batch).float()
            if self.compact is not None:
                scale, recipes = self.compact.scale, self.layer_recipes

                def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
                    return _attend(step, layer, recipes[layer], scale, q, k, v)

                return self.compact.forward(token_ids, positions, sample_rows, attend).float()
            self.current_step = step
            try:
                out = self.model(input_ids=token_ids[None], position_ids=positions[None], use_cache=False,
                                 logits_to_keep=sample_rows, flexpage_step=step)
            finally:
                self.current_step = None
        return out.logits[0].float()

    def ahead_of_time(self, inputs: StepInputs) -> Callable[[], None] | None:
        """A function that compiles and saves the step program ``inputs`` would run, without
        running it (:meth:`CompiledStep.ahead_of_time`); None where there is none to compile:
        no compiled step, or its program for such steps is saved already."""
        if self.compiled_step is None:
            return None
        step, token_ids, positions, sample_rows = self._step(inputs)
        batch = step.batch_for(self.layer_recipes[0])
        if not self.compiled_step.accepts(batch):
            return None
        return self.compiled_step.ahead_of_time(token_ids, positions, sample_rows, batch)

    def _step(self, inputs: StepInputs) -> tuple[PagedStep, Tensor, Tensor, Tensor]:
        """The attention context of a step, its token ids, their positions and the sampled rows."""
        per_group = inputs.group_block_tables or [inputs.block_tables]
        if len(per_group) != len(self.layer_groups):
            raise ValueError(f"group_block_tables: {len(per_group)} groups, the model has {len(self.layer_groups)}")
        width = next_power_of_two(max(len(t) for g in per_group for t in g))
        group_tables = [_padded_tables(block_tables, width) for block_tables in per_group]
        multi = len(self.layer_groups) > 1
        step = PagedStep(
            pool=self.pool,
            block_tables=group_tables[0],
            group_tables=tuple(group_tables),
            layer_group=tuple(self._layer_group) if multi else (),
            layer_slot=tuple(self._layer_slot) if multi else (),
            recipes=self.layer_recipes,
            recipes_from_model=self.recipes_from_model,
            seq_lens=torch.tensor(inputs.seq_lens),
            query_lens=torch.tensor(inputs.query_lens),
            compile=self.compile,
            pages_per_block=self.blocks_per_attention_block,
            deterministic=self.deterministic,
            runners=self._runners,
            evicted_pages=inputs.evicted_pages,
            contiguous_rows=self.pool.layout == "virtual",
            plans=self._plans,
        )
        positions = torch.from_numpy(token_positions(np.asarray(inputs.seq_lens, dtype=np.int64),
                                                     np.asarray(inputs.query_lens, dtype=np.int64)))
        token_ids = torch.tensor(inputs.token_ids)
        sample_rows = torch.tensor(inputs.sample_rows, dtype=torch.long)
        return step, token_ids, positions, sample_rows

    def apply_block_ops(self, ops: list[BlockOp]) -> None:
        """Run a plan's block operations in order, each run of one kind as one batched copy
        (no op of a run reads another's destination; see :mod:`flexpage.core.kv_ops`)."""
        for kind, run in groupby(ops, key=lambda op: op.kind):
            pairs = [(op.src, op.dst) for op in run]
            if kind is BlockOpKind.SWAP_OUT:
                device, host = zip(*pairs)
                self.host[:, block_slots(host, self.pool.block_size)] = self.pool.read_blocks(list(device))
            elif kind is BlockOpKind.SWAP_IN:
                host, device = zip(*pairs)
                self.pool.write_blocks(list(device), self.host[:, block_slots(host, self.pool.block_size)])
            elif kind is BlockOpKind.COPY:
                self.pool.copy_blocks(pairs)
            else:  # RELEASE: the virtual layout gives freed rows' memory back (a no-op when paged)
                self.pool.release(pairs)


def check_parallel_supported(model: torch.nn.Module, model_impl: str, deterministic: bool) -> None:
    """Raise ValueError unless ``model`` can run tensor-parallel with these settings (the
    options' pairs: :mod:`flexpage.features`; here what the model adds)."""
    check_features(("tensor_parallel",) + (("transformers_impl",) if model_impl == "transformers" else ())
                   + (("deterministic",) if deterministic else ()))
    if not supports(model):
        raise ValueError(f"tensor parallelism runs on the compact forward (Llama, Mistral, Qwen2, Qwen3), not on "
                         f"model_type={model.config.model_type!r}")


def layer_groups_for(recipes: Sequence[Recipe]) -> tuple[LayerGroup, ...]:
    """The layer groups (one block table each) of layers running ``recipes``, by their declared
    window; see :mod:`flexpage.core.layer_groups`."""
    return plan_layer_groups([recipe.window for recipe in recipes])


def _tile_linear_rows(model: torch.nn.Module, row_tile: int) -> None:
    """Make every ``nn.Linear`` of an HF model compute ``row_tile`` rows per call (deterministic
    mode on HF's modules); the flat batch arrives as ``[1, tokens, features]``."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):

            def forward(x: Tensor, _module: torch.nn.Linear = module) -> Tensor:
                def matmul(rows: Tensor) -> Tensor:
                    return F.linear(rows, _module.weight, _module.bias)

                out = tiled_rows(matmul, x.reshape(-1, x.shape[-1]), row_tile)
                return out.view(*x.shape[:-1], _module.out_features)

            module.forward = forward


def _padded_tables(block_tables: list[list[int]], width: int) -> Tensor:
    """Block tables as one ``[rows, width]`` int32 tensor, padded with the null block 0."""
    lengths = np.fromiter((len(t) for t in block_tables), dtype=np.int64, count=len(block_tables))
    tables = np.zeros((len(block_tables), width), dtype=np.int32)
    tables[np.arange(width) < lengths[:, None]] = np.fromiter(chain.from_iterable(block_tables), dtype=np.int32,
                                                              count=int(lengths.sum()))
    return torch.from_numpy(tables)


def _route_bloom_attention(model: torch.nn.Module, runner: ModelRunner) -> None:
    """Bloom computes ALiBi inside its own attention module (not through AttentionInterface),
    and HF does not pass extra kwargs down to it: replace each module's forward with the
    layer's recipe (the model's: ALiBi), reading the step from the runner that owns this model."""
    for layer, block in enumerate(model.transformer.h):
        attention = block.self_attention

        def forward(hidden_states: Tensor, residual: Tensor, *args: object, _attn=attention, _layer=layer,
                    **kwargs: object) -> tuple[Tensor, None]:
            step = runner.current_step
            if step is None:
                raise ValueError("Bloom attention ran outside ModelRunner.execute (no paged step)")
            tokens = hidden_states.shape[1]
            fused = _attn.query_key_value(hidden_states).view(tokens, _attn.num_heads, 3, _attn.head_dim)
            q, k, v = (fused[:, :, i].contiguous() for i in range(3))
            out = _attend(step, _layer, step.recipes[_layer], _attn.inv_norm_factor, q, k, v)
            return _attn.dense(out.reshape(1, tokens, -1)) + residual, None

        attention.forward = forward
