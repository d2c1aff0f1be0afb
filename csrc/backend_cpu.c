/* backend_cpu.c — the CPU backend: OpenMP over the DP_HD bodies of
 * kernels/dp_kernels.h, GEMM through CBLAS (OpenBLAS), convolution as
 * im2col + GEMM over groups of samples, each thread taking an equal share of
 * the batch (dx of a "same" stride-1 convolution as a convolution of dy).
 *
 * Threads: a device owns `nthreads` cores. Every parallel region names that
 * count; GEMMs issued inside an active region run single-threaded (OpenBLAS's
 * OpenMP build checks omp_in_parallel), GEMMs outside one use the calling
 * thread's OpenMP thread count, which cpu_enter() sets to the device's share.
 * Reductions over samples (weight and bias gradients) go through per-thread
 * partial sums added in thread order, so results are reproducible bit for bit
 * for a given thread count.
 */
#include <cblas.h>
#include <math.h>
#include <omp.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "backend.h"
#include "cpu_caches.h"
#include "implicit_gemm.h"
#include "lanes.h" /* dp_lanes_upto */
#include "small_gemm.h"
#include "winograd.h"
#include "winograd_lanes.h"
#include "fft_lanes.h"
#include "winograd_s2.h"

typedef struct cpu_ctx {
  float *scratch;        /* grows on demand; used only by the device's own thread */
  size_t scratch_floats;
  double pending_loss;   /* softmax_xent's sums kept for metrics_read */
  int64_t pending_correct;
  float loss_flag;       /* dp_loss_flag of the last softmax_xent's rows */
} cpu_ctx;

static void cpu_enter(dp_device *dev) { omp_set_num_threads(dev->nthreads); }

/* *out = bytes (> 0) of memory, 64-byte aligned; buffers of 4 MiB and more
 * (the scratch, activations, gradients) on 2 MiB boundaries and marked for
 * transparent huge pages, which kernels set to "madvise" give only on request:
 * the Winograd transforms' strided stores and the GEMMs' panels then miss the
 * TLB far less (ResNet-18's step measured 1-2% faster, benchmarks/RESULTS.md).
 * DPCORE_HUGE_PAGES=0 leaves them to the kernel's default. NULL when out of
 * memory (the caller names the failure). */
static dp_status cpu_aligned(size_t bytes, void **out) {
  const size_t huge = (size_t)2 << 20;
  int on;
  DP_TRY(dp_env_switch("DPCORE_HUGE_PAGES", 1, &on));
#if defined(__SANITIZE_ADDRESS__)
  /* not under AddressSanitizer: its allocator serves 2 MiB alignments from
   * its secondary (mmap) allocator, and its leak checker's tracer crashed at
   * exit in one full sanitizer run with them (a known intermittent LSan
   * failure; kept out of that run's way) */
  on = 0;
#endif
  if (on && bytes >= 2 * huge) {
    const size_t rounded = (bytes + huge - 1) & ~(huge - 1);
    *out = aligned_alloc(huge, rounded);
#ifdef MADV_HUGEPAGE
    if (*out) (void)madvise(*out, rounded, MADV_HUGEPAGE); /* advice: a kernel without THP ignores it */
#endif
  } else {
    *out = aligned_alloc(64, (bytes + 63) & ~(size_t)63);
  }
  return DP_OK;
}

static dp_status cpu_scratch(dp_device *dev, size_t floats, float **out) {
  cpu_ctx *c = dev->ctx;
  if (floats > c->scratch_floats) {
    /* the GPU's rule on the CPU too, so that the CPU suite tests it: a step
     * uses what its warm-up sized */
    DP_TRY(dp_device_may_grow(dev, "the CPU scratch", c->scratch_floats * sizeof(float), floats * sizeof(float),
                              "bytes"));
    free(c->scratch);
    c->scratch = NULL;
    c->scratch_floats = 0;
    /* 64-byte aligned for the vector units */
    size_t bytes = (floats * sizeof(float) + 63) & ~(size_t)63;
    void *p;
    DP_TRY(cpu_aligned(bytes, &p));
    if (!p) return DP_FAIL(DP_ERR_MEMORY, "cpu scratch: cannot allocate %zu bytes on %s", bytes, dev->name);
    c->scratch = p;
    c->scratch_floats = floats;
  }
  *out = c->scratch;
  return DP_OK;
}

static dp_status cpu_alloc(dp_device *dev, size_t bytes, void **out) {
  size_t rounded = (bytes + 63) & ~(size_t)63;
  if (rounded == 0) rounded = 64;
  void *p;
  DP_TRY(cpu_aligned(rounded, &p));
  if (!p) return DP_FAIL(DP_ERR_MEMORY, "cannot allocate %zu bytes on %s", bytes, dev->name);
  memset(p, 0, rounded);
  *out = p;
  return DP_OK;
}

static void cpu_release(dp_device *dev, void *p) { free(p); }

static dp_status cpu_copy(dp_device *dev, void *dst, const void *src, size_t bytes) {
  if (bytes) memmove(dst, src, bytes);
  return DP_OK;
}

static dp_status cpu_fill(dp_device *dev, float *x, int64_t n, float value) {
  for (int64_t i = 0; i < n; ++i) x[i] = value;
  return DP_OK;
}

/* Whole rows at a time (dp_gather_elem is the GPU's byte-at-a-time form of
 * this; tests/c/kernel_bodies.c checks that the two agree). */
static dp_status cpu_gather_rows(dp_device *dev, int64_t nrows, int64_t row_bytes, const void *src,
                                 const int32_t *rows, void *dst) {
#pragma omp parallel for num_threads(dev->nthreads) schedule(static) if (nrows * row_bytes > (1 << 20))
  for (int64_t r = 0; r < nrows; ++r)
    memcpy((char *)dst + r * row_bytes, (const char *)src + (int64_t)rows[r] * row_bytes, (size_t)row_bytes);
  return DP_OK;
}

static dp_status cpu_u8_to_unit(dp_device *dev, float *y, const uint8_t *x, int64_t n) {
#pragma omp parallel for simd num_threads(dev->nthreads) schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) y[i] = dp_u8_to_unit_elem(x[i]);
  return DP_OK;
}

/* ---- convolution ---------------------------------------------------------- */

/* The output positions o in [lo, hi), o < out, whose input position
 * o*stride - pad + kk is inside [0, in): along a row (columns, kk = kj) or
 * a column (rows, kk = ki). */
static void valid_range(int out, int in, int stride, int pad, int kk, int *lo, int *hi) {
  int l = pad - kk > 0 ? (pad - kk + stride - 1) / stride : 0;
  int h = (in - 1 + pad - kk) >= 0 ? (in - 1 + pad - kk) / stride + 1 : 0;
  if (h > out) h = out;
  if (l > h) l = h;
  *lo = l;
  *hi = h;
}

/* im2col works from copies of the input planes, zero-padded and split into
 * their stride phases: phase (a, b) holds the padded plane's rows a, a+s, ...
 * and columns b, b+s, ... So every row of the column matrix is OH runs of OW
 * contiguous floats (no padding tests, no strided reads), which matters on
 * small planes: ResNet-18's 4x4 stage writes 16-float rows, and the per-row
 * bookkeeping of a direct im2col cost more than the copying. */
typedef struct im2col_phases {
  int s, na, nb; /* stride; phases used: rows a < na, columns b < nb */
  int64_t hq, wq; /* size of one phase plane */
} im2col_phases;

static im2col_phases im2col_phases_of(const dp_conv_geom *g) {
  im2col_phases q;
  q.s = g->stride;
  q.na = g->KH < q.s ? g->KH : q.s;
  q.nb = g->KW < q.s ? g->KW : q.s;
  q.hq = (g->H + 2 * (int64_t)g->pad + q.s - 1) / q.s;
  q.wq = (g->W + 2 * (int64_t)g->pad + q.s - 1) / q.s;
  return q;
}

/* Floats of the phase buffer im2col needs for a group of cnt samples. */
static int64_t im2col_buffer_floats(const dp_conv_geom *g, int64_t cnt) {
  const im2col_phases q = im2col_phases_of(g);
  return cnt * q.na * q.nb * q.hq * q.wq;
}

/* Copies of at most a few dozen floats: fixed-size pieces become single
 * vector moves, where a loop of unknown length becomes a memcpy call. */
static inline void copy_run(float *restrict dst, const float *restrict src, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) memcpy(dst + i, src + i, 8 * sizeof(float));
  if (i + 4 <= n) {
    memcpy(dst + i, src + i, 4 * sizeof(float));
    i += 4;
  }
  switch (n - i) { /* a tail loop would become a memmove call too */
    case 3:
      memcpy(dst + i, src + i, 3 * sizeof(float));
      break;
    case 2:
      memcpy(dst + i, src + i, 2 * sizeof(float));
      break;
    case 1:
      dst[i] = src[i];
      break;
    default:
      break;
  }
}

/* The phase planes of one input plane (H, W) into ph (na*nb planes of
 * hq*wq), inside only: the padding positions are the same for every plane and
 * im2col zeroes them once. */
static void im2col_phase_planes(const dp_conv_geom *g, const im2col_phases *q, const float *plane, float *ph) {
  const int s = q->s;
  for (int a = 0; a < q->na; ++a) {
    int ilo, ihi; /* phase rows i whose input row i*s + a - pad is inside [0, H) */
    valid_range((int)q->hq, g->H, s, g->pad, a, &ilo, &ihi);
    for (int b = 0; b < q->nb; ++b) {
      float *dst = ph + (a * q->nb + b) * q->hq * q->wq;
      int lo, hi; /* likewise the phase columns j */
      valid_range((int)q->wq, g->W, s, g->pad, b, &lo, &hi);
      for (int i = ilo; i < ihi; ++i) {
        float *r = dst + (int64_t)i * q->wq + lo;
        /* the input row's first column that lands in this phase row */
        const float *src = plane + ((int64_t)i * s + a - g->pad) * g->W + ((int64_t)lo * s + b - g->pad);
        if (s == 1)
          copy_run(r, src, hi - lo);
        else
          for (int j = 0; j < hi - lo; ++j) r[j] = src[(int64_t)j * s];
      }
    }
  }
}

/* im2col of the cnt samples x[s] = x + s*x_stride, each (C, H, W), into a
 * matrix with row stride ld (>= cnt*P): row r = (c, ki, kj) holds, at column
 * s*P + oh*OW + ow, x[s][c, oh*stride - pad + ki, ow*stride - pad + kj] (zero
 * where that falls in the padding). Each row is written front to back across
 * the samples: written sample by sample, a 4x4 plane fills one cache line per
 * row, thousands of rows apart, and the writes ran at a tenth of the speed.
 * buf holds im2col_buffer_floats(g, cnt) floats. */
static void im2col(const dp_conv_geom *g, const float *x, int64_t x_stride, int64_t cnt, float *col, int64_t ld,
                   float *buf) {
  const im2col_phases q = im2col_phases_of(g);
  const int s = q.s, OH = g->OH, OW = g->OW;
  const int64_t P = (int64_t)OH * OW, plane_sz = q.hq * q.wq, phases_sz = q.na * q.nb * plane_sz;
  memset(buf, 0, sizeof(float) * (size_t)(cnt * phases_sz));
  for (int c = 0; c < g->C; ++c) {
    for (int64_t n = 0; n < cnt; ++n)
      im2col_phase_planes(g, &q, x + n * x_stride + (int64_t)c * g->H * g->W, buf + n * phases_sz);
    for (int ki = 0; ki < g->KH; ++ki)
      for (int kj = 0; kj < g->KW; ++kj) {
        float *row = col + (int64_t)((c * g->KH + ki) * g->KW + kj) * ld;
        const int64_t off = ((ki % s) * q.nb + kj % s) * plane_sz + (ki / s) * q.wq + kj / s;
        for (int64_t n = 0; n < cnt; ++n) {
          const float *src = buf + n * phases_sz + off;
          float *dst = row + n * P;
          if (q.wq == OW) /* 1x1 kernel, stride 1, no padding: one run */
            memcpy(dst, src, sizeof(float) * (size_t)P);
          else
            for (int oh = 0; oh < OH; ++oh) copy_run(dst + (int64_t)oh * OW, src + oh * q.wq, OW);
        }
      }
  }
}

/* dst[2j] += r[j] for j < n, n >= 8, with AVX-512: 16 of r at a time spread
 * over the even lanes of two vectors of dst (the odd lanes stored back
 * unchanged, none past dst[2n - 2]); each dst[2j] gets the same one add as
 * the scalar loop (the same bits). ResNet-18's 28x28 stride-2 layers' col2im
 * was a scalar loop at a sixth of their backward pass. Shorter runs (7x7 and
 * 4x4 outputs) keep the scalar loop, the choice made once per tap: a test per
 * row measured 3% slower there. */
#if defined(__AVX512F__)
#define ADD_STRIDE2 1
static inline void add_stride2(float *dst, const float *r, int n) {
  const __m512i lo = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i hi = _mm512_setr_epi32(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);
  const __mmask16 even = 0x5555;
  for (int j = 0; j < n; j += 16) {
    const int left = n - j; /* r's values left: dst lanes [0, 2 left - 1) of the 32 from dst + 2j */
    const __m512 v = _mm512_maskz_loadu_ps(dp_lanes_upto(left), r + j);
    const __mmask16 m0 = dp_lanes_upto(2 * left - 1), m1 = dp_lanes_upto(2 * left - 17);
    float *d = dst + 2 * (int64_t)j;
    const __m512 d0 = _mm512_maskz_loadu_ps(m0, d);
    _mm512_mask_storeu_ps(d, m0, _mm512_mask_add_ps(d0, even, d0, _mm512_permutexvar_ps(lo, v)));
    if (m1) {
      const __m512 d1 = _mm512_maskz_loadu_ps(m1, d + 16);
      _mm512_mask_storeu_ps(d + 16, m1, _mm512_mask_add_ps(d1, even, d1, _mm512_permutexvar_ps(hi, v)));
    }
  }
}
#else
#define ADD_STRIDE2 0
static inline void add_stride2(float *dst, const float *r, int n) {
  for (int j = 0; j < n; ++j) dst[2 * (int64_t)j] += r[j];
}
#endif

/* dx (C, H, W) = col2im of the columns [0, P) of dcol (row stride ld): the
 * scatter-add inverse of im2col. dx is overwritten. */
static void col2im(const dp_conv_geom *g, const float *dcol, int64_t ld, float *dx) {
  memset(dx, 0, sizeof(float) * (size_t)g->C * g->H * g->W);
  for (int c = 0; c < g->C; ++c)
    for (int ki = 0; ki < g->KH; ++ki) {
      int oh0, oh1;
      valid_range(g->OH, g->H, g->stride, g->pad, ki, &oh0, &oh1);
      for (int kj = 0; kj < g->KW; ++kj) {
        const float *row = dcol + (int64_t)((c * g->KH + ki) * g->KW + kj) * ld;
        int lo, hi;
        valid_range(g->OW, g->W, g->stride, g->pad, kj, &lo, &hi);
        if (lo >= hi) continue;
        const int vec2 = ADD_STRIDE2 && g->stride == 2 && hi - lo >= 8; /* add_stride2's runs */
        for (int oh = oh0; oh < oh1; ++oh) {
          const int h = oh * g->stride - g->pad + ki;
          const float *r = row + (int64_t)oh * g->OW + lo;
          /* the input column of output column lo */
          float *dst = dx + ((int64_t)c * g->H + h) * g->W + ((int64_t)lo * g->stride - g->pad + kj);
          if (g->stride == 1)
            for (int j = 0; j < hi - lo; ++j) dst[j] += r[j];
          else if (vec2)
            add_stride2(dst, r, hi - lo);
          else
            for (int j = 0; j < hi - lo; ++j) dst[(int64_t)j * g->stride] += r[j];
        }
      }
    }
}

/* How a convolution's N samples are split: thread t of nt takes the samples
 * [N*t/nt, N*(t+1)/nt), an equal share (whole groups dealt to the threads
 * could leave one thread a group more), and runs them in groups of at most G
 * samples side by side in the GEMM's columns (N = G*OH*OW).
 *
 * G: one sample on wide planes; there a sample's GEMM writes its output in
 * place and reads its dy in place (grouped, both were copied: ResNet-18's
 * one-channel stem, 16 samples to a group under the L2 rule below, ran its
 * forward pass 2.2x and its backward 2.6x slower on dpcore's kernel, 1.6x and
 * 1.8x on OpenBLAS's; the 1x1 shortcut on 28x28, 8 a group, 1.1-1.3x its
 * forward). Where one sample's GEMM is narrow
 * (OH*OW < CONV_NARROW: 49 and 16 columns on ResNet-18's last two stages),
 * at least as many samples as keep a thread's im2col matrix near a core's L2
 * (CONV_COL_L2 floats) and enough for about CONV_GEMM_COLS columns: per sample, such a GEMM
 * ran at half the speed of the wide ones and packed the whole filter again
 * for every sample; grouped, they run as fast as the wide ones (more columns
 * were no faster). At most as many as keep the matrix under CONV_COL_MAX
 * floats. Wide planes stay one sample per GEMM: grouping them measured no
 * faster, and it costs reproducibility across batch splits: OpenBLAS's result
 * for a column depends on where in the matrix the column lies, so a sample
 * grouped differently (a replica's shard of the batch) rounds differently,
 * and the replica tests compare k replicas with one device. */
#define CONV_NARROW 64
#define CONV_GEMM_COLS 1024
#define CONV_COL_L2 (dp_cpu_l2_bytes() / 2 / (int64_t)sizeof(float)) /* half a core's L2 */
#define CONV_COL_MAX ((int64_t)1 << 22)

typedef struct conv_plan {
  int nt;
  int64_t G;
} conv_plan;

static conv_plan conv_plan_make(const dp_conv_geom *g, int64_t N, int nthreads) {
  const int64_t K = (int64_t)g->C * g->KH * g->KW, P = (int64_t)g->OH * g->OW;
  int64_t most = 1; /* wide planes: one sample per GEMM */
  if (P < CONV_NARROW) {
    most = CONV_COL_L2 / (K * P);
    if (most * P < CONV_GEMM_COLS) {
      most = (CONV_GEMM_COLS + P - 1) / P;
      if (most * K * P > CONV_COL_MAX) most = CONV_COL_MAX / (K * P);
    }
  }
  if (most < 1) most = 1;
  conv_plan plan;
  plan.nt = N < nthreads ? (N < 1 ? 1 : (int)N) : nthreads;
  const int64_t share = (N + plan.nt - 1) / plan.nt, ngroups = (share + most - 1) / most;
  plan.G = share < 1 ? 1 : (share + ngroups - 1) / ngroups;
  return plan;
}

/* Thread t's k-th group of samples [*n0, *n0 + *cnt), k < conv_groups(); every
 * group holds at most plan->G samples. */
static int64_t conv_groups(const conv_plan *plan, int64_t N, int t) {
  const int64_t share = N * (t + 1) / plan->nt - N * t / plan->nt;
  return (share + plan->G - 1) / plan->G;
}

static void conv_group(const conv_plan *plan, int64_t N, int t, int64_t k, int64_t *n0, int64_t *cnt) {
  const int64_t s0 = N * t / plan->nt, share = N * (t + 1) / plan->nt - s0, ng = conv_groups(plan, N, t);
  *n0 = s0 + share * k / ng;
  *cnt = s0 + share * (k + 1) / ng - *n0;
}

/* ---- single-channel input: direct convolution ---------------------------- */

/* A convolution of a 1-channel image (LeNet's and ResNet-18's first layer)
 * sums over only KH*KW products per output: as im2col + GEMM that is a GEMM
 * with a 9-long inner dimension, which OpenBLAS runs far below its speed,
 * after im2col has written a matrix KH*KW times the input's size. Computed
 * directly instead, on the "wide grid": the input plane zero-padded to
 * (Hp, Wp) and the outputs taken at q = oh*Wp + ow for every ow < Wp (the
 * columns ow >= OW are discarded), so that the input every output q reads
 * through tap (ki, kj) is xp[q + ki*Wp + kj]: one contiguous run per tap
 * over the whole plane, in blocks of DIRECT_BLOCK outputs held in registers.
 * Each sample is computed alone (results do not depend on the rest of the
 * batch). Used for stride 1 without padding (dx is then a convolution of
 * dy padded by K-1 with the flipped filter, by the same routine; the code
 * takes any padding below the kernel). */
#define DIRECT_BLOCK 64

/* Eight floats as one value (GCC's and Clang's vector extension: one AVX
 * register, or two SSE ones); the loops below keep their sums in a few of
 * these, where arrays of floats were kept on the stack. */
typedef float dp_v8 __attribute__((vector_size(32)));

/* Unaligned loads and stores of one (macros: a vector passed by value to a
 * function changes the ABI where AVX is not enabled, and GCC warns). */
#define V8_LOAD(v, p) memcpy(&(v), (p), sizeof(dp_v8))
#define V8_STORE(p, v) memcpy((p), &(v), sizeof(dp_v8))

typedef struct direct_geom {
  int cin, hp, wp, kh, kw, oh, ow; /* input channels, padded plane, kernel, output */
  int64_t len;                      /* wide outputs rounded up to DIRECT_BLOCK */
} direct_geom;

static direct_geom direct_geom_make(int cin, int hp, int wp, int kh, int kw) {
  direct_geom d = {cin, hp, wp, kh, kw, hp - kh + 1, wp - kw + 1, 0};
  d.len = ((int64_t)d.oh * wp + DIRECT_BLOCK - 1) / DIRECT_BLOCK * DIRECT_BLOCK;
  return d;
}

/* Floats of a padded input buffer: the planes, then what the last block reads
 * past the last plane (zeros). */
static int64_t direct_input_floats(const direct_geom *d) {
  return (int64_t)d->cin * d->hp * d->wp + d->len - (int64_t)d->oh * d->wp + d->kw;
}

/* Copies the (cin, h, w) planes of x into xp's interiors at (pad_h, pad_w);
 * the borders and the tail stay as they were (zeroed once by the caller). */
static void direct_pad_input(const direct_geom *d, const float *x, int h, int w, int pad_h, int pad_w, float *xp) {
  for (int c = 0; c < d->cin; ++c)
    for (int i = 0; i < h; ++i)
      memcpy(xp + ((int64_t)c * d->hp + i + pad_h) * d->wp + pad_w, x + ((int64_t)c * h + i) * w,
             sizeof(float) * (size_t)w);
}

/* y (nout, OH, OW) = w (nout, cin, kh, kw) * xp + b (b may be NULL): the
 * taps summed in (c, ki, kj) order, then the bias added. wide: len floats. */
/* Output channels a pass over the input (each input vector loaded once for
 * all of them, forward and dw): 4 where the build has AVX-512's 32 vector
 * registers (4 x 8 sums of 8 lanes), else 1 */
#if defined(__AVX512F__)
#define DIRECT_OUTS 4
#else
#define DIRECT_OUTS 1
#endif

static void direct_conv(const direct_geom *d, const float *xp, const float *w, const float *b, int nout,
                        float *wide, float *y) {
  const int64_t plane = (int64_t)d->hp * d->wp, taps = (int64_t)d->kh * d->kw, ws = d->cin * taps;
  for (int o0 = 0; o0 < nout; o0 += DIRECT_OUTS) {
    const int on = nout - o0 < DIRECT_OUTS ? nout - o0 : DIRECT_OUTS;
    for (int64_t q0 = 0; q0 < d->len; q0 += DIRECT_BLOCK) {
      /* each output's sum over the taps in the same order whatever on is */
      dp_v8 a[DIRECT_OUTS][DIRECT_BLOCK / 8];
      for (int r = 0; r < DIRECT_OUTS; ++r)
        for (int j = 0; j < DIRECT_BLOCK / 8; ++j) a[r][j] = (dp_v8){0};
      for (int c = 0; c < d->cin; ++c)
        for (int ki = 0; ki < d->kh; ++ki)
          for (int kj = 0; kj < d->kw; ++kj) {
            const int64_t k = (c * d->kh + ki) * d->kw + kj;
            const float *s = xp + c * plane + (int64_t)ki * d->wp + kj + q0;
            float wv[DIRECT_OUTS];
            for (int r = 0; r < DIRECT_OUTS; ++r) wv[r] = r < on ? w[(int64_t)(o0 + r) * ws + k] : 0.0f;
            for (int j = 0; j < DIRECT_BLOCK / 8; ++j) {
              dp_v8 sv;
              V8_LOAD(sv, s + 8 * j);
              for (int r = 0; r < DIRECT_OUTS; ++r) a[r][j] += wv[r] * sv;
            }
          }
      for (int r = 0; r < on; ++r) memcpy(wide + r * d->len + q0, a[r], sizeof a[r]);
    }
    for (int r = 0; r < on; ++r) {
      const float bias = b ? b[o0 + r] : 0.0f;
      float *yo = y + (int64_t)(o0 + r) * d->oh * d->ow;
      const float *wr = wide + r * d->len;
      for (int i = 0; i < d->oh; ++i)
        for (int j = 0; j < d->ow; ++j) yo[(int64_t)i * d->ow + j] = wr[(int64_t)i * d->wp + j] + bias;
    }
  }
}

static int conv_is_direct(const dp_conv_geom *g) {
  /* "valid" only: ResNet-18's padded stem keeps the GEMM path, whose
   * roundings its sync-BatchNorm one-replica test was tuned against (with the
   * direct path there, that test's chaotic float noise grew past its bound) */
  return g->C == 1 && g->stride == 1 && g->pad == 0;
}

/* Thread t of nt takes the samples [N*t/nt, N*(t+1)/nt). */
static int direct_threads(int64_t N, int nthreads) { return N < nthreads ? (N < 1 ? 1 : (int)N) : nthreads; }

static dp_status conv_direct_forward(dp_device *dev, const dp_conv_geom *g, int64_t N, const float *x, const float *w,
                                     const float *b, float *y) {
  const direct_geom d = direct_geom_make(1, g->H + 2 * g->pad, g->W + 2 * g->pad, g->KH, g->KW);
  const int64_t in_sz = (int64_t)g->H * g->W, out_sz = (int64_t)g->O * g->OH * g->OW;
  const int64_t xp_sz = direct_input_floats(&d), per_thread = xp_sz + DIRECT_OUTS * d.len;
  const int nt = direct_threads(N, dev->nthreads);
  float *scratch;
  DP_TRY(cpu_scratch(dev, (size_t)(nt * per_thread), &scratch));
#pragma omp parallel num_threads(nt)
  {
    const int t = omp_get_thread_num();
    float *xp = scratch + t * per_thread, *wide = xp + xp_sz;
    memset(xp, 0, sizeof(float) * (size_t)xp_sz);
    for (int64_t n = N * t / nt; n < N * (t + 1) / nt; ++n) {
      direct_pad_input(&d, x + n * in_sz, g->H, g->W, g->pad, g->pad, xp);
      direct_conv(&d, xp, w, b, g->O, wide, y + n * out_sz);
    }
  }
  return DP_OK;
}

/* dw[o, ki, kj] = sum over samples and outputs of dy[o, q] * xp[q + ki*Wp + kj]
 * on the wide grid (dy spread to it with zeros in the discarded columns), in
 * DIRECT_LANES independent float sums per tap and sample, accumulated over the
 * samples in double (the stem of a BatchNorm network gets a dy whose products
 * cancel: float sums over the batch differed between a batch and its halves
 * by more than the replica tests allow); db the sums of dy. dx (if wanted) as described above. */
#define DIRECT_LANES 32

static int pool_is_2x2(const dp_pool_geom *g);
static void avgpool_relu_backward_2x2(const dp_pool_geom *g, const float *restrict r, const float *restrict dy,
                                      float *restrict dx);

/* pg non-NULL (a 2x2 pooling, cpu_conv2d_relu_avgpool_backward): dy is not
 * given but formed a sample at a time from the pooling's output gradient dp
 * and the convolution's output y, by the fused op's own plane function */
static dp_status conv_direct_backward(dp_device *dev, const dp_conv_geom *g, int64_t N, const float *x,
                                      const float *w, const float *dy, const dp_pool_geom *pg, const float *y,
                                      const float *dp, float *dx, float *dw, float *db) {
  const direct_geom d = direct_geom_make(1, g->H + 2 * g->pad, g->W + 2 * g->pad, g->KH, g->KW);
  const int ph = g->KH - 1 - g->pad, pw = g->KW - 1 - g->pad; /* dy's padding for dx */
  const direct_geom dt = direct_geom_make(g->O, g->OH + 2 * ph, g->OW + 2 * pw, g->KH, g->KW);
  const int64_t taps = (int64_t)g->KH * g->KW, wsz = g->O * taps, P = (int64_t)g->OH * g->OW;
  const int64_t in_sz = (int64_t)g->H * g->W, out_sz = g->O * P;
  const int64_t xp_sz = direct_input_floats(&d), dyw_sz = g->O * d.len;
  const int64_t dyp_sz = dx ? direct_input_floats(&dt) : 0, wide_sz = dx ? DIRECT_OUTS * dt.len : 0;
  const int64_t dys_sz = pg ? out_sz : 0, pool_sz = pg ? (int64_t)pg->OH * pg->OW : 0;
  /* per thread: the lanes of dw, db's sums, xp, dy on the wide grid, for dx
   * dy padded, with pg the sample's dy, and for dx a wide row */
  const int64_t lanes_sz = 2 * wsz * DIRECT_LANES; /* in floats; the lanes are doubles */
  const int64_t per_thread = (lanes_sz + g->O + xp_sz + dyw_sz + dyp_sz + dys_sz + wide_sz + 1) & ~(int64_t)1;
  const int nt = direct_threads(N, dev->nthreads);
  float *scratch;
  DP_TRY(cpu_scratch(dev, (size_t)(nt * per_thread + (dx ? wsz : 0)), &scratch));
  float *wt = scratch + nt * per_thread; /* the flipped filter (1, O, KH, KW) */
#pragma omp parallel num_threads(nt)
  {
    const int t = omp_get_thread_num();
    /* per_thread is even and the scratch 64-byte aligned: the lanes are aligned doubles */
    double *lanes = (double *)(void *)(scratch + t * per_thread);
    float *pdb = scratch + t * per_thread + lanes_sz, *xp = pdb + g->O, *dyw = xp + xp_sz;
    float *dyp = dyw + dyw_sz, *dys = dyp + dyp_sz, *wide = dys + dys_sz;
    memset(scratch + t * per_thread, 0, sizeof(float) * (size_t)(per_thread - wide_sz));
    if (dx) {
#pragma omp for schedule(static)
      for (int64_t i = 0; i < wsz; ++i) wt[i] = w[(i / taps) * taps + taps - 1 - i % taps];
    }
    for (int64_t n = N * t / nt; n < N * (t + 1) / nt; ++n) {
      const float *dyn = pg ? dys : dy + n * out_sz;
      if (pg)
        for (int o = 0; o < g->O; ++o)
          avgpool_relu_backward_2x2(pg, y + n * out_sz + o * P, dp + (n * g->O + o) * pool_sz, dys + o * P);
      direct_pad_input(&d, x + n * in_sz, g->H, g->W, g->pad, g->pad, xp);
      for (int o = 0; o < g->O; ++o) {
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < P; ++i) sum += dyn[o * P + i];
        pdb[o] += sum;
        for (int i = 0; i < g->OH; ++i)
          memcpy(dyw + o * d.len + (int64_t)i * d.wp, dyn + o * P + (int64_t)i * g->OW, sizeof(float) * (size_t)g->OW);
      }
      /* DIRECT_OUTS output channels a pass over each tap's input run (each
       * (o, tap) lane summed over q in the same order whatever their number) */
      for (int o0 = 0; o0 < g->O; o0 += DIRECT_OUTS) {
        const int on = g->O - o0 < DIRECT_OUTS ? g->O - o0 : DIRECT_OUTS;
        for (int ki = 0; ki < g->KH; ++ki)
          for (int kj = 0; kj < g->KW; ++kj) {
            const float *s = xp + (int64_t)ki * d.wp + kj, *a[DIRECT_OUTS];
            for (int r = 0; r < DIRECT_OUTS; ++r) a[r] = dyw + (int64_t)(o0 + (r < on ? r : 0)) * d.len;
            dp_v8 v[DIRECT_OUTS][DIRECT_LANES / 8];
            for (int r = 0; r < DIRECT_OUTS; ++r)
              for (int j = 0; j < DIRECT_LANES / 8; ++j) v[r][j] = (dp_v8){0};
            for (int64_t q = 0; q < d.len; q += DIRECT_LANES)
              for (int j = 0; j < DIRECT_LANES / 8; ++j) {
                dp_v8 sv;
                V8_LOAD(sv, s + q + 8 * j);
                for (int r = 0; r < DIRECT_OUTS; ++r) {
                  dp_v8 av;
                  V8_LOAD(av, a[r] + q + 8 * j);
                  v[r][j] += av * sv;
                }
              }
            for (int r = 0; r < on; ++r) {
              float vs[DIRECT_LANES];
              memcpy(vs, v[r], sizeof vs);
              double *l = lanes + (((o0 + r) * g->KH + ki) * g->KW + kj) * DIRECT_LANES;
              for (int j = 0; j < DIRECT_LANES; ++j) l[j] += vs[j];
            }
          }
      }
      if (dx) {
        direct_pad_input(&dt, dyn, g->OH, g->OW, ph, pw, dyp);
        direct_conv(&dt, dyp, wt, NULL, 1, wide, dx + n * in_sz);
      }
    }
  }
  /* dw, db = each thread's lanes added up, the threads in order */
  for (int64_t i = 0; i < wsz + g->O; ++i) {
    double s = 0.0;
    for (int t = 0; t < nt; ++t) {
      const float *p = scratch + t * per_thread;
      if (i < wsz) {
        const double *l = (const double *)(const void *)p + i * DIRECT_LANES;
        for (int j = 0; j < DIRECT_LANES; ++j) s += l[j];
      } else {
        s += p[lanes_sz + i - wsz];
      }
    }
    if (i < wsz)
      dw[i] = (float)s;
    else if (db)
      db[i - wsz] = (float)s;
  }
  return DP_OK;
}

/* keep's U for a Winograd layer worth keeping one (allocated on first use),
 * else NULL; the caller has cleared keep->valid */
static dp_status kept_u(dp_device *dev, const dp_conv_geom *g, dp_conv_keep *keep, float **u) {
  *u = NULL;
  if (!keep || !dp_winograd_worth_keeping(g)) return DP_OK;
  const size_t floats = dp_winograd_u_floats(g);
  if (keep->u && keep->floats != floats) { /* another geometry's (never on a model's layer) */
    cpu_release(dev, keep->u);
    keep->u = NULL;
  }
  if (!keep->u) {
    void *p;
    DP_TRY(cpu_alloc(dev, sizeof(float) * floats, &p));
    keep->u = p;
    keep->floats = floats;
  }
  *u = keep->u;
  return DP_OK;
}

static dp_status cpu_conv2d_forward(dp_device *dev, const dp_conv_geom *g, int64_t N, const float *x, const float *w,
                                    const float *b, float *y, dp_conv_keep *keep) {
  cpu_enter(dev);
  if (keep) keep->valid = 0; /* until a forward pass below has written its U */
  int winograd;
  DP_TRY(dp_wl_takes(g, dev->fast_conv, &winograd));
  if (winograd) { /* csrc/winograd_lanes.h */
    float *wino;
    DP_TRY(cpu_scratch(dev, dp_wl_scratch_floats(g, N, dev->nthreads, DP_WL_FORWARD), &wino));
    return dp_wl_forward(g, N, x, w, b, y, dev->nthreads, wino);
  }
  DP_TRY(dp_winograd_takes(g, &winograd));
  if (winograd) {
    float *wino;
    DP_TRY(cpu_scratch(dev, dp_winograd_scratch_floats(g, N, dev->nthreads), &wino));
    float *u;
    DP_TRY(kept_u(dev, g, keep, &u));
    DP_TRY(dp_winograd_forward(g, N, x, w, b, y, dev->nthreads, wino, u));
    if (u) keep->valid = N > 0;
    return DP_OK;
  }
  DP_TRY(dp_s2_takes(g, N, &winograd));
  if (winograd) { /* csrc/winograd_s2.h */
    float *buf;
    DP_TRY(cpu_scratch(dev, dp_s2_scratch_floats(g, N, dev->nthreads, DP_S2_FORWARD), &buf));
    return dp_s2_forward(g, N, x, w, b, y, dev->nthreads, buf);
  }
  int fft;
  DP_TRY(dp_fft_takes(g, &fft));
  if (fft) { /* csrc/fft_lanes.h */
    float *buf;
    DP_TRY(cpu_scratch(dev, dp_fft_scratch_floats(g, N, dev->nthreads, DP_FFT_FORWARD), &buf));
    return dp_fft_forward(g, N, x, w, b, y, dev->nthreads, buf);
  }
  if (conv_is_direct(g)) return conv_direct_forward(dev, g, N, x, w, b, y);
  int igemm;
  DP_TRY(dp_igemm_takes(g, &igemm));
  if (igemm) { /* csrc/implicit_gemm.h */
    float *buf;
    DP_TRY(cpu_scratch(dev, dp_igemm_scratch_floats(g, N, dev->nthreads, DP_IGEMM_FORWARD), &buf));
    return dp_igemm_forward(g, N, x, w, b, y, dev->nthreads, buf);
  }
  const int64_t K = (int64_t)g->C * g->KH * g->KW, P = (int64_t)g->OH * g->OW;
  const int64_t in_sz = (int64_t)g->C * g->H * g->W, out_sz = (int64_t)g->O * P;
  const conv_plan plan = conv_plan_make(g, N, dev->nthreads);
  const int64_t G = plan.G;
  int own_gemm; /* the GEMM on csrc/small_gemm.h's kernel, else the BLAS */
  DP_TRY(dp_small_gemm_on(&own_gemm));
  /* per thread: col (K, G*P), out (O, G*P), im2col's plane buffer */
  const int64_t per_thread = K * G * P + g->O * G * P + im2col_buffer_floats(g, G);
  float *scratch;
  DP_TRY(cpu_scratch(dev, (size_t)(plan.nt * per_thread), &scratch));
#pragma omp parallel num_threads(plan.nt)
  {
    const int t = omp_get_thread_num();
    float *col = scratch + (int64_t)t * per_thread;
    float *out = col + K * G * P;
    float *buf = out + g->O * G * P;
    const int64_t ngroups = conv_groups(&plan, N, t);
    for (int64_t k = 0; k < ngroups; ++k) {
      int64_t n0, cnt;
      conv_group(&plan, N, t, k, &n0, &cnt);
      const int64_t ld = cnt * P;
      im2col(g, x + n0 * in_sz, in_sz, cnt, col, ld, buf);
      /* out (O, cnt*P) = w (O, K) . col (K, cnt*P); a lone sample's out is its own y */
      float *res = cnt == 1 ? y + n0 * out_sz : out;
      dp_gemm(own_gemm, 0, 0, g->O, ld, K, w, K, col, ld, res, ld, 0, NULL);
      for (int64_t s = 0; s < cnt; ++s)
        for (int o = 0; o < g->O; ++o) {
          const float *src = res + o * ld + s * P;
          float *dst = y + (n0 + s) * out_sz + o * P;
          const float bias = b ? b[o] : 0.0f;
          for (int64_t p = 0; p < P; ++p) dst[p] = src[p] + bias;
        }
    }
  }
  return DP_OK;
}

/* dx of a stride-1 convolution is itself a convolution: of dy (O, OH, OW)
 * with the filter transposed and flipped, wt[c, o, ki, kj] = w[o, c, KH-1-ki,
 * KW-1-kj], padding K-1-pad, giving (C, H, W). Computed that way the GEMM
 * sums over O*KH*KW (not over O alone: 64 on ResNet-18's first stage) and
 * writes C*H*W values instead of the KH*KW times larger column matrix that
 * col2im then scatters back. Taken where the output is no smaller than the
 * input ("same" padding): otherwise it would multiply the padding's zeros
 * (twice the work on LeNet's 13x13 -> 9x9 conv). */
static int conv_dx_as_conv(const dp_conv_geom *g) {
  return g->stride == 1 && g->KH == g->KW && g->KH > 1 && g->pad <= g->KH - 1 &&
         (int64_t)g->H * g->W <= (int64_t)g->OH * g->OW;
}

static dp_conv_geom conv_dx_geom(const dp_conv_geom *g) {
  dp_conv_geom t = {g->O, g->OH, g->OW, g->C, g->KH, g->KW, 1, g->KH - 1 - g->pad, g->H, g->W};
  return t;
}

/* The form cpu_conv2d_backward takes for g: the first of these whose test takes it */
typedef enum { CONV_BWD_WL, CONV_BWD_WINOGRAD, CONV_BWD_S2, CONV_BWD_FFT, CONV_BWD_DIRECT, CONV_BWD_GEMM } conv_bwd_form;

static dp_status conv_backward_form(dp_device *dev, const dp_conv_geom *g, int64_t N, conv_bwd_form *form) {
  int takes;
  DP_TRY(dp_wl_takes(g, dev->fast_conv, &takes));
  *form = CONV_BWD_WL;
  if (!takes) {
    DP_TRY(dp_winograd_takes(g, &takes));
    *form = CONV_BWD_WINOGRAD;
  }
  if (!takes) {
    DP_TRY(dp_s2_takes(g, N, &takes));
    *form = CONV_BWD_S2;
  }
  if (!takes) {
    DP_TRY(dp_fft_takes(g, &takes));
    *form = CONV_BWD_FFT;
  }
  if (!takes) *form = conv_is_direct(g) ? CONV_BWD_DIRECT : CONV_BWD_GEMM;
  return DP_OK;
}

static dp_status cpu_conv2d_backward(dp_device *dev, const dp_conv_geom *g, int64_t N, const float *x, const float *w,
                                     const float *dy, float *dx, float *dw, float *db, dp_conv_keep *keep) {
  cpu_enter(dev);
  conv_bwd_form form;
  DP_TRY(conv_backward_form(dev, g, N, &form));
  if (form == CONV_BWD_WL) { /* csrc/winograd_lanes.h */
    float *wino;
    DP_TRY(cpu_scratch(dev, dp_wl_scratch_floats(g, N, dev->nthreads, DP_WL_BACKWARD), &wino));
    return dp_wl_backward(g, N, x, w, dy, dx, dw, db, dev->nthreads, wino);
  }
  if (form == CONV_BWD_WINOGRAD) { /* csrc/winograd.h */
    float *wino;
    DP_TRY(cpu_scratch(dev, dp_winograd_scratch_floats(g, N, dev->nthreads), &wino));
    const float *u = keep && keep->valid && keep->u && keep->floats == dp_winograd_u_floats(g) ? keep->u : NULL;
    if (dx) DP_TRY(dp_winograd_backward_dx(g, N, w, dy, dx, dev->nthreads, wino, u));
    return dp_winograd_backward_dw(g, N, x, dy, dw, db, dev->nthreads, wino);
  }
  if (form == CONV_BWD_S2) { /* csrc/winograd_s2.h */
    float *buf;
    DP_TRY(cpu_scratch(dev, dp_s2_scratch_floats(g, N, dev->nthreads, DP_S2_BACKWARD), &buf));
    return dp_s2_backward(g, N, x, w, dy, dx, dw, db, dev->nthreads, buf);
  }
  if (form == CONV_BWD_FFT) { /* csrc/fft_lanes.h */
    float *buf;
    DP_TRY(cpu_scratch(dev, dp_fft_scratch_floats(g, N, dev->nthreads, DP_FFT_BACKWARD), &buf));
    return dp_fft_backward(g, N, x, w, dy, dx, dw, db, dev->nthreads, buf);
  }
  if (form == CONV_BWD_DIRECT) return conv_direct_backward(dev, g, N, x, w, dy, NULL, NULL, NULL, dx, dw, db);
  /* the implicit GEMM's dw and db (csrc/implicit_gemm.h), and its dx where it
   * measured faster; otherwise dx below without the dw half (no im2col of x) */
  int igemm;
  DP_TRY(dp_igemm_takes(g, &igemm));
  if (igemm) {
    float *buf;
    DP_TRY(cpu_scratch(dev, dp_igemm_scratch_floats(g, N, dev->nthreads, DP_IGEMM_DW), &buf));
    DP_TRY(dp_igemm_backward_dw(g, N, x, dy, dw, db, dev->nthreads, buf));
    if (!dx) return DP_OK;
    if (!conv_dx_as_conv(g) && g->O >= DP_IGEMM_DX_MIN_OUT) {
      DP_TRY(cpu_scratch(dev, dp_igemm_scratch_floats(g, N, dev->nthreads, DP_IGEMM_DX), &buf));
      return dp_igemm_backward_dx(g, N, w, dy, dx, dev->nthreads, buf);
    }
  }
  const int64_t KK = (int64_t)g->KH * g->KW, K = (int64_t)g->C * KK, P = (int64_t)g->OH * g->OW;
  const int64_t in_sz = (int64_t)g->C * g->H * g->W, out_sz = (int64_t)g->O * P;
  const int64_t wsz = (int64_t)g->O * K;
  const conv_plan plan = conv_plan_make(g, N, dev->nthreads);
  const int64_t G = plan.G;
  const int nt = plan.nt;
  const int as_conv = dx && conv_dx_as_conv(g);
  const int dw_here = !igemm; /* dw and db by this path's GEMMs, or the implicit GEMM's above */
  const dp_conv_geom tg = conv_dx_geom(g);
  const int64_t HW = (int64_t)g->H * g->W;
  /* per thread: partial dw (O, K) and db (O) first, then col (K, G*P) (also
   * the transposed conv's columns (O*KH*KW, G*H*W)), dy gathered as
   * (O, G*P), and dcol (K, G*P) for col2im or dx gathered as (C, G*H*W) */
  const int64_t acc_sz = wsz + g->O;
  const int64_t col_sz = as_conv ? (K * G * P > g->O * KK * G * HW ? K * G * P : g->O * KK * G * HW) : K * G * P;
  const int64_t dcol_sz = !dx ? 0 : as_conv ? g->C * G * HW : K * G * P;
  const int64_t buf_sz = as_conv && im2col_buffer_floats(&tg, G) > im2col_buffer_floats(g, G)
                             ? im2col_buffer_floats(&tg, G)
                             : im2col_buffer_floats(g, G);
  int own_gemm; /* the GEMMs on csrc/small_gemm.h's kernel (with a packing buffer a thread), else the BLAS */
  DP_TRY(dp_small_gemm_on(&own_gemm));
  const int64_t pack_sz = own_gemm ? DP_SMALL_GEMM_PACK_FLOATS : 0;
  const int64_t per_thread = acc_sz + col_sz + g->O * G * P + dcol_sz + buf_sz + pack_sz;
  /* the transposed filter, (C, O*KH*KW), shared by the threads */
  const int64_t wt_sz = as_conv ? wsz : 0;
  float *scratch;
  DP_TRY(cpu_scratch(dev, (size_t)(nt * per_thread + wt_sz), &scratch));
  float *wt = scratch + nt * per_thread;
#pragma omp parallel num_threads(nt)
  {
    const int t = omp_get_thread_num();
    float *pdw = scratch + (int64_t)t * per_thread;
    float *pdb = pdw + wsz;
    float *col = pdb + g->O;
    float *dyg = col + col_sz;
    float *dcol = dyg + g->O * G * P;
    float *buf = dcol + dcol_sz;
    float *pack = buf + buf_sz;
    const int64_t ngroups = conv_groups(&plan, N, t);
    /* the first group's GEMM overwrites the partial sums; with no group (an
     * empty batch) they are zero */
    if (ngroups == 0) memset(pdw, 0, sizeof(float) * (size_t)acc_sz);
    if (as_conv) {
#pragma omp for schedule(static)
      for (int64_t oc = 0; oc < wsz / KK; ++oc) {
        const int64_t o = oc / g->C, c = oc % g->C;
        const float *src = w + oc * KK;
        float *dst = wt + (c * g->O + o) * KK;
        for (int64_t k = 0; k < KK; ++k) dst[k] = src[KK - 1 - k];
      }
    }
    for (int64_t k = 0; k < ngroups; ++k) {
      int64_t n0, cnt;
      conv_group(&plan, N, t, k, &n0, &cnt);
      const int64_t ld = cnt * P;
      if (dw_here) im2col(g, x + n0 * in_sz, in_sz, cnt, col, ld, buf);
      /* dyg row o = the samples' planes o side by side (written front to back,
       * as in im2col); a lone sample's dy is that already */
      const float *dys = dy + n0 * out_sz;
      if (cnt > 1) {
        for (int o = 0; o < g->O; ++o)
          for (int64_t s = 0; s < cnt; ++s)
            memcpy(dyg + o * ld + s * P, dy + (n0 + s) * out_sz + o * P, sizeof(float) * (size_t)P);
        dys = dyg;
      }
      /* pdw (O, K) (+)= dyg (O, cnt*P) . col^T (cnt*P, K) */
      if (dw_here) dp_gemm(own_gemm, 0, 1, g->O, K, ld, dys, ld, col, ld, pdw, K, k > 0, pack);
      for (int o = 0; dw_here && o < g->O; ++o) {
        const float *r = dys + o * ld;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < ld; ++i) sum += r[i];
        pdb[o] = k == 0 ? sum : pdb[o] + sum;
      }
      if (as_conv) {
        /* dxg (C, cnt*H*W) = wt (C, O*KH*KW) . im2col(dy) (O*KH*KW, cnt*H*W) */
        const int64_t ldx = cnt * HW;
        im2col(&tg, dy + n0 * out_sz, out_sz, cnt, col, ldx, buf);
        dp_gemm(own_gemm, 0, 0, g->C, ldx, g->O * KK, wt, g->O * KK, col, ldx, cnt == 1 ? dx + n0 * in_sz : dcol, ldx,
                0, NULL);
        for (int64_t s = 0; cnt > 1 && s < cnt; ++s)
          for (int c = 0; c < g->C; ++c)
            memcpy(dx + (n0 + s) * in_sz + c * HW, dcol + c * ldx + s * HW, sizeof(float) * (size_t)HW);
      } else if (dx) {
        /* dcol (K, cnt*P) = w^T (K, O) . dyg (O, cnt*P) */
        dp_gemm(own_gemm, 1, 0, K, ld, g->O, w, K, dys, ld, dcol, ld, 0, NULL);
        for (int64_t s = 0; s < cnt; ++s) col2im(g, dcol + s * P, ld, dx + (n0 + s) * in_sz);
      }
    }
  }
  /* dw, db = the threads' partials added in thread order */
  if (!dw_here) return DP_OK;
#pragma omp parallel for num_threads(dev->nthreads) schedule(static) if (acc_sz * nt > 65536)
  for (int64_t i = 0; i < acc_sz; ++i) {
    float s = 0.0f;
    for (int t = 0; t < nt; ++t) s += scratch[t * per_thread + i];
    if (i < wsz)
      dw[i] = s;
    else if (db)
      db[i - wsz] = s;
  }
  return DP_OK;
}

/* Backward passes of a direct convolution that fed a fused ReLU + pooling
 * straight from the pooling's output gradient (backend.h), for the count of
 * debug_counters()['conv_relu_pool'] */
static _Atomic long long conv_pool_fused;
long long dp_cpu_conv_relu_pool_count(void) { return atomic_load_explicit(&conv_pool_fused, memory_order_relaxed); }

static dp_status cpu_conv2d_relu_avgpool_backward(dp_device *dev, const dp_conv_geom *g, const dp_pool_geom *pg,
                                                  int64_t N, const float *x, const float *w, const float *y,
                                                  const float *dp, float *dx, float *dw, float *db, int *done) {
  *done = 0;
  /* only where cpu_conv2d_backward itself would take the direct loops (the same bits) */
  conv_bwd_form form;
  DP_TRY(conv_backward_form(dev, g, N, &form));
  if (form != CONV_BWD_DIRECT || !pool_is_2x2(pg)) return DP_OK;
  cpu_enter(dev);
  DP_TRY(conv_direct_backward(dev, g, N, x, w, NULL, pg, y, dp, dx, dw, db));
  atomic_fetch_add_explicit(&conv_pool_fused, 1, memory_order_relaxed);
  *done = 1;
  return DP_OK;
}

/* ---- dense ---------------------------------------------------------------- */

static dp_status cpu_dense_forward(dp_device *dev, int64_t N, int nin, int nout, const float *x, const float *w,
                                   const float *b, float *y) {
  cpu_enter(dev);
  if (N == 0) return DP_OK;
  for (int64_t n = 0; n < N; ++n)
    for (int o = 0; o < nout; ++o) y[n * nout + o] = b ? b[o] : 0.0f;
  /* y (N, nout) += x (N, nin) . w^T (nin, nout) */
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)N, nout, nin, 1.0f, x, nin, w, nin, 1.0f, y, nout);
  return DP_OK;
}

static dp_status cpu_dense_backward(dp_device *dev, int64_t N, int nin, int nout, const float *x, const float *w,
                                    const float *dy, float *dx, float *dw, float *db) {
  cpu_enter(dev);
  if (N == 0) {
    memset(dw, 0, sizeof(float) * (size_t)nout * nin);
    if (db) memset(db, 0, sizeof(float) * (size_t)nout);
    return DP_OK;
  }
  /* dw (nout, nin) = dy^T (nout, N) . x (N, nin) */
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, nout, nin, (int)N, 1.0f, dy, nout, x, nin, 0.0f, dw, nin);
  if (db) {
    for (int o = 0; o < nout; ++o) db[o] = 0.0f;
    for (int64_t n = 0; n < N; ++n)
      for (int o = 0; o < nout; ++o) db[o] += dy[n * nout + o];
  }
  /* dx (N, nin) = dy (N, nout) . w (nout, nin) */
  if (dx) cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)N, nin, nout, 1.0f, dy, nout, w, nin, 0.0f, dx, nin);
  return DP_OK;
}

/* ---- element-wise and pooling ------------------------------------------- */

static dp_status cpu_relu_forward(dp_device *dev, int64_t n, const float *x, float *y) {
#pragma omp parallel for simd num_threads(dev->nthreads) schedule(static) if (n > 32768)
  for (int64_t i = 0; i < n; ++i) y[i] = dp_relu_forward_elem(x[i]);
  return DP_OK;
}

static dp_status cpu_relu_backward(dp_device *dev, int64_t n, const float *y, const float *dy, float *dx) {
#pragma omp parallel for simd num_threads(dev->nthreads) schedule(static) if (n > 32768)
  for (int64_t i = 0; i < n; ++i) dx[i] = dp_relu_backward_elem(y[i], dy[i]);
  return DP_OK;
}

/* Per-axis window tables: input position p lies in output windows [lo[p], hi[p]].
 * Computed once per call with the same dp_pool_windows the GPU calls per element. */
typedef struct pool_tables {
  int *h_lo, *h_hi, *w_lo, *w_hi;
} pool_tables;

static dp_status pool_tables_make(const dp_pool_geom *g, pool_tables *t) {
  int *mem = malloc(sizeof(int) * 2 * (size_t)(g->H + g->W));
  if (!mem) return DP_FAIL(DP_ERR_MEMORY, "pooling: cannot allocate window tables");
  t->h_lo = mem;
  t->h_hi = mem + g->H;
  t->w_lo = mem + 2 * g->H;
  t->w_hi = t->w_lo + g->W;
  for (int h = 0; h < g->H; ++h) dp_pool_windows(h, g->k, g->stride, g->pad, g->OH, &t->h_lo[h], &t->h_hi[h]);
  for (int w = 0; w < g->W; ++w) dp_pool_windows(w, g->k, g->stride, g->pad, g->OW, &t->w_lo[w], &t->w_hi[w]);
  return DP_OK;
}

static void pool_tables_free(pool_tables *t) { free(t->h_lo); }

/* 2x2 windows at stride 2 without padding (LeNet's pools): every window lies
 * inside the plane and every input position in at most one window, so the
 * bodies' loops reduce to fixed sums that vectorise across a row. The
 * arithmetic is the bodies' own, in their order ((((0 + a) + b) + c) + d) *
 * (1 / 4), so the results are theirs bit for bit (tests/c/kernel_bodies.c). */
static int pool_is_2x2(const dp_pool_geom *g) { return g->k == 2 && g->stride == 2 && g->pad == 0; }

#if defined(__AVX512F__)
/* lane i of each: 2i and 2i + 1 of 32 floats in two registers (a permutation's
 * index), and i / 2 (or 8 + i / 2) of one: a row's pairs and their inverse */
static const int32_t POOL_EVEN[16] = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
static const int32_t POOL_ODD[16] = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
static const int32_t POOL_DUP_LO[16] = {0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7};
static const int32_t POOL_DUP_HI[16] = {8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15};
#endif

static void avgpool_forward_2x2(const dp_pool_geom *g, const float *restrict x, float *restrict y) {
  const float inv = 1.0f / (2.0f * 2.0f);
  for (int oh = 0; oh < g->OH; ++oh) {
    const float *r0 = x + (int64_t)2 * oh * g->W, *r1 = r0 + g->W;
    float *dst = y + (int64_t)oh * g->OW;
    int ow = 0;
#if defined(__AVX512F__)
    /* 16 outputs a step, the scalar loop's sums in its order */
    const __m512i ev = _mm512_loadu_si512(POOL_EVEN), od = _mm512_loadu_si512(POOL_ODD);
    for (; ow < g->OW; ow += 16) {
      const int n = g->OW - ow < 16 ? g->OW - ow : 16;
      const __mmask16 ml = dp_lanes_upto(2 * n), mh = dp_lanes_upto(2 * n - 16);
      const __m512 a0 = _mm512_maskz_loadu_ps(ml, r0 + 2 * ow), a1 = _mm512_maskz_loadu_ps(mh, r0 + 2 * ow + 16);
      const __m512 b0 = _mm512_maskz_loadu_ps(ml, r1 + 2 * ow), b1 = _mm512_maskz_loadu_ps(mh, r1 + 2 * ow + 16);
      __m512 sum = _mm512_add_ps(_mm512_setzero_ps(), _mm512_permutex2var_ps(a0, ev, a1));
      sum = _mm512_add_ps(sum, _mm512_permutex2var_ps(a0, od, a1));
      sum = _mm512_add_ps(sum, _mm512_permutex2var_ps(b0, ev, b1));
      sum = _mm512_add_ps(sum, _mm512_permutex2var_ps(b0, od, b1));
      _mm512_mask_storeu_ps(dst + ow, dp_lanes_upto(n), _mm512_mul_ps(sum, _mm512_set1_ps(inv)));
    }
#elif defined(__AVX2__)
    /* 8 outputs a step, the same sums in the same order; a row's evens and
     * odds come out as the pairs of outputs (0 1) (4 5) (2 3) (6 7), which one
     * permutation puts back. A last partial step is taken as the row's last 8
     * (the overlap written twice with the same values: AMD's masked stores are
     * slow); a row under 8 by the scalar loop */
    for (; g->OW >= 8 && ow < g->OW; ow += 8) {
      if (ow + 8 > g->OW) ow = g->OW - 8;
      const __m256 a0 = _mm256_loadu_ps(r0 + 2 * ow), a1 = _mm256_loadu_ps(r0 + 2 * ow + 8);
      const __m256 b0 = _mm256_loadu_ps(r1 + 2 * ow), b1 = _mm256_loadu_ps(r1 + 2 * ow + 8);
      __m256 sum = _mm256_add_ps(_mm256_setzero_ps(), _mm256_shuffle_ps(a0, a1, 0x88));
      sum = _mm256_add_ps(sum, _mm256_shuffle_ps(a0, a1, 0xDD));
      sum = _mm256_add_ps(sum, _mm256_shuffle_ps(b0, b1, 0x88));
      sum = _mm256_add_ps(sum, _mm256_shuffle_ps(b0, b1, 0xDD));
      sum = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(sum), 0xD8));
      _mm256_storeu_ps(dst + ow, _mm256_mul_ps(sum, _mm256_set1_ps(inv)));
    }
#endif
    for (; ow < g->OW; ++ow)
      dst[ow] = ((((0.0f + r0[2 * ow]) + r0[2 * ow + 1]) + r1[2 * ow]) + r1[2 * ow + 1]) * inv;
  }
}

static void avgpool_backward_2x2(const dp_pool_geom *g, const float *restrict dy, float *restrict dx) {
  const float inv = 1.0f / (2.0f * 2.0f);
  for (int oh = 0; oh < g->OH; ++oh) {
    const float *src = dy + (int64_t)oh * g->OW;
    float *d0 = dx + (int64_t)2 * oh * g->W, *d1 = d0 + g->W;
    for (int ow = 0; ow < g->OW; ++ow) {
      const float v = (0.0f + src[ow]) * inv; /* 0 + keeps the body's -0 -> +0 */
      d0[2 * ow] = v;
      d0[2 * ow + 1] = v;
      d1[2 * ow] = v;
      d1[2 * ow + 1] = v;
    }
    /* an odd width's last column lies in no window */
    for (int w = 2 * g->OW; w < g->W; ++w) d0[w] = d1[w] = 0.0f;
  }
  /* likewise an odd height's last row */
  for (int h = 2 * g->OH; h < g->H; ++h) memset(dx + (int64_t)h * g->W, 0, sizeof(float) * (size_t)g->W);
}

static void avgpool_plane_forward(const dp_pool_geom *g, const float *x, float *y) {
  if (pool_is_2x2(g)) {
    avgpool_forward_2x2(g, x, y);
    return;
  }
  for (int oh = 0; oh < g->OH; ++oh)
    for (int ow = 0; ow < g->OW; ++ow) y[oh * g->OW + ow] = dp_avgpool_forward_at(x, g, oh, ow);
}

/* Planes are spread over the threads; within a plane the loops are the bodies'. */
static dp_status cpu_avgpool_forward(dp_device *dev, const dp_pool_geom *g, int64_t N, const float *x, float *y) {
  const int64_t planes = N * g->C, in_sz = (int64_t)g->H * g->W, out_sz = (int64_t)g->OH * g->OW;
#pragma omp parallel for num_threads(dev->nthreads) schedule(static) if (planes * out_sz > 16384)
  for (int64_t p = 0; p < planes; ++p) avgpool_plane_forward(g, x + p * in_sz, y + p * out_sz);
  return DP_OK;
}

static dp_status cpu_avgpool_backward(dp_device *dev, const dp_pool_geom *g, int64_t N, const float *dy, float *dx) {
  const int64_t planes = N * g->C, in_sz = (int64_t)g->H * g->W, out_sz = (int64_t)g->OH * g->OW;
  if (pool_is_2x2(g)) {
#pragma omp parallel for num_threads(dev->nthreads) schedule(static) if (planes * in_sz > 16384)
    for (int64_t p = 0; p < planes; ++p) avgpool_backward_2x2(g, dy + p * out_sz, dx + p * in_sz);
    return DP_OK;
  }
  pool_tables t;
  DP_TRY(pool_tables_make(g, &t));
#pragma omp parallel for num_threads(dev->nthreads) schedule(static) if (planes * in_sz > 16384)
  for (int64_t p = 0; p < planes; ++p)
    for (int h = 0; h < g->H; ++h)
      for (int w = 0; w < g->W; ++w)
        dx[p * in_sz + h * g->W + w] =
            dp_avgpool_backward_at(dy + p * out_sz, g, t.h_lo[h], t.h_hi[h], t.w_lo[w], t.w_hi[w]);
  pool_tables_free(&t);
  return DP_OK;
}

/* ReLU + average pooling fused (backend.h): each plane's ReLU is written and
 * then pooled while it is in cache, and backward writes dx from dy and the
 * ReLU's output directly; the arithmetic is the separate ops', in their
 * order, so the results are theirs bit for bit (tests/test_fusion.py). */
static void relu_plane(int64_t n, const float *restrict x, float *restrict r) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) r[i] = dp_relu_forward_elem(x[i]);
}

/* The ReLU's output is not written (backend.h: the backward pass reads the
 * ReLU's input): each plane's goes through a thread's own buffer, in cache. */
static dp_status cpu_relu_avgpool_forward(dp_device *dev, const dp_pool_geom *g, int64_t N, const float *x, float *r,
                                          float *y) {
  (void)r;
  const int64_t planes = N * g->C, in_sz = (int64_t)g->H * g->W, out_sz = (int64_t)g->OH * g->OW;
  const int nt = planes * in_sz > 32768 ? dev->nthreads : 1;
  float *buf;
  DP_TRY(cpu_scratch(dev, (size_t)(nt * ((in_sz + 15) & ~(int64_t)15)), &buf));
#pragma omp parallel num_threads(nt)
  {
    float *plane = buf + omp_get_thread_num() * ((in_sz + 15) & ~(int64_t)15);
#pragma omp for schedule(static)
    for (int64_t p = 0; p < planes; ++p) {
      relu_plane(in_sz, x + p * in_sz, plane);
      avgpool_plane_forward(g, plane, y + p * out_sz);
    }
  }
  return DP_OK;
}

/* avgpool_backward_2x2 with each value passed through the ReLU's backward */
static void avgpool_relu_backward_2x2(const dp_pool_geom *g, const float *restrict r, const float *restrict dy,
                                      float *restrict dx) {
  const float inv = 1.0f / (2.0f * 2.0f);
  for (int oh = 0; oh < g->OH; ++oh) {
    const float *src = dy + (int64_t)oh * g->OW;
    const int64_t row = (int64_t)2 * oh * g->W;
    const float *r0 = r + row, *r1 = r0 + g->W;
    float *d0 = dx + row, *d1 = d0 + g->W;
    int ow = 0;
#if defined(__AVX512F__)
    /* 16 of dy a step into 32 of each row; relu_backward's mask: not (r <= 0), NaN kept */
    const __m512i lo = _mm512_loadu_si512(POOL_DUP_LO), hi = _mm512_loadu_si512(POOL_DUP_HI);
    for (; ow < g->OW; ow += 16) {
      const int n = g->OW - ow < 16 ? g->OW - ow : 16;
      const __mmask16 ml = dp_lanes_upto(2 * n), mh = dp_lanes_upto(2 * n - 16);
      const __m512 v = _mm512_mul_ps(_mm512_add_ps(_mm512_setzero_ps(), _mm512_maskz_loadu_ps(dp_lanes_upto(n), src + ow)),
                                     _mm512_set1_ps(inv));
      const __m512 vl = _mm512_permutexvar_ps(lo, v), vh = _mm512_permutexvar_ps(hi, v);
      const float *rr[2] = {r0, r1};
      float *dd[2] = {d0, d1};
      for (int k = 0; k < 2; ++k) {
        const __m512 xl = _mm512_maskz_loadu_ps(ml, rr[k] + 2 * ow), xh = _mm512_maskz_loadu_ps(mh, rr[k] + 2 * ow + 16);
        const __mmask16 kl = _mm512_cmp_ps_mask(xl, _mm512_setzero_ps(), _CMP_NLE_UQ);
        const __mmask16 kh = _mm512_cmp_ps_mask(xh, _mm512_setzero_ps(), _CMP_NLE_UQ);
        _mm512_mask_storeu_ps(dd[k] + 2 * ow, ml, _mm512_maskz_mov_ps(kl, vl));
        _mm512_mask_storeu_ps(dd[k] + 2 * ow + 16, mh, _mm512_maskz_mov_ps(kh, vh));
      }
    }
#elif defined(__AVX2__)
    /* 8 of dy a step into 16 of each row (each value twice: unpack, then the
     * halves' exchange; a last partial step as the forward's); relu_backward's
     * mask: not (r <= 0), NaN kept */
    for (; g->OW >= 8 && ow < g->OW; ow += 8) {
      if (ow + 8 > g->OW) ow = g->OW - 8;
      const __m256 v = _mm256_mul_ps(_mm256_add_ps(_mm256_setzero_ps(), _mm256_loadu_ps(src + ow)), _mm256_set1_ps(inv));
      const __m256 lo = _mm256_unpacklo_ps(v, v), hi = _mm256_unpackhi_ps(v, v);
      const __m256 vl = _mm256_permute2f128_ps(lo, hi, 0x20), vh = _mm256_permute2f128_ps(lo, hi, 0x31);
      const float *rr[2] = {r0, r1};
      float *dd[2] = {d0, d1};
      for (int k = 0; k < 2; ++k) {
        const __m256 xl = _mm256_loadu_ps(rr[k] + 2 * ow), xh = _mm256_loadu_ps(rr[k] + 2 * ow + 8);
        _mm256_storeu_ps(dd[k] + 2 * ow, _mm256_and_ps(_mm256_cmp_ps(xl, _mm256_setzero_ps(), _CMP_NLE_UQ), vl));
        _mm256_storeu_ps(dd[k] + 2 * ow + 8, _mm256_and_ps(_mm256_cmp_ps(xh, _mm256_setzero_ps(), _CMP_NLE_UQ), vh));
      }
    }
#endif
    for (; ow < g->OW; ++ow) {
      const float v = (0.0f + src[ow]) * inv;
      d0[2 * ow] = dp_relu_backward_elem(r0[2 * ow], v);
      d0[2 * ow + 1] = dp_relu_backward_elem(r0[2 * ow + 1], v);
      d1[2 * ow] = dp_relu_backward_elem(r1[2 * ow], v);
      d1[2 * ow + 1] = dp_relu_backward_elem(r1[2 * ow + 1], v);
    }
    for (int w = 2 * g->OW; w < g->W; ++w) {
      d0[w] = dp_relu_backward_elem(r0[w], 0.0f);
      d1[w] = dp_relu_backward_elem(r1[w], 0.0f);
    }
  }
  for (int64_t i = (int64_t)2 * g->OH * g->W; i < (int64_t)g->H * g->W; ++i) dx[i] = dp_relu_backward_elem(r[i], 0.0f);
}

static dp_status cpu_avgpool_relu_backward(dp_device *dev, const dp_pool_geom *g, int64_t N, const float *r,
                                           const float *dy, float *dx) {
  const int64_t planes = N * g->C, in_sz = (int64_t)g->H * g->W, out_sz = (int64_t)g->OH * g->OW;
  if (pool_is_2x2(g)) {
#pragma omp parallel for num_threads(dev->nthreads) schedule(static) if (planes * in_sz > 32768)
    for (int64_t p = 0; p < planes; ++p) avgpool_relu_backward_2x2(g, r + p * in_sz, dy + p * out_sz, dx + p * in_sz);
    return DP_OK;
  }
  pool_tables t;
  DP_TRY(pool_tables_make(g, &t));
#pragma omp parallel for num_threads(dev->nthreads) schedule(static) if (planes * in_sz > 32768)
  for (int64_t p = 0; p < planes; ++p) {
    const float *rp = r + p * in_sz;
    float *dxp = dx + p * in_sz;
    for (int h = 0; h < g->H; ++h)
      for (int w = 0; w < g->W; ++w) {
        const float v = dp_avgpool_backward_at(dy + p * out_sz, g, t.h_lo[h], t.h_hi[h], t.w_lo[w], t.w_hi[w]);
        dxp[h * g->W + w] = dp_relu_backward_elem(rp[h * g->W + w], v);
      }
  }
  pool_tables_free(&t);
  return DP_OK;
}

static dp_status cpu_maxpool_forward(dp_device *dev, const dp_pool_geom *g, int64_t N, const float *x, float *y,
                                     int32_t *arg) {
  const int64_t planes = N * g->C, in_sz = (int64_t)g->H * g->W, out_sz = (int64_t)g->OH * g->OW;
#pragma omp parallel for num_threads(dev->nthreads) schedule(static) if (planes * out_sz > 16384)
  for (int64_t p = 0; p < planes; ++p)
    for (int oh = 0; oh < g->OH; ++oh)
      for (int ow = 0; ow < g->OW; ++ow) {
        int64_t o = p * out_sz + oh * g->OW + ow;
        y[o] = dp_maxpool_forward_at(x + p * in_sz, g, oh, ow, &arg[o]);
      }
  return DP_OK;
}

static dp_status cpu_maxpool_backward(dp_device *dev, const dp_pool_geom *g, int64_t N, const float *dy,
                                      const int32_t *arg, float *dx) {
  const int64_t planes = N * g->C, in_sz = (int64_t)g->H * g->W, out_sz = (int64_t)g->OH * g->OW;
  pool_tables t;
  DP_TRY(pool_tables_make(g, &t));
#pragma omp parallel for num_threads(dev->nthreads) schedule(static) if (planes * in_sz > 16384)
  for (int64_t p = 0; p < planes; ++p)
    for (int h = 0; h < g->H; ++h)
      for (int w = 0; w < g->W; ++w)
        dx[p * in_sz + h * g->W + w] = dp_maxpool_backward_at(dy + p * out_sz, arg + p * out_sz, g, h, w, t.h_lo[h],
                                                              t.h_hi[h], t.w_lo[w], t.w_hi[w]);
  pool_tables_free(&t);
  return DP_OK;
}

static dp_status cpu_softmax_xent(dp_device *dev, int64_t N, int K, const float *logits, const int32_t *labels,
                                  float scale, float *dlogits, double *loss_sum, int64_t *correct) {
  float *row_loss;
  DP_TRY(cpu_scratch(dev, (size_t)(2 * N + 1), &row_loss));
  float *row_hit = row_loss + N;
#pragma omp parallel for num_threads(dev->nthreads) schedule(static) if (N * K > 65536)
  for (int64_t n = 0; n < N; ++n) {
    int hit;
    row_loss[n] = dp_softmax_xent_row(logits + n * K, K, labels[n], scale, dlogits ? dlogits + n * K : NULL, &hit);
    row_hit[n] = (float)hit;
  }
  double s = 0.0;
  int64_t c = 0;
  for (int64_t n = 0; n < N; ++n) {
    s += row_loss[n];
    c += row_hit[n] != 0.0f;
  }
  cpu_ctx *ctx = dev->ctx;
  ctx->loss_flag = dp_loss_flag(row_loss, N);
  ctx->pending_loss = loss_sum ? 0.0 : s; /* computed already: "pending" only in name */
  ctx->pending_correct = loss_sum ? 0 : c;
  if (loss_sum) *loss_sum = s;
  if (correct) *correct = c;
  return DP_OK;
}

static dp_status cpu_metrics_read(dp_device *dev, double *loss_sum, int64_t *correct) {
  cpu_ctx *ctx = dev->ctx;
  *loss_sum = ctx->pending_loss;
  *correct = ctx->pending_correct;
  ctx->pending_loss = 0.0;
  ctx->pending_correct = 0;
  return DP_OK;
}

static dp_status cpu_loss_flag(dp_device *dev, float *flag) {
  *flag = ((cpu_ctx *)dev->ctx)->loss_flag;
  return DP_OK;
}

static dp_status cpu_restore_unless_allowed(dp_device *dev, int64_t n, float *dst, const float *saved,
                                            const float *guard) {
  if (!dp_step_allowed(guard) && n > 0) memcpy(dst, saved, sizeof(float) * (size_t)n);
  return DP_OK;
}

static dp_status cpu_sgd_update(dp_device *dev, int64_t n, float *w, const float *g, float *v, float lr, float mu,
                                float wd, const float *guard) {
  if (!dp_step_allowed(guard)) return DP_OK; /* the step's loss is not finite: no update */
  if (mu == 0.0f) {
    /* a literal 0 folds the body's momentum branch away, so this loop vectorises too */
#pragma omp parallel for simd num_threads(dev->nthreads) schedule(static) if (n > 65536)
    for (int64_t i = 0; i < n; ++i) dp_sgd_elem(w, g, v, i, lr, 0.0f, wd);
  } else {
#pragma omp parallel for simd num_threads(dev->nthreads) schedule(static) if (n > 65536)
    for (int64_t i = 0; i < n; ++i) dp_sgd_elem(w, g, v, i, lr, mu, wd);
  }
  return DP_OK;
}

static dp_status cpu_add(dp_device *dev, int64_t n, const float *a, const float *b, float *y) {
#pragma omp parallel for simd num_threads(dev->nthreads) schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) y[i] = dp_add_elem(a[i], b[i]);
  return DP_OK;
}

static dp_status cpu_add_relu(dp_device *dev, int64_t n, const float *a, const float *b, float *y) {
#pragma omp parallel for simd num_threads(dev->nthreads) schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) y[i] = dp_relu_forward_elem(dp_add_elem(a[i], b[i]));
  return DP_OK;
}

static dp_status cpu_scale(dp_device *dev, int64_t n, float *x, float alpha) {
  for (int64_t i = 0; i < n; ++i) x[i] *= alpha;
  return DP_OK;
}

static dp_status cpu_global_avgpool_forward(dp_device *dev, int64_t N, int C, int HW, const float *x, float *y) {
  const float inv = 1.0f / (float)HW;
#pragma omp parallel for num_threads(dev->nthreads) schedule(static) if (N * C * HW > 65536)
  for (int64_t p = 0; p < N * C; ++p) y[p] = dp_row_sum(x + p * HW, HW) * inv;
  return DP_OK;
}

static dp_status cpu_global_avgpool_backward(dp_device *dev, int64_t N, int C, int HW, const float *dy, float *dx) {
  const float inv = 1.0f / (float)HW;
#pragma omp parallel for num_threads(dev->nthreads) schedule(static) if (N * C * HW > 65536)
  for (int64_t p = 0; p < N * C; ++p)
    for (int i = 0; i < HW; ++i) dx[p * HW + i] = dy[p] * inv;
  return DP_OK;
}

/* BatchNorm's per-channel sums over the batch accumulate in double, by fixed
 * groups of samples (winograd.h: dp_sample_groups), each group's samples in
 * order and the groups in order: reproducible whatever the threads, and
 * accurate over N*HW values (50,000 for ResNet-18's first stage at batch
 * 64). bn_partials: the groups' partials, k doubles per group and channel,
 * in the scratch. */
static dp_status bn_partials(dp_device *dev, int64_t N, int C, int k, double **out) {
  float *p;
  DP_TRY(cpu_scratch(dev, (size_t)(2 * k * dp_sample_groups(N) * (int64_t)C), &p));
  *out = (double *)(void *)p; /* the scratch is 64-byte aligned */
  return DP_OK;
}

static dp_status cpu_bn_sums(dp_device *dev, int64_t N, int C, int HW, const float *x, const float *mean,
                             float *out) {
  const int64_t G = dp_sample_groups(N);
  double *part;
  DP_TRY(bn_partials(dev, N, C, 1, &part));
#pragma omp parallel num_threads(dev->nthreads) if (N * C * HW > 65536)
  {
#pragma omp for schedule(static)
    for (int64_t g = 0; g < G; ++g) {
      double *pg = part + g * C;
      for (int c = 0; c < C; ++c) pg[c] = 0.0;
      for (int64_t n = N * g / G; n < N * (g + 1) / G; ++n)
        for (int c = 0; c < C; ++c) {
          const float *row = x + (n * C + c) * HW;
          float sum = 0.0f;
          if (mean) {
            const float m = mean[c];
#pragma omp simd reduction(+ : sum)
            for (int i = 0; i < HW; ++i) sum += (row[i] - m) * (row[i] - m);
          } else {
#pragma omp simd reduction(+ : sum)
            for (int i = 0; i < HW; ++i) sum += row[i];
          }
          pg[c] += sum;
        }
    }
#pragma omp for schedule(static)
    for (int c = 0; c < C; ++c) {
      double s = 0.0;
      for (int64_t g = 0; g < G; ++g) s += part[g * C + c];
      out[c] = (float)s;
    }
  }
  return DP_OK;
}

static dp_status cpu_bn_finalize(dp_device *dev, int C, const float *sqdev, float count, const float *mean, float eps,
                                 float momentum, int update_running, float *invstd, float *running_mean,
                                 float *running_var) {
  for (int c = 0; c < C; ++c)
    dp_bn_finalize_channel(sqdev[c], count, mean[c], eps, momentum, update_running, &invstd[c], &running_mean[c],
                           &running_var[c]);
  return DP_OK;
}

/* y = bn(x), or with relu relu(bn(x)) (the fused pass: one read, one write) */
static void bn_apply_pass(dp_device *dev, int64_t N, int C, int HW, const float *x, const float *mean,
                          const float *invstd, const float *gamma, const float *beta, float *y, int relu) {
#pragma omp parallel for num_threads(dev->nthreads) schedule(static) if (N * C * HW > 65536)
  for (int64_t p = 0; p < N * C; ++p) {
    const int c = (int)(p % C);
    const float m = mean[c], s = invstd[c], g = gamma[c], b = beta[c];
    if (relu) {
#pragma omp simd
      for (int i = 0; i < HW; ++i) y[p * HW + i] = dp_relu_forward_elem(dp_bn_apply_elem(x[p * HW + i], m, s, g, b));
    } else {
#pragma omp simd
      for (int i = 0; i < HW; ++i) y[p * HW + i] = dp_bn_apply_elem(x[p * HW + i], m, s, g, b);
    }
  }
}

static dp_status cpu_bn_apply(dp_device *dev, int64_t N, int C, int HW, const float *x, const float *mean,
                              const float *invstd, const float *gamma, const float *beta, float *y) {
  bn_apply_pass(dev, N, C, HW, x, mean, invstd, gamma, beta, y, 0);
  return DP_OK;
}

static dp_status cpu_bn_apply_relu(dp_device *dev, int64_t N, int C, int HW, const float *x, const float *mean,
                                   const float *invstd, const float *gamma, const float *beta, float *y) {
  bn_apply_pass(dev, N, C, HW, x, mean, invstd, gamma, beta, y, 1);
  return DP_OK;
}

static dp_status cpu_bn_backward_sums(dp_device *dev, int64_t N, int C, int HW, const float *x, const float *dy,
                                      const float *mean, const float *invstd, const float *gamma,
                                      const float *relu_beta, float *sum_dy, float *sum_dy_xhat) {
  /* by groups of samples, as cpu_bn_sums: 0.98 -> 0.75 ms a pass on 64x28x28 at batch 64 */
  const int64_t G = dp_sample_groups(N);
  double *part; /* group g's sums of dy at part[2 g C], of dy * xhat at part[(2 g + 1) C] */
  DP_TRY(bn_partials(dev, N, C, 2, &part));
#pragma omp parallel num_threads(dev->nthreads) if (N * C * HW > 65536)
  {
#pragma omp for schedule(static)
    for (int64_t g = 0; g < G; ++g) {
      double *pa = part + 2 * g * C, *pb = pa + C;
      for (int c = 0; c < C; ++c) pa[c] = pb[c] = 0.0;
      for (int64_t n = N * g / G; n < N * (g + 1) / G; ++n)
        for (int c = 0; c < C; ++c) {
          const float m = mean[c], s = invstd[c];
          const float *xr = x + (n * C + c) * HW, *dr = dy + (n * C + c) * HW;
          float qa = 0.0f, qb = 0.0f;
          if (relu_beta) {
            const float gm = gamma[c], be = relu_beta[c];
#pragma omp simd reduction(+ : qa, qb)
            for (int i = 0; i < HW; ++i) {
              const float d = dp_bn_relu_dy(xr[i], dr[i], m, s, gm, be);
              qa += d;
              qb += d * ((xr[i] - m) * s);
            }
          } else {
#pragma omp simd reduction(+ : qa, qb)
            for (int i = 0; i < HW; ++i) {
              qa += dr[i];
              qb += dr[i] * ((xr[i] - m) * s);
            }
          }
          pa[c] += qa;
          pb[c] += qb;
        }
    }
#pragma omp for schedule(static)
    for (int c = 0; c < C; ++c) {
      double a = 0.0, b = 0.0;
      for (int64_t g = 0; g < G; ++g) {
        a += part[2 * g * C + c];
        b += part[(2 * g + 1) * C + c];
      }
      sum_dy[c] = (float)a;
      sum_dy_xhat[c] = (float)b;
    }
  }
  return DP_OK;
}

static dp_status cpu_bn_backward_dx(dp_device *dev, int64_t N, int C, int HW, const float *x, const float *dy,
                                    const float *mean, const float *invstd, const float *gamma,
                                    const float *relu_beta, const float *sum_dy, const float *sum_dy_xhat,
                                    float inv_count, float *dx) {
#pragma omp parallel for num_threads(dev->nthreads) schedule(static) if (N * C * HW > 65536)
  for (int64_t p = 0; p < N * C; ++p) {
    const int c = (int)(p % C);
    const float m = mean[c], s = invstd[c], g = gamma[c], a = sum_dy[c], b = sum_dy_xhat[c];
    if (relu_beta) {
      const float be = relu_beta[c];
#pragma omp simd
      for (int i = 0; i < HW; ++i) {
        const float xi = x[p * HW + i];
        dx[p * HW + i] = dp_bn_backward_elem(xi, dp_bn_relu_dy(xi, dy[p * HW + i], m, s, g, be), m, s, g, a, b,
                                             inv_count);
      }
    } else {
#pragma omp simd
      for (int i = 0; i < HW; ++i)
        dx[p * HW + i] = dp_bn_backward_elem(x[p * HW + i], dy[p * HW + i], m, s, g, a, b, inv_count);
    }
  }
  return DP_OK;
}

static dp_status cpu_synchronize(dp_device *dev) { return DP_OK; }

/* The CPU's streams and events: tokens. A call on a CPU device has finished
 * when it returns, so there is nothing to order. */
static char cpu_token;

static dp_status cpu_stream_create(dp_device *dev, dp_stream **out) {
  *out = (dp_stream *)&cpu_token;
  return DP_OK;
}

static void cpu_stream_destroy(dp_device *dev, dp_stream *s) {}

static dp_status cpu_event_create(dp_device *dev, dp_event **out) {
  *out = (dp_event *)&cpu_token;
  return DP_OK;
}

static void cpu_event_destroy(dp_device *dev, dp_event *e) {}

static dp_status cpu_event_record(dp_device *dev, dp_event *e, dp_stream *s) { return DP_OK; }

static dp_status cpu_event_wait(dp_device *dev, dp_stream *s, dp_event *e) { return DP_OK; }

static void cpu_destroy(dp_device *dev) {
  cpu_ctx *c = dev->ctx;
  free(c->scratch);
  free(c);
}

static const dp_backend cpu_backend = {
    .name = "cpu",
    .alloc = cpu_alloc,
    .release = cpu_release,
    .copy_to_device = cpu_copy,
    .copy_to_host = cpu_copy,
    .fill = cpu_fill,
    .u8_to_unit = cpu_u8_to_unit,
    .gather_rows = cpu_gather_rows,
    .conv2d_forward = cpu_conv2d_forward,
    .conv2d_backward = cpu_conv2d_backward,
    .dense_forward = cpu_dense_forward,
    .dense_backward = cpu_dense_backward,
    .relu_forward = cpu_relu_forward,
    .relu_backward = cpu_relu_backward,
    .avgpool_forward = cpu_avgpool_forward,
    .avgpool_backward = cpu_avgpool_backward,
    .relu_avgpool_forward = cpu_relu_avgpool_forward,
    .avgpool_relu_backward = cpu_avgpool_relu_backward,
    .conv2d_relu_avgpool_backward = cpu_conv2d_relu_avgpool_backward,
    .maxpool_forward = cpu_maxpool_forward,
    .maxpool_backward = cpu_maxpool_backward,
    .softmax_xent = cpu_softmax_xent,
    .metrics_read = cpu_metrics_read,
    .sgd_update = cpu_sgd_update,
    .loss_flag = cpu_loss_flag,
    .restore_unless_allowed = cpu_restore_unless_allowed,
    .add = cpu_add,
    .add_relu = cpu_add_relu,
    .scale = cpu_scale,
    .global_avgpool_forward = cpu_global_avgpool_forward,
    .global_avgpool_backward = cpu_global_avgpool_backward,
    .bn_sums = cpu_bn_sums,
    .bn_finalize = cpu_bn_finalize,
    .bn_apply = cpu_bn_apply,
    .bn_apply_relu = cpu_bn_apply_relu,
    .bn_backward_sums = cpu_bn_backward_sums,
    .bn_backward_dx = cpu_bn_backward_dx,
    .synchronize = cpu_synchronize,
    .stream_create = cpu_stream_create,
    .stream_destroy = cpu_stream_destroy,
    .event_create = cpu_event_create,
    .event_destroy = cpu_event_destroy,
    .event_record = cpu_event_record,
    .event_wait = cpu_event_wait,
    .destroy = cpu_destroy,
};

const dp_backend *dp_cpu_backend(void) { return &cpu_backend; }

int dp_cpu_core_count(void) {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) {
    int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  int n = omp_get_num_procs();
  return n > 0 ? n : 1;
}

dp_status dp_cpu_device_init(dp_device *dev, int index, int nthreads) {
  if (nthreads < 1) return DP_FAIL(DP_ERR_VALUE, "cpu:%d: thread count must be >= 1, got %d", index, nthreads);
  cpu_ctx *c = calloc(1, sizeof *c);
  if (!c) return DP_FAIL(DP_ERR_MEMORY, "cpu:%d: cannot allocate the device context", index);
  memset(dev, 0, sizeof *dev);
  dev->kind = DP_DEVICE_CPU;
  dev->index = index;
  dev->nthreads = nthreads;
  dev->backend = &cpu_backend;
  dev->ctx = c;
  snprintf(dev->name, sizeof dev->name, "cpu:%d", index);
  return DP_OK;
}

