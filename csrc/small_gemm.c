/* small_gemm.c — see small_gemm.h.
 *
 * The 8 x 32 micro-kernel: for k in order, two vector loads of B's row k
 * (32 columns) and eight broadcasts of A's column k, sixteen fused
 * multiply-adds into sixteen accumulators (a fused multiply-add's latency
 * times the two ports asks for at least eight independent ones). A panel
 * narrower than 32 columns loads and stores under masks (no edge copies).
 * The loops: the 32-column panels outside, the 8-row blocks inside, so that a
 * panel of B (K x 32 floats: 8 KiB at K = 64, 64 KiB at 512) stays in the
 * cache while all of A's rows pass over it. K in blocks of DP_GEMM_KB
 * (small_gemm.h): each block's sums start from zero in the registers and are
 * then added into C.
 */
#include <stdatomic.h>
#include "small_gemm.h"

#include <cblas.h>
#include <string.h>

#include "gemm_kernel.h"

#if defined(__AVX512F__)
#define DP_SG_KERNEL 2 /* dp_small_gemm_built's answer */
#define MR 8
#define NR 32
#define MB 128 /* rows a block (A's block, 128 KiB at K = 256, in the L2 cache) */
#define TB 16  /* the NT packing's register transpose: TB x TB */

/* A's element (row r, k) is a[r * rs + k * ks]: rs = lda and ks = 1 for A
 * as stored (NN), rs = 1 and ks = lda for A stored transposed (TN); each
 * caller passes one of them as a constant (the function is inlined). */
#define ROW_FMA(r)                                        \
  do {                                                    \
    const __m512 s = _mm512_set1_ps(ak[(r) * rs]);        \
    c##r##0 = _mm512_fmadd_ps(s, b0, c##r##0);            \
    if (wide) c##r##1 = _mm512_fmadd_ps(s, b1, c##r##1);  \
  } while (0)
#define ROW_INIT(r)                \
  do {                             \
    c##r##0 = _mm512_setzero_ps(); \
    c##r##1 = _mm512_setzero_ps(); \
  } while (0)
#define ROW_STORE(r)                                                                                   \
  do {                                                                                                 \
    if (acc) c##r##0 = _mm512_add_ps(_mm512_maskz_loadu_ps(m0, C + (r) * ldc), c##r##0);               \
    _mm512_mask_storeu_ps(C + (r) * ldc, m0, c##r##0);                                                  \
    if (wide && acc) c##r##1 = _mm512_add_ps(_mm512_maskz_loadu_ps(m1, C + (r) * ldc + 16), c##r##1); \
    if (wide) _mm512_mask_storeu_ps(C + (r) * ldc + 16, m1, c##r##1);                                   \
  } while (0)

/* C[0..8)[cols of m0, m1] (+)= A[0..8)[0..K) . B[0..K)[cols], K <= DP_GEMM_KB
 * (one accumulation block, small_gemm.h): each output's fused multiply-adds
 * in k order from zero, then (acc) C's value added to the block's sum, else
 * the sum stored. wide (a constant at each call): the second 16 columns too;
 * a panel of at most 16 columns (a 14x14 plane's 196 columns end in one of
 * 4) leaves them out, half the multiplies (the same sums: each column is its
 * own FMA chain). */
static inline __attribute__((always_inline)) void mk8x32(int64_t K, const float *A, int64_t rs, int64_t ks,
                                                         const float *B, int64_t ldb, float *C, int64_t ldc,
                                                         __mmask16 m0, __mmask16 m1, int acc, const int wide) {
  __m512 c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51, c60, c61, c70, c71;
  ROW_INIT(0);
  ROW_INIT(1);
  ROW_INIT(2);
  ROW_INIT(3);
  ROW_INIT(4);
  ROW_INIT(5);
  ROW_INIT(6);
  ROW_INIT(7);
  for (int64_t k = 0; k < K; ++k) {
    const float *bk = B + k * ldb, *ak = A + k * ks;
    const __m512 b0 = _mm512_maskz_loadu_ps(m0, bk), b1 = wide ? _mm512_maskz_loadu_ps(m1, bk + 16) : b0;
    ROW_FMA(0);
    ROW_FMA(1);
    ROW_FMA(2);
    ROW_FMA(3);
    ROW_FMA(4);
    ROW_FMA(5);
    ROW_FMA(6);
    ROW_FMA(7);
  }
  ROW_STORE(0);
  ROW_STORE(1);
  ROW_STORE(2);
  ROW_STORE(3);
  ROW_STORE(4);
  ROW_STORE(5);
  ROW_STORE(6);
  ROW_STORE(7);
}

/* one row (M's last M % 8): A's row at A, its k-th element at A[k * ks]; one block, as mk8x32 */
static inline void mk1x32(int64_t K, const float *A, int64_t ks, const float *B, int64_t ldb, float *C,
                          __mmask16 m0, __mmask16 m1, int acc) {
  __m512 c0 = _mm512_setzero_ps(), c1 = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 s = _mm512_set1_ps(A[k * ks]);
    c0 = _mm512_fmadd_ps(s, _mm512_maskz_loadu_ps(m0, B + k * ldb), c0);
    c1 = _mm512_fmadd_ps(s, _mm512_maskz_loadu_ps(m1, B + k * ldb + 16), c1);
  }
  if (acc) {
    c0 = _mm512_add_ps(_mm512_maskz_loadu_ps(m0, C), c0);
    c1 = _mm512_add_ps(_mm512_maskz_loadu_ps(m1, C + 16), c1);
  }
  _mm512_mask_storeu_ps(C, m0, c0);
  _mm512_mask_storeu_ps(C + 16, m1, c1);
}

/* rows [0, M) of C against one panel of nj <= 32 columns; A's element (r, k)
 * at A[r * rs + k * ks] (one of rs, ks is 1) */
static inline __attribute__((always_inline)) void panel(int64_t M, int64_t nj, int64_t K, const float *A, int64_t rs,
                                                        int64_t ks, const float *B, int64_t ldb, float *C,
                                                        int64_t ldc, int acc) {
  int64_t i = 0;
  if (nj == NR) { /* the common case: constant masks, plain loads and stores */
    for (; i + MR <= M; i += MR) mk8x32(K, A + i * rs, rs, ks, B, ldb, C + i * ldc, ldc, 0xFFFF, 0xFFFF, acc, 1);
  } else if (nj > 16) {
    const __mmask16 m0 = dp_lanes_upto(nj), m1 = dp_lanes_upto(nj - 16);
    for (; i + MR <= M; i += MR) mk8x32(K, A + i * rs, rs, ks, B, ldb, C + i * ldc, ldc, m0, m1, acc, 1);
  } else {
    const __mmask16 m0 = dp_lanes_upto(nj);
    for (; i + MR <= M; i += MR) mk8x32(K, A + i * rs, rs, ks, B, ldb, C + i * ldc, ldc, m0, 0, acc, 0);
  }
  const __mmask16 m0 = dp_lanes_upto(nj), m1 = dp_lanes_upto(nj - 16);
  for (; i < M; ++i) mk1x32(K, A + i * rs, ks, B, ldb, C + i * ldc, m0, m1, acc);
}

/* out[k * 16 + r] = rows[r][k], r, k < 16 (rows[r] = src + r * ld): a
 * 16 x 16 transpose in registers (pairs unpacked, then 4-float and 128-bit
 * blocks shuffled) */
static inline void transpose_block(const float *src, int64_t ld, float *out, int64_t out_ld) {
  __m512 r[16], c[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * ld);
  dp_transpose16(r, c);
  for (int k = 0; k < 16; ++k) _mm512_storeu_ps(out + k * out_ld, c[k]);
}

#elif defined(__AVX2__) && defined(__FMA__)
/* AVX2 + FMA (no AVX-512): the same kernel at half the width, a 6 x 16
 * block (12 of the 16 vector registers accumulate, two hold B's row k, one
 * the broadcast); a panel of at most 8 columns on one vector of columns.
 * Each output the same blocks of fused multiply-adds in k order as the
 * AVX-512 kernel's: the same bits. Against OpenBLAS's AVX2 kernels, which
 * pack both operands on every call: benchmarks/RESULTS.md, "An AVX2-only
 * machine". */
#define DP_SG_KERNEL 1
#define MR 6
#define NR 16
#define MB 120 /* a multiple of 6 */
#define TB 8

/* C[0..R)[cols] (+)= A[0..R)[0..K) . B[0..K)[cols], R <= 6 (a constant at
 * each call, as wide, bfull and cfull), K <= DP_GEMM_KB (one accumulation
 * block, as the AVX-512 kernel's: from zero, then C's value added where acc):
 * A's element (r, k) at A[r * rs + k * ks]; bfull: B's rows read whole (16
 * floats, or 8 where not wide) by plain loads, else the columns of m0 (and,
 * wide, m1 from column 8) under masks; cfull the same for C. The k loop holds
 * 12 accumulators, B's two vectors and the broadcast: masked loads in it
 * would need both masks too, 17 values for 16 registers (GCC 12 then stored
 * accumulators to the stack in the loop: 414 such stores in kernel_gemm), so
 * a wide partial panel is read from a zero-padded copy (panel) and only C is
 * masked */
static inline __attribute__((always_inline)) void mk16(const int R, int64_t K, const float *A, int64_t rs, int64_t ks,
                                                       const float *B, int64_t ldb, float *C, int64_t ldc,
                                                       __m256i m0, __m256i m1, int acc, const int wide,
                                                       const int bfull, const int cfull) {
  __m256 c[MR][2];
  for (int r = 0; r < R; ++r) c[r][0] = c[r][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float *bk = B + k * ldb, *ak = A + k * ks;
    const __m256 b0 = bfull ? _mm256_loadu_ps(bk) : _mm256_maskload_ps(bk, m0);
    const __m256 b1 = !wide ? b0 : bfull ? _mm256_loadu_ps(bk + 8) : _mm256_maskload_ps(bk + 8, m1);
    for (int r = 0; r < R; ++r) {
      const __m256 s = _mm256_broadcast_ss(ak + r * rs);
      c[r][0] = _mm256_fmadd_ps(s, b0, c[r][0]);
      if (wide) c[r][1] = _mm256_fmadd_ps(s, b1, c[r][1]);
    }
  }
  for (int r = 0; r < R && acc; ++r) {
    c[r][0] = _mm256_add_ps(cfull ? _mm256_loadu_ps(C + r * ldc) : _mm256_maskload_ps(C + r * ldc, m0), c[r][0]);
    if (wide)
      c[r][1] =
          _mm256_add_ps(cfull ? _mm256_loadu_ps(C + r * ldc + 8) : _mm256_maskload_ps(C + r * ldc + 8, m1), c[r][1]);
  }
  for (int r = 0; r < R; ++r) {
    if (cfull) {
      _mm256_storeu_ps(C + r * ldc, c[r][0]);
      if (wide) _mm256_storeu_ps(C + r * ldc + 8, c[r][1]);
    } else {
      _mm256_maskstore_ps(C + r * ldc, m0, c[r][0]);
      if (wide) _mm256_maskstore_ps(C + r * ldc + 8, m1, c[r][1]);
    }
  }
}

/* rows [0, M) in blocks of 6, the last rows a block of their own size */
static inline __attribute__((always_inline)) void mk_rows(int64_t M, int64_t K, const float *A, int64_t rs,
                                                          int64_t ks, const float *B, int64_t ldb, float *C,
                                                          int64_t ldc, __m256i m0, __m256i m1, int acc,
                                                          const int wide, const int bfull, const int cfull) {
  int64_t i = 0;
  for (; i + MR <= M; i += MR) mk16(MR, K, A + i * rs, rs, ks, B, ldb, C + i * ldc, ldc, m0, m1, acc, wide, bfull, cfull);
  switch (M - i) {
    case 5:
      mk16(5, K, A + i * rs, rs, ks, B, ldb, C + i * ldc, ldc, m0, m1, acc, wide, bfull, cfull);
      break;
    case 4:
      mk16(4, K, A + i * rs, rs, ks, B, ldb, C + i * ldc, ldc, m0, m1, acc, wide, bfull, cfull);
      break;
    case 3:
      mk16(3, K, A + i * rs, rs, ks, B, ldb, C + i * ldc, ldc, m0, m1, acc, wide, bfull, cfull);
      break;
    case 2:
      mk16(2, K, A + i * rs, rs, ks, B, ldb, C + i * ldc, ldc, m0, m1, acc, wide, bfull, cfull);
      break;
    case 1:
      mk16(1, K, A + i * rs, rs, ks, B, ldb, C + i * ldc, ldc, m0, m1, acc, wide, bfull, cfull);
      break;
    default:
      break;
  }
}

/* rows [0, M) of C against one panel of nj <= 16 columns, K <= DP_GEMM_KB */
static inline __attribute__((always_inline)) void panel(int64_t M, int64_t nj, int64_t K, const float *A, int64_t rs,
                                                        int64_t ks, const float *B, int64_t ldb, float *C,
                                                        int64_t ldc, int acc) {
  const __m256i m0 = dp_lanes8_upto(nj), m1 = dp_lanes8_upto(nj - 8);
  if (nj == NR) {
    mk_rows(M, K, A, rs, ks, B, ldb, C, ldc, m0, m1, acc, 1, 1, 1);
  } else if (nj > 8) {
    /* B's nj columns in a 16-wide copy, the lanes past nj zero: the loop's loads plain; each used
     * lane's FMAs as the masked form's, so the same bits */
    float pad[DP_GEMM_KB * NR] __attribute__((aligned(32)));
    for (int64_t k = 0; k < K; ++k) {
      memcpy(pad + k * NR, B + k * ldb, sizeof(float) * (size_t)nj);
      memset(pad + k * NR + nj, 0, sizeof(float) * (size_t)(NR - nj));
    }
    mk_rows(M, K, A, rs, ks, pad, NR, C, ldc, m0, m1, acc, 1, 1, 0);
  } else {
    mk_rows(M, K, A, rs, ks, B, ldb, C, ldc, m0, m1, acc, 0, 0, 0);
  }
}

/* out[k * out_ld + r] = src[r * ld + k], r, k < 8: an 8 x 8 transpose in registers (lanes.h) */
static inline void transpose_block(const float *src, int64_t ld, float *out, int64_t out_ld) {
  __m256 r[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * ld);
  dp_transpose8(r);
  for (int k = 0; k < 8; ++k) _mm256_storeu_ps(out + k * out_ld, r[k]);
}

#endif

#if defined(DP_SG_KERNEL)
/* the NT product's K block: a packed panel of NR x KC floats (64 KiB), a
 * whole number of accumulation blocks */
#define KC (DP_SMALL_GEMM_PACK_FLOATS / NR)
/* blocks of KB k (the accumulation block, small_gemm.h) by MB rows: A's
 * block in the L2 cache, B's panel (KB x NR) in the L1 while the block's rows
 * pass over it */
#define KB DP_GEMM_KB
_Static_assert(KC % KB == 0, "the NT packing's K block is a whole number of accumulation blocks");

int dp_small_gemm_built(void) { return DP_SG_KERNEL; }

dp_status dp_small_gemm_on(int *on) {
  DP_TRY(dp_env_switch("DPCORE_OWN_GEMM", 1, on));
  return DP_OK;
}

/* C (+)= op(A) . B, A's element (r, k) at A[r * rs + k * ks] (A as stored: rs
 * = lda, ks = 1; A stored transposed: rs = 1, ks = lda; the callers pass the
 * 1 as a constant) */
static inline __attribute__((always_inline)) void drive(int64_t M, int64_t N, int64_t K, const float *A, int64_t rs,
                                                        int64_t ks, const float *B, int64_t ldb, float *C,
                                                        int64_t ldc, int acc) {
  for (int64_t k0 = 0; k0 < K; k0 += KB) {
    const int64_t kc = K - k0 < KB ? K - k0 : KB;
    for (int64_t i0 = 0; i0 < M; i0 += MB) {
      const int64_t mc = M - i0 < MB ? M - i0 : MB;
      for (int64_t j = 0; j < N; j += NR)
        panel(mc, N - j < NR ? N - j : NR, kc, A + i0 * rs + k0 * ks, rs, ks, B + k0 * ldb + j, ldb,
              C + i0 * ldc + j, ldc, acc || k0 > 0);
    }
  }
}

/* pack[k * NR + jj] = B[jj * ldb + k], jj < nj, k < kc: TB x TB blocks in
 * registers, the edges one float at a time */
static void pack_transposed(const float *B, int64_t ldb, int64_t nj, int64_t kc, float *pack) {
  const int64_t kfull = kc / TB * TB, jfull = nj / TB * TB;
  for (int64_t jj = 0; jj < jfull; jj += TB)
    for (int64_t k = 0; k < kfull; k += TB) transpose_block(B + jj * ldb + k, ldb, pack + k * NR + jj, NR);
  for (int64_t jj = 0; jj < nj; ++jj) {
    const float *src = B + jj * ldb;
    for (int64_t k = jj < jfull ? kfull : 0; k < kc; ++k) pack[k * NR + jj] = src[k];
  }
}

/* C (+)= A . B^T, B stored (N, K): B^T packed a panel of NR columns by KC k at a time, each packed panel's
 * KC k summed a block of KB at a time */
static void gemm_nt(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *B, int64_t ldb,
                    float *C, int64_t ldc, int accumulate, float *pack) {
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t kc = K - k0 < KC ? K - k0 : KC;
    for (int64_t j = 0; j < N; j += NR) {
      const int64_t nj = N - j < NR ? N - j : NR;
      pack_transposed(B + j * ldb + k0, ldb, nj, kc, pack);
      for (int64_t i0 = 0; i0 < M; i0 += MB) {
        const int64_t mc = M - i0 < MB ? M - i0 : MB;
        for (int64_t kb = 0; kb < kc; kb += KB)
          panel(mc, nj, kc - kb < KB ? kc - kb : KB, A + i0 * lda + k0 + kb, lda, 1, pack + kb * NR, NR,
                C + i0 * ldc + j, ldc, accumulate || k0 + kb > 0);
      }
    }
  }
}

static int kernel_takes(int own, int ta, int tb) { return own && !(ta && tb); }

static void kernel_gemm(int ta, int tb, int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *B,
                        int64_t ldb, float *C, int64_t ldc, int accumulate, float *pack) {
  if (K <= 0) {
    if (!accumulate)
      for (int64_t i = 0; i < M; ++i) memset(C + i * ldc, 0, sizeof(float) * (size_t)N);
  } else if (tb) {
    gemm_nt(M, N, K, A, lda, B, ldb, C, ldc, accumulate, pack);
  } else if (ta) {
    drive(M, N, K, A, 1, lda, B, ldb, C, ldc, accumulate);
  } else {
    drive(M, N, K, A, lda, 1, B, ldb, C, ldc, accumulate);
  }
}

#else /* neither AVX-512 nor AVX2 + FMA in this build: CBLAS */

int dp_small_gemm_built(void) { return 0; }

dp_status dp_small_gemm_on(int *on) {
  DP_TRY(dp_env_switch("DPCORE_OWN_GEMM", 0, on)); /* a malformed value is an error in every build */
  *on = 0;
  return DP_OK;
}

static int kernel_takes(int own, int ta, int tb) {
  (void)own, (void)ta, (void)tb;
  return 0;
}

static void kernel_gemm(int ta, int tb, int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *B,
                        int64_t ldb, float *C, int64_t ldc, int accumulate, float *pack) {
  (void)ta, (void)tb, (void)M, (void)N, (void)K, (void)A, (void)lda, (void)B, (void)ldb, (void)C, (void)ldc,
      (void)accumulate, (void)pack;
}

#endif

static _Atomic long long gemm_calls[2]; /* [0] the BLAS, [1] dpcore's kernel */

void dp_gemm_counts(long long *blas, long long *own) {
  *blas = atomic_load_explicit(&gemm_calls[0], memory_order_relaxed);
  *own = atomic_load_explicit(&gemm_calls[1], memory_order_relaxed);
}

void dp_gemm(int own, int ta, int tb, int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *B,
             int64_t ldb, float *C, int64_t ldc, int accumulate, float *pack) {
  const int kernel = kernel_takes(own, ta, tb);
  atomic_fetch_add_explicit(&gemm_calls[kernel], 1, memory_order_relaxed);
  if (kernel)
    kernel_gemm(ta, tb, M, N, K, A, lda, B, ldb, C, ldc, accumulate, pack);
  else
    cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, (int)M, (int)N, (int)K,
                1.0f, A, (int)lda, B, (int)ldb, accumulate ? 1.0f : 0.0f, C, (int)ldc);
}
