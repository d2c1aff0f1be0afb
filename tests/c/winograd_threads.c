/* winograd_threads.c — Winograd F(2x2, 3x3) (csrc/winograd.c) gives the same
 * bits whatever its thread count: y and dx (a sample's tiles in its own GEMMs
 * on wide planes; a chunk's, the same chunks, on narrow ones) and dw, db (the
 * batch in the same chunks, each entry's GEMM summing them in order). With
 * AVX-512 every thread also transforms the entries of its own GEMMs, each at
 * the largest chunk's place: 1, 2, 3, 5 and 17 threads (17: more threads than
 * the 16 entries) on wide and narrow planes with chunks of unequal sizes, and
 * small planes in lanes (plane_lanes) in groups of unequal sizes, odd ones
 * with their edge tiles' unused entries skipped (the threads' entries then
 * split by their columns).
 * tests/test_small_gemm.py builds it for this CPU (-march=native, as the
 * extension) under ASan and UBSan. Without AVX-512 the GEMMs are OpenBLAS's:
 * the same bits too, as long as they run single-threaded (inside an active
 * region, or with the thread count cpu_enter sets).
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "winograd.h"
#include "conv_outputs.h"

static int run(const dp_conv_geom *g, int64_t N, const float *x, const float *w, const float *b, const float *dy,
               int nt, outputs *o) {
  const int64_t xs = N * g->C * g->H * g->W, ys = N * g->O * g->OH * g->OW;
  const size_t floats = dp_winograd_scratch_floats(g, N, nt); /* the forward pass's, dx's and dw's */
  /* as the CPU backend's cpu_enter: the device's thread count is the calling thread's OpenMP one
   * (with one thread the region is inactive, and OpenBLAS's OpenMP build would otherwise run its
   * GEMMs on all the cores, in other bits than the single-threaded calls inside a region) */
  omp_set_num_threads(nt);
  float *scratch = outputs_alloc(g, N, floats, o);
  if (!scratch) return 0;
  CHECK(dp_winograd_forward(g, N, x, w, b, o->y, nt, scratch, NULL) == DP_OK);
  CHECK(dp_winograd_backward_dx(g, N, w, dy, o->dx, nt, scratch, NULL) == DP_OK);
  /* and dx from the forward pass's kept filter transform: the same bits */
  const size_t uf = dp_winograd_u_floats(g);
  float *u = aligned_alloc(64, (uf * sizeof(float) + 63) & ~(size_t)63), *y2 = malloc(sizeof(float) * (size_t)ys),
        *dx2 = malloc(sizeof(float) * (size_t)xs);
  if (u && y2 && dx2) {
    CHECK(dp_winograd_forward(g, N, x, w, b, y2, nt, scratch, u) == DP_OK);
    CHECK(dp_winograd_backward_dx(g, N, w, dy, dx2, nt, scratch, u) == DP_OK);
    CHECK(memcmp(y2, o->y, sizeof(float) * (size_t)ys) == 0);
    CHECK(memcmp(dx2, o->dx, sizeof(float) * (size_t)xs) == 0);
  } else {
    CHECK(!"out of memory");
  }
  free(u), free(y2), free(dx2);
  CHECK(dp_winograd_backward_dw(g, N, x, dy, o->dw, o->db, nt, scratch) == DP_OK);
  free(scratch);
  return 1;
}

static void check_geometry(int64_t N, int C, int H, int O) {
  const dp_conv_geom g = {C, H, H, O, 3, 3, 1, 1, H, H};
  const int64_t xs = N * C * H * H, ys = N * O * H * H;
  float *x = signed_randoms(xs), *w = signed_randoms((int64_t)O * C * 9), *b = signed_randoms(O),
        *dy = signed_randoms(ys);
  outputs one = {0};
  if (!x || !w || !b || !dy || !run(&g, N, x, w, b, dy, 1, &one)) {
    CHECK(!"out of memory");
  } else {
    static const int threads[] = {2, 3, 5, 17};
    for (size_t i = 0; i < sizeof threads / sizeof threads[0]; ++i) {
      outputs many = {0};
      if (!run(&g, N, x, w, b, dy, threads[i], &many)) {
        CHECK(!"out of memory");
      } else {
        const int same = memcmp(one.y, many.y, sizeof(float) * (size_t)ys) == 0 &&
                         memcmp(one.dx, many.dx, sizeof(float) * (size_t)xs) == 0 &&
                         memcmp(one.dw, many.dw, sizeof(float) * (size_t)O * C * 9) == 0 &&
                         memcmp(one.db, many.db, sizeof(float) * (size_t)O) == 0;
        CHECK(same);
        if (!same)
          fprintf(stderr, "N %ld C %d H %d O %d: %d threads differ from 1\n", (long)N, C, H, O, threads[i]);
      }
      release(&many);
    }
  }
  release(&one);
  free(x), free(w), free(b), free(dy);
}

int main(void) {
  check_geometry(7, 64, 40, 64);   /* wide; dw in chunks of 1, 2, 2, 2 samples */
  check_geometry(3, 64, 28, 72);   /* wide, ResNet-18's first stage's plane, more outputs than inputs */
  check_geometry(17, 256, 7, 256); /* narrow; chunks of 8 and 9 samples */
  check_geometry(5, 80, 4, 64);    /* narrow, 2x2 tiles a sample, one chunk */
  check_geometry(2, 64, 9, 65);    /* wide, odd sides and channels */
  check_geometry(11, 64, 3, 64);   /* narrow, groups of 4 3x3 planes in lanes (4, 4, 3), through a buffer */
  check_geometry(21, 64, 2, 72);   /* narrow, groups of 16 2x2 planes (16, 5) */
  check_geometry(6, 64, 5, 64);    /* narrow, odd 5x5: the edge tiles' entries 3, 7, 11-15 skipped (9, 6, 4 tiles) */
  check_geometry(19, 64, 1, 64);   /* 1x1 planes (16, 3): entries 3, 7, 11-15 kept by no tile */
  printf(failures ? "winograd_threads: FAILED\n" : "winograd_threads: ok\n");
  return failures ? 1 : 0;
}
