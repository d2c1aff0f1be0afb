/* comm.h — the all-reduce of a group of replicas, behind one interface.
 *
 * One ops table per kind (comm.c), chosen when the comm is made:
 *
 *   host    CPU replicas in one process: collective.c's all-reduce, each
 *           replica thread reducing 1/k of the buffer.
 *   kernel  CUDA replicas NCCL cannot serve (several logical GPUs on one
 *           physical GPU, which NCCL refuses; peer-accessible GPUs without
 *           NCCL): kernels/collective.cu, rank r summing chunk r of all k
 *           buffers in rank order, bit for bit the host kind's sum.
 *   nccl    CUDA replicas on distinct GPUs, in one process or across
 *           processes (the communicator's id broadcast over MPI):
 *           ncclAllReduce, the communicators made up front so that a failure
 *           shows when the strategy is made, not in the middle of training.
 *   mpi     CPU replicas in several processes: a worker thread per process
 *           runs dist.h's rank-ordered chain bucket by bucket, bit for bit
 *           the host kind's sum over the job's replicas.
 *
 * The model sees none of this: dp_comm_collective gives each rank
 * collective.h's interface over the buffers of dp_comm_register and the
 * buckets of dp_comm_set_buckets.
 *
 * Every replica thread makes the same sequence of calls, each with its rank.
 * No call waits for the GPU: on CUDA each operation is queued on the rank's
 * streams, ordered by the backend's events (backend.h) after the work queued
 * before it. The host threads meet at the group's barrier only where one
 * rank's GPU work must wait for another's queued work (the kernel kind); a
 * replica that fails breaks the barrier, so that its peers return
 * DP_ERR_ABORTED instead of waiting forever.
 *
 * Buckets overlap the gradient all-reduce with the backward pass:
 * dp_comm_bucket_allreduce starts a range's all-reduce on a second stream as
 * soon as the rank's backward has produced it; dp_comm_wait_buckets makes the
 * rank's later work (the optimizer step) wait for every bucket of every rank.
 * The host kind reduces a bucket at once, on the replica threads.
 */
#ifndef DP_COMM_H
#define DP_COMM_H

#include <stdint.h>

#include "backend.h"
#include "collective.h"

typedef enum dp_comm_kind {
  DP_COMM_AUTO = -1, /* for dp_comm_create: the best kind for the devices */
  DP_COMM_HOST = 0,
  DP_COMM_KERNEL = 1,
  DP_COMM_NCCL = 2,
  DP_COMM_MPI = 3,
  DP_COMM_KIND_COUNT
} dp_comm_kind;

enum { DP_COMM_MAX_BUCKETS = 256, DP_COMM_MAX_REPLICAS = 64, DP_COMM_MAX_REGISTERED = 8 };

typedef struct dp_comm dp_comm;

/* A range of the flat gradient buffer whose all-reduce starts once the
 * backward pass has finished layer ready_layer (every layer with parameters
 * in the range has an index >= ready_layer, and backward runs from the last
 * layer to the first). Buckets are numbered in the order they become ready. */
typedef struct dp_grad_bucket {
  int64_t begin, end;
  int ready_layer;
} dp_grad_bucket;

/* The process's settings for the NCCL kind: NCCL_RUNTIME_CONNECT=0 unless
 * the environment has a value already; nothing without NCCL. Called once by
 * the binding's module init, before any thread of dpcore starts, because
 * setenv may move environ while another thread reads it (getenv: the
 * DPCORE_* switches). */
DP_MUST_CHECK dp_status dp_comm_process_init(void);

/* devs[r]: replica r's device (borrowed; outlives the comm). bar: the barrier
 * of the group's k replica threads (borrowed). want: DP_COMM_AUTO, or a kind
 * to insist on (DP_ERR_VALUE / DP_ERR_UNSUPPORTED, naming why, when it cannot
 * serve these devices). */
DP_MUST_CHECK dp_status dp_comm_create(dp_device *const *devs, int k, dp_comm_kind want, dp_barrier *bar,
                                       dp_comm **out);
/* The same for replicas across processes; collective over every process of
 * the job. This process's k replicas are the job's first .. first + k - 1 of
 * total (dist.h's order: process by process); a peer process that does not
 * arrive within timeout seconds is a DP_ERR_DIST. */
DP_MUST_CHECK dp_status dp_comm_create_across(dp_device *const *devs, int k, dp_comm_kind want, dp_barrier *bar,
                                              int first, int total, double timeout, dp_comm **out);
void dp_comm_destroy(dp_comm *c);
int dp_comm_total(const dp_comm *c); /* the job's replicas */
int dp_comm_first(const dp_comm *c); /* this process's first replica among them */
dp_comm_kind dp_comm_get_kind(const dp_comm *c);
const char *dp_comm_kind_name(dp_comm_kind kind); /* "host", "kernel", "nccl", "mpi", "auto" */
/* "host" -> DP_COMM_HOST ...; DP_ERR_VALUE for an unknown name. */
DP_MUST_CHECK dp_status dp_comm_kind_parse(const char *name, dp_comm_kind *out);

/* The names of the NULL entries of kind's ops table (at most max written to
 * out); returns how many there are, or -1 when this build has no table for
 * the kind. Needs no device: tests check the CUDA kinds' tables anywhere. */
int dp_comm_ops_null_entries(dp_comm_kind kind, const char **out, int max);

/* Registers a buffer every replica has a copy of, bufs[r] rank r's n floats
 * on its device; the collective interface's all_reduce accepts any range of
 * it. DP_ERR_VALUE when DP_COMM_MAX_REGISTERED are registered already.
 * dp_comm_unregister_all forgets them all. Both are called by one thread
 * while no replica thread uses the comm. */
DP_MUST_CHECK dp_status dp_comm_register(dp_comm *c, float *const *bufs, int64_t n);
void dp_comm_unregister_all(dp_comm *c);
/* The gradient buckets (order: as the backward pass produces them) of the
 * registered buffer grads; the collective interface's grad_ready starts
 * them. Called by one thread while no replica thread uses the comm. */
DP_MUST_CHECK dp_status dp_comm_set_buckets(dp_comm *c, float *const *grads, const dp_grad_bucket *buckets, int n);
/* Rank's collective interface (collective.h) over this comm, BatchNorm
 * unsynchronized: the caller sets sync_batchnorm and global_batch. */
dp_collective dp_comm_collective(dp_comm *c, int rank);

/* bufs[0..k-1]: the k replicas' buffers of n floats, each on its replica's
 * device; every buffer receives the sum (or mean). In stream order on CUDA. */
DP_MUST_CHECK dp_status dp_comm_allreduce(dp_comm *c, int rank, float *const *bufs, int64_t n, dp_reduce_op op);

/* The sum of elements [begin, end) of every bufs[r], started once the work
 * queued on the rank's device is done, running beside the rank's later work.
 * bucket (0 .. DP_COMM_MAX_BUCKETS-1) numbers the buckets of one step; every
 * rank starts the same buckets in the same order. */
DP_MUST_CHECK dp_status dp_comm_bucket_allreduce(dp_comm *c, int rank, float *const *bufs, int64_t begin, int64_t end,
                                                 int bucket);
/* The rank's work queued after this waits for every bucket started so far by
 * every rank (they write into this rank's buffer). Ends a step's buckets. */
DP_MUST_CHECK dp_status dp_comm_wait_buckets(dp_comm *c, int rank);

/* dp_comm_step_begin starts a step: each rank's count of collectives issued
 * is zeroed and its next bucket is the first again. dp_comm_allreduce and
 * dp_comm_bucket_allreduce count the ones that reach other ranks (k > 1, a
 * non-empty range); dp_comm_collectives_issued reads the total. Every kind
 * keeps this count, so that the CPU suite runs the logic the NCCL kind needs.
 * Called by one thread while no replica thread uses the comm. */
void dp_comm_step_begin(dp_comm *c);
int64_t dp_comm_collectives_issued(const dp_comm *c);
/* After a failed step: returns 1 when an NCCL comm was aborted, else 0. When
 * a collective was issued since dp_comm_step_begin, NCCL operations some ranks
 * queued may never be matched by the others, so an NCCL comm's communicators
 * are aborted and the comm refuses further use (DP_ERR_RUNTIME naming the
 * reason). When none was issued, nothing is pending and the comm stays
 * usable; other kinds never need aborting. Called by one thread while no
 * replica thread uses the comm. */
int dp_comm_step_failed(dp_comm *c);
int dp_comm_is_poisoned(const dp_comm *c);

#endif
