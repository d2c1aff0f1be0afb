/* collective.h — collectives across the replica threads of one process,
 * and the collective interface the model calls.
 *
 * All-reduce is reduce-scatter + all-gather fused: of k replicas, rank r owns
 * chunk r of the buffer; it sums chunk r of all k buffers in rank order
 * (0, 1, ..., k-1, so that the result never depends on thread timing) and
 * writes the result into chunk r of every buffer. Chunks start on 16-float
 * boundaries, so that no two ranks write the same cache line. Every replica
 * thread calls dp_allreduce with its rank; barriers bracket the exchange.
 */
#ifndef DP_COLLECTIVE_H
#define DP_COLLECTIVE_H

#include <pthread.h>
#include <stdint.h>

#include "dp_status.h"

/* A barrier of count threads that spins briefly before sleeping, because
 * waking a sleeping thread (on a virtual machine above all) can take longer
 * than a small buffer's whole all-reduce. The spin yields the core
 * regularly, so that k threads on fewer cores still make progress. */
typedef struct dp_barrier {
  pthread_mutex_t mutex;
  pthread_cond_t cond;
  int count;
  _Atomic int arrived;
  _Atomic unsigned generation;
  _Atomic int broken;  /* set by dp_barrier_break: every wait fails until reset */
} dp_barrier;

DP_MUST_CHECK dp_status dp_barrier_init(dp_barrier *b, int count);
void dp_barrier_destroy(dp_barrier *b);
/* DP_OK once all count threads have arrived; DP_ERR_ABORTED (with a message)
 * when the barrier is or becomes broken: a replica that failed will never
 * arrive, and its peers must not wait for it forever. */
DP_MUST_CHECK dp_status dp_barrier_wait(dp_barrier *b);
/* A failing thread breaks the barrier: every waiter returns DP_ERR_ABORTED. */
void dp_barrier_break(dp_barrier *b);
/* Mends a broken barrier; only while no thread is inside it (dp_group_run
 * calls it before it starts the workers). */
void dp_barrier_reset(dp_barrier *b);

typedef enum dp_reduce_op { DP_REDUCE_SUM = 0, DP_REDUCE_MEAN = 1 } dp_reduce_op;

/* The [begin, end) range of n elements that rank r of k reduces. */
void dp_allreduce_chunk(int64_t n, int k, int rank, int64_t *begin, int64_t *end);

/* Called by each of the k threads with its rank; bufs[0..k-1] are the k
 * replicas' buffers of n floats, reduced in place. bar counts k threads.
 * DP_ERR_ABORTED when another replica broke the barrier (it failed). */
DP_MUST_CHECK dp_status dp_allreduce(float *const *bufs, int k, int rank, int64_t n, dp_reduce_op op, dp_barrier *bar);

/* ---- the collective interface the model calls ----------------------------------
 *
 * One replica's view of its group (a mirrored runner's, dp.all_reduce's):
 * passed into dp_model_forward_backward_loaded, NULL for a lone model. Each
 * implementation is an ops table plus its context (csrc/comm.c serves every
 * comm kind with one). Every replica of a group makes the same calls in the
 * same order, each with its rank. */
typedef struct dp_collective_ops {
  /* The sum (or mean) over the group's replicas of n floats at buf, in place.
   * buf lies in a buffer registered with the group (every replica has its own
   * copy, at its own address); each rank names the range by its own copy. */
  DP_MUST_CHECK dp_status (*all_reduce)(void *ctx, int rank, float *buf, int64_t n, dp_reduce_op op);
  /* The backward pass has finished layer `layer` (every layer, from the last
   * to the first): the gradient buckets complete there may start reducing. */
  DP_MUST_CHECK dp_status (*grad_ready)(void *ctx, int rank, int layer);
  /* The rank's work after this waits for every reduction it started; ends a
   * backward pass's buckets (an error when some were never started). */
  DP_MUST_CHECK dp_status (*wait)(void *ctx, int rank);
} dp_collective_ops;

typedef struct dp_collective {
  const dp_collective_ops *ops;
  void *ctx;
  int rank;
  /* BatchNorm: 0, each replica normalises with its own shard's statistics;
   * 1, the statistics are all-reduced and count global_batch samples, the
   * whole batch over every replica (known on the host: the step never waits
   * for a count). */
  int sync_batchnorm;
  int64_t global_batch;
} dp_collective;

/* The ops for a collective that exchanges nothing (the identity: a group of
 * one, or a warm-up pass that must not communicate). */
extern const dp_collective_ops dp_collective_local_ops;

/* The calls the model makes: nothing to do without a collective (NULL). */
static inline DP_MUST_CHECK dp_status dp_collective_all_reduce(const dp_collective *c, float *buf, int64_t n,
                                                               dp_reduce_op op) {
  return c ? c->ops->all_reduce(c->ctx, c->rank, buf, n, op) : DP_OK;
}
static inline DP_MUST_CHECK dp_status dp_collective_grad_ready(const dp_collective *c, int layer) {
  return c ? c->ops->grad_ready(c->ctx, c->rank, layer) : DP_OK;
}
static inline DP_MUST_CHECK dp_status dp_collective_wait(const dp_collective *c) {
  return c ? c->ops->wait(c->ctx, c->rank) : DP_OK;
}
static inline int dp_collective_syncs_batchnorm(const dp_collective *c) { return c && c->sync_batchnorm; }

#endif
