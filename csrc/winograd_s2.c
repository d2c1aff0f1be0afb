/* winograd_s2.c — Winograd for 3x3 stride-2 pad-1 convolutions: the
 * transforms of winograd_s2.h, 16 samples in the vector lanes, the products
 * as GEMMs over blocks of tiles.
 *
 * Layouts (floats; L = 16 lanes, one sample each; a group of gch chunks of
 * 16 samples at a time, so that the lane planes stay within
 * S2_PLANES_FLOATS):
 *   U   (16, O, C)              the filter transform's 16 distinct matrices
 *   P   (gch, C, hp, wp, L)     the input, (i, j) at (i + 1, j + 1), zero
 *                               border; hp = 4*th + 1, wp = 4*tw + 1
 *   Y/D (gch, O, 2*th, 2*tw, L) the output (forward) / dy, zero past its edge (backward)
 *   DX  (gch, C, hp, wp, L)     dx, bordered as P, the tiles added in
 *   V   (25, C, cols)           a block's B^T d B: column tile*L + lane
 *   M   (25, ob, cols)          forward: a round of ob output channels' products
 *   dM  (9, O, cols)            backward: A dY A^T's 9 distinct matrices (dm_of)
 *   dV  (25, C, cols)           backward: U^T dM
 *   dU  (16, O, C)              backward: the filter transform's gradient, and
 *                               (each thread on its own chunks) a partial
 *                               dU per group of chunks after it
 * The forward pass's V and M, and the backward pass's own-chunk V, dM, dV,
 * are each thread's; the shared backward block's are one for all.
 */
#include <omp.h>
#include <string.h>

#include "cpu_caches.h"
#include "lanes.h"
#include "small_gemm.h"
#include "winograd.h" /* dp_winograd_bias_grad */
#include "winograd_s2.h"

#define DP_S2_DEFAULT 1
/* The sizes below may be set by the build: tests/c/winograd_s2_threads.c sets
 * them small, so that a few samples cross every boundary. */
/* fewer channels than this keep im2col + GEMM (the transforms' share grows
 * as the products shrink) */
#define DP_S2_MIN_CHANNELS 32
/* a block of tiles: its V, M (and dV) at most this many floats (16 MiB) */
#ifndef S2_BLOCK_FLOATS
#define S2_BLOCK_FLOATS ((int64_t)1 << 22)
#endif
/* forward: a thread's block of tiles, its V at most S2_V_FLOATS (half the L2),
 * or, where U is over S2_U_FLOATS, at most S2_V_MAX_FLOATS; the products
 * a round of ob output channels at a time, at most S2_M_FLOATS */
#ifndef S2_V_FLOATS
#define S2_V_FLOATS (dp_cpu_l2_bytes() / 2 / (int64_t)sizeof(float)) /* half a core's L2 */
#endif
#ifndef S2_V_MAX_FLOATS
#define S2_V_MAX_FLOATS ((int64_t)1 << 20)
#endif
#ifndef S2_U_FLOATS
#define S2_U_FLOATS (dp_cpu_l2_bytes() / (int64_t)sizeof(float))
#endif
#ifndef S2_M_FLOATS
#define S2_M_FLOATS (dp_cpu_l2_bytes() / 4 / (int64_t)sizeof(float))
#endif
/* backward, where U is at most S2_PRIVATE_U_FLOATS (and there are 2 chunks
 * or more): each thread takes whole chunks, its own transforms, products and
 * dx, dw's partial sums in up to S2_DW_GROUPS groups of chunks (added in
 * group order at the end); a block of tiles at a time, its V, dM and dV at
 * most S2_PRIVATE_FLOATS */
#ifndef S2_PRIVATE_U_FLOATS
#define S2_PRIVATE_U_FLOATS ((int64_t)1 << 18)
#endif
#ifndef S2_PRIVATE_FLOATS
#define S2_PRIVATE_FLOATS ((int64_t)1 << 19)
#endif
#define S2_DW_GROUPS 8
/* a group of chunks: its lane planes at most this many floats (64 MiB) */
#ifndef S2_PLANES_FLOATS
#define S2_PLANES_FLOATS ((int64_t)1 << 24)
#endif
#define L 16
#define XI 25

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4), may_alias));
#define LD(p) (*(const v16u *)(const void *)(p))
#define ST(p, v) (*(v16u *)(void *)(p) = (v))

static int64_t r16(int64_t n) { return (n + 15) & ~(int64_t)15; }

typedef struct s2_geom {
  int C, O, H, W, OH, OW, th, tw;
  int64_t T;       /* tiles per sample */
  int64_t hp, wp;  /* P's and DX's planes */
  int64_t yh, yw;  /* Y's and D's planes */
  int64_t nch;     /* chunks of L samples in the batch */
  int64_t gch;     /* chunks per group */
  int64_t bt;      /* tiles per block (at most) */
  int64_t cols;    /* columns of a block: bt * L */
  int64_t ob;      /* forward: output channels per round of products */
  int nt;
} s2_geom;

static int64_t plane_floats(const s2_geom *q, int pass) {
  const int64_t p = (int64_t)q->C * q->hp * q->wp * L, y = (int64_t)q->O * q->yh * q->yw * L;
  return pass == DP_S2_FORWARD ? p + y : 2 * p + y;
}

static s2_geom s2_make(const dp_conv_geom *g, int64_t N, int nthreads, int pass) {
  s2_geom q;
  q.C = g->C;
  q.O = g->O;
  q.H = g->H;
  q.W = g->W;
  q.OH = g->OH;
  q.OW = g->OW;
  q.th = (g->OH + 1) / 2;
  q.tw = (g->OW + 1) / 2;
  q.T = (int64_t)q.th * q.tw;
  q.hp = 4 * (int64_t)q.th + 1;
  q.wp = 4 * (int64_t)q.tw + 1;
  q.yh = 2 * (int64_t)q.th;
  q.yw = 2 * (int64_t)q.tw;
  q.nch = N > 0 ? (N + L - 1) / L : 0;
  q.gch = S2_PLANES_FLOATS / plane_floats(&q, pass);
  if (q.gch < 1) q.gch = 1;
  if (q.gch > q.nch) q.gch = q.nch > 0 ? q.nch : 1;
  q.nt = nthreads < 1 ? 1 : nthreads;
  const int64_t tiles = q.gch * q.T;
  int64_t bt;
  if (pass == DP_S2_FORWARD) {
    /* each thread its share of the tiles, in blocks whose V stays in the
     * L2 cache (S2_V_FLOATS), or all of its share at once where U is
     * large (read again for every block) */
    const int64_t share = (tiles + q.nt - 1) / q.nt, per_tile = (int64_t)XI * q.C * L;
    bt = S2_V_FLOATS / per_tile;
    if (16 * (int64_t)q.O * q.C > S2_U_FLOATS) bt = share < S2_V_MAX_FLOATS / per_tile ? share : S2_V_MAX_FLOATS / per_tile;
    if (bt > share) bt = share;
  } else {
    /* the tiles of a group in blocks, shared by the threads */
    bt = S2_BLOCK_FLOATS / ((int64_t)XI * (2 * (int64_t)q.C + q.O) * L);
    if (bt > tiles) bt = tiles;
  }
  if (bt < 1) bt = 1;
  const int64_t nblk = (tiles + bt - 1) / bt; /* as even as they go */
  q.bt = (tiles + nblk - 1) / nblk;
  q.cols = q.bt * L;
  q.ob = S2_M_FLOATS / ((int64_t)XI * q.cols) / 8 * 8;
  if (q.ob < 8) q.ob = 8;
  if (q.ob > q.O) q.ob = q.O;
  return q;
}

dp_status dp_s2_takes(const dp_conv_geom *g, int64_t N, int *takes) {
  *takes = 0;
  int on, s2;
  DP_TRY(dp_env_switch("DPCORE_WINOGRAD", 1, &on));
  DP_TRY(dp_env_switch("DPCORE_WINOGRAD_S2", DP_S2_DEFAULT, &s2));
  if (!on || !s2 || g->KH != 3 || g->KW != 3 || g->stride != 2 || g->pad != 1) return DP_OK;
  if (g->C < DP_S2_MIN_CHANNELS || g->O < DP_S2_MIN_CHANNELS || g->H < 1 || g->W < 1) return DP_OK;
  if (g->OH != (g->H - 1) / 2 + 1 || g->OW != (g->W - 1) / 2 + 1) return DP_OK;
  /* its multiplies (25 per 2x2 block, the blocks past the plane's edge and
   * the lanes past the batch included) at most 0.8 of the direct form's */
  const int64_t th = (g->OH + 1) / 2, tw = (g->OW + 1) / 2, lanes = (N + L - 1) / L * L;
  *takes = N >= L && 5 * 25 * 4 * th * tw * lanes <= 4 * 36 * (int64_t)g->OH * g->OW * N;
  return DP_OK;
}

/* per region, floats (each rounded to 16) */
typedef struct s2_sizes {
  int64_t u, planes_p, planes_y, v, m, dv, du, pack;
} s2_sizes;

static s2_sizes s2_sizes_of(const s2_geom *q, int pass) {
  s2_sizes z;
  z.u = r16(16 * (int64_t)q->O * q->C);
  z.planes_p = r16(q->gch * q->C * q->hp * q->wp * L);
  z.planes_y = r16(q->gch * q->O * q->yh * q->yw * L);
  /* forward: each thread's V and M (ob rows); backward: the block's V and dM (9 distinct matrices) */
  const int64_t per = pass == DP_S2_FORWARD ? q->nt : 1;
  z.v = per * r16((int64_t)XI * q->C * q->cols);
  z.m = per * r16(pass == DP_S2_FORWARD ? (int64_t)XI * q->ob * q->cols : (int64_t)9 * q->O * q->cols);
  z.dv = pass == DP_S2_BACKWARD ? z.v : 0;
  z.du = pass == DP_S2_BACKWARD ? z.u : 0;
  z.pack = pass == DP_S2_BACKWARD ? r16(DP_SMALL_GEMM_PACK_FLOATS) * q->nt : 0;
  return z;
}

/* the backward pass with each thread on its own chunks (S2_PRIVATE_U_FLOATS) */
typedef struct s2_private {
  int on;
  int64_t G;          /* dw's groups of chunks */
  int64_t bt, cols;   /* tiles a block, its columns */
  int64_t v, m, dv;   /* a thread's V (25, C, cols), dM (9, O, cols), dV (25, C, cols) */
  int64_t per_thread; /* those and its packing buffer */
} s2_private;

static s2_private private_make(const s2_geom *q) {
  s2_private v;
  memset(&v, 0, sizeof v);
  v.on = 16 * (int64_t)q->O * q->C <= S2_PRIVATE_U_FLOATS && q->nch >= 2;
  v.G = q->nch < S2_DW_GROUPS ? q->nch : S2_DW_GROUPS;
  v.bt = S2_PRIVATE_FLOATS / ((2 * XI * (int64_t)q->C + 9 * (int64_t)q->O) * L); /* V, dV, dM a tile */
  if (v.bt > q->T) v.bt = q->T;
  if (v.bt < 1) v.bt = 1;
  v.cols = v.bt * L;
  v.v = r16((int64_t)XI * q->C * v.cols);
  v.m = r16((int64_t)9 * q->O * v.cols);
  v.dv = v.v;
  v.per_thread = v.v + v.m + v.dv + r16(DP_SMALL_GEMM_PACK_FLOATS);
  return v;
}

size_t dp_s2_scratch_floats(const dp_conv_geom *g, int64_t N, int nthreads, int pass) {
  const s2_geom q = s2_make(g, N, nthreads, pass);
  const s2_sizes z = s2_sizes_of(&q, pass);
  /* backward: P, D and DX (two P-sized planes) */
  const int64_t planes = pass == DP_S2_FORWARD ? z.planes_p + z.planes_y : 2 * z.planes_p + z.planes_y;
  int64_t rest = z.v + z.m + z.dv + z.du + z.pack;
  if (pass == DP_S2_BACKWARD) { /* or dU, the groups' partial dU and the threads' own floats */
    const s2_private v = private_make(&q);
    if (v.on && rest < (1 + v.G) * z.du + q.nt * v.per_thread) rest = (1 + v.G) * z.du + q.nt * v.per_thread;
  }
  return (size_t)(z.u + planes + rest);
}

/* ---- the 16 matrices of U and the 25 products that share them ------------ */

/* the products xi = 5*i + j of U's matrix k = 4*a + b, in order (1, 2 or 4
 * of them): those with i = a and j = b, rows and columns 3 and 4 both
 * mapping to 3 (G's rows 3 and 4 are equal) */
static int members(int k, int xi[4]) {
  const int a = k / 4, b = k % 4;
  int n = 0;
  for (int i = a; i <= (a == 3 ? 4 : a); ++i)
    for (int j = b; j <= (b == 3 ? 4 : b); ++j) xi[n++] = 5 * i + j;
  return n;
}

/* dw's matrices dealt to the threads in order, by their products (25 in all):
 * matrix k to the thread whose share holds the middle of its products */
static int du_owner(int k, int nt) {
  int before = 0, xi[4];
  for (int j = 0; j < k; ++j) before += members(j, xi);
  const int n = members(k, xi);
  return (int)((2 * before + n) * (int64_t)nt / (2 * XI));
}

/* rows [lo, hi) of thread t of nt over n rows, cut at multiples of 8 (the kernel's rows) */
static void row_share(int n, int t, int nt, int *lo, int *hi) {
  const int64_t units = (n + 7) / 8;
  const int64_t a = 8 * (units * t / nt), b = 8 * (units * (t + 1) / nt);
  *lo = (int)(a < n ? a : n);
  *hi = (int)(b < n ? b : n);
}

/* ---- the lane planes ------------------------------------------------------- */

/* zero a plane (ph x pw pixels) but for its pixels (i + off, j + off), i < h, j < w */
static void zero_border(float *plane, int64_t ph, int64_t pw, int off, int h, int w) {
  const size_t px = sizeof(float) * L;
  memset(plane, 0, px * (size_t)(off * pw));
  for (int64_t i = off; i < off + h; ++i) {
    float *row = plane + i * pw * L;
    memset(row, 0, px * (size_t)off);
    memset(row + (off + w) * L, 0, px * (size_t)(pw - off - w));
  }
  memset(plane + (off + h) * pw * L, 0, px * (size_t)((ph - off - h) * pw));
}

/* Plane c of chunk gc of src (N samples of np planes of h x w, a sample
 * every np*h*w floats) into a lane plane of ph x pw pixels, its (i, j) at
 * (i + off, j + off), the rest zero. */
static void plane_to_lanes(const float *src, int64_t N, int64_t gc, int np, int c, int h, int w, float *plane,
                           int64_t ph, int64_t pw, int off) {
  const int64_t hw = (int64_t)h * w, n0 = gc * L, cnt = N - n0 < L ? N - n0 : L;
  zero_border(plane, ph, pw, off, h, w);
  dp_to_lanes(src + n0 * np * hw + c * hw, np * hw, cnt, h, w, plane, pw, off);
}

/* plane_to_lanes's inverse: the chunk's samples of plane c of dst from the
 * lane plane's pixels (i + off, j + off), i < h, j < w. */
static void plane_from_lanes(const float *plane, int64_t pw, int off, int64_t N, int64_t gc, int np, int c, int h,
                             int w, float *dst) {
  const int64_t hw = (int64_t)h * w, n0 = gc * L, cnt = N - n0 < L ? N - n0 : L;
  dp_from_lanes(plane, pw, off, h, w, dst + n0 * np * hw + c * hw, np * hw, cnt);
}

/* every plane of the group's chunks [c0, c0 + gn): a worksharing loop */
static void group_to_lanes(const float *src, int64_t N, int64_t c0, int64_t gn, int np, int h, int w, float *planes,
                           int64_t ph, int64_t pw, int off) {
#pragma omp for schedule(static)
  for (int64_t k = 0; k < gn * np; ++k)
    plane_to_lanes(src, N, c0 + k / np, np, (int)(k % np), h, w, planes + k * ph * pw * L, ph, pw, off);
}

static void group_from_lanes(const float *planes, int64_t ph, int64_t pw, int off, int64_t N, int64_t c0, int64_t gn,
                             int np, int h, int w, float *dst) {
#pragma omp for schedule(static)
  for (int64_t k = 0; k < gn * np; ++k)
    plane_from_lanes(planes + k * ph * pw * L, pw, off, N, c0 + k / np, np, (int)(k % np), h, w, dst);
}

/* ---- the transforms, 16 lanes at a time --------------------------------- */

/* B^T along one axis */
static inline void bt5(const v16 in[5], v16 out[5]) {
  out[0] = in[0] - in[2];
  out[1] = in[2];
  out[2] = in[4] - in[2];
  out[3] = in[1];
  out[4] = in[3];
}

/* B along one axis (B^T's transpose) */
static inline void b5(const v16 in[5], v16 out[5]) {
  out[0] = in[0];
  out[1] = in[3];
  out[2] = (in[1] - in[0]) - in[2];
  out[3] = in[4];
  out[4] = in[2];
}

/* A^T along one axis */
static inline void at5(const v16 in[5], v16 out[2]) {
  out[0] = (in[0] + in[1]) + in[3];
  out[1] = (in[1] + in[2]) + in[4];
}

/* A along one axis, its 3 distinct entries: A dy = (dy0, dy0 + dy1, dy1, dy0, dy1) */
static inline void a3(const v16 in[2], v16 out[3]) {
  out[0] = in[0];
  out[1] = in[0] + in[1];
  out[2] = in[1];
}

/* A dy's entry i is its distinct entry dy_row(i) */
static int dy_row(int i) { return i < 3 ? i : i == 3 ? 0 : 2; }

/* dM's matrix (of 9) holding product xi's (A dY A^T)[xi] */
static int64_t dm_of(int xi) { return 3 * dy_row(xi / 5) + dy_row(xi % 5); }

/* v[xi * vs] = (B^T d B)[xi] of the 5x5 tile d (row a, column b at d + a * rs + b * L) */
static void input_tile(const float *d, int64_t rs, float *v, int64_t vs) {
  v16 t[5][5], in[5], out[5]; /* t[b][i] = (B^T d)[i][b] */
  for (int b = 0; b < 5; ++b) {
    for (int a = 0; a < 5; ++a) in[a] = LD(d + a * rs + b * L);
    bt5(in, t[b]);
  }
  for (int i = 0; i < 5; ++i) {
    for (int b = 0; b < 5; ++b) in[b] = t[b][i];
    bt5(in, out);
    for (int j = 0; j < 5; ++j) ST(v + (i * 5 + j) * vs, out[j]);
  }
}

/* the 2x2 block at y (row a, column b at y + a * rs + b * L) = A^T m A + bias of m[xi * ms] */
static void output_tile(const float *m, int64_t ms, float bias, float *y, int64_t rs) {
  v16 t[5][2], in[5], o[2]; /* t[j][a] = (A^T m)[a][j] */
  for (int j = 0; j < 5; ++j) {
    for (int i = 0; i < 5; ++i) in[i] = LD(m + (i * 5 + j) * ms);
    at5(in, t[j]);
  }
  for (int a = 0; a < 2; ++a) {
    for (int j = 0; j < 5; ++j) in[j] = t[j][a];
    at5(in, o);
    ST(y + a * rs, o[0] + bias);
    ST(y + a * rs + L, o[1] + bias);
  }
}

/* w[(3*i + j) * ws] = the 9 distinct entries (i, j < 3) of A dY A^T, dY the
 * 2x2 block (row a, column b at d + a * rs + b * L) */
static void dy_tile(const float *d, int64_t rs, float *w, int64_t ws) {
  v16 t[2][3], in[2], out[3]; /* t[b][i] = (A dY)[i][b] */
  for (int b = 0; b < 2; ++b) {
    in[0] = LD(d + b * L);
    in[1] = LD(d + rs + b * L);
    a3(in, t[b]);
  }
  for (int i = 0; i < 3; ++i) {
    in[0] = t[0][i];
    in[1] = t[1][i];
    a3(in, out);
    for (int j = 0; j < 3; ++j) ST(w + (i * 3 + j) * ws, out[j]);
  }
}

/* dst (5x5 at dst + a * rs + b * L) += B z B^T of z[xi * zs] */
static void dx_tile(const float *z, int64_t zs, float *dst, int64_t rs) {
  v16 t[5][5], in[5], out[5]; /* t[j][a] = (B z)[a][j] */
  for (int j = 0; j < 5; ++j) {
    for (int i = 0; i < 5; ++i) in[i] = LD(z + (i * 5 + j) * zs);
    b5(in, t[j]);
  }
  for (int a = 0; a < 5; ++a) {
    for (int j = 0; j < 5; ++j) in[j] = t[j][a];
    b5(in, out);
    for (int b = 0; b < 5; ++b) {
      float *p = dst + a * rs + b * L;
      ST(p, LD(p) + out[b]);
    }
  }
}

/* G' (G's 4 distinct rows) along one axis: (g0, g0 + g2, g2, g1) */
static inline void g4(const v16 in[3], v16 out[4]) {
  out[0] = in[0];
  out[1] = in[0] + in[2];
  out[2] = in[2];
  out[3] = in[1];
}

/* G'^T along one axis: (u0 + u1, u3, u1 + u2) */
static inline void gt4(const v16 in[4], v16 out[3]) {
  out[0] = in[0] + in[1];
  out[1] = in[3];
  out[2] = in[1] + in[2];
}

/* g[k] lane l = tap k of the filter (p0 + l) of w (9 taps each), for l < n; 0 past n */
static void taps_to_lanes(const float *w, int64_t p0, int64_t n, v16 g[9]) {
#if defined(__AVX512F__)
  __m512 r[16], c[16];
  for (int l = 0; l < 16; ++l) r[l] = l < n ? _mm512_maskz_loadu_ps(0x1FF, w + (p0 + l) * 9) : _mm512_setzero_ps();
  dp_transpose16(r, c);
  for (int k = 0; k < 9; ++k) g[k] = c[k];
#else
  for (int k = 0; k < 9; ++k) {
    float lane[L];
    for (int l = 0; l < L; ++l) lane[l] = l < n ? w[(p0 + l) * 9 + k] : 0.0f;
    g[k] = LD(lane);
  }
#endif
}

/* dw[(p0 + l) * 9 + k] = g[k] lane l, for l < n */
static void taps_from_lanes(const v16 g[9], int64_t p0, int64_t n, float *dw) {
#if defined(__AVX512F__)
  __m512 c[16], r[16];
  for (int k = 0; k < 16; ++k) c[k] = k < 9 ? (__m512)g[k] : _mm512_setzero_ps();
  dp_transpose16(c, r);
  for (int l = 0; l < n; ++l) _mm512_mask_storeu_ps(dw + (p0 + l) * 9, 0x1FF, r[l]);
#else
  for (int k = 0; k < 9; ++k) {
    float lane[L];
    ST(lane, g[k]);
    for (int64_t l = 0; l < n; ++l) dw[(p0 + l) * 9 + k] = lane[l];
  }
#endif
}

/* U[k][o][c] = (G' g G'^T)[k] of every filter g = w[o, c], 16 (o, c) pairs
 * at a time, one per lane. A worksharing loop of a parallel region. */
static void filter_transform(const s2_geom *q, const float *w, float *U) {
#if defined(__AVX2__) && !defined(__AVX512F__)
  /* 8 pairs a block in AVX2 registers: the arithmetic below in its order
   * (the same bits; GCC copied the 16-lane vectors through the stack 16 bytes
   * at a time there, a tenth of the 7x7 -> 4x4 layer's forward pass) */
  {
    const int64_t pairs = (int64_t)q->O * q->C, blocks = (pairs + 7) / 8;
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const int64_t p0 = blk * 8, n = pairs - p0 < 8 ? pairs - p0 : 8;
      __m256 g[9];
      for (int l = 0; l < 8; ++l) g[l] = l < n ? _mm256_loadu_ps(w + (p0 + l) * 9) : _mm256_setzero_ps();
      dp_transpose8(g); /* taps 0-7 */
      float t8[8];
      for (int l = 0; l < 8; ++l) t8[l] = l < n ? w[(p0 + l) * 9 + 8] : 0.0f;
      g[8] = _mm256_loadu_ps(t8);
      __m256 t[3][4]; /* t[b] = g4 of column b: (g0b, g0b + g2b, g2b, g1b) */
      for (int b = 0; b < 3; ++b) {
        t[b][0] = g[b];
        t[b][1] = _mm256_add_ps(g[b], g[6 + b]);
        t[b][2] = g[6 + b];
        t[b][3] = g[3 + b];
      }
      const __m256i m = dp_lanes8_upto(n);
      for (int a = 0; a < 4; ++a) {
        const __m256 out[4] = {t[0][a], _mm256_add_ps(t[0][a], t[2][a]), t[2][a], t[1][a]};
        for (int b = 0; b < 4; ++b) _mm256_maskstore_ps(U + (a * 4 + b) * pairs + p0, m, out[b]);
      }
    }
    return;
  }
#endif
  const int64_t pairs = (int64_t)q->O * q->C, blocks = (pairs + L - 1) / L;
#pragma omp for schedule(static)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t p0 = blk * L, n = pairs - p0 < L ? pairs - p0 : L;
    v16 g[9];
    taps_to_lanes(w, p0, n, g);
    v16 t[3][4], in[4], out[4]; /* t[b][a] = (G' g)[a][b] */
    for (int b = 0; b < 3; ++b) {
      for (int a = 0; a < 3; ++a) in[a] = g[a * 3 + b];
      g4(in, t[b]);
    }
    for (int a = 0; a < 4; ++a) {
      for (int b = 0; b < 3; ++b) in[b] = t[b][a];
      g4(in, out);
      for (int b = 0; b < 4; ++b) {
        float *dst = U + (a * 4 + b) * pairs + p0;
        if (n == L) {
          ST(dst, out[b]);
        } else {
          float lane[L];
          ST(lane, out[b]);
          memcpy(dst, lane, sizeof(float) * (size_t)n);
        }
      }
    }
  }
}

/* dw = G'^T dU G', 16 (o, c) pairs at a time. A worksharing loop. */
static void filter_gradient(const s2_geom *q, const float *dU, float *dw) {
  const int64_t pairs = (int64_t)q->O * q->C, blocks = (pairs + L - 1) / L;
#pragma omp for schedule(static)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t p0 = blk * L, n = pairs - p0 < L ? pairs - p0 : L;
    v16 u[16];
    for (int k = 0; k < 16; ++k) {
      if (n == L) {
        u[k] = LD(dU + k * pairs + p0);
      } else {
        float lane[L] = {0};
        memcpy(lane, dU + k * pairs + p0, sizeof(float) * (size_t)n);
        u[k] = LD(lane);
      }
    }
    v16 t[4][3], in[4], out[3], g[9]; /* t[b][a] = (G'^T u)[a][b] */
    for (int b = 0; b < 4; ++b) {
      for (int a = 0; a < 4; ++a) in[a] = u[a * 4 + b];
      gt4(in, t[b]);
    }
    for (int a = 0; a < 3; ++a) {
      for (int b = 0; b < 4; ++b) in[b] = t[b][a];
      gt4(in, out);
      for (int b = 0; b < 3; ++b) g[a * 3 + b] = out[b];
    }
    taps_from_lanes(g, p0, n, dw);
  }
}

/* a block's tile (its place in the group's tiles) */
typedef struct tile_at {
  int64_t ch;  /* the group's chunk */
  int ti, tj;
} tile_at;

static tile_at tile_of(const s2_geom *q, int64_t gtile) {
  tile_at t;
  t.ch = gtile / q->T;
  const int64_t k = gtile % q->T;
  t.ti = (int)(k / q->tw);
  t.tj = (int)(k % q->tw);
  return t;
}

/* ---- the forward pass ------------------------------------------------------ */

/* one group: the chunks [c0, c0 + gn) of the batch (samples from c0 * L, N in all) */
static void forward_group(const s2_geom *q, const s2_sizes *z, int own, int64_t N, int64_t c0, int64_t gn,
                          const float *x, const float *b, float *y, float *scratch) {
  const float *U = scratch;
  float *P = scratch + z->u, *Y = P + z->planes_p, *V = Y + z->planes_y, *M = V + z->v;
  const int C = q->C, O = q->O;
  const int64_t pp = q->hp * q->wp * L, cols = q->cols, tiles = gn * q->T;
#pragma omp parallel num_threads(q->nt)
  {
    group_to_lanes(x, N, c0, gn, C, q->H, q->W, P, q->hp, q->wp, 1);
    /* thread t: the tiles [lo, hi), a block at a time, all its own */
    const int t = omp_get_thread_num();
    float *Vt = V + t * (z->v / q->nt), *Mt = M + t * (z->m / q->nt);
    const int64_t lo = tiles * t / q->nt, hi = tiles * (t + 1) / q->nt;
    for (int64_t g0 = lo; g0 < hi; g0 += q->bt) {
      const int64_t nb = hi - g0 < q->bt ? hi - g0 : q->bt;
      for (int64_t tl = 0; tl < nb; ++tl) {
        const tile_at at = tile_of(q, g0 + tl);
        const float *src = P + (at.ch * C * q->hp + 4 * at.ti) * q->wp * L + 4 * at.tj * L;
        for (int c = 0; c < C; ++c)
          input_tile(src + (int64_t)c * pp, q->wp * L, Vt + (int64_t)c * cols + tl * L, (int64_t)C * cols);
      }
      for (int o0 = 0; o0 < O; o0 += (int)q->ob) {
        const int on = O - o0 < q->ob ? O - o0 : (int)q->ob;
        for (int k = 0; k < 16; ++k) {
          int xi[4];
          const int n = members(k, xi);
          for (int e = 0; e < n; ++e)
            dp_gemm(own, 0, 0, on, nb * L, C, U + ((int64_t)k * O + o0) * C, C, Vt + (int64_t)xi[e] * C * cols, cols,
                    Mt + (int64_t)xi[e] * q->ob * cols, cols, 0, NULL);
        }
        for (int o = o0; o < o0 + on; ++o) {
          const float bias = b ? b[o] : 0.0f;
          for (int64_t tl = 0; tl < nb; ++tl) {
            const tile_at at = tile_of(q, g0 + tl);
            output_tile(Mt + (int64_t)(o - o0) * cols + tl * L, q->ob * cols, bias,
                        Y + ((at.ch * O + o) * q->yh + 2 * at.ti) * q->yw * L + 2 * at.tj * L, q->yw * L);
          }
        }
      }
    }
#pragma omp barrier
    group_from_lanes(Y, q->yh, q->yw, 0, N, c0, gn, O, q->OH, q->OW, y);
  }
}

dp_status dp_s2_forward(const dp_conv_geom *g, int64_t N, const float *x, const float *w, const float *b, float *y,
                        int nthreads, float *scratch) {
  if (N <= 0) return DP_OK;
  int own;
  DP_TRY(dp_small_gemm_on(&own));
  const s2_geom q = s2_make(g, N, nthreads, DP_S2_FORWARD);
  const s2_sizes z = s2_sizes_of(&q, DP_S2_FORWARD);
#pragma omp parallel num_threads(q.nt)
  filter_transform(&q, w, scratch);
  for (int64_t c0 = 0; c0 < q.nch; c0 += q.gch)
    forward_group(&q, &z, own, N, c0, q.nch - c0 < q.gch ? q.nch - c0 : q.gch, x, b, y, scratch);
  return DP_OK;
}

/* ---- the backward pass ----------------------------------------------------- */

/* backward with a block shared by the threads (where U is large, or one
 * chunk): one group of gn chunks from chunk c0. The threads transform the
 * block's tiles together (V, dM), then dw's 16 matrices are dealt out whole
 * (dU summed on over the blocks and groups in order) and dx split by
 * input-channel rows (dV, then each thread adds its channels' tiles). */
static void backward_group(const s2_geom *q, const s2_sizes *z, int own, int64_t N, int64_t c0, int64_t gn,
                           const float *x, const float *dy, float *dx, float *scratch) {
  const float *U = scratch;
  float *P = scratch + z->u, *D = P + z->planes_p, *DX = D + z->planes_y, *V = DX + z->planes_p;
  float *dM = V + z->v, *dV = dM + z->m, *dU = dV + z->dv, *pack = dU + z->du;
  const int C = q->C, O = q->O;
  const int64_t pp = q->hp * q->wp * L, cols = q->cols, pairs = (int64_t)O * C;
  const int64_t tiles = gn * q->T;
#pragma omp parallel num_threads(q->nt)
  {
    group_to_lanes(x, N, c0, gn, C, q->H, q->W, P, q->hp, q->wp, 1);
    group_to_lanes(dy, N, c0, gn, O, q->OH, q->OW, D, q->yh, q->yw, 0);
    if (dx) {
#pragma omp for schedule(static)
      for (int64_t pc = 0; pc < gn * C; ++pc) memset(DX + pc * pp, 0, sizeof(float) * (size_t)pp);
    }
    const int t = omp_get_thread_num();
    float *tpack = pack + (int64_t)t * r16(DP_SMALL_GEMM_PACK_FLOATS);
    int cl, ch_;
    row_share(C, t, q->nt, &cl, &ch_);
    for (int64_t g0 = 0; g0 < tiles; g0 += q->bt) {
      const int64_t nb = tiles - g0 < q->bt ? tiles - g0 : q->bt;
      /* the block's V and dM, its tiles and channels dealt to the threads */
#pragma omp for schedule(static)
      for (int64_t k = 0; k < nb * (C + O); ++k) {
        const int64_t tl = k / (C + O), r = k % (C + O);
        const tile_at at = tile_of(q, g0 + tl);
        if (r < C)
          input_tile(P + ((at.ch * C + r) * q->hp + 4 * at.ti) * q->wp * L + 4 * at.tj * L, q->wp * L,
                     V + r * cols + tl * L, (int64_t)C * cols);
        else
          dy_tile(D + ((at.ch * O + r - C) * q->yh + 2 * at.ti) * q->yw * L + 2 * at.tj * L, q->yw * L,
                  dM + (r - C) * cols + tl * L, (int64_t)O * cols);
      }
      /* dU_k (+)= dM_xi . V_xi^T over k's products: matrix k's thread alone, in order */
      for (int k = 0; k < 16; ++k) {
        if (du_owner(k, q->nt) != t) continue;
        int xi[4];
        const int n = members(k, xi);
        for (int e = 0; e < n; ++e)
          dp_gemm(own, 0, 1, O, C, nb * L, dM + dm_of(xi[e]) * O * cols, cols, V + (int64_t)xi[e] * C * cols, cols,
                  dU + (int64_t)k * pairs, C, c0 > 0 || g0 > 0 || e > 0, tpack);
      }
      /* dV_xi (channels [cl, ch_)) = U_k^T dM_xi, then dx += B dV B^T where each tile lies */
      if (dx && ch_ > cl) {
        for (int k = 0; k < 16; ++k) {
          int xi[4];
          const int n = members(k, xi);
          for (int e = 0; e < n; ++e)
            dp_gemm(own, 1, 0, ch_ - cl, nb * L, O, U + (int64_t)k * pairs + cl, C, dM + dm_of(xi[e]) * O * cols,
                    cols, dV + ((int64_t)xi[e] * C + cl) * cols, cols, 0, NULL);
        }
        for (int c = cl; c < ch_; ++c)
          for (int64_t tl = 0; tl < nb; ++tl) {
            const tile_at at = tile_of(q, g0 + tl);
            dx_tile(dV + (int64_t)c * cols + tl * L, (int64_t)C * cols,
                    DX + ((at.ch * C + c) * q->hp + 4 * at.ti) * q->wp * L + 4 * at.tj * L, q->wp * L);
          }
      }
#pragma omp barrier
    }
    if (dx) group_from_lanes(DX, q->hp, q->wp, 1, N, c0, gn, C, q->H, q->W, dx);
  }
}

/* backward with each thread on its own chunks (s2_private): one group of
 * gn chunks of lane planes from chunk c0; dU's partials (G of them, after
 * the planes) summed on from earlier groups. */
static void backward_private(const s2_geom *q, const s2_sizes *z, const s2_private *v, int own, int64_t N,
                             int64_t c0, int64_t gn, const float *x, const float *dy, float *dx, float *scratch) {
  const float *U = scratch;
  float *P = scratch + z->u, *D = P + z->planes_p, *DX = D + z->planes_y, *part = DX + z->planes_p + z->du;
  float *threads = part + v->G * z->du;
  const int C = q->C, O = q->O;
  const int64_t pp = q->hp * q->wp * L, py = q->yh * q->yw * L, cols = v->cols, pairs = (int64_t)O * C;
#pragma omp parallel num_threads(q->nt)
  {
    const int t = omp_get_thread_num();
    float *V = threads + t * v->per_thread, *dM = V + v->v, *dV = dM + v->m, *pack = dV + v->dv;
    for (int64_t ch = 0; ch < gn; ++ch) {
      const int64_t gc = c0 + ch, grp = gc * v->G / q->nch;
      if (grp * q->nt / v->G != t) continue; /* group grp's thread */
      const int first = gc == 0 || (gc - 1) * v->G / q->nch != grp; /* the group's first chunk */
      for (int c = 0; c < C; ++c) {
        plane_to_lanes(x, N, gc, C, c, q->H, q->W, P + (ch * C + c) * pp, q->hp, q->wp, 1);
        if (dx) memset(DX + (ch * C + c) * pp, 0, sizeof(float) * (size_t)pp);
      }
      for (int o = 0; o < O; ++o) plane_to_lanes(dy, N, gc, O, o, q->OH, q->OW, D + (ch * O + o) * py, q->yh, q->yw, 0);
      float *pu = part + grp * z->du;
      for (int64_t t0 = 0; t0 < q->T; t0 += v->bt) {
        const int64_t nb = q->T - t0 < v->bt ? q->T - t0 : v->bt;
        for (int64_t tl = 0; tl < nb; ++tl) {
          const int ti = (int)((t0 + tl) / q->tw), tj = (int)((t0 + tl) % q->tw);
          for (int c = 0; c < C; ++c)
            input_tile(P + ((ch * C + c) * q->hp + 4 * ti) * q->wp * L + 4 * tj * L, q->wp * L, V + c * cols + tl * L,
                       (int64_t)C * cols);
          for (int o = 0; o < O; ++o)
            dy_tile(D + ((ch * O + o) * q->yh + 2 * ti) * q->yw * L + 2 * tj * L, q->yw * L, dM + o * cols + tl * L,
                    (int64_t)O * cols);
        }
        for (int k = 0; k < 16; ++k) {
          int xi[4];
          const int n = members(k, xi);
          for (int e = 0; e < n; ++e) {
            dp_gemm(own, 0, 1, O, C, nb * L, dM + dm_of(xi[e]) * O * cols, cols, V + (int64_t)xi[e] * C * cols, cols,
                    pu + (int64_t)k * pairs, C, !(first && t0 == 0 && e == 0), pack);
            if (dx)
              dp_gemm(own, 1, 0, C, nb * L, O, U + (int64_t)k * pairs, C, dM + dm_of(xi[e]) * O * cols, cols,
                      dV + (int64_t)xi[e] * C * cols, cols, 0, NULL);
          }
        }
        for (int c = 0; dx && c < C; ++c)
          for (int64_t tl = 0; tl < nb; ++tl) {
            const int ti = (int)((t0 + tl) / q->tw), tj = (int)((t0 + tl) % q->tw);
            dx_tile(dV + (int64_t)c * cols + tl * L, (int64_t)C * cols,
                    DX + ((ch * C + c) * q->hp + 4 * ti) * q->wp * L + 4 * tj * L, q->wp * L);
          }
      }
      for (int c = 0; dx && c < C; ++c) plane_from_lanes(DX + (ch * C + c) * pp, q->wp, 1, N, gc, C, c, q->H, q->W, dx);
    }
  }
}

dp_status dp_s2_backward(const dp_conv_geom *g, int64_t N, const float *x, const float *w, const float *dy,
                         float *dx, float *dw, float *db, int nthreads, float *scratch) {
  if (N <= 0) {
    memset(dw, 0, sizeof(float) * (size_t)g->O * (size_t)g->C * 9);
    if (db) memset(db, 0, sizeof(float) * (size_t)g->O);
    return DP_OK;
  }
  int own;
  DP_TRY(dp_small_gemm_on(&own));
  const s2_geom q = s2_make(g, N, nthreads, DP_S2_BACKWARD);
  const s2_sizes z = s2_sizes_of(&q, DP_S2_BACKWARD);
  if (dx) {
#pragma omp parallel num_threads(q.nt)
    filter_transform(&q, w, scratch);
  }
  const s2_private v = private_make(&q);
  for (int64_t c0 = 0; c0 < q.nch; c0 += q.gch) {
    const int64_t gn = q.nch - c0 < q.gch ? q.nch - c0 : q.gch;
    if (v.on)
      backward_private(&q, &z, &v, own, N, c0, gn, x, dy, dx, scratch);
    else
      backward_group(&q, &z, own, N, c0, gn, x, dy, dx, scratch);
  }
  float *const planes_end = scratch + z.u + 2 * z.planes_p + z.planes_y;
  float *dU = v.on ? planes_end : planes_end + z.v + z.m + z.dv;
  const int64_t P = (int64_t)g->OH * g->OW;
#pragma omp parallel num_threads(q.nt)
  {
    if (v.on) { /* dU = the groups' partials, in group order */
      const float *part = dU + z.du;
#pragma omp for schedule(static)
      for (int64_t e = 0; e < z.du; ++e) {
        float sum = part[e];
        for (int64_t k = 1; k < v.G; ++k) sum += part[k * z.du + e];
        dU[e] = sum;
      }
    }
    filter_gradient(&q, dU, dw); /* ends in a barrier: dU read, its floats free for db's partials */
    if (db) dp_winograd_bias_grad(dy, N, g->O, P, (double *)(void *)dU, db);
  }
  return DP_OK;
}
