/* model.h — a sequential network whose parameters live in one flat buffer.
 *
 * Build: dp_model_create, then dp_model_add_* per layer, then
 * dp_model_finalize, which lays every weight and bias out in one flat
 * parameter buffer (and the same layout in the gradient and momentum
 * buffers): replication is one copy, the gradient all-reduce one collective,
 * the SGD step one fused kernel.
 */
#ifndef DP_MODEL_H
#define DP_MODEL_H

#include <stdint.h>

#include "backend.h"

typedef enum dp_layer_kind {
  DP_LAYER_CONV2D,
  DP_LAYER_DENSE,
  DP_LAYER_RELU,
  DP_LAYER_AVGPOOL,
  DP_LAYER_MAXPOOL,
  DP_LAYER_FLATTEN
} dp_layer_kind;

typedef struct dp_layer {
  dp_layer_kind kind;
  int in_c, in_h, in_w;     /* per-sample input shape (dense: in_c features, h = w = 1) */
  int out_c, out_h, out_w;  /* per-sample output shape */
  int k, stride, pad;       /* conv (square kernel) and pooling */
  int64_t w_off, w_len;     /* into the flat buffers; w_len == 0: no parameters */
  int64_t b_off, b_len;
} dp_layer;

typedef struct dp_model {
  dp_device *dev;           /* borrowed; outlives the model */
  int nlayers, cap;
  dp_layer *layers;
  int in_c, in_h, in_w;
  int finalized;
  int64_t nparams;
  float *params, *grads, *velocity;  /* flat, (nparams), device memory */
  /* activations for up to act_batch samples; acts[i] is layer i's output */
  int64_t act_batch;
  float **acts;
  int32_t **argmax;         /* max-pool winners, per layer (NULL otherwise) */
  float *grad_a, *grad_b;   /* backward ping-pong, the largest activation */
  float *input;             /* the batch on the device, (act_batch, in_c, in_h, in_w) */
  int32_t *labels;          /* (act_batch) */
} dp_model;

/* A batch as it comes from the host: images uint8 (scaled by 1/255) or float32,
 * NCHW matching the model's input; labels int64 (may be NULL for predict). */
typedef struct dp_batch {
  const void *x;
  int x_is_u8;
  const int64_t *y;
  int64_t n;
} dp_batch;

dp_status dp_model_create(dp_device *dev, int in_c, int in_h, int in_w, dp_model **out);
void dp_model_destroy(dp_model *m);
dp_status dp_model_add_conv2d(dp_model *m, int out_c, int k, int stride, int pad);
dp_status dp_model_add_dense(dp_model *m, int out_features);
dp_status dp_model_add_relu(dp_model *m);
dp_status dp_model_add_avgpool(dp_model *m, int k, int stride, int pad);
dp_status dp_model_add_maxpool(dp_model *m, int k, int stride, int pad);
dp_status dp_model_add_flatten(dp_model *m);
dp_status dp_model_finalize(dp_model *m);
int dp_model_num_classes(const dp_model *m);

/* Copy the flat parameters from / to host memory (nparams floats). */
dp_status dp_model_set_params(dp_model *m, const float *host);
dp_status dp_model_get_params(dp_model *m, float *host);
dp_status dp_model_get_grads(dp_model *m, float *host);
dp_status dp_model_reset_velocity(dp_model *m);

/* Forward and backward on one batch. The gradient written to m->grads is
 * grad_scale * (sum over the batch's samples of d loss_i / d params): pass
 * 1/n for the mean, 1/global_n for a shard of a larger batch.
 * *loss_sum and *correct are sums over the batch. */
dp_status dp_model_forward_backward(dp_model *m, const dp_batch *b, float grad_scale, double *loss_sum,
                                    int64_t *correct);
/* w -= lr * (momentum-smoothed g + wd * w), over the flat buffer, one kernel. */
dp_status dp_model_sgd_step(dp_model *m, float lr, float momentum, float weight_decay);
/* Forward only: loss and accuracy sums (labels required). */
dp_status dp_model_evaluate(dp_model *m, const dp_batch *b, double *loss_sum, int64_t *correct);
/* Forward only: logits (n, num_classes) copied to host memory. */
dp_status dp_model_predict(dp_model *m, const dp_batch *b, float *logits_host);

#endif
