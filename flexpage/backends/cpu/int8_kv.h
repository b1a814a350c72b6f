// flexpage: the tuned CPU FlexAttention template's products over 8-bit keys and values (the int8
// KV cache), in AVX-512 code (see flexpage/backends/cpu/template_edits.py, INT8_KV_ROWS_CALL).
//
// Inductor's micro-gemm reads an int8 B by widening each 16 elements to float32, per 16-column
// tile; for q @ k^T (a transposed B) it then transposes every 16 x 16 float tile and broadcasts
// each query element from a scalar. A bf16 SmolLM2 decode call (8 rows of 8k tokens) over int8
// keys ran no faster than over bf16 keys at half the bytes (2.5 ms, compute-bound). Here a
// decode token's whole row block (its packed query heads) is computed in one call:
// * q @ k^T on VNNI integer dot products (four int8 products a lane per instruction): the
//   query's int8 codes are found once per call; 16 keys' rows of 64 channels are loaded as 16
//   vectors and transposed as 32-bit words (four channels each), which is the operand layout of
//   vpdpbusd. CPUs without AVX512-VNNI keep Inductor's product.
// * P @ V reads each value row's 64 columns once, widened to float32 for the multiply-adds.
// The same call took 1.5x less time than over bf16 keys (Xeon with AMX, bench: docs/kv-cache-dtype.md).
#ifndef FLEXPAGE_INT8_KV
#define FLEXPAGE_INT8_KV
#include <immintrin.h>
#include <cstdint>
#include <algorithm>
#include <type_traits>
#ifndef FLEXPAGE_AVX512_TILES  // standalone (a test's driver); the kernel text puts avx512_tiles.h first
#include "avx512_tiles.h"
#endif

namespace flexpage_int8_kv {
using flexpage_avx512_tiles::transpose16;
#define FLEXPAGE_INT8_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))

//: the longest row of A (head dimension for q @ k^T, key block for P @ V) the helpers take
constexpr int64_t MAX_K = 512;

// independent accumulators per row, so that a few rows keep both FMA units busy; summed at the end
template <int64_t BLOCK_M>
constexpr int64_t chains() {
  return BLOCK_M >= 8 ? 1 : (BLOCK_M >= 4 ? 2 : 4);
}

// A's rows [0, BLOCK_M) x [0, K) as float32, at stride MAX_K (A: float or a 16-bit bf16)
template <int64_t BLOCK_M, typename A_t>
FLEXPAGE_INT8_TARGET static inline void widen_rows(const A_t* A, int64_t lda, int64_t K, float* a) {
  for (int64_t m = 0; m < BLOCK_M; ++m) {
    for (int64_t k = 0; k < K; k += 16) {
      const __mmask16 part = K - k >= 16 ? __mmask16(0xffff) : __mmask16((1u << (K - k)) - 1);
      __m512 x;
      if constexpr (std::is_same_v<A_t, float>) {
        x = _mm512_maskz_loadu_ps(part, A + m * lda + k);
      } else {  // bf16: the upper half of a float32
        static_assert(sizeof(A_t) == 2, "A is float32 or bf16");
        const __m256i h = _mm256_maskz_loadu_epi16(part, reinterpret_cast<const uint16_t*>(A + m * lda + k));
        x = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      }
      _mm512_storeu_ps(a + m * MAX_K + k, x);
    }
  }
}

#define FLEXPAGE_VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))

static inline bool has_vnni() {
  static const bool yes = __builtin_cpu_supports("avx512vnni");
  return yes;
}

// The engine hands the kernel queries already on an int8 grid (flexpage.attention.kv_quant.
// scale_queries: a query head's row is code * (max |row| / 127)), so the codes recovered here
// (round(a / (max |a| / 127))) are the graph's own and the integer sums are exact: the result is
// the float path's up to float32 rounding. Keys go in as unsigned bytes (k + 128), so each sum
// carries 128 * sum(codes) of its row, subtracted before the row's scale multiplies it.
template <int64_t BLOCK_M>
struct QueryCodes {
  alignas(64) int32_t words[BLOCK_M * MAX_K / 4];  // four int8 codes a word, rows at stride MAX_K / 4
  float scale[BLOCK_M];
  int32_t bias[BLOCK_M];  // 128 * the row's sum of codes
};

// A's rows (K % 16 == 0) as int8 codes of their own scale
template <int64_t BLOCK_M, typename A_t>
FLEXPAGE_VNNI_TARGET static inline void query_codes(const A_t* A, int64_t lda, int64_t K, QueryCodes<BLOCK_M>& q) {
  alignas(64) float a[BLOCK_M * MAX_K];
  widen_rows<BLOCK_M>(A, lda, K, a);
  for (int64_t m = 0; m < BLOCK_M; ++m) {
    __m512 peak = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
      peak = _mm512_max_ps(peak, _mm512_abs_ps(_mm512_loadu_ps(a + m * MAX_K + k)));
    }
    const float top = _mm512_reduce_max_ps(peak);
    q.scale[m] = top / 127.0f;
    const __m512 inverse = _mm512_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
    __m512i total = _mm512_setzero_si512();
    for (int64_t k = 0; k < K; k += 16) {
      const __m512i codes = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(a + m * MAX_K + k), inverse));
      total = _mm512_add_epi32(total, codes);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q.words + (m * MAX_K + k) / 4), _mm512_cvtsepi32_epi8(codes));
    }
    q.bias[m] = 128 * _mm512_reduce_add_epi32(total);
  }
}

// C[m, 0:N] (+)= the query codes' scores against N <= 16 keys at B
template <int64_t BLOCK_M, bool accum>
FLEXPAGE_VNNI_TARGET static inline void qk_vnni_tile(const QueryCodes<BLOCK_M>& q, const int8_t* B, float* C, int64_t N,
                                                     int64_t K, int64_t ldb, int64_t ldc) {
  constexpr int64_t S = chains<BLOCK_M>();
  const __mmask16 cols = N >= 16 ? __mmask16(0xffff) : __mmask16((1u << N) - 1);
  __m512i acc[S][BLOCK_M];
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t m = 0; m < BLOCK_M; ++m) {
      acc[s][m] = _mm512_setzero_si512();
    }
  }
  for (int64_t n = 16; n < 32; ++n) {  // the next 16 keys on their way
    for (int64_t k = 0; k < K; k += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(B + n * ldb + k), _MM_HINT_T0);
    }
  }
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t k = 0; k < K; k += 64) {
    const __mmask64 part = K - k >= 64 ? ~__mmask64(0) : (__mmask64(1) << (K - k)) - 1;
    __m512i rows[16];
    for (int64_t n = 0; n < 16; ++n) {
      rows[n] = n < N ? _mm512_maskz_loadu_epi8(part, B + n * ldb + k) : _mm512_setzero_si512();
    }
    transpose16(rows);  // rows[w] lane n: channels k + 4w .. k + 4w + 3 of key n
    const int64_t words = std::min<int64_t>(16, (K - k) / 4);
    for (int64_t w = 0; w < words; ++w) {
      const __m512i keys = _mm512_xor_si512(rows[w], flip);  // k + 128, as unsigned bytes
      for (int64_t m = 0; m < BLOCK_M; ++m) {
        const __m512i codes = _mm512_set1_epi32(q.words[(m * MAX_K + k) / 4 + w]);
        acc[w % S][m] = _mm512_dpbusd_epi32(acc[w % S][m], keys, codes);
      }
    }
  }
  for (int64_t m = 0; m < BLOCK_M; ++m) {
    __m512i sum = acc[0][m];
    for (int64_t s = 1; s < S; ++s) {
      sum = _mm512_add_epi32(sum, acc[s][m]);
    }
    __m512 out = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sum, _mm512_set1_epi32(q.bias[m]))),
                               _mm512_set1_ps(q.scale[m]));
    if (accum) {
      out = _mm512_add_ps(out, _mm512_maskz_loadu_ps(cols, C + m * ldc));
    }
    _mm512_mask_storeu_ps(C + m * ldc, cols, out);
  }
}

// A whole q @ k^T of BLOCK_M rows against N keys (any N): the query codes computed once
template <int64_t BLOCK_M, bool accum, typename A_t>
FLEXPAGE_VNNI_TARGET void qk_vnni_rows(const A_t* A, const int8_t* B, float* C, int64_t N, int64_t K, int64_t lda,
                                       int64_t ldb, int64_t ldc) {
  QueryCodes<BLOCK_M> q;
  query_codes<BLOCK_M>(A, lda, K, q);
  for (int64_t n = 0; n < N; n += 16) {
    qk_vnni_tile<BLOCK_M, accum>(q, B + n * ldb, C + n, std::min<int64_t>(16, N - n), K, ldb, ldc);
  }
}


// P @ V of BLOCK_M rows over all N columns (any N): each value row's 64 columns loaded once, A
// widened once
template <int64_t BLOCK_M, bool accum, typename A_t>
FLEXPAGE_INT8_TARGET void pv_rows(const A_t* A, const int8_t* B, float* C, int64_t N, int64_t K, int64_t lda,
                                  int64_t ldb, int64_t ldc) {
  alignas(64) float a[BLOCK_M * MAX_K];
  widen_rows<BLOCK_M>(A, lda, K, a);
  for (int64_t n0 = 0; n0 < N; n0 += 64) {
    const int64_t width = std::min<int64_t>(64, N - n0);
    const __mmask64 bytes = width >= 64 ? ~__mmask64(0) : (__mmask64(1) << width) - 1;
    __mmask16 cols[4];
    for (int c = 0; c < 4; ++c) {
      const int64_t left = std::max<int64_t>(0, std::min<int64_t>(16, width - 16 * c));
      cols[c] = left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
    }
    __m512 acc[BLOCK_M][4];
    for (int64_t m = 0; m < BLOCK_M; ++m) {
      for (int c = 0; c < 4; ++c) {
        acc[m][c] = accum ? _mm512_maskz_loadu_ps(cols[c], C + m * ldc + n0 + 16 * c) : _mm512_setzero_ps();
      }
    }
    for (int64_t k = 0; k < K; ++k) {
      const __m512i row = _mm512_maskz_loadu_epi8(bytes, B + k * ldb + n0);
      __m512 b[4];
      b[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_castsi512_si128(row)));
      b[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(row, 1)));
      b[2] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(row, 2)));
      b[3] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(row, 3)));
      for (int64_t m = 0; m < BLOCK_M; ++m) {
        const __m512 p = _mm512_set1_ps(a[m * MAX_K + k]);
        for (int c = 0; c < 4; ++c) {
          acc[m][c] = _mm512_fmadd_ps(p, b[c], acc[m][c]);
        }
      }
    }
    for (int64_t m = 0; m < BLOCK_M; ++m) {
      for (int c = 0; c < 4; ++c) {
        _mm512_mask_storeu_ps(C + m * ldc + n0 + 16 * c, cols[c], acc[m][c]);
      }
    }
  }
}

// a whole product of BLOCK_M rows (the entry's full row block), where the helpers take it
template <int64_t BLOCK_M, bool trans_b, bool accum, typename A_t>
FLEXPAGE_INT8_TARGET bool rows(const A_t* A, const int8_t* B, float* C, int64_t N, int64_t K, int64_t lda,
                               int64_t ldb, int64_t ldc) {
  if (K > MAX_K) {
    return false;
  }
  if constexpr (trans_b) {
    if (K % 16 != 0 || !has_vnni()) {
      return false;
    }
    qk_vnni_rows<BLOCK_M, accum>(A, B, C, N, K, lda, ldb, ldc);
  } else {
    pv_rows<BLOCK_M, accum>(A, B, C, N, K, lda, ldb, ldc);
  }
  return true;
}
}  // namespace flexpage_int8_kv
#endif
