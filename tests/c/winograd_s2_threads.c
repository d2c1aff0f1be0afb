/* winograd_s2_threads.c — the stride-2 Winograd (csrc/winograd_s2.c) with its
 * blocks made small, so that a handful of samples crosses every boundary the
 * shipped sizes reach only on large batches: several groups of chunks, the
 * backward pass's blocks of one tile (both of its ways: the threads on their
 * own chunks, where U is small and there are 2 chunks or more, dw's partial
 * sums carried across groups; else a block shared), the forward pass's blocks
 * split across chunks and its rounds of 8 output channels. Each geometry:
 *
 *   - y, dx, dw and db against a double-precision direct convolution (within
 *     1e-4 of the largest value: float32 sums of at most a few thousand terms);
 *   - the same bits on 1, 2, 3, 5 and 17 threads (17: more threads than the
 *     16 matrices dw deals out, and than the tiles of some batches);
 *   - a second run with other numbers in the scratch: the same bits.
 *
 * tests/test_small_gemm.py builds it for this CPU (-march=native) under ASan
 * and UBSan.
 */
#define S2_PLANES_FLOATS ((int64_t)1 << 16)
#define S2_BLOCK_FLOATS ((int64_t)1 << 16)
#define S2_V_FLOATS ((int64_t)1 << 13)
#define S2_V_MAX_FLOATS ((int64_t)1 << 15)
#define S2_U_FLOATS ((int64_t)1 << 14)
#define S2_M_FLOATS ((int64_t)1 << 12)
#define S2_PRIVATE_U_FLOATS ((int64_t)1 << 15)
#define S2_PRIVATE_FLOATS ((int64_t)1 << 13)
#include "winograd_s2.c"

#include <math.h>
#include <stdlib.h>

#include "check.h"
#include "conv_outputs.h"

static int run(const dp_conv_geom *g, int64_t N, const float *x, const float *w, const float *b, const float *dy,
               int nt, outputs *o) {
  size_t floats = dp_s2_scratch_floats(g, N, nt, DP_S2_FORWARD);
  if (dp_s2_scratch_floats(g, N, nt, DP_S2_BACKWARD) > floats) floats = dp_s2_scratch_floats(g, N, nt, DP_S2_BACKWARD);
  omp_set_num_threads(nt); /* as the CPU backend's cpu_enter (see winograd_threads.c) */
  float *scratch = outputs_alloc(g, N, floats, o);
  if (!scratch) return 0;
  for (size_t i = 0; i < floats; ++i) scratch[i] = NAN; /* nothing may read what it did not write */
  CHECK(dp_s2_forward(g, N, x, w, b, o->y, nt, scratch) == DP_OK);
  CHECK(dp_s2_backward(g, N, x, w, dy, o->dx, o->dw, o->db, nt, scratch) == DP_OK);
  free(scratch);
  return 1;
}

/* the largest |a - ref| over the largest |ref| (at least 1) */
static double rel_err(const float *a, const double *ref, int64_t n) {
  double e = 0.0, m = 1.0;
  for (int64_t i = 0; i < n; ++i) {
    const double d = fabs((double)a[i] - ref[i]);
    if (!(d <= e)) e = d; /* NaN sticks */
    if (fabs(ref[i]) > m) m = fabs(ref[i]);
  }
  return e / m;
}

/* y, dx, dw, db of the direct convolution in double */
static int check_reference(const dp_conv_geom *g, int64_t N, const float *x, const float *w, const float *b,
                           const float *dy, const outputs *o) {
  const int C = g->C, O = g->O, H = g->H, W = g->W, OH = g->OH, OW = g->OW;
  const int64_t xs = N * C * H * W, ys = N * O * OH * OW, ws = (int64_t)O * C * 9;
  double *y = calloc((size_t)ys, sizeof(double)), *dx = calloc((size_t)xs, sizeof(double)),
         *dw = calloc((size_t)ws, sizeof(double)), *db = calloc((size_t)O, sizeof(double));
  if (!y || !dx || !dw || !db) {
    free(y), free(dx), free(dw), free(db);
    return 0;
  }
  for (int64_t n = 0; n < N; ++n)
    for (int oc = 0; oc < O; ++oc)
      for (int i = 0; i < OH; ++i)
        for (int j = 0; j < OW; ++j) {
          const int64_t yi = ((n * O + oc) * OH + i) * OW + j;
          double s = b[oc];
          for (int c = 0; c < C; ++c)
            for (int a = 0; a < 3; ++a)
              for (int e = 0; e < 3; ++e) {
                const int r = 2 * i + a - 1, q = 2 * j + e - 1;
                if (r < 0 || r >= H || q < 0 || q >= W) continue;
                const int64_t xi = ((n * C + c) * H + r) * W + q, wi = ((int64_t)(oc * C + c) * 3 + a) * 3 + e;
                s += (double)w[wi] * x[xi];
                dx[xi] += (double)w[wi] * dy[yi];
                dw[wi] += (double)x[xi] * dy[yi];
              }
          y[yi] = s;
          db[oc] += dy[yi];
        }
  const double ey = rel_err(o->y, y, ys), edx = rel_err(o->dx, dx, xs), edw = rel_err(o->dw, dw, ws),
               edb = rel_err(o->db, db, O);
  CHECK(ey < 1e-4 && edx < 1e-4 && edw < 1e-4 && edb < 1e-4);
  if (!(ey < 1e-4 && edx < 1e-4 && edw < 1e-4 && edb < 1e-4))
    fprintf(stderr, "N %ld C %d %dx%d O %d: errors y %g dx %g dw %g db %g\n", (long)N, C, H, W, O, ey, edx, edw, edb);
  free(y), free(dx), free(dw), free(db);
  return 1;
}

static int same(const outputs *a, const outputs *b, int64_t xs, int64_t ys, int64_t ws, int O) {
  return memcmp(a->y, b->y, sizeof(float) * (size_t)ys) == 0 && memcmp(a->dx, b->dx, sizeof(float) * (size_t)xs) == 0 &&
         memcmp(a->dw, b->dw, sizeof(float) * (size_t)ws) == 0 && memcmp(a->db, b->db, sizeof(float) * (size_t)O) == 0;
}

static void check_geometry(int64_t N, int C, int H, int W, int O) {
  const dp_conv_geom g = {C, H, W, O, 3, 3, 2, 1, (H - 1) / 2 + 1, (W - 1) / 2 + 1};
  const int64_t xs = N * C * H * W, ys = N * O * g.OH * g.OW, ws = (int64_t)O * C * 9;
  float *x = signed_randoms(xs), *w = signed_randoms(ws), *b = signed_randoms(O), *dy = signed_randoms(ys);
  outputs one = {0};
  if (!x || !w || !b || !dy || !run(&g, N, x, w, b, dy, 1, &one) || !check_reference(&g, N, x, w, b, dy, &one)) {
    CHECK(!"out of memory");
  } else {
    static const int threads[] = {2, 3, 5, 17, 1};
    for (size_t i = 0; i < sizeof threads / sizeof threads[0]; ++i) {
      outputs many = {0};
      if (!run(&g, N, x, w, b, dy, threads[i], &many)) {
        CHECK(!"out of memory");
      } else {
        const int ok = same(&one, &many, xs, ys, ws, O);
        CHECK(ok);
        if (!ok)
          fprintf(stderr, "N %ld C %d %dx%d O %d: %d threads differ from 1\n", (long)N, C, H, W, O, threads[i]);
      }
      release(&many);
    }
  }
  release(&one);
  free(x), free(w), free(b), free(dy);
}

int main(void) {
  check_geometry(20, 32, 9, 11, 40); /* two chunks (16 + 4): two groups, each thread its own backward; 5x6
                                        outputs, edge tiles half outside */
  check_geometry(16, 64, 28, 28, 72); /* ResNet-18's first downsampling plane, one chunk in many blocks */
  check_geometry(33, 48, 7, 7, 64);  /* three chunks (16, 16, 1), 2x2 tiles a sample; U over S2_U_FLOATS and
                                        S2_PRIVATE_U_FLOATS: the shared backward blocks */
  check_geometry(5, 40, 1, 1, 33);   /* a 1x1 plane, one short chunk, output rows not a multiple of 8 */
  check_geometry(17, 33, 6, 3, 35);  /* a 3x2 output, odd channel counts */
  printf(failures ? "winograd_s2_threads: FAILED\n" : "winograd_s2_threads: ok\n");
  return failures ? 1 : 0;
}
