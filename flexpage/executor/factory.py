"""From an :class:`~flexpage.config.EngineConfig` to a running executor: load the model and
tokenizer, size the KV cache, build the runner, and pick one process or tensor parallel.

:func:`build_executor` returns the executor with what the engine must know of the model
(:class:`ModelInfo`) and of the KV cache's shape (:class:`KVSizing`, which the block
manager is built from).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from flexpage.attention.eviction import EvictionPolicy
from flexpage.attention.kv_quant import storage_dtype
from flexpage.attention.recipe import Recipe
from flexpage.backends.cpu import kernel_header
from flexpage.backends.cpu.vec_isa_cache import probe_in_background
from flexpage.config import EngineConfig, parse_size
from flexpage.core.layer_groups import LayerGroup
from flexpage.executor import Executor
from flexpage.executor.local import LocalExecutor
from flexpage.model.dtypes import default_dtype, parse_dtype
from flexpage.model.kv_calibration import calibration_token_ids
from flexpage.model.kv_eviction import resolve_eviction_policy
from flexpage.model.kv_tier_storage import TierStorage
from flexpage.model.layer_recipes import engine_recipes
from flexpage.model.loader import gguf_source, load_hf_model, load_tokenizer, resolve_model_path
from flexpage.model.runner import ModelRunner, layer_groups_for

__all__ = ["KVSizing", "ModelInfo", "build_executor"]


@dataclass(frozen=True)
class ModelInfo:
    """What the engine needs to know of the model it serves."""

    path: Any  # the HF folder (a converted GGUF's cache folder for the default model)
    dtype: torch.dtype
    tokenizer: Any
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    #: every layer's attention recipe: the model's own, or the one the config names
    recipes: tuple[Recipe, ...]
    #: one block holds one layer group's layers (all layers unless windowed and full layers mix)
    layer_groups: tuple[LayerGroup, ...]
    #: which blocks a sequence over its KV budget gives up (see flexpage.core.eviction)
    eviction_policy: EvictionPolicy
    #: attention FLOPs per token of context over the weights' FLOPs per token (see KVTiers' cost)
    flop_cost_slope: float


@dataclass(frozen=True)
class KVSizing:
    """The KV cache's shape in blocks, for the block manager."""

    num_blocks: int  # blocks the manager may hand out (the virtual layout: may hold at once)
    run_length: int  # blocks per allocation run (the virtual layout: per row)
    virtual_rows: int  # rows of the virtual layout (0: paged)
    num_host_blocks: int  # swap space for preemption by swapping
    host_slots: int  # the prefix cache's host tier
    disk_slots: int  # the prefix cache's disk tier
    bytes_per_block: int


def build_executor(config: EngineConfig) -> tuple[Executor, ModelInfo, KVSizing]:
    """Load ``config.model``, size its KV cache and start the executor that runs it
    (``FLEXPAGE_COMPILE=0`` in the environment runs attention eagerly, for debugging)."""
    compile = config.compile and os.environ.get("FLEXPAGE_COMPILE", "1") != "0"
    if compile:
        probe_in_background()  # the compiled kernels' vector ISA, while the model loads
        kernel_header.build_in_background()  # and then Inductor's precompiled header for them
    path = resolve_model_path(config.model)
    dtype = default_dtype() if config.dtype == "auto" else parse_dtype(config.dtype)
    tokenizer = load_tokenizer(path)
    model = load_hf_model(path, dtype)
    text_config = model.config.get_text_config()
    recipes = engine_recipes(config.recipe, model.config)
    info = ModelInfo(
        path=path, dtype=dtype, tokenizer=tokenizer,
        max_model_len=config.max_model_len or min(getattr(text_config, "max_position_embeddings", 4096), 8192),
        vocab_size=text_config.vocab_size, eos_token_ids=_eos_ids(model, tokenizer), recipes=recipes,
        layer_groups=layer_groups_for(recipes), eviction_policy=resolve_eviction_policy(config.kv_eviction),
        flop_cost_slope=_flop_cost_slope(model, text_config),
    )
    kv_dtype = storage_dtype(config.kv_cache_dtype, dtype)  # int8: twice the blocks in kv_cache_memory
    bytes_per_block = _kv_bytes_per_token(text_config, kv_dtype, len(info.layer_groups[0].layers)) * config.block_size
    num_blocks = config.num_blocks or max(2, parse_size(config.kv_cache_memory) // bytes_per_block)
    run_length = config.blocks_per_attention_block(dtype)
    # the virtual layout: one row of max_model_len tokens (whole key blocks) per sequence and
    # layer group, in address space; num_blocks then caps the blocks in use, not the pool
    row_length = -(-info.max_model_len // (run_length * config.block_size)) * run_length
    virtual_rows = config.max_num_seqs * len(info.layer_groups) if config.kv_layout == "virtual" else 0
    if virtual_rows and config.kv_resident_bytes is not None:
        num_blocks = max(2, parse_size(config.kv_resident_bytes, "kv_resident_bytes") // bytes_per_block)
    host_slots = parse_size(config.host_kv_bytes, "host_kv_bytes") // bytes_per_block
    # a disk entry is one safetensors file: the block plus a small header
    disk_slots = parse_size(config.disk_kv_bytes, "disk_kv_bytes") // (bytes_per_block + 4096) if host_slots else 0
    gguf = gguf_source(path) if config.quantization == "auto" else None  # quantised blocks read from it
    runner_kwargs = dict(num_blocks=(virtual_rows + 1) * row_length if virtual_rows else num_blocks,
                         block_size=config.block_size, compile=compile,
                         num_host_blocks=parse_size(config.swap_space) // bytes_per_block,
                         blocks_per_attention_block=run_length, model_impl=config.model_impl,
                         deterministic=config.deterministic, compile_step=config.compile_step,
                         kv_layout=config.kv_layout, gguf_path=None if gguf is None else str(gguf),
                         int8_weights=config.quantization == "int8", kv_cache_dtype=config.kv_cache_dtype,
                         kv_calibration_ids=calibration_token_ids(tokenizer) if kv_dtype == torch.int8 else None)
    eos = info.eos_token_ids[0] if info.eos_token_ids else None
    executor: Executor
    if config.tensor_parallel_size > 1:
        from flexpage.executor.tensor_parallel import start_leader  # torch.distributed only when asked for
        from flexpage.parallel.launch import WorkerSpec

        spec = WorkerSpec(str(path), dtype, config.recipe, runner_kwargs,
                          prime_rows=(config.max_num_batched_tokens, config.max_num_seqs),
                          timeout_s=config.tensor_parallel_timeout, kv_eviction=config.kv_eviction)
        executor = start_leader(model, spec, recipes, config.tensor_parallel_size,
                                eviction_policy=info.eviction_policy, eos_token_id=eos, seed=config.seed)
    else:
        runner = ModelRunner(model, recipes=recipes, **runner_kwargs)
        storage = TierStorage(runner.pool, host_slots, config.disk_kv_dir) if host_slots else None
        executor = LocalExecutor(runner, eviction_policy=info.eviction_policy, eos_token_id=eos, seed=config.seed,
                                 tier_storage=storage)
    sizing = KVSizing(num_blocks=num_blocks, run_length=row_length if virtual_rows else run_length,
                      virtual_rows=virtual_rows, num_host_blocks=executor.runner.num_host_blocks,
                      host_slots=host_slots, disk_slots=disk_slots, bytes_per_block=bytes_per_block)
    return executor, info, sizing


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    ids = model.generation_config.eos_token_id if model.generation_config is not None else None
    if ids is None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return []
    return [ids] if isinstance(ids, int) else list(ids)


def _flop_cost_slope(model: torch.nn.Module, text_config: Any) -> float:
    """Attention FLOPs per token of context over the weights' FLOPs per token: how much more a
    token costs to recompute per token before it (the estimate until it is measured)."""
    weights = sum(p.numel() for name, p in model.named_parameters() if "embed" not in name)
    heads = text_config.num_attention_heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
    return 4 * text_config.num_hidden_layers * heads * head_dim / (2 * weights)


def _kv_bytes_per_token(text_config: Any, dtype: torch.dtype, num_layers: int | None = None) -> int:
    heads = text_config.num_attention_heads
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
    num_layers = text_config.num_hidden_layers if num_layers is None else num_layers
    return 2 * num_layers * kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()
