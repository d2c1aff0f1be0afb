/* lanes.h — AVX-512 lane helpers shared by the CPU code that works in vector
 * registers (gemm_kernel.h's includers: small_gemm.c, winograd.c, ...; and
 * backend_cpu.c, which cannot include gemm_kernel.h: both name macros
 * V8_LOAD). Static inline: each includer gets its own copy, compiled with its
 * flags; nothing without AVX-512. */
#ifndef DP_LANES_H
#define DP_LANES_H

#include <stdint.h>

#if defined(__AVX512F__)
#include <immintrin.h>

/* the mask of lanes [0, n) of 16 (none for n <= 0, all for n >= 16) */
static inline __mmask16 dp_lanes_upto(int64_t n) {
  return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1u);
}

/* out[k] lane l = in[l] lane k: a 16 x 16 transpose in registers (unpacks, then
 * 128-bit lane shuffles); used by small_gemm.c's packing and winograd.c's
 * filter transforms */
static inline void dp_transpose16(const __m512 in[16], __m512 out[16]) {
  __m512 a[16], b[16];
  for (int i = 0; i < 8; ++i) { /* lane L: rows 2i, 2i+1 at columns 4L..4L+1 (lo), 4L+2..4L+3 (hi) */
    a[2 * i] = _mm512_unpacklo_ps(in[2 * i], in[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_ps(in[2 * i], in[2 * i + 1]);
  }
  for (int g = 0; g < 4; ++g) { /* b[4g + q], lane L: column 4L + q of rows 4g..4g+3 */
    b[4 * g + 0] = _mm512_shuffle_ps(a[4 * g], a[4 * g + 2], 0x44);
    b[4 * g + 1] = _mm512_shuffle_ps(a[4 * g], a[4 * g + 2], 0xEE);
    b[4 * g + 2] = _mm512_shuffle_ps(a[4 * g + 1], a[4 * g + 3], 0x44);
    b[4 * g + 3] = _mm512_shuffle_ps(a[4 * g + 1], a[4 * g + 3], 0xEE);
  }
  for (int q = 0; q < 4; ++q) { /* column 4L + q: lane L of b[q], b[4 + q], b[8 + q], b[12 + q] */
    const __m512 c0 = _mm512_shuffle_f32x4(b[q], b[4 + q], 0x88), c1 = _mm512_shuffle_f32x4(b[q], b[4 + q], 0xDD);
    const __m512 c2 = _mm512_shuffle_f32x4(b[8 + q], b[12 + q], 0x88);
    const __m512 c3 = _mm512_shuffle_f32x4(b[8 + q], b[12 + q], 0xDD);
    out[0 + q] = _mm512_shuffle_f32x4(c0, c2, 0x88);
    out[8 + q] = _mm512_shuffle_f32x4(c0, c2, 0xDD);
    out[4 + q] = _mm512_shuffle_f32x4(c1, c3, 0x88);
    out[12 + q] = _mm512_shuffle_f32x4(c1, c3, 0xDD);
  }
}
#endif

#endif
