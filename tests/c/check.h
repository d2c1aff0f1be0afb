/* check.h — the C test programs' CHECK (count a failed condition, say where)
 * and their random numbers. */
#ifndef DP_TEST_CHECK_H
#define DP_TEST_CHECK_H

#include <stdio.h>

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

#endif
