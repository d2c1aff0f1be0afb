/* device_registry.c — the device registry (csrc/device.c) without Python,
 * under AddressSanitizer, LeakSanitizer and UndefinedBehaviorSanitizer
 * (tests/test_sanitizers.py): a device made once and shared, destroyed with
 * its last reference; names refused; logical devices and the core shares;
 * devices made before a reconfiguration stay usable; gets, puts and step
 * locks from several threads at once; nothing left alive or leaked. */
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "check.h"
#include "device.h"
#include "model.h"

static int live_count(void) { return dp_devices_live(NULL, NULL, 0); }

/* The references the registry holds for dev's entry (name and core count
 * identify it among the live ones); 0 when it is not live. */
static int refs_of(const dp_device *dev) {
  dp_device_info infos[DP_DEVICES_MAX];
  int refs[DP_DEVICES_MAX];
  int n = dp_devices_live(infos, refs, DP_DEVICES_MAX);
  for (int i = 0; i < n && i < DP_DEVICES_MAX; ++i)
    if (strcmp(infos[i].name, dev->name) == 0 && infos[i].nthreads == dev->nthreads) return refs[i];
  return 0;
}

static void check_sharing(void) {
  dp_device *a = NULL, *b = NULL, *c = NULL;
  CHECK(live_count() == 0);
  CHECK(dp_device_get("cpu:0", &a) == DP_OK && a);
  CHECK(dp_device_get("cpu", &b) == DP_OK && b == a); /* "cpu" is cpu:0 */
  CHECK(dp_device_get_index(DP_DEVICE_CPU, 0, 0, &c) == DP_OK && c == a);
  CHECK(live_count() == 1 && refs_of(a) == 3);
  CHECK(a->kind == DP_DEVICE_CPU && a->index == 0 && strcmp(a->name, "cpu:0") == 0);
  CHECK(a->nthreads == dp_cpu_core_count()); /* one logical device: every core */
  /* two models on one device share it; the device outlives them */
  dp_model *m1 = NULL, *m2 = NULL;
  CHECK(dp_model_create(a, 1, 4, 4, &m1) == DP_OK && dp_model_create(b, 1, 4, 4, &m2) == DP_OK);
  CHECK(m1 && m2 && m1->dev == m2->dev);
  if (m1 && m2) {
    CHECK(dp_model_add_flatten(m1) == DP_OK && dp_model_add_dense(m1, 3) == DP_OK && dp_model_finalize(m1) == DP_OK);
    CHECK(dp_model_add_flatten(m2) == DP_OK && dp_model_add_dense(m2, 5) == DP_OK && dp_model_finalize(m2) == DP_OK);
  }
  dp_model_destroy(m1);
  dp_model_destroy(m2);
  dp_device_put(c);
  dp_device_put(b);
  CHECK(live_count() == 1 && refs_of(a) == 1);
  dp_device_put(a);
  CHECK(live_count() == 0);
  dp_device_put(NULL); /* fine */
  /* a device its caller made is not the registry's: put leaves it alone, and
   * it has no step lock to take (py_ops.c's device is one) */
  dp_device own;
  CHECK(dp_cpu_device_init(&own, 0, 1) == DP_OK);
  CHECK(own.entry == NULL);
  dp_device_put(&own);
  CHECK(own.ctx != NULL);
  dp_device_lock(&own);
  dp_device_lock(&own); /* nothing held: not even a second lock waits */
  dp_device_unlock(&own);
  dp_device_unlock(&own);
  dp_device_destroy(&own);
  /* an explicit core count other than the share is a device of its own */
  if (dp_cpu_core_count() > 1) {
    CHECK(dp_device_get_index(DP_DEVICE_CPU, 0, 1, &a) == DP_OK && a && a->nthreads == 1);
    CHECK(dp_device_get_index(DP_DEVICE_CPU, 0, 0, &b) == DP_OK && b && b != a);
    CHECK(dp_device_get_index(DP_DEVICE_CPU, 0, 1, &c) == DP_OK && c == a);
    CHECK(live_count() == 2);
    dp_device_put(a);
    dp_device_put(b);
    dp_device_put(c);
  }
  CHECK(live_count() == 0);
}

static void check_names(void) {
  const char *bad[] = {"gpu", "cpu:", "cpu:-1", "cpu:1", "cpu:0x", "cpu0", "cpu:00000000000000000001", "cpu: 0",
                       "cuda:", "cuda:64", "", "cpu:0:0"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; ++i) {
    dp_device own, *d = &own; /* not NULL: a failed get must clear it */
    CHECK(dp_device_get(bad[i], &d) == DP_ERR_VALUE && d == NULL);
    if (d) dp_device_put(d);
  }
  dp_device *d = NULL;
  /* this program is built without the CUDA backend (and there is no GPU here) */
  const dp_status st = dp_device_get("cuda:0", &d);
  CHECK((st == DP_ERR_UNSUPPORTED || st == DP_ERR_CUDA) && d == NULL);
  CHECK(strstr(dp_error_message(), "cuda:0") != NULL);
  CHECK(dp_device_get_index(DP_DEVICE_CPU, 0, -1, &d) == DP_ERR_VALUE && d == NULL);
  /* DP_MAX_THREADS: 100000 threads once ended the process in libgomp */
  CHECK(dp_device_get_index(DP_DEVICE_CPU, 0, DP_MAX_THREADS + 1, &d) == DP_ERR_VALUE && d == NULL);
  CHECK(dp_device_get_index(DP_DEVICE_CPU, 0, 100000, &d) == DP_ERR_VALUE && d == NULL);
  CHECK(dp_device_get_index(DP_DEVICE_CUDA, 0, 2, &d) == DP_ERR_VALUE && d == NULL);
  CHECK(live_count() == 0);
}

static void check_logical(void) {
  const int cores = dp_cpu_core_count();
  dp_device_info list[2 * DP_DEVICES_MAX];
  CHECK(dp_devices_logical(DP_DEVICE_CPU) == 1 && dp_devices_list(list, 2 * DP_DEVICES_MAX) == 1);
  dp_device *before = NULL;
  CHECK(dp_device_get("cpu:0", &before) == DP_OK && before);
  for (int k = 1; k <= DP_DEVICES_MAX; ++k) {
    CHECK(dp_devices_set_logical(DP_DEVICE_CPU, k) == DP_OK);
    const int n = dp_devices_list(list, 2 * DP_DEVICES_MAX);
    CHECK(n == k); /* no GPU here */
    int sum = 0;
    for (int i = 0; i < n && i < k; ++i) {
      char name[32];
      snprintf(name, sizeof name, "cpu:%d", i);
      CHECK(strcmp(list[i].name, name) == 0 && list[i].kind == DP_DEVICE_CPU && list[i].index == i);
      CHECK(list[i].physical == -1);
      /* cores / k each, the first cores % k one more, at least one */
      const int want = cores / k + (i < cores % k);
      CHECK(list[i].nthreads == (want > 0 ? want : 1));
      sum += list[i].nthreads;
    }
    CHECK(k > cores || sum == cores);
  }
  /* refused counts change nothing */
  CHECK(dp_devices_set_logical(DP_DEVICE_CPU, 0) == DP_ERR_VALUE);
  CHECK(dp_devices_set_logical(DP_DEVICE_CPU, DP_DEVICES_MAX + 1) == DP_ERR_VALUE);
  CHECK(dp_devices_set_logical(DP_DEVICE_CUDA, 2) == DP_ERR_VALUE); /* no usable GPU */
  CHECK(strstr(dp_error_message(), "usable CUDA device") != NULL);
  CHECK(dp_devices_logical(DP_DEVICE_CPU) == DP_DEVICES_MAX && dp_devices_logical(DP_DEVICE_CUDA) == 1);
  /* the device made before keeps its cores and works; a get now makes cpu:0
   * with its new share (or shares the old one where the share is the same) */
  CHECK(before->nthreads == cores);
  float *buf = NULL;
  CHECK(dp_device_alloc(before, 64, (void **)&buf) == DP_OK && buf);
  CHECK(before->backend->fill(before, buf, 16, 2.0f) == DP_OK && buf && buf[15] == 2.0f);
  dp_device_free(before, buf);
  dp_device *after = NULL;
  CHECK(dp_device_get("cpu:63", &after) == DP_OK && after && after->nthreads == list[63].nthreads);
  dp_device_put(after);
  CHECK(dp_devices_set_logical(DP_DEVICE_CPU, 2) == DP_OK);
  CHECK(dp_device_get("cpu:0", &after) == DP_OK && after);
  const int share0 = cores / 2 + (cores % 2 > 0);
  CHECK(after && after->nthreads == (share0 > 0 ? share0 : 1));
  CHECK(after && (after == before) == (after->nthreads == cores));
  CHECK(live_count() == (after == before ? 1 : 2));
  dp_device_put(before);
  dp_device_put(after);
  CHECK(live_count() == 0);
  CHECK(dp_devices_set_logical(DP_DEVICE_CPU, 1) == DP_OK);
}

/* Each thread gets and puts cpu:0 and cpu:1 over and over, and adds to a
 * counter under cpu:0's step lock: every increment counted, nothing left. */
enum { THREADS = 4, ROUNDS = 2000 };
static long counter;

static void *hammer(void *arg) {
  (void)arg;
  for (int i = 0; i < ROUNDS; ++i) {
    dp_device *a = NULL, *b = NULL;
    if (dp_device_get("cpu:0", &a) != DP_OK || dp_device_get(i % 2 ? "cpu:1" : "cpu:0", &b) != DP_OK) {
      dp_device_put(a);
      return (void *)1;
    }
    dp_device_lock(a);
    const long seen = counter;
    counter = seen + 1; /* a lost update here would be a race the lock allows */
    dp_device_unlock(a);
    dp_device_put(b);
    dp_device_put(a);
  }
  return NULL;
}

static void check_threads(void) {
  CHECK(dp_devices_set_logical(DP_DEVICE_CPU, 2) == DP_OK);
  pthread_t t[THREADS];
  int started = 0;
  for (int i = 0; i < THREADS; ++i) started += pthread_create(&t[i], NULL, hammer, NULL) == 0;
  CHECK(started == THREADS);
  for (int i = 0; i < started; ++i) {
    void *ret = NULL;
    CHECK(pthread_join(t[i], &ret) == 0 && ret == NULL);
  }
  CHECK(counter == (long)started * ROUNDS);
  CHECK(live_count() == 0);
  CHECK(dp_devices_set_logical(DP_DEVICE_CPU, 1) == DP_OK);
}

int main(void) {
  check_sharing();
  check_names();
  check_logical();
  check_threads();
  if (failures) fprintf(stderr, "%d checks failed\n", failures);
  printf("device_registry: %s\n", failures ? "FAILED" : "ok");
  return failures ? 1 : 0;
}
