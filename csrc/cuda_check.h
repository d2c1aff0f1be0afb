/* cuda_check.h — one check macro per NVIDIA library, each turning the
 * library's status into a dp_status whose message names the failing call,
 * the library's own error name and string, and the file and line. */
#ifndef DP_CUDA_CHECK_H
#define DP_CUDA_CHECK_H

#include "dp_status.h"

#ifdef DP_HAVE_CUDA
#include <cuda_runtime.h>
/* A failed call's error is also cleared from the thread's last error (a sticky error stays
 * sticky): otherwise the next launch, which reports through cudaGetLastError, is blamed for it. */
#define DP_CUDA_CHECK(call)                                                                                \
  do {                                                                                                     \
    cudaError_t dp_e_ = (call);                                                                            \
    if (dp_e_ != cudaSuccess) {                                                                            \
      (void)cudaGetLastError();                                                                            \
      return DP_FAIL(DP_ERR_CUDA, "%s failed: %s (%d): %s", #call, cudaGetErrorName(dp_e_), (int)dp_e_,   \
                     cudaGetErrorString(dp_e_));                                                           \
    }                                                                                                      \
  } while (0)
#endif

#ifdef DP_HAVE_CUDNN
#include <cudnn.h>
#define DP_CUDNN_CHECK(call)                                                                               \
  do {                                                                                                     \
    cudnnStatus_t dp_s_ = (call);                                                                          \
    if (dp_s_ != CUDNN_STATUS_SUCCESS)                                                                     \
      return DP_FAIL(DP_ERR_CUDA, "%s failed: %s (%d)", #call, cudnnGetErrorString(dp_s_), (int)dp_s_);  \
  } while (0)
#endif

#ifdef DP_HAVE_CUBLAS
#include <cublas_v2.h>
#define DP_CUBLAS_CHECK(call)                                                                              \
  do {                                                                                                     \
    cublasStatus_t dp_b_ = (call);                                                                         \
    if (dp_b_ != CUBLAS_STATUS_SUCCESS)                                                                    \
      return DP_FAIL(DP_ERR_CUDA, "%s failed: %s (%d): %s", #call, cublasGetStatusName(dp_b_), (int)dp_b_, \
                     cublasGetStatusString(dp_b_));                                                        \
  } while (0)
#endif

#ifdef DP_HAVE_NCCL
#include <nccl.h>
#define DP_NCCL_CHECK(call)                                                                               \
  do {                                                                                                     \
    ncclResult_t dp_n_ = (call);                                                                           \
    if (dp_n_ != ncclSuccess)                                                                              \
      return DP_FAIL(DP_ERR_CUDA, "%s failed: NCCL error %d: %s", #call, (int)dp_n_,                      \
                     ncclGetErrorString(dp_n_));                                                           \
  } while (0)
#endif

#endif
