/* layers.c — the table of layer kinds (layers.h): what the model, the
 * binding and dpcore.models know of each kind, written once.
 *
 * Shape inference runs in 64 bits through shapes.c, so that every size a
 * layer stores fits an int (its kernels index with ints) before it is stored.
 */
#include "layers.h"
#include "dp_limits.h"

#include <limits.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "backend.h"

/* ---- shape inference, per kind ---------------------------------------------- */

static dp_status infer_conv2d(dp_layer *l, const dp_layer_arg_value *a, const int *in2, const char *what) {
  dp_conv_geom g;
  DP_TRY(dp_conv_geom_make(what, l->in_c, l->in_h, l->in_w, a[0].i, a[1].i, a[1].i, a[2].i, a[3].i, &g));
  l->k = g.KH;
  l->stride = g.stride;
  l->pad = g.pad;
  l->out_c = g.O;
  l->out_h = g.OH;
  l->out_w = g.OW;
  return DP_OK;
}

static dp_status infer_dense(dp_layer *l, const dp_layer_arg_value *a, const int *in2, const char *what) {
  const int64_t out = a[0].i;
  if (out < 1) return DP_FAIL(DP_ERR_VALUE, "%s: out_features must be >= 1, got %lld", what, (long long)out);
  /* before the product, which saturates and so would be misreported */
  if (out > DP_MAX_FEATURES)
    return DP_FAIL(DP_ERR_VALUE, "%s: out_features must be at most %d, got %lld", what, DP_MAX_FEATURES,
                   (long long)out);
  if (l->in_h != 1 || l->in_w != 1)
    return DP_FAIL(DP_ERR_VALUE, "%s: input is (%d, %d, %d); add a flatten layer first", what, l->in_c, l->in_h,
                   l->in_w);
  const int64_t weights = dp_size_mul(out, l->in_c);
  if (weights > INT_MAX)
    return DP_FAIL(DP_ERR_VALUE, "%s: %lld weights (%lld x %d), more than the largest supported %d", what,
                   (long long)weights, (long long)out, l->in_c, INT_MAX);
  l->out_c = (int)out;
  l->out_h = l->out_w = 1;
  return DP_OK;
}

static void same_shape(dp_layer *l) {
  l->out_c = l->in_c;
  l->out_h = l->in_h;
  l->out_w = l->in_w;
}

static dp_status infer_elementwise(dp_layer *l, const dp_layer_arg_value *a, const int *in2, const char *what) {
  same_shape(l);
  return DP_OK;
}

static dp_status infer_pool(dp_layer *l, const dp_layer_arg_value *a, const int *in2, const char *what) {
  dp_pool_geom g;
  DP_TRY(dp_pool_geom_make(what, l->in_c, l->in_h, l->in_w, a[0].i, a[1].i, a[2].i, &g));
  l->k = g.k;
  l->stride = g.stride;
  l->pad = g.pad;
  l->out_c = l->in_c;
  l->out_h = g.OH;
  l->out_w = g.OW;
  return DP_OK;
}

static dp_status infer_flatten(dp_layer *l, const dp_layer_arg_value *a, const int *in2, const char *what) {
  /* the source's values per sample, checked to fit an int when it was made */
  l->out_c = (int)((int64_t)l->in_c * l->in_h * l->in_w);
  l->out_h = l->out_w = 1;
  return DP_OK;
}

static dp_status infer_batchnorm(dp_layer *l, const dp_layer_arg_value *a, const int *in2, const char *what) {
  const float eps = (float)a[0].f, momentum = (float)a[1].f;
  if (!(eps > 0.0f)) return DP_FAIL(DP_ERR_VALUE, "%s: eps must be > 0, got %g", what, (double)eps);
  if (!(momentum >= 0.0f && momentum <= 1.0f))
    return DP_FAIL(DP_ERR_VALUE, "%s: momentum must be in [0, 1], got %g", what, (double)momentum);
  l->eps = eps;
  l->momentum = momentum;
  same_shape(l);
  return DP_OK;
}

static dp_status infer_add(dp_layer *l, const dp_layer_arg_value *a, const int *in2, const char *what) {
  if (l->in_c != in2[0] || l->in_h != in2[1] || l->in_w != in2[2])
    return DP_FAIL(DP_ERR_VALUE, "%s: shapes differ: (%d, %d, %d) and (%d, %d, %d)", what, l->in_c, l->in_h, l->in_w,
                   in2[0], in2[1], in2[2]);
  same_shape(l);
  return DP_OK;
}

static dp_status infer_global_avgpool(dp_layer *l, const dp_layer_arg_value *a, const int *in2, const char *what) {
  l->out_c = l->in_c;
  l->out_h = l->out_w = 1;
  return DP_OK;
}

/* ---- the table ---------------------------------------------------------------- */

#define INT_ARG(name) {name, DP_ARG_INT, 0, {0}}
#define FLOAT_ARG_OR(name, value) {name, DP_ARG_FLOAT, 1, {.f = value}}
/* the same rule under every init mode */
#define EITHER(rule) {rule, rule, rule}
#define PARAM(name, rank, dims, normal, torch, d2l) {name, DP_BUFFER_PARAMS, rank, dims, {normal, torch, d2l}}
#define STATE(name, rank, dims, rule) {name, DP_BUFFER_STATE, rank, dims, EITHER(rule)}
#define DIMS(...) {__VA_ARGS__}
/* conv and linear per mode (layers.h: dp_init_mode) */
#define WEIGHT(dims, rank) PARAM("weight", rank, DIMS dims, DP_INIT_NORMAL, DP_INIT_FAN_IN_UNIFORM, DP_INIT_NORMAL)
#define BIAS PARAM("bias", 1, DIMS(DP_DIM_OUT_C), DP_INIT_ZEROS, DP_INIT_FAN_IN_UNIFORM, DP_INIT_FAN_IN_UNIFORM)
#define POOL_ARGS {INT_ARG("kernel"), INT_ARG("stride"), INT_ARG("padding")}

static const dp_layer_kind_info kinds[] = {
    [DP_LAYER_CONV2D] = {.name = "conv2d", .op = "conv2d", .nargs = 4,
                         .args = {INT_ARG("out_channels"), INT_ARG("kernel"), INT_ARG("stride"), INT_ARG("padding")},
                         .split = DP_SPLIT_OUTPUT, .ntensors = 2,
                         .tensors = {WEIGHT((DP_DIM_OUT_C, DP_DIM_IN_C, DP_DIM_K, DP_DIM_K), 4), BIAS},
                         .infer = infer_conv2d},
    [DP_LAYER_DENSE] = {.name = "dense", .op = "dense", .nargs = 1, .args = {INT_ARG("out_features")},
                        .split = DP_SPLIT_OUTPUT, .ntensors = 2,
                        .tensors = {WEIGHT((DP_DIM_OUT_C, DP_DIM_IN_C), 2), BIAS}, .infer = infer_dense},
    [DP_LAYER_RELU] = {.name = "relu", .op = "relu", .split = DP_SPLIT_CHANNELS, .infer = infer_elementwise},
    [DP_LAYER_AVGPOOL] = {.name = "avgpool", .op = "avg_pool2d", .nargs = 3, .args = POOL_ARGS,
                          .split = DP_SPLIT_CHANNELS, .infer = infer_pool},
    [DP_LAYER_MAXPOOL] = {.name = "maxpool", .op = "max_pool2d", .nargs = 3, .args = POOL_ARGS,
                          .split = DP_SPLIT_CHANNELS, .infer = infer_pool},
    [DP_LAYER_FLATTEN] = {.name = "flatten", .op = "flatten", .view = 1, .infer = infer_flatten},
    /* gamma 1, beta 0; running mean 0, running variance 1 (PyTorch's) */
    [DP_LAYER_BATCHNORM] = {.name = "batchnorm", .op = "batchnorm", .nargs = 2,
                            .args = {FLOAT_ARG_OR("eps", 1e-5), FLOAT_ARG_OR("momentum", 0.1)},
                            .split = DP_SPLIT_CHANNELS, .batch_stats = 1, .ntensors = 4,
                            .tensors = {PARAM("weight", 1, DIMS(DP_DIM_IN_C), DP_INIT_ONES, DP_INIT_ONES,
                                              DP_INIT_ONES),
                                        PARAM("bias", 1, DIMS(DP_DIM_IN_C), DP_INIT_ZEROS, DP_INIT_ZEROS,
                                              DP_INIT_ZEROS),
                                        STATE("running_mean", 1, DIMS(DP_DIM_IN_C), DP_INIT_ZEROS),
                                        STATE("running_var", 1, DIMS(DP_DIM_IN_C), DP_INIT_ONES)},
                            .infer = infer_batchnorm},
    [DP_LAYER_ADD] = {.name = "add", .op = "add", .nargs = 2, .args = {INT_ARG("layer_a"), INT_ARG("layer_b")},
                      .sources = 2, .joins = DP_JOIN_SUM, .infer = infer_add},
    [DP_LAYER_GLOBAL_AVGPOOL] = {.name = "global_avgpool", .op = "global_avgpool", .split = DP_SPLIT_CHANNELS,
                                 .infer = infer_global_avgpool},
};
/* One entry per kind; and, as ggml counts its ops, the count written out, so
 * that a new kind is added here (and to model.c's forward and backward) on purpose. */
_Static_assert(sizeof kinds / sizeof kinds[0] == DP_LAYER_KIND_COUNT, "every layer kind needs its entry in kinds[]");
_Static_assert(DP_LAYER_KIND_COUNT == 9, "a new layer kind: its entry in kinds[], its forward and backward in model.c");

#undef INT_ARG
#undef FLOAT_ARG_OR
#undef EITHER
#undef PARAM
#undef STATE
#undef DIMS
#undef WEIGHT
#undef BIAS
#undef POOL_ARGS

static const char *const dim_names[] = {[DP_DIM_OUT_C] = "out_channels", [DP_DIM_IN_C] = "in_channels",
                                        [DP_DIM_K] = "kernel"};
_Static_assert(sizeof dim_names / sizeof dim_names[0] == DP_DIM_COUNT, "every dimension needs its name");
static const char *const init_rule_names[] = {[DP_INIT_ZEROS] = "zeros", [DP_INIT_ONES] = "ones",
                                              [DP_INIT_NORMAL] = "normal",
                                              [DP_INIT_FAN_IN_UNIFORM] = "fan_in_uniform"};
_Static_assert(sizeof init_rule_names / sizeof init_rule_names[0] == DP_INIT_RULE_COUNT, "every rule needs its name");
/* dp.models' init= values */
static const char *const init_mode_names[] = {[DP_INIT_MODE_NORMAL] = "normal", [DP_INIT_MODE_TORCH] = "torch",
                                              [DP_INIT_MODE_D2L] = "d2l"};
_Static_assert(sizeof init_mode_names / sizeof init_mode_names[0] == DP_INIT_MODE_COUNT, "every mode needs its name");

const dp_layer_kind_info *dp_layer_kind_info_of(dp_layer_kind k) { return &kinds[k]; }

const char *dp_layer_split_name(dp_layer_split s) {
  return s == DP_SPLIT_OUTPUT ? "output" : s == DP_SPLIT_CHANNELS ? "channels" : NULL;
}

const char *dp_layer_join_name(dp_layer_join j) { return j == DP_JOIN_SUM ? "sum" : NULL; }

int dp_layer_kind_find(const char *name) {
  for (int k = 0; k < DP_LAYER_KIND_COUNT; ++k)
    if (strcmp(kinds[k].name, name) == 0) return k;
  return -1;
}

const char *dp_layer_dim_name(dp_layer_dim d) { return dim_names[d]; }
const char *dp_init_rule_name(dp_init_rule r) { return init_rule_names[r]; }
const char *dp_init_mode_name(dp_init_mode m) { return init_mode_names[m]; }

dp_status dp_layer_args_fill(dp_layer_kind k, const char *what, const dp_layer_arg_value *args, int nargs,
                             dp_layer_arg_value out[DP_LAYER_MAX_ARGS]) {
  const dp_layer_kind_info *info = &kinds[k];
  int required = 0;
  while (required < info->nargs && !info->args[required].optional) ++required;
  if (nargs < required || nargs > info->nargs) {
    char names[128] = "";
    size_t used = 0;
    for (int i = 0; i < info->nargs && used < sizeof names; ++i)
      used += (size_t)snprintf(names + used, sizeof names - used, "%s%s", i ? ", " : "", info->args[i].name);
    if (info->nargs == 0) return DP_FAIL(DP_ERR_VALUE, "%s: takes no arguments, got %d", what, nargs);
    if (required == info->nargs)
      return DP_FAIL(DP_ERR_VALUE, "%s: takes %d argument%s (%s), got %d", what, required, required == 1 ? "" : "s",
                     names, nargs);
    return DP_FAIL(DP_ERR_VALUE, "%s: takes %d to %d arguments (%s), got %d", what, required, info->nargs, names,
                   nargs);
  }
  for (int i = 0; i < info->nargs; ++i) out[i] = i < nargs ? args[i] : info->args[i].fallback;
  return DP_OK;
}

int64_t dp_layer_dim_of(const dp_layer *l, dp_layer_dim d) {
  switch (d) {
    case DP_DIM_OUT_C: return l->out_c;
    case DP_DIM_IN_C: return l->in_c;
    case DP_DIM_K: return l->k;
    case DP_DIM_COUNT: break;
  }
  return 0;
}

int64_t dp_layer_tensor_size(const dp_layer *l, int t) {
  const dp_layer_tensor *x = &kinds[l->kind].tensors[t];
  int64_t n = 1;
  for (int i = 0; i < x->rank; ++i) n = dp_size_mul(n, dp_layer_dim_of(l, x->dims[i]));
  return n;
}

int64_t dp_layer_tensor_offset(const dp_layer *l, int t) {
  const dp_layer_kind_info *info = &kinds[l->kind];
  if (info->tensors[t].buffer == DP_BUFFER_PARAMS) return t == 0 ? l->w_off : l->b_off;
  int64_t off = l->state_off;
  for (int i = 0; i < t; ++i)
    if (info->tensors[i].buffer == DP_BUFFER_STATE) off += dp_layer_tensor_size(l, i);
  return off;
}
