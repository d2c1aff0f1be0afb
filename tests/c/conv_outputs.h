/* conv_outputs.h — one convolution's y, dx, dw and db (3x3 filters) and the scratch
 * they are computed in, as the Winograd thread tests (winograd_threads.c,
 * winograd_s2_threads.c) allocate and compare them. Include after the header that
 * defines dp_conv_geom (backend.h). */
#ifndef DP_TEST_CONV_OUTPUTS_H
#define DP_TEST_CONV_OUTPUTS_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct outputs {
  float *y, *dx, *dw, *db;
} outputs;

/* o's arrays for geometry g at batch N, and a 64-byte-aligned scratch of `floats` floats:
 * the scratch, or NULL when an allocation failed (what o holds is then release()'s to free). */
static float *outputs_alloc(const dp_conv_geom *g, int64_t N, size_t floats, outputs *o) {
  const int64_t xs = N * g->C * g->H * g->W, ys = N * g->O * g->OH * g->OW;
  float *scratch = aligned_alloc(64, (floats * sizeof(float) + 63) & ~(size_t)63);
  o->y = malloc(sizeof(float) * (size_t)ys);
  o->dx = malloc(sizeof(float) * (size_t)xs);
  o->dw = malloc(sizeof(float) * (size_t)g->O * g->C * 9);
  o->db = malloc(sizeof(float) * (size_t)g->O);
  if (!scratch || !o->y || !o->dx || !o->dw || !o->db) {
    free(scratch);
    return NULL;
  }
  return scratch;
}

static void release(outputs *o) {
  free(o->y), free(o->dx), free(o->dw), free(o->db);
  memset(o, 0, sizeof *o);
}

#endif
