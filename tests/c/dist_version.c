/* dist_version.c — dp_dist_library_version asked first by several threads at
 * once: every one gets the same first line of MPI's words, with no data race
 * (tests/test_sanitizers.py builds it with -fsanitize=thread, dist.c with its
 * MPI code).
 *
 * Linked with -Wl,--wrap=MPI_Get_library_version: the wrapper below stands
 * for MPI's, writing its words through memcpy, so that ThreadSanitizer sees
 * every write into dist.c's buffer (libmpi's own are not instrumented, and
 * its locks would order the threads' calls).
 */
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "dist.h"
#include "check.h"

static const char words[] = "Test MPI v1.2.3, ident: 1.2.3 ,, \nsecond line";

int __wrap_MPI_Get_library_version(char *version, int *len) {
  memcpy(version, words, sizeof words);
  *len = (int)strlen(words);
  return 0; /* MPI_SUCCESS */
}

enum { THREADS = 8 };

static const char *seen[THREADS];
static pthread_barrier_t start;

static void *ask(void *arg) {
  const int i = (int)(long)arg;
  pthread_barrier_wait(&start);
  seen[i] = dp_dist_library_version();
  return NULL;
}

int main(void) {
  pthread_t threads[THREADS];
  pthread_barrier_init(&start, NULL, THREADS);
  for (long i = 0; i < THREADS; ++i) pthread_create(&threads[i], NULL, ask, (void *)i);
  for (int i = 0; i < THREADS; ++i) pthread_join(threads[i], NULL);
  pthread_barrier_destroy(&start);
  const char *first = dp_dist_library_version();
  CHECK(strcmp(first, "Test MPI v1.2.3, ident: 1.2.3") == 0); /* the first line, its trailing commas and spaces cut */
  for (int i = 0; i < THREADS; ++i) CHECK(seen[i] == first && strcmp(seen[i], first) == 0);
  printf("dist_version: %s (%s)\n", failures ? "FAILED" : "ok", first);
  return failures ? 1 : 0;
}
