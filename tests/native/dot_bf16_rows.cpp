// Checks flexpage_dot_bf16::rows_of_16 (flexpage/backends/cpu/dot_bf16.h) against a float64
// reference over the shapes a prefill kernel hands it: 16-row blocks, tails of columns, odd
// value counts, every copy stride (head dims 32-256, key blocks up to 256), with and without
// accumulation, and nothing written past the last column; and flexpage_dot_bf16::qk over the
// 1-4 rows of a decode token's packed query heads and a tile's 1-16 keys.
// Inputs are multiples of 1/16, so every product and sum is exact and the results must be
// equal. Prints "<cases> cases, <bad> bad".
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "dot_bf16.h"

namespace {
uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);  // values of a few bits: exact
}
float from_bf16(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
float value() { return (std::rand() % 64 - 32) / 16.0f; }

template <int64_t M, bool accum>
void qk_rows(const uint16_t* A, const uint16_t* B, float* C, int64_t N, int64_t K, int64_t lda, int64_t ldb,
             int64_t ldc) {
  flexpage_dot_bf16::qk<M, accum>(A, B, C, N, K, lda, ldb, ldc);
}

template <bool accum>
void run_qk_accum(int64_t M, const uint16_t* A, const uint16_t* B, float* C, int64_t N, int64_t K, int64_t lda,
                  int64_t ldb, int64_t ldc) {
  switch (M) {
    case 1: return qk_rows<1, accum>(A, B, C, N, K, lda, ldb, ldc);
    case 2: return qk_rows<2, accum>(A, B, C, N, K, lda, ldb, ldc);
    case 3: return qk_rows<3, accum>(A, B, C, N, K, lda, ldb, ldc);
    default: return qk_rows<4, accum>(A, B, C, N, K, lda, ldb, ldc);
  }
}

void run_qk(int64_t M, bool accum, const uint16_t* A, const uint16_t* B, float* C, int64_t N, int64_t K,
            int64_t lda, int64_t ldb, int64_t ldc) {
  accum ? run_qk_accum<true>(M, A, B, C, N, K, lda, ldb, ldc) : run_qk_accum<false>(M, A, B, C, N, K, lda, ldb, ldc);
}

// C (M x N, stride ldc) against sum_k A[m, k] * B(k, n) (+ C's old values when accumulating)
template <bool trans_b>
bool matches(int64_t M, int64_t N, int64_t K, bool accum) {
  const int64_t lda = K + 7, ldb = (trans_b ? K : N) + 3, ldc = N + 5;
  std::vector<uint16_t> A(M * lda), B((trans_b ? N : K) * ldb + 32);
  std::vector<float> C(M * ldc), before(M * ldc);
  for (auto& x : A) x = to_bf16(value());
  for (auto& x : B) x = to_bf16(value());
  for (size_t i = 0; i < C.size(); ++i) C[i] = before[i] = value();
  if (M <= 4) {  // one call of the per-tile q @ k^T for M rows, N <= 16 keys
    run_qk(M, accum, A.data(), B.data(), C.data(), N, K, lda, ldb, ldc);
  } else {
    auto run = accum ? flexpage_dot_bf16::rows_of_16<trans_b, true> : flexpage_dot_bf16::rows_of_16<trans_b, false>;
    if (!run(A.data(), B.data(), C.data(), M, N, K, lda, ldb, ldc)) return false;
  }
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < ldc; ++n) {
      double want = before[m * ldc + n];  // past N: untouched
      if (n < N) {
        want = accum ? want : 0.0;
        for (int64_t k = 0; k < K; ++k) {
          want += double(from_bf16(A[m * lda + k])) * from_bf16(trans_b ? B[n * ldb + k] : B[k * ldb + n]);
        }
      }
      if (want != double(C[m * ldc + n])) return false;  // every sum is exact in float32
    }
  }
  return true;
}
}  // namespace

int main() {
  int cases = 0, bad = 0;
  for (int64_t M : {1, 2, 3, 4}) {  // decode: q @ k^T of one key tile
    for (int accum = 0; accum < 2; ++accum) {
      for (int64_t N : {1, 7, 15, 16}) {
        for (int64_t K : {32, 64, 128, 256}) {
          ++cases;
          bad += !matches<true>(M, N, K, accum);
        }
      }
    }
  }
  for (int64_t M : {16, 32, 48, 80}) {
    for (int accum = 0; accum < 2; ++accum) {
      for (int64_t N : {1, 15, 16, 37, 128}) {
        for (int64_t K : {32, 64, 128, 256}) {  // q @ k^T: head dims, a multiple of 32
          ++cases;
          bad += !matches<true>(M, N, K, accum);
        }
      }
      for (int64_t N : {16, 40, 64}) {
        for (int64_t K : {1, 2, 17, 33, 64, 127, 128, 200, 256}) {  // P @ V: any count of keys
          ++cases;
          bad += !matches<false>(M, N, K, accum);
        }
      }
    }
  }
  std::printf("%d cases, %d bad\n", cases, bad);
  return bad != 0;
}
