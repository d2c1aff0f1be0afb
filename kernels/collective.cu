// collective.cu — the reduction kernel of logical GPUs. NCCL refuses two ranks
// on one GPU, so k replicas sharing a physical GPU (or GPUs without NCCL but
// with peer access) are reduced by this kernel instead: each rank launches it
// over its own chunk, reading all k buffers and writing the rank-ordered sum
// back into all of them (csrc/comm.c orders it with events). The arithmetic is
// dp_allreduce_elem, which the CPU all-reduce matches bit for bit
// (tests/c/kernel_bodies.c), so a k-replica step on logical GPUs reduces
// exactly as the CPU does.
#include <cuda_runtime.h>

#include "dp_cuda.h"
#include "launch.cuh"

namespace {

using dp_launch::grid_for;
using dp_launch::kThreads;
using dp_launch::launched;

__global__ void allreduce_range_kernel(dp_ptr_set parts, int k, int64_t begin, int64_t n, float scale) {
  DP_GRID_STRIDE(i, n) dp_allreduce_elem(parts.p, k, begin + i, scale);
}

}  // namespace

extern "C" {

int dp_cuda_allreduce_range(dp_cuda_stream s, dp_ptr_set parts, int k, int64_t begin, int64_t end, float scale) {
  if (end <= begin || k <= 0) return 0;
  if (k > DP_MAX_REPLICAS) return (int)cudaErrorInvalidValue;
  allreduce_range_kernel<<<grid_for(end - begin), kThreads, 0, s>>>(parts, k, begin, end - begin, scale);
  return launched();
}

}  // extern "C"
