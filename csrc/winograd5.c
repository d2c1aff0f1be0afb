/* winograd5.c — Winograd F(3x3, 5x5) convolution on the CPU (see winograd5.h).
 *
 * Layouts (floats; L = 16 lanes, one sample each):
 *   U    (49, O, C)          the transformed filter, shared (forward and dx)
 *   P    (C, hp, wp, L)      a chunk's input, zero-bordered: the input's (i, j)
 *                            at (i + pad, j + pad); hp = 3*th + 4, wp = 3*tw + 4
 *   DYT  (O, 3*th, 3*tw, L)  a chunk's dy, zero past the output's edge
 *   V    (49, C, L)          one tile's B^T d B (forward: the kernel's panel, K = C)
 *   M    (49, o6, L)         one tile's products (o6: O rounded up to the kernel's 6 rows)
 *   Wd   (49, O, L)          one tile's A dY A^T (dx: the kernel's panel, K = O)
 *   Z    (49, c6, L)         one tile's sums over o of U_xi^T dM
 *   DXT  (C, hp, wp, L)      a chunk's dx, bordered as P, accumulated tile by tile
 *   dw:  Vw (49, np, TB*L, 16) a block of TB tiles' B^T d B with the channels in
 *        the lanes (np panels of 16), Wb (49, TB, O, L) their A dY A^T, and the
 *        thread's partial dU (49, O, np*16)
 * Every transform is 16-lane vector arithmetic (v16 below), written out, not
 * left to the loop vectorizer: GCC 12's AVX-512 code for a lane loop that
 * skipped the zero entries with `continue` computed zeros (-O3 -march=native
 * on an AVX-512 EPYC; right at -O2, with AVX2 only, or without the
 * vectorizer).
 */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "gemm_kernel.h"
#include "winograd5.h"

/* Fewer input channels than this keep the other paths: the products' sum over
 * C is the kernel's K, and with a handful of channels the transforms dominate.
 * Measured on one core against the implicit GEMM (benchmarks/bench_winograd5.py,
 * a build with the limit at 1 as the A/B, batch 128, 14x14): 4 -> 16 0.90x
 * forward and 0.94x backward (slower), 6 -> 16 1.06x and 1.18x, 8 -> 16 1.17x
 * and 1.27x, LeNet's 20 -> 50 3.1x and 2.4x. */
#ifndef DP_WINO5_MIN_IN /* a build may set it (CFLAGS=-DDP_WINO5_MIN_IN=1: that A/B) */
#define DP_WINO5_MIN_IN 6
#endif
/* A chunk's bordered input and dy planes at most this many floats (16 MiB):
 * larger planes keep the other paths. */
#define DP_WINO5_MAX_PLANES ((int64_t)1 << 22)
#define L 16
#define XI 49
/* dw: tiles per kernel call (K = DW_TILES * 16 lanes) */
#define DW_TILES 9

/* scripts/winograd_matrices.py 3 5 (exact rationals; G's rounded to float32) */
static const float AT[3][7] = {
    {1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 0.0f},
    {0.0f, 1.0f, -1.0f, 2.0f, -2.0f, 0.5f, 0.0f},
    {0.0f, 1.0f, 1.0f, 4.0f, 4.0f, 0.25f, 1.0f}};
static const float G[7][5] = {
    {-1.0f / 2, 0.0f, 0.0f, 0.0f, 0.0f},
    {-1.0f / 3, -1.0f / 3, -1.0f / 3, -1.0f / 3, -1.0f / 3},
    {1.0f / 9, -1.0f / 9, 1.0f / 9, -1.0f / 9, 1.0f / 9},
    {1.0f / 36, 1.0f / 18, 1.0f / 9, 2.0f / 9, 4.0f / 9},
    {-1.0f / 60, 1.0f / 30, -1.0f / 15, 2.0f / 15, -4.0f / 15},
    {32.0f / 45, 16.0f / 45, 8.0f / 45, 4.0f / 45, 2.0f / 45},
    {0.0f, 0.0f, 0.0f, 0.0f, 1.0f}};
static const float BT[7][7] = {
    {-2.0f, 4.0f, 2.5f, -5.0f, -0.5f, 1.0f, 0.0f},
    {0.0f, 2.0f, -2.0f, -4.5f, 0.5f, 1.0f, 0.0f},
    {0.0f, -2.0f, 6.0f, -3.5f, -1.5f, 1.0f, 0.0f},
    {0.0f, 1.0f, -1.5f, -2.0f, 1.5f, 1.0f, 0.0f},
    {0.0f, -1.0f, 2.5f, 0.0f, -2.5f, 1.0f, 0.0f},
    {0.0f, 4.0f, 0.0f, -5.0f, 0.0f, 1.0f, 0.0f},
    {0.0f, -2.0f, 4.0f, 2.5f, -5.0f, -0.5f, 1.0f}};

static int64_t r16(int64_t n) { return (n + 15) & ~(int64_t)15; }

typedef struct w5 {
  int C, O, H, W, OH, OW, pad;
  int th, tw;
  int64_t T;             /* tiles per sample */
  int64_t hp, wp;        /* P's plane */
  int64_t ohp, owp;      /* DYT's plane */
  int64_t o6, c6, np;    /* O and C rounded up to 6; dw's channel panels of 16 */
  int64_t nch;           /* chunks of L samples */
  int nt;                /* threads */
} w5;

static w5 w5_make(const dp_conv_geom *g, int64_t N, int nthreads) {
  w5 q;
  q.C = g->C;
  q.O = g->O;
  q.H = g->H;
  q.W = g->W;
  q.OH = g->OH;
  q.OW = g->OW;
  q.pad = g->pad;
  q.th = (g->OH + 2) / 3;
  q.tw = (g->OW + 2) / 3;
  q.T = (int64_t)q.th * q.tw;
  q.hp = 3 * (int64_t)q.th + 4;
  q.wp = 3 * (int64_t)q.tw + 4;
  q.ohp = 3 * (int64_t)q.th;
  q.owp = 3 * (int64_t)q.tw;
  q.o6 = ((int64_t)g->O + DP_MK_ROWS - 1) / DP_MK_ROWS * DP_MK_ROWS;
  q.c6 = ((int64_t)g->C + DP_MK_ROWS - 1) / DP_MK_ROWS * DP_MK_ROWS;
  q.np = ((int64_t)g->C + 15) / 16;
  q.nch = N > 0 ? (N + L - 1) / L : 0;
  q.nt = nthreads < 1 ? 1 : nthreads;
  if (q.nch > 0 && q.nt > q.nch) q.nt = (int)q.nch;
  return q;
}

static int64_t p_floats(const w5 *q) { return r16((int64_t)q->C * q->hp * q->wp * L); }
static int64_t dyt_floats(const w5 *q) { return r16((int64_t)q->O * q->ohp * q->owp * L); }
static int64_t dwb_tiles(const w5 *q) { return q->T < DW_TILES ? q->T : DW_TILES; }

dp_status dp_wino5_takes(const dp_conv_geom *g, int *takes) {
  *takes = 0;
  int on;
  DP_TRY(dp_env_switch("DPCORE_WINOGRAD", 1, &on));
  if (!on || g->KH != 5 || g->KW != 5 || g->stride != 1 || g->C < DP_WINO5_MIN_IN || g->OH < 1 || g->OW < 1) return DP_OK;
  const w5 q = w5_make(g, 1, 1);
  *takes = (int64_t)g->C * q.hp * q.wp + (int64_t)g->O * q.ohp * q.owp <= DP_WINO5_MAX_PLANES / L;
  return DP_OK;
}

/* shared floats: U and the int32 offset tables */
static int64_t shared_floats(const w5 *q, int pass) {
  const int64_t u = r16((int64_t)XI * q->O * q->C);
  return pass == DP_WINO5_FORWARD ? u + r16(q->C) : u + r16(q->O) + r16(dwb_tiles(q) * L);
}

static int64_t thread_floats(const w5 *q, int pass) {
  if (pass == DP_WINO5_FORWARD)
    return p_floats(q) + r16((int64_t)XI * q->C * L) + r16((int64_t)XI * q->o6 * L);
  /* backward: P, DYT, Vw, Wb, the partial dU, v, the kernel's tile, Z, DX */
  return p_floats(q) + dyt_floats(q) + r16((int64_t)XI * q->np * dwb_tiles(q) * L * 16) +
         r16((int64_t)XI * dwb_tiles(q) * q->O * L) + r16((int64_t)XI * q->O * q->np * 16) + r16(XI * L) +
         16 * DP_MK_ROWS + r16((int64_t)XI * q->c6 * L) + p_floats(q);
}

size_t dp_wino5_scratch_floats(const dp_conv_geom *g, int64_t N, int nthreads, int pass) {
  const w5 q = w5_make(g, N, nthreads);
  return (size_t)(shared_floats(&q, pass) + q.nt * thread_floats(&q, pass));
}

/* ---- the transforms, 16 lanes at a time ----------------------------------
 * v16: 16 floats, one AVX-512 register (two AVX ones, four SSE ones: GCC's and
 * Clang's vector extension); no function takes or returns one (that would
 * change the ABI without AVX-512, and GCC warns), they pass arrays. Each
 * apply_* is one of the 1-D transforms on 7 (or 3) vectors, its loops unrolled
 * so that the matrix entries are constants and the zero ones drop out: each
 * output a sequential sum of its nonzero terms in index order. */

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4), may_alias));
#define LD(p) (*(const v16u *)(const void *)(p))
#define ST(p, v) (*(v16u *)(void *)(p) = (v))

/* out[i] = sum over a of BT[i][a] in[a] (B^T along one axis) */
static inline void apply_bt(const v16 *in, v16 *out) {
#pragma GCC unroll 7
  for (int i = 0; i < 7; ++i) {
    v16 acc = {0};
    int first = 1;
#pragma GCC unroll 7
    for (int a = 0; a < 7; ++a)
      if (BT[i][a] != 0.0f) {
        acc = first ? BT[i][a] * in[a] : acc + BT[i][a] * in[a];
        first = 0;
      }
    out[i] = acc;
  }
}

/* out[a] = sum over i of BT[i][a] in[i] (B along one axis) */
static inline void apply_b(const v16 *in, v16 *out) {
#pragma GCC unroll 7
  for (int a = 0; a < 7; ++a) {
    v16 acc = {0};
    int first = 1;
#pragma GCC unroll 7
    for (int i = 0; i < 7; ++i)
      if (BT[i][a] != 0.0f) {
        acc = first ? BT[i][a] * in[i] : acc + BT[i][a] * in[i];
        first = 0;
      }
    out[a] = acc;
  }
}

/* out[a] (3) = sum over i of AT[a][i] in[i] (7) (A^T along one axis) */
static inline void apply_at(const v16 *in, v16 *out) {
#pragma GCC unroll 3
  for (int a = 0; a < 3; ++a) {
    v16 acc = {0};
    int first = 1;
#pragma GCC unroll 7
    for (int i = 0; i < 7; ++i)
      if (AT[a][i] != 0.0f) {
        acc = first ? AT[a][i] * in[i] : acc + AT[a][i] * in[i];
        first = 0;
      }
    out[a] = acc;
  }
}

/* out[i] (7) = sum over a of AT[a][i] in[a] (3) (A along one axis) */
static inline void apply_a(const v16 *in, v16 *out) {
#pragma GCC unroll 7
  for (int i = 0; i < 7; ++i) {
    v16 acc = {0};
    int first = 1;
#pragma GCC unroll 3
    for (int a = 0; a < 3; ++a)
      if (AT[a][i] != 0.0f) {
        acc = first ? AT[a][i] * in[a] : acc + AT[a][i] * in[a];
        first = 0;
      }
    out[i] = acc;
  }
}

/* v[xi * vs + lane] = (B^T d B)[xi] of the 7x7 tile d (row i, column j at
 * d + i * rs + j * L): the columns first (B^T d), then the rows. */
static void input_tile(const float *d, int64_t rs, float *v, int64_t vs) {
  v16 t[7][7], in[7], out[7]; /* t[b][i] = (B^T d)[i][b] */
  for (int b = 0; b < 7; ++b) {
    for (int a = 0; a < 7; ++a) in[a] = LD(d + a * rs + b * L);
    apply_bt(in, t[b]);
  }
  for (int i = 0; i < 7; ++i) {
    for (int b = 0; b < 7; ++b) in[b] = t[b][i];
    apply_bt(in, out);
    for (int j = 0; j < 7; ++j) ST(v + (i * 7 + j) * vs, out[j]);
  }
}

/* out = A^T m A (3x3) of the 7x7 products m[xi * ms + lane]. */
static void output_tile(const float *m, int64_t ms, float out[3][3][L]) {
  v16 t[7][3], in[7], o3[3]; /* t[j][a] = (A^T m)[a][j] */
  for (int j = 0; j < 7; ++j) {
    for (int i = 0; i < 7; ++i) in[i] = LD(m + (i * 7 + j) * ms);
    apply_at(in, t[j]);
  }
  for (int a = 0; a < 3; ++a) {
    for (int j = 0; j < 7; ++j) in[j] = t[j][a];
    apply_at(in, o3);
    for (int b = 0; b < 3; ++b) ST(out[a][b], o3[b]);
  }
}

/* w[xi * ws + lane] = (A dY A^T)[xi] of the 3x3 block dY (row a, column b at
 * d + a * rs + b * L): the gradient of the tile's products. */
static void dy_tile(const float *d, int64_t rs, float *w, int64_t ws) {
  v16 t[3][7], in[7], out[7]; /* t[b][i] = (A dY)[i][b] */
  for (int b = 0; b < 3; ++b) {
    for (int a = 0; a < 3; ++a) in[a] = LD(d + a * rs + b * L);
    apply_a(in, t[b]);
  }
  for (int i = 0; i < 7; ++i) {
    for (int b = 0; b < 3; ++b) in[b] = t[b][i];
    apply_a(in, out);
    for (int j = 0; j < 7; ++j) ST(w + (i * 7 + j) * ws, out[j]);
  }
}

/* dst (7x7 at dst + a * rs + b * L) += B z B^T of z[xi * zs + lane]: a tile's
 * input gradient added where the tile lies. */
static void dx_tile(const float *z, int64_t zs, float *dst, int64_t rs) {
  v16 t[7][7], in[7], out[7]; /* t[j][a] = (B z)[a][j] */
  for (int j = 0; j < 7; ++j) {
    for (int i = 0; i < 7; ++i) in[i] = LD(z + (i * 7 + j) * zs);
    apply_b(in, t[j]);
  }
  for (int a = 0; a < 7; ++a) {
    for (int j = 0; j < 7; ++j) in[j] = t[j][a];
    apply_b(in, out);
    for (int b = 0; b < 7; ++b) {
      float *p = dst + a * rs + b * L;
      ST(p, LD(p) + out[b]);
    }
  }
}

/* U[xi][o][c] = (G g G^T)[xi] of every filter g = w[o, c] (5x5). A
 * worksharing loop of a parallel region. */
static void filter_transform(const w5 *q, const float *w, float *U) {
  const int64_t pairs = (int64_t)q->O * q->C, us = pairs;
#pragma omp for schedule(static)
  for (int64_t oc = 0; oc < pairs; ++oc) {
    const float *g = w + oc * 25;
    float t[7][5];
    for (int i = 0; i < 7; ++i)
      for (int b = 0; b < 5; ++b) {
        float acc = 0.0f;
        for (int a = 0; a < 5; ++a)
          if (G[i][a] != 0.0f) acc += G[i][a] * g[a * 5 + b];
        t[i][b] = acc;
      }
    for (int i = 0; i < 7; ++i)
      for (int j = 0; j < 7; ++j) {
        float acc = 0.0f;
        for (int b = 0; b < 5; ++b)
          if (G[j][b] != 0.0f) acc += t[i][b] * G[j][b];
        U[(i * 7 + j) * us + oc] = acc;
      }
  }
}

/* dw (5x5) = G^T u G of the 49 sums u. */
static void filter_gradient(const float u[XI], float *dw) {
  float t[5][7];
  for (int a = 0; a < 5; ++a)
    for (int j = 0; j < 7; ++j) {
      float acc = 0.0f;
      for (int i = 0; i < 7; ++i)
        if (G[i][a] != 0.0f) acc += G[i][a] * u[i * 7 + j];
      t[a][j] = acc;
    }
  for (int a = 0; a < 5; ++a)
    for (int b = 0; b < 5; ++b) {
      float acc = 0.0f;
      for (int j = 0; j < 7; ++j)
        if (G[j][b] != 0.0f) acc += t[a][j] * G[j][b];
      dw[a * 5 + b] = acc;
    }
}

/* ---- the chunks' planes ----------------------------------------------------- */

/* P (or DXT's shape): a chunk's cnt samples of src (C, H, W each) into the
 * lanes, at (i + pad, j + pad); the border and, for a short chunk, the lanes
 * past cnt are zero (the caller zeroes the plane first then). */
static void to_lanes(const w5 *q, const float *src, int64_t cnt, float *P) {
  const int64_t hw = (int64_t)q->H * q->W, in_sz = q->C * hw;
  for (int64_t s = 0; s < cnt; ++s)
    for (int c = 0; c < q->C; ++c)
      for (int i = 0; i < q->H; ++i) {
        const float *row = src + s * in_sz + c * hw + (int64_t)i * q->W;
        float *dst = P + ((c * q->hp + i + q->pad) * q->wp + q->pad) * L + s;
        for (int j = 0; j < q->W; ++j) dst[(int64_t)j * L] = row[j];
      }
}

/* DYT: a chunk's dy into the lanes (zero past the output's edge: the caller
 * zeroes the plane once, and for a short chunk). */
static void dy_to_lanes(const w5 *q, const float *dy, int64_t cnt, float *D) {
  const int64_t P = (int64_t)q->OH * q->OW, out_sz = q->O * P;
  for (int64_t s = 0; s < cnt; ++s)
    for (int o = 0; o < q->O; ++o)
      for (int i = 0; i < q->OH; ++i) {
        const float *row = dy + s * out_sz + o * P + (int64_t)i * q->OW;
        float *dst = D + ((o * q->ohp + i) * q->owp) * L + s;
        for (int j = 0; j < q->OW; ++j) dst[(int64_t)j * L] = row[j];
      }
}

/* chunk k's first sample and count */
static void chunk(int64_t N, int64_t k, int64_t *n0, int64_t *cnt) {
  *n0 = k * L;
  *cnt = N - *n0 < L ? N - *n0 : L;
}

/* ---- forward ------------------------------------------------------------- */

dp_status dp_wino5_forward(const dp_conv_geom *g, int64_t N, const float *x, const float *w, const float *b, float *y,
                           int nthreads, float *scratch) {
  if (N <= 0) return DP_OK;
  const w5 q = w5_make(g, N, nthreads);
  float *U = scratch;
  int32_t *cidx = (int32_t *)(void *)(U + r16((int64_t)XI * q.O * q.C));
  float *per = scratch + shared_floats(&q, DP_WINO5_FORWARD);
  for (int c = 0; c < q.C; ++c) cidx[c] = c;
  const int64_t in_sz = (int64_t)q.C * q.H * q.W, P = (int64_t)q.OH * q.OW, out_sz = (int64_t)q.O * P;
  const int64_t us = (int64_t)q.O * q.C, rs = q.wp * L;
#pragma omp parallel num_threads(q.nt)
  {
    filter_transform(&q, w, U); /* ends in a barrier */
    const int th = omp_get_thread_num();
    float *Pl = per + th * thread_floats(&q, DP_WINO5_FORWARD);
    float *V = Pl + p_floats(&q), *M = V + r16((int64_t)XI * q.C * L);
    memset(Pl, 0, sizeof(float) * (size_t)p_floats(&q));
    for (int64_t k = q.nch * th / q.nt; k < q.nch * (th + 1) / q.nt; ++k) {
      int64_t n0, cnt;
      chunk(N, k, &n0, &cnt);
      if (cnt < L) memset(Pl, 0, sizeof(float) * (size_t)p_floats(&q));
      to_lanes(&q, x + n0 * in_sz, cnt, Pl);
      for (int ti = 0; ti < q.th; ++ti)
        for (int tj = 0; tj < q.tw; ++tj) {
          for (int c = 0; c < q.C; ++c)
            input_tile(Pl + ((c * q.hp + 3 * ti) * q.wp + 3 * tj) * L, rs, V + c * L, (int64_t)q.C * L);
          for (int xi = 0; xi < XI; ++xi)
            for (int o0 = 0; o0 < q.O; o0 += DP_MK_ROWS) {
              const float *xb[DP_MK_ROWS];
              for (int r = 0; r < DP_MK_ROWS; ++r) xb[r] = U + xi * us + (int64_t)(o0 + r < q.O ? o0 + r : q.O - 1) * q.C;
              dp_mk_16(q.C, xb, cidx, V + (int64_t)xi * q.C * L, M + ((int64_t)xi * q.o6 + o0) * L);
            }
          const int i0 = 3 * ti, j0 = 3 * tj;
          for (int o = 0; o < q.O; ++o) {
            float out[3][3][L];
            output_tile(M + (int64_t)o * L, q.o6 * L, out);
            const float bias = b ? b[o] : 0.0f;
            for (int64_t s = 0; s < cnt; ++s) {
              float *yo = y + (n0 + s) * out_sz + o * P;
              for (int a = 0; a < 3 && i0 + a < q.OH; ++a)
                for (int c = 0; c < 3 && j0 + c < q.OW; ++c) yo[(int64_t)(i0 + a) * q.OW + j0 + c] = out[a][c][s] + bias;
            }
          }
        }
    }
  }
  return DP_OK;
}

/* ---- backward: dx, dw and db -------------------------------------------- */

dp_status dp_wino5_backward(const dp_conv_geom *g, int64_t N, const float *x, const float *w, const float *dy,
                            float *dx, float *dw, float *db, int nthreads, float *scratch) {
  const int64_t pairs = (int64_t)g->O * g->C, P = (int64_t)g->OH * g->OW;
  if (N <= 0) {
    memset(dw, 0, sizeof(float) * (size_t)pairs * 25);
    if (db) memset(db, 0, sizeof(float) * (size_t)g->O);
    return DP_OK;
  }
  const w5 q = w5_make(g, N, nthreads);
  const int64_t TB = dwb_tiles(&q), K = TB * L, pw = q.np * 16;
  float *U = scratch;
  int32_t *oidx = (int32_t *)(void *)(U + r16((int64_t)XI * q.O * q.C));
  int32_t *kidx = oidx + r16(q.O);
  float *per = scratch + shared_floats(&q, DP_WINO5_BACKWARD);
  for (int o = 0; o < q.O; ++o) oidx[o] = o * q.C;
  for (int64_t t = 0; t < TB; ++t)
    for (int s = 0; s < L; ++s) kidx[t * L + s] = (int32_t)(t * q.O * L + s);
  const int64_t hw = (int64_t)q.H * q.W, in_sz = q.C * hw, out_sz = (int64_t)q.O * P;
  const int64_t us = (int64_t)q.O * q.C, tf = thread_floats(&q, DP_WINO5_BACKWARD);
  const int64_t vw_sz = r16((int64_t)XI * q.np * K * 16), wb_sz = r16((int64_t)XI * TB * q.O * L);
  const int64_t acc_sz = (int64_t)XI * q.O * pw, planes = p_floats(&q) + dyt_floats(&q);
  const int64_t acc_at = planes + vw_sz + wb_sz;
#pragma omp parallel num_threads(q.nt)
  {
    if (dx) filter_transform(&q, w, U); /* ends in a barrier */
    const int th = omp_get_thread_num();
    float *Pl = per + th * tf, *D = Pl + p_floats(&q), *Vw = D + dyt_floats(&q), *Wb = Vw + vw_sz;
    float *acc = Pl + acc_at, *v = acc + r16(acc_sz), *tile = v + r16(XI * L);
    float *Z = tile + 16 * DP_MK_ROWS, *DX = Z + r16((int64_t)XI * q.c6 * L);
    memset(Pl, 0, sizeof(float) * (size_t)(planes + vw_sz)); /* borders; Vw's lanes past C stay 0 */
    memset(acc, 0, sizeof(float) * (size_t)acc_sz);
    for (int64_t k = q.nch * th / q.nt; k < q.nch * (th + 1) / q.nt; ++k) {
      int64_t n0, cnt;
      chunk(N, k, &n0, &cnt);
      if (cnt < L) memset(Pl, 0, sizeof(float) * (size_t)planes); /* the lanes past cnt zero */
      to_lanes(&q, x + n0 * in_sz, cnt, Pl);
      dy_to_lanes(&q, dy + n0 * out_sz, cnt, D);
      if (dx) memset(DX, 0, sizeof(float) * (size_t)p_floats(&q));
      for (int64_t t0 = 0; t0 < q.T; t0 += TB) {
        const int64_t tn = q.T - t0 < TB ? q.T - t0 : TB;
        for (int64_t t = 0; t < tn; ++t) {
          const int ti = (int)((t0 + t) / q.tw), tj = (int)((t0 + t) % q.tw);
          /* Wb[xi][t][o][lane] = A dY A^T */
          for (int o = 0; o < q.O; ++o)
            dy_tile(D + ((o * q.ohp + 3 * ti) * q.owp + 3 * tj) * L, q.owp * L, Wb + (t * q.O + o) * L, TB * q.O * L);
          /* B^T d B with the channels into the lanes: Vw[xi][c/16][t*L + s][c%16] */
          for (int c = 0; c < q.C; ++c) {
            input_tile(Pl + ((c * q.hp + 3 * ti) * q.wp + 3 * tj) * L, q.wp * L, v, L);
            for (int xi = 0; xi < XI; ++xi) {
              float *dst = Vw + ((xi * q.np + c / 16) * K + t * L) * 16 + c % 16;
              for (int s = 0; s < L; ++s) dst[s * 16] = v[xi * L + s];
            }
          }
          if (!dx) continue;
          /* Z[xi][c][lane] = sum over o of U_xi[o][c] Wb[xi][t][o][lane]; dx += B Z B^T where the tile lies */
          for (int xi = 0; xi < XI; ++xi)
            for (int c0 = 0; c0 < q.C; c0 += DP_MK_ROWS) {
              const float *xb[DP_MK_ROWS];
              for (int r = 0; r < DP_MK_ROWS; ++r) xb[r] = U + xi * us + (c0 + r < q.C ? c0 + r : q.C - 1);
              dp_mk_16(q.O, xb, oidx, Wb + ((int64_t)xi * TB + t) * q.O * L, Z + ((int64_t)xi * q.c6 + c0) * L);
            }
          for (int c = 0; c < q.C; ++c)
            dx_tile(Z + (int64_t)c * L, q.c6 * L, DX + ((c * q.hp + 3 * ti) * q.wp + 3 * tj) * L, q.wp * L);
        }
        /* dU_xi[o][c] += sum over the block's tiles and lanes of Wb_xi[t][o][s] Vw_xi[t][s][c] */
        for (int xi = 0; xi < XI; ++xi)
          for (int o0 = 0; o0 < q.O; o0 += DP_MK_ROWS) {
            const float *xb[DP_MK_ROWS];
            for (int r = 0; r < DP_MK_ROWS; ++r)
              xb[r] = Wb + (int64_t)xi * TB * q.O * L + (int64_t)(o0 + r < q.O ? o0 + r : q.O - 1) * L;
            const int rows = q.O - o0 < DP_MK_ROWS ? q.O - o0 : DP_MK_ROWS;
            for (int64_t p = 0; p < q.np; ++p) {
              const int64_t width = q.C - 16 * p > 8 ? 16 : 8;
              dp_mk(width, tn * L, xb, kidx, Vw + (xi * q.np + p) * K * 16, tile); /* a short block: its tiles */
              for (int r = 0; r < rows; ++r) {
                float *a = acc + ((int64_t)xi * q.O + o0 + r) * pw + p * 16;
                for (int64_t j = 0; j < width; ++j) a[j] += tile[r * 16 + j];
              }
            }
          }
      }
      if (dx)
        for (int64_t s = 0; s < cnt; ++s)
          for (int c = 0; c < q.C; ++c)
            for (int i = 0; i < q.H; ++i) {
              float *row = dx + (n0 + s) * in_sz + c * hw + (int64_t)i * q.W;
              const float *src = DX + ((c * q.hp + i + q.pad) * q.wp + q.pad) * L + s;
              for (int j = 0; j < q.W; ++j) row[j] = src[(int64_t)j * L];
            }
    }
  }
  /* dU = the threads' partial sums in thread order; dw = G^T dU G */
#pragma omp parallel for num_threads(q.nt) schedule(static)
  for (int64_t oc = 0; oc < pairs; ++oc) {
    const int64_t o = oc / q.C, c = oc % q.C;
    float u[XI];
    for (int xi = 0; xi < XI; ++xi) {
      float s = 0.0f;
      for (int th = 0; th < q.nt; ++th) s += per[th * tf + acc_at + ((int64_t)xi * q.O + o) * pw + c];
      u[xi] = s;
    }
    filter_gradient(u, dw + oc * 25);
  }
  if (db) {
#pragma omp parallel for num_threads(q.nt) schedule(static)
    for (int o = 0; o < q.O; ++o) {
      double sum = 0.0;
      for (int64_t n = 0; n < N; ++n) {
        const float *r = dy + n * out_sz + o * P;
        for (int64_t i = 0; i < P; ++i) sum += r[i];
      }
      db[o] = (float)sum;
    }
  }
  return DP_OK;
}
