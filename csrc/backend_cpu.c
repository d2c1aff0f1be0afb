/* backend_cpu.c — the CPU backend: OpenMP over the DP_HD bodies of
 * kernels/dp_kernels.h, GEMM through CBLAS (OpenBLAS), convolution as
 * im2col + GEMM per sample, samples spread over the device's threads.
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
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"

typedef struct cpu_ctx {
  float *scratch;        /* grows on demand; used only by the device's own thread */
  size_t scratch_floats;
} cpu_ctx;

static void cpu_enter(dp_device *dev) { omp_set_num_threads(dev->nthreads); }

static dp_status cpu_scratch(dp_device *dev, size_t floats, float **out) {
  cpu_ctx *c = dev->ctx;
  if (floats > c->scratch_floats) {
    free(c->scratch);
    c->scratch = NULL;
    c->scratch_floats = 0;
    /* 64-byte aligned for the vector units */
    size_t bytes = (floats * sizeof(float) + 63) & ~(size_t)63;
    void *p = aligned_alloc(64, bytes);
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
  void *p = aligned_alloc(64, rounded);
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

static dp_status cpu_u8_to_unit(dp_device *dev, float *y, const uint8_t *x, int64_t n) {
#pragma omp parallel for simd num_threads(dev->nthreads) schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) y[i] = dp_u8_to_unit_elem(x[i]);
  return DP_OK;
}

/* ---- convolution ---------------------------------------------------------- */

/* The output columns [lo, hi) whose input column o*stride - pad + kj is inside [0, W). */
static void valid_range(int out, int in, int stride, int pad, int kk, int *lo, int *hi) {
  int l = pad - kk > 0 ? (pad - kk + stride - 1) / stride : 0;
  int h = (in - 1 + pad - kk) >= 0 ? (in - 1 + pad - kk) / stride + 1 : 0;
  if (h > out) h = out;
  if (l > h) l = h;
  *lo = l;
  *hi = h;
}

/* col (C*KH*KW, OH*OW) from one sample x (C, H, W); row r = (c, ki, kj). */
static void im2col(const dp_conv_geom *g, const float *x, float *col) {
  const int P = g->OH * g->OW;
  for (int c = 0; c < g->C; ++c)
    for (int ki = 0; ki < g->KH; ++ki)
      for (int kj = 0; kj < g->KW; ++kj) {
        float *row = col + (int64_t)((c * g->KH + ki) * g->KW + kj) * P;
        int lo, hi;
        valid_range(g->OW, g->W, g->stride, g->pad, kj, &lo, &hi);
        for (int oh = 0; oh < g->OH; ++oh) {
          float *r = row + oh * g->OW;
          int h = oh * g->stride - g->pad + ki;
          if (h < 0 || h >= g->H) {
            memset(r, 0, sizeof(float) * (size_t)g->OW);
            continue;
          }
          const float *src = x + ((int64_t)c * g->H + h) * g->W - g->pad + kj;
          for (int ow = 0; ow < lo; ++ow) r[ow] = 0.0f;
          if (g->stride == 1)
            memcpy(r + lo, src + lo, sizeof(float) * (size_t)(hi - lo));
          else
            for (int ow = lo; ow < hi; ++ow) r[ow] = src[ow * g->stride];
          for (int ow = hi; ow < g->OW; ++ow) r[ow] = 0.0f;
        }
      }
}

/* dx (C, H, W) = the col2im scatter-add of dcol; dx is overwritten. */
static void col2im(const dp_conv_geom *g, const float *dcol, float *dx) {
  const int P = g->OH * g->OW;
  memset(dx, 0, sizeof(float) * (size_t)g->C * g->H * g->W);
  for (int c = 0; c < g->C; ++c)
    for (int ki = 0; ki < g->KH; ++ki)
      for (int kj = 0; kj < g->KW; ++kj) {
        const float *row = dcol + (int64_t)((c * g->KH + ki) * g->KW + kj) * P;
        int lo, hi;
        valid_range(g->OW, g->W, g->stride, g->pad, kj, &lo, &hi);
        for (int oh = 0; oh < g->OH; ++oh) {
          int h = oh * g->stride - g->pad + ki;
          if (h < 0 || h >= g->H) continue;
          const float *r = row + oh * g->OW;
          float *dst = dx + ((int64_t)c * g->H + h) * g->W - g->pad + kj;
          for (int ow = lo; ow < hi; ++ow) dst[ow * g->stride] += r[ow];
        }
      }
}

static int conv_is_pointwise(const dp_conv_geom *g) {
  return g->KH == 1 && g->KW == 1 && g->stride == 1 && g->pad == 0;
}

static int threads_for(dp_device *dev, int64_t items) {
  return items < dev->nthreads ? (items < 1 ? 1 : (int)items) : dev->nthreads;
}

static dp_status cpu_conv2d_forward(dp_device *dev, const dp_conv_geom *g, int64_t N, const float *x, const float *w,
                                    const float *b, float *y) {
  cpu_enter(dev);
  const int64_t K = (int64_t)g->C * g->KH * g->KW, P = (int64_t)g->OH * g->OW;
  const int64_t in_sz = (int64_t)g->C * g->H * g->W, out_sz = (int64_t)g->O * P;
  const int nt = threads_for(dev, N);
  const int pointwise = conv_is_pointwise(g);
  float *scratch = NULL;
  if (!pointwise) DP_TRY(cpu_scratch(dev, (size_t)(nt * K * P), &scratch));
#pragma omp parallel num_threads(nt)
  {
    float *col = pointwise ? NULL : scratch + (int64_t)omp_get_thread_num() * K * P;
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const float *xn = x + n * in_sz;
      float *yn = y + n * out_sz;
      const float *src = xn;
      if (!pointwise) {
        im2col(g, xn, col);
        src = col;
      }
      for (int o = 0; o < g->O; ++o)
        for (int64_t p = 0; p < P; ++p) yn[o * P + p] = b ? b[o] : 0.0f;
      /* yn (O, P) += w (O, K) . col (K, P) */
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, g->O, (int)P, (int)K, 1.0f, w, (int)K, src, (int)P, 1.0f,
                  yn, (int)P);
    }
  }
  return DP_OK;
}

static dp_status cpu_conv2d_backward(dp_device *dev, const dp_conv_geom *g, int64_t N, const float *x, const float *w,
                                     const float *dy, float *dx, float *dw, float *db) {
  cpu_enter(dev);
  const int64_t K = (int64_t)g->C * g->KH * g->KW, P = (int64_t)g->OH * g->OW;
  const int64_t in_sz = (int64_t)g->C * g->H * g->W, out_sz = (int64_t)g->O * P;
  const int64_t wsz = (int64_t)g->O * K;
  const int nt = threads_for(dev, N);
  const int pointwise = conv_is_pointwise(g);
  /* per thread: col (K,P), dcol (K,P), partial dw (O,K), partial db (O) */
  const int64_t per_thread = 2 * K * P + wsz + g->O;
  float *scratch;
  DP_TRY(cpu_scratch(dev, (size_t)(nt * per_thread), &scratch));
#pragma omp parallel num_threads(nt)
  {
    const int t = omp_get_thread_num();
    float *col = scratch + t * per_thread;
    float *dcol = col + K * P;
    float *pdw = dcol + K * P;
    float *pdb = pdw + wsz;
    memset(pdw, 0, sizeof(float) * (size_t)(wsz + g->O));
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const float *xn = x + n * in_sz;
      const float *dyn = dy + n * out_sz;
      const float *src = xn;
      if (!pointwise) {
        im2col(g, xn, col);
        src = col;
      }
      /* pdw (O, K) += dy_n (O, P) . col^T (P, K) */
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, g->O, (int)K, (int)P, 1.0f, dyn, (int)P, src, (int)P, 1.0f,
                  pdw, (int)K);
      for (int o = 0; o < g->O; ++o) pdb[o] += dp_row_sum(dyn + o * P, P);
      if (dx) {
        float *dxn = dx + n * in_sz;
        float *dst = pointwise ? dxn : dcol;
        /* dcol (K, P) = w^T (K, O) . dy_n (O, P) */
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)K, (int)P, g->O, 1.0f, w, (int)K, dyn, (int)P, 0.0f,
                    dst, (int)P);
        if (!pointwise) col2im(g, dcol, dxn);
      }
    }
  }
  /* dw = sum of the partials in thread order */
  for (int64_t i = 0; i < wsz + g->O; ++i) {
    float s = 0.0f;
    for (int t = 0; t < nt; ++t) s += scratch[t * per_thread + 2 * K * P + i];
    if (i < wsz)
      dw[i] = s;
    else if (db)
      db[i - wsz] = s;
  }
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

static dp_status cpu_avgpool_forward(dp_device *dev, const dp_pool_geom *g, int64_t N, const float *x, float *y) {
  const int64_t n = N * g->C * g->OH * g->OW;
#pragma omp parallel for num_threads(dev->nthreads) schedule(static) if (n > 16384)
  for (int64_t o = 0; o < n; ++o) y[o] = dp_avgpool_forward_elem(x, g, o);
  return DP_OK;
}

static dp_status cpu_avgpool_backward(dp_device *dev, const dp_pool_geom *g, int64_t N, const float *dy, float *dx) {
  const int64_t n = N * g->C * g->H * g->W;
#pragma omp parallel for num_threads(dev->nthreads) schedule(static) if (n > 16384)
  for (int64_t i = 0; i < n; ++i) dx[i] = dp_avgpool_backward_elem(dy, g, i);
  return DP_OK;
}

static dp_status cpu_maxpool_forward(dp_device *dev, const dp_pool_geom *g, int64_t N, const float *x, float *y,
                                     int32_t *arg) {
  const int64_t n = N * g->C * g->OH * g->OW;
#pragma omp parallel for num_threads(dev->nthreads) schedule(static) if (n > 16384)
  for (int64_t o = 0; o < n; ++o) y[o] = dp_maxpool_forward_elem(x, g, o, &arg[o]);
  return DP_OK;
}

static dp_status cpu_maxpool_backward(dp_device *dev, const dp_pool_geom *g, int64_t N, const float *dy,
                                      const int32_t *arg, float *dx) {
  const int64_t n = N * g->C * g->H * g->W;
#pragma omp parallel for num_threads(dev->nthreads) schedule(static) if (n > 16384)
  for (int64_t i = 0; i < n; ++i) dx[i] = dp_maxpool_backward_elem(dy, arg, g, i);
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
  *loss_sum = s;
  *correct = c;
  return DP_OK;
}

static dp_status cpu_sgd_update(dp_device *dev, int64_t n, float *w, const float *g, float *v, float lr, float mu,
                                float wd) {
#pragma omp parallel for simd num_threads(dev->nthreads) schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) dp_sgd_elem(w, g, v, i, lr, mu, wd);
  return DP_OK;
}

static dp_status cpu_synchronize(dp_device *dev) { return DP_OK; }

static const dp_backend cpu_backend = {
    .name = "cpu",
    .alloc = cpu_alloc,
    .release = cpu_release,
    .copy_to_device = cpu_copy,
    .copy_to_host = cpu_copy,
    .fill = cpu_fill,
    .u8_to_unit = cpu_u8_to_unit,
    .conv2d_forward = cpu_conv2d_forward,
    .conv2d_backward = cpu_conv2d_backward,
    .dense_forward = cpu_dense_forward,
    .dense_backward = cpu_dense_backward,
    .relu_forward = cpu_relu_forward,
    .relu_backward = cpu_relu_backward,
    .avgpool_forward = cpu_avgpool_forward,
    .avgpool_backward = cpu_avgpool_backward,
    .maxpool_forward = cpu_maxpool_forward,
    .maxpool_backward = cpu_maxpool_backward,
    .softmax_xent = cpu_softmax_xent,
    .sgd_update = cpu_sgd_update,
    .synchronize = cpu_synchronize,
};

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

void dp_device_destroy(dp_device *dev) {
  if (!dev || !dev->ctx) return;
  if (dev->kind == DP_DEVICE_CPU) {
    cpu_ctx *c = dev->ctx;
    free(c->scratch);
    free(c);
  }
  dev->ctx = NULL;
}
