/* A stand-in for the CUDA runtime's header: only what csrc/dist_nccl.c uses,
 * with the runtime's names and signatures, for tests/c/p2p_order.c, which
 * defines the functions (a host-only fake) and so runs dist_nccl.c's ticket
 * order, deadlines and aborts on a machine without a GPU. */
#ifndef DP_FAKE_CUDA_RUNTIME_H
#define DP_FAKE_CUDA_RUNTIME_H

typedef enum cudaError { cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorNotReady = 600 } cudaError_t;
typedef struct fake_stream *cudaStream_t;
typedef struct fake_event *cudaEvent_t;
typedef struct CUuuid_st {
  char bytes[16];
} cudaUUID_t;
struct cudaDeviceProp {
  char name[256];
  cudaUUID_t uuid;
};
enum { cudaStreamNonBlocking = 1, cudaEventDisableTiming = 2 };

cudaError_t cudaSetDevice(int device);
cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *prop, int device);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *stream, unsigned int flags);
cudaError_t cudaStreamDestroy(cudaStream_t stream);
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *event, unsigned int flags);
cudaError_t cudaEventDestroy(cudaEvent_t event);
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream);
cudaError_t cudaEventQuery(cudaEvent_t event);
cudaError_t cudaGetLastError(void);
const char *cudaGetErrorName(cudaError_t error);
const char *cudaGetErrorString(cudaError_t error);

#endif
