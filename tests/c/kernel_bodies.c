/* kernel_bodies.c — the DP_HD bodies the CUDA launchers call, run on the CPU,
 * against loops written here.
 *
 * The CUDA kernels in kernels/ .cu files call the flat-index forms of the bodies
 * (one thread per output element); the CPU backend calls the per-plane forms
 * of the same bodies. Comparing one with the other cannot catch a wrong body,
 * so both are compared with a reference written independently in this file
 * from the formula each body documents: scatter loops where the bodies gather,
 * double precision where the arithmetic is not fixed to the bit.
 *
 * Exact comparisons where the formula fixes every rounding (ReLU, add, SGD in
 * PyTorch's order, the bias fill, max pooling, the gather, the rank-ordered
 * float sum of the all-reduce). Elsewhere a tolerance: REL_TOL, relative to
 * max(1, |reference|), for a float32 result of at most a few dozen roundings
 * (pooling averages, BatchNorm); SOFTMAX_TOL for expf/logf (a few ulp each).
 * A bug in an index or a term is an error of order 0.1 here.
 *
 * The GPU runs these bodies bit for bit as the CPU does: nvcc compiles them
 * with --fmad=false and the C build with -ffp-contract=off (setup.py), except
 * expf/logf, whose CUDA versions differ from libm's by a few ulp.
 * Exit status 0 only if every comparison matched. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "collective.h"
#include "dp_kernels.h"

#define REL_TOL 1e-6
#define SOFTMAX_TOL 1e-5

static int failures = 0;

static unsigned rng = 777u;
static float uniform(void) {
  rng = rng * 1664525u + 1013904223u;
  return (float)(rng >> 8) / (float)(1u << 24) - 0.5f;
}

static void expect_same(const char *what, const float *a, const float *ref, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (memcmp(&a[i], &ref[i], sizeof(float)) != 0) {
      fprintf(stderr, "%s: element %lld is %.9g, the reference %.9g\n", what, (long long)i, (double)a[i],
              (double)ref[i]);
      failures++;
      return;
    }
}

static void expect_close(const char *what, const float *a, const double *ref, int64_t n, double tol) {
  for (int64_t i = 0; i < n; ++i)
    if (!(fabs((double)a[i] - ref[i]) <= tol * fmax(1.0, fabs(ref[i])))) {
      fprintf(stderr, "%s: element %lld is %.9g, the reference %.9g (tolerance %g)\n", what, (long long)i,
              (double)a[i], ref[i], tol);
      failures++;
      return;
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

static float *floats(int64_t n) { return malloc(sizeof(float) * (size_t)(n ? n : 1)); }
static double *doubles(int64_t n) { return calloc((size_t)(n ? n : 1), sizeof(double)); }

/* ---- pooling: references by windows (forward) and by scattering (backward) -- */

static void check_pooling(dp_device *dev, int N, int C, int H, int W, int k, int stride, int pad) {
  dp_pool_geom g = {C, H, W, (int)dp_pool_out_dim(H, k, stride, pad), (int)dp_pool_out_dim(W, k, stride, pad), k,
                    stride, pad};
  const int64_t nin = (int64_t)N * C * H * W, nout = (int64_t)N * C * g.OH * g.OW;
  float *x = randoms(nin), *dy = randoms(nout), *a = floats(nin > nout ? nin : nout);
  float *ymax = floats(nout);
  double *avg = doubles(nout), *davg = doubles(nin), *dmax = doubles(nin);
  int32_t *arg_ref = malloc(sizeof(int32_t) * (size_t)nout), *arg = malloc(sizeof(int32_t) * (size_t)nout);
  for (int64_t nc = 0; nc < (int64_t)N * C; ++nc)
    for (int oh = 0; oh < g.OH; ++oh)
      for (int ow = 0; ow < g.OW; ++ow) {
        const int64_t o = (nc * g.OH + oh) * g.OW + ow;
        double s = 0.0;
        int best = -1;
        for (int i = 0; i < k; ++i)
          for (int j = 0; j < k; ++j) {
            const int h = oh * stride - pad + i, w = ow * stride - pad + j;
            if (h < 0 || h >= H || w < 0 || w >= W) continue; /* padding: counted in k*k, never a winner */
            const int64_t at = nc * H * W + h * W + w;
            s += x[at];
            if (best < 0 || x[at] > x[nc * H * W + best]) best = h * W + w; /* the first maximum wins */
          }
        avg[o] = s / (k * k);
        ymax[o] = x[nc * H * W + best];
        arg_ref[o] = best;
        for (int i = 0; i < k; ++i) /* scatter each window's gradient back */
          for (int j = 0; j < k; ++j) {
            const int h = oh * stride - pad + i, w = ow * stride - pad + j;
            if (h >= 0 && h < H && w >= 0 && w < W) davg[nc * H * W + h * W + w] += (double)dy[o] / (k * k);
          }
        dmax[nc * H * W + best] += dy[o];
      }
  char what[128];
#define POOL_WHAT(s) (snprintf(what, sizeof what, "%s k%d s%d p%d", s, k, stride, pad), what)
  for (int64_t o = 0; o < nout; ++o) a[o] = dp_avgpool_forward_elem(x, &g, o);
  expect_close(POOL_WHAT("avgpool forward (body)"), a, avg, nout, REL_TOL);
  EXPECT_OK(dev->backend->avgpool_forward(dev, &g, N, x, a));
  expect_close(POOL_WHAT("avgpool forward (cpu)"), a, avg, nout, REL_TOL);

  for (int64_t i = 0; i < nin; ++i) a[i] = dp_avgpool_backward_elem(dy, &g, i);
  expect_close(POOL_WHAT("avgpool backward (body)"), a, davg, nin, REL_TOL);
  EXPECT_OK(dev->backend->avgpool_backward(dev, &g, N, dy, a));
  expect_close(POOL_WHAT("avgpool backward (cpu)"), a, davg, nin, REL_TOL);

  for (int64_t o = 0; o < nout; ++o) a[o] = dp_maxpool_forward_elem(x, &g, o, &arg[o]);
  expect_same(POOL_WHAT("maxpool forward (body)"), a, ymax, nout);
  if (memcmp(arg, arg_ref, sizeof(int32_t) * (size_t)nout) != 0) {
    fprintf(stderr, "%s: argmax differs\n", POOL_WHAT("maxpool forward (body)"));
    failures++;
  }
  EXPECT_OK(dev->backend->maxpool_forward(dev, &g, N, x, a, arg));
  expect_same(POOL_WHAT("maxpool forward (cpu)"), a, ymax, nout);
  if (memcmp(arg, arg_ref, sizeof(int32_t) * (size_t)nout) != 0) {
    fprintf(stderr, "%s: argmax differs\n", POOL_WHAT("maxpool forward (cpu)"));
    failures++;
  }
  for (int64_t i = 0; i < nin; ++i) a[i] = dp_maxpool_backward_elem(dy, arg_ref, &g, i);
  expect_close(POOL_WHAT("maxpool backward (body)"), a, dmax, nin, REL_TOL);
  EXPECT_OK(dev->backend->maxpool_backward(dev, &g, N, dy, arg_ref, a));
  expect_close(POOL_WHAT("maxpool backward (cpu)"), a, dmax, nin, REL_TOL);
#undef POOL_WHAT
  free(x), free(dy), free(a), free(ymax), free(avg), free(davg), free(dmax), free(arg_ref), free(arg);
}

/* ---- element-wise ----------------------------------------------------------- */

static void check_elementwise(dp_device *dev) {
  const int64_t n = 1003;
  float *x = randoms(n), *dy = randoms(n), *a = floats(n), *ref = floats(n);

  for (int64_t i = 0; i < n; ++i) ref[i] = x[i] > 0.0f ? x[i] : 0.0f;
  for (int64_t i = 0; i < n; ++i) a[i] = dp_relu_forward_elem(x[i]);
  expect_same("relu forward (body)", a, ref, n);
  EXPECT_OK(dev->backend->relu_forward(dev, n, x, a));
  expect_same("relu forward (cpu)", a, ref, n);

  for (int64_t i = 0; i < n; ++i) ref[i] = x[i] > 0.0f ? dy[i] : 0.0f;
  for (int64_t i = 0; i < n; ++i) a[i] = dp_relu_backward_elem(x[i], dy[i]);
  expect_same("relu backward (body)", a, ref, n);
  EXPECT_OK(dev->backend->relu_backward(dev, n, x, dy, a));
  expect_same("relu backward (cpu)", a, ref, n);

  for (int64_t i = 0; i < n; ++i) ref[i] = x[i] + dy[i];
  for (int64_t i = 0; i < n; ++i) a[i] = dp_add_elem(x[i], dy[i]);
  expect_same("add (body)", a, ref, n);
  EXPECT_OK(dev->backend->add(dev, n, x, dy, a));
  expect_same("add (cpu)", a, ref, n);

  /* v / 255; the body multiplies by the rounded reciprocal: within an ulp */
  uint8_t u8[256];
  float ua[256];
  double uref[256];
  for (int i = 0; i < 256; ++i) u8[i] = (uint8_t)i, uref[i] = i / 255.0, ua[i] = dp_u8_to_unit_elem(u8[i]);
  expect_close("u8 to unit (body)", ua, uref, 256, 1.2e-7);
  EXPECT_OK(dev->backend->u8_to_unit(dev, ua, u8, 256));
  expect_close("u8 to unit (cpu)", ua, uref, 256, 1.2e-7);

  /* SGD, torch.optim.SGD's order: g' = g + wd w; v = mu v + g'; w -= lr v */
  const float lr = 0.05f, mu = 0.9f, wd = 1e-4f;
  float *w0 = randoms(n), *v0 = randoms(n), *wref = floats(n), *vref = floats(n), *w = floats(n), *v = floats(n);
  for (int64_t i = 0; i < n; ++i) {
    const float gp = dy[i] + wd * w0[i];
    vref[i] = mu * v0[i] + gp;
    wref[i] = w0[i] - lr * vref[i];
  }
  memcpy(w, w0, sizeof(float) * n), memcpy(v, v0, sizeof(float) * n);
  for (int64_t i = 0; i < n; ++i) dp_sgd_elem(w, dy, v, i, lr, mu, wd);
  expect_same("sgd weights (body)", w, wref, n);
  expect_same("sgd velocity (body)", v, vref, n);
  memcpy(w, w0, sizeof(float) * n), memcpy(v, v0, sizeof(float) * n);
  EXPECT_OK(dev->backend->sgd_update(dev, n, w, dy, v, lr, mu, wd, NULL));
  expect_same("sgd weights (cpu)", w, wref, n);
  expect_same("sgd velocity (cpu)", v, vref, n);
  /* without momentum the velocity is not used: w -= lr (g + wd w) */
  for (int64_t i = 0; i < n; ++i) wref[i] = w0[i] - lr * (dy[i] + wd * w0[i]);
  memcpy(w, w0, sizeof(float) * n);
  for (int64_t i = 0; i < n; ++i) dp_sgd_elem(w, dy, NULL, i, lr, 0.0f, wd);
  expect_same("sgd without momentum (body)", w, wref, n);

  /* the bias fill of the CUDA convolution's epilogue: y (2, C, HW) */
  enum { C = 5, HW = 7 };
  const float bias[C] = {0.5f, -1.0f, 2.0f, 0.25f, -0.125f};
  float fill[2 * C * HW], fill_ref[2 * C * HW];
  for (int s = 0; s < 2; ++s)
    for (int c = 0; c < C; ++c)
      for (int p = 0; p < HW; ++p) fill_ref[(s * C + c) * HW + p] = bias[c];
  for (int64_t i = 0; i < 2 * C * HW; ++i) fill[i] = dp_bias_value_elem(bias, i, C, HW);
  expect_same("bias value (body)", fill, fill_ref, 2 * C * HW);

  /* row sums: the bias gradients and global average pooling, y (N, C) the
   * mean of each plane of x (N, C, HW) */
  enum { PLANES = 6, AREA = 49 };
  float rows_sum[PLANES], gap[PLANES];
  double rows_ref[PLANES] = {0}, gap_ref[PLANES];
  for (int p = 0; p < PLANES; ++p) {
    for (int i = 0; i < AREA; ++i) rows_ref[p] += x[p * AREA + i];
    gap_ref[p] = rows_ref[p] / AREA;
    rows_sum[p] = dp_row_sum(x + p * AREA, AREA);
  }
  expect_close("row sum (body)", rows_sum, rows_ref, PLANES, REL_TOL);
  EXPECT_OK(dev->backend->global_avgpool_forward(dev, 2, PLANES / 2, AREA, x, gap));
  expect_close("global average pool (cpu)", gap, gap_ref, PLANES, REL_TOL);

  free(x), free(dy), free(a), free(ref), free(w0), free(v0), free(wref), free(vref), free(w), free(v);
}

/* ---- softmax cross-entropy: a double-precision reference ------------------- */

static void check_softmax(dp_device *dev) {
  enum { N = 9, K = 10 };
  const float scale = 0.25f;
  float *logits = randoms(N * K), d[N * K], loss[N];
  double dref[N * K], lref[N], total = 0.0;
  int32_t labels[N];
  int hits_ref = 0, hits = 0;
  for (int i = 0; i < N; ++i) labels[i] = (i * 7) % K, logits[i * K] *= 1000.0f; /* one row far from the others */
  for (int r = 0; r < N; ++r) {
    const float *z = logits + r * K;
    int am = 0;
    double mx = z[0], s = 0.0;
    for (int j = 1; j < K; ++j)
      if (z[j] > z[am]) am = j;
    mx = z[am];
    for (int j = 0; j < K; ++j) s += exp((double)z[j] - mx);
    lref[r] = log(s) + mx - z[labels[r]];
    for (int j = 0; j < K; ++j) dref[r * K + j] = scale * (exp((double)z[j] - mx) / s - (j == labels[r]));
    hits_ref += am == labels[r];
    total += lref[r];
  }
  for (int r = 0; r < N; ++r) {
    int hit;
    loss[r] = dp_softmax_xent_row(logits + r * K, K, labels[r], scale, d + r * K, &hit);
    hits += hit;
  }
  expect_close("softmax loss rows (body)", loss, lref, N, SOFTMAX_TOL);
  expect_close("softmax dlogits (body)", d, dref, N * K, SOFTMAX_TOL);
  double loss_cpu;
  int64_t hits_cpu;
  EXPECT_OK(dev->backend->softmax_xent(dev, N, K, logits, labels, scale, d, &loss_cpu, &hits_cpu));
  expect_close("softmax dlogits (cpu)", d, dref, N * K, SOFTMAX_TOL);
  if (hits != hits_ref || hits_cpu != hits_ref || !(fabs(loss_cpu - total) <= SOFTMAX_TOL * fmax(1.0, total))) {
    fprintf(stderr, "softmax: hits %d (body) %lld (cpu) vs %d, loss %.9g vs %.9g\n", hits, (long long)hits_cpu,
            hits_ref, loss_cpu, total);
    failures++;
  }
  free(logits);
}

/* ---- NaN and infinities: PyTorch's semantics, and the step guard ------------ */

/* Bitwise equality, NaN included (a NaN's bits are whatever the body made, so
 * NaN positions are compared as "is NaN" and the rest exactly). */
static void expect_nan_same(const char *what, const float *a, const float *ref, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (isnan(ref[i]) ? !isnan(a[i]) : (isnan(a[i]) || a[i] != ref[i])) {
      fprintf(stderr, "%s: [%lld] %.9g, expected %.9g\n", what, (long long)i, a[i], ref[i]);
      failures++;
      return;
    }
}

static void check_nonfinite(dp_device *dev) {
  enum { E = 7 };
  /* relu keeps NaN (PyTorch: relu(NaN) = NaN); threshold_backward: y <= 0 ? 0 : dy */
  const float x[E] = {NAN, -INFINITY, INFINITY, -1.0f, -0.0f, 0.0f, 2.0f};
  const float relu_ref[E] = {NAN, 0.0f, INFINITY, 0.0f, 0.0f, 0.0f, 2.0f};
  float a[E];
  for (int i = 0; i < E; ++i) a[i] = dp_relu_forward_elem(x[i]);
  expect_nan_same("relu forward, NaN and inf (body)", a, relu_ref, E);
  EXPECT_OK(dev->backend->relu_forward(dev, E, x, a));
  expect_nan_same("relu forward, NaN and inf (cpu)", a, relu_ref, E);
  const float y[E] = {NAN, 0.0f, 1.0f, 0.0f, 2.0f, -INFINITY, INFINITY};
  const float dy[E] = {5.0f, 5.0f, NAN, NAN, INFINITY, 3.0f, -1.0f};
  const float back_ref[E] = {5.0f, 0.0f, NAN, 0.0f, INFINITY, 0.0f, -1.0f};
  for (int i = 0; i < E; ++i) a[i] = dp_relu_backward_elem(y[i], dy[i]);
  expect_nan_same("relu backward, NaN and inf (body)", a, back_ref, E);
  EXPECT_OK(dev->backend->relu_backward(dev, E, y, dy, a));
  expect_nan_same("relu backward, NaN and inf (cpu)", a, back_ref, E);

  /* max pooling, one 2x2 window per plane: a NaN wins, the last NaN of the
   * window (PyTorch's `val > maxval || isnan(val)`); -inf everywhere: -inf at
   * the first position; +inf beats numbers */
  const dp_pool_geom g = {1, 2, 2, 1, 1, 2, 2, 0};
  const float planes[4][4] = {{1.0f, NAN, 3.0f, NAN}, {NAN, 7.0f, 8.0f, 9.0f},
                              {-INFINITY, -INFINITY, -INFINITY, -INFINITY}, {1.0f, INFINITY, NAN, 2.0f}};
  const float want[4] = {NAN, NAN, -INFINITY, NAN};
  const int32_t want_arg[4] = {3, 0, 0, 2};
  float got[4];
  int32_t arg[4];
  for (int p = 0; p < 4; ++p) got[p] = dp_maxpool_forward_elem(planes[p], &g, 0, &arg[p]);
  expect_nan_same("maxpool forward, NaN and inf (body)", got, want, 4);
  if (memcmp(arg, want_arg, sizeof arg) != 0) {
    fprintf(stderr, "maxpool forward, NaN and inf (body): winners %d %d %d %d\n", arg[0], arg[1], arg[2], arg[3]);
    failures++;
  }
  EXPECT_OK(dev->backend->maxpool_forward(dev, &g, 4, &planes[0][0], got, arg));
  expect_nan_same("maxpool forward, NaN and inf (cpu)", got, want, 4);
  if (memcmp(arg, want_arg, sizeof arg) != 0) {
    fprintf(stderr, "maxpool forward, NaN and inf (cpu): winners %d %d %d %d\n", arg[0], arg[1], arg[2], arg[3]);
    failures++;
  }

  /* softmax cross-entropy: a NaN or +inf logit makes the row's loss and
   * every dlogit NaN; argmax counts the first NaN as the maximum; -inf on the
   * label is an infinite loss with a finite gradient */
  enum { R = 4, K = 3 };
  const float logits[R * K] = {1.0f, NAN, 3.0f, INFINITY, 0.0f, 1.0f, 1.0f, -INFINITY, 2.0f, NAN, 4.0f, NAN};
  const int32_t labels[R] = {1, 1, 1, 2};
  const int want_hit[R] = {1, 0, 0, 0};
  float d[R * K], loss[R];
  for (int r = 0; r < R; ++r) {
    int hit;
    loss[r] = dp_softmax_xent_row(logits + r * K, K, labels[r], 1.0f, d + r * K, &hit);
    if (hit != want_hit[r]) {
      fprintf(stderr, "softmax row %d with NaN/inf: hit %d, expected %d\n", r, hit, want_hit[r]);
      failures++;
    }
  }
  const float loss_ref[R] = {NAN, NAN, INFINITY, NAN};
  expect_nan_same("softmax loss, NaN and inf rows (body)", loss, loss_ref, R);
  /* row 2: softmax (e^1, 0, e^2) / (e^1 + e^2) minus the one-hot of class 1 */
  const float p0 = expf(1.0f - 2.0f) / (expf(1.0f - 2.0f) + 1.0f);
  const float d_ref[R * K] = {NAN, NAN, NAN, NAN, NAN, NAN, p0, -1.0f, 1.0f - p0, NAN, NAN, NAN};
  for (int j = 6; j < 9; ++j) /* the finite row: within the softmax tolerance */
    if (!(fabsf(d[j] - d_ref[j]) <= SOFTMAX_TOL)) {
      fprintf(stderr, "softmax dlogits with -inf: [%d] %.9g, expected %.9g\n", j, d[j], d_ref[j]);
      failures++;
    }
  for (int j = 0; j < R * K; ++j)
    if (isnan(d_ref[j]) && !isnan(d[j])) {
      fprintf(stderr, "softmax dlogits: [%d] %.9g, expected NaN\n", j, d[j]);
      failures++;
    }

  /* the loss flag and the step guard */
  const float finite_rows[3] = {0.5f, 2.0f, 1e30f}, inf_rows[3] = {0.5f, INFINITY, 1.0f}, nan_rows[1] = {NAN};
  const float flags[4] = {dp_loss_flag(finite_rows, 3), dp_loss_flag(inf_rows, 3), dp_loss_flag(nan_rows, 1),
                          dp_loss_flag(NULL, 0)};
  const float flags_ref[4] = {0.0f, NAN, NAN, 0.0f};
  expect_nan_same("loss flag (body)", flags, flags_ref, 4);
  const float zero = 0.0f, nan = NAN, inf = INFINITY, sum_of_flags = 0.0f + NAN; /* the all-reduce's sum */
  if (!dp_step_allowed(NULL) || !dp_step_allowed(&zero) || dp_step_allowed(&nan) || dp_step_allowed(&inf) ||
      dp_step_allowed(&sum_of_flags)) {
    fprintf(stderr, "dp_step_allowed: wrong verdict\n");
    failures++;
  }
  /* the CPU backend: softmax_xent leaves the flag, sgd_update and restore obey it */
  float flag = -1.0f;
  double lsum;
  int64_t hsum;
  EXPECT_OK(dev->backend->softmax_xent(dev, R, K, logits, labels, 1.0f, NULL, NULL, NULL));
  EXPECT_OK(dev->backend->metrics_read(dev, &lsum, &hsum));
  EXPECT_OK(dev->backend->loss_flag(dev, &flag));
  expect_nan_same("loss flag after NaN rows (cpu)", &flag, &nan, 1);
  EXPECT_OK(dev->backend->softmax_xent(dev, 1, K, logits + 2 * K, labels + 3, 1.0f, NULL, NULL, NULL));
  EXPECT_OK(dev->backend->loss_flag(dev, &flag));
  expect_nan_same("loss flag after a finite row (cpu)", &flag, &zero, 1);
  EXPECT_OK(dev->backend->metrics_read(dev, &lsum, &hsum));
  float w[3] = {1.0f, 2.0f, 3.0f}, v[3] = {0.5f, 0.25f, 0.125f}, gr[3] = {NAN, 1.0f, 1.0f};
  const float w0[3] = {1.0f, 2.0f, 3.0f}, v0[3] = {0.5f, 0.25f, 0.125f};
  EXPECT_OK(dev->backend->sgd_update(dev, 3, w, gr, v, 0.1f, 0.9f, 0.01f, &sum_of_flags));
  if (memcmp(w, w0, sizeof w) != 0 || memcmp(v, v0, sizeof v) != 0) {
    fprintf(stderr, "sgd_update with a NaN guard changed the weights or momentum (cpu)\n");
    failures++;
  }
  EXPECT_OK(dev->backend->sgd_update(dev, 3, w, gr, v, 0.1f, 0.9f, 0.01f, &zero));
  float w_ref[3], v_ref[3];
  for (int i = 0; i < 3; ++i) { /* PyTorch's order; a NaN gradient makes NaN, as in PyTorch */
    v_ref[i] = 0.9f * v0[i] + (gr[i] + 0.01f * w0[i]);
    w_ref[i] = w0[i] - 0.1f * v_ref[i];
  }
  expect_nan_same("sgd_update with a finite guard (cpu): weights", w, w_ref, 3);
  expect_nan_same("sgd_update with a finite guard (cpu): momentum", v, v_ref, 3);
  float st[2] = {7.0f, 8.0f};
  const float saved[2] = {1.0f, 2.0f}, kept[2] = {7.0f, 8.0f};
  EXPECT_OK(dev->backend->restore_unless_allowed(dev, 2, st, saved, &zero));
  expect_nan_same("restore with a finite guard (cpu)", st, kept, 2);
  EXPECT_OK(dev->backend->restore_unless_allowed(dev, 2, st, saved, &inf));
  expect_nan_same("restore with an infinite guard (cpu)", st, saved, 2);
}

/* ---- BatchNorm: double-precision references of PyTorch's formulas --------- */

static void check_batchnorm(dp_device *dev) {
  enum { N = 3, C = 4, HW = 10 };
  const int64_t n = (int64_t)N * C * HW;
  const float eps = 1e-5f, momentum = 0.1f, count = (float)(N * HW);
  float *x = randoms(n), *dy = randoms(n), *y = floats(n);
  double *ref = doubles(n);
  const float gamma[C] = {1.0f, 0.5f, -2.0f, 1.5f}, beta[C] = {0.0f, 0.1f, -0.2f, 0.3f};
  double mean_ref[C] = {0}, sq_ref[C] = {0}, invstd_ref[C], rm_ref[C], rv_ref[C], sdy_ref[C] = {0},
         sdx_ref[C] = {0};
  for (int64_t i = 0; i < n; ++i) mean_ref[(i / HW) % C] += x[i];
  for (int c = 0; c < C; ++c) mean_ref[c] /= count;
  for (int64_t i = 0; i < n; ++i) sq_ref[(i / HW) % C] += pow(x[i] - mean_ref[(i / HW) % C], 2);

  /* the sums (backend bn_sums) */
  float sums[C], mean[C], sqdev[C];
  EXPECT_OK(dev->backend->bn_sums(dev, N, C, HW, x, NULL, sums));
  for (int c = 0; c < C; ++c) mean[c] = sums[c] / count;
  expect_close("bn mean (cpu)", mean, mean_ref, C, REL_TOL);
  EXPECT_OK(dev->backend->bn_sums(dev, N, C, HW, x, mean, sqdev));
  expect_close("bn squared deviations (cpu)", sqdev, sq_ref, C, REL_TOL);

  /* finalize: biased variance for invstd, unbiased for the running variance */
  float invstd[C], rm[C], rv[C];
  for (int c = 0; c < C; ++c) {
    invstd_ref[c] = 1.0 / sqrt((double)sqdev[c] / count + eps);
    rm_ref[c] = (1.0 - momentum) * 0.25 + momentum * mean[c];
    rv_ref[c] = (1.0 - momentum) * 2.0 + momentum * ((double)sqdev[c] / (count - 1.0));
  }
  for (int c = 0; c < C; ++c) {
    rm[c] = 0.25f, rv[c] = 2.0f;
    dp_bn_finalize_channel(sqdev[c], count, mean[c], eps, momentum, 1, &invstd[c], &rm[c], &rv[c]);
  }
  expect_close("bn invstd (body)", invstd, invstd_ref, C, REL_TOL);
  expect_close("bn running mean (body)", rm, rm_ref, C, REL_TOL);
  expect_close("bn running var (body)", rv, rv_ref, C, REL_TOL);
  for (int c = 0; c < C; ++c) rm[c] = 0.25f, rv[c] = 2.0f;
  EXPECT_OK(dev->backend->bn_finalize(dev, C, sqdev, count, mean, eps, momentum, 1, invstd, rm, rv));
  expect_close("bn invstd (cpu)", invstd, invstd_ref, C, REL_TOL);
  expect_close("bn running mean (cpu)", rm, rm_ref, C, REL_TOL);
  expect_close("bn running var (cpu)", rv, rv_ref, C, REL_TOL);

  /* apply: y = gamma (x - mean) invstd + beta */
  for (int64_t i = 0; i < n; ++i) {
    const int c = (int)((i / HW) % C);
    ref[i] = gamma[c] * ((double)x[i] - mean[c]) * invstd[c] + beta[c];
  }
  for (int64_t i = 0; i < n; ++i) {
    const int c = (int)((i / HW) % C);
    y[i] = dp_bn_apply_elem(x[i], mean[c], invstd[c], gamma[c], beta[c]);
  }
  expect_close("bn apply (body)", y, ref, n, REL_TOL);
  EXPECT_OK(dev->backend->bn_apply(dev, N, C, HW, x, mean, invstd, gamma, beta, y));
  expect_close("bn apply (cpu)", y, ref, n, REL_TOL);

  /* backward: sum dy, sum dy xhat; dx = gamma invstd (dy - sum_dy / m - xhat sum_dy_xhat / m) */
  for (int64_t i = 0; i < n; ++i) {
    const int c = (int)((i / HW) % C);
    sdy_ref[c] += dy[i];
    sdx_ref[c] += dy[i] * ((double)x[i] - mean[c]) * invstd[c];
  }
  float sdy[C], sdx[C];
  EXPECT_OK(dev->backend->bn_backward_sums(dev, N, C, HW, x, dy, mean, invstd, gamma, NULL, sdy, sdx));
  expect_close("bn sum dy (cpu)", sdy, sdy_ref, C, REL_TOL);
  expect_close("bn sum dy xhat (cpu)", sdx, sdx_ref, C, REL_TOL);
  for (int64_t i = 0; i < n; ++i) {
    const int c = (int)((i / HW) % C);
    const double xhat = ((double)x[i] - mean[c]) * invstd[c];
    ref[i] = gamma[c] * (double)invstd[c] * (dy[i] - sdy[c] / (double)count - xhat * sdx[c] / (double)count);
  }
  for (int64_t i = 0; i < n; ++i) {
    const int c = (int)((i / HW) % C);
    y[i] = dp_bn_backward_elem(x[i], dy[i], mean[c], invstd[c], gamma[c], sdy[c], sdx[c], 1.0f / count);
  }
  expect_close("bn backward (body)", y, ref, n, REL_TOL);
  EXPECT_OK(dev->backend->bn_backward_dx(dev, N, C, HW, x, dy, mean, invstd, gamma, NULL, sdy, sdx, 1.0f / count, y));
  expect_close("bn backward (cpu)", y, ref, n, REL_TOL);

  /* fused with a ReLU after it (relu_beta): the bits of the ReLU's backward pass on
   * relu(bn_apply(x)), then the plain BatchNorm backward */
  float *masked = floats(n), *fused = floats(n);
  for (int64_t i = 0; i < n; ++i) {
    const int c = (int)((i / HW) % C);
    masked[i] = dp_relu_backward_elem(dp_relu_forward_elem(dp_bn_apply_elem(x[i], mean[c], invstd[c], gamma[c],
                                                                             beta[c])),
                                      dy[i]);
  }
  float mdy[C], mdx[C], fdy[C], fdx[C];
  EXPECT_OK(dev->backend->bn_backward_sums(dev, N, C, HW, x, masked, mean, invstd, gamma, NULL, mdy, mdx));
  EXPECT_OK(dev->backend->bn_backward_sums(dev, N, C, HW, x, dy, mean, invstd, gamma, beta, fdy, fdx));
  expect_same("bn + relu sum dy (cpu)", fdy, mdy, C);
  expect_same("bn + relu sum dy xhat (cpu)", fdx, mdx, C);
  EXPECT_OK(
      dev->backend->bn_backward_dx(dev, N, C, HW, x, masked, mean, invstd, gamma, NULL, mdy, mdx, 1.0f / count, y));
  EXPECT_OK(dev->backend->bn_backward_dx(dev, N, C, HW, x, dy, mean, invstd, gamma, beta, fdy, fdx, 1.0f / count,
                                         fused));
  expect_same("bn + relu backward (cpu)", fused, y, n);
  int64_t zeros = 0; /* the mask did mask, not everything */
  for (int64_t i = 0; i < n; ++i) zeros += masked[i] == 0.0f && dy[i] != 0.0f;
  if (zeros == 0 || zeros == n) {
    fprintf(stderr, "bn + relu: %lld of %lld gradients masked\n", (long long)zeros, (long long)n);
    failures++;
  }
  free(masked), free(fused);
  free(x), free(dy), free(y), free(ref);
}

/* ---- the all-reduce: the rank-ordered float sum ((p0 + p1) + p2) + ... ----- */

static void check_sum_parts(void) {
  for (int k = 1; k <= 5; ++k) {
    const int64_t n = 1031;
    float *bufs[5], *copies[5], *sum = floats(n), *ref = floats(n);
    for (int r = 0; r < k; ++r) {
      bufs[r] = randoms(n);
      copies[r] = floats(n);
      memcpy(copies[r], bufs[r], sizeof(float) * n);
    }
    for (int64_t i = 0; i < n; ++i) {
      float s = bufs[0][i];
      for (int r = 1; r < k; ++r) s += bufs[r][i];
      ref[i] = s;
    }
    char what[64];
    for (int64_t i = 0; i < n; ++i) sum[i] = dp_sum_parts_elem((const float *const *)bufs, k, i);
    snprintf(what, sizeof what, "dp_sum_parts_elem k=%d", k);
    expect_same(what, sum, ref, n);
    /* dp_allreduce_elem (the logical-GPU all-reduce kernel's body) on the copies */
    for (int64_t i = 0; i < n; ++i) dp_allreduce_elem(copies, k, i, 1.0f);
    /* the CPU all-reduce: one thread plays every rank in turn (the chunks are
     * disjoint, and a barrier of count 1 never waits) */
    dp_barrier bar;
    EXPECT_OK(dp_barrier_init(&bar, 1));
    for (int rank = 0; rank < k; ++rank) EXPECT_OK(dp_allreduce(bufs, k, rank, n, DP_REDUCE_SUM, &bar));
    dp_barrier_destroy(&bar);
    for (int r = 0; r < k; ++r) {
      snprintf(what, sizeof what, "all-reduce k=%d replica %d", k, r);
      expect_same(what, bufs[r], ref, n);
      snprintf(what, sizeof what, "dp_allreduce_elem k=%d replica %d", k, r);
      expect_same(what, copies[r], ref, n);
      free(bufs[r]);
      free(copies[r]);
    }
    free(sum), free(ref);
  }
}

/* ---- the CUDA channel sums' partition and walk (kernels/layers.cu) ----------
 * Exact: each channel's N * HW values fall into contiguous, non-empty parts that
 * cover them once, in (n, i) order; a thread's walk reaches the offset the
 * division formula gives, (n * C + c) * HW + i for n = j / HW, i = j % HW. */

static void check_channel_walks(int64_t N, int C, int HW, int stride) {
  const int64_t count = N * HW;
  const int P = dp_channel_parts(count);
  unsigned char *seen = calloc((size_t)(count ? count : 1), 1);
  const int channels[2] = {0, C - 1};
  for (int k = 0; k < 2; ++k) {
    const int c = channels[k];
    memset(seen, 0, (size_t)(count ? count : 1));
    if (dp_channel_part_begin(count, P, 0) != 0 || dp_channel_part_begin(count, P, P) != count) {
      fprintf(stderr, "channel parts of %lld values (P = %d) do not span them\n", (long long)count, P);
      failures++;
    }
    for (int p = 0; p < P; ++p) {
      const int64_t begin = dp_channel_part_begin(count, P, p), end = dp_channel_part_begin(count, P, p + 1);
      if (count > 0 && end <= begin) {
        fprintf(stderr, "channel part %d of %d over %lld values is empty\n", p, P, (long long)count);
        failures++;
      }
      for (int t = 0; t < stride; ++t) {
        int64_t j = begin + t;
        dp_channel_walk w = dp_channel_walk_start(C, HW, c, j, stride);
        for (; j < end; j += stride, dp_channel_walk_next(&w)) {
          const int64_t n = j / HW, i = j % HW, at = (n * C + c) * HW + i;
          if (w.at != at || w.i != i || seen[j]) {
            fprintf(stderr, "channel walk N=%lld C=%d HW=%d stride %d, channel %d part %d thread %d, value %lld: "
                    "offset %lld (%s), expected %lld\n", (long long)N, C, HW, stride, c, p, t, (long long)j,
                    (long long)w.at, seen[j] ? "seen before" : "first", (long long)at);
            failures++;
            free(seen);
            return;
          }
          seen[j] = 1;
        }
      }
    }
    for (int64_t j = 0; j < count; ++j)
      if (!seen[j]) {
        fprintf(stderr, "channel walk N=%lld C=%d HW=%d: value %lld not summed\n", (long long)N, C, HW, (long long)j);
        failures++;
        break;
      }
  }
  free(seen);
}

static void check_channel_partition(void) {
  const struct { int64_t count; int parts; } sizes[] = {
      {0, 1}, {1, 1}, {DP_CHANNEL_PART_VALUES, 1}, {DP_CHANNEL_PART_VALUES + 1, 2}, {256 * 784, 13},
      {256 * 196, 4}, {256 * 49, 1}, {(int64_t)DP_CHANNEL_MAX_PARTS * DP_CHANNEL_PART_VALUES, DP_CHANNEL_MAX_PARTS},
      {(int64_t)1 << 40, DP_CHANNEL_MAX_PARTS}};
  for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; ++k)
    if (dp_channel_parts(sizes[k].count) != sizes[k].parts) {
      fprintf(stderr, "dp_channel_parts(%lld) = %d, expected %d\n", (long long)sizes[k].count,
              dp_channel_parts(sizes[k].count), sizes[k].parts);
      failures++;
    }
  /* no part empty near the cap's edge, where parts are longest relative to the last */
  for (int64_t count = 1; count < 3 * DP_CHANNEL_PART_VALUES; count += 977) {
    const int P = dp_channel_parts(count);
    for (int p = 0; p < P; ++p)
      if (dp_channel_part_begin(count, P, p + 1) <= dp_channel_part_begin(count, P, p)) {
        fprintf(stderr, "channel part %d of %d over %lld values is empty\n", p, P, (long long)count);
        failures++;
      }
  }
  const int strides[] = {256, 7};
  for (int k = 0; k < 2; ++k) {
    const int st = strides[k];
    check_channel_walks(3, 4, 0, st);            /* no values */
    check_channel_walks(0, 4, 49, st);           /* no samples */
    check_channel_walks(5, 3, 4000, st);         /* HW > stride, two parts */
    check_channel_walks(40, 2, 784, st);         /* two parts */
    check_channel_walks(256, 3, 49, st);         /* HW < stride, one part */
    check_channel_walks(300, 2, 256, st);        /* HW == stride, five parts */
    check_channel_walks(20000, 10, 1, st);       /* a dense bias: HW = 1 */
    check_channel_walks(4100, 2, 16, st);        /* HW divides the stride */
  }
  /* capped: 64 parts longer than DP_CHANNEL_PART_VALUES */
  check_channel_walks((int64_t)DP_CHANNEL_MAX_PARTS * DP_CHANNEL_PART_VALUES + 4099, 2, 1, 256);
}

/* ---- the resident dataset's gather: whole rows, byte by byte ---------------- */

static void check_gather(dp_device *dev) {
  const int64_t count = 50, nrows = 37;
  int32_t rows[37];
  for (int64_t r = 0; r < nrows; ++r) rows[r] = (int32_t)((r * 17 + 3) % count);
  for (int64_t row_bytes = 1; row_bytes <= 13; row_bytes += 3) {
    uint8_t *src = malloc((size_t)(count * row_bytes)), *a = malloc((size_t)(nrows * row_bytes)),
            *ref = malloc((size_t)(nrows * row_bytes));
    for (int64_t i = 0; i < count * row_bytes; ++i) src[i] = (uint8_t)(i * 31 + 7);
    for (int64_t r = 0; r < nrows; ++r) memcpy(ref + r * row_bytes, src + rows[r] * row_bytes, (size_t)row_bytes);
    for (int64_t i = 0; i < nrows * row_bytes; ++i) a[i] = dp_gather_elem(src, rows, row_bytes, i);
    if (memcmp(a, ref, (size_t)(nrows * row_bytes)) != 0) {
      fprintf(stderr, "gather rows of %lld bytes (body): not the source rows\n", (long long)row_bytes);
      failures++;
    }
    EXPECT_OK(dev->backend->gather_rows(dev, nrows, row_bytes, src, rows, a));
    if (memcmp(a, ref, (size_t)(nrows * row_bytes)) != 0) {
      fprintf(stderr, "gather rows of %lld bytes (cpu): not the source rows\n", (long long)row_bytes);
      failures++;
    }
    free(src), free(a), free(ref);
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
  check_nonfinite(&dev);
  check_batchnorm(&dev);
  check_sum_parts();
  check_channel_partition();
  check_gather(&dev);
  dp_device_destroy(&dev);
  printf("kernel_bodies: %s\n", failures ? "FAILED" : "ok");
  return failures ? 1 : 0;
}
