"""An opt-in tuning of PyTorch's CPU FlexAttention template for paged attention (torch 2.13).

The CPU template visits one (row, head, key block) at a time. For every dtype the tuned
template cuts what a visit costs beyond reading the block:

- a partial block's mask (it depends on indices only) is evaluated *before* the q@k^T gemm,
  and the block is shortened to its last column some query row can see (both found and
  applied in vector code: as scalar loops they were a quarter of a bf16 prefill kernel's
  non-gemm time; 4x256 GQA prefill 1.47-1.50 vs 1.70-2.14 ms): a sequence's last
  key block is usually partly filled, and the stock template reads all of it (K and V) and
  masks the unfilled slots afterwards;
- no per-block heap allocation of index buffers, no identity score mod (a copy of the score
  tile onto itself), no linear search to tell partial from full blocks (partial ones are
  listed first), no pool-sized K/V packing buffers per call unless the kernel packs;
- its threads take (row, head, query block) items one at a time from a shared counter, not
  in equal contiguous shares: items differ in cost (causal query blocks, rows of other
  lengths, padding), and a prefill's static split left one of two threads waiting ~20% of
  the kernel's time (the anchors workload's prefill 3.06-3.22 -> 2.86-3.11 s, Zen 5).

For the small query blocks of bf16/fp16 decode (one token's ``G`` packed query heads: 1-8
rows) two more choices cost more than the attention itself (``perf`` of a batch-64 GQA
decode call: 28% in MKL's generic bf16 gemm, 22% in the q@k^T micro-gemm):

- ``P @ V`` goes through ``cpublas::brgemm``, which for unpacked bf16 falls back to a full
  MKL gemm call per key block (converting to fp32 inside). The template already has a
  micro-gemm for it (its fp16 path uses it); the tuned template uses it for bf16 too.
- Its micro-gemms block one query row at a time (``GemmBlocking(1, 16, 1)``), so each key
  tile is reloaded for every row. The tuned template blocks ``min(query block rows, 16)``
  rows, which keeps the whole query block in registers for decode.

Those two give 1.5-3x faster bf16 decode calls. A decode call also reads each key block once,
from memory, with little work per byte: each of its visits starts the reads of its block's values
and of the next key block (software prefetch; 15-20% faster bf16 decode calls once the KV
outgrows the caches). On CPUs with AVX512-BF16, kernels compiled
with a non-empty ``DOT_BF16_OPTION`` (flexpage passes one there, see :func:`dot_bf16_option`)
run both bf16 micro-gemms on ``vdpbf16ps`` (``_dot_bf16.h``):
a pair of bf16 products per float32 lane, no widening, half the shuffles of the stock
transposed tile; ``q @ k^T`` prefetches the next 16 key rows while it computes (a decode call
streams its keys from memory, and the loads waited: ~15% faster bf16 decode calls). Prefill
query blocks (whole blocks of 16 rows) go to its ``rows_of_16``, which copies the rows and
rearranges each key or value tile once per call rather than once per 16 rows, at strides the
compiler knows (the per-tile helpers spilled their row addresses and accumulators); their
softmax converts the probabilities to bf16 with ``vcvtneps2bf16`` (``exp_sum_bf16``), and
every tuned kernel finds a row's max without storing the row again: a 1,024-token bf16 GQA
prefill call took ~2.6-2.9 ms instead of 4.2 (AMD EPYC Zen 5). float32
decode keeps ``brgemm`` and one-row blocks (a fast sgemm there; both changes measured
slower); float32 prefill query blocks
(32 rows) block 16 rows in the q@k^T micro-gemm: 1.4-2x faster prefill calls
(``bench/prefill.py``). In AVX2 code (no AVX-512) only float32 prefill is tuned that way,
and its q@k^T runs on ``_avx2_fp32.h`` (the stock AVX2 transposed micro-gemm gains nothing
from row blocks); its mask code loads key indices with plain loads (:func:`_full_int64_loads`).
Numerics are identical up to float summation order.

Where the kernel packs K and V into the VNNI layout for its AMX brgemm (bf16/fp16 query
blocks of 64+ rows on CPUs with AMX), the stock template packs every key block of the pool
on every call; the tuned one packs only the blocks the call visits.

Only kernels compiled with ``kernel_options={TUNED_OPTION: TUNING_VERSION}`` get the tuned
template (flexpage always passes it); everything else in the process, including PyTorch's
experimental ``PagedAttention`` our benchmark compares against, stays stock. The option is
part of the compiled graph, so Inductor's cache keys tuned and stock kernels apart -- and
kernels of an older tuning: bump ``TUNING_VERSION`` whenever the tuning changes (the FX
graph cache does not see template text).
"""

from __future__ import annotations

import contextvars
import hashlib
import os
import re
from pathlib import Path
from typing import Any, NamedTuple
from types import SimpleNamespace

import torch

from flexpage.attention._vec_isa_cache import cpu_vec_isa

TUNED_OPTION = "FLEXPAGE_TUNED_CPU_TEMPLATE"
#: kernel option: every query row computed by the same arithmetic whatever the call's shape (see
#: :data:`_DETERMINISTIC_EDITS`); only with :data:`TUNED_OPTION`
DETERMINISTIC_OPTION = "FLEXPAGE_DETERMINISTIC_CPU_TEMPLATE"
#: kernel option: bf16 micro-gemms on AVX512-BF16 dot products (see :func:`dot_bf16_option`);
#: only with :data:`TUNED_OPTION`, never deterministic
DOT_BF16_OPTION = "FLEXPAGE_AVX512_BF16_DOT"
DOT_BF16_ENV_SWITCH = "FLEXPAGE_BF16_DOT"  # "0": stock bf16 micro-gemms (for comparisons)
TUNING_VERSION = 32  # 2: float32 kernels stay stock; 5: lean per-key-block work and tail trimming, every dtype;
# 6: no K/V packing buffers unless packing; 7: only the visited key blocks are packed;
# 12: float32 prefill micro-gemms block up to 16 rows (8-11: experiments);
# 13: AVX2 kernels never pack and keep stock micro-gemms; 14-15: deterministic kernels;
# 16-17: deterministic kernels block rows too; 18: bf16 dot-product micro-gemms;
# 19: AVX2 float32 prefill blocks rows, q @ k^T on _avx2_fp32.h; AVX2 full-width int64 loads plain;
# 20: the bf16 q @ k^T prefetches the next 16 key rows; 21: a partial block's mask applied and trimmed in vector code;
# 22: no stock q @ k^T fallback where the head dimension is a known multiple of the helper's step;
# 23: a tail of rows computed in power-of-two row blocks; 24: items handed to threads one at a time;
# 25-26: bf16 prefill micro-gemms in whole 16-row blocks (_dot_bf16.h rows_of_16), AVX512-BF16 probabilities, row max
# 27-32: a bf16/fp16 visit of few query rows (decode) prefetches its block's values and the next block (27-30: experiments)
_MAX_BLOCK_M = 16  # float32 prefill: 8 rows 10-15% slower, 32 no faster
_MIN_FP32_BLOCKED_ROWS = 16  # decode blocks (1-8 packed query heads) keep one-row blocking in float32
_STOCK_PV_BRANCH = "          if (!std::is_same_v<scalar_t, at::Half>) {\n            at::native::cpublas::brgemm("
_TUNED_PV_BRANCH = "          if (false) {  // flexpage: P@V through the micro-gemm\n            at::native::cpublas::brgemm("
# The float32 micro-gemm computes q @ k^T (a transposed B) one of two ways, picked by the rows
# of the block it is called for: with 24 x rows <= head_dim (1-2 rows at head_dim 64: a decode
# row, or the last rows of a prefill query block) each score is a dot product reduced across a
# vector, otherwise a sum of broadcast multiply-adds in head-dimension order -- other bits for
# the same row. Deterministic kernels always take the second way (where head_dim is a multiple
# of the vector width), so they can block rows like the tuned ones: their prefill query blocks
# ran 1.7-1.8x slower with one-row blocks (float32 rows, AMD EPYC).
_STOCK_TRANSPOSED_CHOICE = "&& 24 * BLOCK_M > K) {"
_DETERMINISTIC_TRANSPOSED_CHOICE = ") {  // flexpage: deterministic, one way for every row block"

# The micro-gemm kernel template's first line of body; bf16 kernels with DOT_BF16_OPTION call
# the helpers of _dot_bf16.h there (q @ k^T needs a head dimension that is a multiple of 32).
_KERNEL_BODY_START = "    using Vectorized = at::vec::Vectorized<{{compute_t}}>;\n"
_DOT_BF16_CALL = """\
{%- if input_dtype == torch.bfloat16 and input2_dtype == torch.bfloat16 and compute_t == "float" and block_n == 16 %}
    if ({{ "K % 32 == 0" if trans_b else "true" }}) {  // flexpage: AVX512-BF16 dot products
        flexpage_dot_bf16::{{ "qk" if trans_b else "pv" }}<BLOCK_M, accum>(
            reinterpret_cast<const uint16_t*>(A), reinterpret_cast<const uint16_t*>(B), C,
            {{ "N" if tail_n else "BLOCK_N" }}, K, lda, ldb, ldc);
        return;
    }
{%- endif %}
"""
# The micro-gemm entry's first line of its row loop; there bf16 kernels with DOT_BF16_OPTION and
# 16-row blocks (prefill query blocks) compute all whole 16-row blocks with _dot_bf16.h's
# ``rows_of_16`` (one copy of A's rows and one rearranged B tile shared by the blocks), leaving
# only a tail of rows to the per-tile loop.
_ENTRY_ROW_LOOP = "    // TODO(jgong5): loop unroll for M and N\n"
_DOT_BF16_ROWS_CALL = """\
{%- if input_dtype == torch.bfloat16 and input2_dtype == torch.bfloat16 and compute_t == "float" and block_n == 16 and block_m == 16 %}
    if ({{ "K % 32 == 0" if trans_b else "true" }} && M >= 16 && flexpage_dot_bf16::rows_of_16<{{ "true" if trans_b else "false" }}, accum>(
            reinterpret_cast<const uint16_t*>(A), reinterpret_cast<const uint16_t*>(B), C, M, N, K, lda, ldb, ldc)) {
        const int64_t done = M - M % 16;  // flexpage: whole 16-row blocks done, the tail below
        A += done * lda;
        C += done * ldc;
        M -= done;
    }
{%- endif %}
"""
_DOT_BF16_SOURCE = Path(__file__).with_name("_dot_bf16.h").read_text()
_DOT_BF16_HELPERS = "{% raw %}" + _DOT_BF16_SOURCE + "{% endraw %}\n"
# Row-blocked float32 kernels compiled for AVX2 compute q @ k^T with _avx2_fp32.h there
# (bump TUNING_VERSION when the header changes: nothing else puts it in the cache key).
_AVX2_FP32_CALL = """\
{%- if input_dtype == torch.float and input2_dtype == torch.float and trans_b and alpha == 1 %}
    if (K % 8 == 0) {  // flexpage: AVX2 q @ k^T, scores reduced eight at a time
        flexpage_avx2_fp32::qk<BLOCK_M, accum>(A, B, C, {{ "N" if tail_n else "BLOCK_N" }}, K, lda, ldb, ldc);
        return;
    }
{%- endif %}
"""
_AVX2_FP32_HELPERS = "{% raw %}" + Path(__file__).with_name("_avx2_fp32.h").read_text() + "{% endraw %}\n"

# The micro-gemm's entry computes a block of fewer rows than its row block (a query block's last
# rows) with a kernel instantiated for exactly that many rows: 15 instantiations per kernel kind,
# most of the C++ a prefill attention kernel holds. Tuned kernels split such a tail into blocks
# of 8, 4, 2 and 1 rows (the kernels of the rows' own arithmetic: each row is computed alone),
# four instantiations, which cut `g++ -O3` of the bf16 prefill attention kernel from ~5 s to ~3 s.
_TAIL_EDITS = (
    ("""    for (int64_t m = 0; m < M; m += {{block_m}}) {
        int64_t block_m = std::min<int64_t>(M - m, {{block_m}});
""", """    for (int64_t m = 0, block_m = 0; m < M; m += block_m) {
        block_m = std::min<int64_t>(M - m, {{block_m}});
        while (block_m < {{block_m}} && (block_m & (block_m - 1)) != 0) {  // flexpage: tails in powers of two
            block_m &= block_m - 1;
        }
"""),
    ("{%- for b in range(block_m - 1, 0, -1) %}",
     "{%- for b in range(block_m - 1, 0, -1) if b in (1, 2, 4, 8, 16, 32, 64) %}"),
    ("{%- for b in range(block_m, 0, -1) %}",
     "{%- for b in range(block_m, 0, -1) if b == block_m or b in (1, 2, 4, 8, 16, 32, 64) %}"),
)

# Text edits of the stock template (each must match exactly once, else nothing is tuned).
_LEAN_EDITS = (
    # pack_vnni2 exists only in AVX-512 builds of ATen's vector code, but the stock template asks the CPU
    # (AMX present?) rather than the ISA it is compiled for: a kernel compiled for AVX2 on an AMX CPU
    # (ATEN_CPU_CAPABILITY=avx2) failed with "pack_vnni2 is only supported when avx512 is supported"
    ("""  // Pad is needed for packing when K is not even""",
     """#if !defined(CPU_CAPABILITY_AVX512)
  need_pack = false;  // flexpage: VNNI packing needs AVX-512 vector code
#endif
  // Pad is needed for packing when K is not even"""),
    # Where the kernel packs K and V for its AMX brgemm (bf16/fp16 query blocks of 64+ rows: prefill),
    # the stock template packs every key block of the pool, on every call, into buffers sized by the
    # pool; the tuned one packs the key blocks the call visits (listed in the block mask), into
    # buffers sized by them. A bf16 4x256 prefill through the engine cost 444 ms with a 64 MiB pool,
    # 760 ms with 1 GiB, 1,770 ms with 4 GiB (Xeon with AMX). Without packing no buffer is allocated.
    ("""  {{template.codegen_allocate_buffer("key_reorder_ptr", "scalar_t", "batchSize_k*num_head_k*eheadSize*kvSize")}}
  {{template.codegen_allocate_buffer("value_reorder_ptr", "scalar_t", "batchSize_k*num_head_k*kv_padding_size*headSize_v")}}""",
     """  // flexpage: only the visited key blocks are packed
  std::vector<int64_t> packed_blocks;  // the key blocks some query block visits, in packing order
  std::vector<int64_t> packed_index;  // key block -> its place in packed_blocks, -1 where none visits it
  if (need_pack) {
    packed_index.assign(kvSlice, -1);
    auto add_visited = [&](int64_t block) {
      if (block >= 0 && block < kvSlice && packed_index[block] < 0) {
        packed_index[block] = static_cast<int64_t>(packed_blocks.size());
        packed_blocks.push_back(block);
      }
    };
    for (int64_t b = 0; b < batchSize_kvi; ++b) {
      for (int64_t h = 0; h < num_head_kvi; ++h) {
        for (int64_t q = 0; q < qSlice; ++q) {
          int64_t count = kv_num_blocks_data[b * num_kviStrideB + h * num_kviStrideH + q];
          for (int64_t t = 0; t < count; ++t) {
            add_visited(kv_indices_data[b * kviStrideB + h * kviStrideH + q * kviStrideQ + t]);
          }
{%- if has_full_kv_block %}
          count = full_kv_num_blocks_data[b * full_num_kviStrideB + h * full_num_kviStrideH + q];
          for (int64_t t = 0; t < count; ++t) {
            add_visited(full_kv_indices_data[b * full_kviStrideB + h * full_kviStrideH + q * full_kviStrideQ + t]);
          }
{%- endif %}
        }
      }
    }
  }
  const int64_t num_packed = static_cast<int64_t>(packed_blocks.size());
  const int64_t packed_k_stride = eheadSize * num_packed * kvSplitSize;  // per (batch, kv head)
  const int64_t packed_v_stride = num_packed * ekvSplitSize * headSize_v;
  {{template.codegen_allocate_buffer("key_reorder_ptr", "scalar_t", "batchSize_k*num_head_k*packed_k_stride")}}
  {{template.codegen_allocate_buffer("value_reorder_ptr", "scalar_t", "batchSize_k*num_head_k*packed_v_stride")}}"""),
    ("""    at::parallel_for(0, batchSize_k * num_head_k * kvSlice, 1, [&](int64_t begin, int64_t end) {""",
     """    at::parallel_for(0, batchSize_k * num_head_k * num_packed, 1, [&](int64_t begin, int64_t end) {"""),
    ("""      at::native::data_index_init(begin, i, batchSize_k, j, num_head_k, l, kvSlice);""",
     """      at::native::data_index_init(begin, i, batchSize_k, j, num_head_k, l, num_packed);"""),
    ("""        n = l * kvSplitSize;""",
     """        n = packed_blocks[l] * kvSplitSize;"""),
    ("""          /* dst */ reinterpret_cast<uint16_t*>(key_reorder_ptr + i * num_head_k * eheadSize * kvSize +
                  j * eheadSize * kvSize + n * eheadSize),""",
     """          /* dst */ reinterpret_cast<uint16_t*>(key_reorder_ptr + (i * num_head_k + j) * packed_k_stride +
                  l * kvSplitSize * eheadSize),"""),
    ("""          /* dst */ reinterpret_cast<uint16_t*>(value_reorder_ptr +
                  i * num_head_k * kv_padding_size * headSize_v +
                  j * kv_padding_size * headSize_v + n * headSize_v),""",
     """          /* dst */ reinterpret_cast<uint16_t*>(value_reorder_ptr + (i * num_head_k + j) * packed_v_stride +
                  l * ekvSplitSize * headSize_v),"""),
    ("""      at::native::data_index_step(i, batchSize_k, j, num_head_k, l, kvSlice);""",
     """      at::native::data_index_step(i, batchSize_k, j, num_head_k, l, num_packed);"""),
    ("""              key_reorder_ptr + i_kv * num_head_k * eheadSize * kvSize +
                  j_kv * eheadSize * kvSize + n * eheadSize,""",
     """              key_reorder_ptr + (i_kv * num_head_k + j_kv) * packed_k_stride +
                  packed_index[cur_n] * kvSplitSize * eheadSize,"""),
    ("""          int64_t psize = n / kvSplitSize * ekvSplitSize;""",
     """          int64_t psize = packed_index[cur_n] * ekvSplitSize;"""),
    ("""              value_reorder_ptr +
                  i_kv * num_head_k * kv_padding_size * headSize_v +
                  j_kv * kv_padding_size * headSize_v + psize * headSize_v,""",
     """              value_reorder_ptr + (i_kv * num_head_k + j_kv) * packed_v_stride + psize * headSize_v,"""),
    ("""        // TODO: reduce the number of calls of q_idx and kv_idx initialization
        std::vector<int64_t> q_idx(cur_qSplitSize);""",
     """        // flexpage: index buffers kept per thread, not allocated per key block
        thread_local std::vector<int64_t> q_idx;
        q_idx.resize(cur_qSplitSize);"""),
    ("""        std::vector<int64_t> kv_idx(cur_kvSplitSize);
        for (int64_t i = 0; i < cur_kvSplitSize; ++i) {
          kv_idx[i] = n + i;
        }

        std::vector<int64_t> b_idx = {i};
        std::vector<int64_t> h_idx = {j};""",
     """        thread_local std::vector<int64_t> kv_idx;
        kv_idx.resize(cur_kvSplitSize);
        for (int64_t i = 0; i < cur_kvSplitSize; ++i) {
          kv_idx[i] = n + i;
        }

        std::array<int64_t, 1> b_idx = {i};
        std::array<int64_t, 1> h_idx = {j};"""),
    ("""        // apply score mod function
        {""",
     """{%- if not template.flexpage_identity_score %}
        // apply score mod function
        {"""),
    ("""        if ((std::find(kv_indice_list.begin(), kv_indice_list.end(), cur_n) != kv_indice_list.end()) ){""",
     """{%- endif %}
        if (n_idx < kv_indice_num) {  // flexpage: partial blocks are listed (and visited) first"""),
    # A mask depends on indices alone: evaluate a partial block's mask before the q@k^T gemm
    # and shorten the block to its last column some query row can see. A sequence's last key
    # block is usually partly filled; the stock template reads all of it (K and V) and masks
    # the unfilled slots afterwards.
    ("""        int64_t cur_ekvSplitSize = (need_pack && cur_kvSplitSize % 2 != 0) ? cur_kvSplitSize + 1 : cur_kvSplitSize;
""",
     """{%- if score_mod and mask_mod %}
        const accum_t* mask_bias = nullptr;  // flexpage: 0 (visible) / -inf per (row, column), row stride mask_bias_stride
        const int64_t mask_bias_stride = cur_kvSplitSize;
        if (n_idx < kv_indice_num && !need_pack) {
          thread_local std::vector<accum_t> bias_buf;
          bias_buf.assign(cur_qSplitSize * cur_kvSplitSize, accum_t(0));
          thread_local std::vector<int64_t> q_idx, kv_idx;
          q_idx.resize(cur_qSplitSize);
          kv_idx.resize(cur_kvSplitSize);
          for (int64_t i = 0; i < cur_qSplitSize; ++i) {
            q_idx[i] = m + i;
          }
          for (int64_t i = 0; i < cur_kvSplitSize; ++i) {
            kv_idx[i] = n + i;
          }
          std::array<int64_t, 1> b_idx = {i};
          std::array<int64_t, 1> h_idx = {j};
          accum_t* in_ptr0 = bias_buf.data();
          auto in_ptr1 = b_idx.data();
          auto in_ptr2 = h_idx.data();
          auto in_ptr3 = q_idx.data();
          auto in_ptr4 = kv_idx.data();
          {
              {{ template.generate_other_buffer("mask_others", -1, "len_mask_other", kernel.args) }}
              accum_t* out_ptr{{mask_buf_idx}} = in_ptr0;
              {{ template.modification(mask_mod, mask_buf_name, mask_buf_idx)|indent(12, false) }}
          }
          int64_t visible = 1;  // at least one column: a fully masked block then takes the -inf path below
          for (int64_t row = 0; row < cur_qSplitSize; ++row) {  // a visible column's bias is 0, a masked one's -inf
            const accum_t* bias_row = bias_buf.data() + row * mask_bias_stride;
            int64_t col = 0;
            for (; col + Vec::size() <= cur_kvSplitSize; col += Vec::size()) {
              const auto zeros = static_cast<uint64_t>(Vec::loadu(bias_row + col).zero_mask());
              if (zeros != 0) {
                visible = std::max<int64_t>(visible, col + 64 - __builtin_clzll(zeros));
              }
            }
            for (; col < cur_kvSplitSize; ++col) {
              if (bias_row[col] == accum_t(0)) {
                visible = std::max<int64_t>(visible, col + 1);
              }
            }
          }
          mask_bias = bias_buf.data();
          cur_kvSplitSize = visible;
        }
{%- endif %}
        int64_t cur_ekvSplitSize = (need_pack && cur_kvSplitSize % 2 != 0) ? cur_kvSplitSize + 1 : cur_kvSplitSize;
"""),
    # Items (row, head, query block) are taken one at a time from a shared counter instead of in
    # equal contiguous shares: their costs differ (causal query blocks, rows of other lengths,
    # padding), and in a prefill the static split left one thread waiting for the other (~20%
    # of the kernel's time, `perf` of the anchors workload's prefill on 2 cores). An item's
    # result does not depend on the thread that computes it.
    ("""  at::parallel_for(0, batchSize * num_head * qSlice, 1, [&](int64_t begin, int64_t end) {
    int64_t i = 0, j = 0, k = 0;
    at::native::data_index_init(begin, i, batchSize, j, num_head, k, qSlice);
""", """  const int64_t num_items = batchSize * num_head * qSlice;
  std::atomic<int64_t> next_item{0};  // flexpage: items handed out one at a time
  at::parallel_for(0, std::min<int64_t>(num_thread, num_items), 1, [&](int64_t, int64_t) {
    int64_t i = 0, j = 0, k = 0;
"""),
    ("""    for ([[maybe_unused]] auto z : c10::irange(begin, end)) {
      auto i_kvi = is_broadcast_bs_kvi ? i/bs_shards_kvi : i;""",
     """    for (int64_t z = next_item++; z < num_items; z = next_item++) {
      at::native::data_index_init(z, i, batchSize, j, num_head, k, qSlice);
      auto i_kvi = is_broadcast_bs_kvi ? i/bs_shards_kvi : i;"""),
    ("""      // Move to the next query
      at::native::data_index_step(i, batchSize, j, num_head, k, qSlice);
""", ""),
    # A row's max: the stock call multiplied the row by 1 and stored it again on the way
    ("""          {{kernel.kernel_name}}_mul_reduce_max_fusion_kernel(
              qk_data + row * cur_kvSplitSize,
              static_cast<accum_t>(1),
              cur_kvSplitSize,
              qk_data + row * cur_kvSplitSize,
              tmp_max);""",
     """          {  // flexpage: the row's max, nothing stored; two chains of max instructions (a NaN score: a NaN row anyway)
            const accum_t* scores = qk_data + row * cur_kvSplitSize;
            Vec vec_max(-std::numeric_limits<accum_t>::infinity()), vec_max2 = vec_max;
            int64_t col = 0;
            for (; col + 2 * Vec::size() <= cur_kvSplitSize; col += 2 * Vec::size()) {
              vec_max = at::vec::clamp_min(Vec::loadu(scores + col), vec_max);
              vec_max2 = at::vec::clamp_min(Vec::loadu(scores + col + Vec::size()), vec_max2);
            }
            for (; col + Vec::size() <= cur_kvSplitSize; col += Vec::size()) {
              vec_max = at::vec::clamp_min(Vec::loadu(scores + col), vec_max);
            }
            vec_max = at::vec::clamp_min(vec_max, vec_max2);
            tmp_max = at::vec::vec_reduce_all<accum_t>([](Vec& x, Vec& y) { return at::vec::clamp_min(x, y); }, vec_max);
            for (; col < cur_kvSplitSize; ++col) {
              tmp_max = std::max(tmp_max, scores[col]);
            }
          }"""),
    # bf16 probabilities converted by AVX512-BF16 instructions where the kernel has them
    ("""            {{kernel.kernel_name}}_exp_reduce_sum_fusion_kernel(
              qk_data + row * cur_kvSplitSize, cur_kvSplitSize,""",
     """{%- if template.flexpage_bf16_softmax %}
            flexpage_dot_bf16::exp_sum_bf16(qk_data + row * cur_kvSplitSize, cur_kvSplitSize,
              reinterpret_cast<uint16_t*>(qk_reduced_data + row * cur_ekvSplitSize), tmp_sum,
              [](__m512 x) -> __m512 { return at::vec::Vectorized<float>(x).exp_u20(); });
            if (false)
{%- endif %}
            {{kernel.kernel_name}}_exp_reduce_sum_fusion_kernel(
              qk_data + row * cur_kvSplitSize, cur_kvSplitSize,"""),
    ("""          // Apply block mask, fill unused with -inf
          {
""",
     """{%- if score_mod and mask_mod %}
          if (mask_bias != nullptr) {  // flexpage: the mask was evaluated before the gemm
            for (int64_t row = 0; row < cur_qSplitSize; ++row) {
              accum_t* scores = qk_data + row * cur_kvSplitSize;
              const accum_t* bias_row = mask_bias + row * mask_bias_stride;
              int64_t col = 0;
              for (; col + Vec::size() <= cur_kvSplitSize; col += Vec::size()) {
                const Vec bias = Vec::loadu(bias_row + col);
                Vec::blendv(bias, Vec::loadu(scores + col), bias == Vec(accum_t(0))).store(scores + col);
              }
              for (; col < cur_kvSplitSize; ++col) {
                scores[col] = bias_row[col] == accum_t(0) ? scores[col] : bias_row[col];
              }
            }
          } else
{%- endif %}
          // Apply block mask, fill unused with -inf
          {
"""),
    # A visit of few query rows (a decode token's packed heads) does little work per byte of the
    # block it reads, and a decode call reads each block once, from memory: its loads waited on
    # the block's first lines while the hardware prefetcher found each 16 KB block anew. Here the
    # visit starts the reads of its block's visible values (read after q @ k^T and the softmax)
    # and of the next block's keys and values (bf16 GQA decode call, batch 32 of 300-1,100
    # tokens, KV from memory: 1.33-1.39 -> 1.09-1.19 ms, AMD EPYC Zen 4). Whole prefill query
    # blocks revisit cached blocks, and float32 decode (256-token blocks, P @ V on MKL's sgemm)
    # measured 5-10% slower with it: both left alone.
    ("""        auto i_kv = is_broadcast_bs_kv ? i/bs_shards : i;
        auto j_kv = is_broadcast_head_kv ? j/gqa_shards : j;
""",
     """        auto i_kv = is_broadcast_bs_kv ? i/bs_shards : i;
        auto j_kv = is_broadcast_head_kv ? j/gqa_shards : j;
        if (is_reduced_type && !need_pack && cur_qSplitSize <= 16) {  // flexpage: this block's V and the next block's K and V on their way
          const int64_t row_bytes = headSize * static_cast<int64_t>(sizeof(scalar_t));
          auto prefetch_rows = [row_bytes](const scalar_t* rows, int64_t count, int64_t stride) {
            for (int64_t r = 0; r < count; ++r) {
              for (int64_t b = 0; b < row_bytes; b += 64) {
                __builtin_prefetch(reinterpret_cast<const char*>(rows + r * stride) + b, 0, 2);
              }
            }
          };
          prefetch_rows(v_data + i_kv * vStrideB + j_kv * vStrideH + n * vStrideN, cur_kvSplitSize, vStrideN);
          if (n_idx + 1 < kv_indice_num + full_kv_indice_num) {
            const int64_t next = (n_idx + 1 < kv_indice_num ? kv_indice_list[n_idx + 1]
                                  : full_kv_indice_list[n_idx + 1 - kv_indice_num]) * kvSplitSize;
            const int64_t next_rows = std::min(kvSplitSize, kvSize - next);
            prefetch_rows(k_data + i_kv * kStrideB + j_kv * kStrideH + next * kStrideN, next_rows, kStrideN);
            prefetch_rows(v_data + i_kv * vStrideB + j_kv * vStrideH + next * vStrideN, next_rows, vStrideN);
          }
        }
"""),
)


# Deterministic kernels (``DETERMINISTIC_OPTION``, the engine's ``deterministic`` mode): a query
# row's output must not depend on what else the call holds. The stock template decides at run
# time, from the call's query and key lengths, whether the products run on the AMX brgemm over
# packed K/V or on the vector micro-gemm (the two sum in different orders: a row of a 1,024-token
# prefill differed from the same row decoded alone by 4.9e-4 in bf16), and float32 P@V runs
# through ``cpublas::brgemm``, whose kernel depends on the row count (1.3e-7 between the same
# row in a decode and a prefill call). Here a CPU that can pack always packs (bf16/fp16 on AMX:
# both products on the AMX brgemm, as fast as the stock prefill), and every other call runs both
# on the micro-gemm; either sums the head or key dimension in one order for every row. Key
# blocks are fixed in the row's logical positions by the gathered layout (see
# flexpage.attention.paging). Partial key blocks are masked after the gemm, whole, as the stock
# template does: trimming them to the query block's last visible column changes the order in
# which the vectorised row sums add a block's last columns.
_DETERMINISTIC_EDITS = (
    ("""    int64_t thresh_size = 64;""", """    int64_t thresh_size = 0;"""),
    ("""      need_pack = gemm_size_per_thread / pack_size >= 4;""", """      need_pack = true;"""),
    ("""        if (n_idx < kv_indice_num && !need_pack) {""",
     """        if (false) {  // flexpage: deterministic, whole key blocks masked after the gemm"""),
)


class _Lowering(NamedTuple):
    tuned: bool  # the kernel asked for the tuned template
    identity_score: bool  # its score mod returns the score unchanged
    deterministic: bool = False  # it asked for DETERMINISTIC_OPTION
    dot_bf16: bool = False  # it asked for DOT_BF16_OPTION (and is not deterministic)


# set while flex_attention is lowered, read when the lowering constructs its template
_lowering: contextvars.ContextVar[_Lowering] = contextvars.ContextVar(
    "flexpage_lowering", default=_Lowering(False, False))


def apply() -> bool:
    """Install the hooks once (see :func:`flexpage.attention.torch_patches.install`); returns
    whether they are installed: not if PyTorch's template text changed (stock kernels, still correct)."""
    import torch._inductor.graph  # noqa: F401  (imports the codegen modules in an order that works)
    from torch._inductor import lowering
    from torch._inductor.codegen import cpp_flex_attention_template as template_module
    from torch._inductor.codegen import cpp_micro_gemm

    template_cls = template_module.CppFlexAttentionTemplate
    if getattr(template_cls, "_flexpage_tuning", False):
        return True
    stock_template = template_module.FLEX_ATTENTION_TEMPLATE
    if any(stock_template.count(old) != 1 for old, _ in (*_LEAN_EDITS, (_STOCK_PV_BRANCH, None))):
        return False
    lean_template = stock_template
    for old, new in _LEAN_EDITS:
        lean_template = lean_template.replace(old, new)
    reduced_template = lean_template.replace(_STOCK_PV_BRANCH, _TUNED_PV_BRANCH)
    if any(reduced_template.count(old) != 1 for old, _ in _DETERMINISTIC_EDITS):
        return False
    stock_kernel = cpp_micro_gemm.CppMicroGemmFP32Vec.TEMPLATE_KERNEL
    if stock_kernel.count(_STOCK_TRANSPOSED_CHOICE) != 2 or stock_kernel.count(_KERNEL_BODY_START) != 1:
        return False
    tail_entry = cpp_micro_gemm.CppMicroGemmFP32Vec.TEMPLATE_ENTRY
    if any(tail_entry.count(old) != 1 for old, _ in _TAIL_EDITS) or tail_entry.count(_ENTRY_ROW_LOOP) != 1:
        return False
    for old, new in _TAIL_EDITS:
        tail_entry = tail_entry.replace(old, new)
    deterministic_template = reduced_template
    for old, new in _DETERMINISTIC_EDITS:
        deterministic_template = deterministic_template.replace(old, new)

    hop = torch.ops.higher_order.flex_attention
    stock_lowering = lowering.lowerings[hop]

    def flex_attention_lowering(*args: Any, **kwargs: Any) -> Any:
        kernel_options = args[6] if len(args) > 6 else kwargs.get("kernel_options", {})
        score_mod = args[3] if len(args) > 3 else kwargs.get("subgraph")
        tuned = bool(kernel_options.get(TUNED_OPTION, False))
        deterministic = tuned and bool(kernel_options.get(DETERMINISTIC_OPTION, False))
        dot_bf16 = tuned and not deterministic and bool(kernel_options.get(DOT_BF16_OPTION, False))
        token = _lowering.set(_Lowering(tuned, tuned and _is_identity(score_mod), deterministic, dot_bf16))
        try:
            return stock_lowering(*args, **kwargs)
        finally:
            _lowering.reset(token)

    stock_init = template_cls.__init__

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        stock_init(self, *args, **kwargs)
        lowering_state = _lowering.get()  # templates are rendered after lowering returns
        self.flexpage_tuned = lowering_state.tuned
        self.flexpage_identity_score = lowering_state.identity_score
        self.flexpage_deterministic = lowering_state.deterministic
        self.flexpage_dot_bf16 = lowering_state.dot_bf16
        # bf16 kernels with the dot-product helpers (_dot_bf16.h is in their micro-gemm code)
        self.flexpage_bf16_softmax = self.flexpage_dot_bf16 and self.input_nodes[0].get_dtype() == torch.bfloat16

    stock_choose = template_cls.choose_flex_template

    def choose_flex_template(self, query: Any, key: Any, num_threads: Any) -> str:
        # the stock chooser reads ``node.data.data.layout.size``, a chain only an input buffer has:
        # a query computed inside a larger compiled graph is a view of another buffer
        chosen = stock_choose(self, _sized(query), _sized(key), num_threads)
        if getattr(self, "flexpage_deterministic", False):
            # never the decoding template: it splits a row's keys between threads, and its
            # merge order follows the thread count and the call's shape
            return deterministic_template
        if not getattr(self, "flexpage_tuned", False) or chosen is not stock_template:
            return chosen
        return reduced_template if _is_reduced(self) and _compiles_avx512() else lean_template

    stock_modification = template_cls.modification

    def modification(self, *args: Any, **kwargs: Any) -> str:
        code = stock_modification(self, *args, **kwargs)
        if getattr(self, "flexpage_tuned", False) and not _compiles_avx512():
            code = _full_int64_loads(code)
        return code

    stock_micro_gemm_define = template_cls.micro_gemm_define

    def micro_gemm_define(self, kernel_name: str) -> str:
        # deterministic kernels block rows wherever tuned ones may, whatever the query block: a
        # decode row must get the arithmetic of the same token's row in a prefill block
        deterministic = getattr(self, "flexpage_deterministic", False)
        blocked = (_rows_blocked(self) and not deterministic) or (deterministic and _compiles_avx512())
        if not (getattr(self, "flexpage_tuned", False) and blocked):
            return stock_micro_gemm_define(self, kernel_name)
        stock_gemm = cpp_micro_gemm.CppMicroGemmFP32Vec
        block_m = max(1, min(int(self.q_block_size), _MAX_BLOCK_M))
        kernel_text = stock_gemm.TEMPLATE_KERNEL
        if self.flexpage_deterministic:
            kernel_text = kernel_text.replace(_STOCK_TRANSPOSED_CHOICE, _DETERMINISTIC_TRANSPOSED_CHOICE)
        head_dim = _static_head_dim(self)
        entry = tail_entry
        if self.flexpage_dot_bf16:
            call = _known_head_dim_test(_DOT_BF16_CALL, head_dim, 32)
            kernel_text = _DOT_BF16_HELPERS + kernel_text.replace(_KERNEL_BODY_START, _KERNEL_BODY_START + call)
            rows_call = _known_head_dim_test(_DOT_BF16_ROWS_CALL, head_dim, 32)
            entry = entry.replace(_ENTRY_ROW_LOOP, _ENTRY_ROW_LOOP + rows_call)
        if not (_compiles_avx512() or self.flexpage_deterministic):
            call = _known_head_dim_test(_AVX2_FP32_CALL, head_dim, 8)
            kernel_text = _AVX2_FP32_HELPERS + kernel_text.replace(_KERNEL_BODY_START, _KERNEL_BODY_START + call)

        class RowBlockedGemm(stock_gemm):  # type: ignore[misc, valid-type]
            TEMPLATE_KERNEL = kernel_text
            TEMPLATE_ENTRY = entry

            def __init__(self, name, input_dtype, input2_dtype, output_dtype, compute_dtype, blocking,  # noqa: ANN001
                         *rest) -> None:  # noqa: ANN002
                blocking = type(blocking)(block_m, blocking.block_n, blocking.block_k)
                super().__init__(name, input_dtype, input2_dtype, output_dtype, compute_dtype, blocking, *rest)

        cpp_micro_gemm.CppMicroGemmFP32Vec = RowBlockedGemm
        try:
            return stock_micro_gemm_define(self, kernel_name)
        finally:
            cpp_micro_gemm.CppMicroGemmFP32Vec = stock_gemm

    lowering.lowerings[hop] = flex_attention_lowering
    template_cls.__init__ = __init__
    template_cls.choose_flex_template = choose_flex_template
    template_cls.micro_gemm_define = micro_gemm_define
    template_cls.modification = modification
    template_cls._flexpage_tuning = True
    return True


def installed() -> bool:
    """Whether :func:`apply` has installed the hooks in this process."""
    import torch._inductor.graph  # noqa: F401  (imports the codegen modules in an order that works)
    from torch._inductor.codegen import cpp_flex_attention_template as template_module

    return bool(getattr(template_module.CppFlexAttentionTemplate, "_flexpage_tuning", False))


def dot_bf16_option() -> str:
    """The value flexpage gives :data:`DOT_BF16_OPTION`: ``""`` (stock bf16 micro-gemms) unless
    Inductor compiles AVX-512 code for a CPU with AVX512-BF16 (and ``FLEXPAGE_BF16_DOT`` is
    not ``"0"``); there a digest of ``_dot_bf16.h``, so that Inductor's cache, which keys a
    kernel by its graph and not by the code a template renders, never returns kernels built
    from another version of the helpers.

    On an AMD EPYC (Zen 4) a 48-row bf16 GQA decode call ran in 0.74-0.81x the stock
    kernel's time, and bf16 prefill rows in ~0.7x the time of the float32 copy they attended
    in before (:func:`~flexpage.attention.flex.gathered_attention_dtype`). Deterministic
    kernels keep the stock arithmetic: their rows must compute alike in any call, and the
    dot products sum in pairs, in another order than the float32 multiply-adds."""
    if os.environ.get(DOT_BF16_ENV_SWITCH, "1") == "0" or not _compiles_avx512():
        return ""
    if not torch.cpu._is_avx512_bf16_supported():
        return ""
    return hashlib.sha256(_DOT_BF16_SOURCE.encode()).hexdigest()[:16]


def _static_head_dim(template: Any) -> int | None:
    """The query's head dimension where the graph fixes it (else None)."""
    size = template.input_nodes[0].get_size()[-1]
    return int(size) if getattr(size, "is_number", True) else None


def _known_head_dim_test(call: str, head_dim: int | None, step: int) -> str:
    """``call`` (a micro-gemm's call of a flexpage helper, guarded by ``K % step == 0``) with the
    guard made ``true`` where the kernel's head dimension is a known multiple of ``step``.

    Why: the stock micro-gemm code after the call is then dead and g++ drops it before it
    optimises. Kept, its sixteen row-block instantiations of the stock q @ k^T made ``g++ -O3``
    of the bf16 prefill attention kernel take 12.4 s instead of 5.1 s (AMD EPYC Zen 5), on the
    critical path of a cold start."""
    test = f"K % {step} == 0"
    if call.count(test) != 1:
        raise AssertionError(f"flexpage: the micro-gemm call lost its test {test!r}")
    return call.replace(test, "true") if head_dim is not None and head_dim % step == 0 else call


def _is_reduced(template: Any) -> bool:
    """P@V through the micro-gemm and row blocking are for bf16/fp16 only: for float32
    ``cpublas::brgemm`` is a fast sgemm and row blocking does not pay (measured,
    docs/attention-benchmark.md)."""
    return template.input_nodes[0].get_dtype() in (torch.bfloat16, torch.float16)


# In AVX2 code a load of int64 vectors given a count (ATen's ``Vectorized<int64_t>::loadu(ptr,
# count)``) copies the elements through a stack buffer even when the count fills the vector, and
# the wide load that follows stalls on the narrower stores (store forwarding). Inductor's mask and
# score code loads the key indices that way in its main loop, with the loop's full width: on an
# AMD EPYC (Zen 3) those loads were ~10% of a 4 x 256 float32 prefill call. A full-width count
# means the plain load, which is what the tuned kernels get.
_FULL_INT64_LOAD = re.compile(r"(at::vec::VectorizedN<int64_t,(\d+)>::loadu\([^;]*?), static_cast<int64_t>\((\d+)L?\)\)(?=;)")
_INT64_LANES_AVX2 = 4


def _full_int64_loads(code: str) -> str:
    """``code`` (AVX2 mask or score code) with full-width counted int64 loads made plain loads."""
    def plain(match: re.Match) -> str:
        vectors, count = int(match.group(2)), int(match.group(3))
        if count != vectors * _INT64_LANES_AVX2 or not _closes_at_end(match.group(0)):
            return match.group(0)
        return match.group(1) + ")"

    return _FULL_INT64_LOAD.sub(plain, code)


def _closes_at_end(call: str) -> bool:
    """Whether the first parenthesis of ``call`` closes at its last character (the count is the
    load's own last argument, not some later call's)."""
    depth = 0
    for at in range(call.index("("), len(call)):
        depth += {"(": 1, ")": -1}.get(call[at], 0)
        if depth == 0:
            return at == len(call) - 1
    return False


def _rows_blocked(template: Any) -> bool:
    """Micro-gemms block ``min(query block rows, 16)`` rows: in AVX-512 code for bf16/fp16,
    and for float32 prefill query blocks (there the stock one-row blocking reloads each key
    tile per row). In AVX2 code for float32 prefill query blocks only, whose q @ k^T then
    runs on ``_avx2_fp32.h``; AVX2 bf16/fp16 kernels stay stock. (Deterministic kernels
    decide in ``micro_gemm_define``.)"""
    prefill = int(template.q_block_size) >= _MIN_FP32_BLOCKED_ROWS
    if _compiles_avx512():
        return _is_reduced(template) or prefill
    return prefill and template.input_nodes[0].get_dtype() == torch.float32


def _compiles_avx512() -> bool:
    return "avx512" in cpu_vec_isa().split()  # VecAVX512 and its subclasses (VNNI, AMX)


def packs_for_amx(dtype: torch.dtype) -> bool:
    """Whether kernels for ``dtype`` on this CPU run their products on the AMX brgemm over
    packed K/V (bf16, or fp16 with AMX-FP16, in the AMX code Inductor compiles here).
    Everywhere else a reduced-precision kernel runs the vector micro-gemm, which widens every
    load to float32."""
    if dtype not in (torch.bfloat16, torch.float16) or "amx_tile" not in cpu_vec_isa().split():
        return False
    return dtype == torch.bfloat16 or torch.cpu._is_amx_fp16_supported()


def _is_identity(score_mod: Any) -> bool:
    """Whether a lowered score-mod subgraph returns its score unchanged (flex_attention's default)."""
    graph = getattr(getattr(score_mod, "graph_module", None), "graph", None)
    if graph is None:
        return False
    placeholders = [node for node in graph.nodes if node.op == "placeholder"]
    (output,) = [node for node in graph.nodes if node.op == "output"]
    result = output.args[0]
    result = result[0] if isinstance(result, (tuple, list)) and len(result) == 1 else result
    return bool(placeholders) and result is placeholders[0]


def _sized(node: Any) -> SimpleNamespace:
    """A stand-in exposing ``node``'s size where the stock template chooser looks for it."""
    return SimpleNamespace(data=SimpleNamespace(data=SimpleNamespace(layout=SimpleNamespace(size=node.get_size()))))
