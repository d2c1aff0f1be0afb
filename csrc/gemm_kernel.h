/* gemm_kernel.h — the CPU's register-blocked micro-kernel, shared by the
 * implicit GEMM (implicit_gemm.c) and Winograd with the samples in lanes (winograd_lanes.c):
 *
 *   tile[r][j] = sum over k < K of xb[r][idx[k]] * B[k*16 + j],
 *
 * r < DP_MK_ROWS (6), j < 16 (or 8): six rows, each read through its own base
 * pointer and a shared offset table, against a panel B of 16 floats per k
 * (one aligned cache line). Each output is a sum in k order blocked as
 * small_gemm.c's (small_gemm.h, DP_GEMM_KB): each block of KB k one chain
 * (fused multiply-adds where the CPU has FMA) from zero in registers, the
 * first block's result stored in the tile and each later one's added to it;
 * the same bits whichever row block or panel it falls in, and the same as
 * small_gemm.c's kernel on the same sum. Static functions: each includer
 * gets its own copy, compiled with its flags.
 */
#ifndef DP_GEMM_KERNEL_H
#define DP_GEMM_KERNEL_H

#include <stdint.h>

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include "lanes.h"      /* dp_lanes_upto, dp_transpose16 */
#include "small_gemm.h" /* DP_GEMM_KB */

#define DP_MK_ROWS 6


#if defined(__AVX__)
typedef __m256 v8;
#define V8_ZERO() _mm256_setzero_ps()
#define V8_LOAD(p) _mm256_loadu_ps(p)
#define V8_BCAST(p) _mm256_broadcast_ss(p)
#define V8_STORE(p, v) _mm256_storeu_ps((p), (v))
#define V8_ADD(a, b) _mm256_add_ps((a), (b))
#if defined(__FMA__)
#define V8_MADD(acc, a, b) _mm256_fmadd_ps((a), (b), (acc))
#else
#define V8_MADD(acc, a, b) _mm256_add_ps((acc), _mm256_mul_ps((a), (b)))
#endif
#else
/* GCC's and Clang's vector extension elsewhere (two SSE registers, or scalar
 * code); v8u, the unaligned and aliasing view of 8 floats, as immintrin.h's
 * __m256_u (no function takes or returns a vector: without AVX that changes
 * the ABI, and GCC warns) */
typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4), may_alias));
#define V8_ZERO() ((v8){0})
#define V8_LOAD(p) ((v8)(*(const v8u *)(const void *)(p)))
#define V8_BCAST(p) ((v8){0} + *(p))
#define V8_STORE(p, v) (*(v8u *)(void *)(p) = (v))
#define V8_ADD(a, b) ((a) + (b))
#define V8_MADD(acc, a, b) ((acc) + (a) * (b))
#endif

/* a block's 8 sums into the tile: stored for the first block (k0 == 0), else added to what it holds */
#define DP_MK_PUT(k0, p, v) V8_STORE((p), (k0) == 0 ? (v) : V8_ADD(V8_LOAD(p), (v)))

#if defined(__AVX512F__) && defined(__FMA__)
/* AVX-512: a row's 16 columns in one register, 6 fused multiply-adds per k
 * where AVX2 issues 12; each output the same sequence of fused multiply-adds,
 * so the same bits as the AVX2 + FMA kernel. */
static inline void dp_mk_16(int64_t K, const float *const *xb, const int32_t *restrict idx, const float *restrict B,
                            float *restrict tile) {
  const float *x0 = xb[0], *x1 = xb[1], *x2 = xb[2], *x3 = xb[3], *x4 = xb[4], *x5 = xb[5];
  __m512 t0 = _mm512_setzero_ps(), t1 = _mm512_setzero_ps(), t2 = _mm512_setzero_ps();
  __m512 t3 = _mm512_setzero_ps(), t4 = _mm512_setzero_ps(), t5 = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 == 0 || k0 < K; k0 += DP_GEMM_KB) { /* a block's chains from zero, then added to the totals */
    const int64_t k1 = K - k0 < DP_GEMM_KB ? K : k0 + DP_GEMM_KB;
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps();
    __m512 a3 = _mm512_setzero_ps(), a4 = _mm512_setzero_ps(), a5 = _mm512_setzero_ps();
    for (int64_t k = k0; k < k1; ++k) {
      const __m512 b = _mm512_loadu_ps(B + k * 16);
      const int32_t i = idx[k];
      a0 = _mm512_fmadd_ps(_mm512_set1_ps(x0[i]), b, a0);
      a1 = _mm512_fmadd_ps(_mm512_set1_ps(x1[i]), b, a1);
      a2 = _mm512_fmadd_ps(_mm512_set1_ps(x2[i]), b, a2);
      a3 = _mm512_fmadd_ps(_mm512_set1_ps(x3[i]), b, a3);
      a4 = _mm512_fmadd_ps(_mm512_set1_ps(x4[i]), b, a4);
      a5 = _mm512_fmadd_ps(_mm512_set1_ps(x5[i]), b, a5);
    }
    if (k0 == 0) {
      t0 = a0, t1 = a1, t2 = a2, t3 = a3, t4 = a4, t5 = a5;
    } else {
      t0 = _mm512_add_ps(t0, a0), t1 = _mm512_add_ps(t1, a1), t2 = _mm512_add_ps(t2, a2);
      t3 = _mm512_add_ps(t3, a3), t4 = _mm512_add_ps(t4, a4), t5 = _mm512_add_ps(t5, a5);
    }
  }
  _mm512_storeu_ps(tile + 0, t0);
  _mm512_storeu_ps(tile + 16, t1);
  _mm512_storeu_ps(tile + 32, t2);
  _mm512_storeu_ps(tile + 48, t3);
  _mm512_storeu_ps(tile + 64, t4);
  _mm512_storeu_ps(tile + 80, t5);
}
#else
static inline void dp_mk_16(int64_t K, const float *const *xb, const int32_t *restrict idx, const float *restrict B,
                      float *restrict tile) {
  const float *x0 = xb[0], *x1 = xb[1], *x2 = xb[2], *x3 = xb[3], *x4 = xb[4], *x5 = xb[5];
  for (int64_t k0 = 0; k0 == 0 || k0 < K; k0 += DP_GEMM_KB) { /* a block's chains from zero, then added into the tile */
    const int64_t k1 = K - k0 < DP_GEMM_KB ? K : k0 + DP_GEMM_KB;
    v8 a00 = V8_ZERO(), a01 = V8_ZERO(), a10 = V8_ZERO(), a11 = V8_ZERO(), a20 = V8_ZERO(), a21 = V8_ZERO();
    v8 a30 = V8_ZERO(), a31 = V8_ZERO(), a40 = V8_ZERO(), a41 = V8_ZERO(), a50 = V8_ZERO(), a51 = V8_ZERO();
    for (int64_t k = k0; k < k1; ++k) {
      const float *bk = B + k * 16;
      const v8 b0 = V8_LOAD(bk), b1 = V8_LOAD(bk + 8);
      const int32_t i = idx[k];
      v8 s = V8_BCAST(x0 + i);
      a00 = V8_MADD(a00, s, b0);
      a01 = V8_MADD(a01, s, b1);
      s = V8_BCAST(x1 + i);
      a10 = V8_MADD(a10, s, b0);
      a11 = V8_MADD(a11, s, b1);
      s = V8_BCAST(x2 + i);
      a20 = V8_MADD(a20, s, b0);
      a21 = V8_MADD(a21, s, b1);
      s = V8_BCAST(x3 + i);
      a30 = V8_MADD(a30, s, b0);
      a31 = V8_MADD(a31, s, b1);
      s = V8_BCAST(x4 + i);
      a40 = V8_MADD(a40, s, b0);
      a41 = V8_MADD(a41, s, b1);
      s = V8_BCAST(x5 + i);
      a50 = V8_MADD(a50, s, b0);
      a51 = V8_MADD(a51, s, b1);
    }
    DP_MK_PUT(k0, tile + 0, a00);
    DP_MK_PUT(k0, tile + 8, a01);
    DP_MK_PUT(k0, tile + 16, a10);
    DP_MK_PUT(k0, tile + 24, a11);
    DP_MK_PUT(k0, tile + 32, a20);
    DP_MK_PUT(k0, tile + 40, a21);
    DP_MK_PUT(k0, tile + 48, a30);
    DP_MK_PUT(k0, tile + 56, a31);
    DP_MK_PUT(k0, tile + 64, a40);
    DP_MK_PUT(k0, tile + 72, a41);
    DP_MK_PUT(k0, tile + 80, a50);
    DP_MK_PUT(k0, tile + 88, a51);
  }
}

#endif

/* The same with 8 columns (the last 8 of a channel count that is not a
 * multiple of 16); tile rows stay 16 floats apart. */
static inline void dp_mk_8(int64_t K, const float *const *xb, const int32_t *restrict idx, const float *restrict B,
                     float *restrict tile) {
  const float *x0 = xb[0], *x1 = xb[1], *x2 = xb[2], *x3 = xb[3], *x4 = xb[4], *x5 = xb[5];
  for (int64_t k0 = 0; k0 == 0 || k0 < K; k0 += DP_GEMM_KB) { /* blocks as dp_mk_16's */
    const int64_t k1 = K - k0 < DP_GEMM_KB ? K : k0 + DP_GEMM_KB;
    v8 a0 = V8_ZERO(), a1 = V8_ZERO(), a2 = V8_ZERO(), a3 = V8_ZERO(), a4 = V8_ZERO(), a5 = V8_ZERO();
    for (int64_t k = k0; k < k1; ++k) {
      const v8 b0 = V8_LOAD(B + k * 16);
      const int32_t i = idx[k];
      a0 = V8_MADD(a0, V8_BCAST(x0 + i), b0);
      a1 = V8_MADD(a1, V8_BCAST(x1 + i), b0);
      a2 = V8_MADD(a2, V8_BCAST(x2 + i), b0);
      a3 = V8_MADD(a3, V8_BCAST(x3 + i), b0);
      a4 = V8_MADD(a4, V8_BCAST(x4 + i), b0);
      a5 = V8_MADD(a5, V8_BCAST(x5 + i), b0);
    }
    DP_MK_PUT(k0, tile + 0, a0);
    DP_MK_PUT(k0, tile + 16, a1);
    DP_MK_PUT(k0, tile + 32, a2);
    DP_MK_PUT(k0, tile + 48, a3);
    DP_MK_PUT(k0, tile + 64, a4);
    DP_MK_PUT(k0, tile + 80, a5);
  }
}

/* The kernel for a panel whose first `width` columns are used: 16 wide, or 8
 * (a channel or tap count's last 8 or fewer). */
static inline void dp_mk(int64_t width, int64_t K, const float *const *xb, const int32_t *idx, const float *B, float *tile) {
  if (width > 8)
    dp_mk_16(K, xb, idx, B, tile);
  else
    dp_mk_8(K, xb, idx, B, tile);
}

#endif
