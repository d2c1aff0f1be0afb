#include "collective.h"

#include <sched.h>
#include <stdatomic.h>
#include <string.h>

#include "trace.h"


dp_status dp_barrier_init(dp_barrier *b, int count) {
  if (count < 1) return DP_FAIL(DP_ERR_VALUE, "barrier: count must be >= 1, got %d", count);
  if (pthread_mutex_init(&b->mutex, NULL) != 0) return DP_FAIL(DP_ERR_RUNTIME, "pthread_mutex_init failed");
  if (pthread_cond_init(&b->cond, NULL) != 0) {
    pthread_mutex_destroy(&b->mutex);
    return DP_FAIL(DP_ERR_RUNTIME, "pthread_cond_init failed");
  }
  b->count = count;
  atomic_init(&b->arrived, 0);
  atomic_init(&b->generation, 0u);
  atomic_init(&b->broken, 0);
  return DP_OK;
}

void dp_barrier_destroy(dp_barrier *b) {
  pthread_cond_destroy(&b->cond);
  pthread_mutex_destroy(&b->mutex);
}

enum { BARRIER_SPINS = 20000, BARRIER_YIELD_EVERY = 64 };

static dp_status barrier_broken(void) {
  return DP_FAIL(DP_ERR_ABORTED, "collective aborted: another replica failed");
}

static dp_status barrier_wait(dp_barrier *b);

/* a barrier's wait is the timeline's "wait" (trace.h) */
dp_status dp_barrier_wait(dp_barrier *b) {
  if (b->count == 1) return DP_OK;
  const int64_t t0 = dp_trace_begin();
  DP_TRY(barrier_wait(b));
  dp_trace_end(DP_PHASE_WAIT, -1, 0, t0);
  return DP_OK;
}

static dp_status barrier_wait(dp_barrier *b) {
  if (atomic_load_explicit(&b->broken, memory_order_acquire)) return barrier_broken();
  const unsigned gen = atomic_load_explicit(&b->generation, memory_order_acquire);
  if (atomic_fetch_add_explicit(&b->arrived, 1, memory_order_acq_rel) + 1 == b->count) {
    atomic_store_explicit(&b->arrived, 0, memory_order_relaxed);
    /* bump under the lock so a thread about to sleep cannot miss the wake-up */
    pthread_mutex_lock(&b->mutex);
    atomic_fetch_add_explicit(&b->generation, 1u, memory_order_acq_rel);
    pthread_cond_broadcast(&b->cond);
    pthread_mutex_unlock(&b->mutex);
    return DP_OK;
  }
  for (int spin = 1; spin <= BARRIER_SPINS; ++spin) {
    if (atomic_load_explicit(&b->generation, memory_order_acquire) != gen) return DP_OK;
    if (atomic_load_explicit(&b->broken, memory_order_acquire)) {
      /* the generation may have completed between the two loads, and a replica
       * gone on from it then failed: a completed generation wins, as below (the
       * stress test once saw a peer told "aborted" by a barrier every replica
       * had passed) */
      if (atomic_load_explicit(&b->generation, memory_order_acquire) != gen) return DP_OK;
      return barrier_broken();
    }
    if (spin % BARRIER_YIELD_EVERY == 0) sched_yield();
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }
  pthread_mutex_lock(&b->mutex);
  while (atomic_load_explicit(&b->generation, memory_order_acquire) == gen &&
         !atomic_load_explicit(&b->broken, memory_order_acquire))
    pthread_cond_wait(&b->cond, &b->mutex);
  pthread_mutex_unlock(&b->mutex);
  /* a completed generation wins over a break that came after it */
  if (atomic_load_explicit(&b->generation, memory_order_acquire) != gen) return DP_OK;
  return barrier_broken();
}

void dp_barrier_break(dp_barrier *b) {
  pthread_mutex_lock(&b->mutex);
  atomic_store_explicit(&b->broken, 1, memory_order_release);
  pthread_cond_broadcast(&b->cond);
  pthread_mutex_unlock(&b->mutex);
}

void dp_barrier_reset(dp_barrier *b) {
  atomic_store_explicit(&b->arrived, 0, memory_order_relaxed);
  atomic_store_explicit(&b->broken, 0, memory_order_release);
}

void dp_allreduce_chunk(int64_t n, int k, int rank, int64_t *begin, int64_t *end) {
  /* equal chunks rounded up to 16 floats (one 64-byte cache line) */
  int64_t per = (n + k - 1) / k;
  per = (per + 15) & ~(int64_t)15;
  int64_t b = (int64_t)rank * per, e = b + per;
  *begin = b < n ? b : n;
  *end = e < n ? e : n;
}

dp_status dp_allreduce(float *const *bufs, int k, int rank, int64_t n, dp_reduce_op op, dp_barrier *bar) {
  if (k == 1) return DP_OK; /* the sum over one replica is itself, and so is its mean */
  DP_TRY(dp_barrier_wait(bar)); /* every replica's buffer is complete */
  int64_t begin, end;
  dp_allreduce_chunk(n, k, rank, &begin, &end);
  const float scale = op == DP_REDUCE_MEAN ? 1.0f / (float)k : 1.0f;
  /* Two to four replicas (the common case): the rank-ordered sum in registers,
   * stored straight to every buffer: k loads and k stores per element.
   * Iteration i touches only index i of each buffer, hence `omp simd`. */
  if (k <= 4) {
    float *b0 = bufs[0], *b1 = bufs[1], *b2 = k > 2 ? bufs[2] : NULL, *b3 = k > 3 ? bufs[3] : NULL;
    if (k == 2) {
#pragma omp simd
      for (int64_t i = begin; i < end; ++i) b0[i] = b1[i] = (b0[i] + b1[i]) * scale;
    } else if (k == 3) {
#pragma omp simd
      for (int64_t i = begin; i < end; ++i) b0[i] = b1[i] = b2[i] = ((b0[i] + b1[i]) + b2[i]) * scale;
    } else {
#pragma omp simd
      for (int64_t i = begin; i < end; ++i) b0[i] = b1[i] = b2[i] = b3[i] = (((b0[i] + b1[i]) + b2[i]) + b3[i]) * scale;
    }
    return dp_barrier_wait(bar);
  }
  /* More replicas: blocks of 1024 floats stay in L1 between the sum and the k copies out.
   * The sum is dp_sum_parts_elem's order (p0 + p1) + p2 ..., taken replica by
   * replica over the block so each pass is one vector add per 8 floats. */
  float acc[1024];
  for (int64_t b0 = begin; b0 < end; b0 += 1024) {
    const int64_t len = end - b0 < 1024 ? end - b0 : 1024;
    memcpy(acc, bufs[0] + b0, sizeof(float) * (size_t)len);
    for (int r = 1; r < k; ++r) {
      const float *src = bufs[r] + b0;
#pragma omp simd
      for (int64_t i = 0; i < len; ++i) acc[i] += src[i];
    }
    if (op == DP_REDUCE_MEAN) {
#pragma omp simd
      for (int64_t i = 0; i < len; ++i) acc[i] *= scale;
    }
    for (int r = 0; r < k; ++r) memcpy(bufs[r] + b0, acc, sizeof(float) * (size_t)len);
  }
  return dp_barrier_wait(bar); /* every chunk is everywhere */
}

static dp_status local_all_reduce(void *ctx, int rank, float *buf, int64_t n, dp_reduce_op op) {
  (void)ctx, (void)rank, (void)buf, (void)n, (void)op;
  return DP_OK;
}

static dp_status local_grad_ready(void *ctx, int rank, int layer) {
  (void)ctx, (void)rank, (void)layer;
  return DP_OK;
}

static dp_status local_wait(void *ctx, int rank) {
  (void)ctx, (void)rank;
  return DP_OK;
}

const dp_collective_ops dp_collective_local_ops = {local_all_reduce, local_grad_ready, local_wait};
