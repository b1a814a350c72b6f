// y = x @ W.T + bias with W kept as Q4_1 blocks: flexpage::q4_1_linear.
//
// A GGUF Q4_1 block is 32 weights of one output row: fp16 scale d, fp16 offset m, then 16 bytes
// of 4-bit codes q (low nibbles are weights 0-15, high nibbles 16-31); weight = d * q + m. Here
// d and m are stored as float32 (24-byte blocks, flexpage.model.gguf_linear.repack_q4_1): read
// with a broadcast load instead of a half-to-float conversion, the 2-core AMD Zen 3 ran a
// 3072x576 projection in 116 instead of 207 us. d * q is exact in float32 (an 11-bit mantissa
// times a 4-bit integer), so the fused multiply-add gives the same float32 weights as GGUF's
// own dequantisation (one rounding, of the sum).
//
// Decode-sized inputs (at most max_rows rows) read the blocks: each thread takes a range of
// output rows and, for each, expands a block into registers and multiplies it with up to four
// input rows, so the weights stream from memory once per call, a quarter of float32's bytes.
// Larger inputs reuse each weight across many rows, where oneDNN's blocked float32 kernels are
// 2-3x faster than expanding blocks: they go to the weight packed for oneDNN.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cstdint>
#include <string>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;       // weights per Q4_1 block
constexpr int64_t kBlockBytes = 24;  // float32 d, float32 m, 16 bytes of codes

// The float32 weights of one block's 8-weight quarter: fma(d, q, m) (see the file comment).
inline __m256 expand8(__m128i codes, __m256 d, __m256 m) {
  return _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes)), m);
}

inline float lane_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// y[i * ldy] = sum_k x[i, k] * w[k] for R input rows and one output row's blocks. Each block's
// weights are expanded once into registers and used by all R rows; a row sums into
// 4 / (R > 2 ? 2 : 1) independent accumulators so that the fused multiply-adds overlap.
template <int R>
inline void rows_times_weight_row(const float* x, int64_t K, const uint8_t* blocks, float* y, int64_t ldy) {
  constexpr int kChains = R > 2 ? 2 : 4;
  const __m128i low4 = _mm_set1_epi8(0x0f);
  __m256 acc[R][kChains];
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < kChains; ++c) acc[i][c] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += kBlock, blocks += kBlockBytes) {
    const float* scale = reinterpret_cast<const float*>(blocks);
    const __m256 d = _mm256_broadcast_ss(scale);
    const __m256 m = _mm256_broadcast_ss(scale + 1);
    const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blocks + 8));
    const __m128i lo = _mm_and_si128(codes, low4);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(codes, 4), low4);
    const __m256 w[4] = {expand8(lo, d, m), expand8(_mm_srli_si128(lo, 8), d, m), expand8(hi, d, m),
                         expand8(_mm_srli_si128(hi, 8), d, m)};
    for (int i = 0; i < R; ++i)
      for (int q = 0; q < 4; ++q)
        acc[i][q % kChains] = _mm256_fmadd_ps(w[q], _mm256_loadu_ps(x + i * K + k + 8 * q), acc[i][q % kChains]);
  }
  for (int i = 0; i < R; ++i) {
    __m256 total = acc[i][0];
    for (int c = 1; c < kChains; ++c) total = _mm256_add_ps(total, acc[i][c]);
    y[i * ldy] = lane_sum(total);
  }
}

// Output rows [begin, end) of y = x @ W.T for all input rows, four input rows at a time
// (an output row's blocks, ~K/2 bytes, stay in L1 between the groups).
void q4_1_rows(const float* x, int64_t rows, int64_t K, const uint8_t* blocks, int64_t row_bytes, float* y,
               int64_t N, int64_t begin, int64_t end) {
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* w = blocks + n * row_bytes;
    int64_t i = 0;
    for (; i + 4 <= rows; i += 4) rows_times_weight_row<4>(x + i * K, K, w, y + i * N + n, N);
    switch (rows - i) {
      case 3: rows_times_weight_row<3>(x + i * K, K, w, y + i * N + n, N); break;
      case 2: rows_times_weight_row<2>(x + i * K, K, w, y + i * N + n, N); break;
      case 1: rows_times_weight_row<1>(x + i * K, K, w, y + i * N + n, N); break;
      default: break;
    }
  }
}

// oneDNN's linear on a weight packed by mkldnn::_reorder_linear_weight (as eager code calls it)
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack{x, weight, bias, std::string("none"), c10::List<std::optional<c10::Scalar>>(),
                                 std::string("")};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// x @ W.T + bias: from the Q4_1 blocks for at most max_rows input rows, else from the float32
// weight packed for oneDNN (whose blocked kernels win once the weights are reused across rows).
at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& blocks, const std::optional<at::Tensor>& packed,
                       const std::optional<at::Tensor>& bias, int64_t max_rows) {
  TORCH_CHECK(x.device().is_cpu() && blocks.device().is_cpu(), "q4_1_linear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "q4_1_linear: x must be float32, got ", x.scalar_type());
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              "q4_1_linear: blocks must be a contiguous uint8 [out_features, in_features / 32 * 24] tensor");
  TORCH_CHECK(x.dim() == 2, "q4_1_linear: x must be [rows, in_features], got ", x.sizes());
  const int64_t K = x.size(1), N = blocks.size(0), rows = x.size(0);
  TORCH_CHECK(K % kBlock == 0 && blocks.size(1) == K / kBlock * kBlockBytes, "q4_1_linear: x has ", K,
              " features, blocks hold ", blocks.size(1) / kBlockBytes * kBlock);
  if (rows > max_rows && packed.has_value() && packed->defined()) return packed_linear(x, *packed, bias);
  const at::Tensor input = x.contiguous();
  at::Tensor out = at::empty({rows, N}, x.options());
  if (rows == 0 || N == 0) return out;
  const float* xp = input.data_ptr<float>();
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  float* yp = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    q4_1_rows(xp, rows, K, bp, blocks.size(1), yp, N, begin, end);
  });
  if (bias.has_value() && bias->defined()) out.add_(*bias);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flexpage, m) {
  m.def("q4_1_linear(Tensor x, Tensor blocks, Tensor? packed, Tensor? bias, int max_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(flexpage, CPU, m) {
  m.impl("q4_1_linear", &q4_1_linear);
}

// the packed weight is an MKLDNN tensor, whose dispatch key wins when it is passed
TORCH_LIBRARY_IMPL(flexpage, MkldnnCPU, m) {
  m.impl("q4_1_linear", &q4_1_linear);
}
