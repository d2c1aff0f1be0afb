/* backend_cuda.c — the CUDA backend: one logical device = one CUDA stream on a
 * physical GPU, with its own cuDNN and cuBLAS handles bound to that stream.
 * Several logical devices may share a physical GPU (set_logical_devices('cuda', k)).
 *
 * Written against documented contracts only; it has never run on a GPU in
 * this repository's CI (see tests/test_gpu.py, which checks it against the CPU
 * backend where a GPU is present).
 *
 * - Memory: plain cudaMalloc per allocation (no managed memory, no arena: the
 *   model allocates a few large buffers once and grows activations rarely).
 * - Ordering: every kernel, cuDNN and cuBLAS call is issued on the device's
 *   stream, so the calls of one replica are ordered among themselves without
 *   host synchronization. The host waits (cudaStreamSynchronize) only where it
 *   reads device data (copy_to_host, softmax_xent's sums) or where a host
 *   buffer must be free for reuse on return (copy_to_device from host memory).
 * - Threads: the replica thread that drives a device is not the thread that
 *   created it, and the current device is per host thread (CUDA Runtime API,
 *   cudaSetDevice), so every entry point first makes the device's GPU current.
 * - Convolutions: cuDNN, algorithms from the cudnnGetConvolution*Algorithm_v7
 *   heuristics (no benchmarking), deterministic ones unless told otherwise,
 *   FMA math (no TF32). Plans (descriptors, algorithms, workspace sizes) are
 *   cached per (geometry, batch).
 * - Dense layers: cublasSgemm in CUBLAS_DEFAULT_MATH (no TF32), see dense_*.
 * - Our own kernels (kernels/ .cu files) run the DP_HD bodies of kernels/dp_kernels.h,
 *   the arithmetic the CPU backend runs.
 */
#include "backend.h"

#if defined(DP_HAVE_CUDA) && defined(DP_HAVE_CUDNN) && defined(DP_HAVE_CUBLAS)

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_check.h"
#include "cudnn_shapes.h"
#include "dp_cuda.h"

/* a launcher's int result is a cudaError_t */
#define DP_LAUNCH_CHECK(call) DP_CUDA_CHECK((cudaError_t)(call))

enum { CUDA_PLANS = 64 };

typedef struct conv_plan {
  int used;
  dp_conv_geom g;
  int N;
  dp_cudnn_conv_descs d;
  cudnnConvolutionFwdAlgo_t fwd;
  cudnnConvolutionBwdDataAlgo_t bwd_data;
  cudnnConvolutionBwdFilterAlgo_t bwd_filter;
  size_t fwd_bytes, bwd_data_bytes, bwd_filter_bytes;
} conv_plan;

typedef struct cuda_ctx {
  int gpu;                 /* physical device ordinal */
  int deterministic;       /* cuDNN: deterministic algorithms only */
  cudaStream_t stream;
  cudnnHandle_t cudnn;
  cublasHandle_t cublas;
  void *workspace;         /* cuDNN workspace, grows on demand */
  size_t workspace_bytes;
  float *row_loss;         /* softmax_xent: (rows) on the device */
  int32_t *row_hit;
  float *host_loss;        /* and their host copies */
  int32_t *host_hit;
  int64_t rows;
  conv_plan plans[CUDA_PLANS];
  int next_plan;           /* round-robin eviction */
} cuda_ctx;

/* Every entry point: the device's context, its GPU made current on this thread. */
#define CUDA_ENTER(dev, c)          \
  cuda_ctx *c = (cuda_ctx *)(dev)->ctx; \
  DP_CUDA_CHECK(cudaSetDevice(c->gpu))

/* ---- memory and copies ------------------------------------------------------ */

static dp_status cuda_alloc(dp_device *dev, size_t bytes, void **out) {
  CUDA_ENTER(dev, c);
  size_t rounded = (bytes + 255) & ~(size_t)255;
  if (rounded == 0) rounded = 256;
  void *p = NULL;
  cudaError_t e = cudaMalloc(&p, rounded);
  if (e == cudaErrorMemoryAllocation) {
    cudaGetLastError(); /* not sticky; clear it */
    return DP_FAIL(DP_ERR_MEMORY, "cannot allocate %zu bytes on %s (cudaMalloc: out of memory)", bytes, dev->name);
  }
  DP_CUDA_CHECK(e);
  /* zero-filled as the table promises; synchronized so that the zeros are
   * visible to work on any stream (the collectives read other replicas' buffers) */
  cudaError_t z = cudaMemsetAsync(p, 0, rounded, c->stream);
  if (z == cudaSuccess) z = cudaStreamSynchronize(c->stream);
  if (z != cudaSuccess) {
    cudaFree(p);
    return DP_FAIL(DP_ERR_CUDA, "zero-filling a new buffer on %s failed: %s (%d): %s", dev->name, cudaGetErrorName(z),
                   (int)z, cudaGetErrorString(z));
  }
  *out = p;
  return DP_OK;
}

static void cuda_release(dp_device *dev, void *p) {
  cuda_ctx *c = dev->ctx;
  if (cudaSetDevice(c->gpu) != cudaSuccess) return;
  /* work still queued on the stream may use p */
  cudaStreamSynchronize(c->stream);
  cudaFree(p);
}

static int is_device_pointer(const void *p) {
  struct cudaPointerAttributes a;
  /* CUDA >= 11: host memory the runtime does not know is cudaMemoryTypeUnregistered, not an error */
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

/* dst: this device's memory; src: host memory or device memory. cudaMemcpyDefault
 * infers the direction from the unified address space. From host memory the
 * call waits for the copy, so the caller may reuse or free src on return
 * (an async copy from pageable memory "might be synchronous" only: CUDA
 * Runtime API, "API synchronization behavior"). Device-to-device copies are
 * ordered on this device's stream only: a caller copying from another logical
 * device's memory synchronizes that device first (dp_mirrored_broadcast does). */
static dp_status cuda_copy_to_device(dp_device *dev, void *dst, const void *src, size_t bytes) {
  CUDA_ENTER(dev, c);
  if (!bytes) return DP_OK;
  DP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, c->stream));
  if (!is_device_pointer(src)) DP_CUDA_CHECK(cudaStreamSynchronize(c->stream));
  return DP_OK;
}

/* Synchronous for the caller: dst holds the data on return. */
static dp_status cuda_copy_to_host(dp_device *dev, void *dst, const void *src, size_t bytes) {
  CUDA_ENTER(dev, c);
  if (!bytes) return DP_OK;
  DP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, c->stream));
  DP_CUDA_CHECK(cudaStreamSynchronize(c->stream));
  return DP_OK;
}

static dp_status cuda_fill(dp_device *dev, float *x, int64_t n, float value) {
  CUDA_ENTER(dev, c);
  DP_LAUNCH_CHECK(dp_cuda_fill(c->stream, n, x, value));
  return DP_OK;
}

/* x is device memory (model.c stages the host bytes first). */
static dp_status cuda_u8_to_unit(dp_device *dev, float *y, const uint8_t *x, int64_t n) {
  CUDA_ENTER(dev, c);
  DP_LAUNCH_CHECK(dp_cuda_u8_to_unit(c->stream, n, x, y));
  return DP_OK;
}

/* The cuDNN workspace: at least `bytes`. Growing frees the old one after the
 * stream's queued work (which may use it) has finished. */
static dp_status cuda_workspace(cuda_ctx *c, size_t bytes, void **out) {
  if (bytes > c->workspace_bytes) {
    DP_CUDA_CHECK(cudaStreamSynchronize(c->stream));
    if (c->workspace) DP_CUDA_CHECK(cudaFree(c->workspace));
    c->workspace = NULL;
    c->workspace_bytes = 0;
    DP_CUDA_CHECK(cudaMalloc(&c->workspace, bytes));
    c->workspace_bytes = bytes;
  }
  *out = bytes ? c->workspace : NULL;
  return DP_OK;
}

/* ---- convolution (cuDNN) -------------------------------------------------------- */

/* The first algorithm of the heuristics' list (best first) that cuDNN supports
 * for these descriptors, is deterministic when asked, and does not need tensor
 * cores (TF32). The *_WINOGRAD_NONFUSED algorithms are skipped for their
 * precision, as TensorFlow does (NVIDIA developer forum, "Variations in
 * heuristics for selecting conv algorithm in different APIs"). cuDNN API
 * reference: cudnnGetConvolutionForwardAlgorithm_v7 and its BackwardData /
 * BackwardFilter twins fill perfResults with algo, status, memory,
 * determinism and mathType per algorithm. */
#define DP_ACCEPTABLE(perf, c, nonfused)                                                           \
  ((perf).status == CUDNN_STATUS_SUCCESS && (perf).algo != (nonfused) &&                           \
   (!(c)->deterministic || (perf).determinism == CUDNN_DETERMINISTIC) &&                           \
   (perf).mathType != CUDNN_TENSOR_OP_MATH && (perf).mathType != CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION)

enum { MAX_ALGOS = 16 };

static dp_status plan_algorithms(cuda_ctx *c, conv_plan *p) {
  const dp_cudnn_conv_descs *d = &p->d;
  int got = 0, i;

  cudnnConvolutionFwdAlgoPerf_t fwd[MAX_ALGOS];
  DP_CUDNN_CHECK(cudnnGetConvolutionForwardAlgorithm_v7(c->cudnn, d->x, d->w, d->conv, d->y, MAX_ALGOS, &got, fwd));
  for (i = 0; i < got && !DP_ACCEPTABLE(fwd[i], c, CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED); ++i) {
  }
  if (i == got) return DP_FAIL(DP_ERR_CUDA, "cuDNN offers no suitable forward algorithm (of %d) for this convolution", got);
  p->fwd = fwd[i].algo;
  DP_CUDNN_CHECK(cudnnGetConvolutionForwardWorkspaceSize(c->cudnn, d->x, d->w, d->conv, d->y, p->fwd, &p->fwd_bytes));

  cudnnConvolutionBwdDataAlgoPerf_t bd[MAX_ALGOS];
  DP_CUDNN_CHECK(cudnnGetConvolutionBackwardDataAlgorithm_v7(c->cudnn, d->w, d->y, d->conv, d->x, MAX_ALGOS, &got, bd));
  for (i = 0; i < got && !DP_ACCEPTABLE(bd[i], c, CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD_NONFUSED); ++i) {
  }
  if (i == got)
    return DP_FAIL(DP_ERR_CUDA, "cuDNN offers no suitable backward-data algorithm (of %d)%s", got,
                   c->deterministic ? " that is deterministic" : "");
  p->bwd_data = bd[i].algo;
  DP_CUDNN_CHECK(cudnnGetConvolutionBackwardDataWorkspaceSize(c->cudnn, d->w, d->y, d->conv, d->x, p->bwd_data,
                                                              &p->bwd_data_bytes));

  cudnnConvolutionBwdFilterAlgoPerf_t bf[MAX_ALGOS];
  DP_CUDNN_CHECK(
      cudnnGetConvolutionBackwardFilterAlgorithm_v7(c->cudnn, d->x, d->y, d->conv, d->w, MAX_ALGOS, &got, bf));
  for (i = 0; i < got && !DP_ACCEPTABLE(bf[i], c, CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD_NONFUSED); ++i) {
  }
  if (i == got)
    return DP_FAIL(DP_ERR_CUDA, "cuDNN offers no suitable backward-filter algorithm (of %d)%s", got,
                   c->deterministic ? " that is deterministic" : "");
  p->bwd_filter = bf[i].algo;
  DP_CUDNN_CHECK(cudnnGetConvolutionBackwardFilterWorkspaceSize(c->cudnn, d->x, d->y, d->conv, d->w, p->bwd_filter,
                                                                &p->bwd_filter_bytes));
  return DP_OK;
}

static void plans_clear(cuda_ctx *c) {
  for (int i = 0; i < CUDA_PLANS; ++i) {
    if (c->plans[i].used) dp_cudnn_conv_descs_destroy(&c->plans[i].d);
    memset(&c->plans[i], 0, sizeof c->plans[i]);
  }
  c->next_plan = 0;
}

static dp_status conv_plan_for(dp_device *dev, cuda_ctx *c, const dp_conv_geom *g, int64_t N, conv_plan **out) {
  if (N > 0x7fffffff) return DP_FAIL(DP_ERR_VALUE, "conv2d on %s: batch %lld is too large for cuDNN", dev->name, (long long)N);
  for (int i = 0; i < CUDA_PLANS; ++i) {
    conv_plan *p = &c->plans[i];
    if (p->used && p->N == (int)N && memcmp(&p->g, g, sizeof *g) == 0) {
      *out = p;
      return DP_OK;
    }
  }
  conv_plan *p = &c->plans[c->next_plan];
  c->next_plan = (c->next_plan + 1) % CUDA_PLANS;
  if (p->used) dp_cudnn_conv_descs_destroy(&p->d);
  memset(p, 0, sizeof *p);
  dp_status st = dp_cudnn_conv_descs_make(g, (int)N, &p->d);
  if (st == DP_OK) st = plan_algorithms(c, p);
  if (st != DP_OK) {
    dp_cudnn_conv_descs_destroy(&p->d);
    return st;
  }
  p->g = *g;
  p->N = (int)N;
  p->used = 1;
  *out = p;
  return DP_OK;
}

static int64_t conv_out_size(const dp_conv_geom *g) { return (int64_t)g->O * g->OH * g->OW; }

/* y = conv(x, w) + b: the bias is written first, then cuDNN adds the
 * convolution with beta = 1 (y = alpha * conv + beta * y; cuDNN API reference,
 * cudnnConvolutionForward, "scaling parameters"). */
static dp_status cuda_conv2d_forward(dp_device *dev, const dp_conv_geom *g, int64_t N, const float *x, const float *w,
                                     const float *b, float *y) {
  CUDA_ENTER(dev, c);
  if (N == 0) return DP_OK;
  conv_plan *p;
  DP_TRY(conv_plan_for(dev, c, g, N, &p));
  void *ws;
  DP_TRY(cuda_workspace(c, p->fwd_bytes, &ws));
  const float one = 1.0f, zero = 0.0f;
  if (b) DP_LAUNCH_CHECK(dp_cuda_bias_fill(c->stream, N * conv_out_size(g), g->O, (int64_t)g->OH * g->OW, b, y));
  DP_CUDNN_CHECK(cudnnConvolutionForward(c->cudnn, &one, p->d.x, x, p->d.w, w, p->d.conv, p->fwd, ws, p->fwd_bytes,
                                         b ? &one : &zero, p->d.y, y));
  return DP_OK;
}

/* dw, db overwritten (beta = 0); dx overwritten unless NULL. db is a channel
 * sum of dy over (N, OH*OW): our deterministic reduction kernel. */
static dp_status cuda_conv2d_backward(dp_device *dev, const dp_conv_geom *g, int64_t N, const float *x, const float *w,
                                      const float *dy, float *dx, float *dw, float *db) {
  CUDA_ENTER(dev, c);
  if (N == 0) {
    DP_LAUNCH_CHECK(dp_cuda_fill(c->stream, (int64_t)g->O * g->C * g->KH * g->KW, dw, 0.0f));
    if (db) DP_LAUNCH_CHECK(dp_cuda_fill(c->stream, g->O, db, 0.0f));
    return DP_OK;
  }
  conv_plan *p;
  DP_TRY(conv_plan_for(dev, c, g, N, &p));
  const float one = 1.0f, zero = 0.0f;
  if (db) DP_LAUNCH_CHECK(dp_cuda_channel_sums(c->stream, N, g->O, g->OH * g->OW, dy, NULL, db));
  void *ws;
  DP_TRY(cuda_workspace(c, p->bwd_filter_bytes, &ws));
  DP_CUDNN_CHECK(cudnnConvolutionBackwardFilter(c->cudnn, &one, p->d.x, x, p->d.y, dy, p->d.conv, p->bwd_filter, ws,
                                                p->bwd_filter_bytes, &zero, p->d.w, dw));
  if (dx) {
    DP_TRY(cuda_workspace(c, p->bwd_data_bytes, &ws));
    DP_CUDNN_CHECK(cudnnConvolutionBackwardData(c->cudnn, &one, p->d.w, w, p->d.y, dy, p->d.conv, p->bwd_data, ws,
                                                p->bwd_data_bytes, &zero, p->d.x, dx));
  }
  return DP_OK;
}

/* ---- dense (cuBLAS) --------------------------------------------------------------
 *
 * cuBLAS is column-major (cuBLAS Library User Guide, "Data layout"): a
 * row-major (R, K) matrix in memory IS the column-major (K, R) matrix, its
 * transpose, with leading dimension K. So each row-major product below is
 * computed as its transpose, C^T = op(B)^T op(A)^T, with the operands' roles
 * swapped; shapes in the comments are row-major, as everywhere in dpcore.
 * cublasSgemm: C (m, n) = alpha op(A) (m, k) op(B) (k, n) + beta C, column-major,
 * lda/ldb/ldc the column strides. alpha/beta are host pointers (the default
 * CUBLAS_POINTER_MODE_HOST). */

static dp_status cuda_dense_forward(dp_device *dev, int64_t N, int nin, int nout, const float *x, const float *w,
                                    const float *b, float *y) {
  CUDA_ENTER(dev, c);
  if (N == 0) return DP_OK;
  if (N > 0x7fffffff) return DP_FAIL(DP_ERR_VALUE, "dense on %s: batch %lld is too large for cuBLAS", dev->name, (long long)N);
  const float one = 1.0f, zero = 0.0f;
  if (b) DP_LAUNCH_CHECK(dp_cuda_bias_fill(c->stream, N * nout, nout, 1, b, y));
  /* y (N, nout) = x (N, nin) w^T (nin, nout)  <=>  y^T (nout, N) = w (nout, nin) x^T (nin, N).
   * Column-major views: w is (nin, nout) ld nin, so op = T gives (nout, nin);
   * x is (nin, N) ld nin, op = N; y^T is (nout, N) ld nout. */
  DP_CUBLAS_CHECK(cublasSgemm(c->cublas, CUBLAS_OP_T, CUBLAS_OP_N, nout, (int)N, nin, &one, w, nin, x, nin,
                              b ? &one : &zero, y, nout));
  return DP_OK;
}

static dp_status cuda_dense_backward(dp_device *dev, int64_t N, int nin, int nout, const float *x, const float *w,
                                     const float *dy, float *dx, float *dw, float *db) {
  CUDA_ENTER(dev, c);
  if (N == 0) {
    DP_LAUNCH_CHECK(dp_cuda_fill(c->stream, (int64_t)nout * nin, dw, 0.0f));
    if (db) DP_LAUNCH_CHECK(dp_cuda_fill(c->stream, nout, db, 0.0f));
    return DP_OK;
  }
  if (N > 0x7fffffff) return DP_FAIL(DP_ERR_VALUE, "dense on %s: batch %lld is too large for cuBLAS", dev->name, (long long)N);
  const float one = 1.0f, zero = 0.0f;
  /* dw (nout, nin) = dy^T (nout, N) x (N, nin)  <=>  dw^T (nin, nout) = x^T (nin, N) dy (N, nout).
   * Column-major views: x is (nin, N) ld nin, op = N; dy is (nout, N) ld nout,
   * op = T gives (N, nout); dw^T is (nin, nout) ld nin. */
  DP_CUBLAS_CHECK(cublasSgemm(c->cublas, CUBLAS_OP_N, CUBLAS_OP_T, nin, nout, (int)N, &one, x, nin, dy, nout, &zero, dw,
                              nin));
  /* db (nout) = column sums of dy (N, nout): channel sums with C = nout, HW = 1 */
  if (db) DP_LAUNCH_CHECK(dp_cuda_channel_sums(c->stream, N, nout, 1, dy, NULL, db));
  /* dx (N, nin) = dy (N, nout) w (nout, nin)  <=>  dx^T (nin, N) = w^T (nin, nout) dy^T (nout, N).
   * Column-major views: w is (nin, nout) ld nin, op = N; dy is (nout, N) ld
   * nout, op = N; dx^T is (nin, N) ld nin. */
  if (dx)
    DP_CUBLAS_CHECK(cublasSgemm(c->cublas, CUBLAS_OP_N, CUBLAS_OP_N, nin, (int)N, nout, &one, w, nin, dy, nout, &zero,
                                dx, nin));
  return DP_OK;
}

/* ---- element-wise, pooling, loss, optimizer (kernels/ .cu files) ---------------------- */

static dp_status cuda_relu_forward(dp_device *dev, int64_t n, const float *x, float *y) {
  CUDA_ENTER(dev, c);
  DP_LAUNCH_CHECK(dp_cuda_relu_forward(c->stream, n, x, y));
  return DP_OK;
}

static dp_status cuda_relu_backward(dp_device *dev, int64_t n, const float *y, const float *dy, float *dx) {
  CUDA_ENTER(dev, c);
  DP_LAUNCH_CHECK(dp_cuda_relu_backward(c->stream, n, y, dy, dx));
  return DP_OK;
}

static dp_status cuda_avgpool_forward(dp_device *dev, const dp_pool_geom *g, int64_t N, const float *x, float *y) {
  CUDA_ENTER(dev, c);
  DP_LAUNCH_CHECK(dp_cuda_avgpool_forward(c->stream, *g, N, x, y));
  return DP_OK;
}

static dp_status cuda_avgpool_backward(dp_device *dev, const dp_pool_geom *g, int64_t N, const float *dy, float *dx) {
  CUDA_ENTER(dev, c);
  DP_LAUNCH_CHECK(dp_cuda_avgpool_backward(c->stream, *g, N, dy, dx));
  return DP_OK;
}

static dp_status cuda_maxpool_forward(dp_device *dev, const dp_pool_geom *g, int64_t N, const float *x, float *y,
                                      int32_t *arg) {
  CUDA_ENTER(dev, c);
  DP_LAUNCH_CHECK(dp_cuda_maxpool_forward(c->stream, *g, N, x, y, arg));
  return DP_OK;
}

static dp_status cuda_maxpool_backward(dp_device *dev, const dp_pool_geom *g, int64_t N, const float *dy,
                                       const int32_t *arg, float *dx) {
  CUDA_ENTER(dev, c);
  DP_LAUNCH_CHECK(dp_cuda_maxpool_backward(c->stream, *g, N, dy, arg, dx));
  return DP_OK;
}

/* Row losses and hits on the device, then (after the stream sync) summed on
 * the host in row order in double, as the CPU backend sums them. */
static dp_status cuda_softmax_xent(dp_device *dev, int64_t N, int K, const float *logits, const int32_t *labels,
                                   float scale, float *dlogits, double *loss_sum, int64_t *correct) {
  CUDA_ENTER(dev, c);
  *loss_sum = 0.0;
  *correct = 0;
  if (N == 0) return DP_OK;
  if (N > c->rows) {
    DP_CUDA_CHECK(cudaStreamSynchronize(c->stream)); /* the old buffers may be in use */
    cudaFree(c->row_loss);
    cudaFree(c->row_hit);
    free(c->host_loss);
    free(c->host_hit);
    c->row_loss = NULL;
    c->row_hit = NULL;
    c->host_loss = NULL;
    c->host_hit = NULL;
    c->rows = 0;
    DP_CUDA_CHECK(cudaMalloc((void **)&c->row_loss, sizeof(float) * (size_t)N));
    DP_CUDA_CHECK(cudaMalloc((void **)&c->row_hit, sizeof(int32_t) * (size_t)N));
    c->host_loss = malloc(sizeof(float) * (size_t)N);
    c->host_hit = malloc(sizeof(int32_t) * (size_t)N);
    if (!c->host_loss || !c->host_hit) return DP_FAIL(DP_ERR_MEMORY, "softmax_xent on %s: cannot allocate %lld rows", dev->name, (long long)N);
    c->rows = N;
  }
  DP_LAUNCH_CHECK(dp_cuda_softmax_xent(c->stream, N, K, logits, labels, scale, dlogits, c->row_loss, c->row_hit));
  DP_CUDA_CHECK(cudaMemcpyAsync(c->host_loss, c->row_loss, sizeof(float) * (size_t)N, cudaMemcpyDeviceToHost, c->stream));
  DP_CUDA_CHECK(cudaMemcpyAsync(c->host_hit, c->row_hit, sizeof(int32_t) * (size_t)N, cudaMemcpyDeviceToHost, c->stream));
  DP_CUDA_CHECK(cudaStreamSynchronize(c->stream));
  double s = 0.0;
  int64_t hits = 0;
  for (int64_t n = 0; n < N; ++n) {
    s += c->host_loss[n];
    hits += c->host_hit[n] != 0;
  }
  *loss_sum = s;
  *correct = hits;
  return DP_OK;
}

static dp_status cuda_sgd_update(dp_device *dev, int64_t n, float *w, const float *g, float *v, float lr, float mu,
                                 float wd) {
  CUDA_ENTER(dev, c);
  DP_LAUNCH_CHECK(dp_cuda_sgd_update(c->stream, n, w, g, v, lr, mu, wd));
  return DP_OK;
}

static dp_status cuda_add(dp_device *dev, int64_t n, const float *a, const float *b, float *y) {
  CUDA_ENTER(dev, c);
  DP_LAUNCH_CHECK(dp_cuda_add(c->stream, n, a, b, y));
  return DP_OK;
}

static dp_status cuda_scale(dp_device *dev, int64_t n, float *x, float alpha) {
  CUDA_ENTER(dev, c);
  DP_LAUNCH_CHECK(dp_cuda_scale(c->stream, n, x, alpha));
  return DP_OK;
}

static dp_status cuda_global_avgpool_forward(dp_device *dev, int64_t N, int C, int HW, const float *x, float *y) {
  CUDA_ENTER(dev, c);
  DP_LAUNCH_CHECK(dp_cuda_global_avgpool_forward(c->stream, N * C, HW, x, y));
  return DP_OK;
}

static dp_status cuda_global_avgpool_backward(dp_device *dev, int64_t N, int C, int HW, const float *dy, float *dx) {
  CUDA_ENTER(dev, c);
  DP_LAUNCH_CHECK(dp_cuda_global_avgpool_backward(c->stream, N * C, HW, dy, dx));
  return DP_OK;
}

/* ---- BatchNorm ------------------------------------------------------------------- */

static dp_status cuda_bn_sums(dp_device *dev, int64_t N, int C, int HW, const float *x, const float *mean,
                              float *out) {
  CUDA_ENTER(dev, c);
  DP_LAUNCH_CHECK(dp_cuda_channel_sums(c->stream, N, C, HW, x, mean, out));
  return DP_OK;
}

static dp_status cuda_bn_finalize(dp_device *dev, int C, const float *sqdev, float count, const float *mean, float eps,
                                  float momentum, int update_running, float *invstd, float *running_mean,
                                  float *running_var) {
  CUDA_ENTER(dev, c);
  DP_LAUNCH_CHECK(dp_cuda_bn_finalize(c->stream, C, sqdev, count, mean, eps, momentum, update_running, invstd,
                                      running_mean, running_var));
  return DP_OK;
}

static dp_status cuda_bn_apply(dp_device *dev, int64_t N, int C, int HW, const float *x, const float *mean,
                               const float *invstd, const float *gamma, const float *beta, float *y) {
  CUDA_ENTER(dev, c);
  DP_LAUNCH_CHECK(dp_cuda_bn_apply(c->stream, N, C, HW, x, mean, invstd, gamma, beta, y));
  return DP_OK;
}

static dp_status cuda_bn_backward_sums(dp_device *dev, int64_t N, int C, int HW, const float *x, const float *dy,
                                       const float *mean, const float *invstd, float *sum_dy, float *sum_dy_xhat) {
  CUDA_ENTER(dev, c);
  DP_LAUNCH_CHECK(dp_cuda_bn_backward_sums(c->stream, N, C, HW, x, dy, mean, invstd, sum_dy, sum_dy_xhat));
  return DP_OK;
}

static dp_status cuda_bn_backward_dx(dp_device *dev, int64_t N, int C, int HW, const float *x, const float *dy,
                                     const float *mean, const float *invstd, const float *gamma, const float *sum_dy,
                                     const float *sum_dy_xhat, float inv_count, float *dx) {
  CUDA_ENTER(dev, c);
  DP_LAUNCH_CHECK(dp_cuda_bn_backward_dx(c->stream, N, C, HW, x, dy, mean, invstd, gamma, sum_dy, sum_dy_xhat,
                                         inv_count, dx));
  return DP_OK;
}

static dp_status cuda_synchronize(dp_device *dev) {
  CUDA_ENTER(dev, c);
  DP_CUDA_CHECK(cudaStreamSynchronize(c->stream));
  return DP_OK;
}

/* Safe on a partly initialized context: every member is checked. Errors are
 * ignored (nothing can be reported from a destructor). */
static void cuda_destroy(dp_device *dev) {
  cuda_ctx *c = dev->ctx;
  if (!c) return;
  if (cudaSetDevice(c->gpu) == cudaSuccess) {
    if (c->stream) cudaStreamSynchronize(c->stream);
    plans_clear(c);
    cudaFree(c->workspace);
    cudaFree(c->row_loss);
    cudaFree(c->row_hit);
    if (c->cublas) cublasDestroy(c->cublas);
    if (c->cudnn) cudnnDestroy(c->cudnn);
    if (c->stream) cudaStreamDestroy(c->stream);
  }
  cudaGetLastError();
  free(c->host_loss);
  free(c->host_hit);
  free(c);
}

static const dp_backend cuda_backend = {
    .name = "cuda",
    .alloc = cuda_alloc,
    .release = cuda_release,
    .copy_to_device = cuda_copy_to_device,
    .copy_to_host = cuda_copy_to_host,
    .fill = cuda_fill,
    .u8_to_unit = cuda_u8_to_unit,
    .conv2d_forward = cuda_conv2d_forward,
    .conv2d_backward = cuda_conv2d_backward,
    .dense_forward = cuda_dense_forward,
    .dense_backward = cuda_dense_backward,
    .relu_forward = cuda_relu_forward,
    .relu_backward = cuda_relu_backward,
    .avgpool_forward = cuda_avgpool_forward,
    .avgpool_backward = cuda_avgpool_backward,
    .maxpool_forward = cuda_maxpool_forward,
    .maxpool_backward = cuda_maxpool_backward,
    .softmax_xent = cuda_softmax_xent,
    .sgd_update = cuda_sgd_update,
    .add = cuda_add,
    .scale = cuda_scale,
    .global_avgpool_forward = cuda_global_avgpool_forward,
    .global_avgpool_backward = cuda_global_avgpool_backward,
    .bn_sums = cuda_bn_sums,
    .bn_finalize = cuda_bn_finalize,
    .bn_apply = cuda_bn_apply,
    .bn_backward_sums = cuda_bn_backward_sums,
    .bn_backward_dx = cuda_bn_backward_dx,
    .synchronize = cuda_synchronize,
    .destroy = cuda_destroy,
};

const dp_backend *dp_cuda_backend(void) { return &cuda_backend; }

/* Stream first, then the handles bound to it. A cuDNN / cuBLAS handle belongs
 * to the device current when it is created (cuDNN developer guide, "cuDNN
 * Handle"; cuBLAS guide, "cuBLAS context"); one handle per stream keeps cuBLAS
 * bitwise reproducible (cuBLAS guide, "Results reproducibility"). */
static dp_status cuda_ctx_init(dp_device *dev, cuda_ctx *c) {
  DP_CUDA_CHECK(cudaSetDevice(c->gpu));
  /* non-blocking: never implicitly ordered with the legacy default stream */
  DP_CUDA_CHECK(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking));
  DP_CUDNN_CHECK(cudnnCreate(&c->cudnn));
  DP_CUDNN_CHECK(cudnnSetStream(c->cudnn, c->stream));
  DP_CUBLAS_CHECK(cublasCreate(&c->cublas));
  DP_CUBLAS_CHECK(cublasSetStream(c->cublas, c->stream));
  /* CUBLAS_DEFAULT_MATH keeps float32 GEMMs in float32 (TF32 tensor cores only
   * with CUBLAS_TF32_TENSOR_OP_MATH; cuBLAS guide, cublasMath_t) */
  DP_CUBLAS_CHECK(cublasSetMathMode(c->cublas, CUBLAS_DEFAULT_MATH));
  return DP_OK;
}

dp_status dp_cuda_device_init(dp_device *dev, int index, int physical_gpu) {
  if (index < 0) return DP_FAIL(DP_ERR_VALUE, "cuda:%d: the logical index must be >= 0", index);
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return DP_FAIL(DP_ERR_CUDA, "cuda:%d: no usable CUDA device: cudaGetDeviceCount: %s (%d): %s", index,
                   cudaGetErrorName(e), (int)e, cudaGetErrorString(e));
  }
  if (physical_gpu < 0 || physical_gpu >= count)
    return DP_FAIL(DP_ERR_VALUE, "cuda:%d: physical GPU %d does not exist (%d present)", index, physical_gpu, count);
  cuda_ctx *c = calloc(1, sizeof *c);
  if (!c) return DP_FAIL(DP_ERR_MEMORY, "cuda:%d: cannot allocate the device context", index);
  c->gpu = physical_gpu;
  c->deterministic = 1;
  memset(dev, 0, sizeof *dev);
  dev->kind = DP_DEVICE_CUDA;
  dev->index = index;
  dev->nthreads = 1; /* the replica thread only issues work */
  dev->backend = &cuda_backend;
  dev->ctx = c;
  snprintf(dev->name, sizeof dev->name, "cuda:%d", index);
  dp_status st = cuda_ctx_init(dev, c);
  if (st != DP_OK) dp_device_destroy(dev); /* keeps this thread's error message */
  return st;
}

dp_status dp_cuda_set_deterministic(dp_device *dev, int deterministic) {
  if (dev->kind != DP_DEVICE_CUDA) return DP_FAIL(DP_ERR_VALUE, "%s is not a CUDA device", dev->name);
  CUDA_ENTER(dev, c);
  if (c->deterministic != !!deterministic) {
    DP_CUDA_CHECK(cudaStreamSynchronize(c->stream));
    plans_clear(c); /* algorithms are chosen again */
    c->deterministic = !!deterministic;
  }
  return DP_OK;
}

#else /* built without the CUDA backend */

const dp_backend *dp_cuda_backend(void) { return NULL; }

dp_status dp_cuda_device_init(dp_device *dev, int index, int physical_gpu) {
  (void)dev;
  (void)physical_gpu;
  return DP_FAIL(DP_ERR_UNSUPPORTED, "cuda:%d: dpcore was built without the CUDA backend (needs the CUDA toolkit, "
                 "cuDNN and cuBLAS)", index);
}

dp_status dp_cuda_set_deterministic(dp_device *dev, int deterministic) {
  (void)deterministic;
  return DP_FAIL(DP_ERR_UNSUPPORTED, "%s: dpcore was built without the CUDA backend", dev->name);
}

#endif
