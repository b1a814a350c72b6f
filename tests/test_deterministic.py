"""Deterministic mode (``LLM(deterministic=True)``, ``--deterministic``).

A request's greedy tokens and their logprobs are the same bits whether it runs alone or in a
batch of 32 others, whatever the chunked-prefill budget, and whether its prefix was computed
now or came from the prefix cache -- including cached blocks of tokens an earlier request
generated. Without the mode the logprobs differ in each of these situations (bf16 SmolLM2 on
the AMX test machine; see docs/deterministic.md).

These tests run with torch's default thread count: how the kernels split work between threads
is one of the things the mode must not depend on.
"""

from __future__ import annotations

import random

import pytest
import torch

from flexpage import SamplingParams
from flexpage.attention.flex import FlexRunner, deterministic_decode_in_place
from flexpage.attention.paging import build_paged_batch
from flexpage.attention.recipe import CAUSAL
from flexpage.model import packed_linear
from flexpage.model.packed_linear import PackedLinear
from flexpage.model.runner import DETERMINISTIC_ROW_TILE

pytestmark = pytest.mark.usefixtures("kv_blocks_returned")

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, logprobs=5, ignore_eos=True)
#: (tiny model, dtype, model_impl): the compact forward in bf16, HF's modules in float32
CASES = [("llama", "bfloat16", "flexpage"), ("llama", "float32", "transformers")]


def _prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(3, 49152) for _ in range(length)]


RNG = random.Random(0)
PROMPT = _prompt(RNG, 200)  # longer than one attention key block (128 tokens in bf16)
OTHERS = [_prompt(RNG, RNG.randrange(5, 260)) for _ in range(32)]


def _bits(output) -> tuple[list[int], list[dict[int, float]]]:
    sample = output.outputs[0]
    return sample.token_ids, [{token: lp.logprob for token, lp in step.items()} for step in sample.logprobs]


@pytest.fixture(scope="module", params=CASES, ids=["-".join(case) for case in CASES])
def engines(request, tiny_model, llm_factory):
    """Two deterministic engines on one model: the default prefill budget and 32-token chunks."""
    kind, dtype, model_impl = request.param
    config = dict(dtype=dtype, compile=True, num_blocks=1024, deterministic=True, model_impl=model_impl)
    return (llm_factory(tiny_model(kind), **config),
            llm_factory(tiny_model(kind), max_num_batched_tokens=32, **config))


@pytest.fixture(scope="module")
def alone(engines):
    """The reference: the prompt alone on an engine that has never seen it."""
    full_budget, _ = engines
    return _bits(full_budget.generate([PROMPT + [7]], GREEDY)[0]), PROMPT + [7]


def test_a_request_in_a_batch_of_32_gets_the_bits_it_gets_alone(engines, alone):
    reference, prompt = alone
    outputs = engines[0].generate(OTHERS[:16] + [prompt] + OTHERS[16:], GREEDY)
    assert _bits(outputs[16]) == reference


def test_the_chunked_prefill_budget_does_not_change_the_bits(engines, alone):
    reference, prompt = alone
    output = engines[1].generate([prompt], GREEDY)[0]
    assert output.num_cached_tokens == 0  # computed in 32-token chunks, not taken from a cache
    assert _bits(output) == reference


def test_a_prefix_cache_hit_does_not_change_the_bits(engines, alone):
    reference, prompt = alone
    engines[0].generate([prompt[:150] + [11] * 20], GREEDY)  # leaves prompt[:144] in the cache
    output = engines[0].generate([prompt], GREEDY)[0]
    assert output.num_cached_tokens >= 144
    assert _bits(output) == reference


def test_cached_generated_tokens_give_the_bits_of_a_fresh_prefill(engines):
    full_budget, chunked = engines
    start = PROMPT[:90]
    generated = full_budget.generate([start], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    follow_up = start + generated[0].outputs[0].token_ids + [13]
    hit = full_budget.generate([follow_up], GREEDY)[0]
    assert hit.num_cached_tokens > len(start)  # blocks the decode steps wrote came from the cache
    fresh = chunked.generate([follow_up], GREEDY)[0]
    assert fresh.num_cached_tokens <= len(start)
    assert _bits(hit) == _bits(fresh)


def test_every_step_of_the_compact_forward_runs_as_one_compiled_graph(engines, alone, monkeypatch):
    """Deterministic mode keeps the compiled step (HF's modules run layer by layer): a step that
    fell back to the layer-by-layer path would round differently from the graph, and so would a
    graph whose projections were not calls of one row tile. (Which kernel a CPU picks per row
    count varies: on some CPUs untiled projections give the same bits, so the tiles are
    checked directly.)"""
    _, prompt = alone
    linear = packed_linear._linear
    for engine in engines:
        runner = engine.engine.runner
        if runner.compact is None:
            assert runner.compiled_step is None
            continue
        executed, projected_rows = [], []
        execute = runner.execute
        monkeypatch.setattr(runner, "execute", lambda inputs: executed.append(inputs) or execute(inputs))
        monkeypatch.setattr(packed_linear, "_linear", lambda x, *args: projected_rows.append(x.shape[0])
                            or linear(x, *args))
        before = runner.compiled_step.steps_run
        engine.generate([prompt, prompt[:50]], GREEDY)  # prefill, mixed (when chunked) and decode steps
        assert len(executed) >= GREEDY.max_tokens
        assert runner.compiled_step.steps_run - before == len(executed)
        assert set(projected_rows) == {DETERMINISTIC_ROW_TILE}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_projection_gives_each_row_the_same_bits_in_any_batch(dtype):
    torch.manual_seed(0)
    weight = (torch.randn(96, 64) * 0.1).to(dtype)
    linear = PackedLinear(weight, row_tile=16)
    x = torch.randn(70, 64).to(dtype)
    order = torch.randperm(70)
    together = linear(x)
    assert torch.equal(linear(x[order]), together[order])
    assert torch.equal(linear(x[5:6]), together[5:6])
    torch.testing.assert_close(together, torch.nn.functional.linear(x, weight))


def test_a_deterministic_plan_reads_every_row_gathered_in_logical_block_order():
    tables = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16]])
    batch = build_paged_batch(tables, torch.tensor([60, 33]), torch.tensor([1, 20]), page_size=8, num_pages=32,
                              recipe=CAUSAL, deterministic=True)
    for group in batch.groups:
        assert group.kv_slots is not None  # decode rows too
        assert int(group.full_kv_num_blocks.sum()) == 0  # every visited block in the partial list...
        counts, indices = group.kv_num_blocks, group.kv_indices
        for row in range(counts.shape[0]):
            for block in range(counts.shape[2]):
                listed = indices[row, 0, block, : counts[row, 0, block]]
                assert torch.equal(listed, listed.sort().values)  # ...in logical order


@pytest.mark.parametrize(("dtype", "dim"), [(torch.bfloat16, 16), (torch.float32, 16), (torch.float32, 64)])
def test_a_tokens_attention_is_the_same_bits_decoded_prefilled_or_batched(dtype, dim):
    """The kernel-level promise behind the engine tests: one token's output, as a decode row
    alone or among others, or as the last row of prefill chunks of any length. Head dim 16 is
    the tiny Llama's; at 64 (SmolLM2's) the CPU micro-gemm would pick its q @ k^T arithmetic by
    the number of rows it is called for, unless the deterministic kernel fixes it."""
    torch.manual_seed(0)
    page, pages, heads, kv_heads = 8, 128, 4, 2
    k_pool = torch.randn(1, kv_heads, pages * page, dim).to(dtype)
    v_pool = torch.randn_like(k_pool)
    runner = FlexRunner(CAUSAL, deterministic=True)
    length = 300
    table = list(range(2, 2 + -(-length // page)))
    other = list(range(60, 100))
    query = torch.randn(heads, dim).to(dtype)

    def output(tables: list[list[int]], seq_lens: list[int], query_lens: list[int], row: int) -> torch.Tensor:
        width = max(map(len, tables))
        batch = build_paged_batch(torch.tensor([t + [0] * (width - len(t)) for t in tables]),
                                  torch.tensor(seq_lens), torch.tensor(query_lens), page_size=page, num_pages=pages,
                                  recipe=CAUSAL, deterministic=True)
        q = torch.randn(sum(query_lens), heads, dim).to(dtype)
        q[row] = query
        return runner(q, k_pool, v_pool, batch)[row]

    reference = output([table], [length], [1], 0)
    assert torch.equal(output([other, table, other[:9]], [300, length, 70], [1, 1, 1], 1), reference)
    assert torch.equal(output([other, table], [300, length], [40, 1], 40), reference)
    assert torch.equal(output([table], [length], [37], 36), reference)
    assert torch.equal(output([other, table], [300, length], [1, 200], 200), reference)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_decode_row_reading_aligned_runs_in_place_gets_the_bits_of_a_gathered_row(dtype):
    """Deterministic decode rows whose logical key blocks are aligned runs of the pool read it
    in place (no gathered copy): a token's output equals the same token prefilled over a
    gathered copy, or decoded beside a row that forces the copy."""
    if not deterministic_decode_in_place(dtype, torch.device("cpu")):
        pytest.skip(f"the engine keeps {dtype} decode rows gathered on this CPU (its kernels pack K/V for AMX)")
    torch.manual_seed(0)
    page, run, pages, heads, kv_heads, dim = 8, 16, 256, 9, 3, 64  # 128-token key blocks, SmolLM2's heads
    k_pool = torch.randn(1, kv_heads, pages * page, dim).to(dtype)
    v_pool = torch.randn_like(k_pool)
    runner = FlexRunner(CAUSAL, deterministic=True)
    length = 300
    aligned = [*range(3 * run, 4 * run), *range(7 * run, 8 * run), *range(5 * run, 5 * run + 6)]  # runs 3, 7, 5
    scattered = [2 * run + 1, 2 * run + 3, *range(10 * run, 10 * run + 20)]  # not runs from a block start
    query = torch.randn(heads, dim).to(dtype)

    def plan(tables: list[list[int]], seq_lens: list[int], query_lens: list[int]):  # noqa: ANN202
        width = max(map(len, tables))
        return build_paged_batch(torch.tensor([t + [0] * (width - len(t)) for t in tables]), torch.tensor(seq_lens),
                                 torch.tensor(query_lens), page_size=page, num_pages=pages, recipe=CAUSAL,
                                 pages_per_block=run, deterministic=True, deterministic_in_place=True)

    def output(batch, row: int) -> torch.Tensor:  # noqa: ANN001
        q = torch.randn(batch.num_tokens, heads, dim).to(dtype)
        q[row] = query
        return runner(q, k_pool, v_pool, batch)[row]

    in_place = plan([aligned, aligned[:30]], [length, 200], [1, 1])
    assert [g.kv_slots is None for g in in_place.groups] == [True]
    reference = output(in_place, 0)
    gathered = plan([aligned, scattered], [length, 170], [1, 1])
    assert [g.kv_slots is not None for g in gathered.groups] == [True]
    assert torch.equal(output(gathered, 0), reference)
    assert torch.equal(output(plan([aligned], [length], [37]), 36), reference)
    assert torch.equal(output(plan([scattered, aligned], [170, length], [1, 200]), 200), reference)


def test_deterministic_attention_without_the_tuned_template_is_refused(monkeypatch):
    from flexpage.attention import flex
    from flexpage.backends.cpu import torch_patches

    monkeypatch.setattr(torch_patches, "tuning_active", lambda: False)
    with pytest.raises(ValueError, match="deterministic: attention needs flexpage's tuned CPU template"):
        flex.kernel_options_for(torch.device("cpu"), None, deterministic=True)
    assert flex.kernel_options_for(torch.device("cpu"), None) == flex.isa_kernel_options(torch.device("cpu"))
