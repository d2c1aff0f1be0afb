/* kernel_bodies.c — the DP_HD bodies the CUDA launchers call, run on the CPU.
 *
 * The CUDA kernels in kernels/elementwise.cu call the flat-index forms of the
 * bodies (one thread per output element). The CPU backend calls the per-plane
 * forms. This program runs the flat-index forms exactly as a grid-stride loop
 * would, and checks them bit for bit against the CPU backend on the same
 * inputs, so the arithmetic a GPU runs is exercised by the CPU test suite.
 * Exit status 0 only if every comparison matched. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "collective.h"
#include "dp_kernels.h"

static int failures = 0;

static unsigned rng = 777u;
static float uniform(void) {
  rng = rng * 1664525u + 1013904223u;
  return (float)(rng >> 8) / (float)(1u << 24) - 0.5f;
}

static void expect_same(const char *what, const float *a, const float *b, int64_t n) {
  if (memcmp(a, b, sizeof(float) * (size_t)n) != 0) {
    int64_t i = 0;
    while (i < n && memcmp(&a[i], &b[i], sizeof(float)) == 0) ++i;
    fprintf(stderr, "%s: element %lld differs: %.9g vs %.9g\n", what, (long long)i, (double)a[i], (double)b[i]);
    failures++;
  }
}

/* A backend call the comparison depends on: its failure is a failure of the
 * check, with the core's message. */
#define EXPECT_OK(call) expect_ok(#call, (call))
static void expect_ok(const char *what, dp_status s) {
  if (s != DP_OK) {
    fprintf(stderr, "%s failed: %s\n", what, dp_error_message());
    failures++;
  }
}

static float *randoms(int64_t n) {
  float *p = malloc(sizeof(float) * (size_t)(n ? n : 1));
  for (int64_t i = 0; i < n; ++i) p[i] = uniform();
  return p;
}

static void check_pooling(dp_device *dev, int N, int C, int H, int W, int k, int stride, int pad) {
  dp_pool_geom g = {C, H, W, dp_pool_out_dim(H, k, stride, pad), dp_pool_out_dim(W, k, stride, pad), k, stride, pad};
  const int64_t nin = (int64_t)N * C * H * W, nout = (int64_t)N * C * g.OH * g.OW;
  float *x = randoms(nin), *dy = randoms(nout);
  float *y_gpu = malloc(sizeof(float) * nout), *y_cpu = malloc(sizeof(float) * nout);
  float *dx_gpu = malloc(sizeof(float) * nin), *dx_cpu = malloc(sizeof(float) * nin);
  int32_t *arg_gpu = malloc(sizeof(int32_t) * nout), *arg_cpu = malloc(sizeof(int32_t) * nout);
  char what[96];

  for (int64_t o = 0; o < nout; ++o) y_gpu[o] = dp_avgpool_forward_elem(x, &g, o);
  EXPECT_OK(dev->backend->avgpool_forward(dev, &g, N, x, y_cpu));
  snprintf(what, sizeof what, "avgpool forward k%d s%d p%d", k, stride, pad);
  expect_same(what, y_gpu, y_cpu, nout);

  for (int64_t i = 0; i < nin; ++i) dx_gpu[i] = dp_avgpool_backward_elem(dy, &g, i);
  EXPECT_OK(dev->backend->avgpool_backward(dev, &g, N, dy, dx_cpu));
  snprintf(what, sizeof what, "avgpool backward k%d s%d p%d", k, stride, pad);
  expect_same(what, dx_gpu, dx_cpu, nin);

  for (int64_t o = 0; o < nout; ++o) y_gpu[o] = dp_maxpool_forward_elem(x, &g, o, &arg_gpu[o]);
  EXPECT_OK(dev->backend->maxpool_forward(dev, &g, N, x, y_cpu, arg_cpu));
  snprintf(what, sizeof what, "maxpool forward k%d s%d p%d", k, stride, pad);
  expect_same(what, y_gpu, y_cpu, nout);
  if (memcmp(arg_gpu, arg_cpu, sizeof(int32_t) * (size_t)nout) != 0) {
    fprintf(stderr, "maxpool argmax differs\n");
    failures++;
  }
  for (int64_t i = 0; i < nin; ++i) dx_gpu[i] = dp_maxpool_backward_elem(dy, arg_gpu, &g, i);
  EXPECT_OK(dev->backend->maxpool_backward(dev, &g, N, dy, arg_cpu, dx_cpu));
  snprintf(what, sizeof what, "maxpool backward k%d s%d p%d", k, stride, pad);
  expect_same(what, dx_gpu, dx_cpu, nin);

  free(x), free(dy), free(y_gpu), free(y_cpu), free(dx_gpu), free(dx_cpu), free(arg_gpu), free(arg_cpu);
}

static void check_elementwise(dp_device *dev) {
  const int64_t n = 1003;
  float *x = randoms(n), *dy = randoms(n), *a = malloc(sizeof(float) * n), *b = malloc(sizeof(float) * n);
  for (int64_t i = 0; i < n; ++i) a[i] = dp_relu_forward_elem(x[i]);
  EXPECT_OK(dev->backend->relu_forward(dev, n, x, b));
  expect_same("relu forward", a, b, n);
  for (int64_t i = 0; i < n; ++i) a[i] = dp_relu_backward_elem(x[i], dy[i]);
  EXPECT_OK(dev->backend->relu_backward(dev, n, x, dy, b));
  expect_same("relu backward", a, b, n);
  for (int64_t i = 0; i < n; ++i) a[i] = dp_add_elem(x[i], dy[i]);
  EXPECT_OK(dev->backend->add(dev, n, x, dy, b));
  expect_same("add", a, b, n);

  uint8_t u8[256];
  float ua[256], ub[256];
  for (int i = 0; i < 256; ++i) u8[i] = (uint8_t)i, ua[i] = dp_u8_to_unit_elem(u8[i]);
  EXPECT_OK(dev->backend->u8_to_unit(dev, ub, u8, 256));
  expect_same("u8 to unit", ua, ub, 256);

  /* SGD: the kernel's per-element body against the backend's fused loop */
  float *w1 = randoms(n), *w2 = malloc(sizeof(float) * n), *v1 = randoms(n), *v2 = malloc(sizeof(float) * n);
  memcpy(w2, w1, sizeof(float) * n);
  memcpy(v2, v1, sizeof(float) * n);
  for (int64_t i = 0; i < n; ++i) dp_sgd_elem(w1, dy, v1, i, 0.05f, 0.9f, 1e-4f);
  EXPECT_OK(dev->backend->sgd_update(dev, n, w2, dy, v2, 0.05f, 0.9f, 1e-4f));
  expect_same("sgd weights", w1, w2, n);
  expect_same("sgd velocity", v1, v2, n);

  /* bias fill: what the CUDA conv epilogue writes, against the CPU conv with zero weights */
  const int C = 5, HW = 7;
  float bias[5] = {0.5f, -1.0f, 2.0f, 0.25f, -0.125f}, fill[2 * 5 * 7], conv[2 * 5 * 7], zeros[5 * 3 * 9 * 9] = {0};
  for (int64_t i = 0; i < 2 * C * HW; ++i) fill[i] = dp_bias_value_elem(bias, i, C, HW);
  dp_conv_geom g = {3, 7, 9, 5, 3, 3, 1, 1, 7, 9};
  float *xin = randoms(2 * 3 * 7 * 9), *yout = malloc(sizeof(float) * 2 * 5 * 63);
  EXPECT_OK(dev->backend->conv2d_forward(dev, &g, 2, xin, zeros, bias, yout));
  for (int s = 0; s < 2; ++s)
    for (int c = 0; c < C; ++c)
      for (int p = 0; p < HW; ++p) conv[(s * C + c) * HW + p] = yout[(s * C + c) * 63 + p];
  expect_same("bias value", fill, conv, 2 * C * HW);

  free(x), free(dy), free(a), free(b), free(w1), free(w2), free(v1), free(v2), free(xin), free(yout);
}

static void check_softmax(dp_device *dev) {
  const int N = 9, K = 10;
  float *logits = randoms(N * K), d1[9 * 10], d2[9 * 10];
  int32_t labels[9];
  for (int i = 0; i < N; ++i) labels[i] = (i * 7) % K, logits[i * K] *= 1000.0f;
  float loss1[9];
  int correct1 = 0;
  for (int r = 0; r < N; ++r) {
    int hit;
    loss1[r] = dp_softmax_xent_row(logits + r * K, K, labels[r], 0.25f, d1 + r * K, &hit);
    correct1 += hit;
  }
  double loss2;
  int64_t correct2;
  EXPECT_OK(dev->backend->softmax_xent(dev, N, K, logits, labels, 0.25f, d2, &loss2, &correct2));
  expect_same("softmax dlogits", d1, d2, N * K);
  double sum = 0.0;
  for (int r = 0; r < N; ++r) sum += loss1[r];
  if (sum != loss2 || correct1 != correct2) {
    fprintf(stderr, "softmax loss/correct differ: %.17g vs %.17g, %d vs %lld\n", sum, loss2, correct1,
            (long long)correct2);
    failures++;
  }
  free(logits);
}

static void check_batchnorm(dp_device *dev) {
  const int N = 3, C = 4, HW = 10;
  const int64_t n = (int64_t)N * C * HW;
  float *x = randoms(n), *dy = randoms(n), *y1 = malloc(sizeof(float) * n), *y2 = malloc(sizeof(float) * n);
  float mean[4], sqdev[4], invstd1[4], invstd2[4], rm1[4] = {0}, rv1[4] = {1, 1, 1, 1}, rm2[4] = {0},
                                                    rv2[4] = {1, 1, 1, 1};
  float gamma[4] = {1.0f, 0.5f, -2.0f, 1.5f}, beta[4] = {0.0f, 0.1f, -0.2f, 0.3f};
  EXPECT_OK(dev->backend->bn_sums(dev, N, C, HW, x, NULL, mean));
  for (int c = 0; c < C; ++c) mean[c] /= (float)(N * HW);
  EXPECT_OK(dev->backend->bn_sums(dev, N, C, HW, x, mean, sqdev));
  for (int c = 0; c < C; ++c)
    dp_bn_finalize_channel(sqdev[c], (float)(N * HW), mean[c], 1e-5f, 0.1f, 1, &invstd1[c], &rm1[c], &rv1[c]);
  EXPECT_OK(dev->backend->bn_finalize(dev, C, sqdev, (float)(N * HW), mean, 1e-5f, 0.1f, 1, invstd2, rm2, rv2));
  expect_same("bn invstd", invstd1, invstd2, C);
  expect_same("bn running mean", rm1, rm2, C);
  expect_same("bn running var", rv1, rv2, C);
  for (int64_t i = 0; i < n; ++i) {
    const int c = (int)((i / HW) % C);
    y1[i] = dp_bn_apply_elem(x[i], mean[c], invstd1[c], gamma[c], beta[c]);
  }
  EXPECT_OK(dev->backend->bn_apply(dev, N, C, HW, x, mean, invstd1, gamma, beta, y2));
  expect_same("bn apply", y1, y2, n);
  float sdy[4], sdx[4];
  EXPECT_OK(dev->backend->bn_backward_sums(dev, N, C, HW, x, dy, mean, invstd1, sdy, sdx));
  for (int64_t i = 0; i < n; ++i) {
    const int c = (int)((i / HW) % C);
    y1[i] = dp_bn_backward_elem(x[i], dy[i], mean[c], invstd1[c], gamma[c], sdy[c], sdx[c], 1.0f / (N * HW));
  }
  EXPECT_OK(dev->backend->bn_backward_dx(dev, N, C, HW, x, dy, mean, invstd1, gamma, sdy, sdx, 1.0f / (N * HW), y2));
  expect_same("bn backward", y1, y2, n);
  free(x), free(dy), free(y1), free(y2);
}

/* dp_sum_parts_elem (the CUDA reduction's body) against the CPU all-reduce */
static void check_sum_parts(void) {
  for (int k = 1; k <= 5; ++k) {
    const int64_t n = 1031;
    float *bufs[5], *expected = malloc(sizeof(float) * n);
    for (int r = 0; r < k; ++r) bufs[r] = randoms(n);
    for (int64_t i = 0; i < n; ++i) expected[i] = dp_sum_parts_elem((const float *const *)bufs, k, i);
    dp_barrier bar;
    EXPECT_OK(dp_barrier_init(&bar, 1));
    /* one thread plays every rank in turn: the chunks are disjoint, and a
     * barrier of count 1 never waits */
    /* and dp_allreduce_elem (the logical-GPU all-reduce kernel's body) on copies */
    float *copies[5];
    for (int r = 0; r < k; ++r) {
      copies[r] = malloc(sizeof(float) * n);
      memcpy(copies[r], bufs[r], sizeof(float) * n);
    }
    for (int64_t i = 0; i < n; ++i) dp_allreduce_elem(copies, k, i, 1.0f);
    for (int rank = 0; rank < k; ++rank)
      if (dp_allreduce(bufs, k, rank, n, DP_REDUCE_SUM, &bar) != DP_OK) {
        fprintf(stderr, "dp_allreduce k=%d rank %d failed\n", k, rank);
        failures++;
      }
    dp_barrier_destroy(&bar);
    for (int r = 0; r < k; ++r) {
      char what[64];
      snprintf(what, sizeof what, "all-reduce k=%d replica %d", k, r);
      expect_same(what, expected, bufs[r], n);
      snprintf(what, sizeof what, "dp_allreduce_elem k=%d replica %d", k, r);
      expect_same(what, expected, copies[r], n);
      free(bufs[r]);
      free(copies[r]);
    }
    free(expected);
  }
}

/* dp_gather_elem (the resident dataset's gather, byte by byte as the GPU runs
 * it) against the CPU backend's row copies: images of 13 bytes, labels of 4 */
static void check_gather(dp_device *dev) {
  const int64_t count = 50, nrows = 37;
  int32_t rows[37];
  for (int64_t r = 0; r < nrows; ++r) rows[r] = (int32_t)((r * 17 + 3) % count);
  for (int64_t row_bytes = 1; row_bytes <= 13; row_bytes += 3) {
    uint8_t *src = malloc((size_t)(count * row_bytes)), *a = malloc((size_t)(nrows * row_bytes)),
            *b = malloc((size_t)(nrows * row_bytes));
    for (int64_t i = 0; i < count * row_bytes; ++i) src[i] = (uint8_t)(i * 31 + 7);
    for (int64_t i = 0; i < nrows * row_bytes; ++i) a[i] = dp_gather_elem(src, rows, row_bytes, i);
    EXPECT_OK(dev->backend->gather_rows(dev, nrows, row_bytes, src, rows, b));
    if (memcmp(a, b, (size_t)(nrows * row_bytes)) != 0) {
      fprintf(stderr, "gather rows of %lld bytes: body and CPU backend differ\n", (long long)row_bytes);
      failures++;
    }
    for (int64_t r = 0; r < nrows; ++r)
      if (memcmp(b + r * row_bytes, src + rows[r] * row_bytes, (size_t)row_bytes) != 0) {
        fprintf(stderr, "gather rows of %lld bytes: row %lld is not source row %d\n", (long long)row_bytes,
                (long long)r, rows[r]);
        failures++;
      }
    free(src), free(a), free(b);
  }
}

int main(void) {
  dp_device dev;
  if (dp_cpu_device_init(&dev, 0, 2) != DP_OK) return 2;
  check_pooling(&dev, 2, 3, 7, 7, 2, 2, 0);
  check_pooling(&dev, 1, 2, 9, 6, 3, 2, 1);
  check_pooling(&dev, 3, 1, 5, 5, 3, 1, 1);
  check_pooling(&dev, 2, 4, 28, 28, 2, 2, 0);
  check_elementwise(&dev);
  check_softmax(&dev);
  check_batchnorm(&dev);
  check_sum_parts();
  check_gather(&dev);
  dp_device_destroy(&dev);
  printf("kernel_bodies: %s\n", failures ? "FAILED" : "ok");
  return failures ? 1 : 0;
}
