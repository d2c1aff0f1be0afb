/* device.c — the device registry (see device.h): the logical-device
 * configuration, the listing, and one refcounted device per name.
 */
#include "device.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(DP_HAVE_CUDA) && defined(DP_HAVE_CUDNN) && defined(DP_HAVE_CUBLAS)
#define DP_DEVICE_HAVE_CUDA_BACKEND 1
#include "dp_cuda.h"
#endif

/* A registry device; dev.entry points back at it. */
typedef struct dp_device_entry {
  dp_device dev;
  int refs;
  int physical; /* cuda: the physical GPU; cpu: -1 */
  pthread_mutex_t step_lock;
  struct dp_device_entry *next;
} device_entry;

static pthread_mutex_t registry_mutex = PTHREAD_MUTEX_INITIALIZER;
static int cpu_logical = 1;  /* logical CPU devices */
static int cuda_per_gpu = 1; /* logical GPUs per physical GPU */
static device_entry *live;   /* every device with a reference */

int dp_devices_gpu_count(char *why, size_t why_len) {
#ifdef DP_DEVICE_HAVE_CUDA_BACKEND
  int count = 0, runtime = 0, driver = 0;
  /* fails only as "no GPU": count 0 and why say what is missing */
  if (dp_cuda_probe(&count, why, why_len, &runtime, &driver) != 0) return 0;
  return count;
#else
  if (why && why_len) snprintf(why, why_len, "built without the CUDA backend");
  return 0;
#endif
}

/* cpu:index's share of the cores with k logical CPU devices. */
static int cpu_share(int index, int k) {
  const int cores = dp_cpu_core_count();
  const int share = cores / k + (index < cores % k ? 1 : 0);
  return share > 0 ? share : 1;
}

/* What a get of (kind, index) makes under the current configuration; the
 * caller holds registry_mutex. */
static dp_status mapping_of(dp_device_kind kind, int index, dp_device_info *out) {
  memset(out, 0, sizeof *out);
  out->kind = kind;
  out->index = index;
  if (kind == DP_DEVICE_CPU) {
    if (index < 0 || index >= cpu_logical)
      return DP_FAIL(DP_ERR_VALUE, "unknown device cpu:%d: the CPU devices are cpu:0 .. cpu:%d", index,
                     cpu_logical - 1);
    out->physical = -1;
    out->nthreads = cpu_share(index, cpu_logical);
    snprintf(out->name, sizeof out->name, "cpu:%d", index);
    return DP_OK;
  }
  if (kind != DP_DEVICE_CUDA) return DP_FAIL(DP_ERR_VALUE, "unknown device kind %d", (int)kind);
  if (index < 0 || index >= DP_DEVICES_MAX)
    return DP_FAIL(DP_ERR_VALUE, "unknown device cuda:%d: a logical GPU index is in [0, %d)", index, DP_DEVICES_MAX);
  /* whether the GPU exists is dp_cuda_device_init's to say, with CUDA's reason */
  out->physical = index / cuda_per_gpu;
  out->nthreads = 1;
  snprintf(out->name, sizeof out->name, "cuda:%d", index);
  return DP_OK;
}

static int entry_matches(const device_entry *e, const dp_device_info *want) {
  return e->dev.kind == want->kind && e->dev.index == want->index && e->physical == want->physical &&
         e->dev.nthreads == want->nthreads;
}

/* A new entry for `want`, its device made; the caller holds registry_mutex
 * (making a CUDA device takes a while, and no second one of that name may be
 * made meanwhile). */
static dp_status entry_create(const dp_device_info *want, device_entry **out) {
  device_entry *e = calloc(1, sizeof *e);
  if (!e) return DP_FAIL(DP_ERR_MEMORY, "%s: cannot allocate the device", want->name);
  if (pthread_mutex_init(&e->step_lock, NULL) != 0) {
    free(e);
    return DP_FAIL(DP_ERR_RUNTIME, "%s: pthread_mutex_init failed", want->name);
  }
  dp_status st = want->kind == DP_DEVICE_CPU ? dp_cpu_device_init(&e->dev, want->index, want->nthreads)
                                             : dp_cuda_device_init(&e->dev, want->index, want->physical);
  if (st != DP_OK) {
    pthread_mutex_destroy(&e->step_lock);
    free(e);
    return st;
  }
  e->dev.entry = e;
  e->physical = want->physical;
  e->refs = 1;
  *out = e;
  return DP_OK;
}

dp_status dp_device_get_index(dp_device_kind kind, int index, int nthreads, dp_device **out) {
  *out = NULL;
  if (nthreads < 0 || nthreads > DP_MAX_THREADS)
    return DP_FAIL(DP_ERR_VALUE, "threads must be between 0 (the device's share) and %d, got %d", DP_MAX_THREADS,
                   nthreads);
  if (nthreads > 0 && kind != DP_DEVICE_CPU)
    return DP_FAIL(DP_ERR_VALUE, "cuda:%d: a thread count is for CPU devices only", index);
  pthread_mutex_lock(&registry_mutex);
  dp_device_info want;
  dp_status st = mapping_of(kind, index, &want);
  if (st == DP_OK && nthreads > 0) want.nthreads = nthreads;
  device_entry *e = NULL;
  if (st == DP_OK) {
    for (e = live; e && !entry_matches(e, &want); e = e->next) {
    }
    if (e) {
      e->refs++;
    } else if ((st = entry_create(&want, &e)) == DP_OK) {
      e->next = live;
      live = e;
    }
  }
  pthread_mutex_unlock(&registry_mutex);
  if (st == DP_OK) *out = &e->dev;
  return st;
}

/* "kind", or "kind:i" with i in digits only (no sign, space or second colon); 0, or -1. */
static int name_index(const char *rest, int *index) {
  *index = 0;
  if (*rest == '\0') return 0;
  if (*rest != ':' || rest[1] == '\0') return -1;
  long v = 0;
  for (const char *c = rest + 1; *c; ++c) {
    if (*c < '0' || *c > '9' || v >= DP_DEVICES_MAX) return -1;
    v = v * 10 + (*c - '0');
  }
  *index = (int)v;
  return 0;
}

dp_status dp_device_get(const char *name, dp_device **out) {
  *out = NULL;
  int index = 0;
  if (strncmp(name, "cpu", 3) == 0 && name_index(name + 3, &index) == 0)
    return dp_device_get_index(DP_DEVICE_CPU, index, 0, out);
  if (strncmp(name, "cuda", 4) == 0 && name_index(name + 4, &index) == 0)
    return dp_device_get_index(DP_DEVICE_CUDA, index, 0, out);
  return DP_FAIL(DP_ERR_VALUE, "unknown device '%s': a device is named 'cpu:i' or 'cuda:i'", name);
}

void dp_device_put(dp_device *dev) {
  if (!dev || !dev->entry) return;
  device_entry *gone = NULL;
  pthread_mutex_lock(&registry_mutex);
  for (device_entry **p = &live; *p; p = &(*p)->next) {
    if (&(*p)->dev != dev) continue;
    if (--(*p)->refs == 0) {
      gone = *p;
      *p = gone->next;
    }
    break;
  }
  pthread_mutex_unlock(&registry_mutex);
  if (!gone) return;
  /* no reference is left, so nobody holds or waits for its step lock; a
   * CUDA device's destroy waits for its stream: outside the registry mutex */
  dp_device_destroy(&gone->dev);
  pthread_mutex_destroy(&gone->step_lock);
  free(gone);
}

void dp_device_lock(dp_device *dev) {
  if (dev->entry) pthread_mutex_lock(&dev->entry->step_lock);
}

void dp_device_unlock(dp_device *dev) {
  if (dev->entry) pthread_mutex_unlock(&dev->entry->step_lock);
}

void dp_device_destroy(dp_device *dev) {
  if (!dev || !dev->ctx) return;
  if (dev->backend && dev->backend->destroy) dev->backend->destroy(dev);
  dev->ctx = NULL;
}

dp_status dp_devices_set_logical(dp_device_kind kind, int count) {
  if (kind != DP_DEVICE_CPU && kind != DP_DEVICE_CUDA)
    return DP_FAIL(DP_ERR_VALUE, "logical devices can be set for 'cpu' or 'cuda', got kind %d", (int)kind);
  if (count < 1 || count > DP_DEVICES_MAX)
    return DP_FAIL(DP_ERR_VALUE, "count must be between 1 and %d, got %d", DP_DEVICES_MAX, count);
  if (kind == DP_DEVICE_CUDA) {
    char why[256] = "";
    const int gpus = dp_devices_gpu_count(why, sizeof why);
    if (gpus == 0)
      return DP_FAIL(DP_ERR_VALUE, "logical GPUs need a usable CUDA device; there is none here (%s)", why);
    if (count * gpus > DP_DEVICES_MAX)
      return DP_FAIL(DP_ERR_VALUE, "%d logical GPUs on each of %d GPUs is more than %d devices", count, gpus,
                     DP_DEVICES_MAX);
  }
  pthread_mutex_lock(&registry_mutex);
  if (kind == DP_DEVICE_CPU)
    cpu_logical = count;
  else
    cuda_per_gpu = count;
  pthread_mutex_unlock(&registry_mutex);
  return DP_OK;
}

int dp_cpu_device_share(int index) { return cpu_share(index, dp_devices_logical(DP_DEVICE_CPU)); }

int dp_devices_logical(dp_device_kind kind) {
  pthread_mutex_lock(&registry_mutex);
  const int k = kind == DP_DEVICE_CPU ? cpu_logical : cuda_per_gpu;
  pthread_mutex_unlock(&registry_mutex);
  return k;
}

int dp_devices_list(dp_device_info *out, int max) {
  const int gpus = dp_devices_gpu_count(NULL, 0);
  pthread_mutex_lock(&registry_mutex);
  const int ncpu = cpu_logical, ncuda = gpus * cuda_per_gpu;
  for (int i = 0; i < ncpu + ncuda; ++i) {
    if (i >= max) break;
    const int cpu = i < ncpu;
    /* every index here is inside the configuration: mapping_of cannot fail */
    dp_status_ignore(mapping_of(cpu ? DP_DEVICE_CPU : DP_DEVICE_CUDA, cpu ? i : i - ncpu, &out[i]));
  }
  pthread_mutex_unlock(&registry_mutex);
  return ncpu + ncuda;
}

int dp_devices_live(dp_device_info *out, int *refs, int max) {
  int n = 0;
  pthread_mutex_lock(&registry_mutex);
  for (const device_entry *e = live; e; e = e->next, ++n) {
    if (n >= max) continue;
    dp_device_info *d = &out[n];
    memset(d, 0, sizeof *d);
    snprintf(d->name, sizeof d->name, "%s", e->dev.name);
    d->kind = e->dev.kind;
    d->index = e->dev.index;
    d->physical = e->physical;
    d->nthreads = e->dev.nthreads;
    if (refs) refs[n] = e->refs;
  }
  pthread_mutex_unlock(&registry_mutex);
  return n;
}
