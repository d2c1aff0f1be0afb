// layers.cu — CUDA launchers for the layers the CUDA backend does not hand to
// cuDNN / cuBLAS: fill, add, scale, global average pooling, BatchNorm, the
// per-channel sums (also the bias gradients).
//
// Determinism: every reduction here has a fixed order. A channel sum is one
// block per channel; thread t of the block accumulates (in double, like the
// CPU backend's channel sums) the elements t, t + kThreads, ... of the channel
// in index order, then the block adds the kThreads partials in a fixed tree.
// No atomics, so the bits depend only on the inputs, never on scheduling.
// (They differ from the CPU backend's bits, whose order is per sample; the
// double accumulation keeps both within a few float ulps of the exact sum.)
#include <cuda_runtime.h>

#include "dp_cuda.h"
#include "launch.cuh"

namespace {

using dp_launch::grid_for;
using dp_launch::kThreads;
using dp_launch::launched;

__global__ void fill_kernel(int64_t n, float *x, float value) {
  DP_GRID_STRIDE(i, n) x[i] = value;
}
__global__ void add_kernel(int64_t n, const float *a, const float *b, float *y) {
  DP_GRID_STRIDE(i, n) y[i] = dp_add_elem(a[i], b[i]);
}
__global__ void add_relu_kernel(int64_t n, const float *a, const float *b, float *y) {
  DP_GRID_STRIDE(i, n) y[i] = dp_relu_forward_elem(dp_add_elem(a[i], b[i]));
}
__global__ void scale_kernel(int64_t n, float *x, float alpha) {
  DP_GRID_STRIDE(i, n) x[i] *= alpha;
}
// y (planes) = mean of each plane of x (planes, HW): the CPU's dp_row_sum * inv.
__global__ void global_avgpool_forward_kernel(int64_t planes, int HW, const float *x, float *y) {
  const float inv = 1.0f / (float)HW;
  DP_GRID_STRIDE(p, planes) y[p] = dp_row_sum(x + p * HW, HW) * inv;
}
__global__ void global_avgpool_backward_kernel(int64_t n, int HW, const float *dy, float *dx) {
  const float inv = 1.0f / (float)HW;
  DP_GRID_STRIDE(i, n) dx[i] = dy[i / HW] * inv;
}

// The fixed-order tree over a block's kThreads partials; returns the total in
// thread 0 (other threads get garbage). kThreads is a power of two.
__device__ double block_sum(double v, double *shared) {
  shared[threadIdx.x] = v;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if ((int)threadIdx.x < stride) shared[threadIdx.x] += shared[threadIdx.x + stride];
    __syncthreads();
  }
  return shared[0];
}

// out[c] = sum over (n, i) of x[n, c, i], or of (x - mean[c])^2 when mean is
// given. Grid: one block per channel, kThreads threads.
__global__ void channel_sums_kernel(int64_t N, int C, int HW, const float *x, const float *mean, float *out) {
  __shared__ double shared[kThreads];
  const int c = blockIdx.x;
  const float m = mean ? mean[c] : 0.0f;
  const int64_t count = N * HW;
  double s = 0.0;
  for (int64_t j = threadIdx.x; j < count; j += kThreads) {
    const int64_t n = j / HW, i = j - n * HW;
    const float v = x[(n * C + c) * HW + i];
    s += mean ? (double)((v - m) * (v - m)) : (double)v;
  }
  const double total = block_sum(s, shared);
  if (threadIdx.x == 0) out[c] = (float)total;
}

// sum_dy[c], sum_dy_xhat[c] over (n, i); same grid and order as channel_sums.
// relu_beta non-NULL: dy is a fused ReLU's output gradient (dp_bn_relu_dy).
__global__ void bn_backward_sums_kernel(int64_t N, int C, int HW, const float *x, const float *dy, const float *mean,
                                        const float *invstd, const float *gamma, const float *relu_beta,
                                        float *sum_dy, float *sum_dy_xhat) {
  __shared__ double shared[kThreads];
  const int c = blockIdx.x;
  const float m = mean[c], s = invstd[c];
  const float g = relu_beta ? gamma[c] : 0.0f, be = relu_beta ? relu_beta[c] : 0.0f;
  const int64_t count = N * HW;
  double a = 0.0, b = 0.0;
  for (int64_t j = threadIdx.x; j < count; j += kThreads) {
    const int64_t n = j / HW, i = j - n * HW, at = (n * C + c) * HW + i;
    const float d = relu_beta ? dp_bn_relu_dy(x[at], dy[at], m, s, g, be) : dy[at];
    a += (double)d;
    b += (double)(d * ((x[at] - m) * s));
  }
  const double ta = block_sum(a, shared);
  if (threadIdx.x == 0) sum_dy[c] = (float)ta;
  __syncthreads();  // shared is reused
  const double tb = block_sum(b, shared);
  if (threadIdx.x == 0) sum_dy_xhat[c] = (float)tb;
}

__global__ void bn_finalize_kernel(int C, const float *sqdev, float count, const float *mean, float eps, float momentum,
                                   int update_running, float *invstd, float *running_mean, float *running_var) {
  DP_GRID_STRIDE(c, C)
  dp_bn_finalize_channel(sqdev[c], count, mean[c], eps, momentum, update_running, &invstd[c],
                         running_mean ? &running_mean[c] : nullptr, running_var ? &running_var[c] : nullptr);
}

__global__ void bn_apply_kernel(int64_t n, int C, int HW, const float *x, const float *mean, const float *invstd,
                                const float *gamma, const float *beta, float *y, int relu) {
  DP_GRID_STRIDE(i, n) {
    const int c = (int)((i / HW) % C);
    const float v = dp_bn_apply_elem(x[i], mean[c], invstd[c], gamma[c], beta[c]);
    y[i] = relu ? dp_relu_forward_elem(v) : v;
  }
}

__global__ void bn_backward_dx_kernel(int64_t n, int C, int HW, const float *x, const float *dy, const float *mean,
                                      const float *invstd, const float *gamma, const float *relu_beta,
                                      const float *sum_dy, const float *sum_dy_xhat, float inv_count, float *dx) {
  DP_GRID_STRIDE(i, n) {
    const int c = (int)((i / HW) % C);
    const float d = relu_beta ? dp_bn_relu_dy(x[i], dy[i], mean[c], invstd[c], gamma[c], relu_beta[c]) : dy[i];
    dx[i] = dp_bn_backward_elem(x[i], d, mean[c], invstd[c], gamma[c], sum_dy[c], sum_dy_xhat[c], inv_count);
  }
}

}  // namespace

extern "C" {

int dp_cuda_fill(dp_cuda_stream s, int64_t n, float *x, float value) {
  if (n <= 0) return 0;
  fill_kernel<<<grid_for(n), kThreads, 0, s>>>(n, x, value);
  return launched();
}
int dp_cuda_add(dp_cuda_stream s, int64_t n, const float *a, const float *b, float *y) {
  if (n <= 0) return 0;
  add_kernel<<<grid_for(n), kThreads, 0, s>>>(n, a, b, y);
  return launched();
}
int dp_cuda_add_relu(dp_cuda_stream s, int64_t n, const float *a, const float *b, float *y) {
  if (n <= 0) return 0;
  add_relu_kernel<<<grid_for(n), kThreads, 0, s>>>(n, a, b, y);
  return launched();
}
int dp_cuda_scale(dp_cuda_stream s, int64_t n, float *x, float alpha) {
  if (n <= 0) return 0;
  scale_kernel<<<grid_for(n), kThreads, 0, s>>>(n, x, alpha);
  return launched();
}
int dp_cuda_global_avgpool_forward(dp_cuda_stream s, int64_t planes, int HW, const float *x, float *y) {
  if (planes <= 0 || HW <= 0) return 0;
  global_avgpool_forward_kernel<<<grid_for(planes), kThreads, 0, s>>>(planes, HW, x, y);
  return launched();
}
int dp_cuda_global_avgpool_backward(dp_cuda_stream s, int64_t planes, int HW, const float *dy, float *dx) {
  const int64_t n = planes * HW;
  if (n <= 0) return 0;
  global_avgpool_backward_kernel<<<grid_for(n), kThreads, 0, s>>>(n, HW, dy, dx);
  return launched();
}
int dp_cuda_channel_sums(dp_cuda_stream s, int64_t N, int C, int HW, const float *x, const float *mean, float *out) {
  if (C <= 0) return 0;
  // N == 0 still launches: every channel's sum is then 0, written by thread 0.
  channel_sums_kernel<<<C, kThreads, 0, s>>>(N, C, HW, x, mean, out);
  return launched();
}
int dp_cuda_bn_backward_sums(dp_cuda_stream s, int64_t N, int C, int HW, const float *x, const float *dy,
                             const float *mean, const float *invstd, const float *gamma, const float *relu_beta,
                             float *sum_dy, float *sum_dy_xhat) {
  if (C <= 0) return 0;
  bn_backward_sums_kernel<<<C, kThreads, 0, s>>>(N, C, HW, x, dy, mean, invstd, gamma, relu_beta, sum_dy,
                                                 sum_dy_xhat);
  return launched();
}
int dp_cuda_bn_finalize(dp_cuda_stream s, int C, const float *sqdev, float count, const float *mean, float eps,
                        float momentum, int update_running, float *invstd, float *running_mean, float *running_var) {
  if (C <= 0) return 0;
  bn_finalize_kernel<<<grid_for(C), kThreads, 0, s>>>(C, sqdev, count, mean, eps, momentum, update_running, invstd,
                                                      running_mean, running_var);
  return launched();
}
int dp_cuda_bn_apply(dp_cuda_stream s, int64_t N, int C, int HW, const float *x, const float *mean,
                     const float *invstd, const float *gamma, const float *beta, float *y, int relu) {
  const int64_t n = N * C * HW;
  if (n <= 0) return 0;
  bn_apply_kernel<<<grid_for(n), kThreads, 0, s>>>(n, C, HW, x, mean, invstd, gamma, beta, y, relu);
  return launched();
}
int dp_cuda_bn_backward_dx(dp_cuda_stream s, int64_t N, int C, int HW, const float *x, const float *dy,
                           const float *mean, const float *invstd, const float *gamma, const float *relu_beta,
                           const float *sum_dy, const float *sum_dy_xhat, float inv_count, float *dx) {
  const int64_t n = N * C * HW;
  if (n <= 0) return 0;
  bn_backward_dx_kernel<<<grid_for(n), kThreads, 0, s>>>(n, C, HW, x, dy, mean, invstd, gamma, relu_beta, sum_dy,
                                                         sum_dy_xhat, inv_count, dx);
  return launched();
}

}  // extern "C"
