// Checks flexpage_dot_bf16::rows_of_16 (flexpage/attention/_dot_bf16.h) against a float64
// reference over the shapes a prefill kernel hands it: 16-row blocks, tails of columns, odd
// value counts, every copy stride (head dims 32-256, key blocks up to 256), with and without
// accumulation, and nothing written past the last column; inputs are multiples of 1/16, so every
// product and sum is exact and the results must be equal. Prints "<cases> cases, <bad> bad".
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "_dot_bf16.h"

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

// C (M x N, stride ldc) against sum_k A[m, k] * B(k, n) (+ C's old values when accumulating)
template <bool trans_b>
bool matches(int64_t M, int64_t N, int64_t K, bool accum) {
  const int64_t lda = K + 7, ldb = (trans_b ? K : N) + 3, ldc = N + 5;
  std::vector<uint16_t> A(M * lda), B((trans_b ? N : K) * ldb + 32);
  std::vector<float> C(M * ldc), before(M * ldc);
  for (auto& x : A) x = to_bf16(value());
  for (auto& x : B) x = to_bf16(value());
  for (size_t i = 0; i < C.size(); ++i) C[i] = before[i] = value();
  auto run = accum ? flexpage_dot_bf16::rows_of_16<trans_b, true> : flexpage_dot_bf16::rows_of_16<trans_b, false>;
  if (!run(A.data(), B.data(), C.data(), M, N, K, lda, ldb, ldc)) return false;
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
