/* backend.h — devices and the backend table.
 *
 * A backend is a table of function pointers; a device is a backend plus its
 * context (cpu: a thread count and scratch memory; cuda: a GPU, stream and
 * handles). Layers and models are written once against this table. The
 * binding's devices come from the registry (csrc/device.h), one per name,
 * shared by the models and tensors on it. Every pointer argument named x, w,
 * y, dx, ... is device memory of that device; shapes are in the comments
 * (NCHW, row-major, float32).
 */
#ifndef DP_BACKEND_H
#define DP_BACKEND_H

#include <stdint.h>

#include "arena.h"
#include "dp_status.h"

typedef enum dp_device_kind { DP_DEVICE_CPU = 0, DP_DEVICE_CUDA = 1 } dp_device_kind;

/* A convolution's transformed filter, kept from its forward pass for its
 * backward pass (conv2d_forward's keep). u: `floats` floats of device memory,
 * allocated by the backend on first use, freed by the owner with
 * dp_device_free; the transform of the w of the last forward pass that set
 * valid. The owner clears valid whenever w may have changed (model.c: every
 * training step). */
typedef struct dp_conv_keep {
  float *u;
  size_t floats;
  int valid;
} dp_conv_keep;

typedef struct dp_backend dp_backend;
/* A stream is a second queue of work on a device beside its own; an event
 * marks the work queued on a stream when it was recorded (backend table
 * below). The collectives (comm.c) order a replica's reductions after its own
 * and its peers' compute with them. On CUDA a dp_stream * is the cudaStream_t
 * and a dp_event * the cudaEvent_t. */
typedef struct dp_stream dp_stream;
typedef struct dp_event dp_event;

typedef struct dp_device {
  dp_device_kind kind;
  int index;            /* cpu:index / cuda:index (logical) */
  int nthreads;         /* cpu: the cores this device may use */
  const dp_backend *backend;
  void *ctx;            /* backend-private */
  char name[32];        /* "cpu:0" */
  /* Set by the mirrored runner (mirrored.c) while a step runs and a peer's
   * collective may be in flight: the device's memory must not grow then
   * (dp_device_may_grow). Why: cudaMalloc, cudaFree and cudaHostAlloc may
   * synchronize with the device, and an allocation while the peers' NCCL
   * kernels wait for this thread hangs them (NVIDIA/nccl pull request 194).
   * The runner sizes every buffer in a warm-up pass instead. */
  int in_step;
  /* Across processes: seconds the host may wait for the device's queued
   * work within a step (0: no limit), set by the mirrored runner. The NCCL
   * kernels of a collective whose peer process stopped spin forever; the
   * deadline turns that hang into DP_ERR_DIST, whose exception ends the job. */
  double wait_timeout;
  /* The CPU backend may take the convolution forms with several times float32
   * GEMM's rounding error (dp_set_fast_convolutions); taken from the
   * process-wide setting where a call or a step begins (dp_cuda_take_defaults). */
  int fast_conv;
  /* The registry's entry of a device made by dp_device_get (csrc/device.c:
   * its references and step lock); NULL for one its caller initialised
   * (dp_cpu_device_init), which the registry leaves alone. */
  struct dp_device_entry *entry;
} dp_device;

/* Convolution geometry: input (N, C, H, W), filter (O, C, KH, KW), output (N, O, OH, OW). */
typedef struct dp_conv_geom {
  int C, H, W, O, KH, KW, stride, pad, OH, OW;
} dp_conv_geom;

/* The gradients of an empty batch: dw (O, C, KH, KW) and db (O, may be NULL)
 * zero (the CPU's convolution forms' backward passes for N = 0). */
static inline void dp_conv_zero_grads(const dp_conv_geom *g, float *dw, float *db) {
  for (int64_t i = 0; i < (int64_t)g->O * g->C * g->KH * g->KW; ++i) dw[i] = 0.0f;
  if (db)
    for (int o = 0; o < g->O; ++o) db[o] = 0.0f;
}

/* Pool geometry lives with its kernels. */
#include "dp_kernels.h"

/* Shapes from arguments (csrc/shapes.c), computed in 64 bits and checked
 * where a layer or a single op is made: every argument, one sample's input
 * and output, and a convolution's weights are at most INT_MAX, so that the
 * kernels may index with an int. Failures are DP_ERR_VALUE, the message
 * starting with `what` ("conv2d (layer 3)") and naming what is at fault. */
DP_MUST_CHECK dp_status dp_input_shape_check(const char *what, int64_t C, int64_t H, int64_t W);
/* input (C, H, W), O filters (KH, KW) */
DP_MUST_CHECK dp_status dp_conv_geom_make(const char *what, int64_t C, int64_t H, int64_t W, int64_t O, int64_t KH,
                                          int64_t KW, int64_t stride, int64_t pad, dp_conv_geom *out);
/* input (C, H, W), a k x k window; padding at most k / 2 */
DP_MUST_CHECK dp_status dp_pool_geom_make(const char *what, int64_t C, int64_t H, int64_t W, int64_t k, int64_t stride,
                                          int64_t pad, dp_pool_geom *out);
/* a * b for sizes (0 when either is <= 0), saturating at INT64_MAX, so that
 * a product can be compared with a limit without wrapping. */
int64_t dp_size_mul(int64_t a, int64_t b);

/* Every entry is filled in every table (dp_backend_null_entries checks). */
struct dp_backend {
  const char *name;
  DP_MUST_CHECK dp_status (*alloc)(dp_device *dev, size_t bytes, void **out); /* zero-filled */
  void (*release)(dp_device *dev, void *p);
  DP_MUST_CHECK dp_status (*copy_to_device)(dp_device *dev, void *dst, const void *src, size_t bytes);
  DP_MUST_CHECK dp_status (*copy_to_host)(dp_device *dev, void *dst, const void *src, size_t bytes);
  DP_MUST_CHECK dp_status (*fill)(dp_device *dev, float *x, int64_t n, float value);
  /* y (n) = x (n uint8) / 255 */
  DP_MUST_CHECK dp_status (*u8_to_unit)(dp_device *dev, float *y, const uint8_t *x, int64_t n);
  /* dst row r = src row rows[r] for r < nrows, rows of row_bytes bytes; rows
   * (int32, each checked by the caller) and both buffers are device memory */
  DP_MUST_CHECK dp_status (*gather_rows)(dp_device *dev, int64_t nrows, int64_t row_bytes, const void *src,
                                         const int32_t *rows, void *dst);

  /* y = conv(x, w) + b.  x (N,C,H,W), w (O,C,KH,KW), b (O), y (N,O,OH,OW).
   * keep (NULL: none): where the backend transforms the filter (the CPU's
   * Winograd on large layers), it keeps the transform there for the layer's
   * backward pass with the same w (dp_conv_keep). */
  DP_MUST_CHECK dp_status (*conv2d_forward)(dp_device *dev, const dp_conv_geom *g, int64_t N, const float *x,
                                            const float *w, const float *b, float *y, dp_conv_keep *keep);
  /* dw, db overwritten with this batch's sums; dx overwritten unless NULL
   * (first layer). keep: the forward's; its transform serves dx when valid. */
  DP_MUST_CHECK dp_status (*conv2d_backward)(dp_device *dev, const dp_conv_geom *g, int64_t N, const float *x,
                                             const float *w, const float *dy, float *dx, float *dw, float *db,
                                             dp_conv_keep *keep);
  /* y (N,nout) = x (N,nin) w^T + b, w (nout,nin): PyTorch's Linear layout */
  DP_MUST_CHECK dp_status (*dense_forward)(dp_device *dev, int64_t N, int nin, int nout, const float *x, const float *w,
                                           const float *b, float *y);
  /* dw, db overwritten with this batch's sums; dx overwritten unless NULL. */
  DP_MUST_CHECK dp_status (*dense_backward)(dp_device *dev, int64_t N, int nin, int nout, const float *x,
                                            const float *w, const float *dy, float *dx, float *dw, float *db);
  DP_MUST_CHECK dp_status (*relu_forward)(dp_device *dev, int64_t n, const float *x, float *y);
  /* dx (n) = 0 where y <= 0, else dy (dp_relu_backward_elem) */
  DP_MUST_CHECK dp_status (*relu_backward)(dp_device *dev, int64_t n, const float *y, const float *dy, float *dx);
  DP_MUST_CHECK dp_status (*avgpool_forward)(dp_device *dev, const dp_pool_geom *g, int64_t N, const float *x,
                                             float *y);
  DP_MUST_CHECK dp_status (*avgpool_backward)(dp_device *dev, const dp_pool_geom *g, int64_t N, const float *dy,
                                              float *dx);
  /* A ReLU whose only reader is an average pooling, fused; the results equal
   * the separate ops'. Forward: y = avgpool(relu(x)), and r (N,C,H,W) =
   * relu(x) where the backend writes it (the CPU's does not). Backward: dx =
   * relu_backward(r, avgpool_backward(dy)), r the ReLU's input or its output
   * alike (both are <= 0 at the same places); the model passes the input.
   * Fused so that each plane is read once while in cache and the ReLU's
   * output gradient is never written. */
  DP_MUST_CHECK dp_status (*relu_avgpool_forward)(dp_device *dev, const dp_pool_geom *g, int64_t N, const float *x,
                                                  float *r, float *y);
  DP_MUST_CHECK dp_status (*avgpool_relu_backward)(dp_device *dev, const dp_pool_geom *g, int64_t N, const float *r,
                                                   const float *dy, float *dx);
  /* A convolution whose output only a ReLU fused with an average pooling
   * reads: its backward pass from the pooling's output gradient dp, its own
   * output gradient relu_backward(y, avgpool_backward(dp)) (y its output)
   * formed a sample at a time in cache and never written; dx (may be NULL),
   * dw, db as conv2d_backward gives them, to the bit. *done = 0, nothing
   * written, where the backend has no such form for g and pg (the model then
   * runs avgpool_relu_backward and conv2d_backward). */
  DP_MUST_CHECK dp_status (*conv2d_relu_avgpool_backward)(dp_device *dev, const dp_conv_geom *g,
                                                          const dp_pool_geom *pg, int64_t N, const float *x,
                                                          const float *w, const float *y, const float *dp, float *dx,
                                                          float *dw, float *db, int *done);
  /* arg (N,C,OH,OW) receives the winner's offset within its input plane */
  DP_MUST_CHECK dp_status (*maxpool_forward)(dp_device *dev, const dp_pool_geom *g, int64_t N, const float *x, float *y,
                                             int32_t *arg);
  DP_MUST_CHECK dp_status (*maxpool_backward)(dp_device *dev, const dp_pool_geom *g, int64_t N, const float *dy,
                                              const int32_t *arg, float *dx);
  /* logits (N,K), labels (N) in [0,K). dlogits = scale * (softmax - onehot)
   * unless NULL. Host outputs: *loss_sum, the row losses summed in float64;
   * *correct, the argmax hits. Both NULL: the sums stay pending for
   * metrics_read (a later softmax_xent replaces them), so that a step queues
   * its backward pass and optimizer step without the host waiting. */
  DP_MUST_CHECK dp_status (*softmax_xent)(dp_device *dev, int64_t N, int K, const float *logits, const int32_t *labels,
                                          float scale, float *dlogits, double *loss_sum, int64_t *correct);
  /* One fused SGD step over a flat buffer (dp_sgd_elem); v may be NULL when
   * mu == 0. guard (one float of device memory, or NULL): the step's loss
   * flag; when it is not finite (dp_step_allowed) nothing is written. Read on
   * the device, so that the host never waits for it. */
  DP_MUST_CHECK dp_status (*sgd_update)(dp_device *dev, int64_t n, float *w, const float *g, float *v, float lr,
                                        float mu, float wd, const float *guard);
  /* flag (one float of device memory) = dp_loss_flag of the row losses of the
   * last softmax_xent on dev (0 after an empty one): 0 when every row's loss
   * is finite, NaN otherwise. Queued; the host does not wait. */
  DP_MUST_CHECK dp_status (*loss_flag)(dp_device *dev, float *flag);
  /* dst (n) = saved (n) when guard's flag is not finite, else nothing: puts
   * back the running statistics of a step that applies no update. */
  DP_MUST_CHECK dp_status (*restore_unless_allowed)(dp_device *dev, int64_t n, float *dst, const float *saved,
                                                    const float *guard);
  /* y (n) = a + b; y may alias a. */
  DP_MUST_CHECK dp_status (*add)(dp_device *dev, int64_t n, const float *a, const float *b, float *y);
  /* y (n) = relu(a + b) in one pass, equal to the separate ops, the add's
   * output never written: for an add whose only reader is the ReLU after it
   * (model.c mark_fusions; the ReLU's backward reads its own output). */
  DP_MUST_CHECK dp_status (*add_relu)(dp_device *dev, int64_t n, const float *a, const float *b, float *y);
  /* x (n) *= alpha */
  DP_MUST_CHECK dp_status (*scale)(dp_device *dev, int64_t n, float *x, float alpha);
  /* Global average pooling: y (N, C) = mean of x (N, C, HW) over HW; backward dx = dy / HW. */
  DP_MUST_CHECK dp_status (*global_avgpool_forward)(dp_device *dev, int64_t N, int C, int HW, const float *x, float *y);
  DP_MUST_CHECK dp_status (*global_avgpool_backward)(dp_device *dev, int64_t N, int C, int HW, const float *dy,
                                                     float *dx);
  /* BatchNorm over x (N, C, HW), per channel c:
   *   bn_sums:   out[c] = sum of x, or of (x - mean[c])^2 when mean is given
   *   bn_finalize: see dp_bn_finalize_channel (sqdev (C), count values)
   *   bn_apply:  y = gamma * (x - mean) * invstd + beta
   *   bn_backward_sums: sum_dy[c], sum_dy_xhat[c] over the batch
   *   bn_backward_dx: see dp_bn_backward_elem
   * Backward, relu_beta non-NULL: a BatchNorm fused with the ReLU after it
   * (bn_apply_relu); dy is the ReLU's output gradient, masked by
   * dp_bn_relu_dy (gamma and relu_beta: the forward pass's parameters), so
   * that the ReLU's own backward pass never runs. */
  DP_MUST_CHECK dp_status (*bn_sums)(dp_device *dev, int64_t N, int C, int HW, const float *x, const float *mean,
                                     float *out);
  DP_MUST_CHECK dp_status (*bn_finalize)(dp_device *dev, int C, const float *sqdev, float count, const float *mean,
                                         float eps, float momentum, int update_running, float *invstd,
                                         float *running_mean, float *running_var);
  DP_MUST_CHECK dp_status (*bn_apply)(dp_device *dev, int64_t N, int C, int HW, const float *x, const float *mean,
                                      const float *invstd, const float *gamma, const float *beta, float *y);
  /* y = relu(bn_apply(x)) in one pass, equal to the separate ops,
   * BatchNorm's output never written: for a BatchNorm whose only reader is
   * the ReLU after it (model.c mark_fusions). */
  DP_MUST_CHECK dp_status (*bn_apply_relu)(dp_device *dev, int64_t N, int C, int HW, const float *x,
                                           const float *mean, const float *invstd, const float *gamma,
                                           const float *beta, float *y);
  DP_MUST_CHECK dp_status (*bn_backward_sums)(dp_device *dev, int64_t N, int C, int HW, const float *x, const float *dy,
                                              const float *mean, const float *invstd, const float *gamma,
                                              const float *relu_beta, float *sum_dy, float *sum_dy_xhat);
  DP_MUST_CHECK dp_status (*bn_backward_dx)(dp_device *dev, int64_t N, int C, int HW, const float *x, const float *dy,
                                            const float *mean, const float *invstd, const float *gamma,
                                            const float *relu_beta, const float *sum_dy, const float *sum_dy_xhat,
                                            float inv_count, float *dx);
  /* The pending sums of the last softmax_xent (0 and 0 when none is pending);
   * waits only for that softmax_xent, not for work queued after it. */
  DP_MUST_CHECK dp_status (*metrics_read)(dp_device *dev, double *loss_sum, int64_t *correct);
  DP_MUST_CHECK dp_status (*synchronize)(dp_device *dev);
  /* A second stream on dev; destroy waits for the work queued on it first.
   * CPU: every call runs to completion on the calling thread, so streams and
   * events order nothing; they are tokens (never NULL) so that the callers
   * need no second path. */
  DP_MUST_CHECK dp_status (*stream_create)(dp_device *dev, dp_stream **out);
  void (*stream_destroy)(dp_device *dev, dp_stream *s);
  DP_MUST_CHECK dp_status (*event_create)(dp_device *dev, dp_event **out);
  void (*event_destroy)(dp_device *dev, dp_event *e);
  /* e captures the work queued so far on s, a stream of dev (NULL: the
   * device's own stream); a later record replaces what it captured. */
  DP_MUST_CHECK dp_status (*event_record)(dp_device *dev, dp_event *e, dp_stream *s);
  /* The work queued on s (NULL: dev's own stream) after this call waits for
   * the work e captured at its latest record before this call; e may belong
   * to another device. The host does not wait. */
  DP_MUST_CHECK dp_status (*event_wait)(dp_device *dev, dp_stream *s, dp_event *e);
  /* Release the device's context (streams, handles, scratch); dev->ctx is
   * cleared by dp_device_destroy afterwards. */
  void (*destroy)(dp_device *dev);
};

/* Writes the names of the NULL entries of `be` (at most max) to out; returns
 * how many there are. Needs no device: the CUDA table is checked on any machine. */
int dp_backend_null_entries(const dp_backend *be, const char **out, int max);
/* The tables themselves; dp_cuda_backend() is NULL when built without the
 * CUDA backend (no CUDA toolkit, cuDNN or cuBLAS). */
const dp_backend *dp_cpu_backend(void);
const dp_backend *dp_cuda_backend(void);

/* The CPU backend: nthreads cores (>= 1). */
DP_MUST_CHECK dp_status dp_cpu_device_init(dp_device *dev, int index, int nthreads);
/* The CUDA backend (csrc/backend_cuda.c): logical device cuda:index on the
 * physical GPU physical_gpu, with its own stream, cuDNN and cuBLAS handles.
 * Several logical devices may share one physical GPU. DP_ERR_UNSUPPORTED when
 * built without CUDA; DP_ERR_CUDA when no usable GPU is present. */
DP_MUST_CHECK dp_status dp_cuda_device_init(dp_device *dev, int index, int physical_gpu);
/* cuDNN algorithms: deterministic ones only (the default) or any. */
DP_MUST_CHECK dp_status dp_cuda_set_deterministic(dp_device *dev, int deterministic);
/* cuBLAS and cuDNN may use TF32 tensor cores on this device (allow != 0) or
 * stay in float32 FMA arithmetic (the default). */
DP_MUST_CHECK dp_status dp_cuda_set_allow_tf32(dp_device *dev, int allow);
/* Process-wide settings for every CUDA device (defaults: deterministic 1,
 * allow_tf32 0): devices created afterwards start with them, existing ones
 * take them when their next call or step begins (dp_cuda_take_defaults). A
 * later dp_cuda_set_deterministic / dp_cuda_set_allow_tf32 overrides them for
 * one device until the next call here. Exist in every build. */
void dp_cuda_set_defaults(int deterministic, int allow_tf32);
void dp_cuda_get_defaults(int *deterministic, int *allow_tf32);
/* The CPU's fast convolutions, process-wide (dpcore.set_precision('fast')):
 * Winograd F(3x3, 5x5) for 5x5 layers (winograd_lanes.h), several times
 * float32 GEMM's rounding error; off by default. Devices take it as they take
 * the CUDA settings. Exist in every build. */
void dp_set_fast_convolutions(int fast);
int dp_get_fast_convolutions(void);
/* One reading of the process-wide settings, for dp_cuda_take_defaults: bit 0
 * deterministic, bit 1 allow_tf32, bit 2 fast convolutions, the bits above
 * count the calls that set them. Exists in every build. */
unsigned long long dp_cuda_defaults_snapshot(void);
/* dev takes the settings of snapshot if they changed since it last took
 * some: the one place a device follows dp_cuda_set_defaults. Called where a
 * call or a step on dev begins, with dev's step lock held and none of its
 * work queued (devices_run_without_gil in the binding; the mirrored runner
 * before its warm-up), so that a change made meanwhile by another thread
 * never rebuilds plans or grows the workspace part way through a step. A CPU
 * device, or any without CUDA, only records the fast-convolution bit. */
DP_MUST_CHECK dp_status dp_cuda_take_defaults(dp_device *dev, unsigned long long snapshot);
/* Waits at most timeout seconds for the work queued on dev's own stream,
 * polling it (cudaStreamQuery): DP_OK once it has finished (at once on a CPU
 * device and without CUDA), DP_ERR_RUNTIME at the deadline, DP_ERR_CUDA for
 * the stream's error. For a free that must not hang (the binding's
 * deallocation); the caller holds dev's step lock, so nothing is queued. */
DP_MUST_CHECK dp_status dp_cuda_wait_idle(dp_device *dev, double timeout);
/* Frees of CUDA device or pinned memory that failed in this process (each
 * one's memory lost), and the last one's CUDA error name in last_error (""
 * when none; may be NULL). */
unsigned long long dp_cuda_failed_frees(char *last_error, size_t len);

/* Backward passes the CPU ran as conv2d_relu_avgpool_backward (debug_counters) */
long long dp_cpu_conv_relu_pool_count(void);

/* The statistics of a CUDA device's arena (csrc/arena.c over its cudaMalloc
 * chunks). DP_ERR_VALUE for another kind of device; DP_ERR_UNSUPPORTED without CUDA. */
DP_MUST_CHECK dp_status dp_cuda_memory_stats(dp_device *dev, dp_arena_stats *out);
/* A CUDA device's physical GPU ordinal and its stream (a cudaStream_t), for
 * the collectives (csrc/comm.c); -1 / NULL for other devices. */
int dp_cuda_device_gpu(const dp_device *dev);
void *dp_cuda_device_stream(const dp_device *dev);
/* Calls the backend's destroy hook (csrc/device.c); safe on a zeroed or destroyed device. */
void dp_device_destroy(dp_device *dev);

/* cuDNN's inferred output (n, c, h, w) for a convolution of N samples, with
 * the descriptors the CUDA backend uses (csrc/cudnn_shapes.c); works without
 * a GPU. DP_ERR_UNSUPPORTED when built without cuDNN. */
DP_MUST_CHECK dp_status dp_cudnn_conv_output_dim(const dp_conv_geom *g, int N, int out[4]);
size_t dp_cudnn_version(void); /* 0 without cuDNN */

/* Number of CPU cores this process may use (sched affinity), >= 1. */
int dp_cpu_core_count(void);

/* Every place a device's memory grows (a new buffer, the activations, a
 * larger scratch or workspace, more pinned staging) asks this first: DP_OK
 * outside a step; inside one (dev->in_step) DP_ERR_RUNTIME naming `what` and
 * the sizes (in `unit`), reported instead of an allocation that could hang
 * the collectives. */
static inline DP_MUST_CHECK dp_status dp_device_may_grow(const dp_device *dev, const char *what, size_t have,
                                                         size_t want, const char *unit) {
  if (!dev->in_step) return DP_OK;
  return DP_FAIL(DP_ERR_RUNTIME,
                 "%s: %s would grow from %zu to %zu %s inside a training step, while other replicas' collectives "
                 "may be in flight (an allocation there can hang NCCL); the step's warm-up did not size it",
                 dev->name, what, have, want, unit);
}

/* Allocation helpers that go through the device's backend. */
static inline DP_MUST_CHECK dp_status dp_device_alloc(dp_device *dev, size_t bytes, void **out) {
  DP_TRY(dp_device_may_grow(dev, "a new device buffer", 0, bytes, "bytes"));
  return dev->backend->alloc(dev, bytes, out);
}
static inline void dp_device_free(dp_device *dev, void *p) {
  if (p) dev->backend->release(dev, p);
}

#endif
