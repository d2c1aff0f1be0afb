/* check.h — the C test programs' CHECK: count a failed condition, say where. */
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

#endif
