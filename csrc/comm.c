/* comm.c — the all-reduce kinds of comm.h: host (CPU threads), kernel (our
 * reduction kernel over logical or peer GPUs) and nccl (distinct GPUs).
 *
 * The CUDA kinds are written against documented contracts only (this
 * repository's CI has no GPU; tests/test_gpu.py runs them where one is):
 * - cudaEventRecord captures the work queued on the stream at the time of the
 *   call; cudaStreamWaitEvent makes all later work on a stream wait for the
 *   work captured by the event's most recent record at the time of *that*
 *   call, and the event may belong to another device (CUDA Runtime API,
 *   "Stream Management", cudaStreamWaitEvent / cudaEventRecord). Hence the
 *   host barrier between one rank's record and another rank's wait: without
 *   it the wait could see an older record and order nothing.
 * - ncclAllReduce with sendbuff == recvbuff reduces in place, queued on the
 *   given stream, ordered like a kernel launch (NCCL User Guide, "Collective
 *   Operations" and "CUDA Stream Semantics"). One host thread per GPU, each
 *   with its own communicator from ncclCommInitAll, is one of the guide's
 *   supported modes ("Examples": "multiple threads, each provided with a comm
 *   object"); group calls (ncclGroupStart/End) are needed only where one
 *   thread issues operations for several communicators, or to fuse several
 *   operations of one thread: dp_comm_allreduce fuses nothing, the buckets are
 *   meant to start one at a time as the backward pass produces them.
 * - After an error the NCCL communicators are aborted (ncclCommAbort), since
 *   peers may wait forever on operations a failed rank never queued (NCCL
 *   User Guide, "Fault tolerance"); the comm then refuses further use.
 */
#include "comm.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_check.h"

#if defined(DP_HAVE_CUDA)
#include "dp_cuda.h"
#endif

typedef struct comm_rank {
  dp_device *dev;
  int64_t issued;  /* collectives this rank issued since dp_comm_step_begin */
#if defined(DP_HAVE_CUDA)
  int gpu;
  cudaStream_t compute;                    /* the device's stream (borrowed) */
  cudaStream_t side;                       /* bucket reductions, beside compute */
  cudaEvent_t ready[DP_COMM_MAX_BUCKETS];  /* compute has produced bucket b */
  cudaEvent_t side_done;                   /* the side stream's reductions so far */
  cudaEvent_t sync_in, sync_out;           /* dp_comm_allreduce on the kernel kind */
#endif
#if defined(DP_HAVE_NCCL)
  ncclComm_t nccl;
#endif
} comm_rank;

struct dp_comm {
  dp_comm_kind kind;
  int k;
  dp_barrier *bar;
  int poisoned;
  comm_rank *ranks;
};

const char *dp_comm_kind_name(dp_comm_kind kind) {
  switch (kind) {
    case DP_COMM_AUTO: return "auto";
    case DP_COMM_HOST: return "host";
    case DP_COMM_KERNEL: return "kernel";
    case DP_COMM_NCCL: return "nccl";
  }
  return "unknown";
}

dp_status dp_comm_kind_parse(const char *name, dp_comm_kind *out) {
  static const dp_comm_kind kinds[] = {DP_COMM_AUTO, DP_COMM_HOST, DP_COMM_KERNEL, DP_COMM_NCCL};
  for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; ++i)
    if (name && strcmp(name, dp_comm_kind_name(kinds[i])) == 0) {
      *out = kinds[i];
      return DP_OK;
    }
  return DP_FAIL(DP_ERR_VALUE, "all_reduce must be 'auto', 'host', 'kernel' or 'nccl', got '%s'",
                 name ? name : "(null)");
}

dp_comm_kind dp_comm_get_kind(const dp_comm *c) { return c->kind; }

static dp_status usable(const dp_comm *c) {
  if (c->poisoned)
    return DP_FAIL(DP_ERR_RUNTIME, "the %s all-reduce was aborted after a failed step (NCCL cannot resume a "
                   "collective a replica never joined); make the strategy and the model again",
                   dp_comm_kind_name(c->kind));
  return DP_OK;
}

/* ---- host ------------------------------------------------------------------ */

static dp_status host_range(dp_comm *c, int rank, float *const *bufs, int64_t begin, int64_t end,
                            dp_reduce_op op) {
  float *shifted[DP_COMM_MAX_REPLICAS];
  for (int r = 0; r < c->k; ++r) shifted[r] = bufs[r] + begin;
  return dp_allreduce(shifted, c->k, rank, end - begin, op, c->bar);
}

/* ---- CUDA kinds ------------------------------------------------------------- */

#if defined(DP_HAVE_CUDA)

static dp_status rank_init(comm_rank *cr) {
  DP_CUDA_CHECK(cudaSetDevice(cr->gpu));
  /* non-blocking: never implicitly ordered with the legacy default stream */
  DP_CUDA_CHECK(cudaStreamCreateWithFlags(&cr->side, cudaStreamNonBlocking));
  /* no timing: cheaper to record and to wait on (CUDA Runtime API, cudaEventCreateWithFlags) */
  for (int b = 0; b < DP_COMM_MAX_BUCKETS; ++b)
    DP_CUDA_CHECK(cudaEventCreateWithFlags(&cr->ready[b], cudaEventDisableTiming));
  DP_CUDA_CHECK(cudaEventCreateWithFlags(&cr->side_done, cudaEventDisableTiming));
  DP_CUDA_CHECK(cudaEventCreateWithFlags(&cr->sync_in, cudaEventDisableTiming));
  DP_CUDA_CHECK(cudaEventCreateWithFlags(&cr->sync_out, cudaEventDisableTiming));
  return DP_OK;
}

static void rank_destroy(comm_rank *cr) {
  if (cudaSetDevice(cr->gpu) != cudaSuccess) {
    cudaGetLastError();
    return;
  }
  if (cr->side) cudaStreamSynchronize(cr->side);
  for (int b = 0; b < DP_COMM_MAX_BUCKETS; ++b)
    if (cr->ready[b]) cudaEventDestroy(cr->ready[b]);
  if (cr->side_done) cudaEventDestroy(cr->side_done);
  if (cr->sync_in) cudaEventDestroy(cr->sync_in);
  if (cr->sync_out) cudaEventDestroy(cr->sync_out);
  if (cr->side) cudaStreamDestroy(cr->side);
  cudaGetLastError();
}

/* The kernel kind reads every replica's buffer from every rank's GPU: one GPU,
 * or peers that can reach each other's memory (cudaDeviceEnablePeerAccess is
 * one-directional and per current device: CUDA Runtime API, "Peer Device
 * Memory Access"). */
static dp_status enable_peers(dp_comm *c) {
  for (int a = 0; a < c->k; ++a)
    for (int b = 0; b < c->k; ++b) {
      const int ga = c->ranks[a].gpu, gb = c->ranks[b].gpu;
      if (ga == gb) continue;
      int can = 0;
      DP_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, ga, gb));
      if (!can)
        return DP_FAIL(DP_ERR_UNSUPPORTED,
                       "all_reduce='kernel': GPU %d cannot access GPU %d's memory (no peer access); replicas on "
                       "different GPUs need NCCL (all_reduce='nccl') or peer access",
                       ga, gb);
      DP_CUDA_CHECK(cudaSetDevice(ga));
      cudaError_t e = cudaDeviceEnablePeerAccess(gb, 0);
      if (e == cudaErrorPeerAccessAlreadyEnabled)
        cudaGetLastError(); /* not an error for us; clear it */
      else
        DP_CUDA_CHECK(e);
    }
  return DP_OK;
}

static dp_ptr_set ptr_set(const dp_comm *c, float *const *bufs) {
  dp_ptr_set s;
  memset(&s, 0, sizeof s);
  for (int r = 0; r < c->k; ++r) s.p[r] = bufs[r];
  return s;
}

/* Rank's chunk of [begin, end), reduced on `stream` by our kernel. */
static dp_status kernel_chunk(dp_comm *c, int rank, float *const *bufs, int64_t begin, int64_t end, float scale,
                              cudaStream_t stream) {
  int64_t b, e;
  dp_allreduce_chunk(end - begin, c->k, rank, &b, &e);
  DP_CUDA_CHECK((cudaError_t)dp_cuda_allreduce_range((dp_cuda_stream)stream, ptr_set(c, bufs), c->k, begin + b,
                                                     begin + e, scale));
  return DP_OK;
}

static dp_status kernel_allreduce(dp_comm *c, int rank, float *const *bufs, int64_t n, dp_reduce_op op) {
  comm_rank *me = &c->ranks[rank];
  DP_CUDA_CHECK(cudaSetDevice(me->gpu));
  /* every replica's buffer is complete before anyone reads it ... */
  DP_CUDA_CHECK(cudaEventRecord(me->sync_in, me->compute));
  DP_TRY(dp_barrier_wait(c->bar));
  for (int q = 0; q < c->k; ++q)
    if (q != rank) DP_CUDA_CHECK(cudaStreamWaitEvent(me->compute, c->ranks[q].sync_in, 0));
  DP_TRY(kernel_chunk(c, rank, bufs, 0, n, op == DP_REDUCE_MEAN ? 1.0f / (float)c->k : 1.0f, me->compute));
  /* ... and every chunk is everywhere before anyone uses its buffer again */
  DP_CUDA_CHECK(cudaEventRecord(me->sync_out, me->compute));
  DP_TRY(dp_barrier_wait(c->bar));
  for (int q = 0; q < c->k; ++q)
    if (q != rank) DP_CUDA_CHECK(cudaStreamWaitEvent(me->compute, c->ranks[q].sync_out, 0));
  return DP_OK;
}

static dp_status kernel_bucket(dp_comm *c, int rank, float *const *bufs, int64_t begin, int64_t end, int bucket) {
  comm_rank *me = &c->ranks[rank];
  DP_CUDA_CHECK(cudaSetDevice(me->gpu));
  DP_CUDA_CHECK(cudaEventRecord(me->ready[bucket], me->compute));
  DP_TRY(dp_barrier_wait(c->bar)); /* every rank has recorded bucket's event */
  for (int q = 0; q < c->k; ++q) DP_CUDA_CHECK(cudaStreamWaitEvent(me->side, c->ranks[q].ready[bucket], 0));
  return kernel_chunk(c, rank, bufs, begin, end, 1.0f, me->side);
}

static dp_status kernel_wait(dp_comm *c, int rank) {
  comm_rank *me = &c->ranks[rank];
  DP_CUDA_CHECK(cudaSetDevice(me->gpu));
  DP_CUDA_CHECK(cudaEventRecord(me->side_done, me->side));
  DP_TRY(dp_barrier_wait(c->bar));
  for (int q = 0; q < c->k; ++q) DP_CUDA_CHECK(cudaStreamWaitEvent(me->compute, c->ranks[q].side_done, 0));
  return DP_OK;
}

#endif /* DP_HAVE_CUDA */

#if defined(DP_HAVE_NCCL)

static dp_status nccl_init(dp_comm *c) {
  int gpus[DP_COMM_MAX_REPLICAS];
  ncclComm_t comms[DP_COMM_MAX_REPLICAS];
  for (int r = 0; r < c->k; ++r) gpus[r] = c->ranks[r].gpu;
  /* Since NCCL 2.22 peers connect lazily, inside the first collective that
   * needs them (NCCL_RUNTIME_CONNECT=1, the default), and connecting
   * allocates device memory. Our replica threads keep every allocation out of
   * the step (the mirrored warm-up), so NCCL must not allocate in the middle
   * of one either: connect at initialisation instead, unless the user chose
   * otherwise (setenv does not overwrite). NCCL reads the variable when the
   * communicators are made. */
  if (setenv("NCCL_RUNTIME_CONNECT", "0", 0) != 0)
    return DP_FAIL(DP_ERR_RUNTIME, "nccl: cannot set NCCL_RUNTIME_CONNECT=0 before ncclCommInitAll");
  /* one process, one communicator per device, rank r on gpus[r] (NCCL API,
   * ncclCommInitAll); the devices must be distinct, checked by the caller */
  DP_NCCL_CHECK(ncclCommInitAll(comms, c->k, gpus));
  for (int r = 0; r < c->k; ++r) c->ranks[r].nccl = comms[r];
  return DP_OK;
}

/* Every NCCL operation of a rank goes on its side stream, in the order the
 * host issues them (the same on every rank): two NCCL kernels of one
 * communicator on two streams may run in either order on the GPU, and NCCL
 * does not promise progress for two of them at once (NVIDIA/nccl issues 195,
 * 217), so one stream per communicator it is. This one, unlike the buckets,
 * is ordered both ways with the compute stream: after its queued work, before
 * its later work. */
static dp_status nccl_allreduce(dp_comm *c, int rank, float *const *bufs, int64_t n, dp_reduce_op op) {
  comm_rank *me = &c->ranks[rank];
  DP_CUDA_CHECK(cudaSetDevice(me->gpu));
  DP_CUDA_CHECK(cudaEventRecord(me->sync_in, me->compute));
  DP_CUDA_CHECK(cudaStreamWaitEvent(me->side, me->sync_in, 0));
  /* ncclAvg (NCCL >= 2.10) divides the sum by the rank count */
  DP_NCCL_CHECK(ncclAllReduce(bufs[rank], bufs[rank], (size_t)n, ncclFloat, op == DP_REDUCE_MEAN ? ncclAvg : ncclSum,
                              me->nccl, me->side));
  DP_CUDA_CHECK(cudaEventRecord(me->sync_out, me->side));
  DP_CUDA_CHECK(cudaStreamWaitEvent(me->compute, me->sync_out, 0));
  return DP_OK;
}

static dp_status nccl_bucket(dp_comm *c, int rank, float *const *bufs, int64_t begin, int64_t end, int bucket) {
  comm_rank *me = &c->ranks[rank];
  DP_CUDA_CHECK(cudaSetDevice(me->gpu));
  /* only this rank's compute orders its send buffer; NCCL pairs the ranks on the GPU */
  DP_CUDA_CHECK(cudaEventRecord(me->ready[bucket], me->compute));
  DP_CUDA_CHECK(cudaStreamWaitEvent(me->side, me->ready[bucket], 0));
  float *p = bufs[rank] + begin;
  DP_NCCL_CHECK(ncclAllReduce(p, p, (size_t)(end - begin), ncclFloat, ncclSum, me->nccl, me->side));
  return DP_OK;
}

static dp_status nccl_wait(dp_comm *c, int rank) {
  comm_rank *me = &c->ranks[rank];
  DP_CUDA_CHECK(cudaSetDevice(me->gpu));
  DP_CUDA_CHECK(cudaEventRecord(me->side_done, me->side));
  DP_CUDA_CHECK(cudaStreamWaitEvent(me->compute, me->side_done, 0));
  return DP_OK;
}

#endif /* DP_HAVE_NCCL */

/* ---- creation ------------------------------------------------------------------ */

static dp_status choose_kind(dp_device *const *devs, int k, dp_comm_kind want, dp_comm_kind *out) {
  int cpus = 0, distinct = 1;
  for (int r = 0; r < k; ++r) cpus += devs[r]->kind == DP_DEVICE_CPU;
  if (cpus && cpus < k)
    return DP_FAIL(DP_ERR_VALUE, "mirrored replicas must be all on CPU devices or all on CUDA devices (%s and %s)",
                   devs[0]->name, devs[devs[0]->kind == DP_DEVICE_CPU ? k - 1 : 0]->name);
  if (cpus) {
    if (want != DP_COMM_AUTO && want != DP_COMM_HOST)
      return DP_FAIL(DP_ERR_VALUE, "all_reduce='%s' needs CUDA devices; CPU replicas use 'host'",
                     dp_comm_kind_name(want));
    *out = DP_COMM_HOST;
    return DP_OK;
  }
  int q0 = -1, q1 = -1;
  for (int a = 0; a < k && distinct; ++a)
    for (int b = 0; b < a; ++b)
      if (dp_cuda_device_gpu(devs[a]) == dp_cuda_device_gpu(devs[b])) {
        distinct = 0;
        q0 = b;
        q1 = a;
        break;
      }
  (void)q0; /* named in the NCCL build's message only */
  (void)q1;
  switch (want) {
    case DP_COMM_HOST:
      return DP_FAIL(DP_ERR_VALUE, "all_reduce='host' is for CPU replicas; %s is a CUDA device", devs[0]->name);
    case DP_COMM_NCCL:
#if !defined(DP_HAVE_NCCL)
      return DP_FAIL(DP_ERR_UNSUPPORTED, "all_reduce='nccl': dpcore was built without NCCL");
#else
      if (!distinct)
        return DP_FAIL(DP_ERR_VALUE,
                       "all_reduce='nccl': %s and %s are on the same physical GPU %d, and NCCL refuses two ranks on "
                       "one GPU; use all_reduce='kernel' (or 'auto') for logical GPUs",
                       devs[q0]->name, devs[q1]->name, dp_cuda_device_gpu(devs[q0]));
      *out = DP_COMM_NCCL;
      return DP_OK;
#endif
    case DP_COMM_KERNEL:
      *out = DP_COMM_KERNEL;
      return DP_OK;
    case DP_COMM_AUTO:
      break;
  }
#if defined(DP_HAVE_NCCL)
  *out = distinct && k > 1 ? DP_COMM_NCCL : DP_COMM_KERNEL;
#else
  *out = DP_COMM_KERNEL;
#endif
  return DP_OK;
}

dp_status dp_comm_create(dp_device *const *devs, int k, dp_comm_kind want, dp_barrier *bar, dp_comm **out) {
  *out = NULL;
  if (k < 1 || k > DP_COMM_MAX_REPLICAS)
    return DP_FAIL(DP_ERR_VALUE, "all-reduce: need 1 to %d replicas, got %d", DP_COMM_MAX_REPLICAS, k);
  dp_comm_kind kind = DP_COMM_HOST;
  DP_TRY(choose_kind(devs, k, want, &kind));
  dp_comm *c = calloc(1, sizeof *c);
  if (!c || !(c->ranks = calloc((size_t)k, sizeof *c->ranks))) {
    free(c);
    return DP_FAIL(DP_ERR_MEMORY, "all-reduce: cannot allocate %d ranks", k);
  }
  c->kind = kind;
  c->k = k;
  c->bar = bar;
  for (int r = 0; r < k; ++r) c->ranks[r].dev = devs[r];
  dp_status st = DP_OK;
#if defined(DP_HAVE_CUDA)
  if (kind != DP_COMM_HOST) {
    for (int r = 0; r < k && st == DP_OK; ++r) {
      c->ranks[r].gpu = dp_cuda_device_gpu(devs[r]);
      c->ranks[r].compute = (cudaStream_t)dp_cuda_device_stream(devs[r]);
      st = rank_init(&c->ranks[r]);
    }
    if (st == DP_OK && kind == DP_COMM_KERNEL) st = enable_peers(c);
#if defined(DP_HAVE_NCCL)
    if (st == DP_OK && kind == DP_COMM_NCCL) st = nccl_init(c);
#endif
  }
#else
  if (kind != DP_COMM_HOST) st = DP_FAIL(DP_ERR_UNSUPPORTED, "all-reduce on CUDA devices: built without CUDA");
#endif
  if (st != DP_OK) {
    dp_comm_destroy(c); /* keeps this thread's error message */
    return st;
  }
  *out = c;
  return DP_OK;
}

void dp_comm_destroy(dp_comm *c) {
  if (!c) return;
#if defined(DP_HAVE_CUDA)
  if (c->kind != DP_COMM_HOST)
    for (int r = 0; r < c->k; ++r) {
#if defined(DP_HAVE_NCCL)
      /* ncclCommDestroy waits for the communicator's queued operations
       * (NCCL API, "Communicator destruction"); poison aborted them already */
      if (c->ranks[r].nccl) ncclCommDestroy(c->ranks[r].nccl);
#endif
      rank_destroy(&c->ranks[r]);
    }
#endif
  free(c->ranks);
  free(c);
}

void dp_comm_step_begin(dp_comm *c) {
  for (int r = 0; r < c->k; ++r) c->ranks[r].issued = 0;
}

int64_t dp_comm_collectives_issued(const dp_comm *c) {
  int64_t n = 0;
  for (int r = 0; r < c->k; ++r) n += c->ranks[r].issued;
  return n;
}

int dp_comm_is_poisoned(const dp_comm *c) { return c->poisoned; }

int dp_comm_step_failed(dp_comm *c) {
  if (!c || dp_comm_collectives_issued(c) == 0 || c->kind != DP_COMM_NCCL) return 0;
  c->poisoned = 1;
#if defined(DP_HAVE_NCCL)
  for (int r = 0; r < c->k; ++r)
    if (c->ranks[r].nccl) {
      ncclCommAbort(c->ranks[r].nccl);
      c->ranks[r].nccl = NULL;
    }
#endif
  return 1;
}

/* ---- operations ------------------------------------------------------------------ */

dp_status dp_comm_allreduce(dp_comm *c, int rank, float *const *bufs, int64_t n, dp_reduce_op op) {
  DP_TRY(usable(c));
  if (c->k == 1 || n <= 0) return DP_OK;
  c->ranks[rank].issued++; /* counted before the call: a failing one may have queued work */
  switch (c->kind) {
    case DP_COMM_HOST: return host_range(c, rank, bufs, 0, n, op);
#if defined(DP_HAVE_CUDA)
    case DP_COMM_KERNEL: return kernel_allreduce(c, rank, bufs, n, op);
#endif
#if defined(DP_HAVE_NCCL)
    case DP_COMM_NCCL: return nccl_allreduce(c, rank, bufs, n, op);
#endif
    default: break;
  }
  return DP_FAIL(DP_ERR_UNSUPPORTED, "all-reduce kind '%s' is not built in", dp_comm_kind_name(c->kind));
}

dp_status dp_comm_bucket_allreduce(dp_comm *c, int rank, float *const *bufs, int64_t begin, int64_t end,
                                   int bucket) {
  DP_TRY(usable(c));
  if (bucket < 0 || bucket >= DP_COMM_MAX_BUCKETS)
    return DP_FAIL(DP_ERR_VALUE, "all-reduce: bucket %d outside [0, %d)", bucket, DP_COMM_MAX_BUCKETS);
  if (c->k == 1 || end <= begin) return DP_OK;
  c->ranks[rank].issued++;
  switch (c->kind) {
    case DP_COMM_HOST: return host_range(c, rank, bufs, begin, end, DP_REDUCE_SUM);
#if defined(DP_HAVE_CUDA)
    case DP_COMM_KERNEL: return kernel_bucket(c, rank, bufs, begin, end, bucket);
#endif
#if defined(DP_HAVE_NCCL)
    case DP_COMM_NCCL: return nccl_bucket(c, rank, bufs, begin, end, bucket);
#endif
    default: break;
  }
  return DP_FAIL(DP_ERR_UNSUPPORTED, "all-reduce kind '%s' is not built in", dp_comm_kind_name(c->kind));
}

dp_status dp_comm_wait_buckets(dp_comm *c, int rank) {
  DP_TRY(usable(c));
  if (c->k == 1) return DP_OK;
  switch (c->kind) {
    case DP_COMM_HOST: return DP_OK; /* each bucket was reduced when it was started */
#if defined(DP_HAVE_CUDA)
    case DP_COMM_KERNEL: return kernel_wait(c, rank);
#endif
#if defined(DP_HAVE_NCCL)
    case DP_COMM_NCCL: return nccl_wait(c, rank);
#endif
    default: break;
  }
  return DP_FAIL(DP_ERR_UNSUPPORTED, "all-reduce kind '%s' is not built in", dp_comm_kind_name(c->kind));
}
