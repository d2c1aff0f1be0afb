// layers.cu — CUDA launchers for the layers the CUDA backend does not hand to
// cuDNN / cuBLAS: fill, add, scale, global average pooling, BatchNorm, the
// per-channel sums (also the bias gradients).
//
// Determinism: every reduction here has a fixed order, and no atomics, so the
// bits depend only on the inputs and the shape (N, C, HW), never on the GPU or
// on scheduling. A channel sum runs in two stages. Stage 1: grid (C, P), P =
// dp_channel_parts(N * HW); block (c, p) sums part p of channel c's values in
// (n, i) order (dp_kernels.h: the partition and the walk), thread t of the
// block accumulating in double (like the CPU backend's channel sums) the
// values t, t + kThreads, ... of the part in order, then the block adds its
// kThreads partials in a fixed tree (block_sum) into one double per (c, p).
// Stage 2: one thread per channel adds the P doubles in part order and rounds
// to float. With P == 1, stage 1 rounds its block total itself (the same bits:
// stage 2 starts from part 0's double). (The bits differ from the CPU
// backend's, whose order is per sample; the double accumulation keeps both
// within a few float ulps of the exact sum.)
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

// Stage 1 of out[c] = sum over (n, i) of x[n, c, i], or of (x - mean[c])^2 when
// kSquares. Grid (C, P), kThreads threads. P == 1: out[c] = the block's total;
// else partials[c * P + p] = part p's total.
// The loop's body is unrolled by kUnroll loads ahead of their adds (more loads in
// flight); the adds keep the value order.
constexpr int kUnroll = 4;

template <bool kSquares>
__global__ void channel_sums_kernel(int64_t N, int C, int HW, const float *__restrict__ x,
                                    const float *__restrict__ mean, double *__restrict__ partials,
                                    float *__restrict__ out) {
  __shared__ double shared[kThreads];
  const int c = blockIdx.x, p = blockIdx.y, P = gridDim.y;
  const float m = kSquares ? mean[c] : 0.0f;
  const int64_t count = N * HW, end = dp_channel_part_begin(count, P, p + 1);
  int64_t j = dp_channel_part_begin(count, P, p) + threadIdx.x;
  dp_channel_walk w = dp_channel_walk_start(C, HW, c, j, kThreads);
  double s = 0.0;
  for (; j + (kUnroll - 1) * kThreads < end; j += kUnroll * kThreads) {
    float v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u, dp_channel_walk_next(&w)) v[u] = x[w.at];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) s += kSquares ? (double)((v[u] - m) * (v[u] - m)) : (double)v[u];
  }
  for (; j < end; j += kThreads, dp_channel_walk_next(&w)) {
    const float v = x[w.at];
    s += kSquares ? (double)((v - m) * (v - m)) : (double)v;
  }
  const double total = block_sum(s, shared);
  if (threadIdx.x == 0) {
    if (P == 1) out[c] = (float)total;
    else partials[(int64_t)c * P + p] = total;
  }
}

// Stage 1 of sum_dy[c], sum_dy_xhat[c] over (n, i); the grid, order and
// outputs of channel_sums_kernel, the second sum's partials at C * P + c * P + p.
// kRelu: dy is a fused ReLU's output gradient (dp_bn_relu_dy).
template <bool kRelu>
__global__ void bn_backward_sums_kernel(int64_t N, int C, int HW, const float *__restrict__ x,
                                        const float *__restrict__ dy, const float *__restrict__ mean,
                                        const float *__restrict__ invstd, const float *__restrict__ gamma,
                                        const float *__restrict__ relu_beta, double *__restrict__ partials,
                                        float *__restrict__ sum_dy, float *__restrict__ sum_dy_xhat) {
  __shared__ double shared[kThreads];
  const int c = blockIdx.x, p = blockIdx.y, P = gridDim.y;
  const float m = mean[c], s = invstd[c];
  const float g = kRelu ? gamma[c] : 0.0f, be = kRelu ? relu_beta[c] : 0.0f;
  const int64_t count = N * HW, end = dp_channel_part_begin(count, P, p + 1);
  int64_t j = dp_channel_part_begin(count, P, p) + threadIdx.x;
  dp_channel_walk w = dp_channel_walk_start(C, HW, c, j, kThreads);
  double a = 0.0, b = 0.0;
  for (; j + (kUnroll - 1) * kThreads < end; j += kUnroll * kThreads) {
    float xv[kUnroll], dv[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u, dp_channel_walk_next(&w)) {
      xv[u] = x[w.at];
      dv[u] = dy[w.at];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const float d = kRelu ? dp_bn_relu_dy(xv[u], dv[u], m, s, g, be) : dv[u];
      a += (double)d;
      b += (double)(d * ((xv[u] - m) * s));
    }
  }
  for (; j < end; j += kThreads, dp_channel_walk_next(&w)) {
    const float xv = x[w.at];
    const float d = kRelu ? dp_bn_relu_dy(xv, dy[w.at], m, s, g, be) : dy[w.at];
    a += (double)d;
    b += (double)(d * ((xv - m) * s));
  }
  const double ta = block_sum(a, shared);
  if (threadIdx.x == 0) {
    if (P == 1) sum_dy[c] = (float)ta;
    else partials[(int64_t)c * P + p] = ta;
  }
  __syncthreads();  // shared is reused
  const double tb = block_sum(b, shared);
  if (threadIdx.x == 0) {
    if (P == 1) sum_dy_xhat[c] = (float)tb;
    else partials[(int64_t)C * P + (int64_t)c * P + p] = tb;
  }
}

// Stage 2: out[c] = the sum of partials[c * P + 0 .. P - 1] in part order, in
// double, rounded once; out2 (when given) the same of the partials at C * P.
__global__ void channel_parts_add_kernel(int C, int P, const double *__restrict__ partials, float *__restrict__ out,
                                         float *__restrict__ out2) {
  DP_GRID_STRIDE(c, C) {
    const double *a = partials + c * P;
    double s = a[0];
    for (int p = 1; p < P; ++p) s += a[p];
    out[c] = (float)s;
    if (out2) {
      const double *b = partials + (int64_t)C * P + c * P;
      double t = b[0];
      for (int p = 1; p < P; ++p) t += b[p];
      out2[c] = (float)t;
    }
  }
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
int64_t dp_cuda_sum_partials(int64_t N, int C, int HW) {
  const int P = dp_channel_parts(N * HW);
  return P > 1 && C > 0 ? 2 * (int64_t)C * P : 0;
}
int dp_cuda_channel_sums(dp_cuda_stream s, int64_t N, int C, int HW, const float *x, const float *mean,
                         double *partials, float *out) {
  if (C <= 0) return 0;
  // N == 0 still launches: P is 1 and every channel's sum is 0, written by thread 0.
  const int P = dp_channel_parts(N * HW);
  if (P > 1 && !partials) return (int)cudaErrorInvalidValue;
  const dim3 grid((unsigned)C, (unsigned)P);
  if (mean) channel_sums_kernel<true><<<grid, kThreads, 0, s>>>(N, C, HW, x, mean, partials, out);
  else channel_sums_kernel<false><<<grid, kThreads, 0, s>>>(N, C, HW, x, mean, partials, out);
  if (P == 1) return launched();
  const int e = launched();
  if (e) return e;
  channel_parts_add_kernel<<<grid_for(C), kThreads, 0, s>>>(C, P, partials, out, nullptr);
  return launched();
}
int dp_cuda_bn_backward_sums(dp_cuda_stream s, int64_t N, int C, int HW, const float *x, const float *dy,
                             const float *mean, const float *invstd, const float *gamma, const float *relu_beta,
                             double *partials, float *sum_dy, float *sum_dy_xhat) {
  if (C <= 0) return 0;
  const int P = dp_channel_parts(N * HW);
  if (P > 1 && !partials) return (int)cudaErrorInvalidValue;
  const dim3 grid((unsigned)C, (unsigned)P);
  if (relu_beta)
    bn_backward_sums_kernel<true><<<grid, kThreads, 0, s>>>(N, C, HW, x, dy, mean, invstd, gamma, relu_beta, partials,
                                                            sum_dy, sum_dy_xhat);
  else
    bn_backward_sums_kernel<false><<<grid, kThreads, 0, s>>>(N, C, HW, x, dy, mean, invstd, gamma, relu_beta,
                                                             partials, sum_dy, sum_dy_xhat);
  if (P == 1) return launched();
  const int e = launched();
  if (e) return e;
  channel_parts_add_kernel<<<grid_for(C), kThreads, 0, s>>>(C, P, partials, sum_dy, sum_dy_xhat);
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
