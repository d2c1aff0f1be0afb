/* model.h — a feed-forward network whose parameters live in one flat buffer.
 *
 * Build: dp_model_create, then dp_model_add_layer (or a dp_model_add_*
 * shorthand) per layer, then dp_model_finalize, which lays every weight and
 * bias out in one flat parameter buffer (and the same layout in the gradient
 * and momentum buffers): replication is one copy, the gradient all-reduce one collective,
 * the SGD step one fused kernel. Layers read the previous layer's output
 * unless dp_model_set_source names another (residual blocks: a layer's output
 * may feed several layers; an add layer reads two). BatchNorm's running
 * statistics live in a second flat buffer, the model's state.
 *
 * Fused pairs (dp_model_finalize): a ReLU whose only reader is the average
 * pooling after it, and a BatchNorm or an add whose only reader is the ReLU
 * after it, run with it as one backend op, bit for bit the two ops' results.
 * DPCORE_FUSE=0 in the environment when the model is finalized runs every
 * layer alone.
 */
#ifndef DP_MODEL_H
#define DP_MODEL_H

#include <stdint.h>

#include "backend.h"
#include "collective.h"
#include "layers.h"
#include "resident.h"
#include "trace.h"

#define DP_SRC_PREVIOUS (-2)

typedef struct dp_model {
  dp_device *dev;           /* borrowed; outlives the model */
  int nlayers, cap;
  dp_layer *layers;
  int in_c, in_h, in_w;
  int next_src;             /* source of the next layer added; DP_SRC_PREVIOUS by default */
  int finalized;
  int unfused;              /* run every layer on its own (check_numerics: each layer's output gradient is kept) */
  dp_conv_keep *conv_keep;  /* per layer: a convolution's filter transform kept from forward to backward */
  int keep_on;              /* conv_keep in use: inside dp_model_forward_backward_loaded only */
  int64_t nparams;
  float *params, *grads, *velocity;  /* flat, (nparams), device memory; grads has one float more: */
  /* grads[nparams] is the loss flag of the last training forward pass
   * (dp_loss_flag: 0 finite, NaN not), all-reduced with the gradients so that
   * every replica's SGD kernel skips a step whose global loss is not finite */
  int64_t nstate;
  float *state;             /* BatchNorm running statistics, (nstate) */
  float *state_before;      /* (nstate) the running statistics before the last training forward pass */
  int training;             /* set by forward: batch statistics (1) or running ones (0) */
  /* activations for up to act_batch samples; acts[i] is layer i's output */
  int64_t act_batch;
  float **acts;
  int32_t **argmax;         /* max-pool winners, per layer (NULL otherwise) */
  float **dacts;            /* gradient of each layer's output */
  float *dscratch;          /* the largest activation: a second gradient to add in */
  unsigned char *dready;    /* per layer: dacts[i] holds a gradient already */
  int32_t *dsrc;            /* per layer: whose dacts holds its gradient (itself, or an alias: grad_of) */
  float *bn_saved;          /* per BatchNorm layer: batch mean (C), invstd (C) */
  float *bn_tmp;            /* (nbn_tmp): channel sums being reduced (shared by the layers) */
  int64_t nbn_tmp;          /* 2 * the most channels of a BatchNorm layer, + 1 */
  float *bn_count;          /* host, per layer: the values per channel its last training forward normalised */
  float *input;             /* the batch on the device, (act_batch, in_c, in_h, in_w) */
  uint8_t *input_u8;        /* uint8 images staged before u8_to_unit, (act_batch * in size) */
  int32_t *labels;          /* (act_batch) */
  int32_t *rows;            /* (act_batch) the resident dataset's rows of the batch */
  dp_trace trace;           /* the step timeline of this replica, when profiling (trace.h) */
  /* ---- a pipeline stage (dp_model_set_stage): a slice of a network ---- */
  int headless;             /* the last layer's output goes to the next stage: it need not be logits */
  int input_grad;           /* the backward pass also computes the gradient of the input (dinput) */
  float *dinput;            /* (act_batch, in size) the gradient of the input, when input_grad */
  int dinput_ready;         /* during backward: dinput holds a gradient already */
  float *grad_scratch;      /* (nparams + 1) the gradients of a micro-batch being accumulated */
  int64_t act_bytes;        /* device bytes of this activation set (activations, gradients, staging) */
  /* activation sets: one per micro-batch in flight, sharing the parameters
   * (dp_model_use_slot); the fields above act_batch..rows, dinput, bn_saved,
   * bn_count and act_bytes are the current set's, the others wait in slots */
  int nslots, cur_slot;
  struct dp_act_set *slots;
} dp_model;

/* A batch as it comes from the host: images uint8 (scaled by 1/255) or float32,
 * NCHW matching the model's input; labels int64 (may be NULL for predict). */
typedef struct dp_batch {
  const void *x;
  int x_is_u8;
  const int64_t *y;
  int64_t n;
  /* or, for the mirrored runner: rows[0..n-1] of resident[r], a dataset
   * resident on replica r's device (x and y unused) */
  const int64_t *rows;
  dp_resident *const *resident;
} dp_batch;

/* dev NULL: a model that is only laid out, for its layers' shapes (the
 * binding's layer_shapes); it allocates nothing and is never finalized. */
DP_MUST_CHECK dp_status dp_model_create(dp_device *dev, int64_t in_c, int64_t in_h, int64_t in_w, dp_model **out);
void dp_model_destroy(dp_model *m);
/* Append a layer of the given kind (layers.h) with its first nargs
 * arguments (the rest take their defaults), reading the layer chosen by
 * dp_model_set_source (by default the previous one), or, for a kind whose
 * arguments name its sources (add), those. DP_ERR_VALUE, naming the layer and
 * the argument, for arguments the kind does not take or sizes it cannot hold. */
DP_MUST_CHECK dp_status dp_model_add_layer(dp_model *m, dp_layer_kind kind, const dp_layer_arg_value *args, int nargs);
/* Shorthands for dp_model_add_layer (C callers and tests). */
DP_MUST_CHECK dp_status dp_model_add_conv2d(dp_model *m, int out_c, int k, int stride, int pad);
DP_MUST_CHECK dp_status dp_model_add_dense(dp_model *m, int out_features);
DP_MUST_CHECK dp_status dp_model_add_relu(dp_model *m);
DP_MUST_CHECK dp_status dp_model_add_avgpool(dp_model *m, int k, int stride, int pad);
DP_MUST_CHECK dp_status dp_model_add_maxpool(dp_model *m, int k, int stride, int pad);
DP_MUST_CHECK dp_status dp_model_add_flatten(dp_model *m);
DP_MUST_CHECK dp_status dp_model_add_batchnorm(dp_model *m, float eps, float momentum);
/* out = output(a) + output(b) (same shapes) */
DP_MUST_CHECK dp_status dp_model_add_add(dp_model *m, int a, int b);
DP_MUST_CHECK dp_status dp_model_add_global_avgpool(dp_model *m);
/* The next layer added reads layer src's output (-1: the model input). */
DP_MUST_CHECK dp_status dp_model_set_source(dp_model *m, int64_t src);
DP_MUST_CHECK dp_status dp_model_finalize(dp_model *m);
int dp_model_num_classes(const dp_model *m);

/* Copy the flat parameters from / to host memory (nparams floats). */
DP_MUST_CHECK dp_status dp_model_set_params(dp_model *m, const float *host);
DP_MUST_CHECK dp_status dp_model_get_params(dp_model *m, float *host);
DP_MUST_CHECK dp_status dp_model_get_grads(dp_model *m, float *host);
/* The gradient buffer zeroed: a copy of a split network that saw no samples
 * this step adds nothing to its peers' all-reduce. */
DP_MUST_CHECK dp_status dp_model_zero_grads(dp_model *m);
DP_MUST_CHECK dp_status dp_model_reset_velocity(dp_model *m);
/* The SGD momentum buffer (nparams floats, the parameters' layout): what a
 * resumable training checkpoint saves beside the parameters. */
DP_MUST_CHECK dp_status dp_model_get_velocity(dp_model *m, float *host);
/* Record this replica's step timeline (on) or stop (off); see trace.h. */
DP_MUST_CHECK dp_status dp_model_set_profiling(dp_model *m, int on);
DP_MUST_CHECK dp_status dp_model_set_velocity(dp_model *m, const float *host);
DP_MUST_CHECK dp_status dp_model_get_state(dp_model *m, float *host);
DP_MUST_CHECK dp_status dp_model_set_state(dp_model *m, const float *host);

/* Stage a batch on the model's device (labels checked when need_labels). */
DP_MUST_CHECK dp_status dp_model_load(dp_model *m, const dp_batch *b, int need_labels);
/* DP_ERR_VALUE unless every y[i] (i < n) is a class of m; an error names the
 * index first + i (the position in a larger batch of which y is a part). */
DP_MUST_CHECK dp_status dp_model_check_labels(const dp_model *m, const int64_t *y, int64_t n, int64_t first);
/* DP_ERR_VALUE unless d fits m (its device, sample size and classes) and
 * every rows[i] (i < n) is a sample of d; errors name the position first + i. */
DP_MUST_CHECK dp_status dp_model_check_rows(const dp_model *m, const dp_resident *d, const int64_t *rows, int64_t n,
                                            int64_t first);
/* Stage rows[0..n-1] of a dataset resident on the model's device: only the
 * indices travel; the device gathers the images and labels. */
DP_MUST_CHECK dp_status dp_model_load_rows(dp_model *m, const dp_resident *d, const int64_t *rows, int64_t n);
/* DP_ERR_VALUE when a BatchNorm layer (a kind with batch_stats, layers.h)
 * would see at most one value per channel in training on n samples (n > 0);
 * checked before anything changes. */
DP_MUST_CHECK dp_status dp_model_check_batchnorm_batch(const dp_model *m, int64_t n);
/* dp_model_forward_backward on the batch staged last by dp_model_load, as
 * one replica of a group: coll (collective.h; NULL for a lone model)
 * all-reduces BatchNorm's statistics when it synchronizes them, and hears
 * of each layer whose gradients are final (gradient buckets). Waiting for
 * what it started is the caller's (dp_collective_wait). */
DP_MUST_CHECK dp_status dp_model_forward_backward_loaded(dp_model *m, int64_t n, float grad_scale,
                                                         const dp_collective *coll, double *loss_sum,
                                                         int64_t *correct);
/* Forward and backward on one batch. The gradient written to m->grads is
 * grad_scale * (sum over the batch's samples of d loss_i / d params): pass
 * 1/n for the mean, 1/global_n for a shard of a larger batch.
 * *loss_sum and *correct are sums over the batch; with loss_sum == correct ==
 * NULL they are read later with dp_model_read_metrics, so that the host need
 * not wait for the forward pass before it queues the rest of the step. */
DP_MUST_CHECK dp_status dp_model_forward_backward(dp_model *m, const dp_batch *b, float grad_scale, double *loss_sum,
                                                  int64_t *correct);
/* The sums of the last forward_backward called with NULL sums (waits for its forward pass only). */
DP_MUST_CHECK dp_status dp_model_read_metrics(dp_model *m, double *loss_sum, int64_t *correct);
/* One SGD step on the mean loss of the n samples staged last; the host waits
 * only at the end, for the sums. n == 0: nothing changes. */
DP_MUST_CHECK dp_status dp_model_train_step_loaded(dp_model *m, int64_t n, float lr, float momentum, float weight_decay,
                                                   double *loss_sum, int64_t *correct);
/* torch.optim.SGD over the flat buffer, one kernel: v = momentum v + g + wd w; w -= lr v. */
DP_MUST_CHECK dp_status dp_model_sgd_step(dp_model *m, float lr, float momentum, float weight_decay);
/* DP_ERR_VALUE naming the argument unless lr, momentum and weight_decay are finite, >= 0 and
 * within float32's range. The one check of every SGD step's arguments; it takes doubles so that
 * the binding can pass what it parsed (1e39 must be refused, not seen as inf). */
DP_MUST_CHECK dp_status dp_sgd_args_check(double lr, double momentum, double weight_decay);
/* A gradient scale: finite and within float32's range, else DP_ERR_VALUE naming grad_scale. */
DP_MUST_CHECK dp_status dp_grad_scale_check(double grad_scale);
/* The SGD step of a training step, after the gradient all-reduce: the kernel
 * reads the loss flag (grads[nparams]) on the device and applies nothing when
 * it is not finite, and BatchNorm's running statistics are put back to those
 * before the step's forward pass then; no host wait. */
DP_MUST_CHECK dp_status dp_model_guarded_step(dp_model *m, float lr, float momentum, float weight_decay);
/* DP_ERR_NUMERIC naming replica `replica` on m's device and the loss, when
 * loss_sum is not finite (the step it came from applied no update). */
DP_MUST_CHECK dp_status dp_model_check_loss(const dp_model *m, int replica, double loss_sum);
/* A loss for a message: "nan" (whatever its sign bit), "inf", or %g; buf holds at least 32 chars. */
const char *dp_loss_text(double loss, char *buf);
/* Where a batch's numbers stop being finite (dp.train's check_numerics, a
 * diagnosis run after a step raised DP_ERR_NUMERIC; it copies every layer's
 * output and gradients to the host, so it is for diagnosis only): a
 * training forward and backward pass of the batch on m alone, every layer's
 * output scanned in layer order, then the gradients in the order the
 * backward pass makes them (a layer's output gradient, then its parameter
 * gradients, from the last layer down). *layer: the first layer found, or
 * DP_NONFINITE_LOSS (outputs finite, the loss not), or DP_NONFINITE_NONE;
 * *what: DP_NONFINITE_OUTPUT / _OUTPUT_GRAD / _PARAM_GRAD. The parameters,
 * momentum and running statistics are left as they were; the gradients are
 * this batch's. */
enum { DP_NONFINITE_NONE = -1, DP_NONFINITE_LOSS = -2 };
enum { DP_NONFINITE_OUTPUT = 0, DP_NONFINITE_OUTPUT_GRAD = 1, DP_NONFINITE_PARAM_GRAD = 2 };
DP_MUST_CHECK dp_status dp_model_find_nonfinite(dp_model *m, const dp_batch *b, int *layer, int *what);
/* ---- pipeline stages (a slice of a network on one device; python/dpcore/pipeline.py) ----
 * Before any layer is added: headless (the last layer need not produce
 * logits: its output is the next stage's input) and input_grad (the
 * backward pass also computes the gradient of the model's input, which is
 * the previous stage's output). */
DP_MUST_CHECK dp_status dp_model_set_stage(dp_model *m, int headless, int input_grad);
/* The most activation sets one model keeps (micro-batches in flight on a stage). */
#define DP_MAX_SLOTS 4096
/* Make activation set `slot` (0..DP_MAX_SLOTS-1) the current one: the
 * activations, their gradients, the staged batch and BatchNorm's batch
 * statistics of one micro-batch in flight; the parameters, gradients,
 * momentum and running statistics are shared. A set is allocated the first
 * time it is used and kept (dp_model_activation_bytes counts them all). */
DP_MUST_CHECK dp_status dp_model_use_slot(dp_model *m, int slot);
/* Device bytes of every activation set allocated so far: the peak activation
 * memory of a schedule, since a set is allocated only when a micro-batch
 * needs one while every earlier one is still in flight. */
int64_t dp_model_activation_bytes(const dp_model *m);
/* A stage's forward pass of b (images on the first stage, the previous
 * stage's float activations after it) in activation set `slot`. training:
 * batch statistics, activations kept for dp_model_stage_backward; else the
 * running statistics. With labels (b->y) on a model that is not headless:
 * the loss and accuracy sums, and in training the gradient of grad_scale *
 * (sum of the losses) kept for the backward pass. out, when not NULL: the
 * output (n, out size) copied there.
 *
 * Where the activations travel between stages: b->x (float) and out are host
 * memory, or device memory the backend's copies reach: on a CPU device, the
 * memory of any CPU device; on a CUDA device, the memory of any GPU (CUDA's
 * unified addressing: a device-to-device or peer copy, never through the
 * host). The call returns with m's device synchronized: b->x may be freed and
 * out read by any device's stream. */
DP_MUST_CHECK dp_status dp_model_stage_forward(dp_model *m, int slot, const dp_batch *b, int training,
                                               float grad_scale, float *out, double *loss_sum,
                                               int64_t *correct);
/* The backward pass of the training forward pass slot `slot` ran last, on its
 * n samples: dy (n, out size) the gradient of the output (NULL on the last
 * stage: the loss's, kept by its forward pass). dx, when not NULL
 * (input_grad models): the gradient of the input copied there. Both may be
 * host or device memory as b->x and out of dp_model_stage_forward, and the
 * call returns synchronized likewise. accumulate: 0, the parameter gradients
 * replace m->grads; 1, they are added to them (the micro-batches of one step). */
DP_MUST_CHECK dp_status dp_model_stage_backward(dp_model *m, int slot, int64_t n, const float *dy,
                                                float *dx, int accumulate);

/* Forward only: loss and accuracy sums (labels required). */
DP_MUST_CHECK dp_status dp_model_evaluate(dp_model *m, const dp_batch *b, double *loss_sum, int64_t *correct);
/* Forward only: logits (n, num_classes) copied to host memory, computed in
 * pieces of 64 samples (at most their activations are allocated; a sample's
 * logits never depend on how big the activation sets already are). */
DP_MUST_CHECK dp_status dp_model_predict(dp_model *m, const dp_batch *b, float *logits_host);

#endif
