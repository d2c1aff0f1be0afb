/* dist_nccl.c — GPU messages between two processes by NCCL (dist_nccl.h).
 *
 * NCCL semantics relied on (NCCL 2.28, nccl.h and the User Guide, "Creating
 * a communicator with options", "Point-to-point communication", "Error
 * handling and communicator abort", "Thread safety"):
 * - ncclCommInitRankConfig with config.blocking = 0 returns at once
 *   (ncclSuccess or ncclInProgress); the communicator is usable once
 *   ncclCommGetAsyncError reports ncclSuccess, and any call on it that
 *   returns ncclInProgress must be polled the same way before the next call
 *   on that communicator, nor may other work go on its stream until then
 *   (the call may not have reached the stream yet: the done event is
 *   recorded after). So no NCCL call here waits for a peer: every wait is
 *   ours, against the deadline.
 * - ncclSend / ncclRecv are queued on the given stream, ordered like kernel
 *   launches, and are "blocking for the GPU" until the peer's matching call,
 *   with the same count and type, runs; a communicator pairs them in the order
 *   they are queued. One thread at a time may use a communicator: every NCCL
 *   call here holds table_lock.
 * - ncclCommAbort frees the communicator and stops its queued operations,
 *   without waiting for the peer, from any thread; a peer that failed or
 *   stopped shows as an asynchronous error (ncclRemoteError, ncclSystemError)
 *   or as a kernel that never finishes, which only the deadline catches.
 * - ncclCommInitRank(Config) needs the CUDA device set on the calling thread
 *   (cudaSetDevice), and refuses two ranks on one GPU (dist.c refuses that
 *   pair before either side gets here).
 */
#include "dist_nccl.h"

#include <stdio.h>
#include <string.h>

#if defined(DP_HAVE_NCCL)

#include <pthread.h>
#include <stdlib.h>
#include <time.h>

#include "cuda_check.h"

_Static_assert(sizeof(ncclUniqueId) == DP_NCCL_ID_BYTES, "the ticket carries one ncclUniqueId");

int dp_nccl_p2p_built(void) { return 1; }

/* The uids asked for so far, by ordinal: cudaGetDeviceProperties fills a large struct, once per GPU. */
static pthread_mutex_t uid_lock = PTHREAD_MUTEX_INITIALIZER;
static uint64_t uids[64];

uint64_t dp_nccl_gpu_uid(int gpu) {
  const int cached = gpu >= 0 && gpu < (int)(sizeof uids / sizeof uids[0]);
  pthread_mutex_lock(&uid_lock);
  uint64_t h = cached ? uids[gpu] : 0;
  pthread_mutex_unlock(&uid_lock);
  if (h) return h;
  struct cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, gpu) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  /* the GPU's 16-byte UUID (one per physical GPU or MIG instance, whatever the host or the
   * process's CUDA_VISIBLE_DEVICES), folded by FNV-1a */
  h = 1469598103934665603ull;
  for (size_t i = 0; i < sizeof prop.uuid.bytes; ++i) h = (h ^ (unsigned char)prop.uuid.bytes[i]) * 1099511628211ull;
  if (!h) h = 1;
  if (cached) {
    pthread_mutex_lock(&uid_lock);
    uids[gpu] = h;
    pthread_mutex_unlock(&uid_lock);
  }
  return h;
}

enum { ENTRY_NEW, ENTRY_STARTING, ENTRY_READY, ENTRY_DEAD };

/* The communicator of this process and one peer (and one pair of GPUs). */
typedef struct p2p_comm {
  int peer, my_gpu, peer_gpu; /* peer_gpu: known to the lower rank's entries only */
  int rank;                   /* in the communicator: 0 the lower rank of the pair, 1 the higher */
  int64_t generation;         /* the lower rank's number for it */
  unsigned char id[DP_NCCL_ID_BYTES];
  int64_t taken; /* the lower rank: tickets handed out */
  int64_t next;  /* the ticket whose turn it is to be queued */
  int state;
  int busy;  /* a thread is starting it or queueing on it */
  int users; /* calls of dp_nccl_p2p_move on it (shutdown frees it only without any) */
  ncclComm_t comm;
  cudaStream_t stream;
  char why[320]; /* ENTRY_DEAD: why */
  struct p2p_comm *link;
} p2p_comm;

static pthread_mutex_t table_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t table_changed;
static pthread_once_t table_once = PTHREAD_ONCE_INIT;
static int table_cond_ok;
static p2p_comm *table;
static int64_t generations; /* the last generation this process made as the lower rank of a pair */

static void table_init(void) {
  pthread_condattr_t a;
  if (pthread_condattr_init(&a) != 0) return;
  /* deadlines are CLOCK_MONOTONIC, as every wait of dist.c */
  if (pthread_condattr_setclock(&a, CLOCK_MONOTONIC) == 0 && pthread_cond_init(&table_changed, &a) == 0)
    table_cond_ok = 1;
  pthread_condattr_destroy(&a);
}

static double now_seconds(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void nap(double waited) {
  /* 50 us while the message is young, then up to 1 ms: latency early, little CPU for a long wait */
  const long ns = waited < 5e-3 ? 50000L : 1000000L;
  const struct timespec t = {0, ns};
  nanosleep(&t, NULL);
}

static const char *nccl_text(ncclResult_t rc, char *buf, size_t size) {
  const char *last = ncclGetLastError(NULL);
  snprintf(buf, size, "NCCL error %d: %s%s%s", (int)rc, ncclGetErrorString(rc), last && last[0] ? ": " : "",
           last ? last : "");
  return buf;
}

/* With table_lock held: the communicator aborted, its entry dead for every later call. */
static void entry_kill(p2p_comm *e, const char *why) {
  if (e->comm) {
    (void)ncclCommAbort(e->comm); /* its result: the communicator is gone either way */
    e->comm = NULL;
  }
  if (e->state != ENTRY_DEAD) snprintf(e->why, sizeof e->why, "%s", why);
  e->state = ENTRY_DEAD;
  pthread_cond_broadcast(&table_changed);
}

static p2p_comm *entry_find(int peer, int64_t generation) {
  for (p2p_comm *e = table; e; e = e->link)
    if (e->peer == peer && e->generation == generation) return e;
  return NULL;
}

dp_status dp_nccl_p2p_ticket(int peer, int my_gpu, int peer_gpu, dp_nccl_ticket *out) {
  memset(out, 0, sizeof *out);
  out->generation = -1;
  pthread_once(&table_once, table_init);
  if (!table_cond_ok) return DP_FAIL(DP_ERR_RUNTIME, "GPU point to point: cannot make a condition variable");
  pthread_mutex_lock(&table_lock);
  p2p_comm *e = table;
  for (; e; e = e->link)
    if (e->rank == 0 && e->peer == peer && e->my_gpu == my_gpu && e->peer_gpu == peer_gpu && e->state != ENTRY_DEAD)
      break;
  dp_status st = DP_OK;
  if (!e) {
    e = calloc(1, sizeof *e);
    ncclUniqueId id;
    const ncclResult_t rc = e ? ncclGetUniqueId(&id) : ncclSuccess;
    if (!e) {
      st = DP_FAIL(DP_ERR_MEMORY, "GPU point to point: a communicator entry");
    } else if (rc != ncclSuccess) {
      char text[256];
      st = DP_FAIL(DP_ERR_CUDA, "ncclGetUniqueId failed: %s", nccl_text(rc, text, sizeof text));
      free(e);
      e = NULL;
    } else {
      e->peer = peer, e->rank = 0, e->my_gpu = my_gpu, e->peer_gpu = peer_gpu;
      e->generation = ++generations;
      memcpy(e->id, &id, sizeof id);
      e->state = ENTRY_NEW;
      e->link = table;
      table = e;
    }
  }
  if (e) {
    out->generation = e->generation;
    out->ticket = e->taken++;
    memcpy(out->id, e->id, sizeof out->id);
  } else {
    snprintf(out->why, sizeof out->why, "%s", dp_error_message());
  }
  pthread_mutex_unlock(&table_lock);
  return st;
}

/* Where one of the two sides waits for the other (the waiter's watch, polled):
 * with table_lock held, an error once e's communicator was aborted, reports an
 * error, or the deadline passed (the communicator then aborted); DP_OK and its
 * state (ncclSuccess, or ncclInProgress while a call is still being queued)
 * otherwise. */
typedef struct watch {
  p2p_comm *e;
  int peer;
  double start, deadline, timeout;
  const char *doing, *what;
} watch;

static dp_status watch_comm(const watch *w, ncclResult_t *state) {
  p2p_comm *e = w->e;
  *state = ncclInProgress;
  if (!e->comm)
    return DP_FAIL(DP_ERR_DIST, "%s: %s with rank %d: the communicator was aborted (%s)", w->what, w->doing, w->peer,
                   e->why);
  const ncclResult_t rc = ncclCommGetAsyncError(e->comm, state);
  char why[320], text[256];
  if (rc != ncclSuccess || (*state != ncclSuccess && *state != ncclInProgress)) {
    snprintf(why, sizeof why, "%s with rank %d failed: %s", w->doing, w->peer,
             nccl_text(rc != ncclSuccess ? rc : *state, text, sizeof text));
    entry_kill(e, why);
    return DP_FAIL(DP_ERR_DIST, "%s: %s", w->what, why);
  }
  const double waited = now_seconds() - w->start;
  if (now_seconds() > w->deadline) {
    snprintf(why, sizeof why, "%s with rank %d did not finish in %.0f s", w->doing, w->peer, waited);
    entry_kill(e, why);
    return DP_FAIL(DP_ERR_DIST, "gave up after %.0f s waiting for rank %d in %s (%s): that process stopped, hung, "
                   "or runs a different sequence of steps (the limit is timeout=%g s)",
                   waited, w->peer, w->what, w->doing, w->timeout);
  }
  return DP_OK;
}

/* Polls the communicator (table_lock taken per look) until a call on it is
 * no longer ncclInProgress. */
static dp_status settle(const watch *w) {
  for (;;) {
    ncclResult_t state;
    pthread_mutex_lock(&table_lock);
    const dp_status st = watch_comm(w, &state);
    pthread_mutex_unlock(&table_lock);
    if (st != DP_OK || state == ncclSuccess) return st;
    nap(now_seconds() - w->start);
  }
}

/* With table_lock held and e->busy set by the caller: makes e's communicator
 * (rank 0 the lower rank of the pair, 1 the higher) on my_gpu, with a stream of its own. */
static dp_status entry_start(p2p_comm *e, const watch *w) {
  DP_CUDA_CHECK(cudaSetDevice(e->my_gpu));
  DP_CUDA_CHECK(cudaStreamCreateWithFlags(&e->stream, cudaStreamNonBlocking));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclUniqueId id;
  memcpy(&id, e->id, sizeof id);
  ncclComm_t comm = NULL;
  const ncclResult_t rc = ncclCommInitRankConfig(&comm, 2, id, e->rank, &config);
  if (rc != ncclSuccess && rc != ncclInProgress) {
    char text[256], why[320];
    snprintf(why, sizeof why, "ncclCommInitRankConfig failed: %s", nccl_text(rc, text, sizeof text));
    if (comm) (void)ncclCommAbort(comm); /* what is left of it; the error reported is the init's */
    entry_kill(e, why);
    return DP_FAIL(DP_ERR_DIST, "%s: %s", w->what, why);
  }
  e->comm = comm;
  pthread_mutex_unlock(&table_lock);
  const watch making = {e, w->peer, w->start, w->deadline, w->timeout, "making the NCCL communicator", w->what};
  const dp_status st = settle(&making);
  pthread_mutex_lock(&table_lock);
  return st;
}

/* With table_lock held, e->busy set and e ready: queues the message on e's
 * stream after `stream`'s work so far; *rc is NCCL's answer (ncclInProgress:
 * still being queued, in the background). */
static dp_status entry_queue(p2p_comm *e, int is_send, void *buf, int64_t bytes, cudaStream_t stream,
                             cudaEvent_t ready, ncclResult_t *rc) {
  DP_CUDA_CHECK(cudaSetDevice(e->my_gpu));
  DP_CUDA_CHECK(cudaEventRecord(ready, stream));
  DP_CUDA_CHECK(cudaStreamWaitEvent(e->stream, ready, 0));
  /* the peer is the communicator's other rank */
  *rc = is_send ? ncclSend(buf, (size_t)bytes, ncclUint8, 1 - e->rank, e->comm, e->stream)
                : ncclRecv(buf, (size_t)bytes, ncclUint8, 1 - e->rank, e->comm, e->stream);
  return DP_OK;
}

/* With table_lock held: ticket t's entry (the higher rank makes it from the
 * first ticket of a generation it sees), or NULL and an error. */
static p2p_comm *entry_of(const dp_nccl_ticket *t, int lower, int peer, int my_gpu, const char *what, dp_status *st) {
  p2p_comm *e = entry_find(peer, t->generation);
  if (!e && lower) { /* the lower rank made it with the ticket */
    *st = DP_FAIL(DP_ERR_RUNTIME, "%s: no communicator of generation %lld", what, (long long)t->generation);
    return NULL;
  }
  if (!e) {
    e = calloc(1, sizeof *e);
    if (!e) {
      *st = DP_FAIL(DP_ERR_MEMORY, "GPU point to point: a communicator entry");
      return NULL;
    }
    e->peer = peer, e->rank = 1, e->my_gpu = my_gpu, e->peer_gpu = -1;
    e->generation = t->generation;
    memcpy(e->id, t->id, sizeof e->id);
    e->state = ENTRY_NEW;
    e->link = table;
    table = e;
  }
  return e;
}

/* Called with table_lock held (e->users counting this call); returns with it released. */
static dp_status move(p2p_comm *e, int is_send, int peer, const dp_nccl_ticket *t, void *buf, int64_t bytes,
                      void *stream, double timeout, const char *what, cudaEvent_t ready, cudaEvent_t done) {
  const double start = now_seconds(), deadline = start + timeout;
  const char *doing = is_send ? "an NCCL send" : "an NCCL receive";
  /* my turn: every earlier ticket of this communicator queued */
  while (e->state != ENTRY_DEAD && (e->busy || e->next != t->ticket)) {
    const double left = deadline - now_seconds();
    if (left <= 0) {
      /* message e->next never came: the pair is out of step, and every later message would wait too */
      const dp_status st = DP_FAIL(DP_ERR_DIST, "gave up after %.0f s waiting for the earlier GPU messages with "
                                   "rank %d in %s (message %lld of their NCCL communicator waits for message %lld): a "
                                   "process stopped, hung, or runs a different sequence of steps (the limit is "
                                   "timeout=%g s)", now_seconds() - start, peer, what, (long long)t->ticket,
                                   (long long)e->next, timeout);
      entry_kill(e, dp_error_message());
      pthread_mutex_unlock(&table_lock);
      return st;
    }
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    const double step = left < 0.1 ? left : 0.1;
    until.tv_nsec += (long)(step * 1e9);
    until.tv_sec += until.tv_nsec / 1000000000L;
    until.tv_nsec %= 1000000000L;
    pthread_cond_timedwait(&table_changed, &table_lock, &until);
  }
  if (e->state == ENTRY_DEAD) {
    const dp_status st = DP_FAIL(DP_ERR_DIST, "%s: the NCCL communicator with rank %d was aborted by an earlier "
                                 "failure (%s)", what, peer, e->why);
    pthread_mutex_unlock(&table_lock);
    return st;
  }
  e->busy = 1;
  const watch w = {e, peer, start, deadline, timeout, doing, what};
  dp_status st = DP_OK;
  if (e->state == ENTRY_NEW) {
    e->state = ENTRY_STARTING;
    st = entry_start(e, &w);
    if (st == DP_OK) e->state = ENTRY_READY;
    else if (e->state != ENTRY_DEAD) entry_kill(e, dp_error_message());
  }
  ncclResult_t rc = ncclSuccess;
  if (st == DP_OK) {
    st = entry_queue(e, is_send, buf, bytes, (cudaStream_t)stream, ready, &rc);
    if (st == DP_OK && rc != ncclSuccess && rc != ncclInProgress) {
      char text[256], why[320];
      snprintf(why, sizeof why, "%s failed: %s", is_send ? "ncclSend" : "ncclRecv", nccl_text(rc, text, sizeof text));
      entry_kill(e, why);
      st = DP_FAIL(DP_ERR_DIST, "%s: %s", what, why);
    } else if (st != DP_OK) {
      entry_kill(e, dp_error_message());
    }
  }
  if (st == DP_OK && rc == ncclInProgress) {
    /* still being queued (its kernel maybe not yet on the stream): no other call on the
     * communicator, and no event after it, until it settles */
    pthread_mutex_unlock(&table_lock);
    st = settle(&w);
    pthread_mutex_lock(&table_lock);
  }
  if (st == DP_OK) {
    const cudaError_t ce = cudaEventRecord(done, e->stream);
    if (ce != cudaSuccess) {
      (void)cudaGetLastError();
      char why[320];
      snprintf(why, sizeof why, "cudaEventRecord failed: %s (%d): %s", cudaGetErrorName(ce), (int)ce,
               cudaGetErrorString(ce));
      entry_kill(e, why);
      st = DP_FAIL(DP_ERR_CUDA, "%s: %s", what, why);
    }
  }
  e->busy = 0;
  if (st == DP_OK) e->next++;
  pthread_cond_broadcast(&table_changed);
  pthread_mutex_unlock(&table_lock);
  if (st != DP_OK) return st;

  /* the message is queued: wait for its done event, watching the communicator */
  for (;;) {
    const cudaError_t q = cudaEventQuery(done);
    if (q == cudaSuccess) return DP_OK;
    if (q != cudaErrorNotReady) {
      (void)cudaGetLastError();
      char why[320];
      snprintf(why, sizeof why, "%s with rank %d: cudaEventQuery failed: %s (%d): %s", doing, peer,
               cudaGetErrorName(q), (int)q, cudaGetErrorString(q));
      pthread_mutex_lock(&table_lock);
      entry_kill(e, why);
      pthread_mutex_unlock(&table_lock);
      return DP_FAIL(DP_ERR_CUDA, "%s: %s", what, why);
    }
    (void)cudaGetLastError(); /* "not ready" is no error */
    ncclResult_t state;
    pthread_mutex_lock(&table_lock);
    st = watch_comm(&w, &state);
    pthread_mutex_unlock(&table_lock);
    if (st != DP_OK) {
      /* aborted: its kernels stop; give them a moment, so that the buffers are free when we return */
      const double stop = now_seconds() + 5.0;
      while (cudaEventQuery(done) == cudaErrorNotReady && now_seconds() < stop) nap(1.0);
      (void)cudaGetLastError();
      return st;
    }
    nap(now_seconds() - start);
  }
}

dp_status dp_nccl_p2p_move(int is_send, int lower, int peer, int my_gpu, const dp_nccl_ticket *t, void *buf,
                           int64_t bytes, void *stream, double timeout, const char *what) {
  pthread_once(&table_once, table_init);
  if (!table_cond_ok) return DP_FAIL(DP_ERR_RUNTIME, "GPU point to point: cannot make a condition variable");
  if (bytes < 0 || !buf) return DP_FAIL(DP_ERR_VALUE, "%s: %lld bytes at %p", what, (long long)bytes, buf);
  DP_CUDA_CHECK(cudaSetDevice(my_gpu));
  cudaEvent_t ready = NULL, done = NULL;
  DP_CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
  cudaError_t ce = cudaEventCreateWithFlags(&done, cudaEventDisableTiming);
  if (ce != cudaSuccess) {
    (void)cudaGetLastError();
    (void)cudaEventDestroy(ready); /* a free: the error reported is the create's */
    return DP_FAIL(DP_ERR_CUDA, "cudaEventCreateWithFlags failed: %s (%d): %s", cudaGetErrorName(ce), (int)ce,
                   cudaGetErrorString(ce));
  }
  dp_status st = DP_OK;
  pthread_mutex_lock(&table_lock);
  p2p_comm *e = entry_of(t, lower, peer, my_gpu, what, &st);
  if (e) {
    e->users++;
    st = move(e, is_send, peer, t, buf, bytes, stream, timeout, what, ready, done);
    pthread_mutex_lock(&table_lock);
    e->users--;
  }
  pthread_mutex_unlock(&table_lock);
  /* an event whose work is still queued is released once it completes (CUDA Runtime API,
   * cudaEventDestroy); a free path, whose failure (a broken context) has nobody to tell but the
   * status already returned */
  (void)cudaEventDestroy(ready);
  (void)cudaEventDestroy(done);
  (void)cudaGetLastError();
  return st;
}

void dp_nccl_p2p_shutdown(void) {
  pthread_mutex_lock(&table_lock);
  const int any = table != NULL; /* a job that sent no GPU message makes no CUDA call here */
  p2p_comm **link = &table;
  while (*link) {
    p2p_comm *e = *link;
    entry_kill(e, "the job is finishing (MPI_Finalize)");
    if (e->users) { /* a call still polls it (an isend never waited for): it fails, the entry stays */
      link = &e->link;
      continue;
    }
    if (e->stream) {
      /* at exit: a failure here has nobody to tell */
      (void)cudaSetDevice(e->my_gpu);
      (void)cudaStreamDestroy(e->stream);
    }
    *link = e->link;
    free(e);
  }
  if (any) (void)cudaGetLastError();
  pthread_mutex_unlock(&table_lock);
}

#else /* built without NCCL */

int dp_nccl_p2p_built(void) { return 0; }

uint64_t dp_nccl_gpu_uid(int gpu) {
  (void)gpu;
  return 0;
}

dp_status dp_nccl_p2p_ticket(int peer, int my_gpu, int peer_gpu, dp_nccl_ticket *out) {
  (void)peer, (void)my_gpu, (void)peer_gpu;
  memset(out, 0, sizeof *out);
  out->generation = -1;
  snprintf(out->why, sizeof out->why, "dpcore was built without NCCL");
  return DP_FAIL(DP_ERR_UNSUPPORTED, "GPU tensors across processes move by NCCL: dpcore was built without it");
}

dp_status dp_nccl_p2p_move(int is_send, int lower, int peer, int my_gpu, const dp_nccl_ticket *t, void *buf,
                           int64_t bytes, void *stream, double timeout, const char *what) {
  (void)is_send, (void)lower, (void)peer, (void)my_gpu, (void)t, (void)buf, (void)bytes, (void)stream, (void)timeout;
  return DP_FAIL(DP_ERR_UNSUPPORTED, "%s: GPU tensors across processes move by NCCL: dpcore was built without it",
                 what);
}

void dp_nccl_p2p_shutdown(void) {}

#endif
