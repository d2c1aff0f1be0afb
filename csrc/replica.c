#include "replica.h"

#include <omp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

typedef struct worker {
  dp_group *group;
  int rank, threads;
  pthread_t thread;
  int started;
  dp_status status;
  char message[1024];
} worker;

struct dp_group {
  int k;
  worker *workers;
  dp_barrier barrier;
  pthread_mutex_t mutex;
  pthread_cond_t work_cv, done_cv;
  unsigned long generation;  /* bumped once per run */
  int pending;               /* workers still running the current task */
  int stopping;
  dp_group_fn fn;
  void *arg;
};

static void *worker_main(void *p) {
  worker *w = p;
  dp_group *g = w->group;
  omp_set_num_threads(w->threads);
  unsigned long seen = 0;
  for (;;) {
    pthread_mutex_lock(&g->mutex);
    while (!g->stopping && g->generation == seen) pthread_cond_wait(&g->work_cv, &g->mutex);
    if (g->stopping) {
      pthread_mutex_unlock(&g->mutex);
      return NULL;
    }
    seen = g->generation;
    dp_group_fn fn = g->fn;
    void *arg = g->arg;
    pthread_mutex_unlock(&g->mutex);

    dp_error_clear();
    w->status = fn(arg, w->rank);
    if (w->status != DP_OK) {
      snprintf(w->message, sizeof w->message, "%s", dp_error_message());
      /* peers waiting for this replica inside a collective give up */
      dp_barrier_break(&g->barrier);
    }

    pthread_mutex_lock(&g->mutex);
    if (--g->pending == 0) pthread_cond_signal(&g->done_cv);
    pthread_mutex_unlock(&g->mutex);
  }
}

static atomic_long groups_created;

long dp_group_created_count(void) { return atomic_load(&groups_created); }

dp_status dp_group_create(int k, const int *threads, dp_group **out) {
  *out = NULL;
  atomic_fetch_add(&groups_created, 1);
  if (k < 1) return DP_FAIL(DP_ERR_VALUE, "a replica group needs at least one replica, got %d", k);
  dp_group *g = calloc(1, sizeof *g);
  if (!g) return DP_FAIL(DP_ERR_MEMORY, "cannot allocate a replica group");
  g->k = k;
  g->workers = calloc((size_t)k, sizeof *g->workers);
  if (!g->workers) {
    free(g);
    return DP_FAIL(DP_ERR_MEMORY, "cannot allocate %d replica workers", k);
  }
  dp_status st = dp_barrier_init(&g->barrier, k);
  if (st != DP_OK) {
    free(g->workers);
    free(g);
    return st;
  }
  pthread_mutex_init(&g->mutex, NULL);
  pthread_cond_init(&g->work_cv, NULL);
  pthread_cond_init(&g->done_cv, NULL);
  for (int r = 0; r < k; ++r) {
    worker *w = &g->workers[r];
    w->group = g;
    w->rank = r;
    w->threads = threads[r] > 0 ? threads[r] : 1;
    int err = pthread_create(&w->thread, NULL, worker_main, w);
    if (err != 0) {
      dp_group_destroy(g);
      return DP_FAIL(DP_ERR_RUNTIME, "pthread_create for replica %d failed: %s", r, strerror(err));
    }
    w->started = 1;
  }
  *out = g;
  return DP_OK;
}

void dp_group_destroy(dp_group *g) {
  if (!g) return;
  pthread_mutex_lock(&g->mutex);
  g->stopping = 1;
  pthread_cond_broadcast(&g->work_cv);
  pthread_mutex_unlock(&g->mutex);
  for (int r = 0; r < g->k; ++r)
    if (g->workers[r].started) pthread_join(g->workers[r].thread, NULL);
  pthread_cond_destroy(&g->work_cv);
  pthread_cond_destroy(&g->done_cv);
  pthread_mutex_destroy(&g->mutex);
  dp_barrier_destroy(&g->barrier);
  free(g->workers);
  free(g);
}

int dp_group_size(const dp_group *g) { return g->k; }

dp_barrier *dp_group_barrier(dp_group *g) { return &g->barrier; }

dp_status dp_group_run(dp_group *g, dp_group_fn fn, void *arg) {
  dp_barrier_reset(&g->barrier); /* no worker is inside it between runs */
  pthread_mutex_lock(&g->mutex);
  g->fn = fn;
  g->arg = arg;
  g->pending = g->k;
  g->generation++;
  pthread_cond_broadcast(&g->work_cv);
  while (g->pending > 0) pthread_cond_wait(&g->done_cv, &g->mutex);
  pthread_mutex_unlock(&g->mutex);
  /* the cause, not the peers that gave up waiting for it */
  for (int pass = 0; pass < 2; ++pass)
    for (int r = 0; r < g->k; ++r) {
      const dp_status s = g->workers[r].status;
      if (s != DP_OK && (pass == 1 || s != DP_ERR_ABORTED)) {
        dp_error_set_message(g->workers[r].message);
        return s;
      }
    }
  return DP_OK;
}
