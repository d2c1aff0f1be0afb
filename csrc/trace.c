/* trace.c — the step timeline's recorder (see trace.h). */
#include "trace.h"

#include <stdlib.h>

#include "backend.h"

_Thread_local dp_trace *dp_trace_current = NULL;

void dp_trace_record(dp_trace *t, int phase, int bucket, int64_t bytes, int64_t t0) {
  if (t->sync_dev) {
    /* the phase's queued work, done: its end is when the device finished it; a
     * failure here shows again in the step's own next call */
    dp_device *dev = t->sync_dev;
    const dp_status ignored = dev->backend->synchronize(dev);
    (void)ignored;
  }
  const int64_t t1 = dp_trace_now();
  if (t->n == t->cap) {
    if (t->cap >= DP_TRACE_MAX_EVENTS) {
      t->dropped++;
      return;
    }
    const int64_t cap = t->cap * 2;
    dp_trace_event *grown = realloc(t->events, sizeof *grown * (size_t)cap);
    if (!grown) {
      t->dropped++;
      return;
    }
    t->events = grown;
    t->cap = cap;
  }
  t->events[t->n++] = (dp_trace_event){phase, bucket, bytes, t->step, t0, t1};
}

dp_status dp_trace_enable(dp_trace *t, int on) {
  if (on && !t->events) {
    t->events = malloc(sizeof *t->events * 4096);
    if (!t->events) return DP_FAIL(DP_ERR_MEMORY, "profiling: cannot allocate the event buffer");
    t->cap = 4096;
    t->n = 0;
  }
  t->recording = on;
  return DP_OK;
}

dp_trace_event *dp_trace_take(dp_trace *t, int64_t *n, int64_t *dropped) {
  dp_trace_event *events = t->events;
  *n = t->n;
  *dropped = t->dropped;
  t->events = NULL;
  t->n = t->cap = t->dropped = 0;
  if (t->recording && dp_trace_enable(t, 1) != DP_OK) t->recording = 0; /* out of memory: recording stops */
  return events;
}

void dp_trace_free(dp_trace *t) {
  free(t->events);
  t->events = NULL;
  t->n = t->cap = t->dropped = 0;
  t->recording = 0;
}

dp_trace *dp_trace_step_begin(dp_trace *t) {
  dp_trace *previous = dp_trace_current;
  if (t && t->recording) {
    dp_trace_current = t;
  } else {
    dp_trace_current = NULL;
  }
  return previous;
}

void dp_trace_step_end(dp_trace *previous) { dp_trace_current = previous; }
