// flexpage: the tuned CPU FlexAttention template's bf16 micro-gemms on AVX512-BF16
// (see flexpage/attention/_cpu_template_tuning.py, DOT_BF16_OPTION).
//
// The stock vector micro-gemm widens every bf16 element to float32 before a multiply-add,
// and for q @ k^T (a transposed B) it transposes each 16 x 16 tile of K in float32 and
// broadcasts each query element from a scalar: at the 3 packed query rows of a GQA decode
// that is several shuffles per multiply-add. Here the products run on vdpbf16ps, which
// multiplies a pair of bf16 values per float32 lane exactly and adds both to the lane:
// K tiles are transposed as 32-bit pairs (half the shuffles, no widening), V rows are
// interleaved in pairs, and the other operand is a broadcast pair read from memory.
// Sums are float32, in another order than the stock kernel's.
#ifndef FLEXPAGE_DOT_BF16
#define FLEXPAGE_DOT_BF16
#include <immintrin.h>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <type_traits>
#ifndef FLEXPAGE_AVX512_TILES  // standalone (a test's driver); the kernel text puts avx512_tiles.h first
#include "avx512_tiles.h"
#endif

namespace flexpage_dot_bf16 {
#define FLEXPAGE_DOT_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))

// two consecutive bf16 values as one 32-bit word
static inline int32_t pair_at(const uint16_t* p) {
  int32_t w;
  std::memcpy(&w, p, sizeof(w));
  return w;
}

using flexpage_avx512_tiles::transpose16;

// independent accumulators per row, so that a few rows still keep the dot-product unit busy
// (its latency is several cycles); summed at the end
template <int64_t BLOCK_M>
constexpr int64_t chains() {
  return BLOCK_M >= 8 ? 1 : (BLOCK_M >= 4 ? 2 : 4);
}

// C's rows (or zeros) in the first of each row's accumulators, zeros in the others
template <int64_t S, int64_t BLOCK_M, bool accum>
FLEXPAGE_DOT_TARGET static inline void start_rows(__m512 (&acc)[S][BLOCK_M], const float* C, int64_t ldc,
                                                  __mmask16 cols) {
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t m = 0; m < BLOCK_M; ++m) {
      acc[s][m] = (accum && s == 0) ? _mm512_maskz_loadu_ps(cols, C + m * ldc) : _mm512_setzero_ps();
    }
  }
}

// each row's accumulators summed into C's row
template <int64_t S, int64_t BLOCK_M>
FLEXPAGE_DOT_TARGET static inline void store_rows(const __m512 (&acc)[S][BLOCK_M], float* C, int64_t ldc,
                                                  __mmask16 cols) {
  for (int64_t m = 0; m < BLOCK_M; ++m) {
    __m512 sum = acc[0][m];
    for (int64_t s = 1; s < S; ++s) {
      sum = _mm512_add_ps(sum, acc[s][m]);
    }
    _mm512_mask_storeu_ps(C + m * ldc, cols, sum);
  }
}

// C[m, 0:N] (+)= sum_k A[m, k] * B[n, k] for BLOCK_M rows, N <= 16 columns, K % 32 == 0
template <int64_t BLOCK_M, bool accum>
FLEXPAGE_DOT_TARGET void qk(const uint16_t* A, const uint16_t* B, float* C, int64_t N, int64_t K,
                            int64_t lda, int64_t ldb, int64_t ldc) {
  constexpr int64_t S = chains<BLOCK_M>();
  const __mmask16 cols = N >= 16 ? __mmask16(0xffff) : __mmask16((1u << N) - 1);
  __m512 acc[S][BLOCK_M];
  start_rows<S, BLOCK_M, accum>(acc, C, ldc, cols);
  // the next 16 key rows (the caller's next columns) on their way while these are computed: each
  // call's loads otherwise wait on memory (a decode step streams the KV pool once); prefetches
  // past the key block's end are harmless (they never fault)
  for (int64_t n = 16; n < 32; ++n) {
    for (int64_t k = 0; k < K; k += 32) {
      _mm_prefetch(reinterpret_cast<const char*>(B + n * ldb + k), _MM_HINT_T0);
    }
  }
  for (int64_t k = 0; k < K; k += 32) {
    __m512i rows[16];
    for (int64_t n = 0; n < 16; ++n) {
      rows[n] = n < N ? _mm512_loadu_si512(B + n * ldb + k) : _mm512_setzero_si512();
    }
    transpose16(rows);  // rows[w]: pair w (elements k + 2w, k + 2w + 1) of every column
    for (int64_t w = 0; w < 16; w += S) {
      for (int64_t s = 0; s < S; ++s) {
        for (int64_t m = 0; m < BLOCK_M; ++m) {
          const __m512i a = _mm512_set1_epi32(pair_at(A + m * lda + k + 2 * (w + s)));
          acc[s][m] = _mm512_dpbf16_ps(acc[s][m], (__m512bh)a, (__m512bh)rows[w + s]);
        }
      }
    }
  }
  store_rows<S, BLOCK_M>(acc, C, ldc, cols);
}

// the permutation of [row | row] (two 16-column rows side by side) that puts element i of the
// first row beside element i of the second
FLEXPAGE_DOT_TARGET static inline __m512i pair_interleave() {
  return _mm512_set_epi16(
      31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
      23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
}

// lane i: (row 0, column i), (row 1, column i) of the two rows at B, columns in ``cols``
FLEXPAGE_DOT_TARGET static inline __m512i row_pair(const uint16_t* B, int64_t ldb, __mmask16 cols, __m512i interleave) {
  const __m256i r0 = _mm256_maskz_loadu_epi16(cols, B);
  const __m256i r1 = _mm256_maskz_loadu_epi16(cols, B + ldb);
  return _mm512_permutexvar_epi16(interleave, _mm512_inserti64x4(_mm512_castsi256_si512(r0), r1, 1));
}

// an odd last row at B paired with zeros (lane i: (row, column i), 0)
FLEXPAGE_DOT_TARGET static inline __m512i last_row_pair(const uint16_t* B, __mmask16 cols, __m512i interleave) {
  return _mm512_permutexvar_epi16(interleave, _mm512_zextsi256_si512(_mm256_maskz_loadu_epi16(cols, B)));
}

// C[m, 0:N] (+)= sum_k A[m, k] * B[k, n] for BLOCK_M rows, N <= 16 columns, any K
template <int64_t BLOCK_M, bool accum>
FLEXPAGE_DOT_TARGET void pv(const uint16_t* A, const uint16_t* B, float* C, int64_t N, int64_t K,
                            int64_t lda, int64_t ldb, int64_t ldc) {
  constexpr int64_t S = chains<BLOCK_M>();
  const __mmask16 cols = N >= 16 ? __mmask16(0xffff) : __mmask16((1u << N) - 1);
  const __m512i interleave = pair_interleave();
  __m512 acc[S][BLOCK_M];
  start_rows<S, BLOCK_M, accum>(acc, C, ldc, cols);
  int64_t k = 0;
  for (; k + 2 * S <= K; k += 2 * S) {
    for (int64_t s = 0; s < S; ++s) {
      const __m512i b = row_pair(B + (k + 2 * s) * ldb, ldb, cols, interleave);
      for (int64_t m = 0; m < BLOCK_M; ++m) {
        const __m512i a = _mm512_set1_epi32(pair_at(A + m * lda + k + 2 * s));
        acc[s][m] = _mm512_dpbf16_ps(acc[s][m], (__m512bh)a, (__m512bh)b);
      }
    }
  }
  for (; k + 1 < K; k += 2) {
    const __m512i b = row_pair(B + k * ldb, ldb, cols, interleave);
    for (int64_t m = 0; m < BLOCK_M; ++m) {
      const __m512i a = _mm512_set1_epi32(pair_at(A + m * lda + k));
      acc[0][m] = _mm512_dpbf16_ps(acc[0][m], (__m512bh)a, (__m512bh)b);
    }
  }
  if (k < K) {  // an odd last row pairs with zeros (and A's next element is never read)
    const __m512i b = last_row_pair(B + k * ldb, cols, interleave);
    for (int64_t m = 0; m < BLOCK_M; ++m) {
      const __m512i a = _mm512_set1_epi32(static_cast<int32_t>(A[m * lda + k]));
      acc[0][m] = _mm512_dpbf16_ps(acc[0][m], (__m512bh)a, (__m512bh)b);
    }
  }
  store_rows<S, BLOCK_M>(acc, C, ldc, cols);
}

// Prefill blocks of 16 query rows. In the kernel, A's rows (queries, or probabilities) and B's
// rows (keys, values) sit at strides known only at run time: the per-tile helpers above then
// keep sixteen row addresses in registers, spill them and their accumulators, and ran at
// ~35% (P @ V) and ~60% (q @ k^T) of the dot-product unit's rate on 2-core Zen 5. Here a chunk
// of A's rows is copied once, at a stride fixed at compile time (KS), so every broadcast is a
// constant offset from one address (no row addresses to keep); and B's 16-column tile is
// rearranged into dot-product pairs once per tile (transposed for q @ k^T, interleaved for
// P @ V) and kept in a buffer that every 16-row block of the chunk reads. Sums per lane run in
// the same order as the per-tile helpers (each row's pairs in order): the same results.

// rows [0, rows) of A, columns [0, K), at row stride KS; an odd K gets a zero column (its pair's partner)
template <int64_t KS>
FLEXPAGE_DOT_TARGET static inline void copy_rows(const uint16_t* A, int64_t lda, int64_t rows, int64_t K,
                                                 uint16_t* a) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < K; c += 32) {  // 32 values a vector (a library memcpy per row cost more)
      const __mmask32 part = K - c >= 32 ? ~__mmask32(0) : (__mmask32(1) << (K - c)) - 1;
      _mm512_mask_storeu_epi16(a + r * KS + c, part, _mm512_maskz_loadu_epi16(part, A + r * lda + c));
    }
    if (K & 1) {
      a[r * KS + K] = 0;
    }
  }
}

// C[m, 0:cols] (+)= sum over pairs p < pairs of a[m, 2p:2p+2] . bt[p], 16 rows of a at stride KS
template <int64_t KS, bool accum>
FLEXPAGE_DOT_TARGET static inline void rows16(const uint16_t* a, const __m512i* bt, int64_t pairs, float* C,
                                              int64_t ldc, __mmask16 cols) {
  __m512 acc[1][16];
  start_rows<1, 16, accum>(acc, C, ldc, cols);
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512i b = _mm512_load_si512(bt + p);
    for (int64_t m = 0; m < 16; ++m) {  // each row's pair broadcast from a constant offset of a
      acc[0][m] = _mm512_dpbf16_ps(acc[0][m], (__m512bh)b, (__m512bh)_mm512_set1_epi32(pair_at(a + m * KS + 2 * p)));
    }
  }
  store_rows<1, 16>(acc, C, ldc, cols);
}

// rows per chunk of A copied at stride KS: at most 8 KiB of copies
template <int64_t KS>
constexpr int64_t chunk_rows() {
  return KS <= 64 ? 64 : (KS <= 128 ? 32 : 16);
}

// the shared loop: A's rows in chunks copied at stride KS; for each 16-column tile of the
// product, ``rearrange(n, width, cols, bt)`` puts B's pairs for columns [n, n + width) in bt,
// which every 16-row block of the chunk then reads
template <int64_t KS, bool accum, typename Rearrange>
FLEXPAGE_DOT_TARGET void rows_at(const uint16_t* A, float* C, int64_t M, int64_t N, int64_t K, int64_t lda,
                                 int64_t ldc, int64_t pairs, Rearrange rearrange) {
  alignas(64) uint16_t a[chunk_rows<KS>() * KS];
  alignas(64) __m512i bt[KS / 2];
  for (int64_t m0 = 0; m0 < M; m0 += chunk_rows<KS>()) {
    const int64_t rows = std::min<int64_t>(chunk_rows<KS>(), M - m0);
    copy_rows<KS>(A + m0 * lda, lda, rows, K, a);
    for (int64_t n = 0; n < N; n += 16) {
      const int64_t width = std::min<int64_t>(16, N - n);
      const __mmask16 cols = width >= 16 ? __mmask16(0xffff) : __mmask16((1u << width) - 1);
      rearrange(n, width, cols, bt);
      for (int64_t m = 0; m < rows; m += 16) {
        rows16<KS, accum>(a + m * KS, bt, pairs, C + (m0 + m) * ldc + n, ldc, cols);
      }
    }
  }
}

// q @ k^T: each key tile transposed as 32-bit pairs (bt[p] lane c: pair p of key n + c)
template <int64_t KS, bool accum>
FLEXPAGE_DOT_TARGET void qk_rows_at(const uint16_t* A, const uint16_t* B, float* C, int64_t M, int64_t N,
                                    int64_t K, int64_t lda, int64_t ldb, int64_t ldc) {
  rows_at<KS, accum>(A, C, M, N, K, lda, ldc, K / 2,
                     [&](int64_t n, int64_t width, __mmask16, __m512i* bt) FLEXPAGE_DOT_TARGET {
    for (int64_t k = 0; k < K; k += 32) {
      __m512i tile[16];
      for (int64_t c = 0; c < 16; ++c) {
        tile[c] = c < width ? _mm512_loadu_si512(B + (n + c) * ldb + k) : _mm512_setzero_si512();
      }
      transpose16(tile);
      for (int64_t w = 0; w < 16; ++w) {
        _mm512_store_si512(bt + k / 2 + w, tile[w]);
      }
    }
  });
}

// P @ V: value rows interleaved in pairs (bt[p] lane c: rows 2p and 2p + 1 of column n + c)
template <int64_t KS, bool accum>
FLEXPAGE_DOT_TARGET void pv_rows_at(const uint16_t* A, const uint16_t* B, float* C, int64_t M, int64_t N,
                                    int64_t K, int64_t lda, int64_t ldb, int64_t ldc) {
  const __m512i interleave = pair_interleave();
  rows_at<KS, accum>(A, C, M, N, K, lda, ldc, (K + 1) / 2,
                     [&](int64_t n, int64_t, __mmask16 cols, __m512i* bt) FLEXPAGE_DOT_TARGET {
    for (int64_t p = 0; p < K / 2; ++p) {
      bt[p] = row_pair(B + 2 * p * ldb + n, ldb, cols, interleave);
    }
    if (K & 1) {
      bt[K / 2] = last_row_pair(B + (K - 1) * ldb + n, cols, interleave);
    }
  });
}

// the first M - M % 16 rows of the per-tile helpers' products (K % 32 == 0 for q @ k^T); false
// (nothing computed) where K is too long for the copies
template <bool trans_b, bool accum>
FLEXPAGE_DOT_TARGET bool rows_of_16(const uint16_t* A, const uint16_t* B, float* C, int64_t M, int64_t N,
                                    int64_t K, int64_t lda, int64_t ldb, int64_t ldc) {
  M -= M % 16;
  auto run = [&](auto at) {
    if constexpr (trans_b) {
      qk_rows_at<decltype(at)::value, accum>(A, B, C, M, N, K, lda, ldb, ldc);
    } else {
      pv_rows_at<decltype(at)::value, accum>(A, B, C, M, N, K, lda, ldb, ldc);
    }
  };
  if (K <= 64) {
    run(std::integral_constant<int64_t, 64>());
  } else if (K <= 128) {
    run(std::integral_constant<int64_t, 128>());
  } else if (K <= 256) {
    run(std::integral_constant<int64_t, 256>());
  } else {
    return false;
  }
  return true;
}

// out[0:size] = bf16(exp(a - val)) and val = their sum (``exp`` the caller's float32 vector
// exp): the bf16 values converted by vcvtneps2bf16 (ATen's vector code emulates the rounding,
// ~9 instructions per 16 values, a third of the softmax pass), a partial last vector masked
// rather than computed one value at a time
template <typename Exp>
FLEXPAGE_DOT_TARGET void exp_sum_bf16(const float* a, int64_t size, uint16_t* out, float& val, Exp exp) {
  const __m512 max = _mm512_set1_ps(val);
  __m512 sum = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= size; i += 16) {
    const __m512 e = exp(_mm512_sub_ps(_mm512_loadu_ps(a + i), max));
    sum = _mm512_add_ps(sum, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), (__m256i)_mm512_cvtneps_pbh(e));
  }
  if (i < size) {
    const __mmask16 tail = __mmask16((1u << (size - i)) - 1);
    const __m512 e = exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, a + i), max));
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(tail, e));
    _mm256_mask_storeu_epi16(out + i, tail, (__m256i)_mm512_cvtneps_pbh(e));
  }
  val = _mm512_reduce_add_ps(sum);
}
#undef FLEXPAGE_DOT_TARGET
}  // namespace flexpage_dot_bf16
#endif
