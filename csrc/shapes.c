/* shapes.c — the geometry of convolutions and pooling from their arguments,
 * computed in 64 bits and checked once, where a layer (or a single op) is
 * made: `in + 2 * pad` and the products of a shape overflow an int long before
 * they overflow an int64_t. Past these checks every size the kernels index
 * with an int (backend_cpu.c, dp_kernels.h, cuDNN's and cuBLAS's int
 * arguments) is at most INT_MAX. */
#include <limits.h>

#include "backend.h"
#include "dp_limits.h"

int64_t dp_size_mul(int64_t a, int64_t b) {
  if (a <= 0 || b <= 0) return 0;
  return a > INT64_MAX / b ? INT64_MAX : a * b;
}

/* value in [lo, INT_MAX], or DP_ERR_VALUE naming the argument */
static dp_status check_arg(const char *what, const char *name, int64_t value, int64_t lo) {
  if (value < lo) return DP_FAIL(DP_ERR_VALUE, "%s: %s must be >= %lld, got %lld", what, name, (long long)lo,
                                 (long long)value);
  if (value > INT_MAX)
    return DP_FAIL(DP_ERR_VALUE, "%s: %s %lld is larger than the largest supported size %d", what, name,
                   (long long)value, INT_MAX);
  return DP_OK;
}

/* the c * h * w values of one sample of an input or output fit in an int */
static dp_status check_volume(const char *what, const char *name, int64_t c, int64_t h, int64_t w) {
  const int64_t n = dp_size_mul(dp_size_mul(c, h), w);
  if (n > INT_MAX)
    return DP_FAIL(DP_ERR_VALUE, "%s: the %s (%lld, %lld, %lld) has %lld values, more than the largest supported %d",
                   what, name, (long long)c, (long long)h, (long long)w, (long long)n, INT_MAX);
  return DP_OK;
}

/* channels (or features) in [1, DP_MAX_FEATURES] */
static dp_status check_features(const char *what, const char *name, int64_t value) {
  DP_TRY(check_arg(what, name, value, 1));
  if (value > DP_MAX_FEATURES)
    return DP_FAIL(DP_ERR_VALUE, "%s: %s must be at most %d, got %lld", what, name, DP_MAX_FEATURES, (long long)value);
  return DP_OK;
}

dp_status dp_input_shape_check(const char *what, int64_t C, int64_t H, int64_t W) {
  DP_TRY(check_features(what, "channels", C));
  DP_TRY(check_arg(what, "height", H, 1));
  DP_TRY(check_arg(what, "width", W, 1));
  return check_volume(what, "input", C, H, W);
}

/* The window arguments shared by convolution and pooling. */
static dp_status check_window(const char *what, int64_t kh, int64_t kw, int64_t stride, int64_t pad) {
  DP_TRY(check_arg(what, "kernel", kh, 1));
  DP_TRY(check_arg(what, "kernel", kw, 1));
  DP_TRY(check_arg(what, "stride", stride, 1));
  return check_arg(what, "padding", pad, 0);
}

/* The output extent (oh, ow) of a kh x kw window over (H, W), arguments
 * checked: cuDNN's 1 + (in + 2*pad - k) / stride, which dp_pool_out_dim
 * computes for pooling and convolution alike. */
static dp_status window_out(const char *what, int64_t H, int64_t W, int64_t kh, int64_t kw, int64_t stride,
                            int64_t pad, int64_t *oh, int64_t *ow) {
  if (H + 2 * pad < kh || W + 2 * pad < kw)
    return DP_FAIL(DP_ERR_VALUE, "%s: kernel %lldx%lld is larger than the padded input %lldx%lld (padding %lld)", what,
                   (long long)kh, (long long)kw, (long long)H, (long long)W, (long long)pad);
  *oh = dp_pool_out_dim(H, kh, stride, pad);
  *ow = dp_pool_out_dim(W, kw, stride, pad);
  return DP_OK;
}

dp_status dp_conv_geom_make(const char *what, int64_t C, int64_t H, int64_t W, int64_t O, int64_t KH, int64_t KW,
                            int64_t stride, int64_t pad, dp_conv_geom *out) {
  DP_TRY(dp_input_shape_check(what, C, H, W));
  DP_TRY(check_features(what, "out_channels", O));
  DP_TRY(check_window(what, KH, KW, stride, pad));
  int64_t OH = 0, OW = 0;
  DP_TRY(window_out(what, H, W, KH, KW, stride, pad, &OH, &OW));
  DP_TRY(check_volume(what, "output", O, OH, OW));
  /* the filter bank (and so im2col's C*KH*KW rows) */
  const int64_t weights = dp_size_mul(dp_size_mul(O, C), dp_size_mul(KH, KW));
  if (weights > INT_MAX)
    return DP_FAIL(DP_ERR_VALUE, "%s: %lld weights (%lld x %lld x %lld x %lld), more than the largest supported %d",
                   what, (long long)weights, (long long)O, (long long)C, (long long)KH, (long long)KW, INT_MAX);
  *out = (dp_conv_geom){(int)C, (int)H, (int)W, (int)O, (int)KH, (int)KW, (int)stride, (int)pad, (int)OH, (int)OW};
  return DP_OK;
}

dp_status dp_pool_geom_make(const char *what, int64_t C, int64_t H, int64_t W, int64_t k, int64_t stride, int64_t pad,
                            dp_pool_geom *out) {
  DP_TRY(dp_input_shape_check(what, C, H, W));
  DP_TRY(check_window(what, k, k, stride, pad));
  /* a window of padding alone would average zeros and have no max */
  if (2 * pad > k)
    return DP_FAIL(DP_ERR_VALUE, "%s: padding %lld must be at most half the kernel %lld", what, (long long)pad,
                   (long long)k);
  int64_t OH = 0, OW = 0;
  DP_TRY(window_out(what, H, W, k, k, stride, pad, &OH, &OW));
  DP_TRY(check_volume(what, "output", C, OH, OW));
  *out = (dp_pool_geom){(int)C, (int)H, (int)W, (int)OH, (int)OW, (int)k, (int)stride, (int)pad};
  return DP_OK;
}
