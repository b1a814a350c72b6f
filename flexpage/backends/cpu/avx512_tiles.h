// flexpage: AVX-512 tile code shared by the tuned CPU FlexAttention template's helpers
// (dot_bf16.h, int8_kv.h; template_edits.py puts this text before either).
#ifndef FLEXPAGE_AVX512_TILES
#define FLEXPAGE_AVX512_TILES
#include <immintrin.h>

namespace flexpage_avx512_tiles {
#define FLEXPAGE_TILES_TARGET __attribute__((target("avx512f")))

// in place: r[j] lane i <- r[i] lane j, a 16 x 16 transpose of 32-bit words
FLEXPAGE_TILES_TARGET static inline void transpose16(__m512i* r) {
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
}  // namespace flexpage_avx512_tiles
#endif
