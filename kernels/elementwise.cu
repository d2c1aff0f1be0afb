// elementwise.cu — CUDA launchers for the DP_HD bodies of dp_kernels.h.
// Kernels: grid-stride loops, one body call per element / row.
// Launchers: check the arguments, size the grid, launch on the stream, check
// the launch (cudaGetLastError). Nothing here synchronizes.
#include <cuda_runtime.h>
#include <stdio.h>

#include "dp_cuda.h"
#include "launch.cuh"

namespace {

using dp_launch::grid_for;
using dp_launch::kThreads;
using dp_launch::launched;

__global__ void relu_forward_kernel(int64_t n, const float *x, float *y) {
  DP_GRID_STRIDE(i, n) y[i] = dp_relu_forward_elem(x[i]);
}
__global__ void relu_backward_kernel(int64_t n, const float *y, const float *dy, float *dx) {
  DP_GRID_STRIDE(i, n) dx[i] = dp_relu_backward_elem(y[i], dy[i]);
}
__global__ void gather_rows_kernel(int64_t n, int64_t row_bytes, const uint8_t *src, const int32_t *rows,
                                   uint8_t *dst) {
  DP_GRID_STRIDE(i, n) dst[i] = dp_gather_elem(src, rows, row_bytes, i);
}

__global__ void u8_to_unit_kernel(int64_t n, const uint8_t *x, float *y) {
  DP_GRID_STRIDE(i, n) y[i] = dp_u8_to_unit_elem(x[i]);
}
// guard: the step's loss flag on the device (NULL: none); every thread reads
// it and a non-finite flag leaves w and v untouched: no host round trip.
__global__ void sgd_kernel(int64_t n, float *w, const float *g, float *v, float lr, float mu, float wd,
                           const float *guard) {
  if (!dp_step_allowed(guard)) return;
  DP_GRID_STRIDE(i, n) dp_sgd_elem(w, g, v, i, lr, mu, wd);
}
// One thread: the row losses of a batch (a few hundred) into one flag.
__global__ void loss_flag_kernel(int64_t n, const float *row_loss, float *flag) {
  if (blockIdx.x == 0 && threadIdx.x == 0) *flag = dp_loss_flag(row_loss, n);
}
__global__ void restore_kernel(int64_t n, float *dst, const float *saved, const float *guard) {
  if (dp_step_allowed(guard)) return;
  DP_GRID_STRIDE(i, n) dst[i] = saved[i];
}
__global__ void avgpool_forward_kernel(dp_pool_geom g, int64_t n, const float *x, float *y) {
  DP_GRID_STRIDE(o, n) y[o] = dp_avgpool_forward_elem(x, &g, o);
}
__global__ void avgpool_backward_kernel(dp_pool_geom g, int64_t n, const float *dy, float *dx) {
  DP_GRID_STRIDE(i, n) dx[i] = dp_avgpool_backward_elem(dy, &g, i);
}
__global__ void maxpool_forward_kernel(dp_pool_geom g, int64_t n, const float *x, float *y, int32_t *arg) {
  DP_GRID_STRIDE(o, n) y[o] = dp_maxpool_forward_elem(x, &g, o, &arg[o]);
}
__global__ void maxpool_backward_kernel(dp_pool_geom g, int64_t n, const float *dy, const int32_t *arg, float *dx) {
  DP_GRID_STRIDE(i, n) dx[i] = dp_maxpool_backward_elem(dy, arg, &g, i);
}
__global__ void softmax_xent_kernel(int64_t N, int K, const float *logits, const int32_t *labels, float scale,
                                    float *dlogits, float *row_loss, int32_t *row_correct) {
  DP_GRID_STRIDE(r, N) {
    int hit;
    row_loss[r] = dp_softmax_xent_row(logits + r * K, K, labels[r], scale, dlogits ? dlogits + r * K : nullptr, &hit);
    row_correct[r] = hit;
  }
}
__global__ void bias_fill_kernel(int64_t n, int64_t C, int64_t HW, const float *bias, float *y) {
  DP_GRID_STRIDE(i, n) y[i] = dp_bias_value_elem(bias, i, C, HW);
}

}  // namespace

extern "C" {

int dp_cuda_relu_forward(dp_cuda_stream s, int64_t n, const float *x, float *y) {
  if (n <= 0) return 0;
  relu_forward_kernel<<<grid_for(n), kThreads, 0, s>>>(n, x, y);
  return launched();
}
int dp_cuda_relu_backward(dp_cuda_stream s, int64_t n, const float *y, const float *dy, float *dx) {
  if (n <= 0) return 0;
  relu_backward_kernel<<<grid_for(n), kThreads, 0, s>>>(n, y, dy, dx);
  return launched();
}
int dp_cuda_gather_rows(dp_cuda_stream s, int64_t nrows, int64_t row_bytes, const void *src, const int32_t *rows,
                        void *dst) {
  const int64_t n = nrows * row_bytes;
  if (n <= 0) return 0;
  gather_rows_kernel<<<grid_for(n), kThreads, 0, s>>>(n, row_bytes, (const uint8_t *)src, rows, (uint8_t *)dst);
  return launched();
}
int dp_cuda_u8_to_unit(dp_cuda_stream s, int64_t n, const uint8_t *x, float *y) {
  if (n <= 0) return 0;
  u8_to_unit_kernel<<<grid_for(n), kThreads, 0, s>>>(n, x, y);
  return launched();
}
int dp_cuda_sgd_update(dp_cuda_stream s, int64_t n, float *w, const float *g, float *v, float lr, float mu, float wd,
                       const float *guard) {
  if (n <= 0) return 0;
  sgd_kernel<<<grid_for(n), kThreads, 0, s>>>(n, w, g, v, lr, mu, wd, guard);
  return launched();
}
int dp_cuda_loss_flag(dp_cuda_stream s, int64_t n, const float *row_loss, float *flag) {
  loss_flag_kernel<<<1, 1, 0, s>>>(n < 0 ? 0 : n, row_loss, flag);
  return launched();
}
int dp_cuda_restore_unless_allowed(dp_cuda_stream s, int64_t n, float *dst, const float *saved, const float *guard) {
  if (n <= 0) return 0;
  restore_kernel<<<grid_for(n), kThreads, 0, s>>>(n, dst, saved, guard);
  return launched();
}
int dp_cuda_avgpool_forward(dp_cuda_stream s, dp_pool_geom g, int64_t N, const float *x, float *y) {
  int64_t n = N * g.C * g.OH * g.OW;
  if (n <= 0) return 0;
  avgpool_forward_kernel<<<grid_for(n), kThreads, 0, s>>>(g, n, x, y);
  return launched();
}
int dp_cuda_avgpool_backward(dp_cuda_stream s, dp_pool_geom g, int64_t N, const float *dy, float *dx) {
  int64_t n = N * g.C * g.H * g.W;
  if (n <= 0) return 0;
  avgpool_backward_kernel<<<grid_for(n), kThreads, 0, s>>>(g, n, dy, dx);
  return launched();
}
int dp_cuda_maxpool_forward(dp_cuda_stream s, dp_pool_geom g, int64_t N, const float *x, float *y, int32_t *arg) {
  int64_t n = N * g.C * g.OH * g.OW;
  if (n <= 0) return 0;
  maxpool_forward_kernel<<<grid_for(n), kThreads, 0, s>>>(g, n, x, y, arg);
  return launched();
}
int dp_cuda_maxpool_backward(dp_cuda_stream s, dp_pool_geom g, int64_t N, const float *dy, const int32_t *arg,
                             float *dx) {
  int64_t n = N * g.C * g.H * g.W;
  if (n <= 0) return 0;
  maxpool_backward_kernel<<<grid_for(n), kThreads, 0, s>>>(g, n, dy, arg, dx);
  return launched();
}
int dp_cuda_softmax_xent(dp_cuda_stream s, int64_t N, int K, const float *logits, const int32_t *labels, float scale,
                         float *dlogits, float *row_loss, int32_t *row_correct) {
  if (N <= 0) return 0;
  softmax_xent_kernel<<<grid_for(N), kThreads, 0, s>>>(N, K, logits, labels, scale, dlogits, row_loss, row_correct);
  return launched();
}
int dp_cuda_bias_fill(dp_cuda_stream s, int64_t n, int64_t C, int64_t HW, const float *bias, float *y) {
  if (n <= 0) return 0;
  bias_fill_kernel<<<grid_for(n), kThreads, 0, s>>>(n, C, HW, bias, y);
  return launched();
}

int dp_cuda_probe(int *count, char *why, size_t why_len, int *runtime_version, int *driver_version) {
  *count = 0;
  *runtime_version = 0;
  *driver_version = 0;
  if (why && why_len) why[0] = '\0';
  cudaRuntimeGetVersion(runtime_version);
  cudaDriverGetVersion(driver_version);  // 0 when no driver is installed
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    // No driver (cudaErrorInsufficientDriver, 35) or no device (100) means
    // "no GPUs", never a failure. Clear the sticky-free error state.
    if (why && why_len)
      snprintf(why, why_len, "cudaGetDeviceCount: %s (%d): %s", cudaGetErrorName(e), (int)e, cudaGetErrorString(e));
    cudaGetLastError();
    return 0;
  }
  *count = n;
  if (n == 0 && why && why_len) snprintf(why, why_len, "cudaGetDeviceCount: 0 devices");
  return 0;
}

int dp_cuda_describe(int gpu, char *name, size_t name_len, size_t *memory_bytes, int *major, int *minor) {
  cudaDeviceProp p;
  cudaError_t e = cudaGetDeviceProperties(&p, gpu);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return (int)e;
  }
  snprintf(name, name_len, "%s", p.name);
  *memory_bytes = p.totalGlobalMem;
  *major = p.major;
  *minor = p.minor;
  return 0;
}

}  // extern "C"
