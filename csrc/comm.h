/* comm.h — the all-reduce of a group of replicas, behind one interface.
 *
 * One ops table per kind of replica set (comm.c), chosen once when the comm
 * is made; every operation below is a lookup in it:
 *
 *   host    CPU replicas: csrc/collective.c's in-process all-reduce (threads,
 *           shared memory, every replica reduces 1/k of the buffer).
 *   kernel  CUDA replicas NCCL cannot serve: several logical GPUs on one
 *           physical GPU (NCCL refuses two ranks on one device), or GPUs that
 *           can reach each other's memory when NCCL is missing. Our reduction
 *           kernel (kernels/collective.cu): rank r sums chunk r of all k
 *           buffers in rank order and writes it back into all of them, ordered
 *           after every replica's compute with events. Bitwise the CPU's sum.
 *   nccl    CUDA replicas on distinct GPUs: ncclAllReduce, communicators made
 *           up front (ncclCommInitAll) so that a failure shows when the
 *           strategy is made, not in the middle of training.
 *   mpi     CPU replicas in several processes (and hosts): a worker thread
 *           per process runs dist.h's rank-ordered chain over MPI, bucket
 *           by bucket as the backward pass produces them. Bitwise the host
 *           kind's sum over the job's replicas. (CUDA replicas across
 *           processes use the nccl kind, one communicator of every replica of
 *           the job, its id broadcast over MPI.)
 *
 * The kernel and nccl kinds order work between a rank's streams, and between
 * ranks, with the backend's streams and events (backend.h).
 *
 * The model sees none of this: dp_comm_collective gives each rank the
 * collective interface of collective.h (all-reduce of a registered buffer,
 * gradient ready for a layer, wait), over the buffers registered with
 * dp_comm_register and the buckets of dp_comm_set_buckets.
 *
 * Every replica thread of the group makes the same sequence of calls, each
 * with its rank. No call waits for the GPU: on CUDA devices each operation is
 * queued on the rank's streams, after the work queued there before the call
 * and before the work queued after it. The host threads meet at the group's
 * barrier only where one rank's GPU work must wait for another rank's queued
 * work (the kernel kind); a replica that fails breaks that barrier, so its
 * peers return DP_ERR_ABORTED instead of waiting forever.
 *
 * Buckets: the gradient all-reduce runs in buckets that overlap the backward
 * pass. dp_comm_bucket_allreduce starts the all-reduce of one range as soon as
 * the rank's backward has produced it, on a second stream, while the rank goes
 * on with the backward of earlier layers; dp_comm_wait_buckets makes the
 * rank's later work (the optimizer step) wait for every bucket of every rank.
 * On the host kind a bucket is reduced at once, by the replica threads.
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

/* The process's settings for the NCCL kind, made once before any thread of
 * dpcore starts (the binding's module init calls it): NCCL_RUNTIME_CONNECT=0
 * unless the environment has a value already. setenv may move environ while
 * another thread reads it (getenv: the DPCORE_* switches), so it is never
 * called once threads run. Nothing to do without NCCL. */
DP_MUST_CHECK dp_status dp_comm_process_init(void);

/* devs[r]: replica r's device (borrowed; outlives the comm). bar: the barrier
 * of the group's k replica threads (borrowed). want: DP_COMM_AUTO, or a kind
 * to insist on (DP_ERR_VALUE / DP_ERR_UNSUPPORTED when it cannot serve these
 * devices, naming why). */
DP_MUST_CHECK dp_status dp_comm_create(dp_device *const *devs, int k, dp_comm_kind want, dp_barrier *bar,
                                       dp_comm **out);
/* The same for replicas that span processes: this process's k replicas are
 * the job's replicas first .. first + k - 1 of total (dist.h's global order:
 * process by process), and a peer process that does not arrive within timeout
 * seconds is a DP_ERR_DIST. Collective over every process of the job. */
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

/* Registers a buffer every replica has a copy of: bufs[r] is rank r's n
 * floats (on its device). The collective interface's all_reduce accepts any
 * range of it. DP_ERR_VALUE when DP_COMM_MAX_REGISTERED are registered
 * already. dp_comm_unregister_all forgets them all. Called by one thread
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
 * queued on the rank's device is done, and running beside the rank's later
 * work. bucket (0 .. DP_COMM_MAX_BUCKETS-1) numbers the buckets of one step;
 * every rank starts the same buckets in the same order. */
DP_MUST_CHECK dp_status dp_comm_bucket_allreduce(dp_comm *c, int rank, float *const *bufs, int64_t begin, int64_t end,
                                                 int bucket);
/* The rank's work queued after this waits for every bucket started so far by
 * every rank (they write into this rank's buffer). Ends a step's buckets. */
DP_MUST_CHECK dp_status dp_comm_wait_buckets(dp_comm *c, int rank);

/* A step's bookkeeping, every kind alike (so that the CPU suite runs the
 * logic the NCCL kind depends on): dp_comm_step_begin zeroes each rank's
 * count of collectives issued; dp_comm_allreduce and dp_comm_bucket_allreduce
 * count the ones they issue (to the other ranks: k > 1, a non-empty range);
 * dp_comm_collectives_issued reads the total; every rank's next bucket is
 * the first again. Called by one thread while no replica thread uses the comm. */
void dp_comm_step_begin(dp_comm *c);
int64_t dp_comm_collectives_issued(const dp_comm *c);
/* After a failed step. When a collective was issued since dp_comm_step_begin,
 * NCCL operations some ranks queued may never be matched by the others: an
 * NCCL comm's communicators are then aborted and the comm refuses further use
 * (DP_ERR_RUNTIME naming the reason); returns 1 then. When none was issued
 * (the step failed before its first collective, e.g. a bad label found while
 * staging) nothing is pending anywhere and the comm stays usable: returns 0.
 * Other kinds never need aborting. Called by one thread while no replica
 * thread uses the comm. */
int dp_comm_step_failed(dp_comm *c);
int dp_comm_is_poisoned(const dp_comm *c);

#endif
