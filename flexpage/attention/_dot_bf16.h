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
#include <cstring>

namespace flexpage_dot_bf16 {
#define FLEXPAGE_DOT_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))

// two consecutive bf16 values as one 32-bit word
static inline int32_t pair_at(const uint16_t* p) {
  int32_t w;
  std::memcpy(&w, p, sizeof(w));
  return w;
}

// in place: r[j] lane i <- r[i] lane j, a 16 x 16 transpose of 32-bit words
FLEXPAGE_DOT_TARGET static inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
}

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

// lane i: (row 0, column i), (row 1, column i) of the two rows at B, columns in ``cols``
FLEXPAGE_DOT_TARGET static inline __m512i row_pair(const uint16_t* B, int64_t ldb, __mmask16 cols, __m512i interleave) {
  const __m256i r0 = _mm256_maskz_loadu_epi16(cols, B);
  const __m256i r1 = _mm256_maskz_loadu_epi16(cols, B + ldb);
  return _mm512_permutexvar_epi16(interleave, _mm512_inserti64x4(_mm512_castsi256_si512(r0), r1, 1));
}

// C[m, 0:N] (+)= sum_k A[m, k] * B[k, n] for BLOCK_M rows, N <= 16 columns, any K
template <int64_t BLOCK_M, bool accum>
FLEXPAGE_DOT_TARGET void pv(const uint16_t* A, const uint16_t* B, float* C, int64_t N, int64_t K,
                            int64_t lda, int64_t ldb, int64_t ldc) {
  constexpr int64_t S = chains<BLOCK_M>();
  const __mmask16 cols = N >= 16 ? __mmask16(0xffff) : __mmask16((1u << N) - 1);
  // lane i of a row pair: element i of the first row, element i of the second ([row | row])
  const __m512i interleave = _mm512_set_epi16(
      31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
      23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
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
    const __m256i r0 = _mm256_maskz_loadu_epi16(cols, B + k * ldb);
    const __m512i b = _mm512_permutexvar_epi16(interleave, _mm512_zextsi256_si512(r0));  // partner lanes 0
    for (int64_t m = 0; m < BLOCK_M; ++m) {
      const __m512i a = _mm512_set1_epi32(static_cast<int32_t>(A[m * lda + k]));
      acc[0][m] = _mm512_dpbf16_ps(acc[0][m], (__m512bh)a, (__m512bh)b);
    }
  }
  store_rows<S, BLOCK_M>(acc, C, ldc, cols);
}
#undef FLEXPAGE_DOT_TARGET
}  // namespace flexpage_dot_bf16
#endif
