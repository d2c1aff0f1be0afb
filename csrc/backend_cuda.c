/* backend_cuda.c — the CUDA backend: one logical device = one CUDA stream on a
 * physical GPU, with its own cuDNN and cuBLAS handles bound to that stream.
 * Several logical devices may share a physical GPU (set_logical_devices('cuda', k)).
 *
 * CI has no GPU: tests/test_gpu.py checks it against the CPU backend where one is
 * present (scripts/gpu-day.sh, docs/gpu-day.md).
 *
 * - Memory: one arena per logical device (csrc/arena.c) over chunks from
 *   cudaMalloc (never managed memory): every buffer of the device (the model's,
 *   the cuDNN workspace, the loss rows) is a block of it, so growing or
 *   replacing a buffer reuses device memory without a cudaMalloc/cudaFree pair
 *   (each of which synchronizes). dp_cuda_memory_stats reports it. Inside a
 *   mirrored step (dev->in_step) nothing grows: no new chunk, workspace,
 *   partials, loss rows or staging; the runner's warm-up pass sized them, and a growth the
 *   warm-up missed is a reported error naming what grew (backend.h,
 *   dp_device_may_grow), never a cudaMalloc while peers' NCCL kernels wait.
 * - Ordering: every kernel, cuDNN and cuBLAS call is issued on the device's
 *   stream, so the calls of one replica are ordered among themselves without
 *   host synchronization. The host waits (cudaStreamSynchronize) only where it
 *   reads device data (copy_to_host, evaluation's softmax_xent sums) and before
 *   a released block can be handed out again (never for a cuDNN plan, which
 *   is host state: plans_clear). A
 *   training step's loss is read last (metrics_read waits for an event after
 *   the forward pass), so the host queues the whole step without waiting.
 * - A step whose loss is not finite applies nothing, decided on the device:
 *   loss_flag (one thread) turns the row losses into 0 or NaN at the end of
 *   the gradient buffer, the gradient all-reduce sums it with the other
 *   replicas' (NCCL or our kernel), and the SGD and restore kernels read it
 *   and return early (dp_step_allowed). No host wait is added. UNTESTED on a
 *   GPU (none where this was written): the bodies are the CPU's
 *   (tests/c/kernel_bodies.c), the launchers only pass the pointers through.
 * - cuDNN runs the convolutions only: no activation, pooling or softmax
 *   descriptor, so no cudnnNanPropagation_t to set; ReLU, pooling and softmax
 *   are our bodies, which keep NaN as PyTorch does.
 * - Copies from host memory go through a pinned staging buffer per device (two
 *   regions, an event each), so that they are truly asynchronous and the
 *   caller's buffer is free on return; see cuda_copy_to_device.
 * - Threads: the replica thread that drives a device is not the thread that
 *   created it, and the current device is per host thread (CUDA Runtime API,
 *   cudaSetDevice), so every entry point first makes the device's GPU current.
 * - Convolutions: cuDNN, algorithms from the cudnnGetConvolution*Algorithm_v7
 *   heuristics (no benchmarking), deterministic ones unless told otherwise,
 *   FMA math (no TF32) unless TF32 is allowed. Plans (descriptors, algorithms,
 *   math types, workspace sizes) are cached per (geometry, batch).
 * - Dense layers: cublasSgemm in CUBLAS_DEFAULT_MATH (no TF32) unless TF32 is
 *   allowed (CUBLAS_TF32_TENSOR_OP_MATH), see dense_*.
 * - Settings: deterministic algorithms and TF32 per device
 *   (dp_cuda_set_deterministic, dp_cuda_set_allow_tf32) and process-wide
 *   (dp_cuda_set_defaults, which dpcore.set_deterministic / set_allow_tf32
 *   call): a device takes a process-wide change where a call or a step on it
 *   begins (dp_cuda_take_defaults), never inside one.
 * - Our own kernels (kernels/ .cu files) run the DP_HD bodies of kernels/dp_kernels.h,
 *   the arithmetic the CPU backend runs.
 */
#include "backend.h"

#include <stdatomic.h>

#include "arena.h"

/* The process-wide settings in one word, so that a reader sees the values of
 * one call together: bit 0 deterministic, bit 1 allow_tf32, bit 2 the CPU's
 * fast convolutions (dp_set_fast_convolutions), the bits above count the calls
 * (a device compares the whole word with the one it last applied). Kept in the
 * CPU-only build too. */
static _Atomic unsigned long long cuda_defaults = 1u; /* deterministic, no TF32, float32-faithful CPU */

static void settings_update(unsigned long long keep, unsigned long long set) {
  unsigned long long old = atomic_load(&cuda_defaults), next;
  do {
    next = (((old >> 3) + 1u) << 3) | (old & keep) | set;
  } while (!atomic_compare_exchange_weak(&cuda_defaults, &old, next));
}

void dp_cuda_set_defaults(int deterministic, int allow_tf32) {
  settings_update(4u, (allow_tf32 ? 2u : 0u) | (deterministic ? 1u : 0u));
}

void dp_set_fast_convolutions(int fast) { settings_update(3u, fast ? 4u : 0u); }

int dp_get_fast_convolutions(void) { return (int)((atomic_load(&cuda_defaults) >> 2) & 1u); }

void dp_cuda_get_defaults(int *deterministic, int *allow_tf32) {
  const unsigned long long s = atomic_load(&cuda_defaults);
  *deterministic = (int)(s & 1u);
  *allow_tf32 = (int)((s >> 1) & 1u);
}

unsigned long long dp_cuda_defaults_snapshot(void) {
  return atomic_load_explicit(&cuda_defaults, memory_order_acquire);
}

#if defined(DP_HAVE_CUDA) && defined(DP_HAVE_CUDNN) && defined(DP_HAVE_CUBLAS)

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

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
  /* the math type each algorithm runs with, set on d.conv before each call */
  cudnnMathType_t fwd_math, bwd_data_math, bwd_filter_math;
  size_t fwd_bytes, bwd_data_bytes, bwd_filter_bytes;
} conv_plan;

/* Pinned staging: regions of at least STAGING_MIN and at most STAGING_MAX
 * bytes (two of them: 16 MiB of page-locked memory per device at most, which
 * cudaHostAlloc's reference asks to use sparingly). */
#define STAGING_MIN ((size_t)64 << 10)
#define STAGING_MAX ((size_t)8 << 20)

typedef struct cuda_ctx {
  int gpu;                 /* physical device ordinal */
  int deterministic;       /* cuDNN: deterministic algorithms only */
  int allow_tf32;          /* cuBLAS and cuDNN may use TF32 tensor cores */
  unsigned long long defaults_seen; /* the cuda_defaults word last applied */
  cudaStream_t stream;
  cudnnHandle_t cudnn;
  cublasHandle_t cublas;
  dp_arena *arena;         /* every device buffer of this device */
  /* host-to-device staging: two pinned regions of region_bytes each; staged[r]
   * marks the end of the last copy out of region r */
  pthread_mutex_t staging_mutex;
  int staging_mutex_ready;
  char *staging;
  size_t region_bytes;
  cudaEvent_t staged[2];
  int next_region;
  void *workspace;         /* cuDNN workspace, grows on demand */
  size_t workspace_bytes;
  void *partials;          /* the channel sums' per-part doubles (dp_cuda_sum_partials), grows on demand */
  size_t partials_bytes;
  float *row_loss;         /* softmax_xent: (rows) on the device */
  int32_t *row_hit;
  float *host_loss;        /* and their host copies, pinned (cudaHostAlloc) so that */
  int32_t *host_hit;       /* the copies are asynchronous */
  int64_t rows;
  int64_t pending_rows;    /* rows of the last deferred softmax_xent, copied when metrics_ready is */
  int64_t flag_rows;       /* rows of the last softmax_xent in row_loss, for loss_flag */
  cudaEvent_t metrics_ready;
  conv_plan plans[CUDA_PLANS];
  int next_plan;           /* round-robin eviction */
} cuda_ctx;

/* Frees of device or pinned host memory that CUDA refused (a broken
 * context): a free path has no caller to report to, so each is counted here,
 * the last one's error kept, for dp_cuda_failed_frees; the memory is lost,
 * nothing crashes. */
static _Atomic unsigned long long cuda_failed_frees;
static _Atomic int cuda_last_free_error;

static void note_free(cudaError_t e) {
  if (e == cudaSuccess) return;
  atomic_fetch_add(&cuda_failed_frees, 1u);
  atomic_store(&cuda_last_free_error, (int)e);
  cudaGetLastError(); /* cleared unless sticky */
}

/* Every entry point: the device's context, its GPU made current on this thread. */
#define CUDA_ENTER(dev, c)          \
  cuda_ctx *c = (cuda_ctx *)(dev)->ctx; \
  DP_CUDA_CHECK(cudaSetDevice(c->gpu))

/* ---- memory and copies ------------------------------------------------------ */

/* The arena's chunks. It calls these from cuda_alloc / cuda_scratch (whose
 * CUDA_ENTER made the GPU current) and from cuda_destroy. */
static dp_status cuda_chunk_alloc(void *ctx, size_t bytes, void **out) {
  const cuda_ctx *c = ctx;
  cudaError_t e = cudaMalloc(out, bytes);
  if (e == cudaErrorMemoryAllocation) {
    cudaGetLastError(); /* not sticky; clear it */
    return DP_FAIL(DP_ERR_MEMORY, "cannot reserve %zu bytes on GPU %d (cudaMalloc: out of memory)", bytes, c->gpu);
  }
  DP_CUDA_CHECK(e);
  return DP_OK;
}

static void cuda_chunk_free(void *ctx, void *chunk) {
  (void)ctx;
  note_free(cudaFree(chunk));
}

/* A block of the device's arena, contents undefined: the scratch buffers.
 * `what` goes into the error message. Inside a step (dev->in_step) only the
 * chunks already held serve it: never a cudaMalloc (backend.h, in_step). */
static dp_status cuda_scratch(dp_device *dev, cuda_ctx *c, size_t bytes, const char *what, void **out) {
  dp_status st = dev->in_step ? dp_arena_alloc_reserved(c->arena, bytes, what, out)
                              : dp_arena_alloc(c->arena, bytes, out);
  if (st != DP_OK) {
    char why[512];
    snprintf(why, sizeof why, "%s", dp_error_message());
    return DP_FAIL(st, "cannot allocate %zu bytes on %s: %s", bytes, dev->name, why);
  }
  return DP_OK;
}

static dp_status cuda_alloc(dp_device *dev, size_t bytes, void **out) {
  CUDA_ENTER(dev, c);
  void *p = NULL;
  DP_TRY(cuda_scratch(dev, c, bytes, "a new buffer", &p));
  /* zero-filled as the table promises; synchronized so that the zeros are
   * visible to work on any stream (the collectives read other replicas' buffers) */
  cudaError_t z = bytes ? cudaMemsetAsync(p, 0, bytes, c->stream) : cudaSuccess;
  if (z == cudaSuccess) z = cudaStreamSynchronize(c->stream);
  if (z != cudaSuccess) {
    /* p is the block just handed out: releasing it cannot fail, and the
     * zero-fill's error is the one to report */
    dp_status_ignore(dp_arena_release(c->arena, p));
    return DP_FAIL(DP_ERR_CUDA, "zero-filling a new buffer on %s failed: %s (%d): %s", dev->name, cudaGetErrorName(z),
                   (int)z, cudaGetErrorString(z));
  }
  *out = p;
  return DP_OK;
}

/* Work still queued on this device's stream may use p, so the stream finishes
 * before the arena may hand p out again (as cudaFree waited before). Work on
 * other streams that reads p is its caller's to order, as for copies between
 * devices. If the stream cannot be synchronized (a broken context), p stays
 * out of use until cuda_destroy gives the whole arena back. */
static void cuda_release(dp_device *dev, void *p) {
  cuda_ctx *c = dev->ctx;
  if (cudaSetDevice(c->gpu) == cudaSuccess && cudaStreamSynchronize(c->stream) == cudaSuccess) {
    /* an unknown p is a caller's bug, and release has no status to report it with */
    dp_status_ignore(dp_arena_release(c->arena, p));
    return;
  }
  cudaGetLastError();
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

/* Two pinned regions of at least `want` bytes each (at most STAGING_MAX):
 * grown after every copy out of the old ones has finished. cudaHostAlloc with
 * cudaHostAllocDefault is cudaMallocHost: page-locked host memory the device
 * reads by DMA (CUDA Runtime API, cudaHostAlloc). */
static dp_status staging_reserve(const dp_device *dev, cuda_ctx *c, size_t want) {
  if (want <= c->region_bytes) return DP_OK;
  size_t region = STAGING_MIN;
  while (region < want && region < STAGING_MAX) region *= 2;
  /* cudaFreeHost and cudaHostAlloc: not while peers' collectives may wait */
  DP_TRY(dp_device_may_grow(dev, "the pinned staging regions", 2 * c->region_bytes, 2 * region, "bytes"));
  if (c->staging) {
    DP_CUDA_CHECK(cudaEventSynchronize(c->staged[0]));
    DP_CUDA_CHECK(cudaEventSynchronize(c->staged[1]));
    const cudaError_t freed = cudaFreeHost(c->staging);
    c->staging = NULL;
    c->region_bytes = 0;
    note_free(freed);
    DP_CUDA_CHECK(freed);
  }
  void *p = NULL;
  cudaError_t e = cudaHostAlloc(&p, 2 * region, cudaHostAllocDefault);
  if (e == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    return DP_FAIL(DP_ERR_MEMORY, "cannot allocate %zu bytes of pinned host memory (cudaHostAlloc)", 2 * region);
  }
  DP_CUDA_CHECK(e);
  c->staging = p;
  c->region_bytes = region;
  c->next_region = 0;
  return DP_OK;
}

/* Host bytes to this device, piece by piece through the two regions in turn.
 * A region is overwritten only after the event recorded behind its last copy
 * has completed (CUDA Runtime API, Event Management: cudaEventRecord captures
 * the stream's work queued so far; cudaEventSynchronize waits for it, and
 * returns at once for an event never recorded). So the next piece's memcpy
 * overlaps the previous piece's DMA, and the caller's buffer is free on
 * return. Caller holds staging_mutex. */
static dp_status stage_to_device(const dp_device *dev, cuda_ctx *c, char *dst, const char *src, size_t bytes) {
  DP_TRY(staging_reserve(dev, c, bytes < STAGING_MAX ? bytes : STAGING_MAX));
  while (bytes) {
    const int r = c->next_region;
    char *region = c->staging + (size_t)r * c->region_bytes;
    const size_t n = bytes < c->region_bytes ? bytes : c->region_bytes;
    DP_CUDA_CHECK(cudaEventSynchronize(c->staged[r]));
    memcpy(region, src, n);
    /* from page-locked memory: asynchronous for the host (CUDA Runtime API,
     * "API synchronization behavior") */
    DP_CUDA_CHECK(cudaMemcpyAsync(dst, region, n, cudaMemcpyHostToDevice, c->stream));
    cudaError_t e = cudaEventRecord(c->staged[r], c->stream);
    if (e != cudaSuccess) {
      /* the copy just queued is not tracked: let it finish before anyone reuses the region */
      cudaStreamSynchronize(c->stream);
      cudaGetLastError();
      return DP_FAIL(DP_ERR_CUDA, "cudaEventRecord(staged[%d]) failed: %s (%d): %s", r, cudaGetErrorName(e), (int)e,
                     cudaGetErrorString(e));
    }
    c->next_region = 1 - r;
    dst += n;
    src += n;
    bytes -= n;
  }
  return DP_OK;
}

/* dst: this device's memory; src: host memory or device memory.
 * - From host memory (pageable, or pinned by someone else): through the
 *   staging regions (stage_to_device). The copy is ordered on this device's
 *   stream like a kernel, and like a kernel's output dst is ready for other
 *   streams and the host only after a synchronize. The caller may reuse or
 *   free src on return. (A cudaMemcpyAsync straight from pageable memory
 *   "might be synchronous" only, hence the stream sync this replaces.)
 * - From device memory: cudaMemcpyDefault infers the direction from the
 *   unified address space; ordered on this device's stream only, so a caller
 *   copying from another logical device's memory synchronizes that device
 *   first (dp_mirrored_broadcast does). */
static dp_status cuda_copy_to_device(dp_device *dev, void *dst, const void *src, size_t bytes) {
  CUDA_ENTER(dev, c);
  if (!bytes) return DP_OK;
  if (is_device_pointer(src)) {
    DP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, c->stream));
    return DP_OK;
  }
  pthread_mutex_lock(&c->staging_mutex);
  dp_status st = stage_to_device(dev, c, dst, src, bytes);
  pthread_mutex_unlock(&c->staging_mutex);
  return st;
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

/* A growable scratch block *buf of *have bytes: at least `bytes` on return
 * (*out NULL when bytes is 0). Growing is a dp_device_may_grow (never inside a
 * mirrored step: the warm-up sizes it) and gives the old block back after the
 * stream's queued work (which may use it) has finished. */
static dp_status cuda_grown(dp_device *dev, cuda_ctx *c, const char *what, size_t bytes, void **buf, size_t *have,
                            void **out) {
  if (bytes > *have) {
    DP_TRY(dp_device_may_grow(dev, what, *have, bytes, "bytes"));
    DP_CUDA_CHECK(cudaStreamSynchronize(c->stream));
    DP_TRY(dp_arena_release(c->arena, *buf));
    *buf = NULL;
    *have = 0;
    DP_TRY(cuda_scratch(dev, c, bytes, what, buf));
    *have = bytes;
  }
  *out = bytes ? *buf : NULL;
  return DP_OK;
}

/* The cuDNN workspace: at least `bytes`. */
static dp_status cuda_workspace(dp_device *dev, cuda_ctx *c, size_t bytes, void **out) {
  return cuda_grown(dev, c, "the cuDNN workspace", bytes, &c->workspace, &c->workspace_bytes, out);
}

/* The scratch of the channel sums of x (N, C, HW): dp_cuda_sum_partials(N, C,
 * HW) doubles (NULL when none are needed). The kernels using it are queued in
 * order on the device's stream, so one sum's partials never meet another's. */
static dp_status cuda_partials(dp_device *dev, cuda_ctx *c, int64_t N, int C, int HW, double **out) {
  const size_t bytes = sizeof(double) * (size_t)dp_cuda_sum_partials(N, C, HW);
  void *p;
  DP_TRY(cuda_grown(dev, c, "the channel sums' partials", bytes, &c->partials, &c->partials_bytes, &p));
  *out = p;
  return DP_OK;
}

/* ---- settings --------------------------------------------------------------------- */

static void plans_clear(cuda_ctx *c);

/* cuBLAS: CUBLAS_DEFAULT_MATH keeps float32 GEMMs in float32 (its precision
 * is at least the one asked for); CUBLAS_TF32_TENSOR_OP_MATH lets single
 * precision routines use TF32 tensor cores (cuBLAS Library User Guide,
 * cublasMath_t). cuDNN: the plans are made again with the new rules. Neither
 * waits for the stream: the math mode is the handle's host state, read by the
 * calls made after it, and a plan holds no device memory (plans_clear). */
static dp_status cuda_apply_settings(cuda_ctx *c, int deterministic, int allow_tf32) {
  deterministic = !!deterministic;
  allow_tf32 = !!allow_tf32;
  if (deterministic == c->deterministic && allow_tf32 == c->allow_tf32) return DP_OK;
  if (allow_tf32 != c->allow_tf32)
    DP_CUBLAS_CHECK(cublasSetMathMode(c->cublas, allow_tf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH));
  plans_clear(c);
  c->deterministic = deterministic;
  c->allow_tf32 = allow_tf32;
  return DP_OK;
}

/* Takes the process-wide settings of snapshot (dp_cuda_defaults_snapshot) if
 * they changed since this device last did; see dp_cuda_take_defaults for
 * where. The entry points of a step never call it. */
static dp_status cuda_follow_defaults(cuda_ctx *c, unsigned long long s) {
  if (s == c->defaults_seen) return DP_OK;
  DP_TRY(cuda_apply_settings(c, (int)(s & 1u), (int)((s >> 1) & 1u)));
  c->defaults_seen = s;
  return DP_OK;
}

/* ---- convolution (cuDNN) -------------------------------------------------------- */

/* The math types a plan accepts. cuDNN API reference, cudnnMathType_t:
 * CUDNN_FMA_MATH restricts cuDNN to FMA kernels; CUDNN_DEFAULT_MATH permits
 * TF32 tensor cores on float32 data (Ampere and newer); CUDNN_TENSOR_OP_MATH
 * permits tensor cores; CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION also converts
 * float32 down to half, which is not TF32, so it is never accepted. Without
 * TF32 the descriptor stays in CUDNN_FMA_MATH whatever the heuristics report;
 * with TF32 each algorithm runs with the math type the heuristics gave it
 * (cudnnConvolutionFwdAlgoPerf_t.mathType, "the math type provided to the
 * algorithm"), set on the descriptor before the call. */
static int math_acceptable(cudnnMathType_t m, int allow_tf32) {
  if (m == CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION) return 0;
  if (m == CUDNN_TENSOR_OP_MATH) return allow_tf32;
  return 1;
}

static cudnnMathType_t plan_math(const cuda_ctx *c, cudnnMathType_t heuristic) {
  return c->allow_tf32 ? heuristic : CUDNN_FMA_MATH;
}

/* The first algorithm of the heuristics' list (best first) that cuDNN supports
 * for these descriptors, is deterministic when asked, and uses tensor cores
 * only when TF32 is allowed. The *_WINOGRAD_NONFUSED algorithms are skipped for
 * their precision, as TensorFlow does (NVIDIA developer forum, "Variations in
 * heuristics for selecting conv algorithm in different APIs"). cuDNN API
 * reference: cudnnGetConvolutionForwardAlgorithm_v7 and its BackwardData /
 * BackwardFilter twins fill perfResults with algo, status, memory,
 * determinism and mathType per algorithm. */
/* The _v7 heuristics apply no memory limit: an FFT algorithm may ask for gigabytes of workspace at
 * a large batch, which the workspace would then fail to grow to. Algorithms that need more than
 * DP_CONV_WORKSPACE_LIMIT are passed over for the next in the list. */
#define DP_CONV_WORKSPACE_LIMIT ((size_t)1 << 30)
#define DP_ACCEPTABLE(perf, c, nonfused)                                                           \
  ((perf).status == CUDNN_STATUS_SUCCESS && (perf).algo != (nonfused) &&                           \
   (perf).memory <= DP_CONV_WORKSPACE_LIMIT &&                                                     \
   (!(c)->deterministic || (perf).determinism == CUDNN_DETERMINISTIC) &&                           \
   math_acceptable((perf).mathType, (c)->allow_tf32))

enum { MAX_ALGOS = 16 };

static dp_status plan_algorithms(cuda_ctx *c, conv_plan *p) {
  const dp_cudnn_conv_descs *d = &p->d;
  int got = 0, i;
  /* the math type the heuristics are asked under (the workspace queries below
   * set each algorithm's own before asking for its size) */
  const cudnnMathType_t query = c->allow_tf32 ? CUDNN_DEFAULT_MATH : CUDNN_FMA_MATH;

  cudnnConvolutionFwdAlgoPerf_t fwd[MAX_ALGOS];
  DP_CUDNN_CHECK(cudnnSetConvolutionMathType(d->conv, query));
  DP_CUDNN_CHECK(cudnnGetConvolutionForwardAlgorithm_v7(c->cudnn, d->x, d->w, d->conv, d->y, MAX_ALGOS, &got, fwd));
  for (i = 0; i < got && !DP_ACCEPTABLE(fwd[i], c, CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED); ++i) {
  }
  if (i == got)
    return DP_FAIL(DP_ERR_CUDA, "cuDNN offers no suitable forward algorithm (of %d, within %zu MiB of workspace)%s",
                   got, DP_CONV_WORKSPACE_LIMIT >> 20, c->deterministic ? " that is deterministic" : "");
  p->fwd = fwd[i].algo;
  p->fwd_math = plan_math(c, fwd[i].mathType);
  DP_CUDNN_CHECK(cudnnSetConvolutionMathType(d->conv, p->fwd_math));
  DP_CUDNN_CHECK(cudnnGetConvolutionForwardWorkspaceSize(c->cudnn, d->x, d->w, d->conv, d->y, p->fwd, &p->fwd_bytes));

  cudnnConvolutionBwdDataAlgoPerf_t bd[MAX_ALGOS];
  DP_CUDNN_CHECK(cudnnSetConvolutionMathType(d->conv, query));
  DP_CUDNN_CHECK(cudnnGetConvolutionBackwardDataAlgorithm_v7(c->cudnn, d->w, d->y, d->conv, d->x, MAX_ALGOS, &got, bd));
  for (i = 0; i < got && !DP_ACCEPTABLE(bd[i], c, CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD_NONFUSED); ++i) {
  }
  if (i == got)
    return DP_FAIL(DP_ERR_CUDA, "cuDNN offers no suitable backward-data algorithm (of %d)%s", got,
                   c->deterministic ? " that is deterministic" : "");
  p->bwd_data = bd[i].algo;
  p->bwd_data_math = plan_math(c, bd[i].mathType);
  DP_CUDNN_CHECK(cudnnSetConvolutionMathType(d->conv, p->bwd_data_math));
  DP_CUDNN_CHECK(cudnnGetConvolutionBackwardDataWorkspaceSize(c->cudnn, d->w, d->y, d->conv, d->x, p->bwd_data,
                                                              &p->bwd_data_bytes));

  cudnnConvolutionBwdFilterAlgoPerf_t bf[MAX_ALGOS];
  DP_CUDNN_CHECK(cudnnSetConvolutionMathType(d->conv, query));
  DP_CUDNN_CHECK(
      cudnnGetConvolutionBackwardFilterAlgorithm_v7(c->cudnn, d->x, d->y, d->conv, d->w, MAX_ALGOS, &got, bf));
  for (i = 0; i < got && !DP_ACCEPTABLE(bf[i], c, CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD_NONFUSED); ++i) {
  }
  if (i == got)
    return DP_FAIL(DP_ERR_CUDA, "cuDNN offers no suitable backward-filter algorithm (of %d)%s", got,
                   c->deterministic ? " that is deterministic" : "");
  p->bwd_filter = bf[i].algo;
  p->bwd_filter_math = plan_math(c, bf[i].mathType);
  DP_CUDNN_CHECK(cudnnSetConvolutionMathType(d->conv, p->bwd_filter_math));
  DP_CUDNN_CHECK(cudnnGetConvolutionBackwardFilterWorkspaceSize(c->cudnn, d->x, d->y, d->conv, d->w, p->bwd_filter,
                                                                &p->bwd_filter_bytes));
  return DP_OK;
}

/* A plan is host state only: cuDNN descriptors (host objects that a cuDNN
 * call reads while it is made; the kernels it queues take their arguments by
 * value, so PyTorch, for one, destroys its descriptors as each call returns),
 * algorithm choices and sizes. So a plan is destroyed, evicted or cleared
 * without waiting for the stream; only device memory that queued work may
 * use (the workspace, an arena block) waits for it (cuda_workspace,
 * cuda_release). */
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
  if (p->used) dp_cudnn_conv_descs_destroy(&p->d); /* no wait: see plans_clear */
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
                                     const float *b, float *y, dp_conv_keep *keep) {
  (void)keep; /* cuDNN keeps no filter transform of ours */
  CUDA_ENTER(dev, c);
  if (N == 0) return DP_OK;
  conv_plan *p;
  DP_TRY(conv_plan_for(dev, c, g, N, &p));
  void *ws;
  DP_TRY(cuda_workspace(dev, c, p->fwd_bytes, &ws));
  const float one = 1.0f, zero = 0.0f;
  if (b) DP_LAUNCH_CHECK(dp_cuda_bias_fill(c->stream, N * conv_out_size(g), g->O, (int64_t)g->OH * g->OW, b, y));
  DP_CUDNN_CHECK(cudnnSetConvolutionMathType(p->d.conv, p->fwd_math));
  DP_CUDNN_CHECK(cudnnConvolutionForward(c->cudnn, &one, p->d.x, x, p->d.w, w, p->d.conv, p->fwd, ws, p->fwd_bytes,
                                         b ? &one : &zero, p->d.y, y));
  return DP_OK;
}

/* dw, db overwritten (beta = 0); dx overwritten unless NULL. db is a channel
 * sum of dy over (N, OH*OW): our deterministic reduction kernel. */
static dp_status cuda_conv2d_backward(dp_device *dev, const dp_conv_geom *g, int64_t N, const float *x, const float *w,
                                      const float *dy, float *dx, float *dw, float *db, dp_conv_keep *keep) {
  (void)keep;
  CUDA_ENTER(dev, c);
  if (N == 0) {
    DP_LAUNCH_CHECK(dp_cuda_fill(c->stream, (int64_t)g->O * g->C * g->KH * g->KW, dw, 0.0f));
    if (db) DP_LAUNCH_CHECK(dp_cuda_fill(c->stream, g->O, db, 0.0f));
    return DP_OK;
  }
  conv_plan *p;
  DP_TRY(conv_plan_for(dev, c, g, N, &p));
  const float one = 1.0f, zero = 0.0f;
  if (db) {
    double *partials;
    DP_TRY(cuda_partials(dev, c, N, g->O, g->OH * g->OW, &partials));
    DP_LAUNCH_CHECK(dp_cuda_channel_sums(c->stream, N, g->O, g->OH * g->OW, dy, NULL, partials, db));
  }
  void *ws;
  DP_TRY(cuda_workspace(dev, c, p->bwd_filter_bytes, &ws));
  DP_CUDNN_CHECK(cudnnSetConvolutionMathType(p->d.conv, p->bwd_filter_math));
  DP_CUDNN_CHECK(cudnnConvolutionBackwardFilter(c->cudnn, &one, p->d.x, x, p->d.y, dy, p->d.conv, p->bwd_filter, ws,
                                                p->bwd_filter_bytes, &zero, p->d.w, dw));
  if (dx) {
    DP_TRY(cuda_workspace(dev, c, p->bwd_data_bytes, &ws));
    DP_CUDNN_CHECK(cudnnSetConvolutionMathType(p->d.conv, p->bwd_data_math));
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
  if (db) {
    double *partials;
    DP_TRY(cuda_partials(dev, c, N, nout, 1, &partials));
    DP_LAUNCH_CHECK(dp_cuda_channel_sums(c->stream, N, nout, 1, dy, NULL, partials, db));
  }
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

/* The fused pair as the two kernels in turn: on a GPU both are launches on
 * one stream and cuDNN-free, so this keeps the table's promise (the separate
 * ops' results) without a kernel of its own; the pass it saves is the CPU's. */
static dp_status cuda_relu_avgpool_forward(dp_device *dev, const dp_pool_geom *g, int64_t N, const float *x, float *r,
                                           float *y) {
  DP_TRY(cuda_relu_forward(dev, N * g->C * (int64_t)g->H * g->W, x, r));
  return cuda_avgpool_forward(dev, g, N, r, y);
}

static dp_status cuda_avgpool_relu_backward(dp_device *dev, const dp_pool_geom *g, int64_t N, const float *r,
                                            const float *dy, float *dx) {
  DP_TRY(cuda_avgpool_backward(dev, g, N, dy, dx));
  return cuda_relu_backward(dev, N * g->C * (int64_t)g->H * g->W, r, dx, dx); /* element-wise: in place is safe */
}

/* cuDNN's convolutions read a whole dy: no fused form here (the model runs the two ops) */
static dp_status cuda_conv2d_relu_avgpool_backward(dp_device *dev, const dp_conv_geom *g, const dp_pool_geom *pg,
                                                   int64_t N, const float *x, const float *w, const float *y,
                                                   const float *dp, float *dx, float *dw, float *db, int *done) {
  *done = 0;
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
/* The host's sums of the rows copied last, in row order in double, as the CPU backend sums them. */
static void sum_rows(const cuda_ctx *c, int64_t N, double *loss_sum, int64_t *correct) {
  double s = 0.0;
  int64_t hits = 0;
  for (int64_t n = 0; n < N; ++n) {
    s += c->host_loss[n];
    hits += c->host_hit[n] != 0;
  }
  *loss_sum = s;
  *correct = hits;
}

/* Row losses and hits on the device, copied to pinned host memory on the
 * stream. Immediate: the host waits for the copy. Deferred (loss_sum NULL):
 * an event marks the copy, and metrics_read waits for that event only, so
 * the backward pass and the step queued after it run on (cudaEventSynchronize
 * waits for the work captured by the event's last record: CUDA Runtime API,
 * "Event Management"). A device-to-pageable copy would make the host wait
 * ("API synchronization behavior"), hence pinned buffers. */
static dp_status cuda_softmax_xent(dp_device *dev, int64_t N, int K, const float *logits, const int32_t *labels,
                                   float scale, float *dlogits, double *loss_sum, int64_t *correct) {
  CUDA_ENTER(dev, c);
  if (loss_sum) *loss_sum = 0.0;
  if (correct) *correct = 0;
  c->pending_rows = 0;
  c->flag_rows = 0;
  if (N == 0) return DP_OK;
  if (N > c->rows) {
    DP_TRY(dp_device_may_grow(dev, "the loss rows (device and pinned host)", (size_t)c->rows, (size_t)N, "rows"));
    DP_CUDA_CHECK(cudaStreamSynchronize(c->stream)); /* the old buffers may be in use */
    DP_TRY(dp_arena_release(c->arena, c->row_loss));
    DP_TRY(dp_arena_release(c->arena, c->row_hit));
    const cudaError_t freed_loss = c->host_loss ? cudaFreeHost(c->host_loss) : cudaSuccess;
    const cudaError_t freed_hit = c->host_hit ? cudaFreeHost(c->host_hit) : cudaSuccess;
    c->row_loss = NULL;
    c->row_hit = NULL;
    c->host_loss = NULL;
    c->host_hit = NULL;
    c->rows = 0;
    /* the buffers are gone from the context either way; a refused free is this call's error */
    note_free(freed_loss);
    note_free(freed_hit);
    DP_CUDA_CHECK(freed_loss);
    DP_CUDA_CHECK(freed_hit);
    DP_TRY(cuda_scratch(dev, c, sizeof(float) * (size_t)N, "the loss rows", (void **)&c->row_loss));
    DP_TRY(cuda_scratch(dev, c, sizeof(int32_t) * (size_t)N, "the hit rows", (void **)&c->row_hit));
    DP_CUDA_CHECK(cudaHostAlloc((void **)&c->host_loss, sizeof(float) * (size_t)N, cudaHostAllocDefault));
    DP_CUDA_CHECK(cudaHostAlloc((void **)&c->host_hit, sizeof(int32_t) * (size_t)N, cudaHostAllocDefault));
    c->rows = N;
  }
  DP_LAUNCH_CHECK(dp_cuda_softmax_xent(c->stream, N, K, logits, labels, scale, dlogits, c->row_loss, c->row_hit));
  c->flag_rows = N;
  DP_CUDA_CHECK(cudaMemcpyAsync(c->host_loss, c->row_loss, sizeof(float) * (size_t)N, cudaMemcpyDeviceToHost, c->stream));
  DP_CUDA_CHECK(cudaMemcpyAsync(c->host_hit, c->row_hit, sizeof(int32_t) * (size_t)N, cudaMemcpyDeviceToHost, c->stream));
  if (!loss_sum) {
    DP_CUDA_CHECK(cudaEventRecord(c->metrics_ready, c->stream));
    c->pending_rows = N;
    return DP_OK;
  }
  DP_CUDA_CHECK(cudaStreamSynchronize(c->stream));
  sum_rows(c, N, loss_sum, correct);
  return DP_OK;
}

/* Polls event e (or, when e is NULL, stream s) with cudaEventQuery /
 * cudaStreamQuery every 100 us until its work has finished or `timeout`
 * seconds have passed: cudaSuccess, the query's error, or cudaErrorNotReady
 * at the deadline; *waited: the seconds it took. */
static cudaError_t poll_done(cudaEvent_t e, cudaStream_t s, double timeout, double *waited) {
  struct timespec t0, now;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (;;) {
    const cudaError_t q = e ? cudaEventQuery(e) : cudaStreamQuery(s);
    clock_gettime(CLOCK_MONOTONIC, &now);
    *waited = (double)(now.tv_sec - t0.tv_sec) + 1e-9 * (double)(now.tv_nsec - t0.tv_nsec);
    if (q != cudaErrorNotReady || *waited > timeout) return q;
    (void)cudaGetLastError(); /* "not ready" is no error: the next launch must not report it */
    const struct timespec nap = {0, 100000L}; /* 100 us */
    nanosleep(&nap, NULL);
  }
}

/* cudaEventSynchronize, or with dev->wait_timeout set, cudaEventQuery polled
 * until the deadline: the event's work may wait on an NCCL peer in another
 * process that stopped, and the host must not wait for it forever. */
static dp_status wait_event(dp_device *dev, cudaEvent_t e, const char *what) {
  if (!(dev->wait_timeout > 0.0)) {
    DP_CUDA_CHECK(cudaEventSynchronize(e));
    return DP_OK;
  }
  double waited = 0.0;
  const cudaError_t q = poll_done(e, NULL, dev->wait_timeout, &waited);
  if (q == cudaErrorNotReady)
    return DP_FAIL(DP_ERR_DIST, "%s: waited %.0f s for %s; its NCCL collectives wait for a process that stopped or "
                   "hung (the limit is the strategy's timeout=%g s)", dev->name, waited, what, dev->wait_timeout);
  DP_CUDA_CHECK(q);
  return DP_OK;
}

static dp_status cuda_metrics_read(dp_device *dev, double *loss_sum, int64_t *correct) {
  CUDA_ENTER(dev, c);
  *loss_sum = 0.0;
  *correct = 0;
  if (!c->pending_rows) return DP_OK;
  DP_TRY(wait_event(dev, c->metrics_ready, "the step's loss"));
  sum_rows(c, c->pending_rows, loss_sum, correct);
  c->pending_rows = 0;
  return DP_OK;
}

/* The guard is read by the kernel on the device (no host wait); untested
 * here: the CPU suite proves the shared bodies (dp_step_allowed,
 * dp_loss_flag), and these launchers only pass pointers through. */
static dp_status cuda_sgd_update(dp_device *dev, int64_t n, float *w, const float *g, float *v, float lr, float mu,
                                 float wd, const float *guard) {
  CUDA_ENTER(dev, c);
  DP_LAUNCH_CHECK(dp_cuda_sgd_update(c->stream, n, w, g, v, lr, mu, wd, guard));
  return DP_OK;
}

/* The rows the last softmax_xent left in row_loss, queued on the stream after it. */
static dp_status cuda_loss_flag(dp_device *dev, float *flag) {
  CUDA_ENTER(dev, c);
  DP_LAUNCH_CHECK(dp_cuda_loss_flag(c->stream, c->flag_rows, c->row_loss, flag));
  return DP_OK;
}

static dp_status cuda_restore_unless_allowed(dp_device *dev, int64_t n, float *dst, const float *saved,
                                             const float *guard) {
  CUDA_ENTER(dev, c);
  DP_LAUNCH_CHECK(dp_cuda_restore_unless_allowed(c->stream, n, dst, saved, guard));
  return DP_OK;
}

static dp_status cuda_add(dp_device *dev, int64_t n, const float *a, const float *b, float *y) {
  CUDA_ENTER(dev, c);
  DP_LAUNCH_CHECK(dp_cuda_add(c->stream, n, a, b, y));
  return DP_OK;
}

static dp_status cuda_add_relu(dp_device *dev, int64_t n, const float *a, const float *b, float *y) {
  CUDA_ENTER(dev, c);
  DP_LAUNCH_CHECK(dp_cuda_add_relu(c->stream, n, a, b, y));
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
  double *partials;
  DP_TRY(cuda_partials(dev, c, N, C, HW, &partials));
  DP_LAUNCH_CHECK(dp_cuda_channel_sums(c->stream, N, C, HW, x, mean, partials, out));
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
  DP_LAUNCH_CHECK(dp_cuda_bn_apply(c->stream, N, C, HW, x, mean, invstd, gamma, beta, y, 0));
  return DP_OK;
}

static dp_status cuda_bn_apply_relu(dp_device *dev, int64_t N, int C, int HW, const float *x, const float *mean,
                                    const float *invstd, const float *gamma, const float *beta, float *y) {
  CUDA_ENTER(dev, c);
  DP_LAUNCH_CHECK(dp_cuda_bn_apply(c->stream, N, C, HW, x, mean, invstd, gamma, beta, y, 1));
  return DP_OK;
}

static dp_status cuda_bn_backward_sums(dp_device *dev, int64_t N, int C, int HW, const float *x, const float *dy,
                                       const float *mean, const float *invstd, const float *gamma,
                                       const float *relu_beta, float *sum_dy, float *sum_dy_xhat) {
  CUDA_ENTER(dev, c);
  double *partials;
  DP_TRY(cuda_partials(dev, c, N, C, HW, &partials));
  DP_LAUNCH_CHECK(dp_cuda_bn_backward_sums(c->stream, N, C, HW, x, dy, mean, invstd, gamma, relu_beta, partials,
                                           sum_dy, sum_dy_xhat));
  return DP_OK;
}

static dp_status cuda_bn_backward_dx(dp_device *dev, int64_t N, int C, int HW, const float *x, const float *dy,
                                     const float *mean, const float *invstd, const float *gamma,
                                     const float *relu_beta, const float *sum_dy, const float *sum_dy_xhat,
                                     float inv_count, float *dx) {
  CUDA_ENTER(dev, c);
  DP_LAUNCH_CHECK(dp_cuda_bn_backward_dx(c->stream, N, C, HW, x, dy, mean, invstd, gamma, relu_beta, sum_dy,
                                         sum_dy_xhat, inv_count, dx));
  return DP_OK;
}

/* rows: device int32; src and dst: device memory of this GPU */
static dp_status cuda_gather_rows(dp_device *dev, int64_t nrows, int64_t row_bytes, const void *src,
                                  const int32_t *rows, void *dst) {
  CUDA_ENTER(dev, c);
  DP_LAUNCH_CHECK(dp_cuda_gather_rows(c->stream, nrows, row_bytes, src, rows, dst));
  return DP_OK;
}

static dp_status cuda_synchronize(dp_device *dev) {
  CUDA_ENTER(dev, c);
  DP_CUDA_CHECK(cudaStreamSynchronize(c->stream));
  return DP_OK;
}

/* ---- streams and events (the collectives': csrc/comm.c) ------------------------ */

static cudaStream_t cuda_stream_of(const cuda_ctx *c, dp_stream *s) { return s ? (cudaStream_t)s : c->stream; }

static dp_status cuda_stream_create(dp_device *dev, dp_stream **out) {
  CUDA_ENTER(dev, c);
  cudaStream_t s;
  /* non-blocking: never implicitly ordered with the legacy default stream */
  DP_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  *out = (dp_stream *)s;
  return DP_OK;
}

/* Errors are ignored (a destructor reports nothing) and cleared. */
static void cuda_stream_destroy(dp_device *dev, dp_stream *s) {
  const cuda_ctx *c = dev->ctx;
  if (s && cudaSetDevice(c->gpu) == cudaSuccess) {
    cudaStreamSynchronize((cudaStream_t)s);
    cudaStreamDestroy((cudaStream_t)s);
  }
  cudaGetLastError();
}

static dp_status cuda_event_create(dp_device *dev, dp_event **out) {
  CUDA_ENTER(dev, c);
  cudaEvent_t e;
  /* no timing: cheaper to record and to wait on (CUDA Runtime API, cudaEventCreateWithFlags) */
  DP_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  *out = (dp_event *)e;
  return DP_OK;
}

static void cuda_event_destroy(dp_device *dev, dp_event *e) {
  const cuda_ctx *c = dev->ctx;
  if (e && cudaSetDevice(c->gpu) == cudaSuccess) cudaEventDestroy((cudaEvent_t)e);
  cudaGetLastError();
}

/* The event and the stream must be on the same device (CUDA Runtime API,
 * cudaEventRecord): both are this device's. */
static dp_status cuda_event_record(dp_device *dev, dp_event *e, dp_stream *s) {
  CUDA_ENTER(dev, c);
  DP_CUDA_CHECK(cudaEventRecord((cudaEvent_t)e, cuda_stream_of(c, s)));
  return DP_OK;
}

/* The event may be another device's (CUDA Runtime API, cudaStreamWaitEvent). */
static dp_status cuda_event_wait(dp_device *dev, dp_stream *s, dp_event *e) {
  CUDA_ENTER(dev, c);
  DP_CUDA_CHECK(cudaStreamWaitEvent(cuda_stream_of(c, s), (cudaEvent_t)e, 0));
  return DP_OK;
}

/* Safe on a partly initialized context: every member is checked. Errors are
 * ignored (nothing can be reported from a destructor). */
static void cuda_destroy(dp_device *dev) {
  cuda_ctx *c = dev->ctx;
  if (!c) return;
  if (cudaSetDevice(c->gpu) == cudaSuccess) {
    /* after this, no queued work reads a block, the staging regions or a descriptor */
    if (c->stream) cudaStreamSynchronize(c->stream);
    plans_clear(c);
    for (int r = 0; r < 2; ++r)
      if (c->staged[r]) cudaEventDestroy(c->staged[r]);
    if (c->staging) note_free(cudaFreeHost(c->staging));
    if (c->host_loss) note_free(cudaFreeHost(c->host_loss));
    if (c->host_hit) note_free(cudaFreeHost(c->host_hit));
    if (c->metrics_ready) cudaEventDestroy(c->metrics_ready);
    if (c->cublas) cublasDestroy(c->cublas);
    if (c->cudnn) cudnnDestroy(c->cudnn);
    if (c->stream) cudaStreamDestroy(c->stream);
  }
  /* every chunk (the workspace, the partials and the loss rows included); the
   * bookkeeping is host memory and goes even when the GPU could not be made current */
  dp_arena_destroy(c->arena);
  cudaGetLastError();
  if (c->staging_mutex_ready) pthread_mutex_destroy(&c->staging_mutex);
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
    .gather_rows = cuda_gather_rows,
    .conv2d_forward = cuda_conv2d_forward,
    .conv2d_backward = cuda_conv2d_backward,
    .dense_forward = cuda_dense_forward,
    .dense_backward = cuda_dense_backward,
    .relu_forward = cuda_relu_forward,
    .relu_backward = cuda_relu_backward,
    .avgpool_forward = cuda_avgpool_forward,
    .avgpool_backward = cuda_avgpool_backward,
    .relu_avgpool_forward = cuda_relu_avgpool_forward,
    .avgpool_relu_backward = cuda_avgpool_relu_backward,
    .conv2d_relu_avgpool_backward = cuda_conv2d_relu_avgpool_backward,
    .maxpool_forward = cuda_maxpool_forward,
    .maxpool_backward = cuda_maxpool_backward,
    .softmax_xent = cuda_softmax_xent,
    .metrics_read = cuda_metrics_read,
    .sgd_update = cuda_sgd_update,
    .loss_flag = cuda_loss_flag,
    .restore_unless_allowed = cuda_restore_unless_allowed,
    .add = cuda_add,
    .add_relu = cuda_add_relu,
    .scale = cuda_scale,
    .global_avgpool_forward = cuda_global_avgpool_forward,
    .global_avgpool_backward = cuda_global_avgpool_backward,
    .bn_sums = cuda_bn_sums,
    .bn_finalize = cuda_bn_finalize,
    .bn_apply = cuda_bn_apply,
    .bn_apply_relu = cuda_bn_apply_relu,
    .bn_backward_sums = cuda_bn_backward_sums,
    .bn_backward_dx = cuda_bn_backward_dx,
    .synchronize = cuda_synchronize,
    .stream_create = cuda_stream_create,
    .stream_destroy = cuda_stream_destroy,
    .event_create = cuda_event_create,
    .event_destroy = cuda_event_destroy,
    .event_record = cuda_event_record,
    .event_wait = cuda_event_wait,
    .destroy = cuda_destroy,
};

const dp_backend *dp_cuda_backend(void) { return &cuda_backend; }

/* Stream first, then the handles bound to it. A cuDNN / cuBLAS handle belongs
 * to the device current when it is created (cuDNN developer guide, "cuDNN
 * Handle"; cuBLAS guide, "cuBLAS context"); one handle per stream keeps cuBLAS
 * bitwise reproducible (cuBLAS guide, "Results reproducibility"). */
static dp_status cuda_ctx_init(dp_device *dev, cuda_ctx *c) {
  if (pthread_mutex_init(&c->staging_mutex, NULL) != 0)
    return DP_FAIL(DP_ERR_RUNTIME, "%s: pthread_mutex_init failed", dev->name);
  c->staging_mutex_ready = 1;
  DP_TRY(dp_arena_create(0, cuda_chunk_alloc, cuda_chunk_free, c, &c->arena));
  DP_CUDA_CHECK(cudaSetDevice(c->gpu));
  /* non-blocking: never implicitly ordered with the legacy default stream */
  DP_CUDA_CHECK(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking));
  /* no timing: the cheapest events to record and wait for (CUDA Runtime API,
   * cudaEventCreateWithFlags, cudaEventDisableTiming) */
  for (int r = 0; r < 2; ++r) DP_CUDA_CHECK(cudaEventCreateWithFlags(&c->staged[r], cudaEventDisableTiming));
  DP_CUDA_CHECK(cudaEventCreateWithFlags(&c->metrics_ready, cudaEventDisableTiming));
  DP_CUDNN_CHECK(cudnnCreate(&c->cudnn));
  DP_CUDNN_CHECK(cudnnSetStream(c->cudnn, c->stream));
  DP_CUBLAS_CHECK(cublasCreate(&c->cublas));
  DP_CUBLAS_CHECK(cublasSetStream(c->cublas, c->stream));
  /* the process-wide settings as they are now (see cuda_apply_settings for the math modes) */
  const unsigned long long s = dp_cuda_defaults_snapshot();
  c->deterministic = (int)(s & 1u);
  c->allow_tf32 = (int)((s >> 1) & 1u);
  c->defaults_seen = s;
  DP_CUBLAS_CHECK(cublasSetMathMode(c->cublas, c->allow_tf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH));
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

/* The per-device setters: a process-wide change not yet taken is taken first,
 * so that this later call wins. */
dp_status dp_cuda_set_deterministic(dp_device *dev, int deterministic) {
  if (dev->kind != DP_DEVICE_CUDA) return DP_FAIL(DP_ERR_VALUE, "%s is not a CUDA device", dev->name);
  CUDA_ENTER(dev, c);
  DP_TRY(cuda_follow_defaults(c, dp_cuda_defaults_snapshot()));
  return cuda_apply_settings(c, deterministic, c->allow_tf32);
}

dp_status dp_cuda_set_allow_tf32(dp_device *dev, int allow) {
  if (dev->kind != DP_DEVICE_CUDA) return DP_FAIL(DP_ERR_VALUE, "%s is not a CUDA device", dev->name);
  CUDA_ENTER(dev, c);
  DP_TRY(cuda_follow_defaults(c, dp_cuda_defaults_snapshot()));
  return cuda_apply_settings(c, c->deterministic, allow);
}

dp_status dp_cuda_wait_idle(dp_device *dev, double timeout) {
  if (dev->kind != DP_DEVICE_CUDA || !dev->ctx) return DP_OK;
  CUDA_ENTER(dev, c);
  double waited = 0.0;
  const cudaError_t q = poll_done(NULL, c->stream, timeout, &waited);
  if (q == cudaErrorNotReady)
    return DP_FAIL(DP_ERR_RUNTIME, "%s: the work queued on its stream has not finished after %.0f s (an NCCL "
                   "collective waiting for a peer that stopped, or a kernel that hangs)", dev->name, waited);
  DP_CUDA_CHECK(q);
  return DP_OK;
}

unsigned long long dp_cuda_failed_frees(char *last_error, size_t len) {
  const unsigned long long n = atomic_load(&cuda_failed_frees);
  const cudaError_t e = (cudaError_t)atomic_load(&cuda_last_free_error);
  if (last_error && len) snprintf(last_error, len, "%s", n ? cudaGetErrorName(e) : "");
  return n;
}

dp_status dp_cuda_take_defaults(dp_device *dev, unsigned long long snapshot) {
  dev->fast_conv = (int)((snapshot >> 2) & 1u);
  if (dev->kind != DP_DEVICE_CUDA || !dev->ctx) return DP_OK;
  CUDA_ENTER(dev, c);
  return cuda_follow_defaults(c, snapshot);
}

dp_status dp_cuda_memory_stats(dp_device *dev, dp_arena_stats *out) {
  if (dev->kind != DP_DEVICE_CUDA || !dev->ctx) return DP_FAIL(DP_ERR_VALUE, "%s is not a CUDA device", dev->name);
  dp_arena_get_stats(((cuda_ctx *)dev->ctx)->arena, out);
  return DP_OK;
}

int dp_cuda_device_gpu(const dp_device *dev) {
  return dev->kind == DP_DEVICE_CUDA && dev->ctx ? ((const cuda_ctx *)dev->ctx)->gpu : -1;
}

void *dp_cuda_device_stream(const dp_device *dev) {
  return dev->kind == DP_DEVICE_CUDA && dev->ctx ? (void *)((const cuda_ctx *)dev->ctx)->stream : NULL;
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

dp_status dp_cuda_set_allow_tf32(dp_device *dev, int allow) {
  (void)allow;
  return DP_FAIL(DP_ERR_UNSUPPORTED, "%s: dpcore was built without the CUDA backend", dev->name);
}

dp_status dp_cuda_take_defaults(dp_device *dev, unsigned long long snapshot) {
  dev->fast_conv = (int)((snapshot >> 2) & 1u);
  return DP_OK;
}

dp_status dp_cuda_wait_idle(dp_device *dev, double timeout) {
  (void)dev;
  (void)timeout;
  return DP_OK;
}

unsigned long long dp_cuda_failed_frees(char *last_error, size_t len) {
  if (last_error && len) last_error[0] = '\0';
  return 0;
}

dp_status dp_cuda_memory_stats(dp_device *dev, dp_arena_stats *out) {
  (void)out;
  return DP_FAIL(DP_ERR_UNSUPPORTED, "%s: dpcore was built without the CUDA backend", dev->name);
}

int dp_cuda_device_gpu(const dp_device *dev) {
  (void)dev;
  return -1;
}

void *dp_cuda_device_stream(const dp_device *dev) {
  (void)dev;
  return NULL;
}

#endif
