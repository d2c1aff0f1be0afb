/* lanes.h — AVX-512 lane helpers shared by the CPU code that works in vector
 * registers (gemm_kernel.h's includers: small_gemm.c, winograd.c, ...; and
 * backend_cpu.c, which cannot include gemm_kernel.h: both name macros
 * V8_LOAD), and the planes with 16 samples in the lanes (AVX-512, or scalar
 * without). Static inline: each includer gets its own copy, compiled with its
 * flags. */
#ifndef DP_LANES_H
#define DP_LANES_H

#include <stdint.h>

/* The sum of 16 double lanes, added pairwise (lane l + lane l + 8, then + 4, ...): the bias
 * gradients' order (winograd.c, fft_lanes.c). Folds lane in place. */
static inline double dp_lanes16_total(double lane[16]) {
  for (int width = 8; width > 0; width /= 2)
    for (int l = 0; l < width; ++l) lane[l] += lane[l + width];
  return lane[0];
}

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

#if defined(__AVX2__) && !defined(__AVX512F__)
#include <immintrin.h>

/* lanes [0, n) of 8 as a vmaskmov mask (AVX2 builds' kernels: small_gemm.c, winograd.c) */
static inline __m256i dp_lanes8_upto(int64_t n) {
  const int c = n < 0 ? 0 : n > 8 ? 8 : (int)n;
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(c), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* r[k] lane l = r[l] lane k, in place: an 8 x 8 transpose in registers
 * (pairs unpacked, then 4-float and 128-bit blocks shuffled) */
static inline void dp_transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i + 0] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x20);
    r[4 + i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x31);
  }
}
#endif

/* Planes with 16 samples in the lanes (winograd_s2.c, winograd_lanes.c):
 * dst's pixel (i + off, j + off) (a plane of rows of dwp pixels, 16 floats
 * each), lane s = src[s * sstride + i * w + j] for i < h, j < w, s < cnt;
 * lanes past cnt zero. With AVX-512, 16 pixels of 16 samples a 16x16
 * register transpose; with AVX2, two 8x8 ones (the scalar copy was a fifth
 * of the AVX2 build's backward pass of ResNet-18's 28x28 -> 14x14 layer). */
static inline void dp_to_lanes(const float *src, int64_t sstride, int64_t cnt, int h, int w, float *dst, int64_t dwp,
                               int off) {
#if defined(__AVX512F__)
  for (int i = 0; i < h; ++i)
    for (int j0 = 0; j0 < w; j0 += 16) {
      const int n = w - j0 < 16 ? w - j0 : 16;
      const __mmask16 m = dp_lanes_upto(n);
      __m512 r[16], c[16];
      for (int s = 0; s < 16; ++s)
        r[s] = s < cnt ? _mm512_maskz_loadu_ps(m, src + s * sstride + (int64_t)i * w + j0) : _mm512_setzero_ps();
      dp_transpose16(r, c);
      float *d = dst + ((i + off) * dwp + j0 + off) * 16;
      for (int k = 0; k < n; ++k) _mm512_storeu_ps(d + k * 16, c[k]);
    }
#elif defined(__AVX2__)
  /* 8 pixels of 8 samples an 8x8 register transpose, each half of the lanes apart; a row's last
   * partial block, where the row has 8 pixels, as the whole 8 ending at its end (pixels before
   * it copied twice: the same values) */
  for (int i = 0; i < h; ++i)
    for (int jb = 0; jb < w; jb += 8) {
      const int whole = w - jb >= 8 || w < 8, j0 = whole ? jb : w - 8, n = whole && w - jb < 8 ? w - jb : 8;
      const __m256i m = dp_lanes8_upto(n);
      float *d = dst + ((i + off) * dwp + j0 + off) * 16;
      for (int half = 0; half < 2; ++half) {
        __m256 r[8];
        for (int l = 0; l < 8; ++l) {
          const int64_t s = 8 * half + l;
          const float *p = src + s * sstride + (int64_t)i * w + j0;
          r[l] = s >= cnt ? _mm256_setzero_ps() : n == 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, m);
        }
        dp_transpose8(r);
        for (int k = 0; k < n; ++k) _mm256_storeu_ps(d + k * 16 + 8 * half, r[k]);
      }
    }
#else
  for (int i = 0; i < h; ++i)
    for (int j = 0; j < w; ++j) {
      float *d = dst + ((i + off) * dwp + j + off) * 16;
      for (int s = 0; s < 16; ++s) d[s] = s < cnt ? src[s * sstride + (int64_t)i * w + j] : 0.0f;
    }
#endif
}

/* dp_to_lanes's inverse: dst[s * sstride + i * w + j] = src's pixel (i + off,
 * j + off) lane s, for i < h, j < w, s < cnt (a copy: the same bits) */
static inline void dp_from_lanes(const float *src, int64_t swp, int off, int h, int w, float *dst, int64_t sstride,
                                 int64_t cnt) {
#if defined(__AVX512F__)
  for (int i = 0; i < h; ++i)
    for (int j0 = 0; j0 < w; j0 += 16) {
      const int n = w - j0 < 16 ? w - j0 : 16;
      const __mmask16 m = dp_lanes_upto(n);
      const float *s0 = src + ((i + off) * swp + j0 + off) * 16;
      __m512 c[16], r[16];
      for (int k = 0; k < 16; ++k) c[k] = k < n ? _mm512_loadu_ps(s0 + k * 16) : _mm512_setzero_ps();
      dp_transpose16(c, r);
      for (int s = 0; s < cnt; ++s)
        _mm512_mask_storeu_ps(dst + s * sstride + (int64_t)i * w + j0, m, r[s]);
    }
#elif defined(__AVX2__)
  /* blocks as dp_to_lanes's: a masked store is slow on AMD's cores, so only rows under 8 pixels take one */
  for (int i = 0; i < h; ++i)
    for (int jb = 0; jb < w; jb += 8) {
      const int whole = w - jb >= 8 || w < 8, j0 = whole ? jb : w - 8, n = whole && w - jb < 8 ? w - jb : 8;
      const __m256i m = dp_lanes8_upto(n);
      const float *s0 = src + ((i + off) * swp + j0 + off) * 16;
      for (int half = 0; half < 2 && 8 * half < cnt; ++half) {
        __m256 r[8];
        for (int k = 0; k < 8; ++k) r[k] = k < n ? _mm256_loadu_ps(s0 + k * 16 + 8 * half) : _mm256_setzero_ps();
        dp_transpose8(r);
        for (int l = 0; l < 8 && 8 * half + l < cnt; ++l) {
          float *p = dst + (8 * half + l) * sstride + (int64_t)i * w + j0;
          if (n == 8)
            _mm256_storeu_ps(p, r[l]);
          else
            _mm256_maskstore_ps(p, m, r[l]);
        }
      }
    }
#else
  for (int i = 0; i < h; ++i)
    for (int j = 0; j < w; ++j) {
      const float *s0 = src + ((i + off) * swp + j + off) * 16;
      for (int64_t s = 0; s < cnt; ++s) dst[s * sstride + (int64_t)i * w + j] = s0[s];
    }
#endif
}


#endif
