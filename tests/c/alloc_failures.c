/* alloc_failures.c — every failed allocation of the core is a DP_ERR_MEMORY,
 * never a crash, a leak or a result computed from memory it did not get.
 *
 * tests/test_sanitizers.py links this program with
 * -Wl,--wrap=malloc,--wrap=calloc,--wrap=realloc,--wrap=aligned_alloc, so
 * every allocation the core's objects make goes through the wrappers below,
 * which can fail one chosen call. A training scenario (conv on both CPU
 * paths, average and max pooling with window tables, BatchNorm, dense, a
 * resident dataset) is run once to count its allocations, then once more per
 * allocation with that one failing: each run must end in DP_ERR_MEMORY and
 * free everything (LeakSanitizer). Then pooling's window tables and the
 * convolution scratch are failed through the backend table directly, as the
 * single ops (dp.ops.*) call them.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "model.h"
#include "resident.h"
#include "check.h"

void *__real_malloc(size_t n);
void *__real_calloc(size_t count, size_t n);
void *__real_realloc(void *p, size_t n);
void *__real_aligned_alloc(size_t align, size_t n);

/* The core allocates only from the calling thread (never inside its OpenMP
 * regions), so a plain counter sees its calls in program order. */
static long allocations;  /* wrapped calls so far */
static long fail_at = -1; /* the call that fails (-1: none) */

static int fail_now(void) { return allocations++ == fail_at; }

void *__wrap_malloc(size_t n) { return fail_now() ? NULL : __real_malloc(n); }
void *__wrap_calloc(size_t count, size_t n) { return fail_now() ? NULL : __real_calloc(count, n); }
void *__wrap_realloc(void *p, size_t n) { return fail_now() ? NULL : __real_realloc(p, n); }
void *__wrap_aligned_alloc(size_t align, size_t n) { return fail_now() ? NULL : __real_aligned_alloc(align, n); }

enum { SIDE = 12, BATCH = 5 };

/* inputs live in static storage: the program's own buffers are no allocations to fail */
static float images[BATCH * SIDE * SIDE];
static uint8_t images_u8[BATCH * SIDE * SIDE];
static int64_t labels[BATCH];
static float logits[BATCH * 10];

/* Everything a training run allocates, from the model's layers to a resident
 * dataset's rows; the first failure is returned, *m and *res hold what was
 * made (the caller destroys them). */
static dp_status scenario(dp_device *dev, dp_model **m, dp_resident **res) {
  DP_TRY(dp_model_create(dev, 1, SIDE, SIDE, m));
  DP_TRY(dp_model_add_conv2d(*m, 4, 3, 1, 0));  /* one channel, valid: the direct path */
  DP_TRY(dp_model_add_conv2d(*m, 6, 3, 1, 1));  /* im2col + GEMM */
  DP_TRY(dp_model_add_avgpool(*m, 3, 2, 1));    /* window tables in backward */
  DP_TRY(dp_model_add_batchnorm(*m, 1e-5f, 0.1f));
  DP_TRY(dp_model_add_maxpool(*m, 2, 1, 1));    /* argmax buffers, window tables */
  DP_TRY(dp_model_add_relu(*m));
  DP_TRY(dp_model_add_flatten(*m));
  DP_TRY(dp_model_add_dense(*m, 10));
  DP_TRY(dp_model_finalize(*m));
  dp_batch b = {images, 0, labels, BATCH, NULL, NULL};
  double loss;
  int64_t correct;
  DP_TRY(dp_model_forward_backward(*m, &b, 1.0f / BATCH, &loss, &correct));
  DP_TRY(dp_model_sgd_step(*m, 0.1f, 0.9f, 0.0f));
  dp_batch bu = {images_u8, 1, labels, BATCH, NULL, NULL};
  DP_TRY(dp_model_evaluate(*m, &bu, &loss, &correct));
  DP_TRY(dp_model_predict(*m, &bu, logits));
  DP_TRY(dp_resident_create(dev, images_u8, 1, labels, BATCH, SIDE * SIDE, 10, res));
  const int64_t rows[3] = {4, 0, 2};
  DP_TRY(dp_model_load_rows(*m, *res, rows, 3));
  return dp_model_forward_backward_loaded(*m, 3, 1.0f / 3, NULL, &loss, &correct);
}

/* The scenario on a fresh device (its scratch starts empty, so every run
 * allocates the same sequence), with allocation number `fail` of it failing
 * (-1: none). Returns the scenario's status; *count receives its allocations. */
static dp_status run_failing(long fail, long *count) {
  dp_device dev;
  if (dp_cpu_device_init(&dev, 0, 2) != DP_OK) return DP_ERR_RUNTIME;
  dp_model *m = NULL;
  dp_resident *res = NULL;
  const long start = allocations;
  fail_at = fail < 0 ? -1 : start + fail;
  const dp_status st = scenario(&dev, &m, &res);
  fail_at = -1;
  *count = allocations - start;
  dp_resident_destroy(res);
  dp_model_destroy(m);
  dp_device_destroy(&dev);
  return st;
}

/* A backend call with its next allocation failing. */
#define FAIL_NEXT(status, call) \
  do {                          \
    fail_at = allocations;      \
    status = (call);            \
    fail_at = -1;               \
  } while (0)

static void check_single_ops(void) {
  dp_device dev;
  if (dp_cpu_device_init(&dev, 0, 2) != DP_OK) {
    CHECK(!"cpu device");
    return;
  }
  static float x[2 * 3 * 9 * 9], y[2 * 4 * 9 * 9], w[4 * 3 * 3 * 3]; /* y: the conv output, the largest */
  static int32_t arg[2 * 3 * 9 * 9];
  dp_pool_geom pg;
  CHECK(dp_pool_geom_make("test pool", 3, 9, 9, 3, 2, 1, &pg) == DP_OK);
  dp_status st;
  /* the window tables of the general (not 2x2) pooling backward */
  FAIL_NEXT(st, dev.backend->avgpool_backward(&dev, &pg, 2, y, x));
  CHECK(st == DP_ERR_MEMORY && strstr(dp_error_message(), "window tables") != NULL);
  CHECK(dev.backend->maxpool_forward(&dev, &pg, 2, x, y, arg) == DP_OK);
  FAIL_NEXT(st, dev.backend->maxpool_backward(&dev, &pg, 2, y, arg, x));
  CHECK(st == DP_ERR_MEMORY && strstr(dp_error_message(), "window tables") != NULL);
  /* and with the memory there, the same calls succeed */
  CHECK(dev.backend->avgpool_backward(&dev, &pg, 2, y, x) == DP_OK);
  CHECK(dev.backend->maxpool_backward(&dev, &pg, 2, y, arg, x) == DP_OK);
  /* the convolution's scratch (im2col and GEMM buffers), and the softmax rows in it */
  dp_conv_geom cg;
  CHECK(dp_conv_geom_make("test conv", 3, 9, 9, 4, 3, 3, 1, 1, &cg) == DP_OK);
  FAIL_NEXT(st, dev.backend->conv2d_forward(&dev, &cg, 2, x, w, NULL, y, NULL));
  CHECK(st == DP_ERR_MEMORY && strstr(dp_error_message(), "scratch") != NULL);
  CHECK(dev.backend->conv2d_forward(&dev, &cg, 2, x, w, NULL, y, NULL) == DP_OK);
  /* a large Winograd layer's kept filter transform (backend.h: dp_conv_keep), allocated on first use:
   * a failed allocation leaves it invalid, and the backward pass then transforms w itself */
  static float kx[256 * 4 * 4], ky[256 * 4 * 4], kw[256 * 256 * 9], kdx[256 * 4 * 4], kdw[256 * 256 * 9], kdb[256];
  dp_conv_geom kg;
  CHECK(dp_conv_geom_make("test keep", 256, 4, 4, 256, 3, 3, 1, 1, &kg) == DP_OK);
  dp_conv_keep keep = {0};
  CHECK(dev.backend->conv2d_forward(&dev, &kg, 1, kx, kw, NULL, ky, NULL) == DP_OK); /* the scratch, grown */
  FAIL_NEXT(st, dev.backend->conv2d_forward(&dev, &kg, 1, kx, kw, NULL, ky, &keep));
  CHECK(st == DP_ERR_MEMORY && !keep.valid && !keep.u);
  CHECK(dev.backend->conv2d_backward(&dev, &kg, 1, kx, kw, ky, kdx, kdw, kdb, &keep) == DP_OK);
  CHECK(dev.backend->conv2d_forward(&dev, &kg, 1, kx, kw, NULL, ky, &keep) == DP_OK && keep.valid && keep.u);
  CHECK(dev.backend->conv2d_backward(&dev, &kg, 1, kx, kw, ky, kdx, kdw, kdb, &keep) == DP_OK);
  dp_device_free(&dev, keep.u);
  dp_device_destroy(&dev);
}

int main(void) {
  for (int i = 0; i < BATCH * SIDE * SIDE; ++i) {
    images[i] = uniform();
    images_u8[i] = (uint8_t)(255.0f * images[i]);
  }
  for (int i = 0; i < BATCH; ++i) labels[i] = i % 10;

  long total = 0, count = 0;
  CHECK(run_failing(-1, &total) == DP_OK);
  CHECK(total >= 30); /* the wrappers see the core's allocations */
  for (long i = 0; i < total; ++i) {
    const dp_status st = run_failing(i, &count);
    if (st != DP_ERR_MEMORY) {
      fprintf(stderr, "allocation %ld of %ld failing: status %s (%s)\n", i, total, dp_status_name(st),
              dp_error_message());
      failures++;
    }
  }
  check_single_ops();
  if (failures) fprintf(stderr, "%d checks failed\n", failures);
  printf("alloc_failures: %s (%ld allocations failed one at a time)\n", failures ? "FAILED" : "ok", total);
  return failures ? 1 : 0;
}
