/* implicit_gemm.c — the implicit-GEMM convolution on the CPU (see
 * implicit_gemm.h).
 *
 * Scratch layout (floats, 64-byte aligned): shared, the packed filter wp
 * (forward only: panels of 16 channels, each (taps, 16)), the offset tables
 * off (rows: OH*OW per sample, a dw group's samples one after another) and
 * toff (taps), as int32; then per thread a zero-bordered copy of its sample
 * (or dw group) when the convolution pads, and for dw dy transposed in the
 * same panels (group rows, 16), the partial sums (taps, opad) and (opad) for
 * db, and the kernel's tile.
 */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "gemm_kernel.h"
#include "implicit_gemm.h"


/* On or off when DPCORE_IMPLICIT_GEMM is unset: the LeNet step's A/B
 * (benchmarks/RESULTS.md) decides. */
#define DP_IGEMM_DEFAULT 1
/* More output channels than this keep the im2col + SGEMM path (see the header). */
#define DP_IGEMM_MAX_OUT 64
/* dw: at least this many output positions per kernel call (a group of samples
 * side by side), so the kernel's set-up and the partial sums' update are small
 * beside its sum. */
#define DP_IGEMM_DW_ROWS 256
/* The micro-kernel's rows. */
#define ROWS DP_MK_ROWS

/* ---- geometry ------------------------------------------------------------ */

typedef struct igeom {
  int64_t hp, wp, plane; /* padded plane, and one sample's padded planes */
  int64_t P, taps, opad; /* output positions, taps C*KH*KW, channels padded to 16 */
  int64_t group;         /* dw: samples per kernel call */
  int64_t O;             /* output channels */
  int padded;            /* the input needs a zero-bordered copy */
} igeom;

static igeom igeom_make(const dp_conv_geom *g) {
  igeom q;
  q.hp = g->H + 2 * (int64_t)g->pad;
  q.wp = g->W + 2 * (int64_t)g->pad;
  q.plane = (int64_t)g->C * q.hp * q.wp;
  q.P = (int64_t)g->OH * g->OW;
  q.taps = (int64_t)g->C * g->KH * g->KW;
  q.opad = ((int64_t)g->O + 15) / 16 * 16;
  q.group = q.P >= DP_IGEMM_DW_ROWS ? 1 : (DP_IGEMM_DW_ROWS + q.P - 1) / q.P;
  q.padded = g->pad > 0;
  q.O = g->O;
  return q;
}

dp_status dp_igemm_takes(const dp_conv_geom *g, int *takes) {
  *takes = 0;
  int on;
  DP_TRY(dp_env_switch("DPCORE_IMPLICIT_GEMM", DP_IGEMM_DEFAULT, &on));
  const igeom q = igeom_make(g);
  /* the offsets are int32: a dw group's padded planes must fit them */
  *takes = on && g->C > 1 && g->O <= DP_IGEMM_MAX_OUT && q.P > 0 && q.plane * q.group < ((int64_t)1 << 30);
  return DP_OK;
}

static int64_t round16(int64_t n) { return (n + 15) & ~(int64_t)15; }

static int igemm_threads(int64_t N, int nthreads) { return N < nthreads ? (N < 1 ? 1 : (int)N) : nthreads; }

/* off[s*P + p]: where output position p of the group's sample s starts its
 * window; toff[t]: tap t = (c, ki, kj) within a window. */
static void offset_tables(const dp_conv_geom *g, const igeom *q, int64_t samples, int32_t *off, int32_t *toff) {
  for (int64_t s = 0; s < samples; ++s)
    for (int oh = 0; oh < g->OH; ++oh)
      for (int ow = 0; ow < g->OW; ++ow)
        off[s * q->P + (int64_t)oh * g->OW + ow] =
            (int32_t)(s * q->plane + (int64_t)oh * g->stride * q->wp + (int64_t)ow * g->stride);
  for (int c = 0; c < g->C; ++c)
    for (int ki = 0; ki < g->KH; ++ki)
      for (int kj = 0; kj < g->KW; ++kj)
        toff[((int64_t)c * g->KH + ki) * g->KW + kj] = (int32_t)(((int64_t)c * q->hp + ki) * q->wp + kj);
}

/* cnt samples of x (C, H, W each) into dst's zero-bordered planes (the
 * borders zeroed once by the caller and never written). */
static void pad_samples(const dp_conv_geom *g, const igeom *q, const float *x, int64_t cnt, float *dst) {
  for (int64_t s = 0; s < cnt; ++s)
    for (int c = 0; c < g->C; ++c)
      for (int i = 0; i < g->H; ++i)
        memcpy(dst + s * q->plane + ((int64_t)c * q->hp + i + g->pad) * q->wp + g->pad,
               x + ((s * g->C + c) * g->H + i) * (int64_t)g->W, sizeof(float) * (size_t)g->W);
}

/* ---- the micro-kernel: gemm_kernel.h ---------------------------------------- */

/* Rows [r0, r0 + ROWS) of a kernel call whose row r reads base + roff[r]; rows
 * past nrows repeat the last one (their results are dropped). */
static void row_bases(const float *base, const int32_t *roff, int64_t r0, int64_t nrows, const float **xb) {
  for (int r = 0; r < ROWS; ++r) xb[r] = base + roff[r0 + r < nrows ? r0 + r : nrows - 1];
}

/* ---- scratch ------------------------------------------------------------- */

/* Taps rounded up to whole 16-tap panels (dx's packed filter). */
static int64_t taps16(const igeom *q) { return (q->taps + 15) / 16 * 16; }

static int64_t shared_floats(const igeom *q, int pass) {
  const int64_t packed = pass == DP_IGEMM_FORWARD ? q->taps * q->opad : pass == DP_IGEMM_DX ? taps16(q) * q->O : 0;
  const int64_t rows = pass == DP_IGEMM_DW ? q->group * q->P : q->P;
  return round16(packed) + round16(rows) + round16(q->taps) + (pass == DP_IGEMM_DX ? round16(q->O) : 0);
}

static int64_t thread_floats(const igeom *q, int pass) {
  const int64_t in = q->padded ? round16((pass == DP_IGEMM_DW ? q->group : 1) * q->plane) : 0;
  if (pass != DP_IGEMM_DW) return in + 16 * ROWS;
  return in + round16(q->group * q->P * q->opad) + round16(q->taps * q->opad + q->opad) + 16 * ROWS;
}

size_t dp_igemm_scratch_floats(const dp_conv_geom *g, int64_t N, int nthreads, int pass) {
  const igeom q = igeom_make(g);
  return (size_t)(shared_floats(&q, pass) + igemm_threads(N, nthreads) * thread_floats(&q, pass));
}

/* ---- forward ------------------------------------------------------------- */

dp_status dp_igemm_forward(const dp_conv_geom *g, int64_t N, const float *x, const float *w, const float *b, float *y,
                           int nthreads, float *scratch) {
  if (N <= 0) return DP_OK;
  const igeom q = igeom_make(g);
  const int nt = igemm_threads(N, nthreads);
  float *wp = scratch;
  int32_t *off = (int32_t *)(void *)(wp + round16(q.taps * q.opad));
  int32_t *toff = off + round16(q.P);
  float *per = (float *)(void *)(toff + round16(q.taps));
  offset_tables(g, &q, 1, off, toff);
  const int64_t in_sz = (int64_t)g->C * g->H * g->W, out_sz = (int64_t)g->O * q.P;
#pragma omp parallel num_threads(nt)
  {
    /* the packed filter: panels of 16 channels, panel k's row t at wp +
     * (k*taps + t)*16 holding w[16k + j, t] (zero past O), so that the
     * kernel streams whole aligned cache lines */
#pragma omp for schedule(static)
    for (int64_t t = 0; t < q.taps; ++t)
      for (int64_t o = 0; o < q.opad; ++o)
        wp[((o / 16) * q.taps + t) * 16 + o % 16] = o < g->O ? w[o * q.taps + t] : 0.0f;
    const int th = omp_get_thread_num();
    float *mine = per + th * thread_floats(&q, DP_IGEMM_FORWARD);
    float *xpad = mine, *tile = mine + (q.padded ? round16(q.plane) : 0);
    if (q.padded) memset(xpad, 0, sizeof(float) * (size_t)q.plane);
    for (int64_t n = N * th / nt; n < N * (th + 1) / nt; ++n) {
      const float *src = x + n * in_sz;
      if (q.padded) {
        pad_samples(g, &q, src, 1, xpad);
        src = xpad;
      }
      float *yn = y + n * out_sz;
      /* panel by panel: one panel of the filter (taps x 16 floats) is read
       * by all the sample's row blocks while it is in cache */
      for (int64_t o0 = 0; o0 < q.opad; o0 += 16) {
        const int64_t width = g->O - o0 > 8 ? 16 : 8;
        for (int64_t p0 = 0; p0 < q.P; p0 += ROWS) {
          const float *xb[ROWS];
          row_bases(src, off, p0, q.P, xb);
          const int64_t rows = q.P - p0 < ROWS ? q.P - p0 : ROWS;
          dp_mk(width, q.taps, xb, toff, wp + o0 * q.taps, tile);
          for (int64_t j = 0; j < width && o0 + j < g->O; ++j) {
            const float bias = b ? b[o0 + j] : 0.0f;
            float *yo = yn + (o0 + j) * q.P + p0;
            for (int64_t r = 0; r < rows; ++r) yo[r] = tile[r * 16 + j] + bias;
          }
        }
      }
    }
  }
  return DP_OK;
}

/* ---- weight gradient ----------------------------------------------------- */

dp_status dp_igemm_backward_dw(const dp_conv_geom *g, int64_t N, const float *x, const float *dy, float *dw,
                               float *db, int nthreads, float *scratch) {
  const igeom q = igeom_make(g);
  const int nt = igemm_threads(N, nthreads);
  int32_t *off = (int32_t *)(void *)scratch;
  int32_t *toff = off + round16(q.group * q.P);
  float *per = (float *)(void *)(toff + round16(q.taps));
  offset_tables(g, &q, q.group, off, toff);
  const int64_t in_sz = (int64_t)g->C * g->H * g->W, out_sz = (int64_t)g->O * q.P;
  const int64_t tf = thread_floats(&q, DP_IGEMM_DW), acc_sz = q.taps * q.opad + q.opad;
  /* within a thread's floats: the bordered planes, dy transposed, then the partial sums */
  const int64_t dyt_at = q.padded ? round16(q.group * q.plane) : 0, acc_at = dyt_at + round16(q.group * q.P * q.opad);
#pragma omp parallel num_threads(nt)
  {
    const int th = omp_get_thread_num();
    float *mine = per + th * tf;
    float *xpad = mine, *dyt = mine + dyt_at, *acc = mine + acc_at, *tile = acc + round16(acc_sz);
    float *accb = acc + q.taps * q.opad;
    if (q.padded) memset(xpad, 0, sizeof(float) * (size_t)(q.group * q.plane));
    memset(dyt, 0, sizeof(float) * (size_t)(q.group * q.P * q.opad)); /* the lanes past O stay 0 */
    memset(acc, 0, sizeof(float) * (size_t)acc_sz);
    const int64_t end = N * (th + 1) / nt;
    for (int64_t n0 = N * th / nt; n0 < end; n0 += q.group) {
      const int64_t cnt = end - n0 < q.group ? end - n0 : q.group, rows = cnt * q.P;
      const float *src = x + n0 * in_sz;
      if (q.padded) {
        pad_samples(g, &q, src, cnt, xpad);
        src = xpad;
      }
      /* dy transposed in panels of 16 channels (as the forward pass's
       * filter): dyt[((o/16)*group*P + s*P + p)*16 + o%16] = dy[n0 + s, o, p];
       * db's sums per sample */
      for (int64_t s = 0; s < cnt; ++s)
        for (int o = 0; o < g->O; ++o) {
          const float *d = dy + (n0 + s) * out_sz + o * q.P;
          float *col = dyt + ((o / 16) * q.group * q.P + s * q.P) * 16 + o % 16, sum = 0.0f;
          for (int64_t p = 0; p < q.P; ++p) {
            col[p * 16] = d[p];
            sum += d[p];
          }
          accb[o] += sum;
        }
      for (int64_t t0 = 0; t0 < q.taps; t0 += ROWS) {
        const float *xb[ROWS];
        row_bases(src, toff, t0, q.taps, xb);
        const int64_t trows = q.taps - t0 < ROWS ? q.taps - t0 : ROWS;
        for (int64_t o0 = 0; o0 < q.opad; o0 += 16) {
          const int64_t width = g->O - o0 > 8 ? 16 : 8;
          dp_mk(width, rows, xb, off, dyt + o0 * q.group * q.P, tile);
          for (int64_t r = 0; r < trows; ++r) {
            float *a = acc + (t0 + r) * q.opad + o0;
            for (int64_t j = 0; j < width; ++j) a[j] += tile[r * 16 + j];
          }
        }
      }
    }
  }
  /* dw[o, t], db[o] = the threads' partial sums, in thread order */
  const int64_t wsz = (int64_t)g->O * q.taps;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (wsz * nt > 65536)
  for (int64_t i = 0; i < wsz + g->O; ++i) {
    const int64_t at = i < wsz ? (i % q.taps) * q.opad + i / q.taps : q.taps * q.opad + (i - wsz);
    float s = 0.0f;
    for (int th = 0; th < nt; ++th) s += per[th * tf + acc_at + at];
    if (i < wsz)
      dw[i] = s;
    else if (db)
      db[i - wsz] = s;
  }
  return DP_OK;
}

/* ---- input gradient ------------------------------------------------------
 * dx[off[p] + toff[t]] += sum over o of dy[o, p] w[o, t], for every output
 * position p and tap t (col2im of w^T dy, never written out): rows are 6
 * output positions, broadcasting dy[o, p] (idx[o] = o*P), lanes 16 taps of
 * the filter packed in panels of 16 taps, (O, 16) each; each tile is added
 * into the sample's dx (zero-bordered when the convolution pads) at once. */

dp_status dp_igemm_backward_dx(const dp_conv_geom *g, int64_t N, const float *w, const float *dy, float *dx,
                               int nthreads, float *scratch) {
  if (N <= 0) return DP_OK;
  const igeom q = igeom_make(g);
  const int nt = igemm_threads(N, nthreads);
  const int64_t t16 = taps16(&q);
  float *wt = scratch;
  int32_t *off = (int32_t *)(void *)(wt + round16(t16 * q.O));
  int32_t *toff = off + round16(q.P);
  int32_t *oidx = toff + round16(q.taps);
  float *per = (float *)(void *)(oidx + round16(q.O));
  offset_tables(g, &q, 1, off, toff);
  for (int o = 0; o < g->O; ++o) oidx[o] = (int32_t)(o * q.P);
  const int64_t in_sz = (int64_t)g->C * g->H * g->W, out_sz = (int64_t)g->O * q.P;
#pragma omp parallel num_threads(nt)
  {
    /* wt[((t/16)*O + o)*16 + t%16] = w[o, t], zero past the taps */
#pragma omp for schedule(static)
    for (int64_t t = 0; t < t16; ++t)
      for (int o = 0; o < g->O; ++o) wt[((t / 16) * q.O + o) * 16 + t % 16] = t < q.taps ? w[o * q.taps + t] : 0.0f;
    const int th = omp_get_thread_num();
    float *mine = per + th * thread_floats(&q, DP_IGEMM_DX);
    float *xpad = mine, *tile = mine + (q.padded ? round16(q.plane) : 0);
    for (int64_t n = N * th / nt; n < N * (th + 1) / nt; ++n) {
      float *dst = q.padded ? xpad : dx + n * in_sz;
      memset(dst, 0, sizeof(float) * (size_t)q.plane);
      const float *dyn = dy + n * out_sz;
      for (int64_t t0 = 0; t0 < q.taps; t0 += 16) {
        const int64_t width = q.taps - t0 > 8 ? 16 : 8, tn = q.taps - t0 < width ? q.taps - t0 : width;
        const float *panel = wt + t0 * q.O;
        for (int64_t p0 = 0; p0 < q.P; p0 += ROWS) {
          const float *xb[ROWS];
          for (int r = 0; r < ROWS; ++r) xb[r] = dyn + (p0 + r < q.P ? p0 + r : q.P - 1);
          const int64_t rows = q.P - p0 < ROWS ? q.P - p0 : ROWS;
          dp_mk(width, q.O, xb, oidx, panel, tile);
          for (int64_t r = 0; r < rows; ++r) {
            float *d = dst + off[p0 + r];
            const float *tr = tile + r * 16;
            for (int64_t j = 0; j < tn; ++j) d[toff[t0 + j]] += tr[j];
          }
        }
      }
      if (q.padded) /* the interior of the bordered planes */
        for (int c = 0; c < g->C; ++c)
          for (int i = 0; i < g->H; ++i)
            memcpy(dx + n * in_sz + ((int64_t)c * g->H + i) * g->W, xpad + ((int64_t)c * q.hp + i + g->pad) * q.wp + g->pad,
                   sizeof(float) * (size_t)g->W);
    }
  }
  return DP_OK;
}
