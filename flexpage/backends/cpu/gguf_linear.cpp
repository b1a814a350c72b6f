// y = x @ W.T + bias with W kept as GGUF quantised blocks: flexpage::block_linear; and
// flexpage::block_or_packed_linear, which picks the blocks or oneDNN's packed weight per call.
//
// GGUF stores 32 weights of one output row per block. Q4_1: fp16 scale d, fp16 offset m, then
// 16 bytes of 4-bit codes q (low nibbles are weights 0-15, high nibbles 16-31); w = d * q + m.
// Q4_0: fp16 d and the codes; w = d * (q - 8). Q8_0: fp16 scale d, then 32 signed bytes q;
// w = d * q. Here the scales are stored as float32 (flexpage.model.gguf_linear.repack): 20-byte
// Q4_0 blocks (m = -8 d computed), 24-byte Q4_1, 36-byte Q8_0, and 40-byte Q8_16 blocks (two
// scales, one per 16 weights, and 32 signed bytes: GGUF's Q6_K, whose 16-weight scales are
// d * sc), so the row width in bytes tells the format. Read with a broadcast load instead of a
// half-to-float conversion, the 2-core AMD Zen 3 ran a 3072x576 Q4_1 projection in 116 instead
// of 207 us. d * q is exact in float32 (an 11-bit mantissa times a 4- or 8-bit integer), so the
// weights are exactly GGUF's own dequantisation (the fused multiply-add d * q + m rounds once,
// as GGUF's sum does; Q6_K's (d * sc) * q rounds once, as GGUF's does).
//
// Up to kDotRows input rows: each thread takes a range of output rows and, for each, expands a
// block into registers and multiplies it with up to four input rows, so the weights stream from
// memory once per call (Q4_1: a fifth of float32's bytes). More rows would expand each block
// again for every four rows: instead each thread expands 16 output rows at a time into a float32
// panel and runs a register-tiled GEMM over it (output_panels): on the 2-core Zen 3 as fast as
// oneDNN's packed float32 from 160 rows up, faster below (bench/gguf_linear.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;  // weights per block
constexpr int64_t kDotRows = 12; // inputs of up to this many rows expand blocks in registers, per output row

// The 32 float32 weights of one block, as four vectors of 8.
// w = d * q + m for the 16 bytes of 4-bit codes at `codes`
inline void expand_nibbles(const uint8_t* codes, __m256 d, __m256 m, __m256 w[4]) {
  const __m128i low4 = _mm_set1_epi8(0x0f);
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
  const __m128i lo = _mm_and_si128(bytes, low4), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
  const __m128i eights[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  for (int q = 0; q < 4; ++q) w[q] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(eights[q])), m);
}

struct Q4_1 {
  static constexpr int64_t kBytes = 24;  // float32 d, float32 m, 16 bytes of codes
  static inline void expand(const uint8_t* block, __m256 w[4]) {
    const float* scale = reinterpret_cast<const float*>(block);
    expand_nibbles(block + 8, _mm256_broadcast_ss(scale), _mm256_broadcast_ss(scale + 1), w);
  }
};

struct Q4_0 {
  static constexpr int64_t kBytes = 20;  // float32 d, 16 bytes of codes; m = -8 d (exact)
  static inline void expand(const uint8_t* block, __m256 w[4]) {
    const __m256 d = _mm256_broadcast_ss(reinterpret_cast<const float*>(block));
    expand_nibbles(block + 4, d, _mm256_mul_ps(d, _mm256_set1_ps(-8.0f)), w);
  }
};

// w[q] = d_q * the 8 signed bytes at codes + 8 q
inline void expand_bytes(const uint8_t* codes, const __m256 d[4], __m256 w[4]) {
  for (int q = 0; q < 4; ++q) {
    const __m128i eight = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 8 * q));
    w[q] = _mm256_mul_ps(d[q], _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight)));
  }
}

struct Q8_0 {
  static constexpr int64_t kBytes = 36;  // float32 d, 32 signed bytes
  static inline void expand(const uint8_t* block, __m256 w[4]) {
    const __m256 d = _mm256_broadcast_ss(reinterpret_cast<const float*>(block));
    const __m256 scales[4] = {d, d, d, d};
    expand_bytes(block + 4, scales, w);
  }
};

struct Q8_16 {
  static constexpr int64_t kBytes = 40;  // float32 scales of weights 0-15 and 16-31, 32 signed bytes
  static inline void expand(const uint8_t* block, __m256 w[4]) {
    const float* scale = reinterpret_cast<const float*>(block);
    const __m256 d0 = _mm256_broadcast_ss(scale), d1 = _mm256_broadcast_ss(scale + 1);
    const __m256 scales[4] = {d0, d0, d1, d1};
    expand_bytes(block + 8, scales, w);
  }
};

// The formats by the kernel's block width: the AVX2 structs here, the AVX-512 ones (bf16::)
// below; with_format calls fn(Formats<...>{}) for a row's format
enum class Kind { kQ4_0, kQ4_1, kQ8_0, kQ8_16, kNone };

inline Kind kind_of(int64_t K, int64_t row_bytes) {
  if (K % kBlock != 0) return Kind::kNone;
  const int64_t blocks = K / kBlock;
  if (row_bytes == blocks * Q4_0::kBytes) return Kind::kQ4_0;
  if (row_bytes == blocks * Q4_1::kBytes) return Kind::kQ4_1;
  if (row_bytes == blocks * Q8_0::kBytes) return Kind::kQ8_0;
  if (row_bytes == blocks * Q8_16::kBytes) return Kind::kQ8_16;
  return Kind::kNone;
}

inline float lane_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The few-row kernels read each output row's blocks once, in order: they prefetch the row
// kNearBytes ahead into L1 and the row kFarBytes ahead into L2 (at least two rows ahead each).
// A core's L1 keeps ~16 misses in flight, which at this VM's ~130 ns latency caps one thread
// near 8 GB/s; requests into L2 have more room. With L1 alone one row of a 1B Llama's Q4_0
// projections and LM head ran at 23 GB/s on the AMX Xeon, with L2 too at 27-28 GB/s
// (bench.gguf_linear --gguf, 1 row: 33-35 vs 40 ms); SmolLM2's 121 projections of one
// decode step (0.1-0.7 MB a thread each) from memory in 6.8-7.5 instead of 7.4-8.3 ms (a loop
// of one step's calls, alternating builds), and its batch-1 decode 10.9-11.8 vs 11.7-12.5 ms a
// token (LLM.generate, three alternating pairs of processes).
constexpr int64_t kNearBytes = 4096, kFarBytes = 16384;

class RowPrefetch {
 public:
  // for output rows before `end` of row_bytes each
  RowPrefetch(int64_t row_bytes, int64_t end)
      : row_bytes_(row_bytes), lines_((row_bytes + 63) / 64), end_(end),
        near_(std::max<int64_t>(2, (kNearBytes + row_bytes - 1) / row_bytes)),
        far_(std::max<int64_t>(2, (kFarBytes + row_bytes - 1) / row_bytes)) {}

  // before reading output row n, whose blocks start at `row`
  __attribute__((always_inline)) inline void operator()(const uint8_t* row, int64_t n) const {
    const char* bytes = reinterpret_cast<const char*>(row);
    if (n + near_ < end_)
      for (int64_t line = 0; line < lines_; ++line) _mm_prefetch(bytes + near_ * row_bytes_ + 64 * line, _MM_HINT_T0);
    if (n + far_ < end_)
      for (int64_t line = 0; line < lines_; ++line) _mm_prefetch(bytes + far_ * row_bytes_ + 64 * line, _MM_HINT_T1);
  }

 private:
  int64_t row_bytes_, lines_, end_, near_, far_;
};

// y[i * ldy] = sum_k x[i, k] * w[k] for R input rows and one output row's blocks. Each block's
// weights are expanded once into registers and used by all R rows; a row sums into
// 4 / (R > 2 ? 2 : 1) independent accumulators so that the fused multiply-adds overlap.
template <typename Format, int R>
__attribute__((always_inline)) inline void rows_times_weight_row(const float* x, int64_t K, const uint8_t* blocks,
                                                                 float* y, int64_t ldy) {
  constexpr int kChains = R > 2 ? 2 : 4;
  __m256 acc[R][kChains];
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < kChains; ++c) acc[i][c] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += kBlock, blocks += Format::kBytes) {
    __m256 w[4];
    Format::expand(blocks, w);
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
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
// (an output row's blocks, under K bytes, stay in L1 between the groups).
template <typename Format>
void output_rows(const float* x, int64_t rows, int64_t K, const uint8_t* blocks, float* y, int64_t N, int64_t begin,
                 int64_t end) {
  const int64_t row_bytes = K / kBlock * Format::kBytes;
  const RowPrefetch prefetch(row_bytes, end);
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* w = blocks + n * row_bytes;
    prefetch(w, n);
    int64_t i = 0;
    for (; i + 4 <= rows; i += 4) rows_times_weight_row<Format, 4>(x + i * K, K, w, y + i * N + n, N);
    switch (rows - i) {
      case 3: rows_times_weight_row<Format, 3>(x + i * K, K, w, y + i * N + n, N); break;
      case 2: rows_times_weight_row<Format, 2>(x + i * K, K, w, y + i * N + n, N); break;
      case 1: rows_times_weight_row<Format, 1>(x + i * K, K, w, y + i * N + n, N); break;
      default: break;
    }
  }
}

// Larger inputs: each thread expands the blocks of 16 output rows at a time once into a float32
// panel [K][16] (transposed, in L1/L2), then multiplies six input rows at a time with it
// (broadcast x, 12 accumulators: the register tile of a float32 GEMM), so expanding costs once
// per call, not once per few input rows.
constexpr int64_t kPanel = 16;  // output rows per panel
constexpr int kTile = 6;        // input rows per register tile
constexpr int64_t kChunkBytes = 384 << 10;  // of x per pass over the panels (L2: 512 KB per core on Zen 3)

// r[j] = column j of the 8x8 matrix whose rows were r[0..7]
inline void transpose8(__m256 r[8]) {
  __m256 t[8], s[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    s[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    s[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    s[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    s[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x31);
  }
}

// panel[k * 16 + j] = W[j, k] for the 16 output rows whose blocks start at `blocks`
template <typename Format>
void expand_panel(const uint8_t* blocks, int64_t row_bytes, int64_t K, float* panel) {
  for (int64_t b = 0; b < K / kBlock; ++b) {
    for (int half = 0; half < 2; ++half) {
      __m256 w[8][4];
      for (int r = 0; r < 8; ++r) Format::expand(blocks + (half * 8 + r) * row_bytes + b * Format::kBytes, w[r]);
      for (int q = 0; q < 4; ++q) {
        __m256 column[8];
        for (int r = 0; r < 8; ++r) column[r] = w[r][q];
        transpose8(column);
        float* out = panel + (b * kBlock + 8 * q) * kPanel + 8 * half;
        for (int j = 0; j < 8; ++j) _mm256_storeu_ps(out + j * kPanel, column[j]);
      }
    }
  }
}

// y[i * ldy + j] = sum_k x[i * K + k] * panel[k * 16 + j] for R input rows and the panel's 16 outputs
// (the tile must live in registers: unrolled and inlined, or GCC keeps `acc` in memory at a third of the speed)
template <int R>
__attribute__((always_inline)) inline void tile_times_panel(const float* x, int64_t K, const float* panel, float* y,
                                                            int64_t ldy) {
  __m256 acc[R][2];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k, panel += kPanel) {
    const __m256 w0 = _mm256_loadu_ps(panel), w1 = _mm256_loadu_ps(panel + 8);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const __m256 xi = _mm256_broadcast_ss(x + i * K + k);
      acc[i][0] = _mm256_fmadd_ps(w0, xi, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(w1, xi, acc[i][1]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
    _mm256_storeu_ps(y + i * ldy, acc[i][0]);
    _mm256_storeu_ps(y + i * ldy + 8, acc[i][1]);
  }
}

// Output rows [16 * begin, 16 * end) of y = x @ W.T for all input rows, one panel at a time
template <typename Format>
void output_panels(const float* x, int64_t rows, int64_t K, const uint8_t* blocks, float* y, int64_t N,
                   int64_t begin, int64_t end) {
  const int64_t row_bytes = K / kBlock * Format::kBytes;
  std::vector<float> panel(K * kPanel);
  // rows in passes whose part of x stays in L2 across the panels, of even sizes (each pass expands again)
  const int64_t most = std::max<int64_t>(kTile, kChunkBytes / (K * int64_t(sizeof(float))));
  const int64_t passes = (rows + most - 1) / most, chunk = (rows + passes - 1) / passes;
  for (int64_t first = 0; first < rows; first += chunk) {
    const int64_t last = std::min(rows, first + chunk);
    for (int64_t p = begin; p < end; ++p) {
      expand_panel<Format>(blocks + p * kPanel * row_bytes, row_bytes, K, panel.data());
      float* out = y + p * kPanel;
      int64_t i = first;
      for (; i + kTile <= last; i += kTile) tile_times_panel<kTile>(x + i * K, K, panel.data(), out + i * N, N);
      switch (last - i) {
        case 5: tile_times_panel<5>(x + i * K, K, panel.data(), out + i * N, N); break;
        case 4: tile_times_panel<4>(x + i * K, K, panel.data(), out + i * N, N); break;
        case 3: tile_times_panel<3>(x + i * K, K, panel.data(), out + i * N, N); break;
        case 2: tile_times_panel<2>(x + i * K, K, panel.data(), out + i * N, N); break;
        case 1: tile_times_panel<1>(x + i * K, K, panel.data(), out + i * N, N); break;
        default: break;
      }
    }
  }
}

// bfloat16 inputs (CPUs with AVX512-BF16): each thread expands the blocks of 32 output rows at a
// time into a bf16 panel in vdpbf16ps's layout ([K / 2][32] pairs of weights along k, rounded to
// nearest even exactly as the bf16 model's weights were) and multiplies 12 input rows at a time
// with it (24 float32 accumulators). While it expands one panel it prefetches the next panel's
// blocks, spread over the expansion (all at once, the prefetches stall on the CPU's miss queue):
// the blocks stream from memory behind the arithmetic. On the 2-core AMD EPYC Zen 5, 30 layers of
// SmolLM2's projections from memory took 0.70-0.85x the time of oneDNN's packed bf16 from 5 to
// 256 rows (a third of the bytes, both threads given equal halves of the outputs) and 0.92-0.96x
// at 512-1,024 rows. Up to 4 rows, each output row's blocks multiply x quantised to integers
// (bf16::WordRows, vpmaddwd).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni")
namespace bf16 {

constexpr int64_t kDotRows = 4;   // up to this many rows run as integers (output_word_rows)
constexpr int64_t kPanel = 32;    // output rows per panel: two vectors of 16 outputs
constexpr int kTile = 12;         // input rows per register tile

// One block's 32 float32 weights as two vectors (k 0-15, 16-31), and as 16 pairs of bf16
// (32-bit unit u holds k = 2u, 2u + 1; rounded to nearest even)
template <typename Format>
struct Pairs {
  static inline __m512i pairs(const uint8_t* block) {
    __m512 w0, w1;
    Format::floats(block, w0, w1);
    return (__m512i)_mm512_cvtne2ps_pbh(w1, w0);
  }
};

// w0, w1 = d * q + m for the 16 bytes of 4-bit codes at `codes`
inline void nibbles(const uint8_t* codes, __m512 d, __m512 m, __m512& w0, __m512& w1) {
  const __m128i low4 = _mm_set1_epi8(0x0f);
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
  const __m128i lo = _mm_and_si128(bytes, low4), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
  w0 = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), m);
  w1 = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), m);
}

// w0, w1 = d0, d1 times the 16 + 16 signed bytes at `codes`
inline void signed_bytes(const uint8_t* codes, __m512 d0, __m512 d1, __m512& w0, __m512& w1) {
  const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
  const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16));
  w0 = _mm512_mul_ps(d0, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)));
  w1 = _mm512_mul_ps(d1, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)));
}

// The 32 4-bit codes at `codes` as 16-bit integers in weight order (low nibbles, then high)
inline __m512i nibble_words(const uint8_t* codes) {
  const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes))));
  const __m512i shifts = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
  return _mm512_and_si512(_mm512_srlv_epi16(bytes, shifts), _mm512_set1_epi16(0x0f));
}

// The 32 weights d * q + m of the 4-bit codes q at `codes` as bf16 (Pairs' order): the 16 values a
// code can take, computed and rounded once (the same fma and rounding as nibbles, so the same
// bits), looked up by vpermw: 7 vector uops where nibbles and the conversion take 11 (by the
// generated code, ~3.5 instead of ~5 cycles of the two 512-bit ports of a Sapphire Rapids core,
// where expanding the blocks is most of the AMX tiles' time). One thread, a 1536 x 576 Q4_1
// projection in cache on the Zen 4: 194-196 vs 208-210 us at 16 rows, 450-452 vs 463-471 at 48.
inline __m512i nibble_pairs(const uint8_t* codes, __m512 d, __m512 m) {
  const __m512 q = _mm512_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, 8.f, 9.f, 10.f, 11.f, 12.f, 13.f, 14.f, 15.f);
  const __m256i table = (__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(d, q, m));
  return _mm512_permutexvar_epi16(nibble_words(codes), _mm512_castsi256_si512(table));
}

// The 32 signed bytes at `codes` as 16-bit integers
inline __m512i byte_words(const uint8_t* codes) {
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes)));
}

// Each format also gives its block as integer words w (words) and, per lane of vpmaddwd's 16 sums
// (lane j: weights 2j, 2j + 1), the scale d of w (word_scales), plus an offset m where the weight
// is d * w + m (kOffset, offset): what bf16::output_word_rows multiplies with integer inputs.
struct Q4_1 : Pairs<Q4_1> {
  static constexpr int64_t kBytes = 24;
  static constexpr bool kOffset = true;
  static inline void floats(const uint8_t* block, __m512& w0, __m512& w1) {
    const float* scale = reinterpret_cast<const float*>(block);
    nibbles(block + 8, _mm512_set1_ps(scale[0]), _mm512_set1_ps(scale[1]), w0, w1);
  }
  static inline __m512i pairs(const uint8_t* block) {
    const float* scale = reinterpret_cast<const float*>(block);
    return nibble_pairs(block + 8, _mm512_set1_ps(scale[0]), _mm512_set1_ps(scale[1]));
  }
  static inline __m512i words(const uint8_t* block) { return nibble_words(block + 8); }
  static inline __m512 word_scales(const uint8_t* block) { return _mm512_set1_ps(*reinterpret_cast<const float*>(block)); }
  static inline float offset(const uint8_t* block) { return reinterpret_cast<const float*>(block)[1]; }
};

struct Q4_0 : Pairs<Q4_0> {
  static constexpr int64_t kBytes = 20;
  static constexpr bool kOffset = false;
  static inline void floats(const uint8_t* block, __m512& w0, __m512& w1) {
    const __m512 d = _mm512_set1_ps(*reinterpret_cast<const float*>(block));
    nibbles(block + 4, d, _mm512_mul_ps(d, _mm512_set1_ps(-8.0f)), w0, w1);
  }
  static inline __m512i pairs(const uint8_t* block) {
    const __m512 d = _mm512_set1_ps(*reinterpret_cast<const float*>(block));
    return nibble_pairs(block + 4, d, _mm512_mul_ps(d, _mm512_set1_ps(-8.0f)));
  }
  static inline __m512i words(const uint8_t* block) {
    return _mm512_sub_epi16(nibble_words(block + 4), _mm512_set1_epi16(8));
  }
  static inline __m512 word_scales(const uint8_t* block) { return _mm512_set1_ps(*reinterpret_cast<const float*>(block)); }
  static inline float offset(const uint8_t*) { return 0.0f; }
};

struct Q8_0 : Pairs<Q8_0> {
  static constexpr int64_t kBytes = 36;
  static constexpr bool kOffset = false;
  static inline void floats(const uint8_t* block, __m512& w0, __m512& w1) {
    const __m512 d = _mm512_set1_ps(*reinterpret_cast<const float*>(block));
    signed_bytes(block + 4, d, d, w0, w1);
  }
  static inline __m512i words(const uint8_t* block) { return byte_words(block + 4); }
  static inline __m512 word_scales(const uint8_t* block) { return _mm512_set1_ps(*reinterpret_cast<const float*>(block)); }
  static inline float offset(const uint8_t*) { return 0.0f; }
};

struct Q8_16 : Pairs<Q8_16> {
  static constexpr int64_t kBytes = 40;
  static constexpr bool kOffset = false;
  static inline void floats(const uint8_t* block, __m512& w0, __m512& w1) {
    const float* scale = reinterpret_cast<const float*>(block);
    signed_bytes(block + 8, _mm512_set1_ps(scale[0]), _mm512_set1_ps(scale[1]), w0, w1);
  }
  static inline __m512i words(const uint8_t* block) { return byte_words(block + 8); }
  static inline __m512 word_scales(const uint8_t* block) {  // lanes 0-7 sum weights 0-15
    const float* scale = reinterpret_cast<const float*>(block);
    return _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(scale[0]), _mm512_set1_ps(scale[1]));
  }
  static inline float offset(const uint8_t*) { return 0.0f; }
};

// Few bf16 rows as integers (word_rows): each 32-wide block of x becomes 32 int16 codes c times a
// power of two s = 2^(E - 14) for the block's largest exponent E, so c = x / s exactly wherever x's
// exponent is at least E - 7 (a bf16 value has 8 significant bits), and c is rounded to nearest
// where smaller: an error of at most s / 2 = 2^-15 of the block's largest magnitude, far under a
// bf16 rounding of the result. A block's 32 products sum exactly in int32 (vpmaddwd: one
// instruction where vpdpwssd needed a zeroed accumulator too), are converted once, and scaled by
// s and the block's d (Q4_1's offset m * s * sum c in scalar code): per block 5-7 vector
// instructions where expanding the weights to float32 takes 12. One thread on a 1536 x 576
// projection held in cache, three alternating pairs of builds on the AMX Xeon: Q8_0 42-44 vs
// 45-46 us, Q4_1 50-52 vs 52-54 us (Q4_1 is bound by unpacking its nibbles: 3 of its 7).
struct WordRows {
  std::vector<int16_t> codes;  // [rows, K]
  std::vector<float> scale;    // [rows, K / 32]: s
  std::vector<float> sum;      // [rows, K / 32]: s * the block's sum of codes (Q4_1's offset multiplies it)
};

// x's bf16 rows as WordRows; false where a block holds an infinity or NaN (the float32 path keeps them)
inline bool quantise_rows(const uint16_t* bits, int64_t rows, int64_t K, WordRows& out) {
  const int64_t count = rows * K / kBlock;
  out.codes.resize(rows * K), out.scale.resize(count), out.sum.resize(count);
  const __m512i magnitude = _mm512_set1_epi16(0x7fff), exponent = _mm512_set1_epi16(0x7f80);
  for (int64_t b = 0; b < count; ++b) {
    const __m512i x = _mm512_loadu_si512(bits + b * kBlock);
    const __m512i mag = _mm512_and_si512(x, magnitude);
    if (_mm512_cmpeq_epi16_mask(_mm512_and_si512(x, exponent), exponent) != 0) return false;
    // finite bf16 magnitudes order as their bits do
    const __m256i m8 = _mm256_max_epu16(_mm512_castsi512_si256(mag), _mm512_extracti64x4_epi64(mag, 1));
    __m128i m4 = _mm_max_epu16(_mm256_castsi256_si128(m8), _mm256_extracti128_si256(m8, 1));
    m4 = _mm_max_epu16(m4, _mm_srli_si128(m4, 8));
    m4 = _mm_max_epu16(m4, _mm_srli_si128(m4, 4));
    m4 = _mm_max_epu16(m4, _mm_srli_si128(m4, 2));
    const int largest = std::max((_mm_extract_epi16(m4, 0) >> 7) - 127, -113);  // zeros and subnormals: tiny
    const __m512 up = _mm512_set1_ps(std::ldexp(1.0f, 14 - largest));
    const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(x)), 16));
    const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(x, 1)), 16));
    const __m512i c_lo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, up)), c_hi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, up));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.codes.data() + b * kBlock), _mm512_cvtepi32_epi16(c_lo));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.codes.data() + b * kBlock + 16), _mm512_cvtepi32_epi16(c_hi));
    out.scale[b] = std::ldexp(1.0f, largest - 14);
    out.sum[b] = out.scale[b] * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(c_lo, c_hi)));
  }
  return true;
}

// acc += s * d * (w . c) (+ m * s * sum c) for one block of R input rows
template <typename Format, int R>
__attribute__((always_inline)) inline void block_times_words(const uint8_t* block, const WordRows& x, int64_t K,
                                                             int64_t b, __m512 acc[R], float offset[R]) {
  const int64_t count = K / kBlock;
  const __m512i w = Format::words(block);
  const __m512 d = Format::word_scales(block);
  for (int i = 0; i < R; ++i) {
    const __m512i c = _mm512_loadu_si512(x.codes.data() + i * K + b * kBlock);
    const __m512 dot = _mm512_cvtepi32_ps(_mm512_madd_epi16(w, c));
    acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(dot, _mm512_set1_ps(x.scale[i * count + b])), d, acc[i]);
    if constexpr (Format::kOffset) offset[i] = std::fma(Format::offset(block), x.sum[i * count + b], offset[i]);
  }
}

// y[i * ldy] = bf16(sum_k x[i, k] * w[k] + bias) for R <= kDotRows rows as WordRows and one
// output row's blocks, two accumulator chains per row and offset (even and odd blocks)
template <typename Format, int R>
__attribute__((always_inline)) inline void rows_times_weight_words(const WordRows& x, int64_t K, const uint8_t* blocks,
                                                                   const float* bias, at::BFloat16* y, int64_t ldy) {
  __m512 even[R], odd[R];
  float even_offset[R], odd_offset[R];
  for (int i = 0; i < R; ++i) even[i] = odd[i] = _mm512_setzero_ps(), even_offset[i] = odd_offset[i] = 0.0f;
  const int64_t count = K / kBlock;
  int64_t b = 0;
  for (; b + 2 <= count; b += 2) {
    block_times_words<Format, R>(blocks + b * Format::kBytes, x, K, b, even, even_offset);
    block_times_words<Format, R>(blocks + (b + 1) * Format::kBytes, x, K, b + 1, odd, odd_offset);
  }
  if (b < count) block_times_words<Format, R>(blocks + b * Format::kBytes, x, K, b, even, even_offset);
  for (int i = 0; i < R; ++i) {
    float sum = _mm512_reduce_add_ps(_mm512_add_ps(even[i], odd[i])) + (even_offset[i] + odd_offset[i]);
    if (bias != nullptr) sum += *bias;
    y[i * ldy] = at::BFloat16(sum);
  }
}

// Output rows [begin, end) of y = x @ W.T + bias for rows <= kDotRows WordRows
template <typename Format>
void output_word_rows(const WordRows& x, int64_t rows, int64_t K, const uint8_t* blocks, const float* bias,
                      at::BFloat16* y, int64_t N, int64_t begin, int64_t end) {
  const RowPrefetch prefetch(K / kBlock * Format::kBytes, end);
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* w = blocks + n * (K / kBlock * Format::kBytes);
    prefetch(w, n);
    const float* b = bias == nullptr ? nullptr : bias + n;
    switch (rows) {
      case 4: rows_times_weight_words<Format, 4>(x, K, w, b, y + n, N); break;
      case 3: rows_times_weight_words<Format, 3>(x, K, w, b, y + n, N); break;
      case 2: rows_times_weight_words<Format, 2>(x, K, w, b, y + n, N); break;
      default: rows_times_weight_words<Format, 1>(x, K, w, b, y + n, N); break;
    }
  }
}

// r[j] = column j of the 16x16 matrix of 32-bit units whose rows were r[0..15]
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // r[4g + c], 128-bit lane L: column 4L + c of rows 4g..4g+3
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // gather lane L of r[c], r[4 + c], r[8 + c], r[12 + c] into column 4L + c
    const __m512i u0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44), u1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
    const __m512i u2 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
    const __m512i u3 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
    t[c] = _mm512_shuffle_i32x4(u0, u2, 0x88);
    t[4 + c] = _mm512_shuffle_i32x4(u0, u2, 0xDD);
    t[8 + c] = _mm512_shuffle_i32x4(u1, u3, 0x88);
    t[12 + c] = _mm512_shuffle_i32x4(u1, u3, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// panel[u * 32 + j] = weights k = 2u, 2u + 1 of output row j, for the 32 output rows whose blocks
// start at `blocks`; prefetches the `next` panel's blocks (nullptr: none) a share per block
template <typename Format>
void expand_panel(const uint8_t* blocks, int64_t row_bytes, int64_t K, uint32_t* panel, const uint8_t* next) {
  const int64_t count = K / kBlock, lines = kPanel * row_bytes / 64;
  for (int64_t b = 0; b < count; ++b) {
    if (next != nullptr)
      for (int64_t line = b * lines / count; line < (b + 1) * lines / count; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(next) + 64 * line, _MM_HINT_T0);
    for (int half = 0; half < 2; ++half) {
      __m512i r[16];
      for (int j = 0; j < 16; ++j) r[j] = Format::pairs(blocks + (half * 16 + j) * row_bytes + b * Format::kBytes);
      transpose16(r);
      uint32_t* out = panel + b * 16 * kPanel + 16 * half;
      for (int u = 0; u < 16; ++u) _mm512_storeu_si512(out + u * kPanel, r[u]);
    }
  }
}

// y[i * ldy + j] = bf16(sum_k x[i, k] * W[j, k] + bias[j]) for R input rows (`x` as pairs of bf16,
// `pairs` per row) and the panel's 32 outputs (the tile must live in registers: unrolled, inlined)
template <int R>
__attribute__((always_inline)) inline void tile_times_panel(const uint32_t* x, int64_t pairs, const uint32_t* panel,
                                                            const float* bias, at::BFloat16* y, int64_t ldy) {
  __m512 acc[R][2];
#pragma GCC unroll 12
  for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (int64_t u = 0; u < pairs; ++u, panel += kPanel) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel), w1 = (__m512bh)_mm512_loadu_si512(panel + 16);
#pragma GCC unroll 12
    for (int i = 0; i < R; ++i) {
      const __m512bh xi = (__m512bh)_mm512_set1_epi32(x[i * pairs + u]);
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], xi, w0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], xi, w1);
    }
  }
  const __m512 b0 = bias != nullptr ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  const __m512 b1 = bias != nullptr ? _mm512_loadu_ps(bias + 16) : _mm512_setzero_ps();
#pragma GCC unroll 12
  for (int i = 0; i < R; ++i)
    _mm512_storeu_si512(y + i * ldy, (__m512i)_mm512_cvtne2ps_pbh(_mm512_add_ps(acc[i][1], b1), _mm512_add_ps(acc[i][0], b0)));
}

template <int R>
inline void tile_rows(const uint32_t* x, int64_t pairs, const uint32_t* panel, const float* bias, at::BFloat16* y,
                      int64_t ldy, int64_t rows) {
  if constexpr (R > 0) {
    if (rows == R) return tile_times_panel<R>(x, pairs, panel, bias, y, ldy);
    tile_rows<R - 1>(x, pairs, panel, bias, y, ldy, rows);
  }
}

// Output rows [32 * begin, 32 * end) of y = x @ W.T + bias for all input rows, one panel at a time
template <typename Format>
void output_panels(const uint32_t* x, int64_t rows, int64_t K, const uint8_t* blocks, const float* bias,
                   at::BFloat16* y, int64_t N, int64_t begin, int64_t end) {
  const int64_t row_bytes = K / kBlock * Format::kBytes, pairs = K / 2, panel_bytes = kPanel * row_bytes;
  std::vector<uint32_t> panel(pairs * kPanel);
  for (int64_t p = begin; p < end; ++p) {
    expand_panel<Format>(blocks + p * panel_bytes, row_bytes, K, panel.data(),
                         p + 1 < end ? blocks + (p + 1) * panel_bytes : nullptr);
    const float* panel_bias = bias != nullptr ? bias + p * kPanel : nullptr;
    for (int64_t i = 0; i < rows; i += kTile)
      tile_rows<kTile>(x + i * pairs, pairs, panel.data(), panel_bias, y + i * N + p * kPanel, N,
                       std::min<int64_t>(kTile, rows - i));
  }
}

}  // namespace bf16
#pragma GCC pop_options

// bfloat16 inputs of up to 64 rows on CPUs with AMX: y.T = W @ x.T on tiles. Each thread takes
// 16 output rows at a time; for each block column (32 weights along k) their 16 blocks expand to
// bf16 (the bf16 panels' rounding), one 64-byte row each: the A tile, in the blocks' own order.
// x.T is laid out once per call as B tiles of 16 input rows each (a last group of fewer rows padded
// with zeros, whose outputs are not written); tdpbf16ps accumulates one C tile (16 outputs x 16
// input rows) per group, each transposed once per 16 outputs on the way out. The blocks are read
// and expanded once per call whatever the row count: on the AMX Xeon one forward's projections of
// SmolLM2 took 11.4, 13.6, 17.1 and 19.1 ms at 16, 32, 48 and 64 rows against 17.3, 19.9, 20.1 and
// 22.3 ms for oneDNN's packed bf16 (bench.gguf_linear), which reads the bf16 weights (2.4x the
// blocks' bytes) and gives the same bits (both sum each 32-wide column in order on the tiles):
// decode batches of up to 64 and speculative verification (a sequence plus its proposals).
namespace amx {
constexpr int64_t kGroupRows = 16;                // input rows per B and C tile
constexpr int64_t kGroups = 4;                    // C tiles: tmm0-3 (A: tmm4, B: tmm5-7)
constexpr int64_t kRows = kGroupRows * kGroups;   // input rows per call at most
constexpr int64_t kOutputs = 16;                  // output rows per C tile
}  // namespace amx

// compilers that know the AMX intrinsics and feature names (GCC 11, clang 12); elsewhere the
// tiles are never used
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11)
#define FLEXPAGE_AMX_TILES 1
#pragma GCC push_options
// (avx512vnni too, which the tile code itself does not use: GCC inlines a function only into one
// whose target has all of its features, and without it each block's bf16::Format::pairs was a
// call; every CPU the tiles run on has it, as tiles_serve asks for the bf16 panels' features)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni,amx-tile,amx-bf16")
namespace amx {

struct TileConfig {  // ldtilecfg's 64-byte operand, palette 1
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The B tiles of every group of 16 input rows and block column, in order:
// x_pairs[(g * pairs + u) * 16 + i] = x[16 g + i, 2u], x[16 g + i, 2u + 1], zero past the last row
inline std::vector<uint32_t> pairs_by_column(const uint32_t* x, int64_t rows, int64_t pairs) {
  const int64_t groups = (rows + kGroupRows - 1) / kGroupRows;
  std::vector<uint32_t> x_pairs(groups * pairs * kGroupRows, 0);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t u = 0; u < pairs; ++u) x_pairs[((i / kGroupRows) * pairs + u) * kGroupRows + i % kGroupRows] = x[i * pairs + u];
  return x_pairs;
}

// y rows [16 g, 16 g + 16) (those under `rows`) of 16 outputs from group g's C tile as stored
// in c_tile, plus the bias
inline void store_group(const float* c_tile, int64_t g, int64_t rows, __m512 add, at::BFloat16* y, int64_t N) {
  __m512i c[16];
  for (int j = 0; j < 16; ++j) c[j] = _mm512_load_si512(c_tile + j * kGroupRows);
  bf16::transpose16(c);  // c[i]: the 16 outputs of input row 16 g + i
  for (int64_t i = 0; i < std::min<int64_t>(kGroupRows, rows - g * kGroupRows); ++i)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + (g * kGroupRows + i) * N),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_castsi512_ps(c[i]), add)));
}

// Output rows [16 * begin, 16 * end) of y = x @ W.T + bias for `rows` <= 64 input rows given as
// x_pairs (pairs_by_column), prefetching the next 16 output rows' blocks a share per block column
template <typename Format>
void output_tiles(const uint32_t* x_pairs, int64_t rows, int64_t K, const uint8_t* blocks, const float* bias,
                  at::BFloat16* y, int64_t N, int64_t begin, int64_t end) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.colsb[t] = 64;  // C, A and B: 16 x 64 bytes each
  _tile_loadconfig(&config);
  const int64_t row_bytes = K / kBlock * Format::kBytes, columns = K / kBlock, pairs = K / 2;
  const int64_t groups = (rows + kGroupRows - 1) / kGroupRows, group_stride = pairs * kGroupRows;
  const int64_t lines = kOutputs * row_bytes / 64;
  alignas(64) uint32_t a_tile[kOutputs * kBlock / 2];
  alignas(64) float c_tile[kOutputs * kGroupRows];
  for (int64_t t = begin; t < end; ++t) {
    const uint8_t* w = blocks + t * kOutputs * row_bytes;
    const uint8_t* next = t + 1 < end ? w + kOutputs * row_bytes : nullptr;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t b = 0; b < columns; ++b) {
      if (next != nullptr)
        for (int64_t line = b * lines / columns; line < (b + 1) * lines / columns; ++line)
          _mm_prefetch(reinterpret_cast<const char*>(next) + 64 * line, _MM_HINT_T0);
      for (int j = 0; j < kOutputs; ++j)
        _mm512_store_si512(a_tile + j * kBlock / 2, Format::pairs(w + j * row_bytes + b * Format::kBytes));
      _tile_loadd(4, a_tile, kBlock * 2);
      // C tile g += A times group g's B tile, the B tiles loaded into tmm5-7 in turn (a load
      // need not wait for the multiply before it to have read its tile); the tile numbers are
      // immediates, so the groups are spelled out
      const uint32_t* b_tiles = x_pairs + b * kBlock / 2 * kGroupRows;
      _tile_loadd(5, b_tiles, kGroupRows * 4);
      _tile_dpbf16ps(0, 4, 5);
      if (groups > 1) {
        _tile_loadd(6, b_tiles + group_stride, kGroupRows * 4);
        _tile_dpbf16ps(1, 4, 6);
      }
      if (groups > 2) {
        _tile_loadd(7, b_tiles + 2 * group_stride, kGroupRows * 4);
        _tile_dpbf16ps(2, 4, 7);
      }
      if (groups > 3) {
        _tile_loadd(5, b_tiles + 3 * group_stride, kGroupRows * 4);
        _tile_dpbf16ps(3, 4, 5);
      }
    }
    const __m512 add = bias != nullptr ? _mm512_loadu_ps(bias + t * kOutputs) : _mm512_setzero_ps();
    at::BFloat16* out = y + t * kOutputs;
    _tile_stored(0, c_tile, kGroupRows * 4);
    store_group(c_tile, 0, rows, add, out, N);
    if (groups > 1) {
      _tile_stored(1, c_tile, kGroupRows * 4);
      store_group(c_tile, 1, rows, add, out, N);
    }
    if (groups > 2) {
      _tile_stored(2, c_tile, kGroupRows * 4);
      store_group(c_tile, 2, rows, add, out, N);
    }
    if (groups > 3) {
      _tile_stored(3, c_tile, kGroupRows * 4);
      store_group(c_tile, 3, rows, add, out, N);
    }
  }
  _tile_release();
}

}  // namespace amx
#pragma GCC pop_options
#endif

// The AVX2 and the AVX-512 struct of one format
template <typename Avx2, typename Avx512>
struct Formats {
  using avx2 = Avx2;
  using avx512 = Avx512;
};

// fn(Formats<...>{}) for blocks of `kind` (one of kind_of's formats)
template <typename Fn>
inline void with_format(Kind kind, Fn&& fn) {
  switch (kind) {
    case Kind::kQ4_0: fn(Formats<Q4_0, bf16::Q4_0>{}); break;
    case Kind::kQ4_1: fn(Formats<Q4_1, bf16::Q4_1>{}); break;
    case Kind::kQ8_0: fn(Formats<Q8_0, bf16::Q8_0>{}); break;
    default: fn(Formats<Q8_16, bf16::Q8_16>{}); break;
  }
}

// True where this CPU has AMX bf16 tiles and Linux lets this process use them (asked once);
// the tile code also needs the bf16 panels' AVX-512 (tiles_serve asks for both)
bool has_amx_tiles() {
#ifdef FLEXPAGE_AMX_TILES
  static const bool has = [] {
    if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16")) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return has;
#else
  return false;
#endif
}

// True where this CPU runs the bf16 panels and word rows (AVX512-BF16 and AVX512-VNNI)
bool has_bf16_panels() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                          __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vnni");
  return has;
}

// Rows [0, rows) of y = x @ W.T + bias in float32 into out's first rows, x validated
void float_block_linear(const at::Tensor& x, int64_t rows, const at::Tensor& blocks,
                        const std::optional<at::Tensor>& bias, Kind kind, at::Tensor& out) {
  const int64_t K = x.size(1), N = blocks.size(0);
  if (rows == 0 || N == 0) return;
  const at::Tensor input = x.contiguous();
  const float* xp = input.data_ptr<float>();
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  float* yp = out.data_ptr<float>();
  if (rows > kDotRows && N % kPanel == 0) {
    at::parallel_for(0, N / kPanel, 1, [&](int64_t begin, int64_t end) {
      with_format(kind, [&](auto f) { output_panels<typename decltype(f)::avx2>(xp, rows, K, bp, yp, N, begin, end); });
    });
  } else {
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
      with_format(kind, [&](auto f) { output_rows<typename decltype(f)::avx2>(xp, rows, K, bp, yp, N, begin, end); });
    });
  }
  if (bias.has_value() && bias->defined()) (rows == out.size(0) ? out : out.narrow(0, 0, rows)).add_(*bias);
}

// True where `rows` bf16 rows (more than bf16::kDotRows, at most amx::kRows) run on the AMX tiles
bool tiles_serve(int64_t rows, at::ScalarType dtype, const at::Tensor& blocks) {
  return dtype == at::kBFloat16 && rows > bf16::kDotRows && rows <= amx::kRows &&
         blocks.size(0) % amx::kOutputs == 0 && has_bf16_panels() && has_amx_tiles();
}

// The bias as float32, contiguous (the bf16 kernels read it by pointer); undefined without one
at::Tensor float_bias(const std::optional<at::Tensor>& bias) {
  return bias.has_value() && bias->defined() ? bias->to(at::kFloat).contiguous() : at::Tensor();
}

// Rows [0, rows) of y = x @ W.T + bias in bf16 into out's first rows, on the AMX tiles (on_tiles:
// tiles_serve) or else the bf16 panels, x validated
void bf16_block_linear(const at::Tensor& x, int64_t rows, const at::Tensor& blocks,
                       const std::optional<at::Tensor>& bias, Kind kind, bool on_tiles, at::Tensor& out) {
  const int64_t K = x.size(1), N = blocks.size(0);
  const at::Tensor input = x.contiguous();
  const at::Tensor bias32 = float_bias(bias);
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(input.data_ptr<at::BFloat16>());  // pairs along k
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  const float* biasp = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  at::BFloat16* yp = out.data_ptr<at::BFloat16>();
#ifdef FLEXPAGE_AMX_TILES
  if (on_tiles) {
    const std::vector<uint32_t> x_pairs = amx::pairs_by_column(xp, rows, K / 2);
    at::parallel_for(0, N / amx::kOutputs, 1, [&](int64_t begin, int64_t end) {
      with_format(kind, [&](auto f) {
        amx::output_tiles<typename decltype(f)::avx512>(x_pairs.data(), rows, K, bp, biasp, yp, N, begin, end);
      });
    });
    return;
  }
#endif
  at::parallel_for(0, N / bf16::kPanel, 1, [&](int64_t begin, int64_t end) {
    with_format(kind, [&](auto f) {
      bf16::output_panels<typename decltype(f)::avx512>(xp, rows, K, bp, biasp, yp, N, begin, end);
    });
  });
}

// Rows [0, rows) of y = x @ W.T + bias in bf16, for up to bf16::kDotRows rows as integers
// (bf16::WordRows), into out's first rows, x validated; false (nothing written) where those
// rows hold an infinity or NaN. x is quantised and y rounded to bf16 here, not by ATen copies
// around the call: a batch-1 step makes 121 of these calls, and two tensor copies each cost
// more than the quantising itself.
bool bf16_word_rows_linear(const at::Tensor& x, int64_t rows, const at::Tensor& blocks,
                           const std::optional<at::Tensor>& bias, Kind kind, at::Tensor& out) {
  const int64_t K = x.size(1), N = blocks.size(0);
  const at::Tensor input = x.contiguous();
  bf16::WordRows quantised;
  if (!bf16::quantise_rows(reinterpret_cast<const uint16_t*>(input.data_ptr<at::BFloat16>()), rows, K, quantised))
    return false;
  const at::Tensor bias32 = float_bias(bias);
  const float* biasp = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  at::BFloat16* yp = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    with_format(kind, [&](auto f) {
      bf16::output_word_rows<typename decltype(f)::avx512>(quantised, rows, K, bp, biasp, yp, N, begin, end);
    });
  });
  return true;
}

// The rows of x before valid_rows (a one-value integer tensor; all where undefined): a compiled
// step pads its rows to a size its graph serves (a batch-1 decode to two rows), and the padding
// rows need no product
int64_t rows_to_compute(const at::Tensor& x, const std::optional<at::Tensor>& valid_rows) {
  if (!valid_rows.has_value() || !valid_rows->defined()) return x.size(0);
  TORCH_CHECK(valid_rows->numel() == 1 && !at::isFloatingType(valid_rows->scalar_type()),
              "block_linear: valid_rows must hold one integer, got ", valid_rows->sizes(), " ", valid_rows->scalar_type());
  return std::clamp<int64_t>(valid_rows->item<int64_t>(), 0, x.size(0));
}

// x @ W.T + bias from the blocks, for any number of rows, in x's dtype: float32, or bf16 (where
// the CPU has AVX512-BF16: up to bf16::kDotRows finite rows as integers, up to amx::kRows on the
// AMX tiles where the CPU has them, more on the bf16 panels; elsewhere, and for rows holding an
// infinity or NaN, in float32 on AVX2, rounded to bf16 after float32). Rows from valid_rows on
// are padding: their outputs are zeros, not computed. Every path writes into one output
// allocated here (a batch-1 step makes 121 calls, each padded to two rows).
at::Tensor block_linear(const at::Tensor& x, const at::Tensor& blocks, const std::optional<at::Tensor>& bias,
                        const std::optional<at::Tensor>& valid_rows) {
  TORCH_CHECK(x.device().is_cpu() && blocks.device().is_cpu(), "block_linear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "block_linear: x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2, "block_linear: x must be [rows, in_features], got ", x.sizes());
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              "block_linear: blocks must be a contiguous uint8 [out_features, bytes per row] tensor");
  const int64_t K = x.size(1), N = blocks.size(0), row_bytes = blocks.size(1);
  const Kind kind = kind_of(K, row_bytes);
  TORCH_CHECK(kind != Kind::kNone, "block_linear: x has ", K, " features (a multiple of 32 needed), so blocks of ",
              K / kBlock * Q4_0::kBytes, " (Q4_0), ", K / kBlock * Q4_1::kBytes, " (Q4_1), ", K / kBlock * Q8_0::kBytes,
              " (Q8_0) or ", K / kBlock * Q8_16::kBytes, " (Q8_16) bytes per row; got ", row_bytes);
  // the bf16 kernels read the bias by pointer, one value per output
  TORCH_CHECK(!(bias.has_value() && bias->defined()) || bias->numel() == N, "block_linear: bias has ",
              bias.has_value() && bias->defined() ? bias->numel() : 0, " values, the blocks ", N, " outputs");
  const int64_t valid = rows_to_compute(x, valid_rows);
  at::Tensor out = at::empty({x.size(0), N}, x.options());
  char* padding = static_cast<char*>(out.data_ptr()) + valid * N * out.element_size();
  std::memset(padding, 0, (x.size(0) - valid) * N * out.element_size());
  if (valid == 0) return out;
  if (x.scalar_type() == at::kFloat) {
    float_block_linear(x, valid, blocks, bias, kind, out);
    return out;
  }
  if (has_bf16_panels()) {
    if (valid <= bf16::kDotRows) {
      if (bf16_word_rows_linear(x, valid, blocks, bias, kind, out)) return out;
    } else {
      const bool on_tiles = tiles_serve(valid, x.scalar_type(), blocks);
      if (on_tiles || N % bf16::kPanel == 0) {
        bf16_block_linear(x, valid, blocks, bias, kind, on_tiles, out);
        return out;
      }
    }
  }
  at::Tensor wide = at::empty({valid, N}, x.options().dtype(at::kFloat));
  float_block_linear(x.narrow(0, 0, valid).to(at::kFloat), valid, blocks, float_bias(bias), kind, wide);
  out.narrow(0, 0, valid).copy_(wide);
  return out;
}

// True where `blocks` (the kernel's layout) expand to exactly `weight` [N, K]: float32 values
// equal, or (bfloat16) equal once rounded to nearest-even as torch rounds. How gguf_blocks checks
// a model's weights against its GGUF: expanding them with tensor operations took 1.3 s of every
// start for the default model; here one pass in registers, the weights read once.
template <typename Format>
bool rows_match(const uint8_t* blocks, int64_t K, const void* weight, bool bf16, int64_t begin, int64_t end) {
  const int64_t row_bytes = K / kBlock * Format::kBytes;
  const __m256i one = _mm256_set1_epi32(1), half = _mm256_set1_epi32(0x7fff);
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* b = blocks + n * row_bytes;
    for (int64_t k = 0; k < K; k += kBlock, b += Format::kBytes) {
      __m256 w[4];
      Format::expand(b, w);
      for (int q = 0; q < 4; ++q) {
        const int64_t at = n * K + k + 8 * q;
        __m256 expected = w[q], stored;
        if (bf16) {
          const __m256i bits = _mm256_castps_si256(w[q]);
          const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), one);
          const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, half));
          expected = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(rounded, 16), 16));
          const __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(weight) + at));
          stored = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16));
        } else {
          stored = _mm256_loadu_ps(static_cast<const float*>(weight) + at);
        }
        if (_mm256_movemask_ps(_mm256_cmp_ps(expected, stored, _CMP_EQ_OQ)) != 0xff) return false;
      }
    }
  }
  return true;
}

bool blocks_match(const at::Tensor& blocks, const at::Tensor& weight) {
  TORCH_CHECK(blocks.device().is_cpu() && weight.device().is_cpu(), "blocks_match: CPU tensors only");
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16,
              "blocks_match: weight must be float32 or bfloat16, got ", weight.scalar_type());
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous() && weight.dim() == 2,
              "blocks_match: blocks must be a contiguous uint8 [out_features, bytes per row] tensor, weight 2-d");
  const int64_t N = weight.size(0), K = weight.size(1), row_bytes = blocks.size(1);
  const Kind kind = kind_of(K, row_bytes);
  if (blocks.size(0) != N || kind == Kind::kNone) return false;
  const at::Tensor w = weight.contiguous();
  const bool bf16 = w.scalar_type() == at::kBFloat16;
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  const void* wp = w.data_ptr();
  std::atomic<bool> match{true};
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    if (!match.load(std::memory_order_relaxed)) return;
    bool ok = true;
    with_format(kind, [&](auto f) { ok = rows_match<typename decltype(f)::avx2>(bp, K, wp, bf16, begin, end); });
    if (!ok) match.store(false, std::memory_order_relaxed);
  });
  return match.load();
}

// A model whose weights are also packed for oneDNN (bf16 where the CPU has bf16): up to
// max_block_rows rows are computed from the blocks in float32 (memory-bound, and the blocks are
// ~40% of bf16's bytes), and bf16 rows up to amx::kRows on the AMX tiles where the CPU has them
// (tiles_serve); more rows by oneDNN's packed kernel on `packed` (compute-bound, where bf16 runs
// at twice float32's rate). One operator, so that one compiled graph serves all. valid_rows as
// block_linear's where the blocks compute (oneDNN computes the padding rows too).
at::Tensor block_or_packed_linear(const at::Tensor& x, const at::Tensor& blocks, const at::Tensor& packed,
                                  const std::optional<at::Tensor>& bias, int64_t max_block_rows,
                                  const std::optional<at::Tensor>& valid_rows) {
  if (x.size(0) <= max_block_rows || tiles_serve(x.size(0), x.scalar_type(), blocks))
    return block_linear(x, blocks, bias, valid_rows);
  static const auto linear = c10::Dispatcher::singleton()
      .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, c10::string_view,
                        c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>)>();
  return linear.call(x.contiguous(), packed, bias, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flexpage, m) {
  m.def("block_linear(Tensor x, Tensor blocks, Tensor? bias, Tensor? valid_rows=None) -> Tensor");
  m.def("block_or_packed_linear(Tensor x, Tensor blocks, Tensor packed, Tensor? bias, int max_block_rows, "
        "Tensor? valid_rows=None) -> Tensor");
  m.def("blocks_match(Tensor blocks, Tensor weight) -> bool");
  m.def("has_bf16_panels() -> bool");
}

TORCH_LIBRARY_IMPL(flexpage, CPU, m) {
  m.impl("block_linear", &block_linear);
  m.impl("block_or_packed_linear", &block_or_packed_linear);
  m.impl("blocks_match", &blocks_match);
}

TORCH_LIBRARY_IMPL(flexpage, CompositeExplicitAutograd, m) {
  m.impl("has_bf16_panels", &has_bf16_panels);
}

TORCH_LIBRARY_IMPL(flexpage, MkldnnCPU, m) {  // `packed` is a oneDNN tensor
  m.impl("block_or_packed_linear", &block_or_packed_linear);
}
