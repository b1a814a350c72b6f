"""The text edits of PyTorch's CPU FlexAttention template and micro-gemm that make up flexpage's
tuned template (torch 2.13), as (stock text, tuned text) pairs and snippets.

:mod:`flexpage.backends.cpu.template_tuning` applies them (each stock text must match exactly
once, else nothing is tuned) and explains what they are for; the comments beside each edit
say why it pays and what it measured. Bump
:data:`~flexpage.backends.cpu.template_tuning.TUNING_VERSION` whenever any of this text (or
a header it reads) changes: Inductor's FX graph cache does not see template text.
"""

from pathlib import Path

STOCK_PV_BRANCH = "          if (!std::is_same_v<scalar_t, at::Half>) {\n            at::native::cpublas::brgemm("
# float32 P@V takes MKL's sgemm only over float32 values; 8-bit values go through the micro-gemm
LEAN_PV_BRANCH = ("          if (!std::is_same_v<scalar_t, at::Half> && std::is_same_v<kv_t, scalar_t>) {\n"
                  "            at::native::cpublas::brgemm(")
TUNED_PV_BRANCH = "          if (false) {  // flexpage: P@V through the micro-gemm\n            at::native::cpublas::brgemm("
# The float32 micro-gemm computes q @ k^T (a transposed B) one of two ways, picked by the rows
# of the block it is called for: with 24 x rows <= head_dim (1-2 rows at head_dim 64: a decode
# row, or the last rows of a prefill query block) each score is a dot product reduced across a
# vector, otherwise a sum of broadcast multiply-adds in head-dimension order -- other bits for
# the same row. Deterministic kernels always take the second way (where head_dim is a multiple
# of the vector width), so they can block rows like the tuned ones: their prefill query blocks
# ran 1.7-1.8x slower with one-row blocks (float32 rows, AMD EPYC).
STOCK_TRANSPOSED_CHOICE = "&& 24 * BLOCK_M > K) {"
DETERMINISTIC_TRANSPOSED_CHOICE = ") {  // flexpage: deterministic, one way for every row block"

# The micro-gemm kernel template's first line of body; bf16 kernels with DOT_BF16_OPTION call
# the helpers of dot_bf16.h there (q @ k^T needs a head dimension that is a multiple of 32).
KERNEL_BODY_START = "    using Vectorized = at::vec::Vectorized<{{compute_t}}>;\n"
DOT_BF16_CALL = """\
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
# 16-row blocks (prefill query blocks) compute all whole 16-row blocks with dot_bf16.h's
# ``rows_of_16`` (one copy of A's rows and one rearranged B tile shared by the blocks), leaving
# only a tail of rows to the per-tile loop.
ENTRY_ROW_LOOP = "    // TODO(jgong5): loop unroll for M and N\n"
DOT_BF16_ROWS_CALL = """\
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
# the helpers' shared tile code (transposes), put before each of them
AVX512_TILES_SOURCE = Path(__file__).with_name("avx512_tiles.h").read_text()
DOT_BF16_SOURCE = AVX512_TILES_SOURCE + Path(__file__).with_name("dot_bf16.h").read_text()
DOT_BF16_HELPERS = "{% raw %}" + DOT_BF16_SOURCE + "{% endraw %}\n"
# Row-blocked float32 kernels compiled for AVX2 compute q @ k^T with avx2_fp32.h there
# (bump TUNING_VERSION when the header changes: nothing else puts it in the cache key).
AVX2_FP32_CALL = """\
{%- if input_dtype == torch.float and input2_dtype == torch.float and trans_b and alpha == 1 %}
    if (K % 8 == 0) {  // flexpage: AVX2 q @ k^T, scores reduced eight at a time
        flexpage_avx2_fp32::qk<BLOCK_M, accum>(A, B, C, {{ "N" if tail_n else "BLOCK_N" }}, K, lda, ldb, ldc);
        return;
    }
{%- endif %}
"""
AVX2_FP32_HELPERS = "{% raw %}" + Path(__file__).with_name("avx2_fp32.h").read_text() + "{% endraw %}\n"
# Micro-gemms over 8-bit keys and values (the int8 KV cache) compiled for AVX-512: their entries
# (the row loop's start) compute a whole row block (a decode token's packed query heads, a float32
# or bf16 row) with int8_kv.h's ``rows``: the query's int8 codes or the probabilities widened once
# per call, each value row read once. Other row blocks (tails), and q @ k^T without AVX512-VNNI,
# keep Inductor's int8 micro-gemm.
INT8_KV_ROWS_CALL = """\
{%- if input2_dtype == torch.int8 and input_dtype in (torch.float, torch.bfloat16) and compute_t == "float" and block_n == 16 %}
    if (M == {{block_m}} && flexpage_int8_kv::rows<{{block_m}}, {{ "true" if trans_b else "false" }}, accum>(
            A, B, C, N, K, lda, ldb, ldc)) {  // flexpage: 8-bit K/V
        return;
    }
{%- endif %}
"""
INT8_KV_SOURCE = AVX512_TILES_SOURCE + Path(__file__).with_name("int8_kv.h").read_text()
INT8_KV_HELPERS = "{% raw %}" + INT8_KV_SOURCE + "{% endraw %}\n"

# The micro-gemm's entry computes a block of fewer rows than its row block (a query block's last
# rows) with a kernel instantiated for exactly that many rows: 15 instantiations per kernel kind,
# most of the C++ a prefill attention kernel holds. Tuned kernels split such a tail into blocks
# of 8, 4, 2 and 1 rows (the kernels of the rows' own arithmetic: each row is computed alone),
# four instantiations, which cut `g++ -O3` of the bf16 prefill attention kernel from ~5 s to ~3 s.
TAIL_EDITS = (
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

# 8-bit K/V (the int8 KV cache, :mod:`flexpage.attention.kv_pool`): the kernel's key and value
# pointers take the keys' own type (``kv_t``; the query's for every other kernel, as before), the
# micro-gemms widen each 8-bit row to float32 as they load it (Inductor's own int8 B operand), and
# such kernels never pack for AMX (its brgemm multiplies 16-bit pairs only) nor take MKL's sgemm.
# The kernel preamble is shared by every kernel: stock kernels keep its stock text.
KV_TYPE_EDIT = (
    """  const scalar_t* k_data = key;
  const scalar_t* v_data = value;
""",
    """{%- if template.flexpage_tuned %}
  using kv_t = {{kernel.dtype(key)}};  // flexpage: keys and values may be 8-bit
  const kv_t* k_data = key;
  const kv_t* v_data = value;
{%- else %}
  const scalar_t* k_data = key;
  const scalar_t* v_data = value;
{%- endif %}
""")
KV8_EDITS = (
    ("""  if (is_reduced_type) {
    // check platform ability""",
     """  if (is_reduced_type && std::is_same_v<kv_t, scalar_t>) {  // flexpage: 8-bit K/V never pack
    // check platform ability"""),
    ("""                  {{kernel.kernel_name}}_conditional_data_ptr(qk_data, qk_reduced_data),
                  v_addr,
                  dst_data,
                  need_pack);""",
     """                  {{kernel.kernel_name}}_conditional_data_ptr(qk_data, qk_reduced_data),
                  reinterpret_cast<const scalar_t*>(v_addr),  // flexpage: taken only where kv_t is scalar_t
                  dst_data,
                  need_pack);"""),
    (STOCK_PV_BRANCH, LEAN_PV_BRANCH),
)
# The micro-gemm's transposed-B inner-product path loads A as int8 wherever B is int8 (Inductor
# wrote it for int8 x int8); a float32 or bf16 query row is loaded as what it is.
MICRO_GEMM_INT8_A_EDIT = (
    """    {%- elif input2_dtype == torch.int8 %}
                auto a32 = at::vec::convert_to_int32<int8_t>(A + (sM * m + s) * lda + k * VLEN, e_k);
                va = at::vec::convert<float>(a32);""",
    """    {%- elif input2_dtype == torch.int8 and input_dtype == torch.int8 %}
                auto a32 = at::vec::convert_to_int32<int8_t>(A + (sM * m + s) * lda + k * VLEN, e_k);
                va = at::vec::convert<float>(a32);
    {%- elif input2_dtype == torch.int8 and input_dtype == torch.bfloat16 %}
                va = at::vec::convert<float>(at::vec::Vectorized<at::BFloat16>::loadu(A + (sM * m + s) * lda + k * VLEN, e_k));
    {%- elif input2_dtype == torch.int8 %}
                va = Vectorized::loadu(A + (sM * m + s) * lda + k * VLEN, e_k);""")

# Text edits of the stock template (each must match exactly once, else nothing is tuned).
LEAN_EDITS = (
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
    # measured 5-10% slower with it: both left alone. So are 8-bit K/V (one 64-byte line a row at
    # head_dim 64): a batch-8, 8k-token decode call took the same time with it and without.
    ("""        auto i_kv = is_broadcast_bs_kv ? i/bs_shards : i;
        auto j_kv = is_broadcast_head_kv ? j/gqa_shards : j;
""",
     """        auto i_kv = is_broadcast_bs_kv ? i/bs_shards : i;
        auto j_kv = is_broadcast_head_kv ? j/gqa_shards : j;
        if (is_reduced_type && sizeof(kv_t) != 1 && !need_pack && cur_qSplitSize <= 16) {  // flexpage: this block's V and the next block's K and V on their way
          const int64_t row_bytes = headSize * static_cast<int64_t>(sizeof(kv_t));
          auto prefetch_rows = [row_bytes](const kv_t* rows, int64_t count, int64_t stride) {
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
DETERMINISTIC_EDITS = (
    ("""    int64_t thresh_size = 64;""", """    int64_t thresh_size = 0;"""),
    ("""      need_pack = gemm_size_per_thread / pack_size >= 4;""", """      need_pack = true;"""),
    ("""        if (n_idx < kv_indice_num && !need_pack) {""",
     """        if (false) {  // flexpage: deterministic, whole key blocks masked after the gemm"""),
)
