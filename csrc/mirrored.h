/* mirrored.h — k replicas of one model, one per device, trained in lockstep.
 *
 * A training step: the global batch is split into k contiguous shards whose
 * sizes differ by at most one; replica r runs forward and backward on shard r
 * on its own thread with gradient scale 1/n_global, so the all-reduced SUM of
 * the flat gradient buffers is exactly the mean gradient over the global batch
 * however uneven the shards (an empty shard contributes zeros). Every replica
 * then takes the same SGD step from the same bits, so the replicas' parameters
 * stay bitwise identical.
 */
#ifndef DP_MIRRORED_H
#define DP_MIRRORED_H

#include "model.h"
#include "replica.h"

typedef struct dp_mirrored dp_mirrored;

/* The context a replica's BatchNorm sync hook receives. */
typedef struct dp_replica_sync {
  dp_mirrored *mirrored;
  int rank;
} dp_replica_sync;

struct dp_mirrored {
  int k;
  dp_model **models; /* borrowed: the caller keeps them alive */
  dp_group *group;
  int sync_batchnorm;          /* all-reduce BatchNorm statistics (SyncBatchNorm) */
  dp_replica_sync sync_ctx[64];
  int64_t shard_n[64];         /* samples of each replica in the current step */
};

/* Shard r of n samples over k replicas: [begin, end). */
void dp_shard_range(int64_t n, int k, int r, int64_t *begin, int64_t *end);

/* BatchNorm across replicas: by default each replica normalises with its own
 * shard's statistics (MirroredStrategy's and the book's behaviour); with
 * sync_batchnorm the statistics are all-reduced so k replicas compute what one
 * replica computes on the whole batch. Either way the running statistics stay
 * identical on every replica: after each step they are averaged over the
 * replicas that had samples. */
dp_status dp_mirrored_create(dp_model **models, int k, int sync_batchnorm, dp_mirrored **out);
void dp_mirrored_destroy(dp_mirrored *m);
/* Copy replica root's parameters to every replica and zero every momentum buffer. */
dp_status dp_mirrored_broadcast(dp_mirrored *m, int root);
dp_status dp_mirrored_train_step(dp_mirrored *m, const dp_batch *b, float lr, float momentum, float weight_decay,
                                 double *loss_sum, int64_t *correct);
/* Forward and backward only (gradients all-reduced, no step). */
dp_status dp_mirrored_forward_backward(dp_mirrored *m, const dp_batch *b, double *loss_sum, int64_t *correct);
/* Evaluation with the batch split over the replicas; each sample counted once. */
dp_status dp_mirrored_evaluate(dp_mirrored *m, const dp_batch *b, double *loss_sum, int64_t *correct);

/* All-reduce of k buffers of n floats on a temporary group of k threads. */
dp_status dp_allreduce_buffers(float *const *bufs, int k, int64_t n, dp_reduce_op op);
/* Time iters all-reduces of n floats over k replica threads (one group run). */
dp_status dp_allreduce_benchmark(int k, int64_t n, int iters, double *seconds);

#endif
