"""Engine configuration as one self-checking dataclass."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from flexpage.attention.kv_pool import KV_LAYOUTS
from flexpage.attention.kv_quant import KV_CACHE_DTYPES
from flexpage.core.kv_tiers import TIER_POLICIES
from flexpage.features import check_combination

DEFAULT_KV_CACHE_MEMORY = 1 << 30  # 1 GiB
# Pages of 8 tokens: the last, partly filled page of a sequence wastes half as much as with
# vLLM's 16 (KV utilisation 98.0% vs 95.8% on bench/throughput.py's workload), and small pages
# cost the kernel nothing because it reads aligned runs of pages as one key block.
# (the CLI and ServeSettings repeat this literal to keep ``flexpage --help`` import-free;
# tests/test_cli.py checks they agree)
DEFAULT_BLOCK_SIZE = 8


def default_attention_block_size(dtype: torch.dtype) -> int:
    """Tokens per attention key block when the config leaves it to the pool's dtype.

    float32 kernels read K/V with a per-block sgemm call, and 256-token blocks are 12-16%
    faster on long contexts than 128 (``bench/attention.py``, every fp32 row) and as fast on
    short ones (batch-64 decode of SmolLM2). The tuned bf16/fp16 kernels keep a decode row's
    packed query heads in registers, and there 128 is faster on short contexts (batch-64
    SmolLM2 decode step 143 vs 179 ms) and about even on long ones.
    """
    return 256 if dtype == torch.float32 else 128


def parse_size(text: str | int, name: str = "kv_cache_memory") -> int:
    """``"2GiB"``, ``"512MB"``, ``"1.5G"`` or a plain byte count -> bytes (``name``: the
    setting, for the error message)."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9.]+)\s*([kmgt]?)(i?b?)\s*", str(text), flags=re.IGNORECASE)
    if not match:
        raise ValueError(f"{name}: got {text!r}, expected a size such as '2GiB', '512MB' or a byte count")
    number, unit, _ = match.groups()
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[unit.lower()]
    return int(float(number) * scale)


def check_kv_budget(name: str, budget: object, block_size: int) -> int:
    """A KV budget in tokens: an int, a multiple of ``block_size`` and at least 3 blocks (the
    first block, the newest and one more are kept whatever the policy). Which engines take one
    is :mod:`flexpage.features`' business."""
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 3 * block_size or budget % block_size:
        raise ValueError(f"{name}: got {budget!r}, expected a multiple of the block size ({block_size}) "
                         f"of at least 3 blocks ({3 * block_size} tokens)")
    return budget


#: ``EngineConfig.model_impl`` values (vLLM's ``--model-impl``)
MODEL_IMPLS = ("auto", "flexpage", "transformers")
#: EngineConfig.quantization values
QUANTIZATIONS = ("auto", "none", "int8")


@dataclass(slots=True)
class EngineConfig:
    """What the engine is built with. ``None`` fields are derived from the model and machine."""

    model: str | None = None  # folder, .gguf, or None for SmolLM2-135M-Instruct
    dtype: str = "auto"
    block_size: int = DEFAULT_BLOCK_SIZE
    # tokens per attention key block: blocks are handed out in aligned runs this long, and the
    # kernel reads a run as one key block (it pays per key block visited; see BlockPool).
    # None: by dtype (default_attention_block_size)
    attention_block_size: int | None = None
    num_blocks: int | None = None  # overrides kv_cache_memory when set
    kv_cache_memory: int | str = DEFAULT_KV_CACHE_MEMORY
    swap_space: int | str = 0  # host-memory tier for preemption by swapping (bytes)
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"
    compile: bool = True
    # steps of Llama-family models run as one compiled graph (flexpage.model.compiled_step);
    # False: layer by layer (for comparison and debugging)
    compile_step: bool = True
    # how layers around attention run: "flexpage" (compact Llama-family forward),
    # "transformers" (HF's modules), "auto" (compact where the model has one); see ModelRunner
    model_impl: str = "auto"
    seed: int = 0
    # attention recipe(s) replacing the model's own: a Recipe ("module:attr", "path/file.py[:attr]")
    # for every layer, a {layer kind: recipe} mapping, or one per layer; None: the model's
    # (see flexpage.model.layer_recipes.RecipeChoice)
    recipe: Any = None
    # greedy tokens and logprobs the same bits whatever else is in the batch, however the
    # prompt is chunked, with or without a prefix-cache hit (vLLM's VLLM_BATCH_INVARIANT);
    # costs throughput: see ModelRunner and docs/deterministic.md
    deterministic: bool = False
    # KV tokens each sequence keeps per layer once its prompt is computed (PagedEviction: whole
    # blocks go, never the first or the newest); None keeps everything. A request's
    # SamplingParams.kv_budget overrides it. See flexpage.core.eviction and docs/kv-budget.md
    kv_budget_tokens: int | None = None
    # which blocks go: a policy name (flexpage.model.kv_eviction.EVICTION_POLICIES),
    # "module:attr" / "file.py[:attr]", or an EvictionPolicy. key_norm by default: on varied
    # text it keeps the blocks that matter more often than paged_eviction (docs/kv-budget.md)
    kv_eviction: Any = "key_norm"
    # tiers behind the prefix cache (Pensieve; flexpage.core.kv_tiers): host memory for blocks
    # the pool evicts (0: none), then optionally a disk directory; which entry goes first
    host_kv_bytes: int | str = 0
    disk_kv_dir: str | None = None
    disk_kv_bytes: int | str = 0
    kv_tier_policy: str = "retention"  # or "lru"
    # where K/V live (flexpage.attention.kv_pool.KV_LAYOUTS): "paged" (one pool of blocks claimed
    # up front; prefix sharing, copy-on-write) or "virtual" (vAttention: a reserved row of
    # max_model_len tokens per sequence that the OS backs page by page; shares nothing, so
    # prefix caching is turned off). See docs/kv-layouts.md
    kv_layout: str = "paged"
    # what the pool stores (flexpage.attention.kv_quant.KV_CACHE_DTYPES; vLLM's kv_cache_dtype):
    # "auto" (the model's dtype) or "int8" (8-bit K/V with static per-channel scales calibrated at
    # start-up: twice the tokens in kv_cache_memory, half the bytes read per step). docs/kv-cache-dtype.md
    kv_cache_dtype: str = "auto"
    # virtual layout: KV bytes in use at once (admission control); None: kv_cache_memory
    kv_resident_bytes: int | str | None = None
    # ranks that each hold 1/N of every layer and of the KV heads (flexpage.parallel; vLLM's
    # --tensor-parallel-size): spawned on this host, or started by torchrun (docs/scaling.md)
    tensor_parallel_size: int = 1
    # seconds a rank waits in a collective for a peer before the engine fails (a hung rank)
    tensor_parallel_timeout: float = 120.0
    # "auto": a GGUF model's Q4_1/Q8_0 projections and LM head are computed from their blocks
    # (flexpage.model.gguf_linear; same weights, a fifth of float32's bytes): always in float32,
    # in bf16 too where the CPU has AVX512-BF16 (on AMX CPUs for steps of up to 4 rows); "none":
    # the model's weights only; "int8": any Llama-family model's projections and LM head
    # quantised to int8 per output channel (flexpage.model.int8_weights), computed by the same kernel
    quantization: str = "auto"
    # speculative decoding (vLLM's speculative_config: a dict, its JSON text, or a
    # SpeculativeConfig; stored parsed): {"method": "ngram", "num_speculative_tokens": k,
    # "prompt_lookup_max": n, "prompt_lookup_min": m}; None: one token per step. docs/speculative.md
    speculative_config: Any = None

    def __post_init__(self) -> None:
        for name in ("block_size", "attention_block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if name == "attention_block_size" and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: got {value!r}, expected a positive int")
        if (self.attention_block_size is not None and self.attention_block_size % self.block_size
                and self.attention_block_size > self.block_size):
            raise ValueError(f"attention_block_size: got {self.attention_block_size}, expected a multiple of "
                             f"block_size={self.block_size}")
        if self.num_blocks is not None and (not isinstance(self.num_blocks, int) or self.num_blocks < 2):
            raise ValueError(f"num_blocks: got {self.num_blocks!r}, expected an int >= 2 (block 0 is reserved)")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 1):
            raise ValueError(f"max_model_len: got {self.max_model_len!r}, expected a positive int")
        if parse_size(self.kv_cache_memory) <= 0:
            raise ValueError(f"kv_cache_memory: got {self.kv_cache_memory!r}, expected a positive size")
        if parse_size(self.swap_space) < 0:
            raise ValueError(f"swap_space: got {self.swap_space!r}, expected a size >= 0")
        for name in ("deterministic", "compile", "compile_step"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: got {getattr(self, name)!r}, expected True or False")
        if self.model_impl not in MODEL_IMPLS:
            raise ValueError(f"model_impl: got {self.model_impl!r}, expected one of {MODEL_IMPLS}")
        if self.kv_budget_tokens is not None:
            check_kv_budget("kv_budget_tokens", self.kv_budget_tokens, self.block_size)
        for name in ("host_kv_bytes", "disk_kv_bytes"):
            if parse_size(getattr(self, name), name) < 0:
                raise ValueError(f"{name}: got {getattr(self, name)!r}, expected a size >= 0")
        if self.disk_kv_dir is not None and parse_size(self.host_kv_bytes) == 0:
            raise ValueError("disk_kv_dir: a disk tier needs host_kv_bytes > 0 (blocks reach disk through host memory)")
        if (self.disk_kv_dir is None) != (parse_size(self.disk_kv_bytes) == 0):
            raise ValueError(f"disk_kv_dir and disk_kv_bytes go together: got disk_kv_dir={self.disk_kv_dir!r}, "
                             f"disk_kv_bytes={self.disk_kv_bytes!r}")
        if self.kv_tier_policy not in TIER_POLICIES:
            raise ValueError(f"kv_tier_policy: got {self.kv_tier_policy!r}, expected one of {TIER_POLICIES}")
        self._check_kv_layout()
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: got {self.kv_cache_dtype!r}, expected one of {KV_CACHE_DTYPES}")
        self._check_tensor_parallel()
        self._check_speculative()
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization: got {self.quantization!r}, expected one of {QUANTIZATIONS}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode: got {self.preemption_mode!r}, expected 'recompute' or 'swap'")
        for name in ("enable_chunked_prefill", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: got {getattr(self, name)!r}, expected True or False")
        check_combination(self)  # which options combine: flexpage.features
        if self.kv_layout == "virtual":
            self.enable_prefix_caching = False  # a row is one sequence's: nothing to share

    def _check_kv_layout(self) -> None:
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout: got {self.kv_layout!r}, expected one of {KV_LAYOUTS}")
        if self.kv_resident_bytes is not None:
            if self.kv_layout != "virtual":
                raise ValueError("kv_resident_bytes: applies to kv_layout='virtual' (the paged pool's size is "
                                 "kv_cache_memory)")
            if parse_size(self.kv_resident_bytes, "kv_resident_bytes") <= 0:
                raise ValueError(f"kv_resident_bytes: got {self.kv_resident_bytes!r}, expected a positive size")

    def _check_speculative(self) -> None:
        from flexpage.speculative.config import SpeculativeConfig

        spec = self.speculative_config
        if isinstance(spec, str):
            spec = SpeculativeConfig.from_json(spec)
        elif spec is not None and not isinstance(spec, SpeculativeConfig):
            spec = SpeculativeConfig.from_dict(spec)
        self.speculative_config = spec

    def _check_tensor_parallel(self) -> None:
        size = self.tensor_parallel_size
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"tensor_parallel_size: got {size!r}, expected a positive int")
        timeout = self.tensor_parallel_timeout
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
            raise ValueError(f"tensor_parallel_timeout: got {timeout!r}, expected a positive number of seconds")

    def blocks_per_attention_block(self, dtype: torch.dtype) -> int:
        """KV blocks per attention key block (the allocator's run length) for a pool of ``dtype``."""
        tokens = self.attention_block_size or default_attention_block_size(dtype)
        return max(1, tokens // self.block_size)
