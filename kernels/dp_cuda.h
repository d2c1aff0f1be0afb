/* dp_cuda.h — C-callable CUDA launchers (kernels/ .cu files). Compiled only when the
 * CUDA toolkit is found (DP_HAVE_CUDA). Every launcher checks its arguments,
 * sizes a grid-stride grid, launches on the given stream and checks the launch;
 * it returns a cudaError_t as int (0 = success) and never synchronizes.
 * Every int result is DP_MUST_CHECK (dp_status.h): a dropped one is a
 * compiler warning, an error under -Werror. */
#ifndef DP_CUDA_H
#define DP_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "dp_kernels.h"
#include "dp_status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct CUstream_st *dp_cuda_stream;

/* Number of usable CUDA devices. Returns 0 and sets *count; when the driver is
 * missing or no device is present, *count = 0 and why names the CUDA error
 * (e.g. "cudaErrorInsufficientDriver (35): ..."). Never fails otherwise. */
DP_MUST_CHECK int dp_cuda_probe(int *count, char *why, size_t why_len, int *runtime_version, int *driver_version);
/* Physical GPU gpu's name, memory and compute capability; a cudaError_t (0 = success). */
DP_MUST_CHECK int dp_cuda_describe(int gpu, char *name, size_t name_len, size_t *memory_bytes, int *major, int *minor);

DP_MUST_CHECK int dp_cuda_relu_forward(dp_cuda_stream s, int64_t n, const float *x, float *y);
DP_MUST_CHECK int dp_cuda_relu_backward(dp_cuda_stream s, int64_t n, const float *y, const float *dy, float *dx);
DP_MUST_CHECK int dp_cuda_u8_to_unit(dp_cuda_stream s, int64_t n, const uint8_t *x, float *y);
/* dst row r (row_bytes bytes) = src row rows[r], r < nrows; rows on the device */
DP_MUST_CHECK int dp_cuda_gather_rows(dp_cuda_stream s, int64_t nrows, int64_t row_bytes, const void *src,
                                      const int32_t *rows, void *dst);
/* guard: the step's loss flag on the device, or NULL (see dp_step_allowed) */
DP_MUST_CHECK int dp_cuda_sgd_update(dp_cuda_stream s, int64_t n, float *w, const float *g, float *v, float lr,
                                     float mu, float wd, const float *guard);
/* *flag = dp_loss_flag(row_loss, n), one thread; row_loss may be NULL when n == 0 */
DP_MUST_CHECK int dp_cuda_loss_flag(dp_cuda_stream s, int64_t n, const float *row_loss, float *flag);
/* dst = saved unless dp_step_allowed(guard) */
DP_MUST_CHECK int dp_cuda_restore_unless_allowed(dp_cuda_stream s, int64_t n, float *dst, const float *saved,
                                                 const float *guard);
DP_MUST_CHECK int dp_cuda_avgpool_forward(dp_cuda_stream s, dp_pool_geom g, int64_t N, const float *x, float *y);
DP_MUST_CHECK int dp_cuda_avgpool_backward(dp_cuda_stream s, dp_pool_geom g, int64_t N, const float *dy, float *dx);
DP_MUST_CHECK int dp_cuda_maxpool_forward(dp_cuda_stream s, dp_pool_geom g, int64_t N, const float *x, float *y,
                                          int32_t *arg);
DP_MUST_CHECK int dp_cuda_maxpool_backward(dp_cuda_stream s, dp_pool_geom g, int64_t N, const float *dy,
                                           const int32_t *arg, float *dx);
/* row_loss (N) and row_correct (N) are device buffers the caller reduces. */
DP_MUST_CHECK int dp_cuda_softmax_xent(dp_cuda_stream s, int64_t N, int K, const float *logits, const int32_t *labels,
                                       float scale, float *dlogits, float *row_loss, int32_t *row_correct);
DP_MUST_CHECK int dp_cuda_bias_fill(dp_cuda_stream s, int64_t n, int64_t C, int64_t HW, const float *bias, float *y);

/* kernels/layers.cu */
DP_MUST_CHECK int dp_cuda_fill(dp_cuda_stream s, int64_t n, float *x, float value);
DP_MUST_CHECK int dp_cuda_add(dp_cuda_stream s, int64_t n, const float *a, const float *b, float *y);
DP_MUST_CHECK int dp_cuda_add_relu(dp_cuda_stream s, int64_t n, const float *a, const float *b, float *y);
DP_MUST_CHECK int dp_cuda_scale(dp_cuda_stream s, int64_t n, float *x, float alpha);
/* x (planes, HW) -> y (planes); backward dx (planes, HW) = dy / HW */
DP_MUST_CHECK int dp_cuda_global_avgpool_forward(dp_cuda_stream s, int64_t planes, int HW, const float *x, float *y);
DP_MUST_CHECK int dp_cuda_global_avgpool_backward(dp_cuda_stream s, int64_t planes, int HW, const float *dy, float *dx);
/* The doubles of device scratch (`partials`) the two channel-sum launchers
 * below need for (N, C, HW): 2 * C * P where a channel's N * HW values take P > 1
 * parts (dp_channel_parts), else 0 (partials may then be NULL). */
DP_MUST_CHECK int64_t dp_cuda_sum_partials(int64_t N, int C, int HW);
/* out (C) = per-channel sums of x (N, C, HW), of (x - mean)^2 when mean != NULL.
 * Also the bias gradients: conv (dy (N, O, OH*OW)) and dense (dy (N, nout), HW = 1).
 * Fixed order, set by (N, C, HW) alone (layers.cu): deterministic. partials:
 * dp_cuda_sum_partials(N, C, HW) doubles, used by the queued kernels until the
 * stream reaches them; N == 0 writes zeros. */
DP_MUST_CHECK int dp_cuda_channel_sums(dp_cuda_stream s, int64_t N, int C, int HW, const float *x, const float *mean,
                                       double *partials, float *out);
/* sum_dy, sum_dy_xhat (C): the same partition and order; partials as above.
 * relu_beta non-NULL: dy is the gradient of a fused ReLU's output (backend.h) */
DP_MUST_CHECK int dp_cuda_bn_backward_sums(dp_cuda_stream s, int64_t N, int C, int HW, const float *x, const float *dy,
                                           const float *mean, const float *invstd, const float *gamma,
                                           const float *relu_beta, double *partials, float *sum_dy,
                                           float *sum_dy_xhat);
DP_MUST_CHECK int dp_cuda_bn_finalize(dp_cuda_stream s, int C, const float *sqdev, float count, const float *mean,
                                      float eps, float momentum, int update_running, float *invstd, float *running_mean,
                                      float *running_var);
/* relu: y = relu(bn(x)) (backend.h: bn_apply_relu) */
DP_MUST_CHECK int dp_cuda_bn_apply(dp_cuda_stream s, int64_t N, int C, int HW, const float *x, const float *mean,
                                   const float *invstd, const float *gamma, const float *beta, float *y, int relu);
DP_MUST_CHECK int dp_cuda_bn_backward_dx(dp_cuda_stream s, int64_t N, int C, int HW, const float *x, const float *dy,
                                         const float *mean, const float *invstd, const float *gamma,
                                         const float *relu_beta, const float *sum_dy, const float *sum_dy_xhat,
                                         float inv_count, float *dx);

/* kernels/collective.cu: the all-reduce of logical GPUs (csrc/comm.c).
 * The k buffers' pointers travel by value in the kernel's parameters (512
 * bytes, under the 4 KB parameter limit), so no device table is needed. */
enum { DP_MAX_REPLICAS = 64 };
typedef struct dp_ptr_set {
  float *p[DP_MAX_REPLICAS];
} dp_ptr_set;
/* Elements [begin, end) of every parts.p[0..k-1] (device memory readable from
 * the stream's device: the same GPU or a peer with access enabled) become
 * scale * their rank-ordered sum (dp_allreduce_elem). */
DP_MUST_CHECK int dp_cuda_allreduce_range(dp_cuda_stream s, dp_ptr_set parts, int k, int64_t begin, int64_t end,
                                          float scale);

#ifdef __cplusplus
}
#endif

#endif
