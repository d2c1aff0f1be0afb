/* core_smoke.c — the C core without Python, for AddressSanitizer,
 * LeakSanitizer and UndefinedBehaviorSanitizer (tests/test_sanitizers.py
 * builds it with -fsanitize=address,undefined and runs it).
 *
 * Builds LeNet and a model with max-pooling, strides and padding, trains a
 * few steps on odd batch sizes (1, 7, 0), predicts, evaluates, provokes every
 * argument error the model API reports, and frees everything. Exit status 0
 * only if every check passed; the sanitizers fail the run on any leak or UB. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dp_limits.h"
#include "backend.h"
#include "model.h"
#include "resident.h"
#include "check.h"

static dp_status build(dp_device *dev, int variant, dp_model **out) {
  dp_model *m = NULL;
  DP_TRY(dp_model_create(dev, 1, 28, 28, &m));
  *out = m;
  if (variant == 0) { /* LeNet */
    DP_TRY(dp_model_add_conv2d(m, 20, 3, 1, 0));
    DP_TRY(dp_model_add_relu(m));
    DP_TRY(dp_model_add_avgpool(m, 2, 2, 0));
    DP_TRY(dp_model_add_conv2d(m, 50, 5, 1, 0));
    DP_TRY(dp_model_add_relu(m));
    DP_TRY(dp_model_add_avgpool(m, 2, 2, 0));
  } else if (variant == 2) { /* a residual block with BatchNorm, as in ResNet-18 */
    DP_TRY(dp_model_add_conv2d(m, 8, 3, 1, 1));
    DP_TRY(dp_model_add_batchnorm(m, 1e-5f, 0.1f));
    DP_TRY(dp_model_add_relu(m)); /* layer 2: the block input */
    DP_TRY(dp_model_add_conv2d(m, 16, 3, 2, 1));
    DP_TRY(dp_model_add_batchnorm(m, 1e-5f, 0.1f)); /* layer 4: main path */
    DP_TRY(dp_model_set_source(m, 2));
    DP_TRY(dp_model_add_conv2d(m, 16, 1, 2, 0)); /* layer 5: 1x1 shortcut */
    DP_TRY(dp_model_add_add(m, 4, 5));
    DP_TRY(dp_model_add_relu(m));
    DP_TRY(dp_model_add_global_avgpool(m));
  } else { /* strides, padding, overlapping max-pooling */
    DP_TRY(dp_model_add_conv2d(m, 8, 3, 2, 1));
    DP_TRY(dp_model_add_relu(m));
    DP_TRY(dp_model_add_maxpool(m, 3, 2, 1));
    DP_TRY(dp_model_add_conv2d(m, 6, 1, 1, 0));
  }
  DP_TRY(dp_model_add_flatten(m));
  DP_TRY(dp_model_add_dense(m, 32));
  DP_TRY(dp_model_add_relu(m));
  DP_TRY(dp_model_add_dense(m, 10));
  return dp_model_finalize(m);
}

static void train_variant(dp_device *dev, int variant) {
  dp_model *m = NULL;
  dp_status st = build(dev, variant, &m);
  CHECK(st == DP_OK);
  if (st != DP_OK) {
    fprintf(stderr, "build: %s\n", dp_error_message());
    dp_model_destroy(m);
    return;
  }
  float *params = malloc(sizeof(float) * (size_t)m->nparams);
  for (int64_t i = 0; i < m->nparams; ++i) params[i] = 0.1f * (uniform() - 0.5f);
  CHECK(dp_model_set_params(m, params) == DP_OK);
  const int64_t sizes[] = {7, 1, 0, 16};
  float *x = malloc(sizeof(float) * 16 * 28 * 28);
  int64_t y[16];
  for (int i = 0; i < 16 * 28 * 28; ++i) x[i] = uniform();
  for (int i = 0; i < 16; ++i) y[i] = i % 10;
  for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; ++k) {
    dp_batch b = {x, 0, y, sizes[k], NULL, NULL};
    double loss = 0;
    int64_t correct = 0;
    st = dp_model_forward_backward(m, &b, sizes[k] ? 1.0f / (float)sizes[k] : 0.0f, &loss, &correct);
    CHECK(st == DP_OK && isfinite(loss));
    CHECK(dp_model_sgd_step(m, 0.1f, 0.9f, 1e-4f) == DP_OK);
  }
  uint8_t *xu = malloc(16 * 28 * 28);
  for (int i = 0; i < 16 * 28 * 28; ++i) xu[i] = (uint8_t)(uniform() * 255);
  dp_batch bu = {xu, 1, y, 16, NULL, NULL};
  double loss = 0;
  int64_t correct = -1;
  CHECK(dp_model_evaluate(m, &bu, &loss, &correct) == DP_OK && correct >= 0 && correct <= 16);
  float logits[16 * 10];
  CHECK(dp_model_predict(m, &bu, logits) == DP_OK && isfinite(logits[0]));
  /* the same uint8 batch resident on the device: gathered rows give the same loss */
  dp_resident *res = NULL;
  CHECK(dp_resident_create(dev, xu, 1, y, 16, 28 * 28, 10, &res) == DP_OK);
  if (res) {
    const int64_t rows[5] = {15, 0, 7, 7, 3};
    double rloss = 0, hloss = 0;
    int64_t rc = 0, hc = 0;
    uint8_t *xh = malloc(5 * 28 * 28);
    int64_t yh[5];
    for (int r = 0; r < 5; ++r) {
      memcpy(xh + r * 28 * 28, xu + rows[r] * 28 * 28, 28 * 28);
      yh[r] = y[rows[r]];
    }
    dp_batch bh = {xh, 1, yh, 5, NULL, NULL};
    CHECK(dp_model_forward_backward(m, &bh, 0.2f, &hloss, &hc) == DP_OK);
    CHECK(dp_model_load_rows(m, res, rows, 5) == DP_OK);
    CHECK(dp_model_forward_backward_loaded(m, 5, 0.2f, NULL, &rloss, &rc) == DP_OK);
    CHECK(rloss == hloss && rc == hc);
    const int64_t bad_rows[2] = {1, 16};
    CHECK(dp_model_load_rows(m, res, bad_rows, 2) == DP_ERR_VALUE);
    CHECK(strstr(dp_error_message(), "outside the resident dataset") != NULL);
    free(xh);
    dp_resident_destroy(res);
  }
  y[3] = 12;
  CHECK(dp_resident_create(dev, xu, 1, y, 16, 28 * 28, 10, &res) == DP_ERR_VALUE && res == NULL);
  y[3] = 3;
  /* errors are values, with a message naming the problem */
  y[3] = 10;
  dp_batch bad = {x, 0, y, 16, NULL, NULL};
  CHECK(dp_model_forward_backward(m, &bad, 1.0f, &loss, &correct) == DP_ERR_VALUE);
  CHECK(strstr(dp_error_message(), "label 10 at index 3") != NULL);
  y[3] = 3;
  CHECK(dp_model_sgd_step(m, -1.0f, 0.0f, 0.0f) == DP_ERR_VALUE);
  CHECK(dp_model_add_relu(m) == DP_ERR_VALUE); /* finalized */
  free(xu);
  free(x);
  free(params);
  dp_model_destroy(m);
}

/* status == DP_ERR_VALUE and the message names `what` */
static int value_error_naming(dp_status status, const char *what) {
  if (status == DP_ERR_VALUE && strstr(dp_error_message(), what)) return 1;
  fprintf(stderr, "expected a DP_ERR_VALUE naming '%s', got %s: %s\n", what, dp_status_name(status),
          dp_error_message());
  return 0;
}

/* Shapes whose sizes overflow an int are rejected where the layer is added,
 * naming the layer; the model stays as it was (nothing is allocated before
 * finalize, so none of these needs memory). */
/* The SGD arguments and the gradient scale: finite, >= 0 (the SGD ones) and
 * within float32's range, checked as the doubles the binding parsed. */
static void check_sgd_args(void) {
  CHECK(dp_sgd_args_check(0.1, 0.9, 5e-4) == DP_OK && dp_sgd_args_check(0.0, 0.0, 0.0) == DP_OK);
  CHECK(value_error_naming(dp_sgd_args_check(NAN, 0.0, 0.0), "lr"));
  CHECK(value_error_naming(dp_sgd_args_check(1e39, 0.0, 0.0), "lr"));
  CHECK(strstr(dp_error_message(), "1e+39") != NULL);
  CHECK(value_error_naming(dp_sgd_args_check(-0.1, 0.0, 0.0), "lr"));
  CHECK(value_error_naming(dp_sgd_args_check(0.1, -INFINITY, 0.0), "momentum"));
  CHECK(value_error_naming(dp_sgd_args_check(0.1, 0.0, INFINITY), "weight_decay"));
  CHECK(dp_grad_scale_check(-0.25) == DP_OK);
  CHECK(value_error_naming(dp_grad_scale_check(NAN), "grad_scale"));
  CHECK(value_error_naming(dp_grad_scale_check(-1e39), "grad_scale"));
}

static void check_sizes(dp_device *dev) {
  dp_model *m = NULL;
  /* 2^15 x 2^16 values per sample */
  CHECK(value_error_naming(dp_model_create(dev, 1, 1 << 15, 1 << 16, &m), "model input") && m == NULL);
  CHECK(dp_model_create(dev, 1, 28, 28, &m) == DP_OK);
  if (!m) return;
  /* in_h + 2 * pad overflows an int: the output would be (2^31 + 26)^2 */
  CHECK(value_error_naming(dp_model_add_conv2d(m, 1, 3, 1, 1 << 30), "conv2d (layer 0)"));
  CHECK(strstr(dp_error_message(), "output") != NULL);
  /* (2^30, 28, 28) values per sample */
  CHECK(value_error_naming(dp_model_add_conv2d(m, 1 << 30, 1, 1, 0), "conv2d (layer 0)"));
  /* more channels than the documented limit (dp_limits.h) */
  CHECK(value_error_naming(dp_model_add_conv2d(m, DP_MAX_FEATURES + 1, 28, 1, 0), "out_channels"));
  /* padding at most half the kernel, 2 * pad computed without overflow */
  CHECK(value_error_naming(dp_model_add_avgpool(m, 1 << 30, 1, 1 << 30), "avg_pool2d (layer 0)"));
  CHECK(value_error_naming(dp_model_add_maxpool(m, 3, 0, 1), "stride"));
  CHECK(m->nlayers == 0);
  CHECK(dp_model_add_conv2d(m, 20, 3, 1, 0) == DP_OK); /* 26x26 */
  CHECK(dp_model_add_flatten(m) == DP_OK);              /* 13520 features */
  CHECK(value_error_naming(dp_model_add_dense(m, 1 << 20), "dense (layer 2)"));
  CHECK(strstr(dp_error_message(), "out_features") != NULL);
  CHECK(dp_model_add_dense(m, 10) == DP_OK);
  CHECK(m->nlayers == 3);
  dp_model_destroy(m);
  /* within the limits, but over INT_MAX weights: a (65536, 1, 1) output of 65536 x 64 x 28 x 28 weights, and a
   * dense layer of 65536 x 2048^2 */
  CHECK(dp_model_create(dev, 64, 28, 28, &m) == DP_OK);
  if (!m) return;
  CHECK(value_error_naming(dp_model_add_conv2d(m, DP_MAX_FEATURES, 28, 1, 0), "weights"));
  dp_model_destroy(m);
  CHECK(dp_model_create(dev, 1, 2048, 2048, &m) == DP_OK);
  if (!m) return;
  CHECK(dp_model_add_flatten(m) == DP_OK);
  CHECK(value_error_naming(dp_model_add_dense(m, DP_MAX_FEATURES), "weights"));
  dp_model_destroy(m);
  /* pooling that grows the plane past INT_MAX values: 46340^2 fits, 46341^2 does not */
  CHECK(dp_model_create(dev, 1, 46340, 46340, &m) == DP_OK);
  if (!m) return;
  CHECK(value_error_naming(dp_model_add_maxpool(m, 2, 1, 1), "max_pool2d (layer 0)"));
  CHECK(dp_model_add_maxpool(m, 2, 2, 0) == DP_OK);
  dp_model_destroy(m);
  /* the single ops' geometry takes the binding's 64-bit values as they are */
  dp_conv_geom cg;
  dp_pool_geom pg;
  CHECK(value_error_naming(dp_conv_geom_make("conv2d", 1, 28, 28, 8, 3, 3, (int64_t)1 << 40, 0, &cg), "stride"));
  CHECK(value_error_naming(dp_conv_geom_make("conv2d", 1, 28, 28, 8, 3, 3, 1, (int64_t)1 << 31, &cg), "padding"));
  CHECK(value_error_naming(dp_conv_geom_make("conv2d", 1, 28, 28, 8, 3, 3, 1, -1, &cg), "padding"));
  CHECK(value_error_naming(dp_pool_geom_make("avg_pool2d", 1, 28, 28, (int64_t)1 << 40, 1, 0, &pg), "kernel"));
  CHECK(dp_conv_geom_make("conv2d", 3, 28, 28, 8, 5, 3, 2, 1, &cg) == DP_OK && cg.OH == 13 && cg.OW == 14);
  CHECK(dp_pool_geom_make("avg_pool2d", 3, 28, 28, 3, 2, 1, &pg) == DP_OK && pg.OH == 14 && pg.OW == 14);
}

/* The layer kinds' table is whole and keeps the rules its readers rely on:
 * parameter tensors first and at most two (w_off, b_off), optional arguments
 * last, a state tensor starting alike under every init mode. */
static void check_layer_table(void) {
  for (int k = 0; k < DP_LAYER_KIND_COUNT; ++k) {
    const dp_layer_kind_info *info = dp_layer_kind_info_of((dp_layer_kind)k);
    CHECK(info->name && info->op && info->infer);
    if (!info->name) continue;
    CHECK(dp_layer_kind_find(info->name) == k);
    CHECK(info->nargs >= 0 && info->nargs <= DP_LAYER_MAX_ARGS && info->sources <= info->nargs && info->sources <= 2);
    for (int i = 0; i < info->nargs; ++i) {
      CHECK(info->args[i].name != NULL);
      if (i > 0) CHECK(info->args[i].optional >= info->args[i - 1].optional);
      if (i < info->sources) CHECK(info->args[i].type == DP_ARG_INT && !info->args[i].optional);
    }
    int params = 0;
    for (int t = 0; t < info->ntensors; ++t) {
      const dp_layer_tensor *x = &info->tensors[t];
      CHECK(x->name && x->rank >= 1 && x->rank <= 4);
      if (x->buffer == DP_BUFFER_PARAMS) CHECK(params++ == t);
      else CHECK(x->init[DP_INIT_MODE_NORMAL] == x->init[DP_INIT_MODE_TORCH]);
      for (int u = 0; u < t; ++u) CHECK(strcmp(info->tensors[u].name, x->name) != 0);
    }
    CHECK(params <= DP_LAYER_MAX_PARAM_TENSORS);
  }
  CHECK(dp_layer_kind_find("conv3d") == -1);
}

/* dp_model_add_layer refuses, naming the layer and its arguments, what the
 * binding passes through unchecked: argument counts, 64-bit values, sources. */
static void check_layer_arguments(dp_device *dev) {
  dp_model *m = NULL;
  CHECK(dp_model_create(dev, 1, 8, 8, &m) == DP_OK);
  if (!m) return;
  const dp_layer_arg_value conv[] = {{.i = 4}, {.i = 3}, {.i = 1}, {.i = (int64_t)1 << 31}};
  CHECK(value_error_naming(dp_model_add_layer(m, DP_LAYER_CONV2D, conv, 3),
                           "conv2d (layer 0): takes 4 arguments (out_channels, kernel, stride, padding), got 3"));
  CHECK(value_error_naming(dp_model_add_layer(m, DP_LAYER_CONV2D, conv, 4), "conv2d (layer 0): padding 2147483648"));
  CHECK(value_error_naming(dp_model_add_layer(m, DP_LAYER_RELU, conv, 1), "relu (layer 0): takes no arguments"));
  const dp_layer_arg_value bn[] = {{.f = 1e-3}, {.f = 0.5}, {.f = 0.0}};
  CHECK(value_error_naming(dp_model_add_layer(m, DP_LAYER_BATCHNORM, bn, 3),
                           "batchnorm (layer 0): takes 0 to 2 arguments (eps, momentum), got 3"));
  CHECK(value_error_naming(dp_model_add_layer(m, DP_LAYER_BATCHNORM, (dp_layer_arg_value[]){{.f = -1.0}}, 1),
                           "batchnorm (layer 0): eps must be > 0"));
  CHECK(value_error_naming(dp_model_add_layer(m, (dp_layer_kind)DP_LAYER_KIND_COUNT, NULL, 0), "unknown layer kind"));
  const dp_layer_arg_value add[] = {{.i = -1}, {.i = 0}};
  CHECK(value_error_naming(dp_model_add_layer(m, DP_LAYER_ADD, add, 2),
                           "add (layer 0): layer_b 0 is not an existing layer"));
  CHECK(value_error_naming(dp_model_set_source(m, (int64_t)1 << 32), "source 4294967296"));
  CHECK(m->nlayers == 0);
  /* defaults filled in: batchnorm with no arguments is eps 1e-5, momentum 0.1 */
  CHECK(dp_model_add_layer(m, DP_LAYER_BATCHNORM, NULL, 0) == DP_OK);
  CHECK(m->nlayers == 1 && m->layers[0].eps == 1e-5f && m->layers[0].momentum == 0.1f);
  CHECK(dp_model_add_add(m, -1, 0) == DP_OK && m->layers[1].src == -1 && m->layers[1].src2 == 0);
  dp_model_destroy(m);
}

int main(void) {
  check_layer_table();
  dp_device dev;
  if (dp_cpu_device_init(&dev, 0, 2) != DP_OK) return 2;
  train_variant(&dev, 0);
  train_variant(&dev, 1);
  train_variant(&dev, 2);
  /* construction errors leave nothing behind */
  dp_model *m = NULL;
  CHECK(dp_model_create(&dev, 0, 28, 28, &m) == DP_ERR_VALUE && m == NULL);
  CHECK(dp_model_create(&dev, 1, 4, 4, &m) == DP_OK);
  CHECK(dp_model_add_conv2d(m, 4, 7, 1, 0) == DP_ERR_VALUE);
  CHECK(dp_model_add_dense(m, 3) == DP_ERR_VALUE); /* needs flatten first */
  CHECK(dp_model_finalize(m) == DP_ERR_VALUE);     /* no layers */
  dp_model_destroy(m);
  check_sizes(&dev);
  check_sgd_args();
  check_layer_arguments(&dev);
  dp_device_destroy(&dev);
  if (failures) fprintf(stderr, "%d checks failed\n", failures);
  printf("core_smoke: %s\n", failures ? "FAILED" : "ok");
  return failures ? 1 : 0;
}
