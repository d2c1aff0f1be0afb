/* fft_lanes.c — convolution by 16 x 16 FFTs with the samples in lanes (see
 * fft_lanes.h).
 *
 * The transform: a real plane (16 rows of 16 pixels, a pixel 16 lanes) to its
 * half spectrum X[u][v], u < 16, v < 9 (NP = 144 points): each pair of rows
 * one complex 16-point FFT (the second row as the imaginary part, split
 * after), then a complex 16-point FFT down each of the 9 columns. The inverse
 * the same steps backwards, the imaginary parts of bins 0 and 8 of each row
 * dropped (the real part of a Hermitian spectrum). Scales: the inverse is
 * unnormalised, so the filter's transform carries 1/256 (a power of two:
 * exact), and dw's inverse multiplies by it.
 *
 * Layouts (floats; L = 16 lanes; a complex value's real and imaginary parts in
 * two rows of L, "(re, im)"):
 *   plane  (16, 16, L)        a chunk's channel, zero past the data
 *   Uf     (NP, O, 2, 2C)     forward rows of output channel o: real
 *                             [Wr, Wi] and imaginary [-Wi, Wr] per input
 *                             channel, against V's (re, im) rows
 *   Ud     (NP, C, 2, 2O)     dx rows of input channel c: real [Wr, -Wi],
 *                             imaginary [Wi, Wr] per output channel
 *   V      (NP, C, 2, L)      a chunk's input spectra (forward)
 *   M      (NP, 2 OB, L)      a block of OB output channels' products
 *   Xe     (NP, C, 4, L)      the input spectra as dw's rows: [Xr, Xi] and
 *                             [Xi, -Xr] (the real and imaginary parts' rows)
 *   Dv     (NP, O, 2, L)      a chunk's dy spectra (dx's panel, K = 2O)
 *   Dt     (nop, 32, 16)      one point's Dv with 16 output channels in the
 *                             lanes (dw's panel, K = 2 x 16 samples)
 *   acc    (NP, 2C, nop*16)   the thread's partial dW, (re, im) rows
 *   Z      (NP, 6, L)         three input channels' dx products
 */
#include <math.h>
#include <omp.h>
#include <stdatomic.h>
#include <string.h>

#include "fft_lanes.h"
#include "gemm_kernel.h"
#include "lanes.h"

#define L 16
#define FS 16          /* the transform's side */
#define FV 9           /* the half spectrum's columns, FS / 2 + 1 */
#define NP (FS * FV)   /* its points */
#define OB 12          /* forward: output channels a block (a multiple of 3: a kernel call's 6 rows) */
/* Fewer input channels than this keep the other paths (the transforms, per
 * channel, would dominate the products), as winograd_lanes.c's F(3x3, 5x5). */
#ifndef DP_FFT_MIN_IN
#define DP_FFT_MIN_IN 6
#endif
/* O * C at most this many pairs: Uf and Ud hold 4 * NP floats a pair (2.25
 * MiB at 1,024 pairs); larger layers keep the other paths. */
#define DP_FFT_MAX_PAIRS 16384
/* The direct form must do at least this many multiplies per (sample, o, c),
 * OH * OW * r * r, twice the FFT's 576, for the transforms and the complex
 * products' lower efficiency to pay. */
#define DP_FFT_MIN_DIRECT 1152

/* fl_forward recomputes the outputs within this many times the plane's error
 * bound of zero; a build may set 0 (CFLAGS=-DDP_FFT_SIGN_MARGIN=0: no
 * recomputation, the A/B of benchmarks/RESULTS.md's FFT section). */
#ifndef DP_FFT_SIGN_MARGIN
#define DP_FFT_SIGN_MARGIN 2.0
#endif

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4), may_alias));
#define LD(p) ((v16)(*(const v16u *)(const void *)(p)))
#define ST(p, v) (*(v16u *)(void *)(p) = (v))

static int64_t r16(int64_t n) { return (n + 15) & ~(int64_t)15; }

/* The transforms' vector: TV_LANES of a pixel's L lanes at a time, the lanes apart
 * (each lane's arithmetic is the same whatever TV_LANES). All 16 where a 16-float
 * vector is one register (AVX-512) or where the code is scalar anyway; 8 with
 * AVX's 16 registers of 8 floats, where a 16-float vector is two and the
 * 16-point FFT's 32 live values spilled (the transforms were 13 % of an AVX2
 * build's LeNet epoch, about half that in halves). */
#if defined(__AVX__) && !defined(__AVX512F__)
#define TV_LANES 8
#else
#define TV_LANES 16
#endif
typedef float tv __attribute__((vector_size(TV_LANES * 4)));
typedef float tvu __attribute__((vector_size(TV_LANES * 4), aligned(4), may_alias));
#define TLD(p) ((tv)(*(const tvu *)(const void *)(p)))
#define TST(p, v) (*(tvu *)(void *)(p) = (v))

/* ---- the 16-point complex FFT on lanes ------------------------------------ */

/* cos and sin of 2 pi m / 16 for the twiddles m = n2 * k1 that occur */
static const float TW_COS[10] = {1.0f, 0.923879532511286756f, 0.707106781186547524f, 0.382683432365089772f, 0.0f,
                                 -0.382683432365089772f, -0.707106781186547524f, -0.923879532511286756f, -1.0f,
                                 -0.923879532511286756f};
static const float TW_SIN[10] = {0.0f, 0.382683432365089772f, 0.707106781186547524f, 0.923879532511286756f, 1.0f,
                                 0.923879532511286756f, 0.707106781186547524f, 0.382683432365089772f, 0.0f,
                                 -0.382683432365089772f};

/* the 4-point DFT of (x0, x1, x2, x3) in place; inv: the inverse's sign */
static inline void dft4(tv *r0, tv *i0, tv *r1, tv *i1, tv *r2, tv *i2, tv *r3, tv *i3, int inv) {
  const tv ar = *r0 + *r2, ai = *i0 + *i2, br = *r0 - *r2, bi = *i0 - *i2;
  const tv cr = *r1 + *r3, ci = *i1 + *i3, dr = *r1 - *r3, di = *i1 - *i3;
  *r0 = ar + cr, *i0 = ai + ci;
  *r2 = ar - cr, *i2 = ai - ci;
  if (!inv) { /* y1 = b - i d, y3 = b + i d */
    *r1 = br + di, *i1 = bi - dr;
    *r3 = br - di, *i3 = bi + dr;
  } else {
    *r1 = br - di, *i1 = bi + dr;
    *r3 = br + di, *i3 = bi - dr;
  }
}

/* X[k] = sum over n of x[n] e^(-+2 pi i n k / 16), in place, natural order:
 * n = 4 n1 + n2, k = k1 + 4 k2; 4-point DFTs over n1, twiddles
 * e^(-+2 pi i n2 k1 / 16), 4-point DFTs over n2. */
static inline __attribute__((always_inline)) void fft16(tv re[FS], tv im[FS], int inv) {
#pragma GCC unroll 4
  for (int n2 = 0; n2 < 4; ++n2)
    dft4(&re[n2], &im[n2], &re[4 + n2], &im[4 + n2], &re[8 + n2], &im[8 + n2], &re[12 + n2], &im[12 + n2], inv);
  /* a[n2][k1] sits at x[4 k1 + n2] */
#pragma GCC unroll 4
  for (int n2 = 1; n2 < 4; ++n2)
#pragma GCC unroll 4
    for (int k1 = 1; k1 < 4; ++k1) {
      const int m = n2 * k1, at = 4 * k1 + n2;
      const tv r = re[at], i = im[at];
      if (m == 4) {
        re[at] = inv ? -i : i;
        im[at] = inv ? r : -r;
      } else {
        const float c = TW_COS[m], s = inv ? TW_SIN[m] : -TW_SIN[m]; /* times c + i s */
        re[at] = r * c - i * s;
        im[at] = i * c + r * s;
      }
    }
  tv tr[FS], ti[FS];
#pragma GCC unroll 4
  for (int k1 = 0; k1 < 4; ++k1) {
    tv a0r = re[4 * k1], a0i = im[4 * k1], a1r = re[4 * k1 + 1], a1i = im[4 * k1 + 1];
    tv a2r = re[4 * k1 + 2], a2i = im[4 * k1 + 2], a3r = re[4 * k1 + 3], a3i = im[4 * k1 + 3];
    dft4(&a0r, &a0i, &a1r, &a1i, &a2r, &a2i, &a3r, &a3i, inv);
    tr[k1] = a0r, ti[k1] = a0i;
    tr[k1 + 4] = a1r, ti[k1 + 4] = a1i;
    tr[k1 + 8] = a2r, ti[k1 + 8] = a2i;
    tr[k1 + 12] = a3r, ti[k1 + 12] = a3i;
  }
#pragma GCC unroll 16
  for (int k = 0; k < FS; ++k) re[k] = tr[k], im[k] = ti[k];
}

/* The half spectrum of a plane whose rows nr and beyond are zero: point p =
 * u * FV + v's real part stored at out + p * ps, its imaginary part at
 * out + p * ps + ims. */
static void rfft2(const float *plane, int nr, float *out, int64_t ps, int64_t ims) {
  for (int h = 0; h < L; h += TV_LANES) { /* TV_LANES lanes at a time */
    tv tr[FS][FV], ti[FS][FV];
    for (int i = 0; i < FS; i += 2) {
      if (i >= nr) {
        for (int k = 0; k < FV; ++k) tr[i][k] = ti[i][k] = tr[i + 1][k] = ti[i + 1][k] = (tv){0};
        continue;
      }
      tv zr[FS], zi[FS];
      for (int j = 0; j < FS; ++j) {
        zr[j] = TLD(plane + (i * FS + j) * L + h);
        zi[j] = i + 1 < nr ? TLD(plane + ((i + 1) * FS + j) * L + h) : (tv){0};
      }
      fft16(zr, zi, 0);
      /* rows i and i + 1 apart: A[k] = (Z[k] + conj Z[-k]) / 2, B[k] = (Z[k] - conj Z[-k]) / 2i */
      for (int k = 0; k < FV; ++k) {
        const int m = (FS - k) & (FS - 1);
        tr[i][k] = 0.5f * (zr[k] + zr[m]);
        ti[i][k] = 0.5f * (zi[k] - zi[m]);
        tr[i + 1][k] = 0.5f * (zi[k] + zi[m]);
        ti[i + 1][k] = 0.5f * (zr[m] - zr[k]);
      }
    }
    for (int v = 0; v < FV; ++v) {
      tv cr[FS], ci[FS];
      for (int u = 0; u < FS; ++u) cr[u] = tr[u][v], ci[u] = ti[u][v];
      fft16(cr, ci, 0);
      for (int u = 0; u < FS; ++u) {
        TST(out + (u * FV + v) * ps + h, cr[u]);
        TST(out + (u * FV + v) * ps + ims + h, ci[u]);
      }
    }
  }
}

/* The inverse (unnormalised, times scale): rows [0, nro) of the real plane
 * whose half spectrum is at src as rfft2 stores it. */
static void irfft2(const float *src, int64_t ps, int64_t ims, int nro, float scale, float *plane) {
  for (int h = 0; h < L; h += TV_LANES) { /* TV_LANES lanes at a time */
    tv tr[FS][FV], ti[FS][FV];
    for (int v = 0; v < FV; ++v) {
      tv cr[FS], ci[FS];
      for (int u = 0; u < FS; ++u) {
        cr[u] = TLD(src + (u * FV + v) * ps + h);
        ci[u] = TLD(src + (u * FV + v) * ps + ims + h);
      }
      fft16(cr, ci, 1);
      for (int u = 0; u < FS; ++u) tr[u][v] = cr[u], ti[u][v] = ci[u];
    }
    for (int i = 0; i < nro; i += 2) {
      /* Z = A + i B over the full row, A and B rows i and i + 1 (Hermitian:
       * A[16 - k] = conj A[k]; bins 0 and 8 real) */
      tv zr[FS], zi[FS];
      zr[0] = tr[i][0], zi[0] = tr[i + 1][0];
      zr[8] = tr[i][8], zi[8] = tr[i + 1][8];
      for (int k = 1; k < 8; ++k) {
        zr[k] = tr[i][k] - ti[i + 1][k];
        zi[k] = ti[i][k] + tr[i + 1][k];
        zr[FS - k] = tr[i][k] + ti[i + 1][k];
        zi[FS - k] = tr[i + 1][k] - ti[i][k];
      }
      fft16(zr, zi, 1);
      for (int j = 0; j < FS; ++j) {
        TST(plane + (i * FS + j) * L + h, zr[j] * scale);
        if (i + 1 < nro) TST(plane + ((i + 1) * FS + j) * L + h, zi[j] * scale);
      }
    }
  }
}

/* ---- the layer ------------------------------------------------------------ */

typedef struct fl_geom {
  int C, O, H, W, OH, OW, pad, r;
  int64_t nch; /* chunks of L samples */
  int64_t nop; /* dw: panels of 16 output channels */
  int nt;
} fl_geom;

static fl_geom fl_make(const dp_conv_geom *g, int64_t N, int nthreads) {
  fl_geom q;
  q.C = g->C, q.O = g->O, q.H = g->H, q.W = g->W, q.OH = g->OH, q.OW = g->OW, q.pad = g->pad, q.r = g->KH;
  q.nch = N > 0 ? (N + L - 1) / L : 0;
  q.nop = ((int64_t)g->O + 15) / 16;
  q.nt = nthreads < 1 ? 1 : nthreads;
  if (q.nch > 0 && q.nt > q.nch) q.nt = (int)q.nch;
  return q;
}

static _Atomic long long fft_calls;

long long dp_fft_count(void) { return atomic_load_explicit(&fft_calls, memory_order_relaxed); }

dp_status dp_fft_takes(const dp_conv_geom *g, int *takes) {
  *takes = 0;
  int on;
  DP_TRY(dp_env_switch("DPCORE_FFT", 1, &on));
  if (!on || g->stride != 1 || g->KH != g->KW || g->KH < 5 || g->OH < 1 || g->OW < 1) return DP_OK;
  if ((int64_t)g->H + 2 * (int64_t)g->pad > FS || (int64_t)g->W + 2 * (int64_t)g->pad > FS) return DP_OK;
  if (g->C < DP_FFT_MIN_IN || (int64_t)g->O * g->C > DP_FFT_MAX_PAIRS) return DP_OK;
  *takes = (int64_t)g->OH * g->OW * g->KH * g->KW >= DP_FFT_MIN_DIRECT;
  return DP_OK;
}

/* the filter's transform (and, forward, the filters' l1 norms after it) and the per-thread floats of each pass */
static int64_t fl_u_floats(const fl_geom *q) { return r16((int64_t)NP * q->O * q->C * 4) + r16((int64_t)q->O * q->C); }
static float *fl_w1(const fl_geom *q, float *U) { return U + r16((int64_t)NP * q->O * q->C * 4); }
static int64_t fl_idx_floats(const fl_geom *q) {
  const int64_t k = 2 * (int64_t)(q->C > q->O ? q->C : q->O);
  return r16(k > 32 ? k : 32);
}
#define PLANE ((int64_t)FS * FS * L)
#define WT_FLOATS ((int64_t)NP * 2 * L)

static int64_t fl_thread_floats(const fl_geom *q, int pass) {
  if (pass == DP_FFT_FORWARD)
    return (q->C + 1) * PLANE + WT_FLOATS + r16((int64_t)NP * 2 * q->C * L) + r16((int64_t)NP * 2 * OB * L) +
           r16((int64_t)q->C * L);
  return 3 * PLANE + WT_FLOATS + r16((int64_t)NP * 4 * q->C * L) + r16((int64_t)NP * 2 * q->O * L) +
         r16(q->nop * 32 * 16) + 16 * DP_MK_ROWS + r16((int64_t)NP * 6 * L) + r16((int64_t)NP * 2 * q->C * q->nop * 16) +
         2 * (int64_t)q->O * L; /* the bias gradient's double lanes */
}

size_t dp_fft_scratch_floats(const dp_conv_geom *g, int64_t N, int nthreads, int pass) {
  const fl_geom q = fl_make(g, N, nthreads);
  return (size_t)(fl_u_floats(&q) + fl_idx_floats(&q) + q.nt * fl_thread_floats(&q, pass));
}

/* Uf (forward) or Ud (dx) from w, 16 (o, c) pairs a lane; each thread's plane
 * and Wt its own. A worksharing loop of a parallel region (ends in its
 * barrier). */
static void fl_filter_transform(const fl_geom *q, const float *w, int dx, float *U, float *plane, float *Wt) {
  const int64_t pairs = (int64_t)q->O * q->C, blocks = (pairs + L - 1) / L, rr = (int64_t)q->r * q->r;
  const int64_t C2 = 2 * (int64_t)q->C, O2 = 2 * (int64_t)q->O;
  const float s = 1.0f / 256.0f;
  memset(plane, 0, sizeof(float) * (size_t)PLANE);
#pragma omp for schedule(static)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t p0 = blk * L, n = pairs - p0 < L ? pairs - p0 : L;
    for (int a = 0; a < q->r; ++a)
      for (int b = 0; b < q->r; ++b) {
        float *px = plane + (a * FS + b) * L;
        for (int64_t l = 0; l < L; ++l) px[l] = l < n ? w[(p0 + l) * rr + a * q->r + b] : 0.0f;
      }
    rfft2(plane, q->r, Wt, 2 * L, L);
    for (int64_t l = 0; l < n; ++l) {
      const int64_t o = (p0 + l) / q->C, c = (p0 + l) % q->C;
      if (!dx) { /* fl_forward's ||w_oc||_1 */
        double a = 0.0;
        for (int64_t k = 0; k < rr; ++k) a += fabs((double)w[(p0 + l) * rr + k]);
        fl_w1(q, U)[p0 + l] = (float)a;
      }
      for (int p = 0; p < NP; ++p) {
        const float wr = Wt[p * 2 * L + l] * s, wi = Wt[p * 2 * L + L + l] * s;
        if (!dx) {
          float *u = U + ((int64_t)p * q->O + o) * 2 * C2;
          u[2 * c] = wr, u[2 * c + 1] = wi;
          u[C2 + 2 * c] = -wi, u[C2 + 2 * c + 1] = wr;
        } else {
          float *u = U + ((int64_t)p * q->C + c) * 2 * O2;
          u[2 * o] = wr, u[2 * o + 1] = -wi;
          u[O2 + 2 * o] = wi, u[O2 + 2 * o + 1] = wr;
        }
      }
    }
  }
}

static void fl_chunk(int64_t N, int64_t k, int64_t *n0, int64_t *cnt) {
  *n0 = k * L;
  *cnt = N - *n0 < L ? N - *n0 : L;
}

/* k_F(K) of tests/test_fft.py: the bound on the error of one output plane,
 * ||y^ - y||_2 <= k_F(2C) sum over c of ||x_c||_2 ||w_oc||_1 (derived there) */
static double fl_plane_bound(int64_t K) {
  const double u = 0x1p-24, g4 = 4 * u / (1 - 4 * u), gk = (double)K * u / (1 - (double)K * u);
  const double eta = u + g4 * (sqrt(2.0) + u), eps = (8 * eta + 2 * u) / (1 - 8 * eta);
  return sqrt(2.0) * (2 * eps + eps * eps + 2 * gk) * (1 + eps) + eps;
}

static _Atomic long long fft_redone; /* outputs recomputed directly (below) */

long long dp_fft_redone(void) { return atomic_load_explicit(&fft_redone, memory_order_relaxed); }

/* Output (i, j) of one output channel for the chunk's 16 samples, b + sum
 * over c, u, v of P[c][i + u][j + v] w[c][u][v] (P the chunk's zero-bordered
 * input in lanes): each channel's r*r terms summed (in vectors: in 4 chains
 * of every fourth tap, then pairwise), then the channels' sums, a float32 GEMM's
 * accuracy (fl_forward's outputs that need a sign). */
/* fl_direct's vector of the machine's width (macros: a function taking or
 * returning a vector changes the ABI where the build lacks the extension) */
#if defined(__AVX512F__)
#define FL_W 16
#define FL_VEC __m512
#define FL_STORE(p, v) _mm512_storeu_ps(p, v)
#define FL_ZERO _mm512_setzero_ps()
#define FL_LOAD(p) _mm512_loadu_ps(p)
#define FL_SET1(x) _mm512_set1_ps(x)
#define FL_ADD(a, b) _mm512_add_ps(a, b)
#define FL_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#elif defined(__AVX__)
#define FL_W 8
#define FL_VEC __m256
#define FL_STORE(p, v) _mm256_storeu_ps(p, v)
#define FL_ZERO _mm256_setzero_ps()
#define FL_LOAD(p) _mm256_loadu_ps(p)
#define FL_SET1(x) _mm256_set1_ps(x)
#define FL_ADD(a, b) _mm256_add_ps(a, b)
#if defined(__FMA__)
#define FL_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#else
#define FL_FMA(a, b, c) _mm256_add_ps(c, _mm256_mul_ps(a, b))
#endif
#else
#define FL_W 4 /* scalar loops over FL_W lanes */
#endif

static void fl_direct(const fl_geom *q, const float *P, const float *wo, float bias, int i, int j, unsigned lanes,
                      float out[L]) {
  /* in vectors of the machine's width (GCC's code for a 16-float vector on a machine with 8-float
   * ones kept this loop's sums on the stack: 4x slower than the FFT itself on an AVX2 build), only
   * those holding a lane of `lanes`, with fused multiply-adds where the machine has them */
  for (int h = 0; h < L; h += FL_W) {
    if (!((lanes >> h) & ((1u << FL_W) - 1u))) continue;
#if defined(FL_VEC)
    FL_VEC acc = FL_ZERO;
#else
    float acc[FL_W] = {0};
#endif
    for (int c = 0; c < q->C; ++c) {
      const float *pc = P + (int64_t)c * PLANE + h, *wc = wo + (int64_t)c * q->r * q->r;
#if defined(FL_VEC)
      /* the taps in 4 chains (tap t into chain t % 4), added pairwise: 4
       * multiply-adds in flight where one chain waited on each */
      FL_VEC p0 = FL_ZERO, p1 = FL_ZERO, p2 = FL_ZERO, p3 = FL_ZERO;
      const int taps = q->r * q->r;
      int t = 0, u = 0, v = 0; /* tap t = u * r + v */
#define FL_TAP(p)                                                                \
  do {                                                                           \
    p = FL_FMA(FL_LOAD(pc + ((i + u) * FS + j + v) * L), FL_SET1(wc[t]), p);     \
    ++t;                                                                         \
    if (++v == q->r) {                                                           \
      v = 0;                                                                     \
      ++u;                                                                       \
    }                                                                            \
  } while (0)
      while (t + 4 <= taps) {
        FL_TAP(p0);
        FL_TAP(p1);
        FL_TAP(p2);
        FL_TAP(p3);
      }
      while (t < taps) FL_TAP(p0);
#undef FL_TAP
      acc = FL_ADD(acc, FL_ADD(FL_ADD(p0, p1), FL_ADD(p2, p3)));
#else
      float part[FL_W] = {0};
      for (int u = 0; u < q->r; ++u)
        for (int v = 0; v < q->r; ++v)
          for (int l = 0; l < FL_W; ++l) part[l] += pc[((i + u) * FS + j + v) * L + l] * wc[u * q->r + v];
      for (int l = 0; l < FL_W; ++l) acc[l] += part[l];
#endif
    }
#if defined(FL_VEC)
    FL_STORE(out + h, FL_ADD(acc, FL_SET1(bias)));
#else
    for (int l = 0; l < FL_W; ++l) out[h + l] = acc[l] + bias;
#endif
  }
}

/* Forward. The FFT's error is spread over the plane (about u times the
 * plane's norm at every output), where a GEMM's error in an output is u times
 * that output's own terms: an output near zero in a plane of large ones (a
 * window over the background of an image, one that should be exactly the
 * bias) can come out with the wrong sign, and ReLU turns the sign into a
 * flipped unit, which moves training far more than rounding (LeNet from the
 * book's initialisation: 50-70x PyTorch float32's distance to float64 when
 * left so). So each output whose computed value is within twice the plane's
 * error bound of zero is recomputed directly (fl_direct): every other one has
 * the exact result's sign. Typically a fraction of a percent are. */
static void fl_forward(const fl_geom *q, int64_t N, const float *x, const float *w, const float *b, float *y,
                       float *scratch) {
  float *U = scratch;
  const float *W1 = fl_w1(q, U);
  int32_t *idx = (int32_t *)(void *)(U + fl_u_floats(q));
  float *per = scratch + fl_u_floats(q) + fl_idx_floats(q);
  const int64_t C2 = 2 * (int64_t)q->C, rr = (int64_t)q->r * q->r;
  for (int64_t k = 0; k < C2; ++k) idx[k] = (int32_t)k;
  const int64_t hw = (int64_t)q->H * q->W, in_sz = q->C * hw, P = (int64_t)q->OH * q->OW, out_sz = q->O * P;
  const int64_t tf = fl_thread_floats(q, DP_FFT_FORWARD);
  const float kf = (float)(DP_FFT_SIGN_MARGIN * fl_plane_bound(C2) * (1.0 + 0x1p-20)), ub = 0x1p-22f;
#pragma omp parallel num_threads(q->nt)
  {
    const int th = omp_get_thread_num();
    float *Pin = per + th * tf, *Pout = Pin + q->C * PLANE, *Wt = Pout + PLANE, *V = Wt + WT_FLOATS;
    float *M = V + r16((int64_t)NP * C2 * L), *XN = M + r16((int64_t)NP * 2 * OB * L);
    long long redone = 0;
    fl_filter_transform(q, w, 0, U, Pin, Wt);
    memset(Pin, 0, sizeof(float) * (size_t)(q->C * PLANE)); /* the borders, never written below */
    for (int64_t k = q->nch * th / q->nt; k < q->nch * (th + 1) / q->nt; ++k) {
      int64_t n0, cnt;
      fl_chunk(N, k, &n0, &cnt);
      for (int c = 0; c < q->C; ++c) {
        float *Pc = Pin + (int64_t)c * PLANE;
        dp_to_lanes(x + n0 * in_sz + c * hw, in_sz, cnt, q->H, q->W, Pc, FS, q->pad);
        v16 ss = {0};
        for (int i = 0; i < q->H; ++i)
          for (int j = 0; j < q->W; ++j) {
            const v16 v = LD(Pc + ((i + q->pad) * FS + j + q->pad) * L);
            ss += v * v;
          }
        float lane[L];
        ST(lane, ss);
        for (int s = 0; s < L; ++s) XN[c * L + s] = sqrtf(lane[s]) * (1.0f + 0x1p-20f); /* ||x_c||_2, rounded up */
        rfft2(Pc, q->pad + q->H, V + 2 * (int64_t)c * L, C2 * L, L);
      }
      for (int ob = 0; ob < q->O; ob += OB) {
        const int on = q->O - ob < OB ? q->O - ob : OB;
        for (int p = 0; p < NP; ++p)
          for (int t0 = 0; t0 < on; t0 += 3) {
            const float *xb[DP_MK_ROWS];
            for (int r = 0; r < DP_MK_ROWS; ++r) {
              const int o = ob + t0 + r / 2 < q->O ? ob + t0 + r / 2 : q->O - 1;
              xb[r] = U + (((int64_t)p * q->O + o) * 2 + r % 2) * C2;
            }
            dp_mk_16(C2, xb, idx, V + (int64_t)p * C2 * L, M + ((int64_t)p * 2 * OB + 2 * t0) * L);
          }
        for (int t = 0; t < on; ++t) {
          const int o = ob + t;
          const float bias = b ? b[o] : 0.0f;
          irfft2(M + 2 * (int64_t)t * L, 2 * OB * L, L, q->OH, 1.0f, Pout);
          /* the threshold per sample: twice the plane's bound (sums of nonnegative terms, each
           * rounded up by the 1 + 2^-20 factors), plus the bias add's rounding */
          v16 tau = {0};
          for (int c = 0; c < q->C; ++c) tau += LD(XN + c * L) * W1[(int64_t)o * q->C + c];
          tau = tau * kf + ub * fabsf(bias);
          float tl[L];
          ST(tl, tau);
          for (int i = 0; i < q->OH; ++i)
            for (int j = 0; j < q->OW; ++j) {
              float *px = Pout + (i * FS + j) * L;
              const v16 v = LD(px) + bias;
              ST(px, v);
              unsigned need = 0;
              for (int64_t s = 0; s < cnt; ++s) need |= (unsigned)!(fabsf(px[s]) > tl[s]) << s; /* a NaN too */
              if (!need) continue;
              float d[L];
              fl_direct(q, Pin, w + (int64_t)o * q->C * rr, bias, i, j, need, d);
              for (int64_t s = 0; s < cnt; ++s)
                if ((need >> s) & 1u) px[s] = d[s], ++redone;
            }
          dp_from_lanes(Pout, FS, 0, q->OH, q->OW, y + n0 * out_sz + o * P, out_sz, cnt);
        }
      }
    }
    atomic_fetch_add_explicit(&fft_redone, redone, memory_order_relaxed);
  }
}

/* Dt (nop, 32, 16) from one point's Dv (O, 2, L): Dt[q][s][j] = Dr of output
 * channel 16 q + j in lane s, Dt[q][16 + s][j] its Di; lanes past O are the
 * caller's zeros */
static void fl_transpose_dy(const fl_geom *q, const float *dv, float *dt) {
  for (int64_t qq = 0; qq < q->nop; ++qq) {
    const int n = q->O - 16 * qq < 16 ? (int)(q->O - 16 * qq) : 16;
    for (int part = 0; part < 2; ++part) {
      float *d = dt + (qq * 32 + 16 * part) * 16;
#if defined(__AVX512F__)
      __m512 in[16], out[16];
      for (int j = 0; j < 16; ++j)
        in[j] = j < n ? _mm512_loadu_ps(dv + ((16 * qq + j) * 2 + part) * L) : _mm512_setzero_ps();
      dp_transpose16(in, out);
      for (int s = 0; s < 16; ++s) _mm512_storeu_ps(d + s * 16, out[s]);
#elif defined(__AVX2__)
      for (int jb = 0; jb < 16; jb += 8) /* four 8 x 8 transposes */
        for (int sb = 0; sb < 16; sb += 8) {
          __m256 r[8];
          for (int k = 0; k < 8; ++k)
            r[k] = jb + k < n ? _mm256_loadu_ps(dv + ((16 * qq + jb + k) * 2 + part) * L + sb) : _mm256_setzero_ps();
          dp_transpose8(r);
          for (int m = 0; m < 8; ++m) _mm256_storeu_ps(d + (sb + m) * 16 + jb, r[m]);
        }
#else
      for (int s = 0; s < 16; ++s)
        for (int j = 0; j < n; ++j) d[s * 16 + j] = dv[((16 * qq + j) * 2 + part) * L + s];
#endif
    }
  }
}

static void fl_backward(const fl_geom *q, int64_t N, const float *x, const float *w, const float *dy, float *dx,
                        float *dw, float *db, float *scratch) {
  float *U = scratch;
  int32_t *idx = (int32_t *)(void *)(U + fl_u_floats(q));
  float *per = scratch + fl_u_floats(q) + fl_idx_floats(q);
  const int64_t C2 = 2 * (int64_t)q->C, O2 = 2 * (int64_t)q->O, ow = q->nop * 16;
  for (int64_t k = 0; k < fl_idx_floats(q); ++k) idx[k] = (int32_t)k;
  const int64_t hw = (int64_t)q->H * q->W, in_sz = q->C * hw, P = (int64_t)q->OH * q->OW, out_sz = q->O * P;
  const int64_t tf = fl_thread_floats(q, DP_FFT_BACKWARD);
  const int64_t xe_sz = r16((int64_t)NP * 4 * q->C * L), dv_sz = r16((int64_t)NP * O2 * L);
  const int64_t dt_sz = r16(q->nop * 32 * 16), z_sz = r16((int64_t)NP * 6 * L);
  const int64_t acc_at = 3 * PLANE + WT_FLOATS + xe_sz + dv_sz + dt_sz + 16 * DP_MK_ROWS + z_sz;
  const int64_t acc_sz = (int64_t)NP * C2 * ow, db_at = acc_at + acc_sz;
#pragma omp parallel num_threads(q->nt)
  {
    const int th = omp_get_thread_num();
    float *Pin = per + th * tf, *Pdy = Pin + PLANE, *Pout = Pdy + PLANE, *Wt = Pout + PLANE;
    float *Xe = Wt + WT_FLOATS, *Dv = Xe + xe_sz, *Dt = Dv + dv_sz, *tile = Dt + dt_sz;
    float *Z = tile + 16 * DP_MK_ROWS, *acc = Pin + acc_at;
    double *dbl = (double *)(void *)(Pin + db_at); /* (O, L): this thread's bias gradient, a sample a lane */
    if (dx) fl_filter_transform(q, w, 1, U, Pin, Wt);
    memset(Pin, 0, sizeof(float) * (size_t)(2 * PLANE));
    memset(Dt, 0, sizeof(float) * (size_t)dt_sz);
    memset(acc, 0, sizeof(float) * (size_t)acc_sz);
    if (db) memset(dbl, 0, sizeof(double) * (size_t)(q->O * L));
    for (int64_t k = q->nch * th / q->nt; k < q->nch * (th + 1) / q->nt; ++k) {
      int64_t n0, cnt;
      fl_chunk(N, k, &n0, &cnt);
      for (int c = 0; c < q->C; ++c) {
        dp_to_lanes(x + n0 * in_sz + c * hw, in_sz, cnt, q->H, q->W, Pin, FS, q->pad);
        float *xe = Xe + 4 * (int64_t)c * L;
        rfft2(Pin, q->pad + q->H, xe, 4 * (int64_t)q->C * L, L);
        for (int p = 0; p < NP; ++p) {
          float *e = xe + (int64_t)p * 4 * q->C * L;
          ST(e + 2 * L, LD(e + L));
          ST(e + 3 * L, -LD(e));
        }
      }
      for (int o = 0; o < q->O; ++o) {
        dp_to_lanes(dy + n0 * out_sz + o * P, out_sz, cnt, q->OH, q->OW, Pdy, FS, 0);
        if (db) /* dy's pixels in double, where they are read anyway (a pass of its own reread dy from L3) */
          for (int i = 0; i < q->OH; ++i)
            for (int j = 0; j < q->OW; ++j)
              for (int s = 0; s < L; ++s) dbl[o * L + s] += (double)Pdy[(i * FS + j) * L + s];
        rfft2(Pdy, q->OH, Dv + 2 * (int64_t)o * L, O2 * L, L);
      }
      /* dW[p] (2C, O) += Xe[p] rows . Dt[p] (K = 32: the lanes' real parts, then their imaginary parts) */
      for (int p = 0; p < NP; ++p) {
        fl_transpose_dy(q, Dv + (int64_t)p * O2 * L, Dt);
        for (int c0 = 0; c0 < q->C; c0 += 3) {
          const float *xb[DP_MK_ROWS];
          for (int r = 0; r < DP_MK_ROWS; ++r) {
            const int c = c0 + r / 2 < q->C ? c0 + r / 2 : q->C - 1;
            xb[r] = Xe + (((int64_t)p * q->C + c) * 4 + 2 * (r % 2)) * L;
          }
          const int rows = 2 * (q->C - c0 < 3 ? q->C - c0 : 3);
          for (int64_t qq = 0; qq < q->nop; ++qq) {
            const int64_t width = q->O - 16 * qq > 8 ? 16 : 8;
            dp_mk(width, 32, xb, idx, Dt + qq * 32 * 16, tile);
            for (int r = 0; r < rows; ++r) {
              float *a = acc + ((int64_t)p * C2 + 2 * c0 + r) * ow + 16 * qq;
              for (int64_t j = 0; j < width; ++j) a[j] += tile[r * 16 + j];
            }
          }
        }
      }
      if (!dx) continue;
      /* dx: three input channels' products over every point, then their inverses */
      for (int c0 = 0; c0 < q->C; c0 += 3) {
        for (int p = 0; p < NP; ++p) {
          const float *xb[DP_MK_ROWS];
          for (int r = 0; r < DP_MK_ROWS; ++r) {
            const int c = c0 + r / 2 < q->C ? c0 + r / 2 : q->C - 1;
            xb[r] = U + (((int64_t)p * q->C + c) * 2 + r % 2) * O2;
          }
          dp_mk_16(O2, xb, idx, Dv + (int64_t)p * O2 * L, Z + (int64_t)p * 6 * L);
        }
        for (int t = 0; t < 3 && c0 + t < q->C; ++t) {
          irfft2(Z + 2 * (int64_t)t * L, 6 * L, L, q->pad + q->H, 1.0f, Pout);
          dp_from_lanes(Pout, FS, q->pad, q->H, q->W, dx + n0 * in_sz + (c0 + t) * hw, in_sz, cnt);
        }
      }
    }
  }
  /* dW = the threads' partials in thread order; dw = its inverse's r x r corner / 256. A block: one
   * input channel and up to 16 consecutive output channels, one a lane (acc's rows are contiguous
   * in o: whole vectors). */
  const int64_t rr = (int64_t)q->r * q->r, blocks = q->C * q->nop;
#pragma omp parallel num_threads(q->nt)
  {
    const int th = omp_get_thread_num();
    float *Pout = per + th * tf + 2 * PLANE, *Wt = Pout + PLANE;
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const int64_t c = blk / q->nop, o0 = (blk % q->nop) * 16, n = q->O - o0 < 16 ? q->O - o0 : 16;
      for (int p = 0; p < NP; ++p) {
        const float *a = per + acc_at + ((int64_t)p * C2 + 2 * c) * ow + o0;
        v16 re = LD(a), im = LD(a + ow);
        for (int t = 1; t < q->nt; ++t) {
          re += LD(a + t * tf);
          im += LD(a + t * tf + ow);
        }
        ST(Wt + p * 2 * L, re);
        ST(Wt + p * 2 * L + L, im);
      }
      irfft2(Wt, 2 * L, L, q->r, 1.0f / 256.0f, Pout);
      for (int64_t l = 0; l < n; ++l)
        for (int a = 0; a < q->r; ++a)
          for (int b2 = 0; b2 < q->r; ++b2)
            dw[((o0 + l) * q->C + c) * rr + a * q->r + b2] = Pout[(a * FS + b2) * L + l];
    }
  }
  /* db: each thread's lanes added pairwise, the threads' sums in thread order */
  for (int o = 0; db && o < q->O; ++o) {
    double total = 0.0;
    for (int t = 0; t < q->nt; ++t) {
      double lane[L];
      memcpy(lane, (const double *)(const void *)(per + t * tf + db_at) + o * L, sizeof lane);
      total += dp_lanes16_total(lane);
    }
    db[o] = (float)total;
  }
}

dp_status dp_fft_forward(const dp_conv_geom *g, int64_t N, const float *x, const float *w, const float *b, float *y,
                         int nthreads, float *scratch) {
  if (N <= 0) return DP_OK;
  const fl_geom q = fl_make(g, N, nthreads);
  atomic_fetch_add_explicit(&fft_calls, 1, memory_order_relaxed);
  fl_forward(&q, N, x, w, b, y, scratch);
  return DP_OK;
}

dp_status dp_fft_backward(const dp_conv_geom *g, int64_t N, const float *x, const float *w, const float *dy,
                          float *dx, float *dw, float *db, int nthreads, float *scratch) {
  if (N <= 0) {
    dp_conv_zero_grads(g, dw, db);
    return DP_OK;
  }
  const fl_geom q = fl_make(g, N, nthreads);
  atomic_fetch_add_explicit(&fft_calls, 1, memory_order_relaxed);
  fl_backward(&q, N, x, w, dy, dx, dw, db, scratch);
  return DP_OK;
}
