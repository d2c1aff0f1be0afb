/* dp_kernels.h — the arithmetic dpcore writes itself, written once.
 *
 * Every function here is a `static inline DP_HD` body: one element, one row or
 * one output position. The CPU backend (csrc/backend_cpu.c) loops over these
 * bodies; the CUDA launchers (kernels/ .cu files) call the very same bodies from
 * grid-stride kernels. The CPU test suite therefore executes the arithmetic
 * the GPU runs. GEMM and convolutions are not here: BLAS / cuBLAS / cuDNN do them.
 *
 * Layout conventions: tensors are NCHW, row-major, float32. Shapes in comments.
 */
#ifndef DP_KERNELS_H
#define DP_KERNELS_H

#include <stdint.h>

#ifdef __CUDACC__
#define DP_HD __host__ __device__
#include <math.h>
#else
#define DP_HD
#include <math.h>
#endif

/* ---- element-wise ------------------------------------------------------ */

/* y = max(x, 0) */
static inline DP_HD float dp_relu_forward_elem(float x) { return x > 0.0f ? x : 0.0f; }

/* dx = dy where the forward output was positive (y > 0 <=> x > 0). */
static inline DP_HD float dp_relu_backward_elem(float y, float dy) { return y > 0.0f ? dy : 0.0f; }

/* x = u8 / 255, the [0, 1] scaling of torchvision's ToTensor. */
static inline DP_HD float dp_u8_to_unit_elem(uint8_t v) { return (float)v * (1.0f / 255.0f); }

/* out[i] = bias[c] for i in the channel-c plane: y is (N, C, HW). Element i. */
static inline DP_HD float dp_bias_value_elem(const float *bias, int64_t i, int64_t C, int64_t HW) {
  return bias[(i / HW) % C];
}

/* SGD with momentum and weight decay, PyTorch's torch.optim.SGD semantics
 * (dampening 0, not Nesterov):  g' = g + wd*w;  v = mu*v + g';  w -= lr*v.
 * With mu == 0 the velocity is not touched (v may be NULL then). */
static inline DP_HD void dp_sgd_elem(float *w, const float *g, float *v, int64_t i, float lr, float mu, float wd) {
  float gi = g[i] + wd * w[i];
  if (mu != 0.0f) {
    float vi = mu * v[i] + gi;
    v[i] = vi;
    gi = vi;
  }
  w[i] -= lr * gi;
}

/* acc[i] = sum_r parts[r][i] in the fixed order r = 0..nparts-1 (deterministic). */
static inline DP_HD float dp_sum_parts_elem(const float *const *parts, int nparts, int64_t i) {
  float s = 0.0f;
  for (int r = 0; r < nparts; ++r) s += parts[r][i];
  return s;
}

/* ---- pooling (NCHW; one output element forward, one input element backward) */

typedef struct dp_pool_geom {
  int C, H, W;      /* input plane */
  int OH, OW;       /* output plane */
  int k, stride, pad;
} dp_pool_geom;

static inline DP_HD int dp_pool_out_dim(int in, int k, int stride, int pad) {
  return (in + 2 * pad - k) / stride + 1;
}

/* Average pooling, PyTorch's count_include_pad=True: the divisor is k*k even
 * where the window hangs over the padding. o indexes y (N, C, OH, OW). */
static inline DP_HD float dp_avgpool_forward_elem(const float *x, const dp_pool_geom *g, int64_t o) {
  int ow = (int)(o % g->OW);
  int oh = (int)((o / g->OW) % g->OH);
  int64_t nc = o / ((int64_t)g->OW * g->OH);
  const float *plane = x + nc * (int64_t)g->H * g->W;
  int h0 = oh * g->stride - g->pad, w0 = ow * g->stride - g->pad;
  float s = 0.0f;
  for (int i = 0; i < g->k; ++i) {
    int h = h0 + i;
    if (h < 0 || h >= g->H) continue;
    for (int j = 0; j < g->k; ++j) {
      int w = w0 + j;
      if (w < 0 || w >= g->W) continue;
      s += plane[h * g->W + w];
    }
  }
  return s / (float)(g->k * g->k);
}

/* The output windows [lo, hi] along one axis that contain input position p. */
static inline DP_HD void dp_pool_windows(int p, int k, int stride, int pad, int out, int *lo, int *hi) {
  int a = p + pad - k + 1;  /* smallest o with o*stride + k - 1 >= p + pad */
  int l = a <= 0 ? 0 : (a + stride - 1) / stride;
  int h = (p + pad) / stride;
  if (h > out - 1) h = out - 1;
  *lo = l;
  *hi = h;
}

/* Gather form of the average-pool backward (no atomics): i indexes dx (N, C, H, W). */
static inline DP_HD float dp_avgpool_backward_elem(const float *dy, const dp_pool_geom *g, int64_t i) {
  int w = (int)(i % g->W);
  int h = (int)((i / g->W) % g->H);
  int64_t nc = i / ((int64_t)g->W * g->H);
  const float *plane = dy + nc * (int64_t)g->OH * g->OW;
  int ohl, ohh, owl, owh;
  dp_pool_windows(h, g->k, g->stride, g->pad, g->OH, &ohl, &ohh);
  dp_pool_windows(w, g->k, g->stride, g->pad, g->OW, &owl, &owh);
  float s = 0.0f;
  for (int oh = ohl; oh <= ohh; ++oh)
    for (int ow = owl; ow <= owh; ++ow) s += plane[oh * g->OW + ow];
  return s / (float)(g->k * g->k);
}

/* Max pooling forward; *arg receives the winning input offset within the plane
 * (first maximum wins, like PyTorch; padding never wins). o indexes y. */
static inline DP_HD float dp_maxpool_forward_elem(const float *x, const dp_pool_geom *g, int64_t o, int32_t *arg) {
  int ow = (int)(o % g->OW);
  int oh = (int)((o / g->OW) % g->OH);
  int64_t nc = o / ((int64_t)g->OW * g->OH);
  const float *plane = x + nc * (int64_t)g->H * g->W;
  int h0 = oh * g->stride - g->pad, w0 = ow * g->stride - g->pad;
  float best = -INFINITY;
  int32_t besti = -1;
  for (int i = 0; i < g->k; ++i) {
    int h = h0 + i;
    if (h < 0 || h >= g->H) continue;
    for (int j = 0; j < g->k; ++j) {
      int w = w0 + j;
      if (w < 0 || w >= g->W) continue;
      float v = plane[h * g->W + w];
      /* the first maximum wins; a NaN wins and stays (PyTorch propagates NaN) */
      if (besti < 0 || v > best || (isnan(v) && !isnan(best))) {
        best = v;
        besti = h * g->W + w;
      }
    }
  }
  *arg = besti;
  return best;
}

/* Gather form of the max-pool backward: dx[i] = sum of dy over the windows whose
 * recorded winner is i. i indexes dx (N, C, H, W); arg is (N, C, OH, OW). */
static inline DP_HD float dp_maxpool_backward_elem(const float *dy, const int32_t *arg, const dp_pool_geom *g, int64_t i) {
  int w = (int)(i % g->W);
  int h = (int)((i / g->W) % g->H);
  int64_t nc = i / ((int64_t)g->W * g->H);
  int64_t base = nc * (int64_t)g->OH * g->OW;
  int32_t self = h * g->W + w;
  int ohl, ohh, owl, owh;
  dp_pool_windows(h, g->k, g->stride, g->pad, g->OH, &ohl, &ohh);
  dp_pool_windows(w, g->k, g->stride, g->pad, g->OW, &owl, &owh);
  float s = 0.0f;
  for (int oh = ohl; oh <= ohh; ++oh)
    for (int ow = owl; ow <= owh; ++ow) {
      int64_t o = base + oh * g->OW + ow;
      if (arg[o] == self) s += dy[o];
    }
  return s;
}

/* ---- rows ----------------------------------------------------------------- */

/* Softmax cross-entropy of one row of logits (K classes) with integer label.
 * Writes dlogits = scale * (softmax - onehot) (dlogits may be NULL) and returns
 * the row's loss -log softmax[label] in float, computed stably (max shifted,
 * log-sum-exp). *correct is 1 when argmax == label (first maximum wins). */
static inline DP_HD float dp_softmax_xent_row(const float *logits, int K, int label, float scale,
                                              float *dlogits, int *correct) {
  float m = logits[0];
  int am = 0;
  for (int j = 1; j < K; ++j)
    if (logits[j] > m) { m = logits[j]; am = j; }
  float s = 0.0f;
  for (int j = 0; j < K; ++j) s += expf(logits[j] - m);
  float lse = logf(s);
  if (dlogits) {
    float inv = 1.0f / s;
    for (int j = 0; j < K; ++j) {
      float p = expf(logits[j] - m) * inv;
      dlogits[j] = scale * (p - (j == label ? 1.0f : 0.0f));
    }
  }
  *correct = (am == label);
  return lse - (logits[label] - m);
}

/* Sum of one row (bias gradients: a channel plane of dy, or a column block). */
static inline DP_HD float dp_row_sum(const float *x, int64_t n) {
  float s = 0.0f;
  for (int64_t i = 0; i < n; ++i) s += x[i];
  return s;
}

#endif /* DP_KERNELS_H */
