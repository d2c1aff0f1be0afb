/* p2p_order.c — csrc/dist_nccl.c on the CPU: its CUDA and NCCL calls answered
 * by the fakes below (declared in tests/c/fake_cuda/, with the libraries'
 * names and signatures), so that what it decides itself is checked where no
 * GPU is (tests/test_sanitizers.py: under ASan + UBSan + LSan, and TSan):
 * - the messages of a pair are queued in ticket order whatever order their
 *   threads come in, both directions on one communicator;
 * - the non-blocking contract: no call on a communicator, and no event on its
 *   stream, while its last call is still ncclInProgress; blocking = 0, two
 *   ranks, the peer the communicator's other rank;
 * - the lower rank's tickets: one generation per peer and pair of GPUs;
 * - a turn that never comes, an asynchronous NCCL error and a message that
 *   never finishes are DP_ERR_DIST at the deadline, the communicator aborted,
 *   the pair's later messages refused at once;
 * - shutdown aborts and frees everything (no leak, no stream or event left).
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "check.h"
#include "dist_nccl.h"
#include "nccl.h"

/* ---- the fakes ------------------------------------------------------------------ */

struct fake_comm {
  int rank;
  int polls_left; /* > 0: its last call (init, send, receive) still in progress */
  ncclResult_t error;
  cudaStream_t stream;
  struct fake_comm *next;
};
struct fake_stream {
  int unused;
};
struct fake_event {
  int recorded;
};

static pthread_mutex_t fake_lock = PTHREAD_MUTEX_INITIALIZER;
static struct fake_comm *comms; /* the live ones */
static int comms_made, comms_live, streams_live, events_live, violations;
static ncclResult_t inject; /* the next queued call's communicator reports it */
static int events_hang;     /* cudaEventQuery never says done */
enum { MAX_QUEUED = 64 };
static const void *queued[MAX_QUEUED];
static int queued_n;

static void violation(const char *what) {
  fprintf(stderr, "p2p_order: contract broken: %s\n", what);
  violations++;
}

cudaError_t cudaSetDevice(int device) { return device >= 0 ? cudaSuccess : cudaErrorInvalidValue; }

cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *prop, int device) {
  memset(prop, 0, sizeof *prop);
  prop->uuid.bytes[0] = (char)(device + 1);
  return cudaSuccess;
}

/* A stream's or an event's memory, counted in *live (streams_live, events_live). */
static void *fake_new(size_t size, int *live) {
  void *p = calloc(1, size);
  pthread_mutex_lock(&fake_lock);
  *live += p != NULL;
  pthread_mutex_unlock(&fake_lock);
  return p;
}

static cudaError_t fake_delete(void *p, int *live) {
  free(p);
  pthread_mutex_lock(&fake_lock);
  *live -= 1;
  pthread_mutex_unlock(&fake_lock);
  return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *stream, unsigned int flags) {
  *stream = fake_new(sizeof **stream, &streams_live);
  return *stream ? cudaSuccess : cudaErrorInvalidValue;
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) { return fake_delete(stream, &streams_live); }

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags) {
  return stream && event ? cudaSuccess : cudaErrorInvalidValue;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *event, unsigned int flags) {
  *event = fake_new(sizeof **event, &events_live);
  return *event ? cudaSuccess : cudaErrorInvalidValue;
}

cudaError_t cudaEventDestroy(cudaEvent_t event) { return fake_delete(event, &events_live); }

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  pthread_mutex_lock(&fake_lock);
  for (struct fake_comm *c = comms; c; c = c->next)
    if (c->stream == stream && c->polls_left > 0) violation("an event on NCCL's stream before its call settled");
  event->recorded = 1;
  pthread_mutex_unlock(&fake_lock);
  return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t event) {
  pthread_mutex_lock(&fake_lock);
  const int done = event->recorded && !events_hang;
  pthread_mutex_unlock(&fake_lock);
  return done ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaGetLastError(void) { return cudaSuccess; }
const char *cudaGetErrorName(cudaError_t error) { return error ? "cudaErrorFake" : "cudaSuccess"; }
const char *cudaGetErrorString(cudaError_t error) { return error ? "a fake error" : "no error"; }

const char *ncclGetErrorString(ncclResult_t result) {
  return result == ncclRemoteError ? "remote process exited or there was a network error" : "a fake NCCL result";
}
const char *ncclGetLastError(ncclComm_t comm) { return ""; }

ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
  static int ids;
  memset(id, 0, sizeof *id);
  pthread_mutex_lock(&fake_lock);
  id->internal[0] = (char)++ids;
  pthread_mutex_unlock(&fake_lock);
  return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank, ncclConfig_t *config) {
  struct fake_comm *c = calloc(1, sizeof *c);
  if (!c) return ncclSystemError;
  c->rank = rank;
  c->polls_left = 3; /* initialising in the background */
  pthread_mutex_lock(&fake_lock);
  if (nranks != 2 || rank < 0 || rank > 1) violation("a pair's communicator has ranks 0 and 1 of 2");
  if (!config || config->blocking != 0) violation("communicators are non-blocking");
  c->next = comms;
  comms = c;
  comms_made++, comms_live++;
  pthread_mutex_unlock(&fake_lock);
  *comm = c;
  return ncclInProgress;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *state) {
  pthread_mutex_lock(&fake_lock);
  if (comm->polls_left > 0) {
    comm->polls_left--;
    *state = ncclInProgress;
  } else {
    *state = comm->error;
  }
  pthread_mutex_unlock(&fake_lock);
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  pthread_mutex_lock(&fake_lock);
  for (struct fake_comm **p = &comms; *p; p = &(*p)->next)
    if (*p == comm) {
      *p = comm->next;
      break;
    }
  comms_live--;
  pthread_mutex_unlock(&fake_lock);
  free(comm); /* a later use is ASan's to report */
  return ncclSuccess;
}

static ncclResult_t fake_queue(const void *buf, int peer, ncclComm_t comm, cudaStream_t stream) {
  pthread_mutex_lock(&fake_lock);
  if (comm->polls_left > 0) violation("a call on a communicator whose last call is still in progress");
  if (peer != 1 - comm->rank) violation("the peer is the communicator's other rank");
  if (queued_n < MAX_QUEUED) queued[queued_n++] = buf;
  comm->stream = stream;
  comm->polls_left = 2; /* queued in the background */
  if (inject != ncclSuccess) comm->error = inject, inject = ncclSuccess;
  pthread_mutex_unlock(&fake_lock);
  return ncclInProgress;
}

ncclResult_t ncclSend(const void *buf, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  return fake_queue(buf, peer, comm, stream);
}

ncclResult_t ncclRecv(void *buf, size_t count, ncclDataType_t type, int peer, ncclComm_t comm, cudaStream_t stream) {
  return fake_queue(buf, peer, comm, stream);
}

/* ---- the checks ------------------------------------------------------------------ */

static cudaStream_t device_stream; /* the tensor's device stream, as the binding passes it */

typedef struct message {
  dp_nccl_ticket t;
  int is_send, lower, peer;
  double delay, timeout;
  char buf[4];
  dp_status st;
  char error[512];
} message;

static void *message_run(void *p) {
  message *m = p;
  const struct timespec nap = {0, (long)(m->delay * 1e9)};
  nanosleep(&nap, NULL);
  m->st = dp_nccl_p2p_move(m->is_send, m->lower, m->peer, 0, &m->t, m->buf, (int64_t)sizeof m->buf, device_stream,
                           m->timeout, "a test message");
  snprintf(m->error, sizeof m->error, "%s", m->st == DP_OK ? "" : dp_error_message());
  return NULL;
}

static message ticketed(int64_t generation, int64_t ticket, int is_send, double timeout) {
  message m;
  memset(&m, 0, sizeof m);
  m.t.generation = generation, m.t.ticket = ticket;
  m.is_send = is_send, m.lower = 0, m.peer = 1, m.timeout = timeout;
  return m;
}

/* As the higher rank: eight messages of one generation, both directions, their threads started
 * in the reverse of their tickets' order: queued 0..7. */
static void check_ticket_order(void) {
  enum { N = 8 };
  message m[N];
  pthread_t th[N];
  for (int k = 0; k < N; ++k) {
    m[k] = ticketed(7, k, k % 2, 10.0);
    m[k].delay = 0.002 * (N - 1 - k);
  }
  pthread_mutex_lock(&fake_lock);
  const int before = queued_n, made = comms_made;
  pthread_mutex_unlock(&fake_lock);
  for (int k = N - 1; k >= 0; --k) CHECK(pthread_create(&th[k], NULL, message_run, &m[k]) == 0);
  for (int k = 0; k < N; ++k) pthread_join(th[k], NULL);
  for (int k = 0; k < N; ++k) {
    CHECK(m[k].st == DP_OK);
    if (m[k].st != DP_OK) fprintf(stderr, "message %d: %s\n", k, m[k].error);
  }
  pthread_mutex_lock(&fake_lock);
  CHECK(queued_n == before + N);
  for (int k = 0; k < N && before + k < MAX_QUEUED; ++k) CHECK(queued[before + k] == m[k].buf);
  CHECK(comms_made == made + 1); /* one communicator for the pair, both directions */
  pthread_mutex_unlock(&fake_lock);
}

/* As the lower rank: tickets numbered per peer and pair of GPUs, a new generation for another GPU. */
static void check_lower_rank_tickets(void) {
  dp_nccl_ticket a, b, c;
  CHECK(dp_nccl_p2p_ticket(3, 0, 1, &a) == DP_OK);
  CHECK(dp_nccl_p2p_ticket(3, 0, 1, &b) == DP_OK);
  CHECK(dp_nccl_p2p_ticket(3, 0, 2, &c) == DP_OK);
  CHECK(a.generation > 0 && b.generation == a.generation && a.ticket == 0 && b.ticket == 1);
  CHECK(c.generation != a.generation && c.ticket == 0);
  CHECK(memcmp(a.id, b.id, sizeof a.id) == 0 && memcmp(a.id, c.id, sizeof a.id) != 0);
  message m = ticketed(a.generation, 0, 1, 10.0);
  m.t = a, m.lower = 1, m.peer = 3;
  message_run(&m);
  CHECK(m.st == DP_OK);
  m.t = b, m.is_send = 0;
  message_run(&m);
  CHECK(m.st == DP_OK);
  m.t.generation = 999; /* the lower rank makes its entries with the tickets: none is a bug */
  message_run(&m);
  CHECK(m.st == DP_ERR_RUNTIME && strstr(m.error, "no communicator of generation 999"));
}

/* Message 0 of a generation never comes: message 1 gives up at its deadline, and message 2 is
 * refused at once. */
static void check_missed_turn(void) {
  message m = ticketed(8, 1, 1, 0.3);
  message_run(&m);
  CHECK(m.st == DP_ERR_DIST && strstr(m.error, "message 1 of their NCCL communicator waits for message 0"));
  m = ticketed(8, 2, 0, 10.0);
  message_run(&m);
  CHECK(m.st == DP_ERR_DIST && strstr(m.error, "was aborted by an earlier failure"));
}

/* An asynchronous NCCL error (a peer gone): DP_ERR_DIST naming it, the communicator aborted. */
static void check_async_error(void) {
  pthread_mutex_lock(&fake_lock);
  inject = ncclRemoteError;
  const int live = comms_live;
  pthread_mutex_unlock(&fake_lock);
  message m = ticketed(9, 0, 1, 10.0);
  message_run(&m);
  CHECK(m.st == DP_ERR_DIST && strstr(m.error, "an NCCL send with rank 1 failed: NCCL error 6"));
  pthread_mutex_lock(&fake_lock);
  CHECK(comms_live == live); /* made, then aborted */
  pthread_mutex_unlock(&fake_lock);
  m = ticketed(9, 1, 0, 10.0);
  message_run(&m);
  CHECK(m.st == DP_ERR_DIST && strstr(m.error, "aborted by an earlier failure"));
}

/* A message queued that never finishes: DP_ERR_DIST at the deadline, the communicator aborted. */
static void check_message_deadline(void) {
  pthread_mutex_lock(&fake_lock);
  events_hang = 1;
  const int live = comms_live;
  pthread_mutex_unlock(&fake_lock);
  message m = ticketed(10, 0, 0, 0.3);
  message_run(&m);
  CHECK(m.st == DP_ERR_DIST && strstr(m.error, "gave up after") && strstr(m.error, "an NCCL receive"));
  pthread_mutex_lock(&fake_lock);
  CHECK(comms_live == live);
  events_hang = 0;
  pthread_mutex_unlock(&fake_lock);
}

int main(void) {
  CHECK(dp_nccl_p2p_built() == 1);
  CHECK(dp_nccl_gpu_uid(0) != 0 && dp_nccl_gpu_uid(0) == dp_nccl_gpu_uid(0) && dp_nccl_gpu_uid(0) != dp_nccl_gpu_uid(1));
  CHECK(cudaStreamCreateWithFlags(&device_stream, 0) == cudaSuccess);
  message bad = ticketed(11, 0, 1, 1.0);
  CHECK(dp_nccl_p2p_move(1, 0, 1, 0, &bad.t, NULL, 4, device_stream, 1.0, "no buffer") == DP_ERR_VALUE);
  check_ticket_order();
  check_lower_rank_tickets();
  check_missed_turn();
  check_async_error();
  check_message_deadline();
  dp_nccl_p2p_shutdown();
  CHECK(cudaStreamDestroy(device_stream) == cudaSuccess);
  pthread_mutex_lock(&fake_lock);
  CHECK(comms_live == 0 && comms == NULL);
  CHECK(streams_live == 0 && events_live == 0);
  CHECK(violations == 0);
  pthread_mutex_unlock(&fake_lock);
  if (failures) {
    fprintf(stderr, "p2p_order: %d checks failed\n", failures);
    return 1;
  }
  printf("p2p_order: ok\n");
  return 0;
}
