/* comm.c — the all-reduce kinds of comm.h: host (CPU threads), kernel (our
 * reduction kernel over logical or peer GPUs) and nccl (distinct GPUs), each
 * an ops table chosen once when the comm is made; and the collective
 * interface (collective.h) every kind serves through its table.
 *
 * The CUDA kinds are written against documented contracts only (this
 * repository's CI has no GPU; tests/test_gpu.py runs them where one is). They
 * order work through the backend's streams and events (backend.h), which on
 * CUDA are cudaStream_t and cudaEvent_t:
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

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_check.h"
#include "dist.h"
#include "trace.h"

#if defined(DP_HAVE_CUDA)
#include "dp_cuda.h"
#endif

typedef struct comm_rank {
  dp_device *dev;
  int64_t issued;   /* collectives this rank issued since dp_comm_step_begin */
  int next_bucket;  /* the next bucket this rank starts in the current backward pass */
  /* the CUDA kinds' ordering, through the backend (backend.h) */
  dp_stream *side;                      /* bucket reductions, beside the device's stream */
  dp_event *ready[DP_COMM_MAX_BUCKETS]; /* the device's stream has produced bucket b */
  dp_event *side_done;                  /* the side stream's reductions so far */
  dp_event *sync_in, *sync_out;         /* dp_comm_allreduce */
#if defined(DP_HAVE_CUDA)
  int gpu;
#endif
#if defined(DP_HAVE_NCCL)
  ncclComm_t nccl;
#endif
} comm_rank;

/* A buffer every rank has a copy of (dp_comm_register). */
typedef struct comm_buffer {
  float *bufs[DP_COMM_MAX_REPLICAS];
  int64_t n;
} comm_buffer;

/* One kind of all-reduce. Every entry is filled (dp_comm_ops_null_entries). */
typedef struct comm_ops {
  /* after the ranks' devices are set: streams, events, communicators */
  DP_MUST_CHECK dp_status (*create)(dp_comm *c);
  /* safe on a comm whose create failed part way */
  void (*destroy)(dp_comm *c);
  DP_MUST_CHECK dp_status (*all_reduce)(dp_comm *c, int rank, float *const *bufs, int64_t n, dp_reduce_op op);
  DP_MUST_CHECK dp_status (*bucket_start)(dp_comm *c, int rank, float *const *bufs, int64_t begin, int64_t end,
                                          int bucket);
  DP_MUST_CHECK dp_status (*bucket_wait)(dp_comm *c, int rank);
  /* after a failed step that issued collectives: 1 when what some ranks
   * queued can never complete, so the comm was torn down (poisoned) */
  int (*step_failed)(dp_comm *c);
} comm_ops;

typedef struct mpi_ctx mpi_ctx;

struct dp_comm {
  dp_comm_kind kind;
  const comm_ops *ops;
  int k;
  /* the job's replicas: this process's k are first .. first + k - 1 of total
   * (first 0, total k within one process) */
  int first, total;
  double timeout;   /* seconds to wait for another process */
  int64_t step;     /* steps begun (dp_comm_step_begin), for messages */
  mpi_ctx *mpi;     /* the mpi kind's worker */
  dp_barrier *bar;
  int poisoned;
  comm_rank *ranks;
  int nregistered;
  comm_buffer registered[DP_COMM_MAX_REGISTERED];
  int nbuckets;
  const comm_buffer *grads;  /* the registered buffer the buckets are ranges of */
  dp_grad_bucket buckets[DP_COMM_MAX_BUCKETS];
};

const char *dp_comm_kind_name(dp_comm_kind kind) {
  switch (kind) {
    case DP_COMM_AUTO: return "auto";
    case DP_COMM_HOST: return "host";
    case DP_COMM_KERNEL: return "kernel";
    case DP_COMM_NCCL: return "nccl";
    case DP_COMM_MPI: return "mpi";
    case DP_COMM_KIND_COUNT: break;
  }
  return "unknown";
}

dp_status dp_comm_kind_parse(const char *name, dp_comm_kind *out) {
  static const dp_comm_kind kinds[] = {DP_COMM_AUTO, DP_COMM_HOST, DP_COMM_KERNEL, DP_COMM_NCCL, DP_COMM_MPI};
  for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; ++i)
    if (name && strcmp(name, dp_comm_kind_name(kinds[i])) == 0) {
      *out = kinds[i];
      return DP_OK;
    }
  return DP_FAIL(DP_ERR_VALUE, "all_reduce must be 'auto', 'host', 'kernel', 'nccl' or 'mpi', got '%s'",
                 name ? name : "(null)");
}

dp_comm_kind dp_comm_get_kind(const dp_comm *c) { return c->kind; }

static dp_status usable(const dp_comm *c) {
  if (c->poisoned && c->kind == DP_COMM_MPI)
    return DP_FAIL(DP_ERR_DIST, "the all-reduce across processes failed part way in an earlier step, and the "
                   "processes are out of step: restart the job");
  if (c->poisoned)
    return DP_FAIL(DP_ERR_RUNTIME, "the %s all-reduce was aborted after a failed step (NCCL cannot resume a "
                   "collective a replica never joined); make the strategy and the model again",
                   dp_comm_kind_name(c->kind));
  return DP_OK;
}

/* ---- host ------------------------------------------------------------------ */

static dp_status host_create(dp_comm *c) { return DP_OK; }

static void host_destroy(dp_comm *c) {}

static dp_status host_range(dp_comm *c, int rank, float *const *bufs, int64_t begin, int64_t end,
                            dp_reduce_op op) {
  float *shifted[DP_COMM_MAX_REPLICAS];
  for (int r = 0; r < c->k; ++r) shifted[r] = bufs[r] + begin;
  return dp_allreduce(shifted, c->k, rank, end - begin, op, c->bar);
}

static dp_status host_all_reduce(dp_comm *c, int rank, float *const *bufs, int64_t n, dp_reduce_op op) {
  return host_range(c, rank, bufs, 0, n, op);
}

/* reduced at once, by the replica threads */
static dp_status host_bucket_start(dp_comm *c, int rank, float *const *bufs, int64_t begin, int64_t end,
                                   int bucket) {
  return host_range(c, rank, bufs, begin, end, DP_REDUCE_SUM);
}

/* each bucket was reduced when it was started */
static dp_status host_bucket_wait(dp_comm *c, int rank) { return DP_OK; }

/* nothing is ever left pending */
static int host_step_failed(dp_comm *c) { return 0; }

static const comm_ops host_ops = {host_create, host_destroy, host_all_reduce, host_bucket_start, host_bucket_wait,
                                  host_step_failed};

/* ---- mpi: processes, each with CPU replica threads ------------------------------
 *
 * Hierarchical and rank-ordered: a worker thread of each process runs the
 * chain of dist.h over the process's k replica buffers (its local sum
 * continues the running sum of the processes before it, in global replica
 * order), so the bits are those of one process with `total` replica threads.
 * A bucket is handed to the worker as soon as every local replica has
 * produced it, and the replica threads go on with the backward pass of the
 * earlier layers while the worker exchanges it: the overlap of DDP's buckets.
 * The worker takes jobs in the order they are posted, and every process posts
 * the same jobs in the same order (buckets in bucket order, whichever replica
 * thread completes one; a synchronous all-reduce after every bucket before it),
 * so the chains match across processes. One thread makes this comm's MPI
 * calls, as Horovod's background thread does. */

enum { MPI_QUEUE = 2 * DP_COMM_MAX_BUCKETS + 16 };

typedef struct mpi_job {
  float *bufs[DP_COMM_MAX_REPLICAS]; /* the range's start in each local buffer */
  int64_t n;
  float scale;
  int tag;
  char what[96];
} mpi_job;

struct mpi_ctx {
  pthread_t thread;
  int started;
  pthread_mutex_t mu;
  pthread_cond_t work, done;
  mpi_job jobs[MPI_QUEUE];
  int64_t posted, taken, finished; /* jobs, counted since the comm was made */
  int stop;
  _Atomic int abandon;             /* the comm is going: the chain in flight gives up */
  dp_status failed;                /* the first failure; later jobs are skipped */
  char message[1024];
  int arrived[DP_COMM_MAX_BUCKETS]; /* local replicas that have produced bucket b this step */
  int complete[DP_COMM_MAX_BUCKETS];
  int next_post;                    /* the next bucket to hand to the worker, in order */
  int64_t sync_target;              /* the job a synchronous all-reduce waits for */
  int64_t tags;                     /* jobs ever posted: each its own tag (mod DP_DIST_MAX_TAG) */
  float *stage;                     /* 2 * DP_DIST_SEGMENT floats */
  dp_dist_channel *channel;         /* this comm's own MPI communicator */
  int owner;                        /* the owner-computes form (DPCORE_DIST_ALLREDUCE=owner), not the chain */
  int *ks;                          /* every process's replica count (the owner-computes form needs them) */
};

#if defined(DP_HAVE_MPI)

static void *mpi_worker(void *arg) {
  dp_comm *c = arg;
  mpi_ctx *x = c->mpi;
  pthread_mutex_lock(&x->mu);
  for (;;) {
    while (!x->stop && x->taken == x->posted) pthread_cond_wait(&x->work, &x->mu);
    if (x->stop) break;
    const mpi_job *job = &x->jobs[x->taken % MPI_QUEUE];
    x->taken++;
    const int skip = x->failed != DP_OK;
    pthread_mutex_unlock(&x->mu);
    dp_status st = DP_OK;
    if (!skip)
      st = x->owner ? dp_dist_owner_allreduce_on(x->channel, job->bufs, c->k, x->ks, job->n, job->scale, job->tag,
                                                 c->timeout, job->what, &x->abandon)
                    : dp_dist_chain_allreduce_on(x->channel, job->bufs, c->k, job->n, job->scale, job->tag, x->stage,
                                                 c->timeout, job->what, &x->abandon);
    pthread_mutex_lock(&x->mu);
    if (st != DP_OK && x->failed == DP_OK) {
      x->failed = st;
      snprintf(x->message, sizeof x->message, "%s", dp_error_message());
    }
    x->finished++;
    pthread_cond_broadcast(&x->done);
  }
  pthread_mutex_unlock(&x->mu);
  return NULL;
}

/* Queues a job (x->mu held). */
static void mpi_post_locked(dp_comm *c, float *const *bufs, int64_t begin, int64_t end, float scale,
                            const char *what) {
  mpi_ctx *x = c->mpi;
  while (x->posted - x->taken >= MPI_QUEUE) pthread_cond_wait(&x->done, &x->mu);
  mpi_job *job = &x->jobs[x->posted % MPI_QUEUE];
  for (int r = 0; r < c->k; ++r) job->bufs[r] = bufs[r] + begin;
  job->n = end - begin;
  job->scale = scale;
  job->tag = (int)(x->tags++ % DP_DIST_MAX_TAG);
  snprintf(job->what, sizeof job->what, "%s of step %lld", what, (long long)c->step);
  x->posted++;
  pthread_cond_signal(&x->work);
}

/* Waits (x->mu held) until job `target` (1-based count) is done; the
 * worker's failure as this thread's error. */
static dp_status mpi_wait_locked(mpi_ctx *x, int64_t target) {
  while (x->finished < target && x->failed == DP_OK) pthread_cond_wait(&x->done, &x->mu);
  if (x->failed == DP_OK) return DP_OK;
  dp_error_set_message(x->message);
  return x->failed;
}

/* The form of the all-reduce across processes: DPCORE_DIST_ALLREDUCE=chain (the default) or
 * owner, the same on every process (checked: a mismatch would pair different messages), and
 * every process's replica count. Collective. */
static dp_status mpi_choose_form(dp_comm *c, mpi_ctx *x) {
  const char *env = getenv("DPCORE_DIST_ALLREDUCE");
  if (env && *env && strcmp(env, "chain") != 0 && strcmp(env, "owner") != 0)
    return DP_FAIL(DP_ERR_VALUE, "DPCORE_DIST_ALLREDUCE must be 'chain' or 'owner', got '%s'", env);
  x->owner = env && strcmp(env, "owner") == 0;
  const dp_dist_info info = dp_dist_get_info();
  int mine[2] = {c->k, x->owner};
  int *all = malloc(sizeof(int) * 2 * (size_t)info.size);
  x->ks = malloc(sizeof(int) * (size_t)info.size);
  if (!all || !x->ks) {
    free(all);
    return DP_FAIL(DP_ERR_MEMORY, "mpi all-reduce: %d replica counts", info.size);
  }
  dp_status st = dp_dist_allgather(mine, sizeof mine, all, c->timeout, "the comparison of the all-reduce's form");
  for (int q = 0; q < info.size && st == DP_OK; ++q) {
    x->ks[q] = all[2 * q];
    if (all[2 * q + 1] != x->owner)
      st = DP_FAIL(DP_ERR_DIST, "rank %d: DPCORE_DIST_ALLREDUCE differs between the processes: rank %d runs the %s, "
                   "this rank the %s", info.rank, q, all[2 * q + 1] ? "owner-computes form" : "chain",
                   x->owner ? "owner-computes form" : "chain");
  }
  free(all);
  return st;
}

static dp_status mpi_create(dp_comm *c) {
  for (int r = 0; r < c->k; ++r)
    if (c->ranks[r].dev->kind != DP_DEVICE_CPU)
      return DP_FAIL(DP_ERR_VALUE, "all_reduce='mpi' is for CPU replicas (%s is not); GPUs across processes use NCCL",
                     c->ranks[r].dev->name);
  mpi_ctx *x = calloc(1, sizeof *x);
  if (!x) return DP_FAIL(DP_ERR_MEMORY, "mpi all-reduce: cannot allocate its worker");
  c->mpi = x;
  x->stage = malloc(sizeof(float) * 2 * DP_DIST_SEGMENT);
  if (!x->stage) return DP_FAIL(DP_ERR_MEMORY, "mpi all-reduce: cannot allocate its staging");
  /* collective: every process makes its comms in the same order */
  DP_TRY(dp_dist_channel_open(c->timeout, &x->channel));
  DP_TRY(mpi_choose_form(c, x));
  if (pthread_mutex_init(&x->mu, NULL) != 0) return DP_FAIL(DP_ERR_RUNTIME, "pthread_mutex_init failed");
  if (pthread_cond_init(&x->work, NULL) != 0 || pthread_cond_init(&x->done, NULL) != 0)
    return DP_FAIL(DP_ERR_RUNTIME, "pthread_cond_init failed");
  if (pthread_create(&x->thread, NULL, mpi_worker, c) != 0)
    return DP_FAIL(DP_ERR_RUNTIME, "mpi all-reduce: cannot start its worker thread");
  x->started = 1;
  return DP_OK;
}

static void mpi_destroy(dp_comm *c) {
  mpi_ctx *x = c->mpi;
  if (!x) return;
  if (x->started) {
    atomic_store(&x->abandon, 1);
    pthread_mutex_lock(&x->mu);
    x->stop = 1;
    pthread_cond_broadcast(&x->work);
    pthread_mutex_unlock(&x->mu);
    pthread_join(x->thread, NULL);
    pthread_cond_destroy(&x->work);
    pthread_cond_destroy(&x->done);
    pthread_mutex_destroy(&x->mu);
  }
  dp_dist_channel_close(x->channel);
  free(x->stage);
  free(x->ks);
  free(x);
  c->mpi = NULL;
}

static dp_status mpi_all_reduce(dp_comm *c, int rank, float *const *bufs, int64_t n, dp_reduce_op op) {
  mpi_ctx *x = c->mpi;
  DP_TRY(dp_barrier_wait(c->bar)); /* every local buffer is complete, every earlier bucket posted */
  if (rank == 0) {
    pthread_mutex_lock(&x->mu);
    mpi_post_locked(c, bufs, 0, n, op == DP_REDUCE_MEAN ? 1.0f / (float)c->total : 1.0f, "an all-reduce");
    x->sync_target = x->posted;
    pthread_mutex_unlock(&x->mu);
  }
  DP_TRY(dp_barrier_wait(c->bar)); /* sync_target is set */
  pthread_mutex_lock(&x->mu);
  const dp_status st = mpi_wait_locked(x, x->sync_target);
  pthread_mutex_unlock(&x->mu);
  return st;
}

/* Bucket b is handed to the worker once every local replica has produced it,
 * and only after every bucket before it. */
static dp_status mpi_bucket_start(dp_comm *c, int rank, float *const *bufs, int64_t begin, int64_t end, int bucket) {
  mpi_ctx *x = c->mpi;
  pthread_mutex_lock(&x->mu);
  if (++x->arrived[bucket] == c->k) {
    x->arrived[bucket] = 0;
    x->complete[bucket] = 1;
    while (x->next_post < DP_COMM_MAX_BUCKETS && x->complete[x->next_post]) {
      const int b = x->next_post++;
      x->complete[b] = 0;
      char what[64];
      snprintf(what, sizeof what, "the gradient all-reduce (bucket %d)", b);
      const dp_grad_bucket *gb = &c->buckets[b];
      mpi_post_locked(c, c->grads->bufs, gb->begin, gb->end, 1.0f, what);
    }
  }
  pthread_mutex_unlock(&x->mu);
  return DP_OK;
}

static dp_status mpi_bucket_wait(dp_comm *c, int rank) {
  mpi_ctx *x = c->mpi;
  DP_TRY(dp_barrier_wait(c->bar)); /* every local replica has started every bucket: all are posted */
  pthread_mutex_lock(&x->mu);
  const dp_status st = mpi_wait_locked(x, x->posted);
  pthread_mutex_unlock(&x->mu);
  return st;
}

/* A chain some processes joined and others never will: the job is out of step. */
static int mpi_step_failed(dp_comm *c) {
  atomic_store(&c->mpi->abandon, 1);
  return 1;
}

static const comm_ops mpi_ops = {mpi_create, mpi_destroy, mpi_all_reduce, mpi_bucket_start, mpi_bucket_wait,
                                 mpi_step_failed};

#endif /* DP_HAVE_MPI */

/* ---- CUDA kinds ------------------------------------------------------------- */

#if defined(DP_HAVE_CUDA)

/* Rank's side stream and events, made through its device's backend. */
static dp_status rank_events_create(comm_rank *cr) {
  const dp_backend *be = cr->dev->backend;
  DP_TRY(be->stream_create(cr->dev, &cr->side));
  for (int b = 0; b < DP_COMM_MAX_BUCKETS; ++b) DP_TRY(be->event_create(cr->dev, &cr->ready[b]));
  DP_TRY(be->event_create(cr->dev, &cr->side_done));
  DP_TRY(be->event_create(cr->dev, &cr->sync_in));
  return be->event_create(cr->dev, &cr->sync_out);
}

/* Safe on a partly made rank; the side stream's queued work finishes first. */
static void rank_events_destroy(comm_rank *cr) {
  const dp_backend *be = cr->dev->backend;
  if (cr->side) be->stream_destroy(cr->dev, cr->side);
  for (int b = 0; b < DP_COMM_MAX_BUCKETS; ++b)
    if (cr->ready[b]) be->event_destroy(cr->dev, cr->ready[b]);
  if (cr->side_done) be->event_destroy(cr->dev, cr->side_done);
  if (cr->sync_in) be->event_destroy(cr->dev, cr->sync_in);
  if (cr->sync_out) be->event_destroy(cr->dev, cr->sync_out);
  cr->side = NULL;
}

static dp_status ranks_create(dp_comm *c) {
  for (int r = 0; r < c->k; ++r) {
    c->ranks[r].gpu = dp_cuda_device_gpu(c->ranks[r].dev);
    DP_TRY(rank_events_create(&c->ranks[r]));
  }
  return DP_OK;
}

static void ranks_destroy(dp_comm *c) {
  for (int r = 0; r < c->k; ++r) rank_events_destroy(&c->ranks[r]);
}

/* The work queued on rank's stream `s` after this waits for event e of every
 * rank (e points into comm_rank; the offset picks the same event of each). */
static dp_status wait_for_every_rank(dp_comm *c, int rank, dp_stream *s, size_t event_offset, int skip_self) {
  comm_rank *me = &c->ranks[rank];
  for (int q = 0; q < c->k; ++q) {
    if (skip_self && q == rank) continue;
    dp_event *e = *(dp_event **)((char *)&c->ranks[q] + event_offset);
    DP_TRY(me->dev->backend->event_wait(me->dev, s, e));
  }
  return DP_OK;
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

static dp_status kernel_create(dp_comm *c) {
  DP_TRY(ranks_create(c));
  return enable_peers(c);
}

static void kernel_destroy(dp_comm *c) { ranks_destroy(c); }

static dp_ptr_set ptr_set(const dp_comm *c, float *const *bufs) {
  dp_ptr_set s;
  memset(&s, 0, sizeof s);
  for (int r = 0; r < c->k; ++r) s.p[r] = bufs[r];
  return s;
}

/* Rank's chunk of [begin, end), reduced by our kernel on stream s (NULL: the
 * device's own). */
static dp_status kernel_chunk(dp_comm *c, int rank, float *const *bufs, int64_t begin, int64_t end, float scale,
                              dp_stream *s) {
  comm_rank *me = &c->ranks[rank];
  int64_t b, e;
  dp_allreduce_chunk(end - begin, c->k, rank, &b, &e);
  cudaStream_t stream = s ? (cudaStream_t)s : (cudaStream_t)dp_cuda_device_stream(me->dev);
  DP_CUDA_CHECK(cudaSetDevice(me->gpu));
  DP_CUDA_CHECK((cudaError_t)dp_cuda_allreduce_range((dp_cuda_stream)stream, ptr_set(c, bufs), c->k, begin + b,
                                                     begin + e, scale));
  return DP_OK;
}

static dp_status kernel_all_reduce(dp_comm *c, int rank, float *const *bufs, int64_t n, dp_reduce_op op) {
  comm_rank *me = &c->ranks[rank];
  const dp_backend *be = me->dev->backend;
  /* every replica's buffer is complete before anyone reads it ... */
  DP_TRY(be->event_record(me->dev, me->sync_in, NULL));
  DP_TRY(dp_barrier_wait(c->bar));
  DP_TRY(wait_for_every_rank(c, rank, NULL, offsetof(comm_rank, sync_in), 1));
  DP_TRY(kernel_chunk(c, rank, bufs, 0, n, op == DP_REDUCE_MEAN ? 1.0f / (float)c->k : 1.0f, NULL));
  /* ... and every chunk is everywhere before anyone uses its buffer again */
  DP_TRY(be->event_record(me->dev, me->sync_out, NULL));
  DP_TRY(dp_barrier_wait(c->bar));
  return wait_for_every_rank(c, rank, NULL, offsetof(comm_rank, sync_out), 1);
}

static dp_status kernel_bucket_start(dp_comm *c, int rank, float *const *bufs, int64_t begin, int64_t end,
                                     int bucket) {
  comm_rank *me = &c->ranks[rank];
  DP_TRY(me->dev->backend->event_record(me->dev, me->ready[bucket], NULL));
  DP_TRY(dp_barrier_wait(c->bar)); /* every rank has recorded bucket's event */
  DP_TRY(wait_for_every_rank(c, rank, me->side, offsetof(comm_rank, ready) + sizeof(dp_event *) * (size_t)bucket, 0));
  return kernel_chunk(c, rank, bufs, begin, end, 1.0f, me->side);
}

static dp_status kernel_bucket_wait(dp_comm *c, int rank) {
  comm_rank *me = &c->ranks[rank];
  DP_TRY(me->dev->backend->event_record(me->dev, me->side_done, me->side));
  DP_TRY(dp_barrier_wait(c->bar));
  return wait_for_every_rank(c, rank, NULL, offsetof(comm_rank, side_done), 0);
}

/* our kernels never wait for a peer on the GPU: nothing can hang */
static int kernel_step_failed(dp_comm *c) { return 0; }

static const comm_ops kernel_ops = {kernel_create,      kernel_destroy,     kernel_all_reduce,
                                    kernel_bucket_start, kernel_bucket_wait, kernel_step_failed};

#endif /* DP_HAVE_CUDA */

#if defined(DP_HAVE_NCCL)

/* What the process of replica 0 (MPI rank 0) broadcasts: the communicators'
 * unique id, or why it could not make one, so that every process fails with
 * that reason instead of its peers waiting out the timeout for an id. */
typedef struct nccl_id_message {
  int32_t ok;
  char why[480];
  ncclUniqueId id;
} nccl_id_message;

/* Collective over every process of the job, like the communicators it serves. */
static dp_status nccl_unique_id_bcast(const dp_comm *c, ncclUniqueId *out) {
  nccl_id_message msg;
  memset(&msg, 0, sizeof msg);
  if (c->first == 0) {
    const ncclResult_t rc = ncclGetUniqueId(&msg.id);
    msg.ok = rc == ncclSuccess;
    if (!msg.ok) {
      /* ncclGetLastError(NULL): the last error message of a call outside a communicator (NCCL API) */
      const char *last = ncclGetLastError(NULL);
      snprintf(msg.why, sizeof msg.why, "ncclGetUniqueId failed: NCCL error %d: %s%s%s", (int)rc,
               ncclGetErrorString(rc), last && last[0] ? ": " : "", last ? last : "");
    }
  }
  DP_TRY(dp_dist_bcast(&msg, (int64_t)sizeof msg, 0, c->timeout, "the NCCL unique id"));
  if (!msg.ok) {
    msg.why[sizeof msg.why - 1] = '\0'; /* another process's bytes: terminated here whatever they hold */
    return DP_FAIL(DP_ERR_CUDA, "NCCL across processes: the process of rank 0 has no unique id for the "
                   "communicators (%s)", msg.why);
  }
  *out = msg.id;
  return DP_OK;
}

static dp_status nccl_create(dp_comm *c) {
  DP_TRY(ranks_create(c));
  int gpus[DP_COMM_MAX_REPLICAS];
  ncclComm_t comms[DP_COMM_MAX_REPLICAS];
  for (int r = 0; r < c->k; ++r) gpus[r] = c->ranks[r].gpu;
  if (c->total > c->k) {
    /* Across processes: one communicator of every replica of the job, rank
     * first + r here, from a unique id made by the process holding replica 0
     * (MPI rank 0) and broadcast over MPI. One thread initialising several
     * ranks must group the calls (NCCL API, ncclCommInitRank: "... must be
     * called within ncclGroupStart/ncclGroupEnd" when one thread has several
     * devices). NCCL builds its own hierarchy (NVLink within a host, the
     * network between hosts) inside the communicator. */
    ncclUniqueId id;
    DP_TRY(nccl_unique_id_bcast(c, &id));
    DP_NCCL_CHECK(ncclGroupStart());
    ncclResult_t rc = ncclSuccess;
    cudaError_t ce = cudaSuccess;
    for (int r = 0; r < c->k && rc == ncclSuccess && ce == cudaSuccess; ++r) {
      ce = cudaSetDevice(gpus[r]);
      if (ce == cudaSuccess) rc = ncclCommInitRank(&comms[r], c->total, id, c->first + r);
      if (ce == cudaSuccess && rc == ncclSuccess) c->ranks[r].nccl = comms[r];
    }
    const ncclResult_t end = ncclGroupEnd(); /* the group is closed whatever failed inside it */
    DP_CUDA_CHECK(ce);
    DP_NCCL_CHECK(rc);
    DP_NCCL_CHECK(end);
    return DP_OK;
  }
  /* one process, one communicator per device, rank r on gpus[r] (NCCL API,
   * ncclCommInitAll); the devices must be distinct, checked by choose_kind */
  DP_NCCL_CHECK(ncclCommInitAll(comms, c->k, gpus));
  for (int r = 0; r < c->k; ++r) c->ranks[r].nccl = comms[r];
  return DP_OK;
}

static void nccl_destroy(dp_comm *c) {
  /* ncclCommDestroy waits for the communicator's queued operations (NCCL
   * API, "Communicator destruction"); step_failed aborted them already */
  for (int r = 0; r < c->k; ++r)
    if (c->ranks[r].nccl) {
      ncclCommDestroy(c->ranks[r].nccl);
      c->ranks[r].nccl = NULL;
    }
  ranks_destroy(c);
}

/* Rank's ncclAllReduce of n floats at p, in place, on its side stream. */
static dp_status nccl_sum(comm_rank *me, float *p, int64_t n, ncclRedOp_t op) {
  DP_CUDA_CHECK(cudaSetDevice(me->gpu));
  DP_NCCL_CHECK(ncclAllReduce(p, p, (size_t)n, ncclFloat, op, me->nccl, (cudaStream_t)me->side));
  return DP_OK;
}

/* Every NCCL operation of a rank goes on its side stream, in the order the
 * host issues them (the same on every rank): two NCCL kernels of one
 * communicator on two streams may run in either order on the GPU, and NCCL
 * does not promise progress for two of them at once (NVIDIA/nccl issues 195,
 * 217), so one stream per communicator it is. This one, unlike the buckets,
 * is ordered both ways with the device's stream: after its queued work,
 * before its later work. */
static dp_status nccl_all_reduce(dp_comm *c, int rank, float *const *bufs, int64_t n, dp_reduce_op op) {
  comm_rank *me = &c->ranks[rank];
  const dp_backend *be = me->dev->backend;
  DP_TRY(be->event_record(me->dev, me->sync_in, NULL));
  DP_TRY(be->event_wait(me->dev, me->side, me->sync_in));
  /* ncclAvg (NCCL >= 2.10) divides the sum by the rank count */
  DP_TRY(nccl_sum(me, bufs[rank], n, op == DP_REDUCE_MEAN ? ncclAvg : ncclSum));
  DP_TRY(be->event_record(me->dev, me->sync_out, me->side));
  return be->event_wait(me->dev, NULL, me->sync_out);
}

static dp_status nccl_bucket_start(dp_comm *c, int rank, float *const *bufs, int64_t begin, int64_t end, int bucket) {
  comm_rank *me = &c->ranks[rank];
  const dp_backend *be = me->dev->backend;
  /* only this rank's compute orders its send buffer; NCCL pairs the ranks on the GPU */
  DP_TRY(be->event_record(me->dev, me->ready[bucket], NULL));
  DP_TRY(be->event_wait(me->dev, me->side, me->ready[bucket]));
  return nccl_sum(me, bufs[rank] + begin, end - begin, ncclSum);
}

static dp_status nccl_bucket_wait(dp_comm *c, int rank) {
  comm_rank *me = &c->ranks[rank];
  const dp_backend *be = me->dev->backend;
  DP_TRY(be->event_record(me->dev, me->side_done, me->side));
  return be->event_wait(me->dev, NULL, me->side_done);
}

/* Operations some ranks queued may never be matched by the others: abort
 * the communicators, since peers may wait forever (NCCL User Guide, "Fault
 * tolerance"). */
static int nccl_step_failed(dp_comm *c) {
  for (int r = 0; r < c->k; ++r)
    if (c->ranks[r].nccl) {
      ncclCommAbort(c->ranks[r].nccl);
      c->ranks[r].nccl = NULL;
    }
  return 1;
}

static const comm_ops nccl_ops = {nccl_create,      nccl_destroy,     nccl_all_reduce,
                                  nccl_bucket_start, nccl_bucket_wait, nccl_step_failed};

#endif /* DP_HAVE_NCCL */

/* ---- the kinds ------------------------------------------------------------------ */

/* A kind's table, NULL where this build has none. */
static const comm_ops *const comm_kinds[DP_COMM_KIND_COUNT] = {
    [DP_COMM_HOST] = &host_ops,
#if defined(DP_HAVE_CUDA)
    [DP_COMM_KERNEL] = &kernel_ops,
#endif
#if defined(DP_HAVE_NCCL)
    [DP_COMM_NCCL] = &nccl_ops,
#endif
#if defined(DP_HAVE_MPI)
    [DP_COMM_MPI] = &mpi_ops,
#endif
};

#define DP_OPS_ENTRY(name) {#name, offsetof(comm_ops, name)}
static const struct {
  const char *name;
  size_t offset;
} ops_entries[] = {DP_OPS_ENTRY(create),       DP_OPS_ENTRY(destroy),     DP_OPS_ENTRY(all_reduce),
                   DP_OPS_ENTRY(bucket_start), DP_OPS_ENTRY(bucket_wait), DP_OPS_ENTRY(step_failed)};
#undef DP_OPS_ENTRY
_Static_assert(sizeof(comm_ops) == sizeof ops_entries / sizeof ops_entries[0] * sizeof(void (*)(void)),
               "ops_entries must list every entry of comm_ops");

int dp_comm_ops_null_entries(dp_comm_kind kind, const char **out, int max) {
  if (kind < 0 || kind >= DP_COMM_KIND_COUNT || !comm_kinds[kind]) return -1;
  int n = 0;
  for (size_t i = 0; i < sizeof ops_entries / sizeof ops_entries[0]; ++i) {
    void (*fn)(void);
    memcpy(&fn, (const char *)comm_kinds[kind] + ops_entries[i].offset, sizeof fn);
    if (!fn) {
      if (n < max) out[n] = ops_entries[i].name;
      ++n;
    }
  }
  return n;
}

/* across: the replicas span several processes. */
static dp_status choose_kind(dp_device *const *devs, int k, dp_comm_kind want, int across, dp_comm_kind *out) {
  int cpus = 0, distinct = 1;
  for (int r = 0; r < k; ++r) cpus += devs[r]->kind == DP_DEVICE_CPU;
  if (cpus && cpus < k)
    return DP_FAIL(DP_ERR_VALUE, "mirrored replicas must be all on CPU devices or all on CUDA devices (%s and %s)",
                   devs[0]->name, devs[devs[0]->kind == DP_DEVICE_CPU ? k - 1 : 0]->name);
  if (cpus && across) {
    if (want != DP_COMM_AUTO && want != DP_COMM_MPI)
      return DP_FAIL(DP_ERR_VALUE, "all_reduce='%s': CPU replicas in several processes use 'mpi'",
                     dp_comm_kind_name(want));
    *out = DP_COMM_MPI;
    return DP_OK;
  }
  if (cpus) {
    if (want == DP_COMM_MPI)
      return DP_FAIL(DP_ERR_VALUE, "all_reduce='mpi' is for replicas in several processes "
                     "(dp.MultiWorkerMirroredStrategy under mpirun); CPU replicas of one process use 'host'");
    if (want != DP_COMM_AUTO && want != DP_COMM_HOST)
      return DP_FAIL(DP_ERR_VALUE, "all_reduce='%s' needs CUDA devices; CPU replicas use 'host'",
                     dp_comm_kind_name(want));
    *out = DP_COMM_HOST;
    return DP_OK;
  }
  if (across && want != DP_COMM_AUTO && want != DP_COMM_NCCL)
    return DP_FAIL(DP_ERR_VALUE, "all_reduce='%s': CUDA replicas in several processes use NCCL ('nccl' or 'auto')",
                   dp_comm_kind_name(want));
  if (want == DP_COMM_MPI)
    return DP_FAIL(DP_ERR_VALUE, "all_reduce='mpi' is for CPU replicas; CUDA replicas use 'nccl' or 'kernel'");
  int q0 = -1, q1 = -1;
  for (int a = 0; a < k && distinct; ++a)
    for (int b = 0; b < a; ++b)
      if (dp_cuda_device_gpu(devs[a]) == dp_cuda_device_gpu(devs[b])) {
        distinct = 0;
        q0 = b;
        q1 = a;
        break;
      }
  switch (want) {
    case DP_COMM_HOST:
      return DP_FAIL(DP_ERR_VALUE, "all_reduce='host' is for CPU replicas; %s is a CUDA device", devs[0]->name);
    case DP_COMM_NCCL:
      if (!distinct)
        return DP_FAIL(DP_ERR_VALUE,
                       "all_reduce='nccl': %s and %s are on the same physical GPU %d, and NCCL refuses two ranks on "
                       "one GPU; use all_reduce='kernel' (or 'auto') for logical GPUs",
                       devs[q0]->name, devs[q1]->name, dp_cuda_device_gpu(devs[q0]));
      *out = DP_COMM_NCCL;
      return DP_OK;
    case DP_COMM_AUTO:
      if (across) {
        if (!distinct)
          return DP_FAIL(DP_ERR_VALUE,
                         "%s and %s are on the same physical GPU %d: across processes dpcore reduces GPU replicas "
                         "with NCCL, which refuses two ranks on one GPU; give each replica a GPU of its own",
                         devs[q0]->name, devs[q1]->name, dp_cuda_device_gpu(devs[q0]));
        *out = DP_COMM_NCCL;
        return DP_OK;
      }
      /* NCCL where it can serve these devices and is built in */
      *out = distinct && k > 1 && comm_kinds[DP_COMM_NCCL] ? DP_COMM_NCCL : DP_COMM_KERNEL;
      return DP_OK;
    default:
      *out = want;
      return DP_OK;
  }
}

dp_status dp_comm_process_init(void) {
#if defined(DP_HAVE_NCCL)
  /* Since NCCL 2.22 peers connect lazily, inside the first collective that
   * needs them (NCCL_RUNTIME_CONNECT=1, the default), and connecting
   * allocates device memory. Our replica threads keep every allocation out of
   * the step (the mirrored warm-up), so NCCL must not allocate in the middle
   * of one either: connect when the communicators are made (NCCL reads the
   * variable then), unless the user chose otherwise (overwrite = 0). */
  if (setenv("NCCL_RUNTIME_CONNECT", "0", 0) != 0)
    return DP_FAIL(DP_ERR_RUNTIME, "cannot set NCCL_RUNTIME_CONNECT=0 for NCCL (setenv failed)");
#endif
  return DP_OK;
}

dp_status dp_comm_create(dp_device *const *devs, int k, dp_comm_kind want, dp_barrier *bar, dp_comm **out) {
  return dp_comm_create_across(devs, k, want, bar, 0, k, 0.0, out);
}

dp_status dp_comm_create_across(dp_device *const *devs, int k, dp_comm_kind want, dp_barrier *bar, int first,
                                int total, double timeout, dp_comm **out) {
  *out = NULL;
  if (k < 1 || k > DP_COMM_MAX_REPLICAS)
    return DP_FAIL(DP_ERR_VALUE, "all-reduce: need 1 to %d replicas, got %d", DP_COMM_MAX_REPLICAS, k);
  if (first < 0 || total < first + k)
    return DP_FAIL(DP_ERR_VALUE, "all-reduce: replicas %d..%d of %d", first, first + k - 1, total);
  const int across = total > k;
  if (across && !(timeout > 0.0))
    return DP_FAIL(DP_ERR_VALUE, "all-reduce across processes: the timeout must be > 0 seconds, got %g", timeout);
  dp_comm_kind kind = DP_COMM_HOST;
  DP_TRY(choose_kind(devs, k, want, across, &kind));
  const comm_ops *ops = comm_kinds[kind];
  if (!ops) {
    if (kind == DP_COMM_NCCL) return DP_FAIL(DP_ERR_UNSUPPORTED, "all_reduce='nccl': dpcore was built without NCCL");
    if (kind == DP_COMM_MPI)
      return DP_FAIL(DP_ERR_UNSUPPORTED, "replicas in several processes need MPI: dpcore was built without it "
                     "(install Open MPI, libopenmpi-dev, and reinstall; DPCORE_MPI=0 disables it)");
    return DP_FAIL(DP_ERR_UNSUPPORTED, "all-reduce kind '%s' on %s: dpcore was built without it",
                   dp_comm_kind_name(kind), devs[0]->name);
  }
  dp_comm *c = calloc(1, sizeof *c);
  if (!c || !(c->ranks = calloc((size_t)k, sizeof *c->ranks))) {
    free(c);
    return DP_FAIL(DP_ERR_MEMORY, "all-reduce: cannot allocate %d ranks", k);
  }
  c->kind = kind;
  c->ops = ops;
  c->k = k;
  c->first = first;
  c->total = total;
  c->timeout = timeout;
  c->bar = bar;
  for (int r = 0; r < k; ++r) c->ranks[r].dev = devs[r];
  const dp_status st = ops->create(c);
  if (st != DP_OK) {
    dp_comm_destroy(c); /* keeps this thread's error message */
    return st;
  }
  *out = c;
  return DP_OK;
}

void dp_comm_destroy(dp_comm *c) {
  if (!c) return;
  c->ops->destroy(c);
  free(c->ranks);
  free(c);
}

void dp_comm_step_begin(dp_comm *c) {
  c->step++;
  for (int r = 0; r < c->k; ++r) {
    c->ranks[r].issued = 0;
    c->ranks[r].next_bucket = 0;
  }
  if (c->mpi) {
    pthread_mutex_lock(&c->mpi->mu);
    memset(c->mpi->arrived, 0, sizeof c->mpi->arrived);
    memset(c->mpi->complete, 0, sizeof c->mpi->complete);
    c->mpi->next_post = 0;
    pthread_mutex_unlock(&c->mpi->mu);
  }
}

int dp_comm_total(const dp_comm *c) { return c->total; }
int dp_comm_first(const dp_comm *c) { return c->first; }

int64_t dp_comm_collectives_issued(const dp_comm *c) {
  int64_t n = 0;
  for (int r = 0; r < c->k; ++r) n += c->ranks[r].issued;
  return n;
}

int dp_comm_is_poisoned(const dp_comm *c) { return c->poisoned; }

int dp_comm_step_failed(dp_comm *c) {
  if (!c || dp_comm_collectives_issued(c) == 0 || c->poisoned) return c && c->poisoned;
  c->poisoned = c->ops->step_failed(c);
  return c->poisoned;
}

/* ---- operations ------------------------------------------------------------------ */

dp_status dp_comm_allreduce(dp_comm *c, int rank, float *const *bufs, int64_t n, dp_reduce_op op) {
  DP_TRY(usable(c));
  if (c->total == 1 || n <= 0) return DP_OK;
  c->ranks[rank].issued++; /* counted before the call: a failing one may have queued work */
  const int64_t t0 = dp_trace_begin();
  DP_TRY(c->ops->all_reduce(c, rank, bufs, n, op));
  dp_trace_end(DP_PHASE_ALLREDUCE, -1, n * (int64_t)sizeof(float), t0);
  return DP_OK;
}

dp_status dp_comm_bucket_allreduce(dp_comm *c, int rank, float *const *bufs, int64_t begin, int64_t end,
                                   int bucket) {
  DP_TRY(usable(c));
  if (bucket < 0 || bucket >= DP_COMM_MAX_BUCKETS)
    return DP_FAIL(DP_ERR_VALUE, "all-reduce: bucket %d outside [0, %d)", bucket, DP_COMM_MAX_BUCKETS);
  if (c->total == 1 || end <= begin) return DP_OK;
  c->ranks[rank].issued++;
  const int64_t t0 = dp_trace_begin();
  DP_TRY(c->ops->bucket_start(c, rank, bufs, begin, end, bucket));
  dp_trace_end(DP_PHASE_ALLREDUCE, bucket, (end - begin) * (int64_t)sizeof(float), t0);
  return DP_OK;
}

dp_status dp_comm_wait_buckets(dp_comm *c, int rank) {
  DP_TRY(usable(c));
  if (c->total == 1) return DP_OK;
  const int64_t t0 = dp_trace_begin();
  DP_TRY(c->ops->bucket_wait(c, rank));
  dp_trace_end(DP_PHASE_WAIT, -1, 0, t0);
  return DP_OK;
}

/* ---- registered buffers and the collective interface ----------------------------- */

dp_status dp_comm_register(dp_comm *c, float *const *bufs, int64_t n) {
  if (c->nregistered == DP_COMM_MAX_REGISTERED)
    return DP_FAIL(DP_ERR_VALUE, "all-reduce: %d buffers are registered already", DP_COMM_MAX_REGISTERED);
  if (n < 0) return DP_FAIL(DP_ERR_VALUE, "all-reduce: a registered buffer of %lld floats", (long long)n);
  comm_buffer *b = &c->registered[c->nregistered++];
  memset(b, 0, sizeof *b);
  for (int r = 0; r < c->k; ++r) b->bufs[r] = bufs[r];
  b->n = n;
  return DP_OK;
}

void dp_comm_unregister_all(dp_comm *c) {
  c->nregistered = 0;
  c->nbuckets = 0;
  c->grads = NULL;
}

/* The registered buffer whose copy on `rank` holds [p, p + n); NULL if none.
 * Compared as addresses: the buffers are distinct allocations. */
static const comm_buffer *registered_at(const dp_comm *c, int rank, const float *p, int64_t n, int64_t *offset) {
  const uintptr_t a = (uintptr_t)p;
  for (int i = 0; i < c->nregistered; ++i) {
    const comm_buffer *b = &c->registered[i];
    const uintptr_t base = (uintptr_t)b->bufs[rank];
    if (a >= base && (a - base) % sizeof(float) == 0 &&
        (int64_t)((a - base) / sizeof(float)) + n <= b->n) {
      *offset = (int64_t)((a - base) / sizeof(float));
      return b;
    }
  }
  return NULL;
}

dp_status dp_comm_set_buckets(dp_comm *c, float *const *grads, const dp_grad_bucket *buckets, int n) {
  if (n < 0 || n > DP_COMM_MAX_BUCKETS)
    return DP_FAIL(DP_ERR_VALUE, "all-reduce: %d gradient buckets, at most %d", n, DP_COMM_MAX_BUCKETS);
  int64_t offset = 0;
  const comm_buffer *b = registered_at(c, 0, grads[0], 0, &offset);
  if (!b || offset != 0) return DP_FAIL(DP_ERR_VALUE, "all-reduce: the gradient buffer is not registered");
  for (int i = 0; i < n; ++i)
    if (buckets[i].begin < 0 || buckets[i].end < buckets[i].begin || buckets[i].end > b->n)
      return DP_FAIL(DP_ERR_VALUE, "all-reduce: bucket %d [%lld, %lld) outside the %lld gradients", i,
                     (long long)buckets[i].begin, (long long)buckets[i].end, (long long)b->n);
  memcpy(c->buckets, buckets, sizeof *buckets * (size_t)n);
  c->nbuckets = n;
  c->grads = b;
  return DP_OK;
}

static dp_status collective_all_reduce(void *ctx, int rank, float *buf, int64_t n, dp_reduce_op op) {
  dp_comm *c = ctx;
  int64_t offset = 0;
  const comm_buffer *b = registered_at(c, rank, buf, n, &offset);
  if (!b)
    return DP_FAIL(DP_ERR_VALUE, "all-reduce: replica %d's %lld floats are in no buffer registered with its group",
                   rank, (long long)n);
  float *shifted[DP_COMM_MAX_REPLICAS];
  for (int r = 0; r < c->k; ++r) shifted[r] = b->bufs[r] + offset;
  return dp_comm_allreduce(c, rank, shifted, n, op);
}

/* Starts every bucket that is complete once layer `layer` is done. */
static dp_status collective_grad_ready(void *ctx, int rank, int layer) {
  dp_comm *c = ctx;
  comm_rank *me = &c->ranks[rank];
  while (me->next_bucket < c->nbuckets && c->buckets[me->next_bucket].ready_layer >= layer) {
    const dp_grad_bucket *b = &c->buckets[me->next_bucket];
    DP_TRY(dp_comm_bucket_allreduce(c, rank, c->grads->bufs, b->begin, b->end, me->next_bucket));
    me->next_bucket++;
  }
  return DP_OK;
}

static dp_status collective_wait(void *ctx, int rank) {
  dp_comm *c = ctx;
  comm_rank *me = &c->ranks[rank];
  if (me->next_bucket != c->nbuckets)
    return DP_FAIL(DP_ERR_RUNTIME, "all-reduce: replica %d started %d of %d gradient buckets", rank, me->next_bucket,
                   c->nbuckets);
  me->next_bucket = 0;
  return dp_comm_wait_buckets(c, rank);
}

static const dp_collective_ops comm_collective_ops = {collective_all_reduce, collective_grad_ready, collective_wait};

dp_collective dp_comm_collective(dp_comm *c, int rank) {
  dp_collective coll = {&comm_collective_ops, c, rank, 0, 0};
  return coll;
}
