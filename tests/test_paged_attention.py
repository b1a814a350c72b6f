"""Paged attention (flexpage.attention) against a float64 dense reference.

Specification, in the style of vLLM's ``tests/v1/attention/test_attention_backends.py``:
for every named batch spec (``seq_lens`` = tokens in the pool after the step,
``query_lens`` = new tokens this step), one :class:`FlexRunner` call over the whole batch
-- decode rows and prefill rows together -- returns, for every new token, the attention
of that token over its own sequence's keys in logical order, however the pool's pages
are shuffled, shared between sequences or filled with garbage elsewhere.

* the physical pages of each sequence come from ``torch.randperm`` (never contiguous);
* some sequences share prefix pages (same physical page at the same logical index);
* every slot that no sequence owns, the null page 0 included, holds random garbage;
* the new tokens' K/V is stored with ``write_kv`` at the slots the batch plan computes.

Compile cost: each (dtype, heads, head_dim) x {decode, prefill} is one compiled kernel.
All specs use the same pool and block-table width, keep >= 2 rows per group (a group of
one row is a separate 0/1-specialised kernel) and give every prefill group a chunk longer
than 32 tokens (so every prefill group gets the same query block), so the specs share
kernels instead of each compiling its own.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attention_reference import (
    BatchSpec,
    Geometry,
    PagedCase,
    dense_causal_attention,
    expected_positions_and_slots,
    make_block_tables,
    reference_paged_attention,
    rel_err,
)
from flexpage.attention.flex import FlexRunner
from flexpage.attention.paging import build_paged_batch
from flexpage.attention.thread_balance import PADDING_ROW as P
from flexpage.attention.thread_balance import thread_balanced_layout
from flexpage.recipes.causal import causal

pytestmark = pytest.mark.usefixtures("compile_budget", "single_torch_thread")

PAGE_SIZE = 16
NUM_PAGES = 48  # page 0 is the null page
TABLE_WIDTH = 8  # pages per block-table row: up to 128 tokens per sequence

# ---- batch specs ---------------------------------------------------------------------

PREFILL_ONLY = BatchSpec(
    "prefill_only",  # fresh prompts, no cached context; 48/64 fill whole pages, 33/17 spill one token
    seq_lens=(48, 33, 64, 17),
    query_lens=(48, 33, 64, 17),
)
CHUNKED_PREFILL = BatchSpec(
    "chunked_prefill",  # prefill chunks after cached context (40 / 16 = one exact page / 63 = one short of 4)
    seq_lens=(80, 50, 96),
    query_lens=(40, 34, 33),
    shared_prefix=((0, 1, 1), (0, 2, 2)),
)
DECODE_ONLY = BatchSpec(
    "decode_only",  # one new token each: a 1-token prompt, the last slot of a page, the first of a new one
    seq_lens=(1, 16, 17, 32, 33, 100),
    query_lens=(1, 1, 1, 1, 1, 1),
    shared_prefix=((3, 4, 1), (4, 5, 2)),
)
MIXED = BatchSpec(
    "mixed",  # vLLM's [32,40,48,56] / [1,1,5,5] plus two long chunks, decode and prefill in ONE call
    seq_lens=(32, 40, 48, 56, 96, 33),
    query_lens=(1, 1, 5, 5, 40, 33),
    shared_prefix=((0, 1, 1), (1, 4, 2)),
)
SPECS = [PREFILL_ONLY, CHUNKED_PREFILL, DECODE_ONLY, MIXED]


# ---- model geometries: every spec on the main one, the mixed spec (both group kinds) on the others

FP32_GQA_D64 = Geometry("fp32-gqa8/2-d64", torch.float32, 8, 2, 64, 1e-5)
FP32_MQA_D128 = Geometry("fp32-mqa4/1-d128", torch.float32, 4, 1, 128, 1e-5)
BF16_GQA_D256 = Geometry("bf16-gqa4/2-d256", torch.bfloat16, 4, 2, 256, 2e-2)
# SmolLM2's shape: 3 query heads per kv head, so the tuned bf16 template's row-blocked
# micro-gemms run with 3-row blocks in decode and a row tail in prefill (96-row blocks)
BF16_GQA_D64 = Geometry("bf16-gqa9/3-d64", torch.bfloat16, 9, 3, 64, 2e-2)

CASES = [(FP32_GQA_D64, spec) for spec in SPECS] + [
    (g, MIXED) for g in (FP32_MQA_D128, BF16_GQA_D256, BF16_GQA_D64)]


def causal_case(spec: BatchSpec, geometry: Geometry, *, seed: int = 0) -> PagedCase:
    return PagedCase(spec, geometry, causal(), page_size=PAGE_SIZE, num_pages=NUM_PAGES, width=TABLE_WIDTH, seed=seed)


# ---- the reference itself ----------------------------------------------------------------


def test_reference_equals_sdpa_for_one_contiguous_causal_sequence():
    """Sanity of the test oracle: pages 1..4 in order, GQA 4/2, agrees with SDPA(is_causal)."""
    g = torch.Generator().manual_seed(1)
    seq_len, heads, kv_heads, dim = 64, 4, 2, 32
    k_pool = torch.randn(1, kv_heads, 5 * PAGE_SIZE, dim, generator=g)
    v_pool = torch.randn(1, kv_heads, 5 * PAGE_SIZE, dim, generator=g)
    q = torch.randn(seq_len, heads, dim, generator=g)
    table = torch.tensor([[1, 2, 3, 4]])
    ref = reference_paged_attention(q, k_pool, v_pool, table, [seq_len], [seq_len], page_size=PAGE_SIZE)
    sdpa = dense_causal_attention(q.transpose(0, 1), k_pool[0, :, 16:80], v_pool[0, :, 16:80])
    torch.testing.assert_close(ref, sdpa.transpose(0, 1), rtol=1e-12, atol=1e-12)


# ---- the batch plan ------------------------------------------------------------------------


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_batch_plan_positions_and_slots(spec: BatchSpec):
    """Every new token's logical position and pool slot follow its sequence's block table."""
    g = torch.Generator().manual_seed(0)
    tables = make_block_tables(spec, page_size=PAGE_SIZE, num_pages=NUM_PAGES, width=TABLE_WIDTH, generator=g)
    seq_lens, query_lens = spec.tensors()
    batch = build_paged_batch(tables, seq_lens, query_lens, page_size=PAGE_SIZE, num_pages=NUM_PAGES, recipe=causal())
    positions, slots = expected_positions_and_slots(spec, tables, PAGE_SIZE)
    assert batch.num_tokens == spec.num_tokens
    assert torch.equal(batch.positions.long(), positions)
    assert torch.equal(batch.slots.long(), slots)
    assert len(set(slots.tolist())) == len(slots), "two new tokens written to one slot"
    # decode rows and prefill rows are planned as separate groups, but within one batch
    kinds = {"decode" if g.q_len == 1 else "prefill" for g in batch.groups}
    expected = {"decode" if q == 1 else "prefill" for q in spec.query_lens}
    assert kinds == expected
    # every new token appears in exactly one group row
    index = torch.cat([g.token_index.flatten() for g in batch.groups])
    assert sorted(index[index < spec.num_tokens].tolist()) == list(range(spec.num_tokens))


def test_shared_page_at_two_logical_indices_is_rejected():
    """A physical page shared by two sequences must hold the same positions in both."""
    tables = torch.tensor([[3, 4, 0], [5, 3, 0]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"block_tables: physical page 3 appears at logical pages"):
        build_paged_batch(tables, torch.tensor([32, 32]), torch.tensor([1, 1]), page_size=PAGE_SIZE,
                          num_pages=NUM_PAGES, recipe=causal())


# ---- compiled and eager outputs vs the reference ----------------------------------------------


@pytest.mark.parametrize(("geometry", "spec"), CASES, ids=lambda x: str(x))
def test_compiled_paged_attention_matches_reference(geometry: Geometry, spec: BatchSpec):
    step = causal_case(spec, geometry)
    out = step.run(compile=True)
    assert out.shape == step.q.shape and out.dtype == geometry.dtype
    err = rel_err(out, step.reference())
    assert err < geometry.tol, f"{geometry} {spec}: relative error {err:.2e}"


def test_a_batch_already_in_kernel_row_order_skips_the_gather_and_still_matches():
    """Four decode rows (a power of two: no padding rows) are the kernel's rows as they come."""
    spec = BatchSpec("decode_in_order", seq_lens=(1, 16, 17, 33), query_lens=(1, 1, 1, 1), shared_prefix=((2, 3, 1),))
    step = causal_case(spec, FP32_GQA_D64)
    [group] = step.batch.groups
    assert group.covers_batch_in_order
    assert not causal_case(DECODE_ONLY, FP32_GQA_D64).batch.groups[0].covers_batch_in_order  # 6 rows pad to 8
    err = rel_err(step.run(compile=True), step.reference())
    assert err < FP32_GQA_D64.tol, f"relative error {err:.2e}"


@pytest.mark.parametrize(("geometry", "spec"), CASES, ids=lambda x: str(x))
def test_eager_paged_attention_matches_reference(geometry: Geometry, spec: BatchSpec):
    """``FlexRunner(compile=False)`` runs the same program unfused; eager mode visits every slot."""
    step = causal_case(spec, geometry)
    err = rel_err(step.run(compile=False), step.reference())
    assert err < geometry.tol, f"{geometry} {spec}: relative error {err:.2e}"


def test_tuned_cpu_template_is_used_only_for_flexpage_kernels(monkeypatch: pytest.MonkeyPatch):
    """flexpage's kernels get the tuned template: every dtype the lean key-block loop (tail
    trimming, no identity score mod, no list search), bf16 also P@V through the micro-gemm
    and rows blocked (on AVX512-BF16 dot products where the CPU has them); the same
    flex_attention compiled without flexpage's kernel option stays stock."""
    from torch._inductor import config as inductor_config
    from torch._inductor.cpu_vec_isa import VecAVX512, pick_vec_isa
    from torch._inductor.utils import run_and_get_code
    from torch.nn.attention.flex_attention import flex_attention

    from flexpage.attention import flex
    from flexpage.backends.cpu import template_tuning

    def fresh_code_object(*args):  # Dynamo caches per code object: compile anew, whatever ran before
        return flex._group_attention(*args)

    monkeypatch.setattr(flex, "_compiled_group_attention", torch.compile(fresh_code_object, fullgraph=True))
    with inductor_config.patch(force_disable_caches=True):
        codes = {}
        for geometry in (BF16_GQA_D64, FP32_GQA_D64):
            _, (codes[geometry.dtype], *_) = run_and_get_code(causal_case(DECODE_ONLY, geometry).run, compile=True)
        q = torch.randn(1, 2, 32, 64, dtype=torch.bfloat16)
        stock = torch.compile(flex_attention, dynamic=False)
        _, (stock_code, *_) = run_and_get_code(stock, q, q, q)
    for code in codes.values():
        assert "flexpage: the mask was evaluated before the gemm" in code
        assert "apply score mod function" not in code  # causal: the score mod is the identity
        assert "std::find(kv_indice_list" not in code
        # K/V are packed (where the CPU packs at all) for the visited key blocks only, into buffers sized by them
        assert "flexpage: only the visited key blocks are packed" in code
        assert "allocate(batchSize_k*num_head_k*packed_k_stride" in code
        assert "allocate(batchSize_k*num_head_k*packed_v_stride" in code
        assert "num_head_k * kvSlice" not in code  # the packing loop walks the visited blocks, not the pool
        assert "flexpage: the row's max, nothing stored" in code
    # AVX-512 code (not AVX2: ATEN_CPU_CAPABILITY=avx2 or an older CPU) also runs bf16 P@V through the
    # micro-gemm and blocks the 3 packed query heads of a decode row in one register block
    avx512 = isinstance(pick_vec_isa(), VecAVX512)
    assert ("flexpage: P@V through the micro-gemm" in codes[torch.bfloat16]) is avx512
    assert ("transpose_b_kernel<3, 16" in codes[torch.bfloat16]) is avx512
    assert "flexpage: P@V through the micro-gemm" not in codes[torch.float32]
    # on CPUs with AVX512-BF16 (AVX-512 code) both bf16 micro-gemms call the dot-product helpers
    dot = bool(template_tuning.dot_bf16_option())
    switched_off = os.environ.get(template_tuning.DOT_BF16_ENV_SWITCH) == "0"
    assert dot == (avx512 and torch.cpu._is_avx512_bf16_supported() and not switched_off)
    for helper in ("flexpage_dot_bf16::qk<BLOCK_M, accum>", "flexpage_dot_bf16::pv<BLOCK_M, accum>",
                   "flexpage_dot_bf16::exp_sum_bf16(qk_data"):
        assert (helper in codes[torch.bfloat16]) is dot
        assert helper not in codes[torch.float32]
    # whole 16-row blocks (prefill query blocks) go to rows_of_16; a decode row's 3 packed heads never do
    assert "flexpage_dot_bf16::rows_of_16<" not in codes[torch.bfloat16]
    assert "flexpage" not in stock_code
    assert "transpose_b_kernel<3, 16" not in stock_code
    assert "std::find(kv_indice_list" in stock_code


def test_avx2_float32_prefill_kernels_run_the_avx2_q_k_helper_and_plain_index_loads(monkeypatch: pytest.MonkeyPatch):
    """In AVX2 code (a CPU without AVX-512, or ``ATEN_CPU_CAPABILITY=avx2``) float32 prefill
    query blocks compute q @ k^T with ``avx2_fp32.h`` in row blocks, and the mask code loads
    its key indices with plain full-width loads; AVX-512 code has neither. Either way the
    prefill (query blocks with row and column tails) equals the reference."""
    import re

    from torch._inductor import config as inductor_config
    from torch._inductor.cpu_vec_isa import VecAVX512, pick_vec_isa
    from torch._inductor.utils import run_and_get_code

    from flexpage.attention import flex

    def fresh_code_object(*args):  # Dynamo caches per code object: compile anew, whatever ran before
        return flex._gathered_group_attention(*args)

    monkeypatch.setattr(flex, "_compiled_gathered_group_attention",
                        torch.compile(fresh_code_object, dynamic=False, fullgraph=True))
    step = causal_case(PREFILL_ONLY, FP32_GQA_D64)
    with inductor_config.patch(force_disable_caches=True):
        out, codes = run_and_get_code(step.run, compile=True)
    assert rel_err(out, step.reference()) < FP32_GQA_D64.tol
    code = "\n".join(codes)
    avx2 = not isinstance(pick_vec_isa(), VecAVX512)
    assert ("flexpage_avx2_fp32::qk<BLOCK_M, accum>" in code) is avx2
    assert "transpose_b_kernel<16, 16" in code  # prefill rows are blocked on either ISA
    if avx2:
        assert "VectorizedN<int64_t,2>::loadu(in_ptr4 + static_cast<int64_t>(x1));" in code
        assert not re.search(r"VectorizedN<int64_t,2>::loadu\([^;]*, static_cast<int64_t>\(8\)\);", code)


def test_only_full_width_counted_int64_loads_become_plain_loads():
    """The AVX2 rewrite of Inductor's mask code touches a counted int64 load only where the
    count fills the vectors (2 x 4 lanes) and is the load's own last argument; tail loads,
    whose counts are expressions, partial counts and other calls' arguments are kept."""
    from flexpage.backends.cpu.template_tuning import _full_int64_loads

    load = "auto tmp0 = at::vec::VectorizedN<int64_t,2>::loadu(in_ptr4 + static_cast<int64_t>(x1)"
    assert _full_int64_loads(load + ", static_cast<int64_t>(8));") == load + ");"
    tail = (load + ", static_cast<int64_t>(cur_kvSplitSize + (-8L)*(c10::div_floor_integer("
            "static_cast<int64_t>(cur_kvSplitSize), static_cast<int64_t>(8L)))));")
    partial = load + ", static_cast<int64_t>(4));"
    other_type = "auto tmp1 = at::vec::Vectorized<float>::loadu(in_ptr0 + x1, static_cast<int64_t>(8));"
    later_call = load + ", n) + f(q, static_cast<int64_t>(8));"  # the count is another call's
    for kept in (tail, partial, other_type, later_call):
        assert _full_int64_loads(kept) == kept


# ---- kernel key blocks of several pages -------------------------------------------------------

RUN = 4  # pages per kernel key block in these tests (the engine uses 128-token blocks)


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("layout", ["aligned-runs", "shuffled"])
def test_kernel_blocks_of_several_pages_match_reference(spec: BatchSpec, layout: str):
    """Key blocks of ``RUN`` aligned pages: pages handed out in aligned runs (some blocks wholly
    owned by a row, others shared through a prefix or partly empty) or shuffled (no block is
    owned by one row) give the same attention."""
    step = PagedCase(spec, FP32_GQA_D64, causal(), page_size=PAGE_SIZE, num_pages=NUM_PAGES, width=TABLE_WIDTH,
                     pages_per_block=RUN)
    if layout == "shuffled":
        step = PagedCase(spec, FP32_GQA_D64, causal(), page_size=PAGE_SIZE, num_pages=NUM_PAGES, width=TABLE_WIDTH)
        seq_lens, query_lens = spec.tensors()
        step.batch = build_paged_batch(step.block_tables, seq_lens, query_lens, page_size=PAGE_SIZE,
                                       num_pages=NUM_PAGES, recipe=causal(), pages_per_block=RUN)
    for compile in (True, False):
        err = rel_err(step.run(compile=compile), step.reference())
        assert err < FP32_GQA_D64.tol, f"{spec} {layout} compile={compile}: relative error {err:.2e}"


def test_compiled_kernel_never_reads_past_a_sequence_end_in_its_last_key_block():
    """The unfilled tail of a row's last key block is skipped, not read and masked: NaN there
    (which a masked read would turn into NaN output, since 0 * NaN = NaN) changes nothing.
    Eager mode reads every slot, so this holds for the compiled kernel only."""
    step = PagedCase(MIXED, FP32_GQA_D64, causal(), page_size=PAGE_SIZE, num_pages=NUM_PAGES, width=TABLE_WIDTH,
                     pages_per_block=RUN)
    before = step.run()
    block_tokens = PAGE_SIZE * RUN
    poisoned = 0
    for row, seq_len in enumerate(MIXED.seq_lens):
        last_slot = int(step.block_tables[row, (seq_len - 1) // PAGE_SIZE]) * PAGE_SIZE + (seq_len - 1) % PAGE_SIZE
        block_end = (last_slot // block_tokens + 1) * block_tokens  # each row's last run is its own (fresh) run
        for pool in (step.k_pool, step.v_pool):
            pool[0, :, last_slot + 1:block_end] = float("nan")
        poisoned += block_end - last_slot - 1
    assert poisoned > 0
    after = step.run()
    torch.testing.assert_close(after, before, rtol=0, atol=0)


@pytest.mark.parametrize(("tables", "seq_lens", "one_owner"), [
    ([[4, 5, 6, 0], [8, 9, 0, 0]], [40, 20], True),  # each row in its own run of 4 pages
    ([[4, 5, 6, 0], [4, 9, 0, 0]], [40, 20], False),  # page 4 shared (a common prefix)
    ([[4, 5, 0, 0], [6, 0, 0, 0]], [20, 10], False),  # two rows' pages in run 1
    ([[4, 5, 0, 0], [8, 6, 0, 0]], [20, 10], True),  # row 1's page 6 lies past its length: not in use
])
def test_one_owner_per_block_tells_whether_the_mask_needs_its_ownership_check(tables, seq_lens, one_owner):
    batch = build_paged_batch(torch.tensor(tables, dtype=torch.int32), torch.tensor(seq_lens), torch.tensor([1, 1]),
                              page_size=PAGE_SIZE, num_pages=NUM_PAGES, recipe=causal(), pages_per_block=RUN)
    assert batch.one_owner_per_block is one_owner


@pytest.mark.parametrize("spec", [PREFILL_ONLY, MIXED], ids=str)
def test_compiled_kernel_without_the_ownership_check_matches_reference(spec: BatchSpec):
    """Private runs (no shared prefix) let the compiled mask skip the ownership check; a shared
    prefix keeps it. Either way free slots in a listed block hold garbage and stay invisible."""
    step = PagedCase(spec, FP32_GQA_D64, causal(), page_size=PAGE_SIZE, num_pages=NUM_PAGES, width=TABLE_WIDTH,
                     pages_per_block=RUN)
    assert step.batch.one_owner_per_block is (not spec.shared_prefix)
    err = rel_err(step.run(compile=True), step.reference())
    assert err < FP32_GQA_D64.tol, f"{spec}: relative error {err:.2e}"


def test_kernel_block_is_full_only_when_one_row_owns_every_page():
    """Row 0 owns run 1 (pages 4-7) outright and is past it: one full block. Row 1 shares
    row 0's first two pages and continues in run 2: run 1 holds pages it does not own, so
    it is partial there, as is run 2 (partly empty)."""
    tables = torch.tensor([[4, 5, 6, 7, 8, 0], [4, 5, 10, 11, 0, 0]], dtype=torch.int32)
    batch = build_paged_batch(tables, torch.tensor([70, 60]), torch.tensor([1, 1]), page_size=PAGE_SIZE,
                              num_pages=NUM_PAGES, recipe=causal(), pages_per_block=RUN)
    (decode,) = batch.groups
    assert decode.full_kv_num_blocks[:2, 0, 0].tolist() == [1, 0]
    assert decode.full_kv_indices[0, 0, 0, 0] == 1
    assert decode.kv_num_blocks[:2, 0, 0].tolist() == [1, 2]
    assert decode.kv_indices[0, 0, 0, 0] == 2
    assert sorted(decode.kv_indices[1, 0, 0, :2].tolist()) == [1, 2]


def test_prefill_rows_read_their_own_keys_gathered_in_logical_order():
    """Prefill rows (two fresh prompts, one chunk after 300 cached tokens) attend over a copy
    of their keys: each row's positions in order from ``kv_start[row]``, padded to whole
    128-token key blocks with slot 0 (the null page), rows one after another; key block ids
    count in that copy. A decode row reads the pool in place. The chunked row's first two key
    blocks are wholly visible to its query block; the fresh rows' diagonal blocks are partial."""
    tables = torch.zeros(3, 24, dtype=torch.int32)
    tables[0, :2], tables[1, :2] = torch.tensor([3, 4]), torch.tensor([7, 2])
    tables[2, :21] = torch.arange(9, 30)  # 333 tokens: 21 pages
    seq_lens, query_lens = torch.tensor([20, 17, 333]), torch.tensor([20, 17, 33])
    batch = build_paged_batch(tables, seq_lens, query_lens, page_size=PAGE_SIZE, num_pages=NUM_PAGES, recipe=causal())
    (prefill,) = batch.groups
    assert prefill.kv_block == 128
    rows = prefill.row_seq[:3].tolist()
    assert sorted(rows) == [0, 1, 2]
    blocks = {0: 1, 1: 1, 2: 3}  # key blocks per sequence
    expected_start = [0]
    for seq in rows:
        expected_start.append(expected_start[-1] + 128 * blocks[seq])
    assert prefill.kv_start.tolist() == expected_start[:3] + [expected_start[3]]  # the padding row holds nothing
    assert prefill.kv_slots.shape == (128 * 5,)
    for r, seq in enumerate(rows):
        length, start = int(seq_lens[seq]), expected_start[r]
        pos = torch.arange(length)
        expected = tables[seq, pos // PAGE_SIZE].long() * PAGE_SIZE + pos % PAGE_SIZE
        assert torch.equal(prefill.kv_slots[start:start + length], expected)
        assert not prefill.kv_slots[start + length:expected_start[r + 1]].any()
    chunked = rows.index(2)  # queries at 300..332: blocks 0 (0-127) and 1 (128-255) wholly visible, 2 partly
    first = expected_start[chunked] // 128
    assert prefill.full_kv_num_blocks[chunked, 0, 0] == 2 and prefill.kv_num_blocks[chunked, 0, 0] == 1
    assert prefill.kv_indices[chunked, 0, 0, 0] == first + 2
    assert sorted(prefill.full_kv_indices[chunked, 0, 0, :2].tolist()) == [first, first + 1]
    fresh = rows.index(0)
    assert prefill.full_kv_num_blocks[fresh, 0, 0] == 0 and prefill.kv_num_blocks[fresh, 0, 0] == 1
    assert prefill.kv_indices[fresh, 0, 0, 0] == expected_start[fresh] // 128
    decode = build_paged_batch(tables, seq_lens, torch.tensor([1, 1, 1]), page_size=PAGE_SIZE, num_pages=NUM_PAGES,
                               recipe=causal()).groups[0]
    assert decode.kv_slots is None and decode.kv_block == PAGE_SIZE


def test_prefill_plan_does_not_depend_on_the_pool_size():
    """The kernel inputs of a prefill group are the same for a pool 100x larger: its work and
    buffers follow the rows' keys, never the pool (bench/prefill.py times it: 64 MiB vs 4 GiB)."""
    step = causal_case(CHUNKED_PREFILL, FP32_GQA_D64)
    seq_lens, query_lens = CHUNKED_PREFILL.tensors()
    plans = [build_paged_batch(step.block_tables, seq_lens, query_lens, page_size=PAGE_SIZE, num_pages=pages,
                               recipe=causal()).groups[0] for pages in (NUM_PAGES, 100 * NUM_PAGES)]
    for name in ("kv_slots", "kv_start", "kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        assert torch.equal(getattr(plans[0], name), getattr(plans[1], name)), name


@pytest.mark.parametrize("num_threads", [0, -1, 1.5])
def test_num_threads_must_be_a_positive_int(num_threads):
    with pytest.raises(ValueError, match=rf"num_threads: got {num_threads}, expected None or a positive int"):
        build_paged_batch(torch.tensor([[1]], dtype=torch.int32), torch.tensor([3]), torch.tensor([1]),
                          page_size=PAGE_SIZE, num_pages=NUM_PAGES, recipe=causal(), num_threads=num_threads)


def test_pool_must_hold_whole_kernel_blocks():
    with pytest.raises(ValueError, match=r"num_pages: got 46, expected a multiple of pages_per_block=4"):
        build_paged_batch(torch.tensor([[1]], dtype=torch.int32), torch.tensor([3]), torch.tensor([1]),
                          page_size=PAGE_SIZE, num_pages=46, recipe=causal(), pages_per_block=4)


def test_eager_paged_attention_with_explicit_scale():
    step = causal_case(MIXED, FP32_GQA_D64, seed=3)
    err = rel_err(step.run(compile=False, scale=0.3), step.reference(scale=0.3))
    assert err < 1e-5


def test_slots_outside_the_block_tables_are_never_read():
    """Rewriting every slot no sequence owns (null page, free pages, slots past seq_len) changes nothing."""
    step = causal_case(MIXED, FP32_GQA_D64, seed=5)
    before = step.run()
    owned = torch.zeros(NUM_PAGES * PAGE_SIZE, dtype=torch.bool)
    for row, seq_len in enumerate(MIXED.seq_lens):
        for pos in range(seq_len):
            owned[int(step.block_tables[row, pos // PAGE_SIZE]) * PAGE_SIZE + pos % PAGE_SIZE] = True
    for pool in (step.k_pool, step.v_pool):
        pool[0, :, ~owned] = 1e4  # huge values would dominate any softmax they leaked into
    after = step.run()
    torch.testing.assert_close(after, before, rtol=0, atol=0)


@pytest.mark.parametrize(("work", "num_rows", "threads", "expected"), [
    ([4000, 4000, 100, 100], 4, 2, [0, 2, 1, 3]),  # both long rows in the first half: one each
    ([4000, 100, 4000, 100], 4, 2, [0, 1, 2, 3]),  # already balanced: batch order kept
    ([100, 3000, 2900, 50, 60, 70], 8, 2, [1, 5, P, P, 2, 0, 4, 3]),  # padded to 8: balanced by work
    ([100, 100, 100, 100, 100, 100], 8, 2, [0, 1, 2, P, 3, 4, 5, P]),  # equal rows: padding spread, order kept
    ([4000, 4000, 100, 100], 4, 1, [0, 1, 2, 3]),  # one thread: nothing to balance
])
def test_rows_are_laid_out_so_each_kernel_thread_gets_equal_work(work, num_rows, threads, expected):
    layout = thread_balanced_layout(np.array(work), num_rows, threads)
    assert layout.tolist() == expected


@settings(max_examples=200, deadline=None)
@given(work=st.lists(st.integers(1, 5000), min_size=1, max_size=40), threads=st.integers(1, 4))
def test_balanced_layout_holds_every_row_once_and_beats_padding_at_the_end(work: list[int], threads: int):
    work_arr = np.array(work)
    num_rows = 1 << (len(work) - 1).bit_length()
    layout = thread_balanced_layout(work_arr, num_rows, threads)
    assert layout.size == num_rows and sorted(layout[layout != P].tolist()) == list(range(len(work)))
    share = -(-num_rows // threads)
    slot_work = np.where(layout == P, 0, work_arr[layout])
    padded_at_end = np.concatenate([work_arr, np.zeros(num_rows - len(work), dtype=work_arr.dtype)])

    def busiest(w: np.ndarray) -> int:
        return max(int(w[t * share:(t + 1) * share].sum()) for t in range(threads))

    assert busiest(slot_work) <= busiest(padded_at_end)


@pytest.mark.parametrize("num_real", [5, 9, 33, 48, 63])
@pytest.mark.parametrize("threads", [2, 4])
def test_equal_rows_spread_their_padding_over_the_threads(num_real: int, threads: int):
    """48 equal decode rows padded to 64 had left two threads 32 and 16 rows: each thread's
    share now holds as many real rows as any other, give or take one."""
    num_rows = 1 << (num_real - 1).bit_length()
    layout = thread_balanced_layout(np.full(num_real, 100), num_rows, threads)
    share = num_rows // threads
    real = [int((layout[t * share:(t + 1) * share] != P).sum()) for t in range(threads)]
    assert sum(real) == num_real and max(real) - min(real) <= 1, real


def test_rows_reordered_for_two_threads_still_match_reference():
    """Two long rows first, short ones after: planned for two threads the rows are reordered
    (so the decode group needs its gather and scatter) and every token's output stays its own."""
    spec = BatchSpec("skewed", seq_lens=(120, 110, 3, 5, 40, 4, 2, 7), query_lens=(1, 1, 1, 1, 33, 1, 1, 1))
    step = causal_case(spec, FP32_GQA_D64)
    seq_lens, query_lens = spec.tensors()
    step.batch = build_paged_batch(step.block_tables, seq_lens, query_lens, page_size=PAGE_SIZE,
                                   num_pages=NUM_PAGES, recipe=causal(), num_threads=2)
    decode = step.batch.groups[0]
    assert decode.row_seq[:7].tolist() != [0, 1, 2, 3, 5, 6, 7] and not decode.covers_batch_in_order
    for compile in (True, False):
        err = rel_err(step.run(compile=compile), step.reference())
        assert err < FP32_GQA_D64.tol, f"compile={compile}: relative error {err:.2e}"


def test_two_kernel_threads_taking_items_one_at_a_time_match_reference():
    """The tuned kernels hand (row, head, query block) items to their threads one at a time;
    with two threads (the suite runs one) a mixed batch of decode and ragged prefill rows, in
    SmolLM2's geometry, still gives every token its own output."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        step = causal_case(MIXED, BF16_GQA_D64)
        err = rel_err(step.run(compile=True), step.reference())
    finally:
        torch.set_num_threads(threads)
    assert err < BF16_GQA_D64.tol, f"relative error {err:.2e}"


def test_sequences_sharing_prefix_pages_see_the_same_prefix():
    """Two decode rows whose first two pages are the same physical pages, given the same new
    token (same q, same K/V at position 32, stored on different pages), produce the same output."""
    spec = BatchSpec("twins", seq_lens=(33, 33, 17), query_lens=(1, 1, 1), shared_prefix=((0, 1, 2),))
    step = causal_case(spec, FP32_GQA_D64, seed=7)
    assert torch.equal(step.block_tables[0, :2], step.block_tables[1, :2])
    assert step.block_tables[0, 2] != step.block_tables[1, 2]
    slots = step.batch.slots
    for pool in (step.k_pool, step.v_pool):
        pool[0, :, slots[1]] = pool[0, :, slots[0]]
    step.q[1] = step.q[0]
    out = step.run()
    torch.testing.assert_close(out[1], out[0], rtol=0, atol=0)
    assert rel_err(out, step.reference()) < 1e-5


@pytest.mark.parametrize("spec", [DECODE_ONLY, CHUNKED_PREFILL], ids=str)
def test_unbucketed_plan_matches_reference(spec: BatchSpec):
    """``bucket=False`` (row counts and query lengths not rounded to powers of two) is the same attention."""
    case = causal_case(spec, FP32_GQA_D64, seed=13)
    seq_lens, query_lens = spec.tensors()
    batch = build_paged_batch(case.block_tables, seq_lens, query_lens, page_size=PAGE_SIZE, num_pages=NUM_PAGES,
                              recipe=causal(), bucket=False)
    assert [g.rows for g in batch.groups] == [spec.num_seqs]
    out = FlexRunner(causal())(case.q, case.k_pool, case.v_pool, batch)
    assert rel_err(out, case.reference()) < 1e-5


def test_eager_multi_head_attention_without_gqa():
    """Equal q and kv head counts (``enable_gqa`` off), head dim 256, eager only."""
    case = causal_case(MIXED, Geometry("fp32-mha2/2-d256", torch.float32, 2, 2, 256, 1e-5), seed=17)
    assert rel_err(case.run(compile=False), case.reference()) < 1e-5


def test_block_table_wider_than_the_pool_is_planned():
    """Block tables padded with the null page beyond the pool's page count still plan and run.

    BUG (flexpage/attention/kernel_blocks.py, ``compact_block_lists``): ``out[..., : ids.shape[-1]] = ids`` with
    ``out`` only ``num_pages`` wide fails with a shape RuntimeError when the table row is wider
    than the pool (here 6 entries, 4 pages); the selected pages (always <= num_pages, they are
    distinct) come first, so copying the first ``min(width, num_pages)`` columns is enough.
    """
    spec = BatchSpec("wide", seq_lens=(20, 5), query_lens=(1, 5))
    case = PagedCase(spec, FP32_GQA_D64, causal(), page_size=PAGE_SIZE, num_pages=4, width=6, seed=19)
    assert rel_err(case.run(compile=False), case.reference()) < 1e-5


# ---- bad input: ValueError naming the argument and both values --------------------------------


@pytest.fixture(scope="module")
def small_step() -> PagedCase:
    return causal_case(MIXED, FP32_GQA_D64, seed=11)


def test_q_with_wrong_token_count_is_rejected(small_step: PagedCase):
    q = small_step.q[:-1]
    with pytest.raises(ValueError, match=rf"q: got \({q.shape[0]}, 8, 64\), expected \[num_tokens={MIXED.num_tokens},"):
        FlexRunner(causal())(q, small_step.k_pool, small_step.v_pool, small_step.batch)


def test_q_with_wrong_rank_is_rejected(small_step: PagedCase):
    q = small_step.q[None]
    with pytest.raises(ValueError, match=r"q: got \(1, 85, 8, 64\), expected \[num_tokens=85"):
        FlexRunner(causal())(q, small_step.k_pool, small_step.v_pool, small_step.batch)


def test_q_head_dim_must_match_pool(small_step: PagedCase):
    q = small_step.q[..., :32]
    with pytest.raises(ValueError, match=r"q head_dim: got 32, expected the pool's head_dim 64"):
        FlexRunner(causal())(q, small_step.k_pool, small_step.v_pool, small_step.batch)


def test_q_dtype_must_match_pool(small_step: PagedCase):
    q = small_step.q.bfloat16()
    with pytest.raises(ValueError, match=r"q.dtype: got torch.bfloat16, expected the pool dtype torch.float32"):
        FlexRunner(causal())(q, small_step.k_pool, small_step.v_pool, small_step.batch)


def test_q_heads_must_be_a_multiple_of_kv_heads(small_step: PagedCase):
    q = small_step.q[:, :3]
    with pytest.raises(ValueError, match=r"q heads: got 3, expected a multiple of the pool's 2 kv heads"):
        FlexRunner(causal())(q, small_step.k_pool, small_step.v_pool, small_step.batch)


def test_pool_must_match_the_batch_plan(small_step: PagedCase):
    k, v = small_step.k_pool[:, :, :-PAGE_SIZE], small_step.v_pool[:, :, :-PAGE_SIZE]
    with pytest.raises(ValueError, match=rf"k_pool slots: got {(NUM_PAGES - 1) * PAGE_SIZE}, expected {NUM_PAGES} pages x {PAGE_SIZE}"):
        FlexRunner(causal())(small_step.q, k, v, small_step.batch)


def _plan(tables, seq_lens, query_lens):
    return build_paged_batch(
        torch.tensor(tables, dtype=torch.int32), torch.tensor(seq_lens), torch.tensor(query_lens),
        page_size=PAGE_SIZE, num_pages=NUM_PAGES, recipe=causal(),
    )


def test_block_table_entries_outside_the_pool_are_rejected():
    with pytest.raises(ValueError, match=rf"block_tables: got 'page ids in \[0, {NUM_PAGES}\]', expected ids in \[0, {NUM_PAGES - 1}\]"):
        _plan([[1, 2, 0], [NUM_PAGES, 0, 0]], [20, 5], [1, 1])
    with pytest.raises(ValueError, match=r"block_tables: got 'page ids in \[-1, 2\]', expected ids in \[0, "):
        _plan([[1, 2, 0], [-1, 0, 0]], [20, 5], [1, 1])


def test_sequence_longer_than_its_blocks_is_rejected():
    """seq_len 40 needs 3 pages; the row's third entry is the null page 0."""
    with pytest.raises(ValueError, match=r"block_tables: row 1 has seq_lens 40, which needs 3 pages, but its page 2 is the null page 0"):
        _plan([[1, 0, 0], [2, 3, 0]], [16, 40], [1, 1])


def test_sequence_longer_than_the_table_row_is_rejected():
    with pytest.raises(ValueError, match=r"seq_lens: got 'max 49', expected <= the 48 slots of 3 pages per block table row"):
        _plan([[1, 2, 3], [4, 5, 6]], [48, 49], [1, 1])


def test_query_lens_longer_than_seq_lens_are_rejected():
    with pytest.raises(ValueError, match=r"query_lens: got 6, expected <= seq_lens \(5\)"):
        _plan([[1, 0], [2, 0]], [20, 5], [1, 6])


def test_query_lens_zero_is_rejected():
    with pytest.raises(ValueError, match=r"query_lens: got 'min 0', expected at least one new token per sequence"):
        _plan([[1, 0], [2, 0]], [20, 5], [1, 0])


def test_lengths_must_have_one_entry_per_row():
    with pytest.raises(ValueError, match=r"seq_lens: got \(3,\), expected shape \(2,\)"):
        _plan([[1, 0], [2, 0]], [20, 5, 4], [1, 1])
    with pytest.raises(ValueError, match=r"query_lens: got \(1,\), expected shape \(2,\)"):
        _plan([[1, 0], [2, 0]], [20, 5], [1])


def test_float_block_tables_are_rejected():
    with pytest.raises(ValueError, match=r"block_tables.dtype: got torch.float32, expected an integer dtype"):
        build_paged_batch(torch.tensor([[1.0]]), torch.tensor([3]), torch.tensor([1]), page_size=PAGE_SIZE,
                          num_pages=NUM_PAGES, recipe=causal())


def test_compiled_decode_with_more_rows_than_the_page_size():
    """Regression: 33 decode rows and a 33-page-wide table once named two kernel bounds alike
    (a PyTorch CPU-template size-symbol clash) and indexed out of bounds."""
    spec = BatchSpec("decode-33", seq_lens=tuple(100 + 16 * i for i in range(33)), query_lens=(1,) * 33)
    step = PagedCase(spec, FP32_GQA_D64, causal(), page_size=16, num_pages=1200, width=64)
    err = rel_err(step.run(compile=True), step.reference())
    assert err < FP32_GQA_D64.tol, f"relative error {err:.2e}"


def test_pages_released_by_a_sliding_window_are_never_visited():
    """Window 20, pages of 16: rows at 60 (decode) and 50..59 (chunk) see nothing below page 2
    (positions 32+ only for the decode row; 31+ for the chunk needs page 1), so those pages may be
    the null page: the output equals the full table's, with garbage in page 0 and the old pages."""
    from flexpage.recipes.sliding_window import sliding_window

    g = torch.Generator().manual_seed(3)
    recipe = sliding_window(20)
    k_pool = torch.randn(1, 2, NUM_PAGES * PAGE_SIZE, 32, generator=g)
    v_pool = torch.randn(1, 2, NUM_PAGES * PAGE_SIZE, 32, generator=g)
    q = torch.randn(1 + 10, 4, 32, generator=g)
    seq_lens, query_lens = torch.tensor([61, 60]), torch.tensor([1, 10])

    def run(tables):
        batch = build_paged_batch(torch.tensor(tables, dtype=torch.int32), seq_lens, query_lens,
                                  page_size=PAGE_SIZE, num_pages=NUM_PAGES, recipe=recipe)
        return FlexRunner(recipe, compile=False)(q, k_pool, v_pool, batch)

    full = run([[1, 2, 3, 4], [5, 6, 7, 8]])
    released = run([[0, 0, 3, 4], [0, 6, 7, 8]])
    torch.testing.assert_close(released, full, rtol=0, atol=0)
    # a page some query still sees, or a full-attention recipe, keeps the clear error
    with pytest.raises(ValueError, match=r"row 1 has seq_lens 60, which needs 4 pages, but its page 1 is the null page 0"):
        run([[0, 0, 3, 4], [0, 0, 7, 8]])
    with pytest.raises(ValueError, match=r"row 0 has seq_lens 61, which needs 4 pages, but its page 0 is the null page 0"):
        build_paged_batch(torch.tensor([[0, 0, 3, 4]], dtype=torch.int32), torch.tensor([61]), torch.tensor([1]),
                          page_size=PAGE_SIZE, num_pages=NUM_PAGES, recipe=causal())


def test_a_decode_row_skips_pages_its_kv_budget_evicted_and_keeps_true_positions():
    """Row at position 60 holds pages 1, 3, 4 of its table (logical page 1, positions 16-31,
    evicted): attention equals a float64 softmax over positions 0-15 and 32-60 only, with ALiBi
    distances from the true positions. Without ``evicted_pages`` the hole is an error, and a
    chunk of several new tokens (a gathered copy) is never allowed one."""
    from flexpage.recipes.alibi import alibi, alibi_slopes

    g = torch.Generator().manual_seed(5)
    recipe = alibi(4)
    k_pool = torch.randn(1, 2, NUM_PAGES * PAGE_SIZE, 32, generator=g)
    v_pool = torch.randn(1, 2, NUM_PAGES * PAGE_SIZE, 32, generator=g)
    q = torch.randn(1, 4, 32, generator=g)
    table = torch.tensor([[1, 0, 3, 4]], dtype=torch.int32)
    batch = build_paged_batch(table, torch.tensor([61]), torch.tensor([1]), page_size=PAGE_SIZE, num_pages=NUM_PAGES,
                              recipe=recipe, evicted_pages=True)
    out = FlexRunner(recipe, compile=False)(q, k_pool, v_pool, batch)

    positions = torch.cat([torch.arange(16), torch.arange(32, 61)])
    slots = torch.cat([torch.arange(16, 32), torch.arange(48, 77)])  # page 1, then pages 3 and 4
    keys, values = k_pool[0, :, slots].double(), v_pool[0, :, slots].double()  # [2, n, 32]
    heads = torch.arange(4)
    scores = torch.einsum("hd,hnd->hn", q[0].double(), keys[heads // 2]) / 32 ** 0.5
    scores = scores + alibi_slopes(4).double()[:, None] * (positions - 60).double()
    want = torch.einsum("hn,hnd->hd", scores.softmax(-1), values[heads // 2])
    torch.testing.assert_close(out[0].double(), want, rtol=0, atol=1e-5)

    with pytest.raises(ValueError, match="its page 1 is the null page 0"):
        build_paged_batch(table, torch.tensor([61]), torch.tensor([1]), page_size=PAGE_SIZE, num_pages=NUM_PAGES,
                          recipe=recipe)
    with pytest.raises(ValueError, match="its page 1 is the null page 0"):
        build_paged_batch(table, torch.tensor([61]), torch.tensor([3]), page_size=PAGE_SIZE, num_pages=NUM_PAGES,
                          recipe=recipe, evicted_pages=True)


def test_gathered_rows_attend_in_float32_where_reduced_precision_kernels_cannot_use_amx(monkeypatch):
    """bf16/fp16 prefill rows run the float32 kernel on CPUs without AMX (its reduced-precision
    path there widens every load anyway, and is slower), except bf16 where the kernels run
    AVX512-BF16 dot products; with AMX, and off the CPU, they keep their dtype. float32 is
    never changed."""
    import dataclasses

    from flexpage.attention import flex
    from flexpage.backends.cpu.description import read_machine

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for isa, avx512_bf16, bf16, fp16 in (("avx2", False, torch.float32, torch.float32),
                                         ("avx512", True, torch.bfloat16, torch.float32),
                                         ("avx512 avx512_vnni amx_tile", False, torch.bfloat16, torch.float16)):
        fake = dataclasses.replace(read_machine(), vec_isa=isa, avx512_bf16=avx512_bf16, amx_fp16=True,
                                   dot_bf16_switch=True)
        monkeypatch.setattr(flex, "describe", lambda fake=fake: fake)
        flex.gathered_attention_dtype.cache_clear()
        assert flex.gathered_attention_dtype(torch.bfloat16, cpu) == bf16
        assert flex.gathered_attention_dtype(torch.float16, cpu) == fp16
        assert flex.gathered_attention_dtype(torch.float32, cpu) == torch.float32
        assert flex.gathered_attention_dtype(torch.bfloat16, cuda) == torch.bfloat16
    flex.gathered_attention_dtype.cache_clear()
