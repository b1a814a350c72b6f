"""The virtual KV layout (vAttention), specified against the paged one, HF and a float64 reference.

* The arena is address space: reserving far more than RAM costs nothing, memory arrives a
  page at a time where tokens are written, and a released row reads zeros and holds none.
  The tensor keeps the mapping alive (no access after release can fault).
* Rows: a sequence's blocks are one row of consecutive blocks; the resident cap, not the
  address space, limits admission; forks copy (nothing is shared).
* Attention over the pool's rows in place equals the same kernel over a contiguous copy bit
  for bit, and the float64 reference within rounding, recipes included.
* The engine gives HF's greedy tokens in the virtual layout for every tiny architecture,
  under preemption (recompute and swap), and the same seeded samples as the paged layout
  with ``n > 1``; a compiled engine returns every row's memory when its sequences finish.
"""

from __future__ import annotations

import gc

import pytest
import torch

from attention_reference import Alibi, BatchSpec, Causal, Both, SlidingWindow, reference_paged_attention, rel_err
from engine_models import hf_greedy, load_reference, random_prompts
from flexpage import SamplingParams
from flexpage.attention.flex import FlexRunner
from flexpage.attention.kv_pool import KVPool
from flexpage.attention.paging import build_paged_batch
from flexpage.core.kv_ops import BlockOpKind
from flexpage.attention.virtual_arena import PAGE_SIZE as OS_PAGE, ArenaRefused, VirtualArena
from flexpage.config import EngineConfig
from flexpage.core.block_manager import BlockManager
from flexpage.core.block_pool import NoFreeBlocksError
from flexpage.core.row_pool import RowPool
from flexpage.core.sequence import Sequence
from flexpage.recipes import alibi, causal, sliding_window

# ---- the arena --------------------------------------------------------------------------


def test_a_reservation_larger_than_ram_holds_no_memory():
    arena = VirtualArena((64 << 20, 1024), torch.uint8)  # 64 GiB on a 24 GB machine
    assert arena.nbytes == 64 << 30 and arena.resident_bytes() == 0


def test_writes_claim_whole_pages_and_release_gives_them_back_as_zeros():
    rows, slots, dim = 6, 4096, 16  # fp32: 64 bytes a token, 64 tokens a page
    arena = VirtualArena((rows, slots, dim), torch.float32)
    arena.tensor[:, 100:300] = 1.0  # tokens 100..299 of every row: pages 1..4
    per_row = (300 * 64 // OS_PAGE - 100 * 64 // OS_PAGE + 1) * OS_PAGE
    assert arena.resident_bytes() == rows * per_row
    assert arena.release([(64, 280)]) == rows * 3 * OS_PAGE  # whole pages inside the range only
    assert arena.resident_bytes() == rows * OS_PAGE  # the page of tokens 256..319 stays
    assert arena.tensor[:, :256].abs().sum() == 0 and arena.tensor[:, 256:300].eq(1.0).all()
    arena.release([(0, slots)])
    assert arena.resident_bytes() == 0


def test_the_tensor_keeps_the_mapping_alive():
    """No close(): the memory goes when the last view does, so a view never outlives it."""
    arena = VirtualArena((4, 1024, 16), torch.float32)
    view = arena.tensor[2]
    view.fill_(3.0)
    del arena
    gc.collect()
    assert view.sum() == 3.0 * 1024 * 16


def test_a_refused_reservation_says_what_to_change():
    with pytest.raises(ArenaRefused, match=r"lower max_num_seqs or max_model_len, or use kv_layout='paged'"):
        VirtualArena((1 << 40, 256), torch.uint8)  # 256 TiB: more than the address space


def test_the_banner_names_the_reservation_and_the_os_settings():
    from types import SimpleNamespace

    from flexpage.server.main import _layout_summary

    pool = KVPool(num_layers=2, num_blocks=64, block_size=16, num_kv_heads=2, head_dim=64, layout="virtual")
    line = _layout_summary(SimpleNamespace(runner=SimpleNamespace(pool=pool)))
    assert line.startswith("virtual (0.00 GiB of address space reserved")
    assert "vm.overcommit_memory=" in line and "transparent huge pages" in line


# ---- rows -------------------------------------------------------------------------------


def test_a_row_pool_hands_out_one_row_per_sequence_and_caps_what_is_in_use():
    pool = RowPool(num_rows=3, row_length=4, capacity=6)
    first = pool.allocate()
    assert first == 4  # row 0 holds the null block and is never handed out
    assert [pool.allocate(after) for after in (4, 5, 6)] == [5, 6, 7]
    with pytest.raises(NoFreeBlocksError, match="ends its row"):
        pool.allocate(7)
    assert pool.allocate() == 8 and pool.num_free == 1
    pool.allocate(8)
    with pytest.raises(NoFreeBlocksError, match="6 resident blocks"):
        pool.allocate()
    assert pool.drain_released_rows() == []
    for block in (4, 5, 6, 7):
        pool.decref(block)
    assert pool.drain_released_rows() == [(4, 8)] and pool.drain_released_rows() == []
    pool.decref(8)
    pool.decref(9)
    assert [pool.allocate() for _ in range(3)] == [12, 4, 8]  # rows in the order they became free
    assert pool.drain_released_rows() == []  # row 2 was taken again before its memory went back


def _seq(seq_id: int, tokens: int, n: int = 1) -> Sequence:
    return Sequence(seq_id, list(range(3, 3 + tokens)), max_tokens=8, num_samples=n)


def test_a_fork_copies_into_rows_its_parent_reserved_at_admission():
    bm = BlockManager(40, 4, enable_prefix_caching=False, run_length=8, virtual_rows=4)
    parent = _seq(0, 10, n=3)
    assert bm.blocks_for_admission(parent) == 3 * 3
    assert bm.allocate(parent) == 0
    assert bm.block_table(parent) == [8, 9, 10] and bm.stats().used == 9
    parent.num_computed_tokens = 10
    children = [_seq(1 + i, 10) for i in range(2)]
    for child in children:
        bm.fork(parent, child)
    tables = [bm.block_table(c) for c in children]
    assert sorted(tables) == [[16, 17, 18], [24, 25, 26]]
    copies = [(op.src, op.dst) for op in bm.drain_ops()]
    assert sorted(copies) == sorted((p, c) for t in tables for p, c in zip([8, 9, 10], t))
    for seq in (parent, *children):
        bm.free(seq)
    released = bm.drain_ops()
    assert bm.stats().used == 0 and sorted((op.kind, op.src, op.dst) for op in released) == [
        (BlockOpKind.RELEASE, start, start + 8) for start in (8, 16, 24)]


def test_admission_waits_for_a_free_row_and_rejects_what_can_never_fit():
    bm = BlockManager(40, 4, enable_prefix_caching=False, run_length=8, virtual_rows=2)
    a, b, c = _seq(0, 4), _seq(1, 4), _seq(2, 4)
    bm.allocate(a)
    bm.allocate(b)
    assert not bm.can_allocate(c)  # 37 blocks free, no row
    bm.free(a)
    assert bm.can_allocate(c)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        BlockManager(40, 4, run_length=8, virtual_rows=2)


@pytest.mark.parametrize(("config", "message"), [
    (dict(kv_layout="virtual", deterministic=True), "kv_layout='virtual' cannot be combined with deterministic"),
    (dict(kv_layout="virtual", kv_budget_tokens=64), "kv_layout='virtual' cannot be combined with kv_budget_tokens"),
    (dict(kv_layout="virtual", host_kv_bytes="1MiB"), "kv_layout='virtual' cannot be combined with host_kv_bytes"),
    (dict(kv_resident_bytes="1GiB"), "kv_resident_bytes: applies to kv_layout='virtual'"),
    (dict(kv_layout="virtual", kv_resident_bytes="0"), "kv_resident_bytes: got '0'"),
    (dict(kv_layout="contiguous"), r"kv_layout: got 'contiguous', expected one of \('paged', 'virtual'\)"),
])
def test_bad_layout_settings_are_named(config, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**config)


def test_the_virtual_layout_turns_prefix_caching_off():
    assert EngineConfig(kv_layout="virtual").enable_prefix_caching is False


# ---- attention over rows ----------------------------------------------------------------

PAGE, ROW_PAGES = 16, 8  # 128-token rows, read as one key block each
SPEC = BatchSpec("mixed", seq_lens=(32, 40, 48, 56, 96, 33), query_lens=(1, 1, 5, 5, 40, 33))


def _row_case(dtype: torch.dtype, heads: int = 8, kv_heads: int = 2, dim: int = 64):
    """A virtual pool whose row ``i + 1`` holds sequence ``i``; random K/V in every used slot."""
    g = torch.Generator().manual_seed(0)
    num_rows = len(SPEC.seq_lens)
    pool = KVPool(num_layers=1, num_blocks=(num_rows + 1) * ROW_PAGES, block_size=PAGE, num_kv_heads=kv_heads,
                  head_dim=dim, dtype=dtype, layout="virtual")
    tables = torch.tensor([[(i + 1) * ROW_PAGES + j for j in range(ROW_PAGES)] for i in range(num_rows)],
                          dtype=torch.int32)
    k, v = pool.layer(0)
    for i, n in enumerate(SPEC.seq_lens):
        start = (i + 1) * ROW_PAGES * PAGE
        k[0, :, start:start + n] = torch.randn(kv_heads, n, dim, generator=g).to(dtype)
        v[0, :, start:start + n] = torch.randn(kv_heads, n, dim, generator=g).to(dtype)
    q = torch.randn(SPEC.num_tokens, heads, dim, generator=g).to(dtype)
    return pool, tables, q


def _plan(pool: KVPool, tables, recipe, contiguous_rows: bool = True):
    seq_lens, query_lens = SPEC.tensors()
    return build_paged_batch(tables, seq_lens, query_lens, page_size=PAGE, num_pages=pool.num_blocks, recipe=recipe,
                             pages_per_block=ROW_PAGES, contiguous_rows=contiguous_rows)


@pytest.mark.usefixtures("compile_budget", "single_torch_thread")
def test_compiled_attention_over_arena_rows_equals_a_contiguous_copy_bit_for_bit():
    """Same kernel, same numbers, memory from the arena or from an ordinary tensor; and the
    float64 reference within fp32 rounding, and the paged plan over the same pool."""
    pool, tables, q = _row_case(torch.float32)
    batch = _plan(pool, tables, causal())
    assert all(g.kv_slots is None and g.kv_start is not None for g in batch.groups)  # no gathered copy
    runner = FlexRunner(causal())
    out = runner(q, *pool.layer(0), batch)
    k_copy, v_copy = (t.clone() for t in pool.layer(0))
    assert k_copy.untyped_storage().data_ptr() != pool.storage.untyped_storage().data_ptr()
    assert torch.equal(runner(q, k_copy, v_copy, batch), out)
    ref = reference_paged_attention(q, *pool.layer(0), tables, SPEC.seq_lens, SPEC.query_lens, page_size=PAGE)
    assert rel_err(out, ref) < 1e-5
    paged = runner(q, *pool.layer(0), _plan(pool, tables, causal(), contiguous_rows=False))
    assert rel_err(out, paged.double()) < 1e-5


@pytest.mark.parametrize(("recipe", "variant"), [
    (sliding_window(24), SlidingWindow(24)),
    (alibi(8), Alibi(8)),
], ids=["sliding_window", "alibi"])
def test_recipes_apply_unchanged_over_rows(recipe, variant):
    """Logical mods see the same positions through a row's first slot as through a page table (eager)."""
    pool, tables, q = _row_case(torch.float32)
    out = FlexRunner(recipe, compile=False)(q, *pool.layer(0), _plan(pool, tables, recipe))
    ref = reference_paged_attention(q, *pool.layer(0), tables, SPEC.seq_lens, SPEC.query_lens, page_size=PAGE,
                                    variant=Both(Causal(), variant))
    assert rel_err(out, ref) < 1e-5


def test_a_row_that_is_not_consecutive_pages_is_rejected():
    pool, tables, _ = _row_case(torch.float32)
    tables[2, 1] = 5
    with pytest.raises(ValueError, match=r"block_tables: row 2 .* is not consecutive pages"):
        _plan(pool, tables, causal())


# ---- the engine -------------------------------------------------------------------------

TINY_KINDS = ["llama", "mistral", "gemma2", "qwen2", "qwen3", "bloom"]
PROMPTS = random_prompts((5, 17, 33, 60))
NEW_TOKENS = 12
VIRTUAL = dict(kv_layout="virtual", max_model_len=256, max_num_seqs=8)


def _greedy(llm, prompts, tokens=NEW_TOKENS, **params):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=tokens, **params))
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.usefixtures("single_torch_thread", "kv_blocks_returned")
@pytest.mark.parametrize("kind", TINY_KINDS)
def test_virtual_layout_greedy_matches_hf(kind, tiny_model, llm_factory):
    model = load_reference(tiny_model(kind))
    expected = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    llm = llm_factory(tiny_model(kind), **VIRTUAL)
    assert llm.engine.runner.pool.layout == "virtual"
    assert _greedy(llm, PROMPTS) == expected


PRESSURE = random_prompts((5, 17, 33, 60, 9, 24), seed=7)


@pytest.mark.usefixtures("single_torch_thread", "kv_blocks_returned")
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_virtual_layout_matches_hf_under_preemption(mode, tiny_model, llm_factory):
    """Six prompts whose decodes outgrow a 12-block resident cap: preempted, chunked, HF's tokens."""
    model = load_reference(tiny_model("llama"))
    expected = [hf_greedy(model, p, 16, stop_at_eos=False) for p in PRESSURE]
    llm = llm_factory(tiny_model("llama"), num_blocks=13, block_size=16, preemption_mode=mode, swap_space="1MiB",
                      enable_chunked_prefill=True, max_num_batched_tokens=16, **VIRTUAL)
    before = llm.engine.stats()["preemptions"]
    assert _greedy(llm, PRESSURE, 16, ignore_eos=True) == expected
    assert llm.engine.stats()["preemptions"] > before


@pytest.mark.usefixtures("single_torch_thread", "kv_blocks_returned")
def test_parallel_samples_are_the_same_in_both_layouts(tiny_model, llm_factory):
    """n > 1 forks by copying in the virtual layout (by sharing when paged): same seeded tokens."""
    params = [SamplingParams(n=1 + i % 3, temperature=1.0, seed=10 + i, max_tokens=8, ignore_eos=True)
              for i in range(len(PROMPTS))]

    def samples(llm):
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        return [[s.token_ids for s in out.outputs] for out in outputs]

    assert samples(llm_factory(tiny_model("llama"), **VIRTUAL)) == samples(llm_factory(tiny_model("llama")))


@pytest.mark.usefixtures("compile_budget", "single_torch_thread", "kv_blocks_returned")
def test_compiled_virtual_engine_holds_memory_only_while_tokens_live(tiny_model, llm_factory):
    """Compiled step over rows: HF's tokens; while a 200-token prompt is held, its written pages
    are resident (reads may map at most the rest of its last key block); after, nothing."""
    from flexpage.attention.virtual_arena import resident_bytes

    model = load_reference(tiny_model("llama"))
    prompt = random_prompts((200,), seed=3)[0]
    llm = llm_factory(tiny_model("llama"), compile=True, **VIRTUAL)
    engine = llm.engine
    assert engine.runner.compiled_step is not None
    pool = engine.runner.pool
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=4), request_id="held")
    engine.step()  # the prompt's prefill
    steps_before = engine.runner.compiled_step.steps_run
    rows = pool.storage.shape[0] * 2 * pool.num_kv_heads
    token_bytes = pool.head_dim * pool.storage.element_size()
    written = rows * -(-200 * token_bytes // OS_PAGE) * OS_PAGE
    key_block = pool.block_size * engine.runner.blocks_per_attention_block
    assert written <= resident_bytes(pool.storage) <= rows * -(-key_block * token_bytes // OS_PAGE) * OS_PAGE
    tokens = []
    while engine.requests:
        for out in engine.step():
            tokens = out.outputs[0].token_ids
    assert tokens == hf_greedy(model, prompt, 4)
    assert engine.runner.compiled_step.steps_run > steps_before
    assert resident_bytes(pool.storage) == 0
