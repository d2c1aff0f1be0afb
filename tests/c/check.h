/* check.h — the C test programs' CHECK (count a failed condition, say where)
 * and their random numbers. */
#ifndef DP_TEST_CHECK_H
#define DP_TEST_CHECK_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

static int failures = 0;
#define CHECK(cond)                                                            \
  do {                                                                         \
    if (!(cond)) {                                                             \
      fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
      failures++;                                                              \
    }                                                                          \
  } while (0)

/* uniform in [0, 1), a fixed sequence (an LCG) */
static unsigned rng_state = 12345u;
static inline float uniform(void) {
  rng_state = rng_state * 1664525u + 1013904223u;
  return (float)(rng_state >> 8) / (float)(1u << 24);
}

/* n uniform numbers in [-1, 1) (malloc'ed; NULL when out of memory) */
static inline float *signed_randoms(int64_t n) {
  float *p = malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
  if (p)
    for (int64_t i = 0; i < n; ++i) p[i] = 2.0f * uniform() - 1.0f;
  return p;
}

#endif
