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

/* y = max(x, 0), NaN kept (PyTorch's relu: NaN -> NaN, -inf -> 0). The
 * comparison is written so that NaN fails it: NaN <= 0 is false. */
static inline DP_HD float dp_relu_forward_elem(float x) { return x <= 0.0f ? 0.0f : x; }

/* dx = dy where the forward output is not <= 0 (PyTorch's threshold_backward:
 * y <= 0 ? 0 : dy), so a NaN output passes dy on and a NaN dy passes where
 * y > 0: NaN is never turned into 0 here. */
static inline DP_HD float dp_relu_backward_elem(float y, float dy) { return y <= 0.0f ? 0.0f : dy; }

/* x = u8 / 255, the [0, 1] scaling of torchvision's ToTensor. */
static inline DP_HD float dp_u8_to_unit_elem(uint8_t v) { return (float)v * (1.0f / 255.0f); }

/* Byte i of a gather of whole rows: dst row r = src row rows[r], rows of
 * row_bytes bytes (the resident dataset's samples and labels). */
static inline DP_HD uint8_t dp_gather_elem(const uint8_t *src, const int32_t *rows, int64_t row_bytes, int64_t i) {
  return src[(int64_t)rows[i / row_bytes] * row_bytes + i % row_bytes];
}

/* out[i] = bias[c] for i in the channel-c plane: y is (N, C, HW). Element i. */
static inline DP_HD float dp_bias_value_elem(const float *bias, int64_t i, int64_t C, int64_t HW) {
  return bias[(i / HW) % C];
}

/* Whether a training step may change the parameters: guard (device memory,
 * one float; NULL: no guard) is the step's loss flag after the gradient
 * all-reduce (dp_loss_flag of every replica, summed): 0 when every replica's
 * loss was finite, NaN otherwise. A step whose loss is not finite applies no
 * update at all, so the model keeps the weights of its last finite step. */
static inline DP_HD int dp_step_allowed(const float *guard) { return !guard || isfinite(*guard); }

/* The loss flag of n row losses: 0 when all are finite, NaN otherwise. It
 * rides at the end of the gradient buffer through the all-reduce (a sum of
 * zeros is 0, anything plus NaN is NaN), so every replica of every process
 * reaches the same verdict without a host round trip. A flag, not the loss
 * itself: a finite double loss sum could overflow a float. */
static inline DP_HD float dp_loss_flag(const float *row_loss, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (!isfinite(row_loss[i])) return NAN;
  return 0.0f;
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

/* sum_r parts[r][i] in the fixed order ((p0 + p1) + p2) + ... (deterministic:
 * the bits never depend on which thread or block finishes first). The CPU
 * all-reduce (csrc/collective.c) runs this order blocked over i, replica by
 * replica, so that it vectorises; the bits are the same. */
static inline DP_HD float dp_sum_parts_elem(const float *const *parts, int nparts, int64_t i) {
  float s = parts[0][i];
  for (int r = 1; r < nparts; ++r) s += parts[r][i];
  return s;
}

/* The in-place all-reduce of element i over k buffers: every buffer receives
 * the rank-ordered sum times scale (1 for a sum, 1/k for a mean), the value
 * csrc/collective.c computes on the CPU. */
static inline DP_HD void dp_allreduce_elem(float *const *parts, int k, int64_t i, float scale) {
  const float s = dp_sum_parts_elem((const float *const *)parts, k, i) * scale;
  for (int r = 0; r < k; ++r) parts[r][i] = s;
}

/* ---- pooling (NCHW; one output element forward, one input element backward) */

typedef struct dp_pool_geom {
  int C, H, W;      /* input plane */
  int OH, OW;       /* output plane */
  int k, stride, pad;
} dp_pool_geom;

/* The output extent of a window k at stride over in positions padded by pad
 * on both sides (pooling's and cuDNN's convolution formula), in 64 bits:
 * in + 2 * pad overflows an int. Callers check that the result fits an int
 * (dp_pool_geom_make, dp_conv_geom_make). */
static inline DP_HD int64_t dp_pool_out_dim(int64_t in, int64_t k, int64_t stride, int64_t pad) {
  return (in + 2 * pad - k) / stride + 1;
}

/* Average pooling, PyTorch's count_include_pad=True: the divisor is k*k even
 * where the window hangs over the padding. One output (oh, ow) of a plane
 * x (H, W). */
static inline DP_HD float dp_avgpool_forward_at(const float *x, const dp_pool_geom *g, int oh, int ow) {
  /* the window clipped to the plane; the divisor stays k*k */
  int h0 = oh * g->stride - g->pad, w0 = ow * g->stride - g->pad;
  int h1 = h0 + g->k < g->H ? h0 + g->k : g->H, w1 = w0 + g->k < g->W ? w0 + g->k : g->W;
  if (h0 < 0) h0 = 0;
  if (w0 < 0) w0 = 0;
  float s = 0.0f;
  for (int h = h0; h < h1; ++h)
    for (int w = w0; w < w1; ++w) s += x[h * g->W + w];
  return s * (1.0f / ((float)g->k * (float)g->k));
}

/* The output windows [lo, hi] along one axis that contain input position p
 * (empty when lo > hi). */
static inline DP_HD void dp_pool_windows(int p, int k, int stride, int pad, int out, int *lo, int *hi) {
  int a = p + pad - k + 1;  /* smallest o with o*stride + k - 1 >= p + pad */
  int l = a <= 0 ? 0 : (a + stride - 1) / stride;
  int h = (p + pad) / stride;
  if (h > out - 1) h = out - 1;
  *lo = l;
  *hi = h;
}

/* Gather form of the average-pool backward (no atomics): one input element of
 * a plane, given the output windows [ohl, ohh] x [owl, owh] that contain it;
 * dy is the plane's (OH, OW) gradient. */
static inline DP_HD float dp_avgpool_backward_at(const float *dy, const dp_pool_geom *g, int ohl, int ohh, int owl,
                                                 int owh) {
  float s = 0.0f;
  for (int oh = ohl; oh <= ohh; ++oh)
    for (int ow = owl; ow <= owh; ++ow) s += dy[oh * g->OW + ow];
  return s * (1.0f / ((float)g->k * (float)g->k));
}

/* Max pooling forward; *arg receives the winner's offset within the plane
 * (the first maximum wins and padding never wins, like PyTorch; a NaN beats
 * every number and a later NaN beats an earlier one, PyTorch's
 * `val > maxval || isnan(val)`, so the output is NaN and the gradient goes to
 * the window's last NaN). One output (oh, ow) of a plane x (H, W). */
static inline DP_HD float dp_maxpool_forward_at(const float *x, const dp_pool_geom *g, int oh, int ow, int32_t *arg) {
  int h0 = oh * g->stride - g->pad, w0 = ow * g->stride - g->pad;
  float best = -INFINITY;
  int32_t besti = -1;
  for (int i = 0; i < g->k; ++i) {
    int h = h0 + i;
    if (h < 0 || h >= g->H) continue;
    for (int j = 0; j < g->k; ++j) {
      int w = w0 + j;
      if (w < 0 || w >= g->W) continue;
      float v = x[h * g->W + w];
      if (besti < 0 || v > best || isnan(v)) {
        best = v;
        besti = h * g->W + w;
      }
    }
  }
  *arg = besti;
  return best;
}

/* Gather form of the max-pool backward: input (h, w) of a plane receives dy of
 * every window (within [ohl, ohh] x [owl, owh]) whose recorded winner it is. */
static inline DP_HD float dp_maxpool_backward_at(const float *dy, const int32_t *arg, const dp_pool_geom *g, int h,
                                                 int w, int ohl, int ohh, int owl, int owh) {
  int32_t self = h * g->W + w;
  float s = 0.0f;
  for (int oh = ohl; oh <= ohh; ++oh)
    for (int ow = owl; ow <= owh; ++ow) {
      int o = oh * g->OW + ow;
      if (arg[o] == self) s += dy[o];
    }
  return s;
}

/* Flat-index forms for one-thread-per-element launchers: o indexes y
 * (N, C, OH, OW), i indexes dx (N, C, H, W). */
static inline DP_HD float dp_avgpool_forward_elem(const float *x, const dp_pool_geom *g, int64_t o) {
  int64_t nc = o / ((int64_t)g->OW * g->OH);
  int rem = (int)(o - nc * g->OW * g->OH);
  return dp_avgpool_forward_at(x + nc * g->H * g->W, g, rem / g->OW, rem % g->OW);
}

static inline DP_HD float dp_avgpool_backward_elem(const float *dy, const dp_pool_geom *g, int64_t i) {
  int64_t nc = i / ((int64_t)g->W * g->H);
  int rem = (int)(i - nc * g->W * g->H);
  int ohl, ohh, owl, owh;
  dp_pool_windows(rem / g->W, g->k, g->stride, g->pad, g->OH, &ohl, &ohh);
  dp_pool_windows(rem % g->W, g->k, g->stride, g->pad, g->OW, &owl, &owh);
  return dp_avgpool_backward_at(dy + nc * g->OH * g->OW, g, ohl, ohh, owl, owh);
}

static inline DP_HD float dp_maxpool_forward_elem(const float *x, const dp_pool_geom *g, int64_t o, int32_t *arg) {
  int64_t nc = o / ((int64_t)g->OW * g->OH);
  int rem = (int)(o - nc * g->OW * g->OH);
  return dp_maxpool_forward_at(x + nc * g->H * g->W, g, rem / g->OW, rem % g->OW, arg);
}

static inline DP_HD float dp_maxpool_backward_elem(const float *dy, const int32_t *arg, const dp_pool_geom *g,
                                                   int64_t i) {
  int64_t nc = i / ((int64_t)g->W * g->H);
  int rem = (int)(i - nc * g->W * g->H);
  int h = rem / g->W, w = rem % g->W;
  int ohl, ohh, owl, owh;
  dp_pool_windows(h, g->k, g->stride, g->pad, g->OH, &ohl, &ohh);
  dp_pool_windows(w, g->k, g->stride, g->pad, g->OW, &owl, &owh);
  int64_t base = nc * g->OH * g->OW;
  return dp_maxpool_backward_at(dy + base, arg + base, g, h, w, ohl, ohh, owl, owh);
}

/* ---- rows ----------------------------------------------------------------- */

/* Softmax cross-entropy of one row of logits (K classes) with integer label.
 * Writes dlogits = scale * (softmax - onehot) (dlogits may be NULL) and returns
 * the row's loss -log softmax[label] in float, computed stably (max shifted,
 * log-sum-exp). *correct is 1 when argmax == label (first maximum wins; a
 * NaN counts as the maximum, the first NaN winning, as torch.argmax does).
 * NaN anywhere in the row makes the loss and every dlogit NaN (the sum s is
 * NaN), and +inf does too (inf - inf), as in PyTorch's log_softmax: the max
 * is taken with comparisons that keep the first NaN, never fmaxf, which
 * drops NaN. */
static inline DP_HD float dp_softmax_xent_row(const float *logits, int K, int label, float scale,
                                              float *dlogits, int *correct) {
  float m = logits[0];
  int am = 0;
  for (int j = 1; j < K; ++j)
    if (logits[j] > m || (isnan(logits[j]) && !isnan(m))) { m = logits[j]; am = j; }
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

/* ---- BatchNorm (per channel c of x (N, C, HW)) ------------------------------ */

/* y = gamma * (x - mean) * invstd + beta */
static inline DP_HD float dp_bn_apply_elem(float x, float mean, float invstd, float gamma, float beta) {
  return gamma * ((x - mean) * invstd) + beta;
}

/* The gradient reaching a BatchNorm's output from the ReLU right after it
 * (fused: bn_apply_relu never stored the BatchNorm's output nor, backward, the
 * ReLU's input gradient): the ReLU's output gradient dy where the forward
 * pass's relu(bn_apply(x)) was positive, recomputed bit for bit, else 0. */
static inline DP_HD float dp_bn_relu_dy(float x, float dy, float mean, float invstd, float gamma, float beta) {
  return dp_relu_backward_elem(dp_relu_forward_elem(dp_bn_apply_elem(x, mean, invstd, gamma, beta)), dy);
}

/* After the (possibly all-reduced) sum of squared deviations of a channel
 * over count values: invstd for the normalisation and, in training, the
 * running statistics as PyTorch updates them (momentum m; the running
 * variance takes the unbiased batch variance). */
static inline DP_HD void dp_bn_finalize_channel(float sqdev_sum, float count, float mean, float eps, float momentum,
                                                int update_running, float *invstd, float *running_mean,
                                                float *running_var) {
  const float var = sqdev_sum / count;
  *invstd = 1.0f / sqrtf(var + eps);
  if (update_running) {
    const float unbiased = count > 1.0f ? sqdev_sum / (count - 1.0f) : var;
    *running_mean = (1.0f - momentum) * *running_mean + momentum * mean;
    *running_var = (1.0f - momentum) * *running_var + momentum * unbiased;
  }
}

/* dx of BatchNorm in training mode, from the channel sums over all count
 * values (all replicas' with synchronized BN):
 * dx = gamma * invstd * (dy - sum_dy / count - xhat * sum_dy_xhat / count) */
static inline DP_HD float dp_bn_backward_elem(float x, float dy, float mean, float invstd, float gamma, float sum_dy,
                                              float sum_dy_xhat, float inv_count) {
  const float xhat = (x - mean) * invstd;
  return gamma * invstd * (dy - inv_count * sum_dy - xhat * (inv_count * sum_dy_xhat));
}

/* ---- the partition of the CUDA channel sums (kernels/layers.cu) --------------
 *
 * A channel's count = N * HW values, in (n, i) order (j = n * HW + i), are cut
 * into P contiguous parts; a block of `stride` threads sums one part, thread t
 * taking j = begin + t, begin + t + stride, ... below the part's end. P and the
 * cut depend on count alone, so the summation order (and the bits) does too,
 * never on the GPU. Aim: about DP_CHANNEL_PART_VALUES values per block (64 per
 * thread of 256), enough blocks to fill a GPU at ResNet's early stages; at most
 * DP_CHANNEL_MAX_PARTS parts, which bounds the partials' scratch (C * P * 2
 * doubles) and the serial add of the second stage. */
enum { DP_CHANNEL_PART_VALUES = 16384, DP_CHANNEL_MAX_PARTS = 64 };

/* P = clamp(ceil(count / DP_CHANNEL_PART_VALUES), 1, DP_CHANNEL_MAX_PARTS). */
static inline DP_HD int dp_channel_parts(int64_t count) {
  if (count <= DP_CHANNEL_PART_VALUES) return 1;
  const int64_t p = (count + DP_CHANNEL_PART_VALUES - 1) / DP_CHANNEL_PART_VALUES;
  return p > DP_CHANNEL_MAX_PARTS ? DP_CHANNEL_MAX_PARTS : (int)p;
}

/* Part p (0 <= p <= parts) begins at min(count, p * ceil(count / parts)); part p
 * is [begin(p), begin(p + 1)), so begin(parts) = count. No part is empty when
 * parts = dp_channel_parts(count) and count > 0. */
static inline DP_HD int64_t dp_channel_part_begin(int64_t count, int parts, int p) {
  const int64_t len = (count + parts - 1) / parts, b = len * p;
  return b < count ? b : count;
}

/* One thread's walk over channel c of x (N, C, HW): `at` is the offset of value
 * j, (n * C + c) * HW + i with n = j / HW, i = j % HW; each step advances j by
 * stride with additions only (one division at the start, none per value). */
typedef struct dp_channel_walk {
  int64_t at;   /* offset of the current value */
  int64_t jump; /* (stride / HW) samples and (stride % HW) values: q * C * HW + r */
  int64_t wrap; /* i passed HW: one more sample, back to the plane's start: C * HW - HW */
  int i, HW, r;
} dp_channel_walk;

static inline DP_HD dp_channel_walk dp_channel_walk_start(int C, int HW, int c, int64_t j, int stride) {
  dp_channel_walk w = {0, 0, 0, 0, HW, 0};
  if (HW <= 0) return w; /* no values: nothing is walked */
  const int64_t n = j / HW, plane = (int64_t)C * HW;
  w.i = (int)(j - n * HW);
  w.at = (n * C + c) * HW + w.i;
  w.r = stride % HW;
  w.jump = (int64_t)(stride / HW) * plane + w.r;
  w.wrap = plane - HW;
  return w;
}

static inline DP_HD void dp_channel_walk_next(dp_channel_walk *w) {
  w->at += w->jump;
  if (w->i >= w->HW - w->r) { /* i + r passes the plane (written so that i + r cannot overflow) */
    w->i -= w->HW - w->r;
    w->at += w->wrap;
  } else {
    w->i += w->r;
  }
}

/* ---- residual add ---------------------------------------------------------- */

static inline DP_HD float dp_add_elem(float a, float b) { return a + b; }

#endif /* DP_KERNELS_H */
