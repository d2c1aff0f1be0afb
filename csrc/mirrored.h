/* mirrored.h — k replicas of one model, one per device, trained in lockstep.
 *
 * A step splits the global batch into k contiguous shards whose sizes differ
 * by at most one; replica r runs forward and backward on shard r on its own
 * thread with gradient scale 1/n_global, so that the all-reduced sum of the
 * flat gradient buffers is the mean gradient over the global batch however
 * uneven the shards (an empty shard contributes zeros). Every replica then
 * takes the same SGD step from the same gradient, so the replicas' parameters
 * stay bitwise identical.
 */
#ifndef DP_MIRRORED_H
#define DP_MIRRORED_H

#include "comm.h"
#include "model.h"
#include "replica.h"

typedef struct dp_mirrored dp_mirrored;

/* A batch shape every replica has been warmed for (mirrored.c, warm_up):
 * the global batch size, where the samples come from (0 float32 images,
 * 1 uint8 images, 2 resident rows: the staging differs), and the CUDA
 * settings (deterministic | allow_tf32 << 1: they choose the cuDNN
 * algorithms, hence the workspace sizes). */
typedef struct dp_warm_key {
  int64_t n;
  int source, settings;
} dp_warm_key;

enum { DP_MIRRORED_WARM_KEYS = 8 };

/* One process's share of a step's metrics: its replicas' loss sums and hits. */
typedef struct dp_step_metrics {
  double loss[DP_COMM_MAX_REPLICAS];
  int64_t correct[DP_COMM_MAX_REPLICAS];
} dp_step_metrics;

struct dp_mirrored {
  int k;
  /* Across processes (dp_mirrored_create_across): this process is proc of
   * nproc, its k replicas the job's first .. first + k - 1 of total, and a
   * batch is the job's global batch, split over all total replicas. Within
   * one process: nproc 1, proc 0, first 0, total k. */
  int nproc, proc, first, total;
  double timeout;  /* seconds to wait for another process */
  int64_t calls;   /* steps and evaluations so far: every process must agree */
  int64_t id;      /* across processes: the models made so far in this process (the same order everywhere) */
  int *proc_k;     /* across processes: each process's replica count */
  struct dp_step_metrics *gathered; /* across processes: every process's metrics of a step */
  dp_model **models; /* borrowed: the caller keeps them alive */
  dp_group *group;
  dp_comm *comm;               /* the replicas' grads, bn_tmp and state registered with it */
  int sync_batchnorm;          /* all-reduce BatchNorm statistics (SyncBatchNorm) */
  int nbuckets;                /* the gradient buckets (given to the comm too) */
  dp_grad_bucket buckets[DP_COMM_MAX_BUCKETS];
  /* the shapes warmed so far, the oldest replaced first; a failed step
   * forgets its own, so that the next one warms up again */
  int nwarm, next_warm;
  dp_warm_key warm[DP_MIRRORED_WARM_KEYS];
};

/* Shard r of n samples over k replicas: [begin, end). Across processes, r
 * and k count the job's replicas. */
void dp_shard_range(int64_t n, int k, int r, int64_t *begin, int64_t *end);

/* Writes model m's gradient buckets of about bucket_floats floats to out (0:
 * one bucket for the whole buffer) and returns how many (>= 1 when the model
 * has parameters). Whole layers only: a bucket closes at the first layer,
 * going backward, that brings it to bucket_floats or more; the size grows
 * when more than max buckets would be needed. */
int dp_plan_buckets(const dp_model *m, int64_t bucket_floats, dp_grad_bucket *out, int max);

/* k replicas over models[0..k-1] (borrowed: the caller keeps them alive).
 * sync_batchnorm: 0, each replica normalises with its own shard's statistics
 * (MirroredStrategy's and the book's behaviour); 1, the statistics are
 * all-reduced, so that k replicas compute what one computes on the whole
 * batch. Either way the running statistics stay identical on every replica:
 * after each step they are averaged over the replicas that had samples.
 * comm: which all-reduce (comm.h; DP_COMM_AUTO picks). bucket_bytes: the
 * gradient all-reduce runs in buckets of about this many bytes, each started
 * as soon as the backward pass has produced it (0: one bucket). */
DP_MUST_CHECK dp_status dp_mirrored_create(dp_model **models, int k, int sync_batchnorm, dp_comm_kind comm,
                                           int64_t bucket_bytes, dp_mirrored **out);
/* The same over every process of an MPI job (dist.h), each with its own k
 * local replicas; collective: every process calls it. The processes compare
 * their models (architecture, parameter count, BatchNorm mode, buckets): a
 * difference is a DP_ERR_DIST on every process, naming it. A step then takes
 * the job's global batch on every process (the processes check that their
 * batches agree before anything is exchanged), and the replicas of all
 * processes stay bitwise identical. */
DP_MUST_CHECK dp_status dp_mirrored_create_across(dp_model **models, int k, int sync_batchnorm, dp_comm_kind comm,
                                                  int64_t bucket_bytes, double timeout, dp_mirrored **out);
void dp_mirrored_destroy(dp_mirrored *m);
/* Process 0's replica 0 parameters and running statistics to every replica of
 * every process, momentum zeroed, then checked: every process compares a
 * digest of its bits with process 0's (DP_ERR_DIST on a difference).
 * Within one process: dp_mirrored_broadcast(m, 0). */
DP_MUST_CHECK dp_status dp_mirrored_broadcast_across(dp_mirrored *m);
/* The digest (FNV-1a 64 over the bits) of replica 0's parameters and running
 * statistics: equal on every replica of every process after every step. */
DP_MUST_CHECK dp_status dp_mirrored_digest(dp_mirrored *m, uint64_t *out);
/* Copy replica root's parameters to every replica and zero every momentum buffer. */
DP_MUST_CHECK dp_status dp_mirrored_broadcast(dp_mirrored *m, int root);
/* A training step (dp_mirrored_train_step, dp_mirrored_forward_backward):
 * 1. dp_mirrored_check_batch checks the whole batch on the calling thread
 *    before any replica starts, so that a bad label or row index is a
 *    DP_ERR_VALUE that leaves every replica and the comm as they were;
 * 2. a batch shape not seen before is warmed up: every replica stages its
 *    shard and runs forward and backward with the collectives off (BatchNorm's
 *    running statistics restored afterwards), so that every buffer, workspace
 *    and staging region is allocated, and every kernel loaded, before the
 *    step's first collective;
 * 3. the step runs with dev->in_step set on every replica's device: memory
 *    that would still grow is a DP_ERR_RUNTIME naming it (backend.h);
 * 4. a failed step aborts an NCCL comm only if a collective was issued
 *    (dp_comm_step_failed).
 * loss_sum and correct are summed over every replica of the job in global
 * replica order, so that every process returns the same value. */
DP_MUST_CHECK dp_status dp_mirrored_check_batch(const dp_mirrored *m, const dp_batch *b, int evaluate_only);
DP_MUST_CHECK dp_status dp_mirrored_train_step(dp_mirrored *m, const dp_batch *b, float lr, float momentum,
                                               float weight_decay, double *loss_sum, int64_t *correct);
/* Forward and backward only (gradients all-reduced, no step). */
DP_MUST_CHECK dp_status dp_mirrored_forward_backward(dp_mirrored *m, const dp_batch *b, double *loss_sum,
                                                     int64_t *correct);
/* Evaluation with the batch split over the replicas; each sample counted once. */
DP_MUST_CHECK dp_status dp_mirrored_evaluate(dp_mirrored *m, const dp_batch *b, double *loss_sum, int64_t *correct);

/* All-reduce of k host buffers of n floats, bufs[r] the copy on the device
 * named devices[r] (dp.all_reduce). Runs on a group of k replica threads made
 * once per device set and kept (a few sets, the least recently used
 * replaced); calls on one set from several threads take turns. */
DP_MUST_CHECK dp_status dp_allreduce_buffers(const char *const *devices, float *const *bufs, int k, int64_t n,
                                             dp_reduce_op op);
/* Destroys the kept groups not in use (tests: every thread and allocation back). */
void dp_allreduce_groups_clear(void);
/* Time iters all-reduces of n floats over k replica threads (one group run). */
DP_MUST_CHECK dp_status dp_allreduce_benchmark(int k, int64_t n, int iters, double *seconds);

#endif
