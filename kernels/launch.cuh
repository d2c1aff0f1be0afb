// launch.cuh — the grid sizing every launcher in kernels/*.cu shares.
// Kernels are grid-stride loops: any grid covers any n, so the grid is capped
// and the loop does the rest.
#ifndef DP_LAUNCH_CUH
#define DP_LAUNCH_CUH

#include <cuda_runtime.h>
#include <stdint.h>

namespace dp_launch {

constexpr int kThreads = 256;

inline int grid_for(int64_t n) {
  int64_t blocks = (n + kThreads - 1) / kThreads;
  if (blocks > 65535LL * 8) blocks = 65535LL * 8;  // grid-stride covers the rest
  return blocks < 1 ? 1 : (int)blocks;
}

// The launch's own error (bad configuration), as an int (0 = success).
// Errors of the kernel's execution surface at the next synchronizing call.
inline int launched() { return (int)cudaGetLastError(); }

}  // namespace dp_launch

#define DP_GRID_STRIDE(i, n) \
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (int64_t)gridDim.x * blockDim.x)

#endif
