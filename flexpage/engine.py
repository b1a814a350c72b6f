"""The engine: requests in, tokens out, one scheduler step at a time.

``LLMEngine.add_request`` validates and queues; ``step`` runs one iteration (schedule ->
apply block copies/swaps -> forward -> sample -> append, stop checks, detokenise) and
returns the requests that progressed; ``abort`` frees a request's blocks at once.
"""

from __future__ import annotations

import itertools
import logging
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Union

import torch

from flexpage.backends.cpu.vec_isa_cache import probe_in_background
from flexpage.config import EngineConfig, check_kv_budget, parse_size
from flexpage.conversations import ConversationRegistry
from flexpage.core.block_manager import BlockManager
from flexpage.core.kv_tiers import KVTiers
from flexpage.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from flexpage.core.sequence import Sequence, SequenceStatus
from flexpage.errors import InvalidParameter
from flexpage.kv_view import kv_view
from flexpage.model.compile_ahead import ForkedCompile, compile_in_child
from flexpage.model.detokenizer import IncrementalDetokenizer
from flexpage.model.kv_eviction import block_scores, resolve_eviction_policy
from flexpage.model.kv_tier_storage import TierStorage
from flexpage.model.dtypes import default_dtype, parse_dtype
from flexpage.model.loader import gguf_source, load_hf_model, load_tokenizer, resolve_model_path
from flexpage.model.layer_recipes import engine_recipes
from flexpage.model.runner import ModelRunner, StepInputs, layer_groups_for
from flexpage.model.sampler import TokenHistory, make_generator, sample
from flexpage.model.tensor_parallel import RankFailure
from flexpage.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from flexpage.parallel.launch import WorkerSpec
from flexpage.parallel.leader import LeaderRunner, start_leader
from flexpage.sampling_params import SamplingParams

PromptInput = Union[str, list[int], dict[str, Any]]

log = logging.getLogger(__name__)


class _ForwardFailed(Exception):
    """The batched forward pass raised (the cause is chained); sampling never started."""


#: Prompt lengths whose prefill lands in each query-block bucket of the paged attention
#: (q_block 2, 4, 8, 16, 32 with one query block, and 32 with several).
_WARMUP_LENGTHS = (2, 3, 5, 9, 17, 33)
#: how long warm-up waits for a compile child once it needs its program (it then compiles it itself)
_COMPILE_CHILD_TIMEOUT_S = 60.0


@dataclass
class Request:
    """Engine-side state of one request: its samples' sequences, generators and outputs."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    seqs: list[Sequence] = field(default_factory=list)
    outputs: list[CompletionOutput] = field(default_factory=list)
    detokenizers: list[IncrementalDetokenizer] = field(default_factory=list)
    generators: list[torch.Generator | None] = field(default_factory=list)
    num_cached_tokens: int = 0
    first_token_time: float | None = None
    kv_budget: int | None = None
    block_size: int = 0
    conversation: str | None = None

    @property
    def finished(self) -> bool:
        return len(self.outputs) == self.params.n and all(o.finished for o in self.outputs)

    def to_output(self) -> RequestOutput:
        evicted = sum(seq.num_evicted_blocks for seq in self.seqs)
        metrics = RequestMetrics(self.arrival_time, self.first_token_time, self.kv_budget, evicted,
                                 evicted * self.block_size)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, list(self.outputs),
                             self.finished, self.num_cached_tokens, metrics)


class LLMEngine:
    """One model, one KV pool, one scheduler. Not thread-safe: drive it from one loop."""

    def __init__(self, config: EngineConfig | None = None, **kwargs: Any) -> None:
        self.config = config = config or EngineConfig(**kwargs)
        compile = config.compile and os.environ.get("FLEXPAGE_COMPILE", "1") != "0"
        if compile:
            probe_in_background()  # the compiled kernels' vector ISA, while the model loads
        path = resolve_model_path(config.model)
        dtype = default_dtype() if config.dtype == "auto" else parse_dtype(config.dtype)
        self.model_path = path
        self.dtype = dtype
        self.tokenizer = load_tokenizer(path)
        model = load_hf_model(path, dtype)
        text_config = model.config.get_text_config()
        self.max_model_len = config.max_model_len or min(getattr(text_config, "max_position_embeddings", 4096), 8192)
        self.vocab_size = text_config.vocab_size
        self.eos_token_ids = _eos_ids(model, self.tokenizer)
        #: every layer's attention recipe: the model's own, or the one the config names
        self.recipes = engine_recipes(config.recipe, model.config)
        # one block holds one layer group's layers (all layers unless windowed and full layers mix)
        self.layer_groups = layer_groups_for(self.recipes)
        #: which blocks a sequence over its KV budget gives up (see flexpage.core.eviction)
        self.eviction_policy = resolve_eviction_policy(config.kv_eviction)
        bytes_per_block = _kv_bytes_per_token(text_config, dtype, len(self.layer_groups[0].layers)) * config.block_size
        num_blocks = config.num_blocks or max(2, parse_size(config.kv_cache_memory) // bytes_per_block)
        run_length = config.blocks_per_attention_block(dtype)
        # the virtual layout: one row of max_model_len tokens (whole key blocks) per sequence and
        # layer group, in address space; num_blocks then caps the blocks in use, not the pool
        row_length = -(-self.max_model_len // (run_length * config.block_size)) * run_length
        virtual_rows = config.max_num_seqs * len(self.layer_groups) if config.kv_layout == "virtual" else 0
        if virtual_rows and config.kv_resident_bytes is not None:
            num_blocks = max(2, parse_size(config.kv_resident_bytes, "kv_resident_bytes") // bytes_per_block)
        gguf = gguf_source(path) if config.quantization == "auto" else None  # quantised blocks read from it
        runner_kwargs = dict(num_blocks=(virtual_rows + 1) * row_length if virtual_rows else num_blocks,
                             block_size=config.block_size, compile=compile,
                             num_host_blocks=parse_size(config.swap_space) // bytes_per_block,
                             blocks_per_attention_block=run_length, model_impl=config.model_impl,
                             deterministic=config.deterministic, compile_step=config.compile_step,
                             kv_layout=config.kv_layout,
                             gguf_path=None if gguf is None else str(gguf),
                             int8_weights=config.quantization == "int8")
        #: rank 0's runner of a tensor-parallel group (it keeps the other ranks in step), or the runner
        self.runner: ModelRunner | LeaderRunner
        if config.tensor_parallel_size > 1:
            spec = WorkerSpec(str(path), dtype, config.recipe, runner_kwargs,
                              prime_rows=(config.max_num_batched_tokens, config.max_num_seqs),
                              timeout_s=config.tensor_parallel_timeout)
            self.runner = start_leader(model, spec, self.recipes, config.tensor_parallel_size)
        else:
            self.runner = ModelRunner(model, recipes=self.recipes, **runner_kwargs)
        host_slots = parse_size(config.host_kv_bytes, "host_kv_bytes") // bytes_per_block
        #: the bytes of the tiers behind the prefix cache (None: no tiers)
        self.tier_storage = TierStorage(self.runner.pool, host_slots, config.disk_kv_dir) if host_slots else None
        # a disk entry is one safetensors file: the block plus a small header
        disk_slots = parse_size(config.disk_kv_bytes, "disk_kv_bytes") // (bytes_per_block + 4096)
        #: relative recompute cost per token of context before it: from FLOPs until warm_up measures it
        self.recompute_cost_slope = _flop_cost_slope(model, text_config)
        tiers = KVTiers(host_slots, disk_slots if host_slots else 0, policy=config.kv_tier_policy,
                        cost=self._recompute_cost)
        self.block_manager = BlockManager(
            num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching,
            num_host_blocks=self.runner.num_host_blocks, run_length=row_length if virtual_rows else run_length,
            group_windows=[group.window for group in self.runner.layer_groups], tiers=tiers,
            virtual_rows=virtual_rows,
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=max(config.max_num_batched_tokens,
                                           0 if config.enable_chunked_prefill else self.max_model_len),
                enable_chunked_prefill=config.enable_chunked_prefill,
                preemption_mode=config.preemption_mode,
                max_model_len=self.max_model_len,
            ),
            self.block_manager,
        )
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
        self._generator = torch.Generator().manual_seed(config.seed)
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "finished_requests": 0}
        self._failures: dict[str, str] = {}  # see take_failures
        #: per conversation id: turns and how much of their history the cache served
        self.conversations = ConversationRegistry()

    # -- requests ------------------------------------------------------------------
    def prepare_prompt(self, prompt: PromptInput) -> dict[str, Any]:
        """Tokenise and check one prompt without queueing it: ``{"prompt", "prompt_token_ids"}``."""
        text, token_ids = self._tokenize(prompt)
        if len(token_ids) >= self.max_model_len:
            raise InvalidParameter("prompt",
                f"prompt: {len(token_ids)} tokens, but max_model_len is {self.max_model_len} "
                "(the prompt plus at least one generated token must fit)"
            )
        return {"prompt": text, "prompt_token_ids": token_ids}

    def add_request(self, prompt: PromptInput, params: SamplingParams | None = None,
                    request_id: str | None = None, *, conversation_id: str | None = None,
                    cache_salt: str | None = None) -> str:
        """Validate and queue one request; raises ValueError before anything is scheduled.

        ``conversation_id``: the chat this turn belongs to (see :mod:`flexpage.conversations`);
        ``cache_salt``: share prefix-cache blocks only with requests of the same salt.
        """
        for name, value in (("conversation_id", conversation_id), ("cache_salt", cache_salt)):
            if value is not None and (not isinstance(value, str) or not value or len(value) > 256):
                raise InvalidParameter(name, f"{name}: got {value!r}, expected a non-empty string of at most 256 "
                                             "characters")
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidParameter("sampling_params",
                                   f"sampling_params: got {type(params).__name__}, expected SamplingParams")
        prepared = self.prepare_prompt(prompt)
        text, token_ids = prepared["prompt"], prepared["prompt_token_ids"]
        request_id = request_id if request_id is not None else str(next(self._request_ids))
        if request_id in self.requests:
            raise InvalidParameter("request_id", f"request_id: {request_id!r} is already in flight")
        kv_budget = self._kv_budget(params)
        request = Request(request_id, text, token_ids, params, time.monotonic(), kv_budget=kv_budget,
                          block_size=self.config.block_size, conversation=conversation_id)
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(token_ids)
        seq = Sequence(next(self._seq_ids), token_ids, max_tokens=max_tokens, request=request, num_samples=params.n,
                       kv_budget=kv_budget, cache_salt=cache_salt, conversation=conversation_id)
        self.scheduler.add(seq)
        self._attach_sample(request, seq)
        self.requests[request_id] = request
        self.counters["prompt_tokens"] += len(token_ids)
        return request_id

    def _kv_budget(self, params: SamplingParams) -> int | None:
        """The request's KV budget in tokens, checked against the block size; None: keep all."""
        if params.kv_budget is None:
            budget = self.config.kv_budget_tokens
        else:
            if self.config.tensor_parallel_size > 1:
                raise InvalidParameter("kv_budget", "kv_budget: not available with tensor_parallel_size > 1 yet")
            try:
                budget = check_kv_budget("kv_budget", params.kv_budget, self.config.block_size,
                                         self.config.deterministic)
            except ValueError as error:
                raise InvalidParameter("kv_budget", str(error)) from None
        return budget if self.eviction_policy.token_scores is not None else None

    def _tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self._tokenize(prompt["prompt"])
            raise InvalidParameter("prompt",
                                   f"prompt: dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidParameter("prompt", "prompt: got an empty string")
            return prompt, self.tokenizer(prompt, add_special_tokens=True).input_ids
        if isinstance(prompt, (list, tuple)):
            return None, self._check_ids(prompt)
        raise InvalidParameter("prompt",
                               f"prompt: got {type(prompt).__name__}, expected str, list of token ids or dict")

    def _check_ids(self, ids: Any) -> list[int]:
        if not isinstance(ids, (list, tuple)) or not ids:
            raise InvalidParameter("prompt_token_ids",
                                   f"prompt_token_ids: got {ids!r}, expected a non-empty list of ints")
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise InvalidParameter("prompt_token_ids",
                                       f"prompt_token_ids: got {t!r}, expected ints in [0, {self.vocab_size})")
        return list(ids)

    def _attach_sample(self, request: Request, seq: Sequence) -> None:
        index = len(request.outputs)
        request.seqs.append(seq)
        request.outputs.append(CompletionOutput(index, logprobs=[] if request.params.logprobs is not None else None))
        request.detokenizers.append(IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                                           request.params.skip_special_tokens))
        seed = request.params.seed
        request.generators.append(make_generator(seed + index) if seed is not None else None)

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free all its blocks; False if it is unknown or done."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        for seq, out in zip(request.seqs, request.outputs):
            if not out.finished:
                self.scheduler.abort(seq.seq_id)
                out.finish_reason = "abort"
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def warm_up(self) -> float:
        """Compile the attention variants a serving run meets, and build the matmul kernels of
        every row bucket (:meth:`CompactDecoder.prime`), so no request pays for them; returns
        the seconds it took. Needs an idle engine; leaves it idle with an empty
        prefix cache (every block back in the pool).

        With the compiled step (``runner.compiled_step``) that is two graphs: a prefill-only
        step builds the one of steps with prefill rows (mixed steps run it too), a decode step
        the other (deterministic mode adds three: its prefill-only steps keep a graph of their
        own, and decode rows over a gathered copy of their keys, alone and beside a prefill).
        Otherwise, layer by layer:

        The compiled kernel specialises on the prefill query block and on one-row groups, so
        every length bucket runs once alone and once as a pair (each also decodes a token alone
        and in a pair), with and without a shared prefix. Compiled code is cached on disk
        (inductor, and the compiled steps whole), so later processes are quicker.

        It returns once the KV pool is resident (:meth:`KVPool.wait_until_resident`), so no
        request's step pays for faulting pool pages in.
        """
        if self.requests:
            raise ValueError(f"warm_up: the engine has {len(self.requests)} unfinished requests; warm up an idle one")
        start = time.perf_counter()
        if self.runner.compact is not None:
            self.runner.compact.prime(self.config.max_num_batched_tokens, self.config.max_num_seqs)

        def ids(first: int, count: int) -> list[int]:  # distinct token ids, valid for any vocabulary
            return [(first + j) % self.vocab_size for j in range(count)]

        if self.runner.compiled_step is not None:  # a prefill, a decode and a mixed step
            params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
            self.add_request({"prompt_token_ids": ids(10, 5)}, params, "warmup-0")
            self.add_request({"prompt_token_ids": ids(20, 40)}, params, "warmup-1")
            decode_ahead = self._compile_decode_step_ahead()
            self.step()
            if decode_ahead is not None:  # its program saved, the decode step below reads it
                decode_ahead.join(timeout=_COMPILE_CHILD_TIMEOUT_S)
            self.step()
            self.add_request({"prompt_token_ids": ids(100, 30)}, params, "warmup-2")
            self._run_to_completion()
            self.reset_prefix_cache()
            if self.config.deterministic:
                self._warm_up_gathered_decode(ids)
            self._measure_recompute_cost()
            self.runner.pool.wait_until_resident()
            return time.perf_counter() - start
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        batches = [[n] for n in _WARMUP_LENGTHS] + [[n, n] for n in _WARMUP_LENGTHS] + [[5, 23, 40]]
        for b, lengths in enumerate(batches):
            for i, length in enumerate(lengths):
                self.add_request({"prompt_token_ids": ids(10 + 7 * b + 3 * i, length)}, params, f"warmup-{b}-{i}")
            self._run_to_completion()
            # cached blocks of earlier batches would make sequences share key blocks (the mask's
            # ownership check): from an empty cache each sequence gets its own runs, as in serving
            self.reset_prefix_cache()
        # Requests sharing a cached prefix block compile the kernels whose mask keeps its ownership
        # check (flexpage.attention.paging.PagedBatch.one_owner_per_block): for each length bucket, a
        # prefill joining a decoding request (one row each) and two prefills together (two rows).
        shared = ids(2000, self.config.block_size)
        self.add_request({"prompt_token_ids": [*shared, 1]}, params, "warmup-prefix")
        self._run_to_completion()
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        for n in _WARMUP_LENGTHS:
            # distinct per (length, request): a suffix must not hit blocks an earlier length cached
            suffixes = [ids(3000 + 200 * (4 * n + i), n) for i in range(4)]
            self.add_request({"prompt_token_ids": shared + suffixes[0]}, params, f"warmup-shared-{n}-0")
            self.step()
            self.add_request({"prompt_token_ids": shared + suffixes[1]}, params, f"warmup-shared-{n}-1")
            self._run_to_completion()
            for i in (2, 3):
                self.add_request({"prompt_token_ids": shared + suffixes[i]}, params, f"warmup-shared-{n}-{i}")
            self._run_to_completion()
        self.reset_prefix_cache()
        self._measure_recompute_cost()
        self.runner.pool.wait_until_resident()
        return time.perf_counter() - start

    def _compile_decode_step_ahead(self) -> ForkedCompile | None:
        """A child process compiling the decode steps' program while this one compiles the
        prefill steps' (:mod:`flexpage.model.compile_ahead`); None where that program is saved
        already, or the runner is not a paged one of this process."""
        runner = self.runner
        if not isinstance(runner, ModelRunner) or runner.pool.layout != "paged" or runner.pool.num_blocks < 5:
            return None
        tables = [[1, 2], [3, 4]]  # two sequences two blocks long, each decoding a token
        inputs = StepInputs(token_ids=[1, 2], block_tables=tables, seq_lens=[self.config.block_size + 1] * 2,
                            query_lens=[1, 1], sample_rows=[0, 1],
                            group_block_tables=[tables] * len(self.layer_groups) if len(self.layer_groups) > 1 else [])
        with torch.inference_mode():  # as steps run: the program's guards check it
            compile = runner.ahead_of_time(inputs)
        return None if compile is None else compile_in_child(torch.inference_mode()(compile))

    def _measure_recompute_cost(self, chunk_blocks: int = 16, context_blocks: int = 128) -> None:
        """With tiers: time one chunk prefilled with no context and behind ``context_blocks``
        cached blocks (medians of 3), and let the retention value's cost grow with position at
        that measured slope instead of the FLOP estimate."""
        bs = self.config.block_size
        chunk = min(chunk_blocks * bs, self.config.max_num_batched_tokens) // bs * bs
        room = self.block_manager.num_usable_blocks // len(self.layer_groups) - 2 * chunk // bs - 1
        context = min(context_blocks, (self.max_model_len // 2) // bs, room) * bs
        if self.block_manager.tiers is None or context < bs or chunk < bs:
            return
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        prefix = [(1000 + j) % self.vocab_size for j in range(context)]

        def prefill_seconds(prompt: list[int]) -> float:
            self.add_request({"prompt_token_ids": prompt}, params)
            start = time.perf_counter()
            self._run_to_completion()
            return time.perf_counter() - start

        prefill_seconds(prefix)  # now cached: the next prompts compute only their last chunk
        behind, alone = [], []
        for r in range(3):
            fresh = [(20000 + r * chunk + j) % self.vocab_size for j in range(chunk)]
            behind.append(prefill_seconds(prefix + fresh))
            alone.append(prefill_seconds([(t + 7919) % self.vocab_size for t in fresh]))
        self.reset_prefix_cache()
        ratio = statistics.median(behind) / statistics.median(alone)
        self.recompute_cost_slope = max(0.0, ratio - 1.0) / (context + chunk / 2)

    def _recompute_cost(self, position: int) -> float:
        """The tiers' cost of recomputing the block at logical index ``position`` (1.0: a block
        with no context before it)."""
        return 1.0 + (position + 0.5) * self.config.block_size * self.recompute_cost_slope

    def _warm_up_gathered_decode(self, ids: Callable[[int, int], list[int]]) -> None:
        """Deterministic mode's two other graphs: decode rows read a gathered copy of their keys
        when one shares a cached prefix but not its run (``build_paged_batch(deterministic_in_place=)``),
        alone and beside a prefill."""
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        page = self.config.block_size
        self.add_request({"prompt_token_ids": ids(200, page + 4)}, params, "warmup-3")
        self.step()  # its first block is full, computed and cached; the run goes on with the next
        self.add_request({"prompt_token_ids": ids(200, page) + ids(300, 4)}, params, "warmup-4")
        self.step()  # the sharer's own block lands in another run
        self.step()  # decode rows, gathered
        self.add_request({"prompt_token_ids": ids(400, 30)}, params, "warmup-5")
        self._run_to_completion()  # gathered decode rows beside a prefill
        self.reset_prefix_cache()

    def _run_to_completion(self) -> None:
        while self.has_unfinished_requests():
            self.step()

    # -- the step --------------------------------------------------------------------
    @torch.inference_mode()  # no autograd state on any tensor made in a step: 1-4% faster steps than no_grad
    def step(self) -> list[RequestOutput]:
        """One iteration; returns the requests that produced tokens or finished.

        A request whose own computation fails (an exception in the forward pass, sampling or
        stop handling) is aborted alone, its blocks freed, and named by :meth:`take_failures`;
        the rest of the step completes: when the batched forward pass fails, each sequence is
        run again on its own, so the one that fails alone is found.
        """
        self._release_free_rows()  # rows freed between steps (aborts), before anything writes there
        sched = self.scheduler.schedule()
        touched: dict[str, Request] = {}
        for seq in sched.finished:  # the scheduler gave up on a sequence that outgrew the pool
            self._finish(seq, SequenceStatus.FINISHED_LENGTH, touched, already_retired=True)
        self._apply_tier_ops()  # first: the other copies may reuse a block spilled here
        self.runner.apply_block_moves(sched.blocks_to_swap_out, sched.blocks_to_swap_in, sched.blocks_to_copy)
        if sched.scheduled:
            try:
                self._run(sched, touched)
            except _ForwardFailed as failure:
                if len(sched.scheduled) == 1:
                    self._fail(sched.scheduled[0].seq.request, failure.__cause__, touched)
                else:
                    for item in sched.scheduled:
                        self._run_alone(item, touched)
        self._release_free_rows()  # finished and preempted sequences' rows (swap-outs are read by now)
        return [r.to_output() for r in touched.values()]

    def _release_free_rows(self) -> None:
        """Virtual layout: give the memory of rows no sequence holds back to the OS."""
        rows = self.block_manager.take_released_rows()
        if rows:
            self.runner.release(rows)

    def _apply_tier_ops(self) -> None:
        ops = self.block_manager.take_tier_ops()
        if ops:
            self.tier_storage.apply(ops)  # type: ignore[union-attr]

    def reset_prefix_cache(self) -> int:
        """Forget every cached block, in the pool and in the tiers; returns the pool blocks dropped."""
        dropped = self.block_manager.reset_prefix_cache()
        self._apply_tier_ops()
        return dropped

    def close(self) -> None:
        """Release what outlives the process otherwise (the disk tier's files and lock, the
        other tensor-parallel ranks)."""
        if self.tier_storage is not None:
            self.tier_storage.close()
        if isinstance(self.runner, LeaderRunner):
            self.runner.close()

    def check_health(self) -> None:
        """Raise :class:`~flexpage.model.tensor_parallel.RankFailure` if a tensor-parallel rank has
        exited (a server calls it while idle, so a dead rank ends it without waiting for a request)."""
        if isinstance(self.runner, LeaderRunner):
            self.runner.check_health()

    def take_failures(self) -> dict[str, str]:
        """Requests :meth:`step` aborted because their own computation failed (id -> message),
        since the last call; each is reported once."""
        failures, self._failures = self._failures, {}
        return failures

    def _run(self, sched: SchedulerOutput, touched: dict[str, Request]) -> None:
        inputs = StepInputs([], [], [], [], [])
        sampled: list[Sequence] = []
        for item in sched.scheduled:
            seq = item.seq
            inputs.token_ids.extend(item.token_ids)
            seq_tables = self.block_manager.block_tables(seq)
            inputs.block_tables.append(seq_tables[0])
            if len(seq_tables) > 1:  # one table per layer group
                if not inputs.group_block_tables:
                    inputs.group_block_tables = [[] for _ in seq_tables]
                for tables, table in zip(inputs.group_block_tables, seq_tables):
                    tables.append(table)
            inputs.evicted_pages |= seq.num_evicted_blocks > 0
            inputs.seq_lens.append(item.start + item.num_new_tokens)
            inputs.query_lens.append(item.num_new_tokens)
            if item.sample:
                inputs.sample_rows.append(len(inputs.token_ids) - 1)
                sampled.append(seq)
        try:  # always run: a step of prefill chunks that samples nothing still computes their K/V
            logits = self.runner.execute(inputs)
        except RankFailure:  # not one request's fault, and no retry can help: the engine ends
            raise
        except Exception as error:
            raise _ForwardFailed from error
        self._score_full_blocks(sched)
        self.scheduler.mark_computed(sched)  # sequences over their KV budget evict blocks here
        self._apply_relocations()
        if sampled:
            self._sample(logits, sampled, touched)
            self._apply_relocations()  # n > 1 siblings fork there (the virtual layout copies)

    def _apply_relocations(self) -> None:
        relocations = self.block_manager.take_relocations()
        if relocations:
            self.runner.apply_block_moves([], [], relocations)

    def _score_full_blocks(self, sched: SchedulerOutput) -> None:
        """Score, with the eviction policy, the blocks of budgeted sequences this step filled."""
        bm, bs = self.block_manager, self.config.block_size
        for item in sched.scheduled:
            blocks = bm.blocks_to_score(item.seq, item.num_new_tokens)
            if not blocks:
                continue
            tables = bm.block_tables(item.seq)
            # a block's score reads every layer group that still holds it (a sliding group may not)
            holding = [table for table in tables if all(table[i] != bm.null_block_id for i in blocks)]
            if holding:
                scores = block_scores(self.runner.pool, self.eviction_policy,
                                      [[table[i] for i in blocks] for table in holding], [i * bs for i in blocks])
            else:
                scores = [block_scores(self.runner.pool, self.eviction_policy,
                                       [[table[i]] for table in tables if table[i] != bm.null_block_id], [i * bs])[0]
                          for i in blocks]
            bm.record_block_scores(item.seq, dict(zip(blocks, scores)))

    def _run_alone(self, item: Any, touched: dict[str, Request]) -> None:
        """Run one scheduled sequence of a step whose batched forward pass failed."""
        if item.seq.status is not SequenceStatus.RUNNING:  # its request failed already (n > 1)
            return
        try:
            self._run(SchedulerOutput(scheduled=[item]), touched)
        except _ForwardFailed as failure:
            self._fail(item.seq.request, failure.__cause__, touched)

    def _sample(self, logits: torch.Tensor, sampled: list[Sequence], touched: dict[str, Request]) -> None:
        rows, seqs = self._with_forked_samples(sampled)
        if len(rows) != len(sampled):  # n > 1 forked children share their parent's row
            logits = logits[rows]
        params = [s.request.params for s in seqs]
        histories = [TokenHistory(s.prompt_token_ids, s.output_token_ids) for s in seqs]
        generators = [self._generator_of(s) for s in seqs]
        eos = self.eos_token_ids[0] if self.eos_token_ids else None
        try:
            result = sample(logits, params, histories, generators, eos, generator=self._generator)
            picks = [(seq, token, result.logprobs[i] if result.logprobs else None)
                     for i, (seq, token) in enumerate(zip(seqs, result.token_ids.tolist()))]
        except Exception:  # find whose parameters broke it: sample row by row
            picks = []
            for i, seq in enumerate(seqs):
                try:
                    one = sample(logits[i : i + 1], params[i : i + 1], histories[i : i + 1], generators[i : i + 1],
                                 eos, generator=self._generator)
                except Exception as error:
                    self._fail(seq.request, error, touched)
                    continue
                picks.append((seq, one.token_ids.item(), one.logprobs[0] if one.logprobs else None))
        for seq, token, logprobs in picks:
            if seq.request.request_id not in self.requests:  # failed above (a sibling of n > 1)
                continue
            try:
                self._append(seq, token, logprobs, touched)
            except Exception as error:
                self._fail(seq.request, error, touched)

    def _fail(self, request: Request, error: BaseException | None, touched: dict[str, Request]) -> None:
        """Abort one request whose own computation raised; the engine keeps serving the others."""
        log.error("request %s failed in the engine step", request.request_id, exc_info=error)
        self.abort(request.request_id)
        touched.pop(request.request_id, None)
        self._failures[request.request_id] = f"internal engine error: {type(error).__name__}: {error}"

    def _with_forked_samples(self, sampled: list[Sequence]) -> tuple[list[int], list[Sequence]]:
        """The scheduler forks n > 1 requests' siblings (see ``Scheduler.fork_parallel_samples``);
        each new sibling becomes one more output of its request."""
        rows, seqs = [], []
        for row, seq in self.scheduler.fork_parallel_samples(sampled, lambda: next(self._seq_ids)):
            request: Request = seq.request
            if seq not in request.seqs:
                request.num_cached_tokens = seq.num_cached_tokens
                self._attach_sample(request, seq)
            rows.append(row)
            seqs.append(seq)
        return rows, seqs

    def _generator_of(self, seq: Sequence) -> torch.Generator | None:
        request: Request = seq.request
        return request.generators[request.seqs.index(seq)]

    def _append(self, seq: Sequence, token: int, logprobs: Any, touched: dict[str, Request]) -> None:
        request: Request = seq.request
        if request.request_id not in self.requests:
            return
        index = request.seqs.index(seq)
        out = request.outputs[index]
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()
            request.num_cached_tokens = max(request.num_cached_tokens, seq.num_cached_tokens)
        seq.append_token(token)
        self.counters["generation_tokens"] += 1
        out.token_ids.append(token)
        if logprobs is not None and out.logprobs is not None:
            out.logprobs.append(self._logprob_entry(logprobs))
        touched[request.request_id] = request
        params = request.params
        stop_token = self._stop_token(token, params, seq.num_output_tokens)
        if stop_token is None or not params.skip_special_tokens:
            out.text = request.detokenizers[index].append(token)
        else:
            request.detokenizers[index].append(token)
        stop_string = _find_stop(out.text, params.stop)
        if stop_token is not None:
            out.stop_reason = None if token in self.eos_token_ids else token
            self._finish(seq, SequenceStatus.FINISHED_STOPPED, touched)
        elif stop_string is not None:
            out.text = out.text[: out.text.index(stop_string)]
            out.stop_reason = stop_string
            self._finish(seq, SequenceStatus.FINISHED_STOPPED, touched)
        elif seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            self._finish(seq, SequenceStatus.FINISHED_LENGTH, touched)

    def _stop_token(self, token: int, params: SamplingParams, num_output: int) -> int | None:
        if num_output <= params.min_tokens and params.min_tokens:
            return None
        if token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos):
            return token
        return None

    def _logprob_entry(self, lp: Any) -> dict[int, Logprob]:
        entry = {tid: Logprob(value, rank + 1, self.tokenizer.decode([tid])) for rank, (tid, value) in enumerate(lp.top)}
        entry[lp.token_id] = Logprob(lp.logprob, lp.rank, self.tokenizer.decode([lp.token_id]))
        return entry

    def _finish(self, seq: Sequence, status: SequenceStatus, touched: dict[str, Request],
                already_retired: bool = False) -> None:
        request: Request = seq.request
        if not already_retired:
            self.scheduler.finish(seq, status)
        request.outputs[request.seqs.index(seq)].finish_reason = status.finish_reason
        touched[request.request_id] = request
        if request.finished:
            self.requests.pop(request.request_id, None)
            self.counters["finished_requests"] += 1
            if request.conversation is not None and status is not SequenceStatus.FINISHED_ABORTED:
                self.conversations.record_turn(request.conversation, len(request.prompt_token_ids),
                                               len(request.outputs[0].token_ids), request.num_cached_tokens,
                                               time.monotonic())

    # -- observability -----------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        """Counters the CLI summary and the server's /metrics export."""
        blocks = self.block_manager.stats()
        return {
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting) + len(self.scheduler.swapped),
            "kv_blocks_total": blocks.total - 1,
            "kv_blocks_used": blocks.used,
            "kv_blocks_free": blocks.free,
            "kv_blocks_cached": blocks.cached,
            "kv_utilization": self.kv_utilization(),
            "prefix_cache_queries": blocks.prefix_cache_queries,
            "prefix_cache_hits": blocks.prefix_cache_hits,
            "prefix_cache_hit_rate": blocks.prefix_cache_hits / max(1, blocks.prefix_cache_queries),
            "preemptions": self.scheduler.num_preemptions,
            "swapped_blocks": blocks.host_used,
            "released_window_blocks": blocks.released_window_blocks,
            "kv_evicted_blocks": blocks.evicted_budget_blocks,
            "kv_evicted_tokens": blocks.evicted_budget_blocks * self.config.block_size,
            # a token takes a slot in every layer group (sliding groups give theirs back later)
            "kv_capacity_tokens": (blocks.total - 1) * self.config.block_size // len(self.layer_groups),
            **self.tier_stats(),
            **self.counters,
        }

    def tier_stats(self) -> dict[str, float]:
        """The host and disk tiers behind the prefix cache (zeros without tiers)."""
        tiers = self.block_manager.tiers
        block_bytes = self.tier_storage.block_bytes if self.tier_storage is not None else 0
        t = tiers.stats() if tiers is not None else None
        size = self.config.block_size
        return {
            "kv_host_blocks_total": t.host_capacity if t else 0,
            "kv_host_blocks_used": t.host_used if t else 0,
            "kv_host_bytes_used": (t.host_used if t else 0) * block_bytes,
            "kv_disk_blocks_total": t.disk_capacity if t else 0,
            "kv_disk_blocks_used": t.disk_used if t else 0,
            "kv_disk_bytes_used": self.tier_storage.disk_bytes if self.tier_storage is not None else 0,
            "kv_spilled_tokens": (t.spilled_blocks if t else 0) * size,
            "kv_restored_host_tokens": (t.restored_host_blocks if t else 0) * size,
            "kv_restored_disk_tokens": (t.restored_disk_blocks if t else 0) * size,
            "kv_dropped_tokens": (t.dropped_blocks if t else 0) * size,
            "kv_released_tokens": (t.released_blocks if t else 0) * size,
            "kv_hole_recomputed_tokens": self.block_manager.num_hole_tokens,
            **{f"conversation_{name}": value for name, value in self.conversations.totals.items()},
        }

    def kv_view(self) -> dict[str, Any]:
        """The KV cache block by block, its tiers, conversations and requests (see flexpage.kv_view)."""
        return kv_view(self)

    def kv_utilization(self) -> float:
        """Token states stored / token slots allocated, over the blocks live sequences hold."""
        filled: dict[int, int] = {}
        size = self.config.block_size
        for seq in self.scheduler.running:
            for table in self.block_manager.block_tables(seq):
                for i, block in enumerate(table):
                    if block == 0:  # given back by a sliding-window group
                        continue
                    stored = min(size, max(0, seq.num_computed_tokens - i * size))
                    filled[block] = max(filled.get(block, 0), stored)
        return sum(filled.values()) / (len(filled) * size) if filled else 1.0


def _find_stop(text: str, stops: list[str]) -> str | None:
    hits = [(text.index(s), s) for s in stops if s in text]
    return min(hits)[1] if hits else None


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
