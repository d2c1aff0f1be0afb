#include "replica.h"

#include "device.h"

#include <omp.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

typedef struct worker {
  dp_group *group;
  int rank, threads;
  int pinned;     /* cores holds the worker's cores */
  cpu_set_t cores;
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
  /* before the first parallel region: the OpenMP threads this worker starts
   * inherit its cores. A refusal (a container's narrower mask) leaves the
   * worker where the scheduler puts it: pinning is a placement hint, never
   * an error. */
  if (w->pinned) (void)pthread_setaffinity_np(pthread_self(), sizeof w->cores, &w->cores);
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

dp_status dp_pin_threads_enabled(int *on) { return dp_env_switch("DPCORE_PIN_THREADS", 0, on); }

/* The cores of logical CPU device `index` of `count`: the index-th contiguous
 * block of this process's allowed cores, blocks sized as the devices' thread
 * shares (the first cores % count devices one core more). 0 when the mask
 * cannot be read or the device would have no core of its own. */
static int cpu_device_cores(int index, int count, cpu_set_t *out) {
  cpu_set_t allowed;
  if (count < 1 || index < 0 || index >= count || sched_getaffinity(0, sizeof allowed, &allowed) != 0) return 0;
  const int cores = CPU_COUNT(&allowed);
  if (cores < count) return 0;
  int first = 0;
  for (int i = 0; i < index; ++i) first += cores / count + (i < cores % count ? 1 : 0);
  const int share = cores / count + (index < cores % count ? 1 : 0);
  CPU_ZERO(out);
  for (int cpu = 0, seen = 0; cpu < CPU_SETSIZE && seen < first + share; ++cpu) {
    if (!CPU_ISSET(cpu, &allowed)) continue;
    if (seen >= first) CPU_SET(cpu, out);
    ++seen;
  }
  return 1;
}

/* g's lock and condition variables: DP_OK, or DP_ERR_RUNTIME with none of
 * them left initialized. */
static dp_status group_sync_init(dp_group *g) {
  int err = pthread_mutex_init(&g->mutex, NULL);
  if (err != 0) return DP_FAIL(DP_ERR_RUNTIME, "replica group: pthread_mutex_init failed: %s", strerror(err));
  if ((err = pthread_cond_init(&g->work_cv, NULL)) == 0) {
    if ((err = pthread_cond_init(&g->done_cv, NULL)) == 0) return DP_OK;
    pthread_cond_destroy(&g->work_cv);
  }
  pthread_mutex_destroy(&g->mutex);
  return DP_FAIL(DP_ERR_RUNTIME, "replica group: pthread_cond_init failed: %s", strerror(err));
}

dp_status dp_group_create(int k, const int *threads, const int *cpu_device, dp_group **out) {
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
  if (st == DP_OK && (st = group_sync_init(g)) != DP_OK) dp_barrier_destroy(&g->barrier);
  if (st != DP_OK) {
    free(g->workers);
    free(g);
    return st;
  }
  for (int r = 0; r < k; ++r) {
    worker *w = &g->workers[r];
    w->group = g;
    w->rank = r;
    w->threads = threads[r] > 0 ? threads[r] : 1;
    if (cpu_device && cpu_device[r] >= 0)
      w->pinned = cpu_device_cores(cpu_device[r], dp_devices_logical(DP_DEVICE_CPU), &w->cores);
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
