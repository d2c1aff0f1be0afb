/* trace.h — the step timeline: when each replica staged its shard, ran its
 * forward and backward passes, all-reduced each gradient bucket, waited for
 * its peers and updated its parameters.
 *
 * A replica thread that profiles points dp_trace_current (thread-local) at
 * its model's recorder for the length of a step; the instrumented places
 * (model.c, comm.c, collective.c, mirrored.c) then record an event each:
 *
 *     const int64_t t0 = dp_trace_begin();
 *     ... the phase ...
 *     dp_trace_end(DP_PHASE_FORWARD, -1, 0, t0);
 *
 * With profiling off dp_trace_current is NULL: each place costs one
 * thread-local load and a predictable branch, and reads no clock. Times are
 * CLOCK_MONOTONIC nanoseconds. On a CUDA device the host's clock measures
 * when work was queued, not when it ran, so a profiling CUDA replica
 * synchronizes its stream at the end of each phase (dp_trace_sync): the
 * phases are then what the GPU took, at the price of the overlap of the
 * all-reduce with the backward pass while profiling.
 *
 * Events nest: a bucket's all-reduce happens inside the backward pass (it
 * starts as soon as its layers' gradients are ready), a barrier wait inside
 * an all-reduce. A step's top-level events (staging, forward, backward, the
 * final wait, the update) add up to the replica's step event.
 */
#ifndef DP_TRACE_H
#define DP_TRACE_H

#include <stdint.h>
#include <time.h>

#include "dp_status.h"

typedef enum dp_phase {
  DP_PHASE_STEP,      /* a replica's whole step */
  DP_PHASE_SCATTER,   /* staging its shard of the batch onto its device */
  DP_PHASE_FORWARD,   /* the forward pass and the loss */
  DP_PHASE_BACKWARD,  /* the backward pass (its buckets' all-reduces nest in it) */
  DP_PHASE_ALLREDUCE, /* one all-reduce: a gradient bucket (bucket >= 0) or other statistics (-1) */
  DP_PHASE_WAIT,      /* waiting for the other replicas: a barrier, or the last buckets */
  DP_PHASE_UPDATE,    /* the SGD step */
  DP_PHASE_COUNT
} dp_phase;

typedef struct dp_trace_event {
  int32_t phase, bucket;
  int64_t bytes, step, t0, t1;
} dp_trace_event;

typedef struct dp_trace {
  dp_trace_event *events;
  int64_t n, cap;
  int64_t dropped; /* events past DP_TRACE_MAX_EVENTS (or memory), not recorded */
  int recording;
  int64_t step;    /* the step being recorded: its runner counts the steps (dp_trace_count_step) */
  void *sync_dev;  /* a CUDA device to synchronize at each phase's end; NULL on a CPU */
} dp_trace;

enum { DP_TRACE_MAX_EVENTS = 1 << 22 }; /* 128 MiB of events at most */

extern _Thread_local dp_trace *dp_trace_current;

static inline int64_t dp_trace_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* the start of a phase: 0 when this thread is not profiling */
static inline int64_t dp_trace_begin(void) { return dp_trace_current ? dp_trace_now() : 0; }

void dp_trace_record(dp_trace *t, int phase, int bucket, int64_t bytes, int64_t t0);

#define dp_trace_end(phase, bucket, bytes, t0)                                  \
  do {                                                                          \
    if (dp_trace_current) dp_trace_record(dp_trace_current, (phase), (bucket), (bytes), (t0)); \
  } while (0)

/* Start (on) or stop (off) recording; stopping keeps what was recorded. */
DP_MUST_CHECK dp_status dp_trace_enable(dp_trace *t, int on);
/* The events recorded so far, handed to the caller (free() them), and a fresh start. */
dp_trace_event *dp_trace_take(dp_trace *t, int64_t *n, int64_t *dropped);
void dp_trace_free(dp_trace *t);

/* The runner of a step, before its replicas start: the step's number. */
static inline void dp_trace_count_step(dp_trace *t) {
  if (t->recording) t->step++;
}

/* A replica thread's step: point dp_trace_current at t when it records (NULL
 * otherwise); returns the previous recorder, for _end. */
dp_trace *dp_trace_step_begin(dp_trace *t);
void dp_trace_step_end(dp_trace *previous);

#endif
