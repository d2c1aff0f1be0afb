/* dist.c — the processes of a job over MPI (dist.h).
 *
 * MPI semantics relied on (MPI 3.1 standard): non-blocking point-to-point
 * messages between one pair of processes on one communicator and tag are
 * received in the order they were sent (3.5, "Order"); MPI_Testsome sets
 * each completed request to MPI_REQUEST_NULL and returns MPI_UNDEFINED once
 * none is active (3.7.5); MPI_Ibcast is a non-blocking collective, matched in
 * the order processes issue collectives on a communicator (5.12); with
 * MPI_THREAD_SERIALIZED any thread may call MPI as long as no two do at once
 * (12.4.3), which the lock below ensures; MPI_ERRORS_RETURN on our own
 * communicators turns an error into a return code instead of the default
 * abort (8.3).
 */
#include "dist.h"
#include "dist_nccl.h"

#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(DP_HAVE_MPI)
#include <dlfcn.h>
#include <mpi.h>
#if defined(OPEN_MPI) && OPEN_MPI
#include <mpi-ext.h>
#endif
#endif

static pthread_mutex_t init_lock = PTHREAD_MUTEX_INITIALIZER;
static dp_dist_info world = {0, 1, 0, 1, 0, 0, -1, 0};


dp_dist_info dp_dist_get_info(void) {
  pthread_mutex_lock(&init_lock);
  dp_dist_info i = world;
  pthread_mutex_unlock(&init_lock);
  return i;
}

/* Open MPI's, PMIx's and PMI's (MPICH, Slurm) variables: a launcher started us. */
static int launched_by_mpirun(void) {
  static const char *const vars[] = {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE"};
  for (size_t i = 0; i < sizeof vars / sizeof vars[0]; ++i)
    if (getenv(vars[i])) return 1;
  return 0;
}

#if defined(DP_HAVE_MPI)

static double now_seconds(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Every MPI call holds it (MPI_THREAD_SERIALIZED is all we need). */
static pthread_mutex_t mpi_lock = PTHREAD_MUTEX_INITIALIZER;
static int init_done;             /* dp_dist_init ran (and succeeded or failed for good) */
static dp_status init_status;     /* its outcome, repeated to every later caller */
static char init_message[512];
static MPI_Comm comm_ctl = MPI_COMM_NULL;  /* bcast, allgather, barrier */
static MPI_Comm comm_data = MPI_COMM_NULL; /* the gradient chains */
static MPI_Comm comm_p2p = MPI_COMM_NULL;  /* dp.distributed.send / recv */
/* Set once an operation failed part way: the processes are out of step, and
 * any later operation (and MPI_Finalize) could wait forever. */
static char broken[768];
static pthread_mutex_t broken_lock = PTHREAD_MUTEX_INITIALIZER;

enum { TAG_GATHER = 1, TAG_CHAIN_BASE = 16 };

int dp_dist_built(void) { return 1; }

static char library_version[MPI_MAX_LIBRARY_VERSION_STRING];
static pthread_once_t library_version_once = PTHREAD_ONCE_INIT;

/* library_version's first line, once: any thread may ask first */
static void library_version_fill(void) {
  int len = 0;
  /* callable before MPI_Init (MPI 3.1, 8.1.1) */
  if (MPI_Get_library_version(library_version, &len) != MPI_SUCCESS)
    snprintf(library_version, sizeof library_version, "MPI");
  char *nl = strchr(library_version, '\n');
  if (nl) *nl = '\0';
  for (char *c = library_version + strlen(library_version); c > library_version && (c[-1] == ' ' || c[-1] == ',');
       --c)
    c[-1] = '\0';
}

const char *dp_dist_library_version(void) {
  pthread_once(&library_version_once, library_version_fill);
  return library_version;
}

int dp_dist_cuda_aware(void) {
#if defined(MPIX_CUDA_AWARE_SUPPORT) && MPIX_CUDA_AWARE_SUPPORT
  /* built with CUDA support; the run-time answer needs MPI initialised */
  int up = 0;
  MPI_Initialized(&up);
  return up ? MPIX_Query_cuda_support() : 1;
#elif defined(MPIX_CUDA_AWARE_SUPPORT)
  return 0; /* Open MPI says: built without CUDA support */
#else
  return -1;
#endif
}

static const char *mpi_error_text(int rc, char *buf, int size) {
  int len = 0;
  if (MPI_Error_string(rc, buf, &len) != MPI_SUCCESS) snprintf(buf, (size_t)size, "MPI error %d", rc);
  return buf;
}

static dp_status fail_broken(void) {
  pthread_mutex_lock(&broken_lock);
  char why[sizeof broken];
  snprintf(why, sizeof why, "%s", broken);
  pthread_mutex_unlock(&broken_lock);
  return DP_FAIL(DP_ERR_DIST, "rank %d: the processes of this job are out of step since an earlier failure (%s); "
                 "restart the job", world.rank, why);
}

int dp_dist_is_broken(void) {
  pthread_mutex_lock(&broken_lock);
  const int out_of_step = broken[0] != '\0' && world.initialized_here;
  pthread_mutex_unlock(&broken_lock);
  return out_of_step;
}

static dp_status usable(void) {
  if (!init_done || world.size == 1) return DP_OK;
  pthread_mutex_lock(&broken_lock);
  const int out_of_step = broken[0] != '\0';
  pthread_mutex_unlock(&broken_lock);
  return out_of_step ? fail_broken() : DP_OK;
}

/* Marks the job out of step with the message just recorded on this thread. */
static dp_status mark_broken(dp_status st) {
  pthread_mutex_lock(&broken_lock);
  if (!broken[0]) snprintf(broken, sizeof broken, "%s", dp_error_message());
  pthread_mutex_unlock(&broken_lock);
  return st;
}

/* "1, 3" from the peers of the requests still active. */
static void pending_peers(const MPI_Request *reqs, const int *peers, int n, char *out, size_t size) {
  out[0] = '\0';
  size_t used = 0;
  for (int i = 0; i < n; ++i) {
    if (reqs[i] == MPI_REQUEST_NULL) continue;
    int seen = 0;
    for (int j = 0; j < i; ++j) seen |= reqs[j] != MPI_REQUEST_NULL && peers[j] == peers[i];
    if (seen) continue;
    const int w = snprintf(out + used, size - used, "%s%d", used ? ", " : "", peers[i]);
    if (w < 0 || (size_t)w >= size - used) break;
    used += (size_t)w;
  }
}

/* When a wait gives up: the receives among reqs (recv[i] != 0) still posted
 * are cancelled, so that a late peer's message cannot be copied, by any later
 * MPI progress (MPI_Finalize's included), into a buffer the caller frees once
 * we return. MPI_Wait returns for a request marked for cancellation whatever
 * the other processes do (MPI 3.1, 3.8.4). Sends are left (Open MPI cannot
 * cancel them; an eager one no longer reads its buffer), and so is a
 * broadcast (a collective cannot be cancelled). */
static void cancel_receives(MPI_Request *reqs, const unsigned char *recv, int n) {
  if (!recv) return;
  pthread_mutex_lock(&mpi_lock);
  for (int i = 0; i < n; ++i)
    if (recv[i] && reqs[i] != MPI_REQUEST_NULL && MPI_Cancel(&reqs[i]) == MPI_SUCCESS)
      MPI_Wait(&reqs[i], MPI_STATUS_IGNORE);
  pthread_mutex_unlock(&mpi_lock);
}

/* Polls reqs until all are done, the deadline passes, MPI fails or the
 * caller abandons the wait (the abandon flag). A waiting thread yields its core: the
 * replica threads that compute are on the same cores. */
static dp_status wait_requests_abandonable(MPI_Request *reqs, const int *peers, const unsigned char *recv, int n,
                                           double timeout, const char *what, const _Atomic int *abandon) {
  const double start = now_seconds();
  long sleeps = 0;
  for (;;) {
    int outcount = 0;
    int idx[64];
    int done = 1;
    pthread_mutex_lock(&mpi_lock);
    int rc = MPI_SUCCESS;
    for (int at = 0; at < n && rc == MPI_SUCCESS; at += 64) {
      const int m = n - at < 64 ? n - at : 64;
      rc = MPI_Testsome(m, reqs + at, &outcount, idx, MPI_STATUSES_IGNORE);
      if (rc == MPI_SUCCESS && outcount != MPI_UNDEFINED)
        for (int i = 0; i < m; ++i) done &= reqs[at + i] == MPI_REQUEST_NULL;
    }
    pthread_mutex_unlock(&mpi_lock);
    char who[128];
    if (rc != MPI_SUCCESS) {
      char text[MPI_MAX_ERROR_STRING];
      pending_peers(reqs, peers, n, who, sizeof who);
      cancel_receives(reqs, recv, n);
      return mark_broken(DP_FAIL(DP_ERR_DIST, "rank %d: MPI failed in %s, waiting for rank %s: %s", world.rank, what,
                                 who[0] ? who : "?", mpi_error_text(rc, text, sizeof text)));
    }
    if (done) return DP_OK;
    if (abandon && atomic_load(abandon)) {
      /* the peers may have gone on without us: the job is out of step */
      cancel_receives(reqs, recv, n);
      dp_status_ignore(mark_broken(DP_FAIL(DP_ERR_ABORTED, "rank %d: %s was abandoned", world.rank, what)));
      return DP_FAIL(DP_ERR_ABORTED, "rank %d: %s was abandoned", world.rank, what);
    }
    const double waited = now_seconds() - start;
    if (waited > timeout) {
      pending_peers(reqs, peers, n, who, sizeof who);
      cancel_receives(reqs, recv, n);
      return mark_broken(DP_FAIL(DP_ERR_DIST,
                                 "rank %d gave up after %.0f s waiting for rank %s in %s: that process stopped, hung, "
                                 "or runs a different sequence of steps (the limit is timeout=%g s)",
                                 world.rank, waited, who, what, timeout));
    }
    /* Spin for the first 50 us (a shared-memory message takes about 1 us),
     * yield the core until 5 ms (a peer still computing gets it), then sleep
     * 50 us doubling to 800 us: latency early, little CPU for a long wait. */
    if (waited < 50e-6) {
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
    } else if (waited < 5e-3) {
      sched_yield();
    } else {
      struct timespec ts = {0, 50000L << (sleeps < 4 ? sleeps : 4)};
      ++sleeps;
      nanosleep(&ts, NULL);
    }
  }
}

static dp_status wait_requests(MPI_Request *reqs, const int *peers, const unsigned char *recv, int n, double timeout,
                               const char *what) {
  return wait_requests_abandonable(reqs, peers, recv, n, timeout, what, NULL);
}

static dp_status mpi_call(int rc, const char *call, const char *what) {
  if (rc == MPI_SUCCESS) return DP_OK;
  char text[MPI_MAX_ERROR_STRING];
  return mark_broken(
      DP_FAIL(DP_ERR_DIST, "rank %d: %s failed in %s: %s", world.rank, call, what, mpi_error_text(rc, text, sizeof text)));
}

/* ---- joining the job ------------------------------------------------------------- */

static dp_status init_fail(int rc, const char *call) {
  char text[MPI_MAX_ERROR_STRING];
  return DP_FAIL(DP_ERR_DIST, "MPI: %s failed: %s", call, mpi_error_text(rc, text, sizeof text));
}

/* Every process's host name, gathered with a deadline: the local rank is the
 * number of lower ranks on the same host. */
static dp_status find_local_rank(void) {
  char mine[MPI_MAX_PROCESSOR_NAME + 1];
  memset(mine, 0, sizeof mine);
  int len = 0;
  if (MPI_Get_processor_name(mine, &len) != MPI_SUCCESS) snprintf(mine, sizeof mine, "?");
  const size_t stride = sizeof mine;
  char *all = calloc((size_t)world.size, stride);
  if (!all) return DP_FAIL(DP_ERR_MEMORY, "MPI: cannot gather %d host names", world.size);
  dp_status st = dp_dist_allgather(mine, (int64_t)stride, all, 120.0, "joining the job (gathering host names)");
  if (st == DP_OK) {
    world.local_rank = 0;
    world.local_size = 0;
    for (int q = 0; q < world.size; ++q)
      if (strcmp(all + (size_t)q * stride, mine) == 0) {
        world.local_size++;
        if (q < world.rank) world.local_rank++;
      }
  }
  free(all);
  return st;
}

static dp_status init_locked(void) {
  world.launched = launched_by_mpirun();
  int up = 0, down = 0;
  MPI_Initialized(&up);
  MPI_Finalized(&down);
  if (down) return DP_FAIL(DP_ERR_DIST, "MPI was finalised already in this process; it cannot be started again");
  int provided = 0;
  if (!up) {
    if (!world.launched) return DP_OK; /* a world of one: no MPI */
    /* Open MPI's plug-ins resolve symbols of libmpi, which a Python extension
     * loads with RTLD_LOCAL: make them global first (mpi4py does the same). */
    static const char *const libs[] = {"libmpi.so.40", "libmpi.so.12", "libmpi.so"};
    for (size_t i = 0; i < sizeof libs / sizeof libs[0]; ++i)
      if (dlopen(libs[i], RTLD_NOW | RTLD_GLOBAL | RTLD_NOLOAD)) break;
    const int rc = MPI_Init_thread(NULL, NULL, MPI_THREAD_MULTIPLE, &provided);
    if (rc != MPI_SUCCESS) return init_fail(rc, "MPI_Init_thread");
    world.initialized_here = 1;
  } else {
    MPI_Query_thread(&provided);
  }
  world.mpi_initialized = 1;
  world.thread_level = provided;
  if (provided < MPI_THREAD_SERIALIZED)
    return DP_FAIL(DP_ERR_DIST,
                   "MPI was initialised with thread level %d; dpcore's replica threads need MPI_THREAD_SERIALIZED "
                   "(%d) or more (with mpi4py: leave mpi4py.rc.thread_level at its default, 'multiple')",
                   provided, MPI_THREAD_SERIALIZED);
  int rc = MPI_Comm_rank(MPI_COMM_WORLD, &world.rank);
  if (rc == MPI_SUCCESS) rc = MPI_Comm_size(MPI_COMM_WORLD, &world.size);
  if (rc != MPI_SUCCESS) return init_fail(rc, "MPI_Comm_rank");
  world.local_rank = 0;
  world.local_size = 1;
  if (world.size == 1) return DP_OK;
  /* Our own communicators, so that no message of ours meets the user's
   * (mpi4py's), each returning errors instead of aborting. MPI_Comm_dup is
   * blocking, the non-blocking duplicate is polled with a deadline. */
  MPI_Request reqs[3];
  int peers[3] = {-1, -1, -1};
  rc = MPI_Comm_idup(MPI_COMM_WORLD, &comm_ctl, &reqs[0]);
  if (rc == MPI_SUCCESS) rc = MPI_Comm_idup(MPI_COMM_WORLD, &comm_data, &reqs[1]);
  if (rc == MPI_SUCCESS) rc = MPI_Comm_idup(MPI_COMM_WORLD, &comm_p2p, &reqs[2]);
  if (rc != MPI_SUCCESS) return init_fail(rc, "MPI_Comm_idup");
  init_done = 1; /* the operations below run on the new communicators */
  DP_TRY(wait_requests(reqs, peers, NULL, 3, 120.0, "joining the job (MPI_Comm_idup)"));
  MPI_Comm_set_errhandler(comm_ctl, MPI_ERRORS_RETURN);
  MPI_Comm_set_errhandler(comm_data, MPI_ERRORS_RETURN);
  MPI_Comm_set_errhandler(comm_p2p, MPI_ERRORS_RETURN);
  return find_local_rank();
}

dp_status dp_dist_init(dp_dist_info *out) {
  pthread_mutex_lock(&init_lock);
  if (!init_done) {
    init_status = init_locked();
    init_done = 1;
    snprintf(init_message, sizeof init_message, "%s", init_status == DP_OK ? "" : dp_error_message());
  }
  const dp_status st = init_status;
  if (out) *out = world;
  pthread_mutex_unlock(&init_lock);
  if (st != DP_OK) dp_error_set_message(init_message);
  return st;
}

dp_status dp_dist_finalize(void) {
  pthread_mutex_lock(&init_lock);
  dp_status st = DP_OK;
  pthread_mutex_lock(&broken_lock);
  const int out_of_step = broken[0] != '\0';
  pthread_mutex_unlock(&broken_lock);
  if (world.initialized_here && !out_of_step) {
    int down = 0;
    MPI_Finalized(&down);
    if (!down) {
      dp_nccl_p2p_shutdown(); /* no GPU message is in flight: the caller's last operations returned */
      if (comm_ctl != MPI_COMM_NULL) MPI_Comm_free(&comm_ctl);
      if (comm_data != MPI_COMM_NULL) MPI_Comm_free(&comm_data);
      if (comm_p2p != MPI_COMM_NULL) MPI_Comm_free(&comm_p2p);
      const int rc = MPI_Finalize();
      if (rc != MPI_SUCCESS) st = init_fail(rc, "MPI_Finalize");
    }
    world.initialized_here = 0;
    world.mpi_initialized = 0;
    pthread_mutex_lock(&broken_lock);
    snprintf(broken, sizeof broken, "MPI was finalised");
    pthread_mutex_unlock(&broken_lock);
  }
  pthread_mutex_unlock(&init_lock);
  return st;
}

void dp_dist_abort(int code) {
  int up = 0, down = 0;
  MPI_Initialized(&up);
  MPI_Finalized(&down);
  if (up && !down) MPI_Abort(MPI_COMM_WORLD, code);
}

/* ---- operations ------------------------------------------------------------------ */

enum { MAX_MESSAGE = 1 << 30 }; /* bytes per message: MPI counts are int */

dp_status dp_dist_bcast(void *buf, int64_t bytes, int root, double timeout, const char *what) {
  DP_TRY(usable());
  if (world.size == 1 || bytes <= 0) return DP_OK;
  if (root < 0 || root >= world.size)
    return DP_FAIL(DP_ERR_VALUE, "broadcast: root %d is not a rank of %d", root, world.size);
  /* Through a buffer of our own: a broadcast cannot be cancelled, so when one
   * fails part way its buffer may still be written by a late root, and it is
   * left allocated (the job is out of step and about to end) instead of the
   * caller's being freed under MPI's feet. */
  char *own = malloc((size_t)bytes);
  if (!own) return DP_FAIL(DP_ERR_MEMORY, "broadcast: %lld bytes", (long long)bytes);
  if (world.rank == root) memcpy(own, buf, (size_t)bytes);
  dp_status st = DP_OK;
  for (int64_t at = 0; at < bytes && st == DP_OK; at += MAX_MESSAGE) {
    const int len = (int)(bytes - at < MAX_MESSAGE ? bytes - at : MAX_MESSAGE);
    MPI_Request req;
    pthread_mutex_lock(&mpi_lock);
    const int rc = MPI_Ibcast(own + at, len, MPI_BYTE, root, comm_ctl, &req);
    pthread_mutex_unlock(&mpi_lock);
    st = mpi_call(rc, "MPI_Ibcast", what);
    /* a broadcast has no single peer to name: the root, as seen by the others */
    const int peer = root;
    if (st == DP_OK) st = wait_requests(&req, &peer, NULL, 1, timeout, what);
  }
  if (st != DP_OK) return st; /* own stays allocated: see above */
  memcpy(buf, own, (size_t)bytes);
  free(own);
  return DP_OK;
}

dp_status dp_dist_allgather(const void *mine, int64_t bytes, void *all, double timeout, const char *what) {
  DP_TRY(usable());
  if (bytes < 0 || bytes > MAX_MESSAGE) return DP_FAIL(DP_ERR_VALUE, "allgather: %lld bytes", (long long)bytes);
  memcpy((char *)all + (size_t)world.rank * (size_t)bytes, mine, (size_t)bytes);
  if (world.size == 1) return DP_OK;
  const int n = 2 * (world.size - 1);
  MPI_Request *reqs = malloc(sizeof *reqs * (size_t)n);
  int *peers = malloc(sizeof *peers * (size_t)n);
  unsigned char *recv = malloc((size_t)n);
  if (!reqs || !peers || !recv) {
    free(reqs);
    free(peers);
    free(recv);
    return DP_FAIL(DP_ERR_MEMORY, "allgather: %d requests", n);
  }
  int m = 0, rc = MPI_SUCCESS;
  pthread_mutex_lock(&mpi_lock);
  for (int q = 0; q < world.size && rc == MPI_SUCCESS; ++q) {
    if (q == world.rank) continue;
    rc = MPI_Irecv((char *)all + (size_t)q * (size_t)bytes, (int)bytes, MPI_BYTE, q, TAG_GATHER, comm_ctl, &reqs[m]);
    recv[m] = 1;
    peers[m++] = q;
    if (rc == MPI_SUCCESS) rc = MPI_Isend(mine, (int)bytes, MPI_BYTE, q, TAG_GATHER, comm_ctl, &reqs[m]);
    recv[m] = 0;
    peers[m++] = q;
  }
  pthread_mutex_unlock(&mpi_lock);
  dp_status st = mpi_call(rc, "MPI_Isend/MPI_Irecv", what);
  if (st == DP_OK) st = wait_requests(reqs, peers, recv, m, timeout, what);
  free(reqs);
  free(peers);
  free(recv);
  return st;
}

dp_status dp_dist_barrier(double timeout, const char *what) {
  if (world.size == 1) return DP_OK;
  char mine = 1;
  char *all = malloc((size_t)world.size);
  if (!all) return DP_FAIL(DP_ERR_MEMORY, "barrier: %d bytes", world.size);
  const dp_status st = dp_dist_allgather(&mine, 1, all, timeout, what);
  free(all);
  return st;
}

/* ---- the rank-ordered chain ------------------------------------------------------ */

/* A chain's sends: every one stays in flight until chain_sends_done, never
 * waited for one at a time. A process that waited for its oldest send before
 * posting the next receive could deadlock the chain: with rendezvous
 * messages, the last process's first send back completes only when the first
 * process, still sending forward, posts its receives for the way back. */
struct dp_dist_channel {
  MPI_Comm comm;
};

dp_status dp_dist_channel_open(double timeout, dp_dist_channel **out) {
  *out = NULL;
  DP_TRY(usable());
  dp_dist_channel *ch = calloc(1, sizeof *ch);
  if (!ch) return DP_FAIL(DP_ERR_MEMORY, "MPI: cannot allocate a channel");
  ch->comm = MPI_COMM_NULL;
  if (world.size > 1) {
    MPI_Request req;
    const int peer = -1;
    pthread_mutex_lock(&mpi_lock);
    const int rc = MPI_Comm_idup(MPI_COMM_WORLD, &ch->comm, &req);
    pthread_mutex_unlock(&mpi_lock);
    dp_status st = mpi_call(rc, "MPI_Comm_idup", "opening a channel");
    if (st == DP_OK) st = wait_requests(&req, &peer, NULL, 1, timeout, "opening a channel (MPI_Comm_idup)");
    if (st != DP_OK) {
      free(ch);
      return st;
    }
    pthread_mutex_lock(&mpi_lock);
    MPI_Comm_set_errhandler(ch->comm, MPI_ERRORS_RETURN);
    pthread_mutex_unlock(&mpi_lock);
  }
  *out = ch;
  return DP_OK;
}

void dp_dist_channel_close(dp_dist_channel *ch) {
  if (!ch) return;
  int down = 0;
  MPI_Finalized(&down);
  if (!down && ch->comm != MPI_COMM_NULL) {
    pthread_mutex_lock(&mpi_lock);
    MPI_Comm_free(&ch->comm);
    pthread_mutex_unlock(&mpi_lock);
  }
  free(ch);
}

typedef struct chain {
  MPI_Comm comm;
  MPI_Request recv[2]; /* the receives posted (two segments ahead, or one on the way back) */
  MPI_Request *send;
  int *send_peer;
  int nsent, capacity;
  double timeout;
  const char *what;
  const _Atomic int *abandon;
} chain;

static dp_status chain_wait(chain *c, MPI_Request *reqs, const int *peers, const unsigned char *recv, int n) {
  return wait_requests_abandonable(reqs, peers, recv, n, c->timeout, c->what, c->abandon);
}

/* Sends len floats at p to peer. */
static dp_status chain_send(chain *c, const float *p, int64_t len, int peer, int tag) {
  if (c->nsent == c->capacity) return DP_FAIL(DP_ERR_RUNTIME, "chain all-reduce: more sends than segments");
  pthread_mutex_lock(&mpi_lock);
  const int rc = MPI_Isend(p, (int)len, MPI_FLOAT, peer, tag, c->comm, &c->send[c->nsent]);
  pthread_mutex_unlock(&mpi_lock);
  c->send_peer[c->nsent++] = peer;
  return mpi_call(rc, "MPI_Isend", c->what);
}

static dp_status chain_sends_done(chain *c) {
  const dp_status st = c->nsent ? chain_wait(c, c->send, c->send_peer, NULL, c->nsent) : DP_OK;
  c->nsent = 0;
  return st;
}

static dp_status chain_recv(chain *c, float *p, int64_t len, int peer, int tag, MPI_Request *req) {
  pthread_mutex_lock(&mpi_lock);
  const int rc = MPI_Irecv(p, (int)len, MPI_FLOAT, peer, tag, c->comm, req);
  pthread_mutex_unlock(&mpi_lock);
  return mpi_call(rc, "MPI_Irecv", c->what);
}

/* Segment [lo, lo + len) of this process's part of the sum: the running sum
 * `in` of the earlier processes (NULL on the first) plus replicas 0..k-1 in
 * order, left in bufs[0]; the last process scales it and copies it to every
 * replica. Each pass is one vector loop; each element sees the same
 * additions in the same order as collective.c's. */
static void chain_add(float *const *bufs, int k, int64_t lo, int64_t len, const float *in, int last, float scale) {
  float *b0 = bufs[0] + lo;
  if (in) {
#pragma omp simd
    for (int64_t i = 0; i < len; ++i) b0[i] = in[i] + b0[i];
  }
  for (int r = 1; r < k; ++r) {
    const float *src = bufs[r] + lo;
#pragma omp simd
    for (int64_t i = 0; i < len; ++i) b0[i] += src[i];
  }
  if (!last) return;
#pragma omp simd
  for (int64_t i = 0; i < len; ++i) b0[i] *= scale;
  for (int r = 1; r < k; ++r) memcpy(bufs[r] + lo, b0, sizeof(float) * (size_t)len);
}

static dp_status chain_run(chain *c, float *const *bufs, int k, int64_t n, float scale, float *stage, int fwd,
                           int back) {
  const int P = world.size, p = world.rank, last = p == P - 1;
  const int64_t S = DP_DIST_SEGMENT, nseg = (n + S - 1) / S;
  MPI_Request *recv = c->recv;
  /* forward: the running sum from p - 1, plus ours, to p + 1 (the last
   * process: scaled, and sent back to p - 1) */
  if (p > 0)
    for (int64_t s = 0; s < nseg && s < 2; ++s)
      DP_TRY(chain_recv(c, stage + (s % 2) * S, n - s * S < S ? n - s * S : S, p - 1, fwd, &recv[s % 2]));
  for (int64_t s = 0; s < nseg; ++s) {
    const int64_t lo = s * S, len = n - lo < S ? n - lo : S;
    float *in = NULL;
    if (p > 0) {
      const int from = p - 1;
      DP_TRY(chain_wait(c, &recv[s % 2], &from, (const unsigned char[]){1}, 1));
      in = stage + (s % 2) * S;
    }
    chain_add(bufs, k, lo, len, in, last, scale);
    if (p > 0 && s + 2 < nseg) {
      const int64_t lo2 = (s + 2) * S;
      DP_TRY(chain_recv(c, stage + (s % 2) * S, n - lo2 < S ? n - lo2 : S, p - 1, fwd, &recv[s % 2]));
    }
    DP_TRY(chain_send(c, bufs[0] + lo, len, last ? p - 1 : p + 1, last ? back : fwd));
  }
  DP_TRY(chain_sends_done(c)); /* bufs[0] is ours again */
  if (last) return DP_OK;
  /* back: the result from p + 1, to p - 1 and every local replica */
  for (int64_t s = 0; s < nseg; ++s) {
    const int64_t lo = s * S, len = n - lo < S ? n - lo : S;
    const int from = p + 1;
    DP_TRY(chain_recv(c, bufs[0] + lo, len, from, back, &recv[0]));
    DP_TRY(chain_wait(c, &recv[0], &from, (const unsigned char[]){1}, 1));
    if (p > 0) DP_TRY(chain_send(c, bufs[0] + lo, len, p - 1, back));
    for (int r = 1; r < k; ++r) memcpy(bufs[r] + lo, bufs[0] + lo, sizeof(float) * (size_t)len);
  }
  return chain_sends_done(c);
}

dp_status dp_dist_chain_allreduce(float *const *bufs, int k, int64_t n, float scale, int tag, float *stage,
                                  double timeout, const char *what) {
  return dp_dist_chain_allreduce_on(NULL, bufs, k, n, scale, tag, stage, timeout, what, NULL);
}

dp_status dp_dist_chain_allreduce_on(const dp_dist_channel *ch, float *const *bufs, int k, int64_t n, float scale,
                                     int tag, float *stage, double timeout, const char *what,
                                     const _Atomic int *abandon) {
  DP_TRY(usable());
  if (n <= 0 || k < 1) return DP_OK;
  if (tag < 0 || tag >= DP_DIST_MAX_TAG) return DP_FAIL(DP_ERR_VALUE, "chain all-reduce: tag %d", tag);
  const int64_t S = DP_DIST_SEGMENT, nseg = (n + S - 1) / S;
  if (world.size == 1) {
    for (int64_t s = 0; s < nseg; ++s) chain_add(bufs, k, s * S, n - s * S < S ? n - s * S : S, NULL, 1, scale);
    return DP_OK;
  }
  const int fwd = TAG_CHAIN_BASE + 2 * tag, back = fwd + 1;
  chain c = {.comm = ch ? ch->comm : comm_data, .timeout = timeout, .what = what, .abandon = abandon,
             .capacity = (int)nseg};
  c.send = malloc(sizeof *c.send * (size_t)nseg);
  c.send_peer = malloc(sizeof *c.send_peer * (size_t)nseg);
  c.recv[0] = c.recv[1] = MPI_REQUEST_NULL;
  dp_status st = c.send && c.send_peer ? chain_run(&c, bufs, k, n, scale, stage, fwd, back)
                                       : DP_FAIL(DP_ERR_MEMORY, "chain all-reduce: %lld requests", (long long)nseg);
  /* a chain that failed part way may leave a receive posted into stage or
   * bufs[0], which the caller may free: cancelled, as wait_requests does */
  if (st != DP_OK) cancel_receives(c.recv, (const unsigned char[]){1, 1}, 2);
  free(c.send);
  free(c.send_peer);
  return st;
}

/* ---- the owner-computes all-reduce ----------------------------------------------- */

#define OWNER_CHUNK ((int64_t)1 << 16) /* floats a message carries, so that adding overlaps sending */

typedef struct owner_reqs {
  MPI_Request *req;
  int *peer;
  unsigned char *recv;
  int n, cap;
} owner_reqs;

static dp_status owner_post(owner_reqs *r, int is_send, float *p, int64_t len, int peer, int tag, MPI_Comm comm,
                            const char *what) {
  if (r->n == r->cap) return DP_FAIL(DP_ERR_RUNTIME, "%s: request table full", what);
  pthread_mutex_lock(&mpi_lock);
  const int rc = is_send ? MPI_Isend(p, (int)len, MPI_FLOAT, peer, tag, comm, &r->req[r->n])
                         : MPI_Irecv(p, (int)len, MPI_FLOAT, peer, tag, comm, &r->req[r->n]);
  pthread_mutex_unlock(&mpi_lock);
  r->peer[r->n] = peer, r->recv[r->n] = (unsigned char)!is_send;
  DP_TRY(mpi_call(rc, is_send ? "MPI_Isend" : "MPI_Irecv", what));
  r->n++;
  return DP_OK;
}

static int64_t owner_lo(int64_t n, int q, int P) { return n * q / P; }

dp_status dp_dist_owner_allreduce_on(const dp_dist_channel *ch, float *const *bufs, int k, const int *ks, int64_t n,
                                     float scale, int tag, double timeout, const char *what,
                                     const _Atomic int *abandon) {
  DP_TRY(usable());
  if (n <= 0 || k < 1) return DP_OK;
  if (tag < 0 || tag >= DP_DIST_MAX_TAG) return DP_FAIL(DP_ERR_VALUE, "owner all-reduce: tag %d", tag);
  const int P = world.size, me = world.rank;
  if (P == 1) {
    for (int64_t lo = 0; lo < n; lo += DP_DIST_SEGMENT)
      chain_add(bufs, k, lo, n - lo < DP_DIST_SEGMENT ? n - lo : DP_DIST_SEGMENT, NULL, 1, scale);
    return DP_OK;
  }
  if (ks[me] != k) return DP_FAIL(DP_ERR_VALUE, "owner all-reduce: ks[%d] = %d, but this process has %d", me, ks[me], k);
  int R = 0, first = 0; /* replicas in all; this process's first, in the global order */
  for (int q = 0; q < P; ++q) {
    if (ks[q] < 1) return DP_FAIL(DP_ERR_VALUE, "owner all-reduce: process %d has %d replicas", q, ks[q]);
    if (q == me) first = R;
    R += ks[q];
  }
  const MPI_Comm comm = ch ? ch->comm : comm_data;
  const int t1 = TAG_CHAIN_BASE + 2 * DP_DIST_MAX_TAG + 2 * tag, t2 = t1 + 1;
  const int64_t L = owner_lo(n, me, P), len = owner_lo(n, me + 1, P) - L;
  const int64_t nc = (len + OWNER_CHUNK - 1) / OWNER_CHUNK;
  int64_t others_chunks = 0; /* chunks of the other processes' segments */
  for (int q = 0; q < P; ++q)
    if (q != me)
      others_chunks += (owner_lo(n, q + 1, P) - owner_lo(n, q, P) + OWNER_CHUNK - 1) / OWNER_CHUNK;
  const int64_t nreq = nc * (R - k) + others_chunks * k + nc * (P - 1) + others_chunks;
  if (nreq > INT_MAX / 2) return DP_FAIL(DP_ERR_VALUE, "owner all-reduce: %lld messages", (long long)nreq);
  owner_reqs r = {malloc(sizeof(MPI_Request) * (size_t)nreq), malloc(sizeof(int) * (size_t)nreq),
                  malloc((size_t)nreq), 0, (int)nreq};
  float *stage = malloc(sizeof(float) * (size_t)((R - k) * len + OWNER_CHUNK)); /* others' slices, then acc */
  dp_status st = r.req && r.peer && r.recv && stage ? DP_OK
                                                    : DP_FAIL(DP_ERR_MEMORY, "owner all-reduce: staging %lld floats",
                                                              (long long)((R - k) * len));
  float *acc = stage ? stage + (R - k) * len : NULL;
  /* phase 1: every other process's replicas' slices of my segment, chunk by chunk, in global
   * replica order (stage row j: the j-th replica that is not mine); my replicas' slices of
   * every other segment to its owner */
  for (int64_t c = 0; c < nc && st == DP_OK; ++c) {
    const int64_t lo = c * OWNER_CHUNK, cl = len - lo < OWNER_CHUNK ? len - lo : OWNER_CHUNK;
    for (int q = 0, j = 0; q < P && st == DP_OK; ++q)
      for (int i = 0; i < ks[q] && q != me && st == DP_OK; ++i, ++j)
        st = owner_post(&r, 0, stage + j * len + lo, cl, q, t1, comm, what);
  }
  const int phase1_recvs = r.n;
  for (int q = 0; q < P && st == DP_OK; ++q) {
    if (q == me) continue;
    const int64_t qL = owner_lo(n, q, P), qlen = owner_lo(n, q + 1, P) - qL;
    for (int64_t lo = 0; lo < qlen && st == DP_OK; lo += OWNER_CHUNK)
      for (int i = 0; i < k && st == DP_OK; ++i)
        st = owner_post(&r, 1, bufs[i] + qL + lo, qlen - lo < OWNER_CHUNK ? qlen - lo : OWNER_CHUNK, q, t1, comm, what);
  }
  const int phase1_end = r.n;
  /* my segment, chunk by chunk as its slices arrive: the sum in global replica order (as
   * collective.c and the chain add), scaled, to every local replica and every other process */
  for (int64_t c = 0; c < nc && st == DP_OK; ++c) {
    const int64_t lo = c * OWNER_CHUNK, cl = len - lo < OWNER_CHUNK ? len - lo : OWNER_CHUNK;
    const int per = R - k;
    st = wait_requests_abandonable(r.req + c * per, r.peer + c * per, r.recv + c * per, per, timeout, what, abandon);
    for (int g = 0; g < R && st == DP_OK; ++g) {
      const int j = g < first ? g : g - k; /* row of a replica that is not mine */
      const float *src = g >= first && g < first + k ? bufs[g - first] + L + lo : stage + j * len + lo;
      if (g == 0) {
        memcpy(acc, src, sizeof(float) * (size_t)cl);
      } else {
#pragma omp simd
        for (int64_t i = 0; i < cl; ++i) acc[i] += src[i];
      }
    }
    if (st != DP_OK) break;
#pragma omp simd
    for (int64_t i = 0; i < cl; ++i) acc[i] *= scale;
    for (int i = 0; i < k; ++i) memcpy(bufs[i] + L + lo, acc, sizeof(float) * (size_t)cl);
    for (int q = 0; q < P && st == DP_OK; ++q)
      if (q != me) st = owner_post(&r, 1, bufs[0] + L + lo, cl, q, t2, comm, what);
  }
  /* phase 2: my slices of the other segments have left (their buffers are read), so the
   * owners' results may land there */
  if (st == DP_OK)
    st = wait_requests_abandonable(r.req + phase1_recvs, r.peer + phase1_recvs, r.recv + phase1_recvs,
                                   phase1_end - phase1_recvs, timeout, what, abandon);
  for (int q = 0; q < P && st == DP_OK; ++q) {
    if (q == me) continue;
    const int64_t qL = owner_lo(n, q, P), qlen = owner_lo(n, q + 1, P) - qL;
    for (int64_t lo = 0; lo < qlen && st == DP_OK; lo += OWNER_CHUNK)
      st = owner_post(&r, 0, bufs[0] + qL + lo, qlen - lo < OWNER_CHUNK ? qlen - lo : OWNER_CHUNK, q, t2, comm, what);
  }
  if (st == DP_OK)
    st = wait_requests_abandonable(r.req + phase1_end, r.peer + phase1_end, r.recv + phase1_end, r.n - phase1_end,
                                   timeout, what, abandon);
  if (st == DP_OK)
    for (int q = 0; q < P; ++q) {
      if (q == me) continue;
      const int64_t qL = owner_lo(n, q, P), qlen = owner_lo(n, q + 1, P) - qL;
      for (int i = 1; i < k; ++i) memcpy(bufs[i] + qL, bufs[0] + qL, sizeof(float) * (size_t)qlen);
    }
  if (st != DP_OK && r.req) cancel_receives(r.req, r.recv, r.n); /* none may land in memory we return */
  free(r.req), free(r.peer), free(r.recv), free(stage);
  return st;
}

/* ---- point to point ------------------------------------------------------------- */

/* Per (peer, user tag): the next sequence number of a send to / a receive
 * from that peer, taken in program order by dp_dist_p2p_next_seq. The MPI tag
 * of a message carries (user tag, sequence mod DP_DIST_P2P_SLOTS, phase), so
 * operations in flight at once on several threads still pair the k-th send
 * with the k-th receive. */
static int64_t *p2p_seq; /* [2][size][DP_DIST_P2P_TAGS]: the next sequence number */
static int *p2p_busy;    /* the same shape: operations taken and not yet finished */
static pthread_mutex_t p2p_lock = PTHREAD_MUTEX_INITIALIZER;

enum { P2P_DESC, P2P_ANSWER, P2P_DATA, P2P_PHASES };
/* Bytes a data message carries at most (MPI counts are ints). */
#define P2P_CHUNK ((int64_t)1 << 30)

static int p2p_tag(int tag, int64_t seq, int phase) {
  return ((tag * DP_DIST_P2P_SLOTS) + (int)(seq % DP_DIST_P2P_SLOTS)) * P2P_PHASES + phase;
}

static dp_status p2p_check(int peer, int tag, const char *verb) {
  DP_TRY(usable());
  if (peer < 0 || peer >= world.size)
    return DP_FAIL(DP_ERR_VALUE, "%s: rank %d is not a rank of this job (0..%d)", verb, peer, world.size - 1);
  if (peer == world.rank)
    return DP_FAIL(DP_ERR_VALUE, "%s: rank %d cannot %s itself", verb, peer,
                   strcmp(verb, "send") == 0 ? "send to" : "receive from");
  if (tag < 0 || tag >= DP_DIST_P2P_TAGS)
    return DP_FAIL(DP_ERR_VALUE, "%s: tag %d is not in [0, %d)", verb, tag, DP_DIST_P2P_TAGS);
  return DP_OK;
}

dp_status dp_dist_p2p_next_seq(int is_send, int peer, int tag, int64_t *seq) {
  DP_TRY(p2p_check(peer, tag, is_send ? "send" : "recv"));
  const size_t n = (size_t)2 * (size_t)world.size * DP_DIST_P2P_TAGS;
  const size_t at = ((size_t)(is_send ? 1 : 0) * (size_t)world.size + (size_t)peer) * DP_DIST_P2P_TAGS + (size_t)tag;
  dp_status st = DP_OK;
  pthread_mutex_lock(&p2p_lock);
  if (!p2p_seq) p2p_seq = calloc(n, sizeof *p2p_seq);
  if (!p2p_busy) p2p_busy = calloc(n, sizeof *p2p_busy);
  if (!p2p_seq || !p2p_busy)
    st = DP_FAIL(DP_ERR_MEMORY, "point to point: cannot allocate the sequence numbers");
  else if (p2p_busy[at] >= DP_DIST_P2P_SLOTS) /* their tags would repeat: messages could pair wrongly */
    st = DP_FAIL(DP_ERR_VALUE, "%s: %d operations with rank %d on tag %d are in flight already, the most there may be; "
                 "wait() for some first", is_send ? "isend" : "irecv", p2p_busy[at], peer, tag);
  else
    *seq = p2p_seq[at]++, p2p_busy[at]++;
  pthread_mutex_unlock(&p2p_lock);
  return st;
}

/* The operation taken by dp_dist_p2p_next_seq is over (done or failed). */
static void p2p_finished(int is_send, int peer, int tag) {
  pthread_mutex_lock(&p2p_lock);
  if (p2p_busy && peer >= 0 && peer < world.size && tag >= 0 && tag < DP_DIST_P2P_TAGS) {
    int *b = &p2p_busy[((size_t)(is_send ? 1 : 0) * (size_t)world.size + (size_t)peer) * DP_DIST_P2P_TAGS +
                       (size_t)tag];
    if (*b > 0) --*b;
  }
  pthread_mutex_unlock(&p2p_lock);
}

/* "float32[2, 3] on cpu" */
static void desc_text(const dp_dist_desc *d, char *out, size_t size) {
  static const char *const types[] = {"float32", "float64", "int32", "int64", "uint8"};
  const char *t = d->dtype >= 0 && d->dtype < 5 ? types[d->dtype] : "?";
  size_t used = (size_t)snprintf(out, size, "%s[", t);
  for (int i = 0; i < d->ndim && i < DP_DIST_MAX_DIMS && used < size; ++i)
    used += (size_t)snprintf(out + used, size - used, "%s%lld", i ? ", " : "", (long long)d->shape[i]);
  if (used < size) snprintf(out + used, size - used, "] in %s memory", d->device == 0 ? "host" : "GPU");
}

static int64_t desc_bytes(const dp_dist_desc *d) {
  static const int sizes[] = {4, 8, 4, 8, 1};
  int64_t n = d->dtype >= 0 && d->dtype < 5 ? sizes[d->dtype] : 0;
  for (int i = 0; i < d->ndim; ++i) n *= d->shape[i];
  return n;
}

static int desc_same(const dp_dist_desc *a, const dp_dist_desc *b) {
  if (a->dtype != b->dtype || a->device != b->device || a->ndim != b->ndim) return 0;
  for (int i = 0; i < a->ndim; ++i)
    if (a->shape[i] != b->shape[i]) return 0;
  return 1;
}

static dp_status p2p_desc_valid(const dp_dist_desc *d, const char *verb) {
  if (d->ndim < 0 || d->ndim > DP_DIST_MAX_DIMS || d->dtype < 0 || d->dtype > 4 || d->device < 0 || d->device > 1)
    return DP_FAIL(DP_ERR_VALUE, "%s: a tensor of %d dimensions, dtype code %d", verb, d->ndim, d->dtype);
  for (int i = 0; i < d->ndim; ++i)
    if (d->shape[i] < 0) return DP_FAIL(DP_ERR_VALUE, "%s: a negative dimension", verb);
  return DP_OK;
}

/* The bytes of one message, in chunks of at most P2P_CHUNK, all posted then waited for. */
static dp_status p2p_data(int is_send, void *buf, int64_t bytes, int peer, int mtag, double timeout,
                          const char *what) {
  const int64_t nchunks = bytes == 0 ? 0 : (bytes + P2P_CHUNK - 1) / P2P_CHUNK;
  if (nchunks == 0) return DP_OK;
  MPI_Request *reqs = malloc(sizeof *reqs * (size_t)nchunks);
  int *peers = malloc(sizeof *peers * (size_t)nchunks);
  unsigned char *recv = malloc((size_t)nchunks);
  if (!reqs || !peers || !recv) {
    free(reqs), free(peers), free(recv);
    return DP_FAIL(DP_ERR_MEMORY, "%s: %lld requests", what, (long long)nchunks);
  }
  int rc = MPI_SUCCESS;
  int64_t c = 0;
  pthread_mutex_lock(&mpi_lock);
  for (; c < nchunks && rc == MPI_SUCCESS; ++c) {
    const int64_t off = c * P2P_CHUNK, len = bytes - off < P2P_CHUNK ? bytes - off : P2P_CHUNK;
    peers[c] = peer, recv[c] = (unsigned char)!is_send;
    rc = is_send ? MPI_Isend((char *)buf + off, (int)len, MPI_BYTE, peer, mtag, comm_p2p, &reqs[c])
                 : MPI_Irecv((char *)buf + off, (int)len, MPI_BYTE, peer, mtag, comm_p2p, &reqs[c]);
  }
  pthread_mutex_unlock(&mpi_lock);
  dp_status st = mpi_call(rc, is_send ? "MPI_Isend" : "MPI_Irecv", what);
  if (st != DP_OK) c -= 1; /* the failed one posted nothing */
  dp_status waited = wait_requests(reqs, peers, recv, (int)c, timeout, what);
  if (st == DP_OK) st = waited;
  free(reqs), free(peers), free(recv);
  return st;
}

/* The answer a receiver sends back: ANSWER_TAKE and its description when it takes the message. */
typedef struct p2p_answer {
  int64_t refuse;
  dp_dist_desc want;
} p2p_answer;
enum { ANSWER_TAKE, ANSWER_MISMATCH, ANSWER_SAME_GPU };

/* The description (sender) or the expectation (receiver) and the answer: DP_OK when the receiver takes the
 * message, *peer_desc then the peer's side (for the sender: the receiver's expectation, its GPU). */
static dp_status handshake(int is_send, const dp_dist_desc *desc, int peer, int tag, int64_t seq, double timeout,
                           const char *what, dp_dist_desc *peer_desc) {
  DP_TRY(p2p_check(peer, tag, is_send ? "send" : "recv"));
  DP_TRY(p2p_desc_valid(desc, is_send ? "send" : "recv"));
  p2p_answer answer;
  memset(&answer, 0, sizeof answer);
  if (is_send) {
    MPI_Request reqs[2];
    const int peers[2] = {peer, peer};
    const unsigned char recv[2] = {0, 1};
    pthread_mutex_lock(&mpi_lock);
    int rc = MPI_Isend(desc, (int)sizeof *desc, MPI_BYTE, peer, p2p_tag(tag, seq, P2P_DESC), comm_p2p, &reqs[0]);
    if (rc == MPI_SUCCESS)
      rc = MPI_Irecv(&answer, (int)sizeof answer, MPI_BYTE, peer, p2p_tag(tag, seq, P2P_ANSWER), comm_p2p, &reqs[1]);
    else
      reqs[1] = MPI_REQUEST_NULL;
    pthread_mutex_unlock(&mpi_lock);
    DP_TRY(mpi_call(rc, "MPI_Isend", what));
    DP_TRY(wait_requests(reqs, peers, recv, 2, timeout, what));
    *peer_desc = answer.want;
  } else {
    dp_dist_desc got;
    MPI_Request req;
    const unsigned char recv = 1;
    pthread_mutex_lock(&mpi_lock);
    int rc = MPI_Irecv(&got, (int)sizeof got, MPI_BYTE, peer, p2p_tag(tag, seq, P2P_DESC), comm_p2p, &req);
    pthread_mutex_unlock(&mpi_lock);
    DP_TRY(mpi_call(rc, "MPI_Irecv", what));
    DP_TRY(wait_requests(&req, &peer, &recv, 1, timeout, what));
    /* NCCL refuses two ranks on one GPU: said here, before either side makes a communicator */
    answer.refuse = !desc_same(&got, desc)                                                   ? ANSWER_MISMATCH
                    : got.device == 1 && got.gpu_uid != 0 && got.gpu_uid == desc->gpu_uid ? ANSWER_SAME_GPU
                                                                                            : ANSWER_TAKE;
    answer.want = *desc;
    pthread_mutex_lock(&mpi_lock);
    rc = MPI_Isend(&answer, (int)sizeof answer, MPI_BYTE, peer, p2p_tag(tag, seq, P2P_ANSWER), comm_p2p, &req);
    pthread_mutex_unlock(&mpi_lock);
    DP_TRY(mpi_call(rc, "MPI_Isend", what));
    DP_TRY(wait_requests(&req, &peer, NULL, 1, timeout, what));
    *peer_desc = got;
  }
  if (answer.refuse == ANSWER_TAKE) return DP_OK;
  char mine[160], theirs[160];
  desc_text(desc, mine, sizeof mine);
  desc_text(peer_desc, theirs, sizeof theirs);
  if (answer.refuse == ANSWER_SAME_GPU)
    return DP_FAIL(DP_ERR_DIST, "rank %d: %s: rank %d %s the same physical GPU (GPU %d there, GPU %d here) that this "
                   "rank %s; NCCL refuses two ranks on one GPU: give each process a GPU of its own "
                   "(cuda:local_rank), or copy to the host first (tag %d); nothing was %s",
                   world.rank, what, peer, is_send ? "receives into" : "sends from", peer_desc->gpu, desc->gpu,
                   is_send ? "sends from" : "receives into", tag, is_send ? "sent" : "received");
  if (is_send)
    return DP_FAIL(DP_ERR_DIST, "rank %d: %s: rank %d expects %s, this rank sends %s (tag %d); nothing was sent",
                   world.rank, what, peer, theirs, mine, tag);
  return DP_FAIL(DP_ERR_DIST, "rank %d: %s: rank %d sends %s, this rank expects %s (tag %d); nothing was received",
                 world.rank, what, peer, theirs, mine, tag);
}

/* "rank 3: " before a message of dist_nccl.c, which does not know the ranks; the job out of step. */
static dp_status nccl_failed(dp_status st) {
  char text[sizeof broken];
  snprintf(text, sizeof text, "%s", dp_error_message());
  return mark_broken(DP_FAIL(st, "rank %d: %s", world.rank, text));
}

/* A GPU message's bytes, after the handshake: the ticket from the pair's lower rank over MPI (in the data
 * phase's tag, which GPU messages leave unused; sender or receiver, whichever is lower), then NCCL. Both sides
 * fail when the lower rank cannot start NCCL. */
static dp_status gpu_data(int is_send, void *buf, const dp_dist_desc *mine, const dp_dist_desc *theirs, int peer,
                          int mtag, void *stream, double timeout, const char *what) {
  const int64_t bytes = desc_bytes(mine);
  if (bytes == 0) return DP_OK;
  const int lower = world.rank < peer;
  dp_nccl_ticket t;
  dp_status st = DP_OK;
  if (lower) st = dp_nccl_p2p_ticket(peer, mine->gpu, theirs->gpu, &t);
  MPI_Request req;
  const unsigned char recv = (unsigned char)!lower;
  pthread_mutex_lock(&mpi_lock);
  const int rc = lower ? MPI_Isend(&t, (int)sizeof t, MPI_BYTE, peer, mtag, comm_p2p, &req)
                       : MPI_Irecv(&t, (int)sizeof t, MPI_BYTE, peer, mtag, comm_p2p, &req);
  pthread_mutex_unlock(&mpi_lock);
  if (rc != MPI_SUCCESS) return mpi_call(rc, lower ? "MPI_Isend" : "MPI_Irecv", what);
  const dp_status sent = wait_requests(&req, &peer, &recv, 1, timeout, what);
  if (st != DP_OK) return st; /* the higher rank has the reason in t.why */
  DP_TRY(sent);
  if (t.generation < 0) {
    t.why[sizeof t.why - 1] = '\0'; /* another process's bytes: terminated here whatever they hold */
    return DP_FAIL(DP_ERR_DIST, "rank %d: %s: rank %d could not start NCCL (%s); nothing was %s", world.rank, what,
                   peer, t.why, is_send ? "sent" : "received");
  }
  st = dp_nccl_p2p_move(is_send, lower, peer, mine->gpu, &t, buf, bytes, stream, timeout, what);
  return st == DP_OK ? DP_OK : nccl_failed(st);
}

static dp_status p2p_message(int is_send, void *buf, const dp_dist_desc *desc, int peer, int tag, int64_t seq,
                             void *stream, double timeout, const char *what) {
  dp_dist_desc theirs;
  DP_TRY(handshake(is_send, desc, peer, tag, seq, timeout, what, &theirs));
  if (desc->device == 1) return gpu_data(is_send, buf, desc, &theirs, peer, p2p_tag(tag, seq, P2P_DATA), stream,
                                         timeout, what);
  return p2p_data(is_send, buf, desc_bytes(desc), peer, p2p_tag(tag, seq, P2P_DATA), timeout, what);
}

dp_status dp_dist_send_seq(const void *buf, const dp_dist_desc *desc, int dst, int tag, int64_t seq, void *stream,
                           double timeout, const char *what) {
  const dp_status st = p2p_message(1, (void *)buf, desc, dst, tag, seq, stream, timeout, what);
  p2p_finished(1, dst, tag);
  return st;
}

dp_status dp_dist_recv_seq(void *buf, const dp_dist_desc *expect, int src, int tag, int64_t seq, void *stream,
                           double timeout, const char *what) {
  const dp_status st = p2p_message(0, buf, expect, src, tag, seq, stream, timeout, what);
  p2p_finished(0, src, tag);
  return st;
}

dp_status dp_dist_p2p_handshake(int is_send, const dp_dist_desc *desc, int peer, int tag, int64_t seq,
                                double timeout, const char *what) {
  dp_dist_desc theirs;
  const dp_status st = handshake(is_send, desc, peer, tag, seq, timeout, what, &theirs);
  p2p_finished(is_send, peer, tag);
  return st;
}

#else /* !DP_HAVE_MPI: every process is a world of one */

int dp_dist_built(void) { return 0; }
const char *dp_dist_library_version(void) { return ""; }
int dp_dist_cuda_aware(void) { return -1; }

dp_status dp_dist_init(dp_dist_info *out) {
  pthread_mutex_lock(&init_lock);
  world.launched = launched_by_mpirun();
  if (out) *out = world;
  pthread_mutex_unlock(&init_lock);
  return DP_OK;
}

dp_status dp_dist_finalize(void) { return DP_OK; }
void dp_dist_abort(int code) { (void)code; }
int dp_dist_is_broken(void) { return 0; }

dp_status dp_dist_bcast(void *buf, int64_t bytes, int root, double timeout, const char *what) {
  if (root != 0) return DP_FAIL(DP_ERR_VALUE, "broadcast: root %d is not a rank of 1", root);
  return DP_OK;
}

dp_status dp_dist_allgather(const void *mine, int64_t bytes, void *all, double timeout, const char *what) {
  if (bytes < 0) return DP_FAIL(DP_ERR_VALUE, "allgather: %lld bytes", (long long)bytes);
  memcpy(all, mine, (size_t)bytes);
  return DP_OK;
}

dp_status dp_dist_barrier(double timeout, const char *what) { return DP_OK; }

dp_status dp_dist_chain_allreduce(float *const *bufs, int k, int64_t n, float scale, int tag, float *stage,
                                  double timeout, const char *what) {
  return dp_dist_chain_allreduce_on(NULL, bufs, k, n, scale, tag, stage, timeout, what, NULL);
}

struct dp_dist_channel {
  int unused;
};

dp_status dp_dist_channel_open(double timeout, dp_dist_channel **out) {
  *out = calloc(1, sizeof **out);
  return *out ? DP_OK : DP_FAIL(DP_ERR_MEMORY, "cannot allocate a channel");
}

void dp_dist_channel_close(dp_dist_channel *ch) { free(ch); }

dp_status dp_dist_chain_allreduce_on(const dp_dist_channel *ch, float *const *bufs, int k, int64_t n, float scale,
                                     int tag, float *stage, double timeout, const char *what,
                                     const _Atomic int *abandon) {
  return DP_FAIL(DP_ERR_UNSUPPORTED, "the all-reduce across processes needs MPI: dpcore was built without it");
}

dp_status dp_dist_owner_allreduce_on(const dp_dist_channel *ch, float *const *bufs, int k, const int *ks, int64_t n,
                                     float scale, int tag, double timeout, const char *what,
                                     const _Atomic int *abandon) {
  return DP_FAIL(DP_ERR_UNSUPPORTED, "the all-reduce across processes needs MPI: dpcore was built without it");
}

static dp_status p2p_alone(int peer, int tag, const char *verb) {
  if (tag < 0 || tag >= DP_DIST_P2P_TAGS)
    return DP_FAIL(DP_ERR_VALUE, "%s: tag %d is not in [0, %d)", verb, tag, DP_DIST_P2P_TAGS);
  if (peer == 0) return DP_FAIL(DP_ERR_VALUE, "%s: rank 0 cannot %s itself", verb,
                                verb[0] == 's' ? "send to" : "receive from");
  return DP_FAIL(DP_ERR_VALUE, "%s: rank %d is not a rank of this job (0..0)", verb, peer);
}

dp_status dp_dist_p2p_next_seq(int is_send, int peer, int tag, int64_t *seq) {
  *seq = 0;
  return p2p_alone(peer, tag, is_send ? "send" : "recv");
}

dp_status dp_dist_send_seq(const void *buf, const dp_dist_desc *desc, int dst, int tag, int64_t seq, void *stream,
                           double timeout, const char *what) {
  return p2p_alone(dst, tag, "send");
}

dp_status dp_dist_recv_seq(void *buf, const dp_dist_desc *expect, int src, int tag, int64_t seq, void *stream,
                           double timeout, const char *what) {
  return p2p_alone(src, tag, "recv");
}

dp_status dp_dist_p2p_handshake(int is_send, const dp_dist_desc *desc, int peer, int tag, int64_t seq,
                                double timeout, const char *what) {
  return p2p_alone(peer, tag, is_send ? "send" : "recv");
}

#endif
