/* sync_failures.c — a replica group whose lock or condition variable cannot be
 * made is a DP_ERR_RUNTIME from dp_group_create, with every one it did make
 * destroyed and nothing leaked, never a group whose threads wait on an
 * uninitialized condition variable.
 *
 * tests/test_sanitizers.py links this program with
 * -Wl,--wrap=pthread_mutex_init,--wrap=pthread_cond_init,
 * --wrap=pthread_mutex_destroy,--wrap=pthread_cond_destroy, so the core's
 * calls go through the wrappers below, which count the live objects and can
 * fail one chosen init. A group is made once to count its inits, then once per
 * init with that one failing; then once more whole, run and destroyed.
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "replica.h"
#include "check.h"

int __real_pthread_mutex_init(pthread_mutex_t *m, const pthread_mutexattr_t *a);
int __real_pthread_cond_init(pthread_cond_t *c, const pthread_condattr_t *a);
int __real_pthread_mutex_destroy(pthread_mutex_t *m);
int __real_pthread_cond_destroy(pthread_cond_t *c);

/* the core makes its groups' locks on the calling thread only */
static int inits;        /* wrapped inits so far */
static int fail_at = -1; /* the init that fails (-1: none) */
static int live;         /* made and not yet destroyed */

static int fail_now(void) { return inits++ == fail_at; }

int __wrap_pthread_mutex_init(pthread_mutex_t *m, const pthread_mutexattr_t *a) {
  if (fail_now()) return EAGAIN;
  const int err = __real_pthread_mutex_init(m, a);
  live += err == 0;
  return err;
}
int __wrap_pthread_cond_init(pthread_cond_t *c, const pthread_condattr_t *a) {
  if (fail_now()) return EAGAIN;
  const int err = __real_pthread_cond_init(c, a);
  live += err == 0;
  return err;
}
int __wrap_pthread_mutex_destroy(pthread_mutex_t *m) {
  live--;
  return __real_pthread_mutex_destroy(m);
}
int __wrap_pthread_cond_destroy(pthread_cond_t *c) {
  live--;
  return __real_pthread_cond_destroy(c);
}

static int ran[3];

static dp_status mark(void *arg, int rank) {
  ran[rank] = 1;
  return DP_OK;
}

int main(void) {
  const int threads[3] = {1, 1, 1};
  dp_group *g = NULL;
  CHECK(dp_group_create(3, threads, NULL, &g) == DP_OK && g);
  const int total = inits;
  CHECK(total >= 3); /* the wrappers see the group's lock and condition variables */
  dp_group_destroy(g);
  CHECK(live == 0);
  for (int i = 0; i < total; ++i) {
    inits = 0;
    fail_at = i;
    g = NULL;
    const dp_status st = dp_group_create(3, threads, NULL, &g);
    CHECK(st == DP_ERR_RUNTIME && g == NULL);
    CHECK(strstr(dp_error_message(), "_init failed") != NULL);
    CHECK(live == 0); /* every lock it made, destroyed */
    if (st == DP_OK) dp_group_destroy(g);
  }
  fail_at = -1;
  CHECK(dp_group_create(3, threads, NULL, &g) == DP_OK);
  CHECK(dp_group_run(g, mark, NULL) == DP_OK && ran[0] && ran[1] && ran[2]);
  dp_group_destroy(g);
  CHECK(live == 0);
  printf("sync_failures: %s (%d inits failed one at a time)\n", failures ? "FAILED" : "ok", total);
  return failures ? 1 : 0;
}
