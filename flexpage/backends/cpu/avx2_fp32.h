// flexpage: the tuned CPU FlexAttention template's float32 q @ k^T micro-gemm in AVX2 code
// (see flexpage/attention/_cpu_template_tuning.py, _AVX2_FP32_CALL).
//
// Without AVX-512 the stock micro-gemm computes q @ k^T (K row-major: a transposed B) one
// of two ways, and both cost more than the product: one transposes every 8 x 8 tile of K
// in generic vector code, the other reduces every score across a vector on its own (a
// horizontal sum per output against 8 multiply-adds at head_dim 64). On an AMD EPYC (Zen 3)
// this micro-gemm was a third of a float32 prefill call's time. Here each score is still a
// dot product over the head dimension, but the scores of a 2 x 4 block accumulate in eight
// vectors and are reduced together (one hadd tree per 8 scores), and each loaded K row
// serves two query rows. Sums are float32, in another order than the stock kernel's.
#ifndef FLEXPAGE_AVX2_FP32
#define FLEXPAGE_AVX2_FP32
#include <immintrin.h>
#include <cstdint>

namespace flexpage_avx2_fp32 {
#define FLEXPAGE_AVX2_TARGET __attribute__((target("avx2,fma")))

// lane j <- the sum of v[j]'s eight lanes
FLEXPAGE_AVX2_TARGET static inline __m256 sum_each(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]);
  const __m256 t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]);
  const __m256 t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1);  // v0..v3: low halves' sums, then high halves'
  const __m256 u1 = _mm256_hadd_ps(t2, t3);  // v4..v7 alike
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// C[r][c] (+)= A[r] . B[c] for ROWS x COLS = 8 scores (COLS columns from B's rows, or the
// first ``cols`` of them where the block is not FULL)
template <int ROWS, int COLS, bool FULL, bool accum>
FLEXPAGE_AVX2_TARGET static inline void block(const float* A, const float* B, float* C, int64_t cols, int64_t K,
                                              int64_t lda, int64_t ldb, int64_t ldc) {
  static_assert(ROWS * COLS == 8, "eight scores per block");
  __m256 acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 a[ROWS];
    for (int r = 0; r < ROWS; ++r) a[r] = _mm256_loadu_ps(A + r * lda + k);
    for (int c = 0; c < COLS; ++c) {
      if (!FULL && c >= cols) break;  // a column tail: those scores stay zero and are not stored
      const __m256 b = _mm256_loadu_ps(B + c * ldb + k);
      for (int r = 0; r < ROWS; ++r) acc[r * COLS + c] = _mm256_fmadd_ps(a[r], b, acc[r * COLS + c]);
    }
  }
  alignas(32) float sums[8];
  _mm256_store_ps(sums, sum_each(acc));
  for (int r = 0; r < ROWS; ++r) {
    for (int c = 0; c < COLS && (FULL || c < cols); ++c) {
      float* out = C + r * ldc + c;
      *out = accum ? *out + sums[r * COLS + c] : sums[r * COLS + c];
    }
  }
}

// C (+)= A @ B^T: A is BLOCK_M x K (row stride lda), B is N x K (row stride ldb), K % 8 == 0
template <int64_t BLOCK_M, bool accum>
FLEXPAGE_AVX2_TARGET inline void qk(const float* A, const float* B, float* C, int64_t N, int64_t K, int64_t lda,
                                    int64_t ldb, int64_t ldc) {
  int64_t m = 0;
  for (; m + 2 <= BLOCK_M; m += 2) {
    int64_t n = 0;
    for (; n + 4 <= N; n += 4) block<2, 4, true, accum>(A + m * lda, B + n * ldb, C + m * ldc + n, 4, K, lda, ldb, ldc);
    if (n < N) block<2, 4, false, accum>(A + m * lda, B + n * ldb, C + m * ldc + n, N - n, K, lda, ldb, ldc);
  }
  if (m < BLOCK_M) {
    int64_t n = 0;
    for (; n + 8 <= N; n += 8) block<1, 8, true, accum>(A + m * lda, B + n * ldb, C + m * ldc + n, 8, K, lda, ldb, ldc);
    if (n < N) block<1, 8, false, accum>(A + m * lda, B + n * ldb, C + m * ldc + n, N - n, K, lda, ldb, ldc);
  }
}
}  // namespace flexpage_avx2_fp32
#endif
