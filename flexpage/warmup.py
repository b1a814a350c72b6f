"""Warm-up: run the engine through the steps a serving run meets, so no request pays for
compiling a kernel, building a matmul kernel or faulting the KV pool in.

It drives the engine with ordinary requests (as a client would) whose prompt lengths come
from the kernels' own buckets (:data:`~flexpage.attention.paging.PREFILL_BUCKET_LENGTHS`),
and, with tiers, measures what recomputing a block costs per token of context.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from flexpage.attention.paging import PREFILL_BUCKET_LENGTHS
from flexpage.core.scheduler_output import StepInputs
from flexpage.executor.local import LocalExecutor
from flexpage.model.compile_ahead import ForkedCompile, compile_in_child
from flexpage.sampling_params import SamplingParams

if TYPE_CHECKING:
    from flexpage.engine import LLMEngine

__all__ = ["warm_up"]

#: how long warm-up waits for a compile child once it needs its program (it then compiles it itself)
_COMPILE_CHILD_TIMEOUT_S = 60.0


def warm_up(engine: LLMEngine) -> float:
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

    It does not wait for the KV pool to be resident: its helper thread goes on faulting the
    pool's pages in (:class:`~flexpage.attention.kv_pool.KVPool`), seconds per GiB on a virtual
    machine that backs memory lazily (an 8 GiB pool: ~16 s on the 2-core EPYC Zen 4 VM), so a wait
    here would grow with ``kv_cache_memory``. ``LLM()`` waits for it; ``flexpage serve`` only
    when asked (``--wait-for-kv-pool``).
    """
    if engine.requests:
        raise ValueError(f"warm_up: the engine has {len(engine.requests)} unfinished requests; warm up an idle one")
    start = time.perf_counter()
    if engine.speculator is not None:
        engine.speculator.proposer.warm_up()
    if engine.executor.runner.compact is not None:
        engine.executor.runner.compact.prime(engine.config.max_num_batched_tokens, engine.config.max_num_seqs)

    def ids(first: int, count: int) -> list[int]:  # distinct token ids, valid for any vocabulary
        return [(first + j) % engine.vocab_size for j in range(count)]

    if engine.executor.runner.compiled_step is not None:  # a prefill, a decode and a mixed step
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        engine.add_request({"prompt_token_ids": ids(10, 5)}, params, "warmup-0")
        engine.add_request({"prompt_token_ids": ids(20, 40)}, params, "warmup-1")
        decode_ahead = _compile_decode_step_ahead(engine)
        engine.step()
        if decode_ahead is not None:  # its program saved, the decode step below reads it
            decode_ahead.join(timeout=_COMPILE_CHILD_TIMEOUT_S)
        engine.step()
        engine.add_request({"prompt_token_ids": ids(100, 30)}, params, "warmup-2")
        _run_to_completion(engine)
        engine.reset_prefix_cache()
        if engine.config.deterministic:
            _warm_up_gathered_decode(engine, ids)
        _measure_recompute_cost(engine)
        return time.perf_counter() - start
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    batches = [[n] for n in PREFILL_BUCKET_LENGTHS] + [[n, n] for n in PREFILL_BUCKET_LENGTHS] + [[5, 23, 40]]
    for b, lengths in enumerate(batches):
        for i, length in enumerate(lengths):
            engine.add_request({"prompt_token_ids": ids(10 + 7 * b + 3 * i, length)}, params, f"warmup-{b}-{i}")
        _run_to_completion(engine)
        # cached blocks of earlier batches would make sequences share key blocks (the mask's
        # ownership check): from an empty cache each sequence gets its own runs, as in serving
        engine.reset_prefix_cache()
    # Requests sharing a cached prefix block compile the kernels whose mask keeps its ownership
    # check (flexpage.attention.paging.PagedBatch.one_owner_per_block): for each length bucket, a
    # prefill joining a decoding request (one row each) and two prefills together (two rows).
    shared = ids(2000, engine.config.block_size)
    engine.add_request({"prompt_token_ids": [*shared, 1]}, params, "warmup-prefix")
    _run_to_completion(engine)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    for n in PREFILL_BUCKET_LENGTHS:
        # distinct per (length, request): a suffix must not hit blocks an earlier length cached
        suffixes = [ids(3000 + 200 * (4 * n + i), n) for i in range(4)]
        engine.add_request({"prompt_token_ids": shared + suffixes[0]}, params, f"warmup-shared-{n}-0")
        engine.step()
        engine.add_request({"prompt_token_ids": shared + suffixes[1]}, params, f"warmup-shared-{n}-1")
        _run_to_completion(engine)
        for i in (2, 3):
            engine.add_request({"prompt_token_ids": shared + suffixes[i]}, params, f"warmup-shared-{n}-{i}")
        _run_to_completion(engine)
    engine.reset_prefix_cache()
    _measure_recompute_cost(engine)
    return time.perf_counter() - start


def _compile_decode_step_ahead(engine: LLMEngine) -> ForkedCompile | None:
    """A child process compiling the decode steps' program while this one compiles the
    prefill steps' (:mod:`flexpage.model.compile_ahead`); None where that program is saved
    already, or the runner is not a paged one of this process."""
    runner = engine.executor.runner
    if type(engine.executor) is not LocalExecutor or runner.pool.layout != "paged" or runner.pool.num_blocks < 5:
        return None
    tables = [[1, 2], [3, 4]]  # two sequences two blocks long, each decoding a token
    inputs = StepInputs(token_ids=[1, 2], block_tables=tables, seq_lens=[engine.config.block_size + 1] * 2,
                        query_lens=[1, 1], sample_rows=[0, 1],
                        group_block_tables=[tables] * len(engine.layer_groups) if len(engine.layer_groups) > 1 else [])
    with torch.inference_mode():  # as steps run: the program's guards check it
        compile = runner.ahead_of_time(inputs)
    return None if compile is None else compile_in_child(torch.inference_mode()(compile))


def _measure_recompute_cost(engine: LLMEngine, chunk_blocks: int = 16, context_blocks: int = 128) -> None:
    """With tiers: time one chunk prefilled with no context and behind ``context_blocks``
    cached blocks (medians of 3), and let the retention value's cost grow with position at
    that measured slope instead of the FLOP estimate."""
    bs = engine.config.block_size
    chunk = min(chunk_blocks * bs, engine.config.max_num_batched_tokens) // bs * bs
    room = engine.block_manager.num_usable_blocks // len(engine.layer_groups) - 2 * chunk // bs - 1
    context = min(context_blocks, (engine.max_model_len // 2) // bs, room) * bs
    if engine.block_manager.tiers is None or context < bs or chunk < bs:
        return
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    prefix = [(1000 + j) % engine.vocab_size for j in range(context)]

    def prefill_seconds(prompt: list[int]) -> float:
        engine.add_request({"prompt_token_ids": prompt}, params)
        start = time.perf_counter()
        _run_to_completion(engine)
        return time.perf_counter() - start

    prefill_seconds(prefix)  # now cached: the next prompts compute only their last chunk
    behind, alone = [], []
    for r in range(3):
        fresh = [(20000 + r * chunk + j) % engine.vocab_size for j in range(chunk)]
        behind.append(prefill_seconds(prefix + fresh))
        alone.append(prefill_seconds([(t + 7919) % engine.vocab_size for t in fresh]))
    engine.reset_prefix_cache()
    ratio = statistics.median(behind) / statistics.median(alone)
    engine.recompute_cost_slope = max(0.0, ratio - 1.0) / (context + chunk / 2)


def _warm_up_gathered_decode(engine: LLMEngine, ids: Callable[[int, int], list[int]]) -> None:
    """Deterministic mode's two other graphs: decode rows read a gathered copy of their keys
    when one shares a cached prefix but not its run (``build_paged_batch(deterministic_in_place=)``),
    alone and beside a prefill."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    page = engine.config.block_size
    engine.add_request({"prompt_token_ids": ids(200, page + 4)}, params, "warmup-3")
    engine.step()  # its first block is full, computed and cached; the run goes on with the next
    engine.add_request({"prompt_token_ids": ids(200, page) + ids(300, 4)}, params, "warmup-4")
    engine.step()  # the sharer's own block lands in another run
    engine.step()  # decode rows, gathered
    engine.add_request({"prompt_token_ids": ids(400, 30)}, params, "warmup-5")
    _run_to_completion(engine)  # gathered decode rows beside a prefill
    engine.reset_prefix_cache()


def _run_to_completion(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()
