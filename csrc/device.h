/* device.h — the device registry (csrc/device.c): one refcounted dp_device
 * per device name, shared by every model and tensor on it, like ggml's
 * backend device (ggml_backend_dev_t).
 *
 * A device is made on its first dp_device_get (CPU: its share of the cores;
 * CUDA: its physical GPU, stream, cuDNN and cuBLAS handles, arena and pinned
 * staging) and destroyed by the dp_device_put that drops its last reference.
 * The registry also holds the logical-device configuration and the listing:
 *
 *   cpu:i   i < k (dp_devices_set_logical(DP_DEVICE_CPU, k), default 1): the
 *           machine's cores split k ways, cores / k each and the first
 *           cores % k one more (at least 1), so k replicas running at once
 *           never oversubscribe the machine when k <= cores;
 *   cuda:i  logical GPU i % k of physical GPU i / k
 *           (dp_devices_set_logical(DP_DEVICE_CUDA, k), default 1).
 *
 * A changed configuration applies to the gets that follow it. A device made
 * before keeps the cores or GPU it was made with, and stays alive (the models
 * and tensors on it keep working) until its last reference is put; a later
 * get of its name whose mapping differs makes a new device, so two live
 * devices may then share a name. A get whose mapping is that of a live device
 * (the configuration changed back, say) shares the live one.
 *
 * One step at a time per device: the device's context (CPU scratch, CUDA
 * workspace, loss rows, convolution plans, cuDNN and cuBLAS handles, the
 * pending metrics) is used by whoever computes on it, and the memory rule of
 * a mirrored step (dp_device.in_step) is per device. So every caller that
 * computes on a registry device, or lets its memory grow, holds its step lock
 * (dp_device_lock) for the whole call; the binding takes it for every model
 * call and tensor allocation, with the GIL released while it waits. Two
 * models on cpu:0 used from two threads therefore run one after the other:
 * each would use all of cpu:0's cores anyway, and two models on one CUDA
 * stream are serialised by the GPU too.
 *
 * Thread-safe: the registry is guarded by one mutex, never held while a
 * step lock is waited for. All of it is plain C11 + pthreads: the CPU test
 * suite runs it under the sanitizers (tests/c/device_registry.c).
 */
#ifndef DP_DEVICE_H
#define DP_DEVICE_H

#include "backend.h"
#include "dp_limits.h" /* DP_DEVICES_MAX: the most devices of one kind (logical CPU devices, logical GPUs in all) */

/* One entry of the listing: what a get of `name` makes now. */
typedef struct dp_device_info {
  char name[32];       /* "cpu:0", "cuda:1" */
  dp_device_kind kind;
  int index;           /* the logical index */
  int physical;        /* cuda: the physical GPU; cpu: -1 */
  int nthreads;        /* cpu: the device's core share; cuda: 1 (its thread only issues work) */
} dp_device_info;

/* The device `name` ("cpu:1", "cuda:0"; "cpu" and "cuda" mean index 0): a
 * new reference, made on first use. DP_ERR_VALUE for a malformed name or a
 * CPU index outside the configuration; a CUDA device that cannot be made
 * (no GPU, no such physical GPU) fails as dp_cuda_device_init does. */
DP_MUST_CHECK dp_status dp_device_get(const char *name, dp_device **out);
/* The same by kind and logical index. nthreads: 0 for the device's share;
 * CPU devices only, another count names another device (its own cores,
 * scratch and step lock), shared by the gets that ask for that count. */
DP_MUST_CHECK dp_status dp_device_get_index(dp_device_kind kind, int index, int nthreads, dp_device **out);
/* Drops a reference; the last one destroys the device (its context and
 * everything its backend holds). NULL is fine; a device that is not the
 * registry's (dp_cpu_device_init'ed by its caller) is left alone. */
void dp_device_put(dp_device *dev);

/* The step lock of a registry device (see above). Not recursive; a caller
 * holding several takes them in increasing address order. A device that is
 * not the registry's has none (its owner orders its calls): both do nothing. */
void dp_device_lock(dp_device *dev);
void dp_device_unlock(dp_device *dev);

/* Split the CPU into count logical devices, or each physical GPU into count
 * logical GPUs; 1 <= count <= 64 (and count * GPUs <= 64). DP_ERR_VALUE,
 * the configuration unchanged, otherwise (logical GPUs with no usable GPU
 * included). Existing devices are kept (see above). */
DP_MUST_CHECK dp_status dp_devices_set_logical(dp_device_kind kind, int count);
/* The logical devices per machine (cpu) or per physical GPU (cuda). */
int dp_devices_logical(dp_device_kind kind);
/* The threads cpu:index gets under the current configuration (its share of the cores). */
int dp_cpu_device_share(int index);
/* Physical GPUs the CUDA backend can use here; 0 (and why, when why_len > 0)
 * without the backend, a driver or a device. */
int dp_devices_gpu_count(char *why, size_t why_len);
/* The devices a get can make now: cpu:0 .. cpu:k-1, then every logical GPU.
 * Writes at most max entries; returns how many there are. */
int dp_devices_list(dp_device_info *out, int max);

/* Live devices (a debugging aid for the tests): writes at most max entries of
 * what each was made with and its reference count; returns how many there
 * are. refs may be NULL. */
int dp_devices_live(dp_device_info *out, int *refs, int max);

#endif
