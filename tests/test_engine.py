"""The engine, specified against Hugging Face transformers.

* Greedy decoding gives exactly the tokens HF ``generate(do_sample=False)`` gives for each
  prompt alone (fp32, no padding), for the default model and for tiny random-weight
  checkpoints of architectures with their own attention rules (sliding window, logit
  soft-capping, q/k norms, ALiBi) -- whatever the batch, pool size, preemption mode,
  chunking and block size.
* A prompt prefix shared by many requests is stored once and computed once.
* Abort frees a request's blocks at once; a bad request added while others run is
  rejected without disturbing them.
* After every test, every KV block is back in the pool (``kv_blocks_returned``).

Everything runs in float32 with eager attention (``compile=False``): tiny models step
faster eagerly than the kernels take to compile.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Iterator

import pytest
import torch

from engine_models import EOS_ID, SLIDING_WINDOW, VOCAB_SIZE, hf_greedy, load_reference, random_prompts
from flexpage import SamplingParams
from flexpage.core.kv_ops import BlockOpKind

pytestmark = pytest.mark.usefixtures("single_torch_thread", "kv_blocks_returned")

RAGGED_LENGTHS = (5, 17, 33, 60)
NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)


PROMPTS = random_prompts(RAGGED_LENGTHS)


def as_inputs(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


def tokens_of(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@contextlib.contextmanager
def recorded_steps(engine) -> Iterator[SimpleNamespace]:
    """Record each forward pass's per-sequence query lengths and every block move applied."""
    log = SimpleNamespace(query_lens=[], swapped_out=0, swapped_in=0, copied=0)
    runner = engine.runner
    execute, apply_ops = runner.execute, runner.apply_block_ops
    counts = {BlockOpKind.SWAP_OUT: "swapped_out", BlockOpKind.SWAP_IN: "swapped_in", BlockOpKind.COPY: "copied"}

    def execute_spy(inputs):
        log.query_lens.append(list(inputs.query_lens))
        return execute(inputs)

    def ops_spy(ops):
        for op in ops:
            if op.kind in counts:
                setattr(log, counts[op.kind], getattr(log, counts[op.kind]) + 1)
        return apply_ops(ops)

    runner.execute, runner.apply_block_ops = execute_spy, ops_spy
    try:
        yield log
    finally:
        del runner.execute, runner.apply_block_ops


@pytest.fixture(scope="module")
def hf_reference(tiny_model):
    """``hf_reference(kind)`` -> HF greedy continuations of ``PROMPTS`` (computed once per kind)."""
    cache: dict[str, list[list[int]]] = {}

    def get(kind: str) -> list[list[int]]:
        if kind not in cache:
            model = load_reference(tiny_model(kind))
            cache[kind] = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
        return cache[kind]

    return get


# --------------------------------------------------------------------------- HF equivalence


@pytest.mark.slow
def test_default_model_greedy_matches_hf(llm_factory, default_model_path):
    """SmolLM2-135M-Instruct (``LLM(model=None)``), text prompts of 5-60 tokens in one batch."""
    from transformers import AutoModelForCausalLM

    prompts = [
        "The capital of France is",
        "Here is a short story about a robot who learns to paint. It begins in a small workshop",
        "List three reasons why the sky appears blue during the day, and explain each of them in one "
        "sentence so that a ten year old child could understand the physics involved.",
        "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number, computed iteratively in O(n) time and "
        "O(1) memory, raising ValueError for negative inputs.\"\"\"\n    if n < 0:\n        raise ValueError(\"n must "
        "be >= 0\")\n    a, b = 0, 1\n    for _ in range(n):\n",
    ]
    llm = llm_factory(None, num_blocks=16)
    tokenizer = llm.get_tokenizer()
    outputs = llm.generate(prompts, GREEDY)

    lengths = [len(tokenizer(p).input_ids) for p in prompts]
    assert lengths[0] <= 8 and lengths[-1] >= 50, lengths
    model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32, local_files_only=True).eval()
    for prompt, out in zip(prompts, outputs):
        assert out.prompt == prompt
        assert out.prompt_token_ids == tokenizer(prompt).input_ids
        expected = hf_greedy(model, out.prompt_token_ids, NEW_TOKENS)
        assert out.outputs[0].token_ids == expected, prompt
        assert out.outputs[0].text == tokenizer.decode(expected, skip_special_tokens=True)
        assert out.finished and out.outputs[0].finish_reason == ("stop" if expected[-1] == EOS_ID else "length")


TINY_KINDS = ["llama", "mistral", "gemma2", "qwen2", "qwen3", "bloom"]


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_tiny_model_greedy_matches_hf(kind, tiny_model, llm_factory, hf_reference):
    """Ragged batch (5/17/33/60 tokens) on each architecture; windows (12) are shorter than most prompts."""
    llm = llm_factory(tiny_model(kind))
    outputs = llm.generate(as_inputs(PROMPTS), GREEDY)
    assert tokens_of(outputs) == hf_reference(kind)
    for prompt, out in zip(PROMPTS, outputs):
        assert out.prompt_token_ids == prompt and out.finished


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_tiny_model_greedy_matches_hf_through_hf_modules(kind, tiny_model, llm_factory, hf_reference):
    """``model_impl="transformers"``: HF's own layers around the paged attention (the path every
    non-Llama-family model takes) give the same tokens as the compact forward and as HF."""
    llm = llm_factory(tiny_model(kind), model_impl="transformers")
    assert llm.engine.runner.compact is None
    assert tokens_of(llm.generate(as_inputs(PROMPTS), GREEDY)) == hf_reference(kind)


@pytest.mark.parametrize(
    ("kind", "disabled"),
    [("mistral", {"sliding_window": 10_000}), ("gemma2", {"sliding_window": 10_000}),
     ("gemma2", {"attn_logit_softcapping": None})],
    ids=["mistral-window", "gemma2-window", "gemma2-softcap"],
)
def test_tiny_models_depend_on_their_attention_rules(kind, disabled, tiny_model, hf_reference):
    """Guard for the test above: without the window / soft cap HF itself answers differently,
    so matching HF means the engine really applies them."""
    assert max(RAGGED_LENGTHS) > SLIDING_WINDOW
    model = load_reference(tiny_model(kind), **disabled)
    assert [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS] != hf_reference(kind)


@pytest.mark.parametrize("kind", ["mistral", "gemma2"])
def test_sliding_window_layers_give_blocks_back(kind, tiny_model, llm_factory, hf_reference):
    """Window 12, blocks of 4: once a sequence's prefill is done, each sliding layer group holds
    at most ceil(12/4)+1 = 4 live blocks (the rest of its table is the null block 0), Gemma2's
    full-attention group holds every block, and the tokens are still HF's."""
    block_size = 4
    llm = llm_factory(tiny_model(kind), block_size=block_size, num_blocks=160)
    engine = llm.engine
    windows = [group.window for group in engine.runner.layer_groups]
    assert windows == ([SLIDING_WINDOW] if kind == "mistral" else [None, SLIDING_WINDOW])
    assert engine.block_manager.group_windows == tuple(windows)
    released = engine.stats()["released_window_blocks"]
    ids = [engine.add_request({"prompt_token_ids": p}, GREEDY) for p in PROMPTS]
    done: dict[str, list[int]] = {}
    bound = -(-SLIDING_WINDOW // block_size) + 1
    peak = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        for seq in engine.scheduler.running:
            assert len(engine.block_manager.block_tables(seq)) == len(windows)
            for window, table in zip(windows, engine.block_manager.block_tables(seq)):
                live = [b for b in table if b != 0]
                if window is None:
                    assert len(live) == len(table) >= -(-seq.num_computed_tokens // block_size)
                elif seq.num_uncomputed_tokens <= 1:  # prefill done: only the window is kept
                    assert len(live) <= bound, (seq, table)
                    assert table[: len(table) - len(live)] == [0] * (len(table) - len(live))  # leading nulls
                    peak = max(peak, len(table) - len(live))
    assert [done[i] for i in ids] == hf_reference(kind)
    assert peak >= 10  # the 60-token prompt dropped most of its sliding blocks
    assert engine.stats()["released_window_blocks"] > released


# --------------------------------------------------------------------------- pool pressure, chunking, block sizes


def _blocks(lengths: tuple[int, ...], block_size: int) -> int:
    return sum(-(-n // block_size) for n in lengths)


# Six ragged prompts in a pool two blocks smaller than their prompts need together: the
# decodes outgrow the pool whatever the block size, chunking or preemption mode, so
# somebody is always preempted (ignore_eos keeps the schedule independent of the tokens).
# The Mistral there has a window of 24: its sliding layers give blocks back (the longer
# sequences pass it), yet keep more than a window of 12 would, so the pool stays tight.
PRESSURE_LENGTHS = (5, 17, 33, 60, 9, 24)
PRESSURE_TOKENS = 16
PRESSURE_WINDOW = 24
PRESSURE_PROMPTS = random_prompts(PRESSURE_LENGTHS, seed=7)
PRESSURE_GREEDY = SamplingParams(temperature=0.0, max_tokens=PRESSURE_TOKENS, ignore_eos=True)


def pressure_pool(block_size: int) -> int:
    return 1 + _blocks(PRESSURE_LENGTHS, block_size) - 2


@pytest.fixture(scope="module")
def pressure_reference(tiny_model):
    model = load_reference(tiny_model("mistral", sliding_window=PRESSURE_WINDOW))
    return [hf_greedy(model, p, PRESSURE_TOKENS, stop_at_eos=False) for p in PRESSURE_PROMPTS]


CHUNKED = dict(enable_chunked_prefill=True, max_num_batched_tokens=16)
SWAP = dict(preemption_mode="swap", swap_space="1MiB")
POOL_CASES = [
    pytest.param(dict(preemption_mode="recompute", **CHUNKED), 16, id="recompute-chunked"),
    pytest.param(dict(preemption_mode="recompute", enable_chunked_prefill=False), 16, id="recompute-unchunked"),
    pytest.param(dict(**SWAP, **CHUNKED), 16, id="swap-chunked"),
    pytest.param(dict(**SWAP, enable_chunked_prefill=False), 16, id="swap-unchunked"),
    pytest.param(dict(preemption_mode="recompute", enable_prefix_caching=False, **CHUNKED), 16,
                 id="recompute-chunked-no-prefix-cache"),
    pytest.param(dict(preemption_mode="recompute", **CHUNKED), 8, id="recompute-chunked-block8"),
    pytest.param(dict(**SWAP, **CHUNKED), 32, id="swap-chunked-block32"),
    pytest.param(dict(**SWAP, enable_chunked_prefill=False), 8, id="swap-unchunked-block8"),
]


@pytest.mark.parametrize(("config", "block_size"), POOL_CASES)
def test_greedy_matches_hf_under_preemption(config, block_size, tiny_model, llm_factory, pressure_reference):
    """Mistral (window 24) in a pool smaller than its prompts: blocks released, preempted, chunked, HF's tokens."""
    llm = llm_factory(tiny_model("mistral", sliding_window=PRESSURE_WINDOW), block_size=block_size,
                      num_blocks=pressure_pool(block_size), **config)
    engine = llm.engine
    preemptions, released = engine.stats()["preemptions"], engine.stats()["released_window_blocks"]
    with recorded_steps(engine) as log:
        outputs = llm.generate(as_inputs(PRESSURE_PROMPTS), PRESSURE_GREEDY)

    assert tokens_of(outputs) == pressure_reference
    assert engine.stats()["preemptions"] > preemptions
    assert engine.stats()["released_window_blocks"] > released
    if config["preemption_mode"] == "swap":  # blocks still cached on the device come back without a copy
        assert log.swapped_out > 0 and log.swapped_in <= log.swapped_out
    else:
        assert log.swapped_out == log.swapped_in == 0
    if config["enable_chunked_prefill"]:
        assert max(sum(q) for q in log.query_lens) <= config["max_num_batched_tokens"]
        assert not any(max(PRESSURE_LENGTHS) in q for q in log.query_lens)  # the 60-token prompt was split
    else:  # every prompt is computed in one piece
        assert any(max(PRESSURE_LENGTHS) in q for q in log.query_lens)


def test_chunked_prefill_of_a_lone_prompt_matches_hf(tiny_model, llm_factory, hf_reference):
    """A 60-token prompt alone, 16 tokens per step: four chunks, the first three sample nothing.

    Every chunk's K/V must still be computed, even in a step where no sequence samples a token.
    """
    llm = llm_factory(tiny_model("mistral"), **CHUNKED)
    with recorded_steps(llm.engine) as log:
        [out] = llm.generate({"prompt_token_ids": PROMPTS[3]}, GREEDY)
    assert sum(sum(q) for q in log.query_lens) == len(PROMPTS[3]) + len(out.outputs[0].token_ids) - 1
    assert out.outputs[0].token_ids == hf_reference("mistral")[3]


@pytest.mark.parametrize("block_size", [8, 32])
def test_greedy_matches_hf_with_other_block_sizes(block_size, tiny_model, llm_factory, hf_reference):
    """Gemma2 (window 12 + soft cap, alternating layers) in a roomy pool of 8- and 32-token blocks."""
    llm = llm_factory(tiny_model("gemma2"), block_size=block_size, num_blocks=1 + 2 * _blocks(RAGGED_LENGTHS, 8))
    assert tokens_of(llm.generate(as_inputs(PROMPTS), GREEDY)) == hf_reference("gemma2")
    assert llm.engine.stats()["preemptions"] == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_seeded_sampling_is_unchanged_by_preemption(mode, tiny_model, llm_factory):
    """Preempted requests resume their random streams where they stopped: same tokens as in a roomy pool.

    Every other request has n=2, so forked samples (sharing blocks copy-on-write) are preempted too.
    """
    params = [SamplingParams(n=1 + i % 2, temperature=1.0, seed=100 + i, max_tokens=PRESSURE_TOKENS, ignore_eos=True)
              for i in range(len(PRESSURE_PROMPTS))]
    roomy = llm_factory(tiny_model("llama"))
    tight = llm_factory(tiny_model("llama"), num_blocks=pressure_pool(16), preemption_mode=mode,
                        swap_space="1MiB", **CHUNKED)

    def samples(llm):
        return [[s.token_ids for s in out.outputs] for out in llm.generate(as_inputs(PRESSURE_PROMPTS), params)]

    expected = samples(roomy)
    before = tight.engine.stats()["preemptions"]
    assert samples(tight) == expected
    assert tight.engine.stats()["preemptions"] > before


def test_greedy_matches_hf_with_at_most_two_sequences_per_step(tiny_model, llm_factory, hf_reference):
    llm = llm_factory(tiny_model("mistral"), max_num_seqs=2, **CHUNKED)
    with recorded_steps(llm.engine) as log:
        outputs = llm.generate(as_inputs(PROMPTS), GREEDY)
    assert tokens_of(outputs) == hf_reference("mistral")
    assert max(len(q) for q in log.query_lens) == 2


def test_a_lone_request_that_outgrows_the_pool_finishes_with_length(tiny_model, llm_factory):
    """The pool holds 3 blocks of 16: a 40-token prompt can grow to 48 tokens and no further."""
    llm = llm_factory(tiny_model("llama"), num_blocks=4, block_size=16)
    [out] = llm.generate({"prompt_token_ids": random_prompts((40,))[0]},
                         SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    assert out.outputs[0].finish_reason == "length"
    assert 40 + len(out.outputs[0].token_ids) == 3 * 16 + 1  # the last sampled token needs no KV slot


# --------------------------------------------------------------------------- prefix sharing

SYSTEM_LEN, SUFFIX_LEN, NUM_REQUESTS = 512, 8, 16


@pytest.fixture
def prefix_llm(tiny_model, llm_factory):
    """Llama with room for 4 copies of the system prompt; the prefix cache starts empty."""
    llm = llm_factory(tiny_model("llama"), num_blocks=160, block_size=16)
    llm.engine.block_manager.reset_prefix_cache()
    return llm


def shared_prefix_prompts(seed: int) -> list[list[int]]:
    system = random_prompts((SYSTEM_LEN,), seed=1234)[0]
    return [system + suffix for suffix in random_prompts((SUFFIX_LEN,) * NUM_REQUESTS, seed=seed)]


def distinct_blocks(engine) -> set[int]:
    return {b for seq in engine.scheduler.running for b in engine.block_manager.block_table(seq)}


def test_concurrent_requests_store_a_shared_prefix_once(prefix_llm):
    """16 requests arriving together: 32 blocks of system prompt + one block of suffix each.

    Checked once every request is admitted (each holds blocks for its whole prompt). Requests
    admitted in the same step as the first one must share its prefix blocks too, rather than
    store and compute their own copy of the 512 shared tokens.
    """
    engine = prefix_llm.engine
    prompts = shared_prefix_prompts(seed=1)
    ids = [engine.add_request({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
           for p in prompts]
    try:
        while engine.scheduler.waiting:
            engine.step()
        expected = SYSTEM_LEN // 16 + NUM_REQUESTS
        assert len(distinct_blocks(engine)) == expected
        assert engine.block_manager.stats().used == expected
    finally:
        for request_id in ids:
            engine.abort(request_id)


def test_second_wave_prefill_computes_only_unshared_tokens(prefix_llm, tiny_model):
    """After a first wave, 16 new requests with the same system prompt hit the cache for all 512 tokens."""
    engine = prefix_llm.engine
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    prefix_llm.generate(as_inputs(shared_prefix_prompts(seed=1)), params)
    stats = engine.block_manager.stats()
    assert stats.used == 0 and stats.cached >= SYSTEM_LEN // 16

    wave = shared_prefix_prompts(seed=2)
    with recorded_steps(engine) as log:
        outputs = prefix_llm.generate(as_inputs(wave), params)
    after = engine.block_manager.stats()

    assert [o.num_cached_tokens for o in outputs] == [SYSTEM_LEN] * NUM_REQUESTS
    assert after.prefix_cache_hits - stats.prefix_cache_hits == SYSTEM_LEN * NUM_REQUESTS
    assert after.prefix_cache_queries - stats.prefix_cache_queries == (SYSTEM_LEN + SUFFIX_LEN) * NUM_REQUESTS
    computed = sum(sum(q) for q in log.query_lens)
    assert computed == NUM_REQUESTS * (SUFFIX_LEN + 1)  # each suffix, then one decode each
    model = load_reference(tiny_model("llama"))
    for prompt, out in list(zip(wave, outputs))[::5]:
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 2, stop_at_eos=False)


def test_second_wave_admission_adds_only_suffix_blocks(prefix_llm):
    engine = prefix_llm.engine
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    prefix_llm.generate(as_inputs(shared_prefix_prompts(seed=3)[:1]), params)
    ids = [engine.add_request({"prompt_token_ids": p}, params) for p in shared_prefix_prompts(seed=4)]
    try:
        engine.step()
        assert not engine.scheduler.waiting
        assert len(distinct_blocks(engine)) == engine.block_manager.stats().used == SYSTEM_LEN // 16 + NUM_REQUESTS
    finally:
        for request_id in ids:
            engine.abort(request_id)


# --------------------------------------------------------------------------- abort and bad requests in flight


def test_abort_frees_blocks_at_once(tiny_model, llm_factory):
    llm = llm_factory(tiny_model("llama"))
    engine = llm.engine
    long = engine.add_request({"prompt_token_ids": PROMPTS[3]}, SamplingParams(temperature=0, max_tokens=50))
    forked = engine.add_request({"prompt_token_ids": PROMPTS[2]},
                                SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=50))
    queued = engine.add_request({"prompt_token_ids": PROMPTS[1]}, SamplingParams(max_tokens=50))
    for _ in range(3):
        engine.step()
    assert engine.block_manager.stats().used > 0

    assert engine.abort(long) and engine.abort(forked) and engine.abort(queued)
    assert engine.block_manager.stats().used == 0
    assert not engine.has_unfinished_requests() and not engine.scheduler.has_unfinished()
    assert engine.abort(long) is False and engine.abort("no-such-request") is False
    assert engine.step() == []


def test_abort_of_a_swapped_request_frees_its_host_blocks(tiny_model, llm_factory):
    llm = llm_factory(tiny_model("llama"), num_blocks=pressure_pool(16), preemption_mode="swap", swap_space="1MiB")
    engine = llm.engine
    ids = [engine.add_request({"prompt_token_ids": p}, PRESSURE_GREEDY) for p in PRESSURE_PROMPTS]
    for _ in range(60):
        engine.step()
        if engine.scheduler.swapped:
            break
    assert engine.scheduler.swapped, "nothing was swapped out"
    assert engine.block_manager.stats().host_used > 0
    for request_id in ids:
        engine.abort(request_id)
    stats = engine.block_manager.stats()
    assert stats.used == 0 and stats.host_used == 0


def _run_to_completion(engine, max_steps: int = 500,
                       failures: dict[str, str] | None = None) -> dict[str, list[int]]:
    """Step until idle: the first sample's tokens of each finished request; ``failures`` gets
    the error of each request the engine aborted alone."""
    done: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return done
        for out in engine.step():
            if out.error is not None:
                assert failures is not None, out.error
                failures[out.request_id] = out.error
            elif out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    raise AssertionError("engine did not finish")


@pytest.mark.parametrize(
    ("bad_prompt", "bad_params", "message"),
    [
        ({"prompt_token_ids": []}, None, "prompt_token_ids"),
        ({"prompt_token_ids": [1, VOCAB_SIZE]}, None, "prompt_token_ids"),
        ({"prompt_token_ids": list(range(3, 3 + 2048))}, None, "max_model_len"),
        ("", None, "empty"),
        ({"prompt_token_ids": [5, 6]}, {"temperature": 0.5}, "SamplingParams"),
        ({"text": "no prompt key"}, None, "prompt"),
    ],
    ids=["empty-ids", "id-out-of-vocab", "too-long", "empty-text", "params-not-SamplingParams", "dict-without-prompt"],
)
def test_bad_request_in_flight_leaves_the_others_undisturbed(bad_prompt, bad_params, message, tiny_model,
                                                             llm_factory, hf_reference):
    llm = llm_factory(tiny_model("mistral"))
    engine = llm.engine
    ids = [engine.add_request({"prompt_token_ids": p}, GREEDY) for p in PROMPTS]
    engine.step()
    engine.step()
    queued_before = len(engine.scheduler.waiting) + len(engine.scheduler.running)
    with pytest.raises(ValueError, match=message):
        engine.add_request(bad_prompt, bad_params)
    assert sorted(engine.requests) == sorted(ids)
    assert len(engine.scheduler.waiting) + len(engine.scheduler.running) == queued_before
    done = _run_to_completion(engine)
    assert [done[i] for i in ids] == hf_reference("mistral")


def test_duplicate_request_id_is_rejected_without_disturbing_the_first(tiny_model, llm_factory, hf_reference):
    engine = llm_factory(tiny_model("mistral")).engine
    engine.add_request({"prompt_token_ids": PROMPTS[0]}, GREEDY, request_id="a")
    engine.step()
    with pytest.raises(ValueError, match="already in flight"):
        engine.add_request({"prompt_token_ids": PROMPTS[1]}, GREEDY, request_id="a")
    assert _run_to_completion(engine) == {"a": hf_reference("mistral")[0]}


#: a token id that the fault-injection tests below make the forward pass fail on
POISON = 4242


@pytest.fixture
def failing_forward(monkeypatch):
    """Make ``runner.execute`` raise for any batch holding the token ``POISON``."""

    def install(engine) -> None:
        execute = engine.runner.execute

        def execute_or_fail(inputs):
            if POISON in inputs.token_ids:
                raise RuntimeError("injected forward failure")
            return execute(inputs)

        monkeypatch.setattr(engine.runner, "execute", execute_or_fail)

    return install


def test_a_request_whose_forward_pass_fails_is_aborted_alone(tiny_model, llm_factory, hf_reference,
                                                            failing_forward):
    engine = llm_factory(tiny_model("mistral")).engine
    failing_forward(engine)
    ids = [engine.add_request({"prompt_token_ids": p}, GREEDY) for p in PROMPTS[:2]]
    bad = engine.add_request({"prompt_token_ids": [5, POISON, 6, 7]}, GREEDY)
    ids += [engine.add_request({"prompt_token_ids": p}, GREEDY) for p in PROMPTS[2:]]
    done, failures = {}, {}
    for _ in range(200):
        for out in engine.step():
            if out.error is not None:
                failures[out.request_id] = out.error
            elif out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        if not engine.has_unfinished_requests():
            break
    assert failures == {bad: "internal engine error: RuntimeError: injected forward failure"}
    assert bad not in done
    assert [done[i] for i in ids] == hf_reference("mistral")


def test_a_request_whose_sampling_fails_is_aborted_alone(tiny_model, llm_factory, hf_reference, monkeypatch):
    import flexpage.executor.local

    sample = flexpage.executor.local.sample

    def sample_or_fail(logits, params, *args, **kwargs):
        if any(p.max_tokens == NEW_TOKENS + 1 for p in params):
            raise OverflowError("injected sampling failure")
        return sample(logits, params, *args, **kwargs)

    monkeypatch.setattr(flexpage.executor.local, "sample", sample_or_fail)
    engine = llm_factory(tiny_model("mistral")).engine
    ids = [engine.add_request({"prompt_token_ids": p}, GREEDY) for p in PROMPTS]
    bad = engine.add_request({"prompt_token_ids": PROMPTS[0]}, SamplingParams(temperature=0.0,
                                                                              max_tokens=NEW_TOKENS + 1))
    failures: dict[str, str] = {}
    done = _run_to_completion(engine, failures=failures)
    assert failures == {bad: "internal engine error: OverflowError: injected sampling failure"}
    assert [done[i] for i in ids] == hf_reference("mistral")


def test_generate_raises_when_one_of_its_requests_fails(tiny_model, llm_factory, failing_forward):
    llm = llm_factory(tiny_model("mistral"))
    failing_forward(llm.engine)
    with pytest.raises(RuntimeError, match="injected forward failure"):
        llm.generate(as_inputs([PROMPTS[0], [5, POISON, 6]]), GREEDY)
    assert not llm.engine.has_unfinished_requests()


def test_prompt_needing_more_blocks_than_the_pool_is_rejected(tiny_model, llm_factory):
    engine = llm_factory(tiny_model("llama"), num_blocks=4).engine
    with pytest.raises(ValueError, match="num_blocks"):
        engine.add_request({"prompt_token_ids": PROMPTS[3]}, GREEDY)
    assert not engine.has_unfinished_requests() and not engine.scheduler.has_unfinished()


@pytest.mark.parametrize("vocab_size", [VOCAB_SIZE, 1000], ids=["default-vocab", "small-vocab"])
def test_warm_up_leaves_the_engine_idle_with_every_block_back(vocab_size, tiny_model, llm_factory):
    """The server's warm-up (every prefill bucket alone, in pairs, with a shared prefix) ends
    with no request, no block in use and an empty prefix cache -- whatever the vocabulary
    size (its prompts' token ids must all be valid)."""
    overrides = {} if vocab_size == VOCAB_SIZE else {"vocab_size": vocab_size}
    engine = llm_factory(tiny_model("llama", **overrides), num_blocks=128).engine
    assert engine.warm_up() > 0
    stats = engine.block_manager.stats()
    assert not engine.has_unfinished_requests()
    assert stats.used == 0 and stats.cached == 0 and stats.free == stats.total - 1, stats  # block 0: the null block


@pytest.mark.parametrize(("deterministic", "dtype"), [(False, "float32"), (True, "float32"), (True, "bfloat16")],
                         ids=["default", "deterministic", "deterministic-bf16"])
def test_after_warm_up_batched_prompts_of_any_length_compile_nothing(tiny_model, llm_factory, deterministic, dtype):
    """The server's first batched requests must not pay for a compile (issue 18: a first
    2-prompt request took 9.6 s): after ``warm_up``, batches of 1-4 prompts of lengths from 1
    to past the pool's key block, with and without a shared prefix, run compiled kernels only
    -- in deterministic mode too, whose plans differ (decode rows over gathered keys, and in
    bf16 over the pool in place where their runs allow)."""
    from torch._dynamo.utils import counters

    llm = llm_factory(tiny_model("llama"), num_blocks=128, compile=True, deterministic=deterministic, dtype=dtype)
    llm.engine.warm_up()
    compiled = counters["stats"]["unique_graphs"]
    assert compiled > 0  # the warm-up compiled (the counter counts what this test is about)
    gen = torch.Generator().manual_seed(4)
    shared = torch.randint(5, VOCAB_SIZE, (40,), generator=gen).tolist()
    for lengths in ([7, 9], [30, 31], [100, 3], [200, 150, 5], [1, 2, 3, 4], [33], [129], [6, 6, 6],
                    [17, 2, 60, 3, 9], [1], [8, 8, 8, 8, 8, 8, 8, 8]):
        prompts = [{"prompt_token_ids": torch.randint(5, VOCAB_SIZE, (n,), generator=gen).tolist()} for n in lengths]
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        llm.generate([{"prompt_token_ids": shared + p["prompt_token_ids"]} for p in prompts], GREEDY)
        assert counters["stats"]["unique_graphs"] == compiled, f"a batch of prompt lengths {lengths} compiled a new variant"


def test_warm_up_of_a_busy_engine_is_a_value_error(tiny_model, llm_factory):
    engine = llm_factory(tiny_model("llama")).engine
    engine.add_request({"prompt_token_ids": PROMPTS[0]}, GREEDY, "busy")
    try:
        with pytest.raises(ValueError, match="warm_up: the engine has 1 unfinished requests"):
            engine.warm_up()
    finally:
        engine.abort("busy")


def test_stats_count_tokens_and_requests(tiny_model, llm_factory):
    engine = llm_factory(tiny_model("qwen2")).engine
    before = engine.stats()
    llm_outputs = llm_factory(tiny_model("qwen2")).generate(as_inputs(PROMPTS), GREEDY)
    after = engine.stats()
    assert after["prompt_tokens"] - before["prompt_tokens"] == sum(RAGGED_LENGTHS)
    assert after["generation_tokens"] - before["generation_tokens"] == sum(len(t) for t in tokens_of(llm_outputs))
    assert after["finished_requests"] - before["finished_requests"] == len(PROMPTS)
    assert after["num_requests_running"] == after["num_requests_waiting"] == after["kv_blocks_used"] == 0
    assert after["kv_blocks_total"] == 63 and after["kv_capacity_tokens"] == 63 * engine.config.block_size
