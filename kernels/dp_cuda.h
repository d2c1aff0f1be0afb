/* dp_cuda.h — C-callable CUDA launchers (kernels/ .cu files). Compiled only when the
 * CUDA toolkit is found (DP_HAVE_CUDA). Every launcher checks its arguments,
 * sizes a grid-stride grid, launches on the given stream and checks the launch;
 * it returns a cudaError_t as int (0 = success) and never synchronizes. */
#ifndef DP_CUDA_H
#define DP_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "dp_kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct CUstream_st *dp_cuda_stream;

/* Number of usable CUDA devices. Returns 0 and sets *count; when the driver is
 * missing or no device is present, *count = 0 and why names the CUDA error
 * (e.g. "cudaErrorInsufficientDriver (35): ..."). Never fails otherwise. */
int dp_cuda_probe(int *count, char *why, size_t why_len, int *runtime_version, int *driver_version);

int dp_cuda_relu_forward(dp_cuda_stream s, int64_t n, const float *x, float *y);
int dp_cuda_relu_backward(dp_cuda_stream s, int64_t n, const float *y, const float *dy, float *dx);
int dp_cuda_u8_to_unit(dp_cuda_stream s, int64_t n, const uint8_t *x, float *y);
int dp_cuda_sgd_update(dp_cuda_stream s, int64_t n, float *w, const float *g, float *v, float lr, float mu, float wd);
int dp_cuda_avgpool_forward(dp_cuda_stream s, dp_pool_geom g, int64_t N, const float *x, float *y);
int dp_cuda_avgpool_backward(dp_cuda_stream s, dp_pool_geom g, int64_t N, const float *dy, float *dx);
int dp_cuda_maxpool_forward(dp_cuda_stream s, dp_pool_geom g, int64_t N, const float *x, float *y, int32_t *arg);
int dp_cuda_maxpool_backward(dp_cuda_stream s, dp_pool_geom g, int64_t N, const float *dy, const int32_t *arg,
                             float *dx);
/* row_loss (N) and row_correct (N) are device buffers the caller reduces. */
int dp_cuda_softmax_xent(dp_cuda_stream s, int64_t N, int K, const float *logits, const int32_t *labels, float scale,
                         float *dlogits, float *row_loss, int32_t *row_correct);
int dp_cuda_bias_fill(dp_cuda_stream s, int64_t n, int64_t C, int64_t HW, const float *bias, float *y);

#ifdef __cplusplus
}
#endif

#endif
