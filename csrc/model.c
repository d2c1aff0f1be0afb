#include "model.h"

#include "cpu_caches.h"
#include "dp_limits.h"

#include <float.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* One activation set (model.h: dp_model_use_slot): the per-micro-batch fields of a model. */
struct dp_act_set {
  int64_t act_batch, act_bytes;
  float **acts, **dacts, *dscratch, *input, *dinput, *bn_saved, *bn_count;
  int32_t **argmax;
  unsigned char *dready;
  int32_t *dsrc;
  uint8_t *input_u8;
  int32_t *labels, *rows;
};

static void slot_save(const dp_model *m, struct dp_act_set *a) {
  *a = (struct dp_act_set){m->act_batch, m->act_bytes, m->acts,   m->dacts,    m->dscratch, m->input,
                           m->dinput,    m->bn_saved,  m->bn_count, m->argmax, m->dready,   m->dsrc,
                           m->input_u8,  m->labels,    m->rows};
}

static void slot_load(dp_model *m, const struct dp_act_set *a) {
  m->act_batch = a->act_batch;
  m->act_bytes = a->act_bytes;
  m->acts = a->acts;
  m->dacts = a->dacts;
  m->dscratch = a->dscratch;
  m->input = a->input;
  m->dinput = a->dinput;
  m->bn_saved = a->bn_saved;
  m->bn_count = a->bn_count;
  m->argmax = a->argmax;
  m->dready = a->dready;
  m->dsrc = a->dsrc;
  m->input_u8 = a->input_u8;
  m->labels = a->labels;
  m->rows = a->rows;
}

static int64_t layer_in_size(const dp_layer *l) { return (int64_t)l->in_c * l->in_h * l->in_w; }
static int64_t layer_out_size(const dp_layer *l) { return (int64_t)l->out_c * l->out_h * l->out_w; }

dp_status dp_model_create(dp_device *dev, int64_t in_c, int64_t in_h, int64_t in_w, dp_model **out) {
  *out = NULL;
  DP_TRY(dp_input_shape_check("model input", in_c, in_h, in_w));
  dp_model *m = calloc(1, sizeof *m);
  if (!m) return DP_FAIL(DP_ERR_MEMORY, "cannot allocate a model");
  m->dev = dev;
  /* each fits an int: checked above */
  m->in_c = (int)in_c;
  m->in_h = (int)in_h;
  m->in_w = (int)in_w;
  m->next_src = DP_SRC_PREVIOUS;
  *out = m;
  return DP_OK;
}

static void free_activations(dp_model *m) {
  for (int i = 0; i < m->nlayers; ++i) {
    if (m->acts && !dp_layer_kind_info_of(m->layers[i].kind)->view) dp_device_free(m->dev, m->acts[i]);
    if (m->dacts) dp_device_free(m->dev, m->dacts[i]);
    if (m->argmax) dp_device_free(m->dev, m->argmax[i]);
  }
  free(m->acts);
  free(m->dacts);
  free(m->argmax);
  free(m->dready);
  free(m->dsrc);
  m->acts = m->dacts = NULL;
  m->argmax = NULL;
  m->dready = NULL;
  m->dsrc = NULL;
  dp_device_free(m->dev, m->dscratch);
  dp_device_free(m->dev, m->input);
  dp_device_free(m->dev, m->input_u8);
  dp_device_free(m->dev, m->labels);
  dp_device_free(m->dev, m->rows);
  dp_device_free(m->dev, m->dinput);
  m->dinput = NULL;
  m->act_bytes = 0;
  m->dscratch = m->input = NULL;
  m->input_u8 = NULL;
  m->labels = NULL;
  m->rows = NULL;
  m->act_batch = 0;
}

/* The buffers dp_model_finalize allocates (all, or those it got before one failed). */
static void free_flat_buffers(dp_model *m) {
  dp_device_free(m->dev, m->params);
  dp_device_free(m->dev, m->grads);
  dp_device_free(m->dev, m->velocity);
  dp_device_free(m->dev, m->state);
  dp_device_free(m->dev, m->state_before);
  dp_device_free(m->dev, m->bn_saved);
  dp_device_free(m->dev, m->bn_tmp);
  free(m->bn_count);
  m->params = m->grads = m->velocity = m->state = m->state_before = m->bn_saved = m->bn_tmp = m->bn_count = NULL;
}

void dp_model_destroy(dp_model *m) {
  if (!m) return;
  if (m->slots) {
    /* every activation set but the current one; free_activations and
     * free_flat_buffers free the current one's */
    const int keep = m->cur_slot;
    for (int k = 0; k < m->nslots; ++k) {
      if (k == keep) continue;
      slot_save(m, &m->slots[m->cur_slot]);
      slot_load(m, &m->slots[k]);
      m->cur_slot = k;
      free_activations(m);
      dp_device_free(m->dev, m->bn_saved);
      free(m->bn_count);
      m->bn_saved = m->bn_count = NULL;
    }
    slot_save(m, &m->slots[m->cur_slot]);
    slot_load(m, &m->slots[keep]);
    free(m->slots);
  }
  dp_device_free(m->dev, m->grad_scratch);
  free_activations(m);
  free_flat_buffers(m);
  for (int i = 0; m->conv_keep && i < m->nlayers; ++i) dp_device_free(m->dev, m->conv_keep[i].u);
  free(m->conv_keep);
  dp_trace_free(&m->trace);
  free(m->layers);
  free(m);
}

dp_status dp_model_set_profiling(dp_model *m, int on) {
  DP_TRY(dp_trace_enable(&m->trace, on));
  m->trace.sync_dev = m->dev->kind == DP_DEVICE_CUDA ? m->dev : NULL;
  return DP_OK;
}

dp_status dp_model_set_source(dp_model *m, int64_t src) {
  if (m->finalized) return DP_FAIL(DP_ERR_VALUE, "cannot add a layer to a finalized model");
  if (src < -1 || src >= m->nlayers)
    return DP_FAIL(DP_ERR_VALUE, "source %lld is not an existing layer (0..%d) or the input (-1)", (long long)src,
                   m->nlayers - 1);
  m->next_src = (int)src;
  return DP_OK;
}

static void shape_of(const dp_model *m, int src, int *c, int *h, int *w) {
  if (src < 0) {
    *c = m->in_c;
    *h = m->in_h;
    *w = m->in_w;
  } else {
    *c = m->layers[src].out_c;
    *h = m->layers[src].out_h;
    *w = m->layers[src].out_w;
  }
}

/* Append a layer reading the chosen source (by default the previous layer).
 * The layer counts only once its add function has validated it. */
static dp_status push_layer(dp_model *m, dp_layer **out) {
  if (m->finalized) return DP_FAIL(DP_ERR_VALUE, "cannot add a layer to a finalized model");
  if (m->nlayers == m->cap) {
    int cap = m->cap ? 2 * m->cap : 16;
    dp_layer *p = realloc(m->layers, sizeof *p * (size_t)cap);
    if (!p) return DP_FAIL(DP_ERR_MEMORY, "cannot grow the layer list");
    m->layers = p;
    m->cap = cap;
  }
  dp_layer *l = &m->layers[m->nlayers];
  memset(l, 0, sizeof *l);
  l->src = m->next_src == DP_SRC_PREVIOUS ? m->nlayers - 1 : m->next_src;
  l->src2 = -1;
  shape_of(m, l->src, &l->in_c, &l->in_h, &l->in_w);
  *out = l;
  return DP_OK;
}

/* "conv2d (layer 3)": how an error names the layer being added. */
static void layer_what(const dp_model *m, const char *op, char *buf, size_t len) {
  snprintf(buf, len, "%s (layer %d)", op, m->nlayers);
}

static void commit_layer(dp_model *m) {
  m->nlayers++;
  m->next_src = DP_SRC_PREVIOUS;
}

/* What the arguments of a layer that names its sources (add) may name. */
static dp_status check_source_arg(const dp_model *m, const char *what, const char *name, int64_t src) {
  if (src < -1 || src >= m->nlayers)
    return DP_FAIL(DP_ERR_VALUE, "%s: %s %lld is not an existing layer (0..%d) or the input (-1)", what, name,
                   (long long)src, m->nlayers - 1);
  return DP_OK;
}

/* Shapes come from the kind's infer (layers.c), computed in 64 bits and
 * checked before they are stored: every size in a layer fits an int. */
dp_status dp_model_add_layer(dp_model *m, dp_layer_kind kind, const dp_layer_arg_value *args, int nargs) {
  if ((unsigned)kind >= DP_LAYER_KIND_COUNT) return DP_FAIL(DP_ERR_VALUE, "unknown layer kind %d", (int)kind);
  const dp_layer_kind_info *info = dp_layer_kind_info_of(kind);
  dp_layer *l = NULL;
  DP_TRY(push_layer(m, &l));
  char what[48];
  layer_what(m, info->op, what, sizeof what);
  dp_layer_arg_value a[DP_LAYER_MAX_ARGS];
  DP_TRY(dp_layer_args_fill(kind, what, args, nargs, a));
  int in2[3];
  for (int i = 0; i < info->sources; ++i) DP_TRY(check_source_arg(m, what, info->args[i].name, a[i].i));
  if (info->sources >= 1) {
    l->src = (int)a[0].i;
    shape_of(m, l->src, &l->in_c, &l->in_h, &l->in_w);
  }
  if (info->sources >= 2) {
    l->src2 = (int)a[1].i;
    shape_of(m, l->src2, &in2[0], &in2[1], &in2[2]);
  }
  l->kind = kind;
  DP_TRY(info->infer(l, a, info->sources >= 2 ? in2 : NULL, what));
  /* the parameter tensors' lengths (each fits an int: infer checked it) */
  for (int t = 0; t < info->ntensors; ++t)
    if (info->tensors[t].buffer == DP_BUFFER_PARAMS) *(t == 0 ? &l->w_len : &l->b_len) = dp_layer_tensor_size(l, t);
  commit_layer(m);
  return DP_OK;
}

dp_status dp_model_add_conv2d(dp_model *m, int out_c, int k, int stride, int pad) {
  const dp_layer_arg_value a[] = {{.i = out_c}, {.i = k}, {.i = stride}, {.i = pad}};
  return dp_model_add_layer(m, DP_LAYER_CONV2D, a, 4);
}

dp_status dp_model_add_dense(dp_model *m, int out_features) {
  const dp_layer_arg_value a[] = {{.i = out_features}};
  return dp_model_add_layer(m, DP_LAYER_DENSE, a, 1);
}

dp_status dp_model_add_relu(dp_model *m) { return dp_model_add_layer(m, DP_LAYER_RELU, NULL, 0); }

dp_status dp_model_add_batchnorm(dp_model *m, float eps, float momentum) {
  const dp_layer_arg_value a[] = {{.f = eps}, {.f = momentum}};
  return dp_model_add_layer(m, DP_LAYER_BATCHNORM, a, 2);
}

dp_status dp_model_add_add(dp_model *m, int a, int b) {
  const dp_layer_arg_value args[] = {{.i = a}, {.i = b}};
  return dp_model_add_layer(m, DP_LAYER_ADD, args, 2);
}

dp_status dp_model_add_global_avgpool(dp_model *m) { return dp_model_add_layer(m, DP_LAYER_GLOBAL_AVGPOOL, NULL, 0); }

dp_status dp_model_add_avgpool(dp_model *m, int k, int stride, int pad) {
  const dp_layer_arg_value a[] = {{.i = k}, {.i = stride}, {.i = pad}};
  return dp_model_add_layer(m, DP_LAYER_AVGPOOL, a, 3);
}

dp_status dp_model_add_maxpool(dp_model *m, int k, int stride, int pad) {
  const dp_layer_arg_value a[] = {{.i = k}, {.i = stride}, {.i = pad}};
  return dp_model_add_layer(m, DP_LAYER_MAXPOOL, a, 3);
}

dp_status dp_model_add_flatten(dp_model *m) { return dp_model_add_layer(m, DP_LAYER_FLATTEN, NULL, 0); }

int dp_model_num_classes(const dp_model *m) {
  return m->nlayers ? (int)layer_out_size(&m->layers[m->nlayers - 1]) : 0;
}

/* The flat buffers of a laid-out model (nparams, nstate set); max_state:
 * the longest state tensor, BatchNorm's channels, whose sums bn_tmp reduces. */
static dp_status alloc_flat_buffers(dp_model *m, int64_t max_state) {
  const int64_t off = m->nparams, state = m->nstate;
  size_t bytes = sizeof(float) * (size_t)off;
  DP_TRY(dp_device_alloc(m->dev, bytes, (void **)&m->params));
  DP_TRY(dp_device_alloc(m->dev, bytes + sizeof(float), (void **)&m->grads)); /* + the loss flag */
  DP_TRY(dp_device_alloc(m->dev, bytes, (void **)&m->velocity));
  DP_TRY(dp_device_alloc(m->dev, sizeof(float) * (size_t)(state ? state : 1), (void **)&m->state));
  DP_TRY(dp_device_alloc(m->dev, sizeof(float) * (size_t)(state ? state : 1), (void **)&m->state_before));
  /* per BatchNorm layer the batch mean and invstd, laid out as its running statistics */
  DP_TRY(dp_device_alloc(m->dev, sizeof(float) * (size_t)(state ? state : 1), (void **)&m->bn_saved));
  m->nbn_tmp = 2 * (int64_t)max_state + 1;
  DP_TRY(dp_device_alloc(m->dev, sizeof(float) * (size_t)m->nbn_tmp, (void **)&m->bn_tmp));
  m->bn_count = calloc((size_t)m->nlayers, sizeof *m->bn_count);
  if (!m->bn_count) return DP_FAIL(DP_ERR_MEMORY, "cannot allocate the BatchNorm counts");
  /* state tensors start as their kind's table says (the running variance at
   * 1, as PyTorch's); alloc zero-filled the rest */
  for (int i = 0; i < m->nlayers; ++i) {
    const dp_layer *l = &m->layers[i];
    const dp_layer_kind_info *info = dp_layer_kind_info_of(l->kind);
    for (int t = 0; t < info->ntensors; ++t)
      if (info->tensors[t].buffer == DP_BUFFER_STATE && info->tensors[t].init[0] == DP_INIT_ONES)
        DP_TRY(m->dev->backend->fill(m->dev, m->state + dp_layer_tensor_offset(l, t), dp_layer_tensor_size(l, t),
                                     1.0f));
  }
  return DP_OK;
}

/* The layers that read layer i's output. */
static int readers_of(const dp_model *m, int i) {
  int readers = 0;
  for (int j = 0; j < m->nlayers; ++j) readers += (m->layers[j].src == i) + (m->layers[j].src2 == i);
  return readers;
}

/* Marks each relu whose output only the next layer, an avgpool, reads: the
 * two run as one op (backend.h), which writes the relu's output but not its
 * output gradient. DPCORE_FUSE=0 in the environment turns this off (the
 * A/B of benchmarks/bench_layers.py; tests/test_fusion.py); a value other
 * than "0", "1" or empty is DP_ERR_VALUE, not silently on. */
static dp_status mark_fusions(dp_model *m) {
  int on;
  DP_TRY(dp_env_switch("DPCORE_FUSE", 1, &on));
  for (int i = 0; i < m->nlayers; ++i) {
    dp_layer *l = &m->layers[i];
    l->fused = 0;
    if (!on || l->kind != DP_LAYER_RELU || i + 1 >= m->nlayers) continue;
    const dp_layer *next = &m->layers[i + 1];
    if (next->kind != DP_LAYER_AVGPOOL || next->src != i) continue;
    l->fused = readers_of(m, i) == 1;
  }
  /* and each batchnorm whose output only the next layer, a relu not fused
   * itself, reads: bn_apply_relu writes the relu's output, not the
   * batchnorm's; backward, the batchnorm masks the relu's output gradient
   * itself (backend.h: relu_beta), and the relu's own pass never runs */
  for (int i = 0; on && i + 1 < m->nlayers; ++i) {
    dp_layer *l = &m->layers[i];
    const dp_layer *next = &m->layers[i + 1];
    if (l->kind == DP_LAYER_BATCHNORM && next->kind == DP_LAYER_RELU && next->src == i && !next->fused)
      l->fused = readers_of(m, i) == 1;
  }
  /* and each add whose output only the next layer, a relu not fused itself,
   * reads (a residual block's end): add_relu writes the relu's output, not
   * the add's, which nothing else reads (the relu's backward reads its own
   * output, the add's none) */
  for (int i = 0; on && i + 1 < m->nlayers; ++i) {
    dp_layer *l = &m->layers[i];
    const dp_layer *next = &m->layers[i + 1];
    if (l->kind == DP_LAYER_ADD && next->kind == DP_LAYER_RELU && next->src == i && !next->fused)
      l->fused = readers_of(m, i) == 1;
  }
  return DP_OK;
}

/* Every on/off switch of the environment and DPCORE_L2_BYTES well formed,
 * when a model is built: each is read where its path is considered, and a
 * model that never takes that path (LeNet and DPCORE_OWN_GEMM) would
 * otherwise train with a malformed value unnoticed. */
static dp_status check_environment(void) {
  static const char *const switches[] = {"DPCORE_FFT", "DPCORE_FUSE", "DPCORE_HUGE_PAGES", "DPCORE_IMPLICIT_GEMM",
                                         "DPCORE_OWN_GEMM", "DPCORE_PIN_THREADS", "DPCORE_WINOGRAD",
                                         "DPCORE_WINOGRAD_F35", "DPCORE_WINOGRAD_F43", "DPCORE_WINOGRAD_S2"};
  for (size_t i = 0; i < sizeof switches / sizeof switches[0]; ++i) {
    int on;
    DP_TRY(dp_env_switch(switches[i], 0, &on));
  }
  return dp_cpu_l2_env_check();
}

dp_status dp_model_finalize(dp_model *m) {
  if (m->finalized) return DP_OK;
  if (!m->dev) return DP_FAIL(DP_ERR_VALUE, "a model without a device is only laid out, never finalized");
  if (m->nlayers == 0) return DP_FAIL(DP_ERR_VALUE, "a model needs at least one layer");
  const dp_layer *last = &m->layers[m->nlayers - 1];
  if (!m->headless && (last->out_h != 1 || last->out_w != 1))
    return DP_FAIL(DP_ERR_VALUE, "the last layer must produce logits (N, classes); it produces (%d, %d, %d)",
                   last->out_c, last->out_h, last->out_w);
  /* the flat length: each layer's weights fit an int (checked when it was
   * added), their sum need not; it is only ever an int64_t or a size_t */
  int64_t off = 0, state = 0, max_state = 1;
  for (int i = 0; i < m->nlayers; ++i) {
    dp_layer *l = &m->layers[i];
    const dp_layer_kind_info *info = dp_layer_kind_info_of(l->kind);
    l->state_off = state;
    for (int t = 0; t < info->ntensors; ++t) {
      const int64_t size = dp_layer_tensor_size(l, t);
      if (info->tensors[t].buffer == DP_BUFFER_STATE) {
        state += size;
        if (size > max_state) max_state = size;
        continue;
      }
      /* Each parameter tensor starts on a 16-float (64-byte) boundary of the flat buffer. */
      *(t == 0 ? &l->w_off : &l->b_off) = off;
      off += (size + 15) & ~(int64_t)15;
    }
  }
  if (off > DP_MAX_PARAMS || state > DP_MAX_PARAMS)
    return DP_FAIL(DP_ERR_VALUE, "the model has %lld parameters and %lld running statistics; at most %d of each are "
                   "supported", (long long)off, (long long)state, DP_MAX_PARAMS);
  m->nparams = off;
  m->nstate = state;
  DP_TRY(check_environment());
  DP_TRY(mark_fusions(m));
  /* a failure leaves no buffer behind, so that finalize may be called again */
  dp_status st = alloc_flat_buffers(m, max_state);
  if (st != DP_OK) free_flat_buffers(m);
  if (st == DP_OK) m->finalized = 1;
  return st;
}

static dp_status require_finalized(const dp_model *m) {
  if (!m->finalized) return DP_FAIL(DP_ERR_VALUE, "the model is not finalized");
  return DP_OK;
}

/* Make room for batches of n samples (activations grow, never shrink). */
static dp_status ensure_batch(dp_model *m, int64_t n) {
  if (n <= m->act_batch) return DP_OK;
  DP_TRY(dp_device_may_grow(m->dev, "the activations", (size_t)m->act_batch, (size_t)n, "samples"));
  const int64_t cap = n;
  /* a byte count that wraps would allocate too little; one that does not
   * fit an allocation fails there, as DP_ERR_MEMORY too */
  int64_t largest = layer_in_size(&m->layers[0]);
  for (int i = 0; i < m->nlayers; ++i)
    if (layer_out_size(&m->layers[i]) > largest) largest = layer_out_size(&m->layers[i]);
  if (dp_size_mul(dp_size_mul(cap, largest), (int64_t)sizeof(float)) == INT64_MAX)
    return DP_FAIL(DP_ERR_MEMORY, "cannot allocate the activations of %lld samples of up to %lld values",
                   (long long)cap, (long long)largest);
  free_activations(m);
  const size_t L = (size_t)m->nlayers;
  m->acts = calloc(L, sizeof *m->acts);
  m->dacts = calloc(L, sizeof *m->dacts);
  m->argmax = calloc(L, sizeof *m->argmax);
  m->dready = calloc(L, 1);
  m->dsrc = calloc(L, sizeof *m->dsrc);
  if (!m->acts || !m->dacts || !m->argmax || !m->dready || !m->dsrc)
    return DP_FAIL(DP_ERR_MEMORY, "cannot allocate the activation table");
#define ACT_ALLOC(bytes, ptr)                                  \
  do {                                                         \
    DP_TRY(dp_device_alloc(m->dev, (bytes), (void **)(ptr))); \
    m->act_bytes += (int64_t)(bytes);                          \
  } while (0)
  for (int i = 0; i < m->nlayers; ++i) {
    const dp_layer *l = &m->layers[i];
    const int64_t sz = layer_out_size(l);
    const size_t bytes = sizeof(float) * (size_t)(cap * sz);
    ACT_ALLOC(bytes, &m->dacts[i]);
    if (dp_layer_kind_info_of(l->kind)->view) continue; /* its output is its source's, set in forward */
    ACT_ALLOC(bytes, &m->acts[i]);
    if (l->kind == DP_LAYER_MAXPOOL) ACT_ALLOC(sizeof(int32_t) * (size_t)(cap * sz), &m->argmax[i]);
  }
  const int64_t in_size = (int64_t)m->in_c * m->in_h * m->in_w;
  ACT_ALLOC(sizeof(float) * (size_t)(cap * largest), &m->dscratch);
  ACT_ALLOC(sizeof(float) * (size_t)(cap * in_size), &m->input);
  ACT_ALLOC(sizeof(int32_t) * (size_t)cap, &m->labels);
  /* uint8 images staged on the device (a CPU device converts straight from
   * the caller's bytes, but gathers resident rows here) */
  ACT_ALLOC((size_t)(cap * in_size), &m->input_u8);
  ACT_ALLOC(sizeof(int32_t) * (size_t)cap, &m->rows);
  if (m->input_grad) ACT_ALLOC(sizeof(float) * (size_t)(cap * in_size), &m->dinput);
#undef ACT_ALLOC
  m->act_batch = cap;
  return DP_OK;
}

/* Stage the batch on the device; labels are checked against the class count. */
dp_status dp_model_load(dp_model *m, const dp_batch *b, int need_labels) {
  DP_TRY(require_finalized(m));
  if (b->n < 0) return DP_FAIL(DP_ERR_VALUE, "batch size must be >= 0, got %lld", (long long)b->n);
  DP_TRY(ensure_batch(m, b->n > 0 ? b->n : 1));
  const dp_backend *be = m->dev->backend;
  const int64_t nx = b->n * (int64_t)m->in_c * m->in_h * m->in_w;
  if (b->x_is_u8) {
    /* u8_to_unit reads device memory: the host bytes go to the device first
     * (a quarter of the float32 traffic), except on a CPU device */
    const uint8_t *src = b->x;
    if (m->dev->kind != DP_DEVICE_CPU) {
      DP_TRY(be->copy_to_device(m->dev, m->input_u8, b->x, (size_t)nx));
      src = m->input_u8;
    }
    DP_TRY(be->u8_to_unit(m->dev, m->input, src, nx));
  } else {
    DP_TRY(be->copy_to_device(m->dev, m->input, b->x, sizeof(float) * (size_t)nx));
  }
  if (need_labels) {
    DP_TRY(dp_model_check_labels(m, b->y, b->n, 0));
    int32_t *tmp = malloc(sizeof(int32_t) * (size_t)(b->n ? b->n : 1));
    if (!tmp) return DP_FAIL(DP_ERR_MEMORY, "cannot allocate labels");
    for (int64_t i = 0; i < b->n; ++i) tmp[i] = (int32_t)b->y[i];
    dp_status s = be->copy_to_device(m->dev, m->labels, tmp, sizeof(int32_t) * (size_t)b->n);
    free(tmp);
    DP_TRY(s);
  }
  return DP_OK;
}

dp_status dp_model_check_labels(const dp_model *m, const int64_t *y, int64_t n, int64_t first) {
  if (!y) return DP_FAIL(DP_ERR_VALUE, "labels are required");
  const int K = dp_model_num_classes(m);
  for (int64_t i = 0; i < n; ++i)
    if (y[i] < 0 || y[i] >= K)
      return DP_FAIL(DP_ERR_VALUE, "label %lld at index %lld is outside [0, %d)", (long long)y[i],
                     (long long)(first + i), K);
  return DP_OK;
}

dp_status dp_model_check_rows(const dp_model *m, const dp_resident *d, const int64_t *rows, int64_t n,
                              int64_t first) {
  if (n < 0) return DP_FAIL(DP_ERR_VALUE, "batch size must be >= 0, got %lld", (long long)n);
  if (!d) return DP_FAIL(DP_ERR_VALUE, "%s has no resident dataset", m->dev->name);
  if (d->dev != m->dev)
    return DP_FAIL(DP_ERR_VALUE, "the resident dataset is on %s, the model on %s", d->dev->name, m->dev->name);
  const int64_t elems = (int64_t)m->in_c * m->in_h * m->in_w;
  if (d->sample_elems != elems)
    return DP_FAIL(DP_ERR_VALUE, "the resident dataset's samples have %lld elements, the model's input %lld",
                   (long long)d->sample_elems, (long long)elems);
  if (d->num_classes != dp_model_num_classes(m))
    return DP_FAIL(DP_ERR_VALUE, "the resident dataset's labels were checked for %d classes, the model has %d",
                   d->num_classes, dp_model_num_classes(m));
  for (int64_t i = 0; i < n; ++i)
    if (rows[i] < 0 || rows[i] >= d->count)
      return DP_FAIL(DP_ERR_VALUE, "sample index %lld at position %lld is outside the resident dataset [0, %lld)",
                     (long long)rows[i], (long long)(first + i), (long long)d->count);
  return DP_OK;
}

dp_status dp_model_load_rows(dp_model *m, const dp_resident *d, const int64_t *rows, int64_t n) {
  DP_TRY(require_finalized(m));
  DP_TRY(dp_model_check_rows(m, d, rows, n, 0));
  const int64_t elems = (int64_t)m->in_c * m->in_h * m->in_w;
  DP_TRY(ensure_batch(m, n > 0 ? n : 1));
  if (n == 0) return DP_OK;
  int32_t *tmp = malloc(sizeof(int32_t) * (size_t)n);
  if (!tmp) return DP_FAIL(DP_ERR_MEMORY, "cannot allocate %lld row indices", (long long)n);
  for (int64_t i = 0; i < n; ++i) tmp[i] = (int32_t)rows[i];
  const dp_backend *be = m->dev->backend;
  dp_status st = be->copy_to_device(m->dev, m->rows, tmp, sizeof(int32_t) * (size_t)n);
  free(tmp);
  DP_TRY(st);
  if (d->x_is_u8) {
    DP_TRY(be->gather_rows(m->dev, n, elems, d->x, m->rows, m->input_u8));
    DP_TRY(be->u8_to_unit(m->dev, m->input, m->input_u8, n * elems));
  } else {
    DP_TRY(be->gather_rows(m->dev, n, elems * (int64_t)sizeof(float), d->x, m->rows, m->input));
  }
  return be->gather_rows(m->dev, n, (int64_t)sizeof(int32_t), d->y, m->rows, m->labels);
}

static const float *output_of(const dp_model *m, int src) { return src < 0 ? m->input : m->acts[src]; }

static dp_conv_geom conv_geom(const dp_layer *l) {
  dp_conv_geom g = {l->in_c, l->in_h, l->in_w, l->out_c, l->k, l->k, l->stride, l->pad, l->out_h, l->out_w};
  return g;
}

static dp_pool_geom pool_geom(const dp_layer *l) {
  dp_pool_geom g = {l->in_c, l->in_h, l->in_w, l->out_h, l->out_w, l->k, l->stride, l->pad};
  return g;
}

/* BatchNorm forward. Training: batch statistics, two passes (mean, then
 * squared deviations) for accuracy; with a collective that synchronizes
 * BatchNorm each pass's channel sums are all-reduced and the count is the
 * global batch's, so k replicas normalise exactly as one replica would over
 * the whole batch. Evaluation: running statistics. relu: y = relu(batchnorm(x))
 * (l fused with the relu after it: mark_fusions). */
static dp_status batchnorm_forward(dp_model *m, const dp_layer *l, int64_t N, const dp_collective *coll,
                                   const float *x, float *y, int relu) {
  const dp_backend *be = m->dev->backend;
  dp_device *dev = m->dev;
  const int C = l->in_c, HW = l->in_h * l->in_w;
  float *mean = m->bn_saved + l->state_off, *invstd = mean + C;
  float *running_mean = m->state + l->state_off, *running_var = running_mean + C;
  float *tmp = m->bn_tmp;
  const float *gamma = m->params + l->w_off, *beta = m->params + l->b_off;
  if (!m->training) {
    /* invstd from the running variance: finalize with count 1 on a copy */
    DP_TRY(be->copy_to_device(dev, mean, running_mean, sizeof(float) * (size_t)C));
    DP_TRY(be->bn_finalize(dev, C, running_var, 1.0f, mean, l->eps, 0.0f, 0, invstd, NULL, NULL));
    return (relu ? be->bn_apply_relu : be->bn_apply)(dev, N, C, HW, x, mean, invstd, gamma, beta, y);
  }
  const int sync = dp_collective_syncs_batchnorm(coll);
  if (N == 0 && !sync) return DP_OK; /* an empty shard has no statistics of its own */
  DP_TRY(be->bn_sums(dev, N, C, HW, x, NULL, tmp));
  /* synchronized: the values of the whole batch, known on the host (no
   * device round trip, so the host never waits inside the step) */
  const float count = (float)((sync ? coll->global_batch : N) * HW);
  if (sync) DP_TRY(dp_collective_all_reduce(coll, tmp, C, DP_REDUCE_SUM));
  if (count <= 1.0f)
    return DP_FAIL(DP_ERR_VALUE, "batchnorm: training needs more than one value per channel, got %g", (double)count);
  DP_TRY(be->scale(dev, C, tmp, 1.0f / count));
  DP_TRY(be->copy_to_device(dev, mean, tmp, sizeof(float) * (size_t)C));
  DP_TRY(be->bn_sums(dev, N, C, HW, x, mean, tmp));
  if (sync) DP_TRY(dp_collective_all_reduce(coll, tmp, C, DP_REDUCE_SUM));
  DP_TRY(be->bn_finalize(dev, C, tmp, count, mean, l->eps, l->momentum, 1, invstd, running_mean, running_var));
  m->bn_count[l - m->layers] = count; /* for this layer's backward pass */
  return (relu ? be->bn_apply_relu : be->bn_apply)(dev, N, C, HW, x, mean, invstd, gamma, beta, y);
}

/* Layer i's kept filter transform (backend.h: dp_conv_keep) while a training
 * step's one forward-backward call runs (keep_on), else NULL. */
static dp_conv_keep *conv_keep(dp_model *m, int i) { return m->keep_on ? &m->conv_keep[i] : NULL; }

/* coll: BatchNorm's collective in training (NULL: none, and in evaluation) */
static dp_status forward(dp_model *m, int64_t N, const dp_collective *coll) {
  const dp_backend *be = m->dev->backend;
  dp_device *dev = m->dev;
  for (int i = 0; i < m->nlayers; ++i) {
    dp_layer *l = &m->layers[i];
    const float *x = output_of(m, l->src);
    float *y = m->acts[i];
    switch (l->kind) {
      case DP_LAYER_CONV2D: {
        dp_conv_geom g = conv_geom(l);
        DP_TRY(be->conv2d_forward(dev, &g, N, x, m->params + l->w_off, m->params + l->b_off, y, conv_keep(m, i)));
        break;
      }
      case DP_LAYER_DENSE:
        DP_TRY(be->dense_forward(dev, N, l->in_c, l->out_c, x, m->params + l->w_off, m->params + l->b_off, y));
        break;
      case DP_LAYER_RELU:
        if (l->fused && !m->unfused) { /* and the avgpool after it */
          const dp_pool_geom g = pool_geom(&m->layers[i + 1]);
          DP_TRY(be->relu_avgpool_forward(dev, &g, N, x, y, m->acts[i + 1]));
          ++i;
          break;
        }
        DP_TRY(be->relu_forward(dev, N * layer_out_size(l), x, y));
        break;
      case DP_LAYER_AVGPOOL:
      case DP_LAYER_MAXPOOL: {
        dp_pool_geom g = pool_geom(l);
        if (l->kind == DP_LAYER_AVGPOOL)
          DP_TRY(be->avgpool_forward(dev, &g, N, x, y));
        else
          DP_TRY(be->maxpool_forward(dev, &g, N, x, y, m->argmax[i]));
        break;
      }
      case DP_LAYER_FLATTEN:
        m->acts[i] = (float *)x; /* the same memory, seen as (N, C*H*W) */
        break;
      case DP_LAYER_BATCHNORM:
        if (l->fused && !m->unfused) { /* and the relu after it (its output written, not this layer's) */
          DP_TRY(batchnorm_forward(m, l, N, coll, x, m->acts[i + 1], 1));
          ++i;
          break;
        }
        DP_TRY(batchnorm_forward(m, l, N, coll, x, y, 0));
        break;
      case DP_LAYER_ADD:
        if (l->fused && !m->unfused) { /* and the relu after it (its output written, not this layer's) */
          DP_TRY(be->add_relu(dev, N * layer_out_size(l), x, output_of(m, l->src2), m->acts[i + 1]));
          ++i;
          break;
        }
        DP_TRY(be->add(dev, N * layer_out_size(l), x, output_of(m, l->src2), y));
        break;
      case DP_LAYER_GLOBAL_AVGPOOL:
        DP_TRY(be->global_avgpool_forward(dev, N, l->in_c, l->in_h * l->in_w, x, y));
        break;
    }
  }
  return DP_OK;
}

/* Where the gradient for layer src's output goes: straight into dacts[src]
 * the first time, into the scratch (to be added) when another consumer has
 * written it already. NULL for the model input (never needed). */
static float *gradient_target(dp_model *m, int src) {
  if (src < 0) return m->input_grad ? (m->dinput_ready ? m->dscratch : m->dinput) : NULL;
  return m->dready[src] ? m->dscratch : m->dacts[src];
}

/* The gradient of layer i's output: its own dacts[i], or (dsrc[i] != i) that
 * of the layer whose backward pass would have copied it over unchanged (an
 * add's, to both its sources): read in place. dacts[j] is final once layer j
 * is reached (its consumers came before it), so an alias never changes under
 * its reader; a second gradient for an aliased layer is added into its own
 * buffer (gradient_delivered). */
static float *grad_of(const dp_model *m, int i) { return m->dacts[m->dsrc[i]]; }

/* Layer src's gradient is layer i's unchanged (its first: see grad_of). */
static void gradient_alias(dp_model *m, int src, int i) {
  m->dsrc[src] = m->dsrc[i];
  m->dready[src] = 1;
}

static dp_status gradient_delivered(dp_model *m, int src, int64_t N) {
  if (src < 0) {
    if (!m->input_grad) return DP_OK;
    if (m->dinput_ready) {
      const int64_t n = N * (int64_t)m->in_c * m->in_h * m->in_w;
      DP_TRY(m->dev->backend->add(m->dev, n, m->dinput, m->dscratch, m->dinput));
    }
    m->dinput_ready = 1;
    return DP_OK;
  }
  if (m->dready[src]) {
    const int64_t n = N * layer_out_size(&m->layers[src]);
    DP_TRY(m->dev->backend->add(m->dev, n, grad_of(m, src), m->dscratch, m->dacts[src]));
    m->dsrc[src] = src;
  }
  m->dready[src] = 1;
  return DP_OK;
}

static dp_status batchnorm_backward(dp_model *m, const dp_layer *l, int64_t N, const dp_collective *coll,
                                    const float *x, const float *dy, float *dx) {
  const dp_backend *be = m->dev->backend;
  dp_device *dev = m->dev;
  const int C = l->in_c, HW = l->in_h * l->in_w;
  const float *mean = m->bn_saved + l->state_off, *invstd = mean + C;
  float *dgamma = m->grads + l->w_off, *dbeta = m->grads + l->b_off;
  float *tmp = m->bn_tmp;
  const int sync = dp_collective_syncs_batchnorm(coll);
  if (N == 0 && !sync) {
    DP_TRY(be->fill(dev, dgamma, C, 0.0f));
    return be->fill(dev, dbeta, C, 0.0f);
  }
  /* this replica's sums are its parameter gradients (the gradient all-reduce
   * adds the replicas'); dx needs the sums over everything normalised together */
  /* fused with the relu after it: dy is the relu's output gradient, masked here (backend.h) */
  const float *gamma = m->params + l->w_off, *relu_beta = l->fused && !m->unfused ? m->params + l->b_off : NULL;
  DP_TRY(be->bn_backward_sums(dev, N, C, HW, x, dy, mean, invstd, gamma, relu_beta, dbeta, dgamma));
  const float count = m->bn_count[l - m->layers];
  if (!dx) return DP_OK;
  DP_TRY(be->copy_to_device(dev, tmp, dbeta, sizeof(float) * (size_t)C));
  DP_TRY(be->copy_to_device(dev, tmp + C, dgamma, sizeof(float) * (size_t)C));
  if (sync) DP_TRY(dp_collective_all_reduce(coll, tmp, 2 * (int64_t)C, DP_REDUCE_SUM));
  DP_TRY(be->bn_backward_dx(dev, N, C, HW, x, dy, mean, invstd, gamma, relu_beta, tmp, tmp + C, 1.0f / count, dx));
  return DP_OK;
}

/* Backward from dlogits in dacts[last]; writes m->grads. Layers are visited in
 * reverse order, which is reverse topological: every consumer of a layer's
 * output comes after it, so its gradient is complete when it is reached;
 * coll hears of each layer once its parameter gradients are final. */
static dp_status backward(dp_model *m, int64_t N, const dp_collective *coll) {
  const dp_backend *be = m->dev->backend;
  dp_device *dev = m->dev;
  memset(m->dready, 0, (size_t)m->nlayers);
  for (int i = 0; i < m->nlayers; ++i) m->dsrc[i] = i;
  m->dready[m->nlayers - 1] = 1;
  m->dinput_ready = 0;
  for (int i = m->nlayers - 1; i >= 0; --i) {
    dp_layer *l = &m->layers[i];
    const float *x = output_of(m, l->src);
    const float *dy = grad_of(m, i);
    if (!m->dready[i]) { /* nothing downstream needs this layer */
      DP_TRY(dp_collective_grad_ready(coll, i));
      continue;
    }
    float *dx = gradient_target(m, l->src);
    switch (l->kind) {
      case DP_LAYER_CONV2D: {
        dp_conv_geom g = conv_geom(l);
        DP_TRY(be->conv2d_backward(dev, &g, N, x, m->params + l->w_off, dy, dx, m->grads + l->w_off,
                                   m->grads + l->b_off, conv_keep(m, i)));
        break;
      }
      case DP_LAYER_DENSE:
        DP_TRY(be->dense_backward(dev, N, l->in_c, l->out_c, x, m->params + l->w_off, dy, dx, m->grads + l->w_off,
                                  m->grads + l->b_off));
        break;
      case DP_LAYER_RELU:
        if (l->src >= 0 && m->layers[l->src].kind == DP_LAYER_BATCHNORM && m->layers[l->src].fused && !m->unfused) {
          /* the batchnorm before it (fused) masks this gradient itself: read in place, nothing written */
          gradient_alias(m, l->src, i);
          DP_TRY(dp_collective_grad_ready(coll, i));
          continue;
        }
        if (dx) DP_TRY(be->relu_backward(dev, N * layer_out_size(l), m->acts[i], dy, dx));
        break;
      case DP_LAYER_AVGPOOL:
      case DP_LAYER_MAXPOOL: {
        dp_pool_geom g = pool_geom(l);
        const dp_layer *relu = i > 0 ? &m->layers[i - 1] : NULL;
        if (relu && relu->fused && !m->unfused) {
          /* straight to the relu's input: its output gradient is never written
           * (dready stays 0, and its own turn below only reports it done) */
          float *rdx = gradient_target(m, relu->src);
          if (rdx) {
            int done = 0;
            const int c = relu->src; /* a convolution only the relu reads: its backward pass from dy here */
            if (c >= 0 && m->layers[c].kind == DP_LAYER_CONV2D && readers_of(m, c) == 1) {
              const dp_layer *cl = &m->layers[c];
              const dp_conv_geom cg = conv_geom(cl);
              DP_TRY(be->conv2d_relu_avgpool_backward(dev, &cg, &g, N, output_of(m, cl->src), m->params + cl->w_off,
                                                      output_of(m, c), dy, gradient_target(m, cl->src),
                                                      m->grads + cl->w_off, m->grads + cl->b_off, &done));
              /* its own turn then finds dready[c] == 0 and only reports it done */
              if (done) DP_TRY(gradient_delivered(m, cl->src, N));
            }
            if (!done) {
              /* the relu's input for its mask (backend.h: its output is not kept) */
              DP_TRY(be->avgpool_relu_backward(dev, &g, N, output_of(m, relu->src), dy, rdx));
              DP_TRY(gradient_delivered(m, relu->src, N));
            }
          }
          DP_TRY(dp_collective_grad_ready(coll, i));
          continue;
        }
        if (!dx) break;
        if (l->kind == DP_LAYER_AVGPOOL)
          DP_TRY(be->avgpool_backward(dev, &g, N, dy, dx));
        else
          DP_TRY(be->maxpool_backward(dev, &g, N, dy, m->argmax[i], dx));
        break;
      }
      case DP_LAYER_FLATTEN:
        if (dx) DP_TRY(be->copy_to_device(dev, dx, dy, sizeof(float) * (size_t)(N * layer_out_size(l))));
        break;
      case DP_LAYER_BATCHNORM:
        DP_TRY(batchnorm_backward(m, l, N, coll, x, dy, dx));
        break;
      case DP_LAYER_ADD:
        /* both sources' gradient is dy: read in place by a source that has no other yet */
        for (int k = 0; k < 2; ++k) {
          const int src = k == 0 ? l->src : l->src2;
          if (src >= 0 && !m->dready[src]) {
            gradient_alias(m, src, i);
            continue;
          }
          dx = gradient_target(m, src);
          if (dx) DP_TRY(be->copy_to_device(dev, dx, dy, sizeof(float) * (size_t)(N * layer_out_size(l))));
          DP_TRY(gradient_delivered(m, src, N));
        }
        DP_TRY(dp_collective_grad_ready(coll, i));
        continue;
      case DP_LAYER_GLOBAL_AVGPOOL:
        if (dx) DP_TRY(be->global_avgpool_backward(dev, N, l->in_c, l->in_h * l->in_w, dy, dx));
        break;
    }
    DP_TRY(gradient_delivered(m, l->src, N));
    DP_TRY(dp_collective_grad_ready(coll, i));
  }
  return DP_OK;
}

static const float *logits_of(const dp_model *m) { return m->acts[m->nlayers - 1]; }

dp_status dp_model_check_batchnorm_batch(const dp_model *m, int64_t n) {
  if (n <= 0) return DP_OK;
  for (int i = 0; i < m->nlayers; ++i) {
    const dp_layer *l = &m->layers[i];
    const dp_layer_kind_info *info = dp_layer_kind_info_of(l->kind);
    if (info->batch_stats && n * l->in_h * l->in_w <= 1)
      return DP_FAIL(DP_ERR_VALUE,
                     "%s (layer %d): training needs more than one value per channel, got %lld sample(s) of %dx%d",
                     info->op, i, (long long)n, l->in_h, l->in_w);
  }
  return DP_OK;
}

static dp_status forward_backward_steps(dp_model *m, int64_t n, float grad_scale, const dp_collective *coll,
                                        double *loss_sum, int64_t *correct) {
  const dp_backend *be = m->dev->backend;
  const int64_t t0 = dp_trace_begin();
  DP_TRY(forward(m, n, coll));
  const int K = dp_model_num_classes(m);
  DP_TRY(be->softmax_xent(m->dev, n, K, logits_of(m), m->labels, grad_scale, m->dacts[m->nlayers - 1], loss_sum,
                          correct));
  dp_trace_end(DP_PHASE_FORWARD, -1, 0, t0);
  const int64_t t1 = dp_trace_begin();
  /* before the backward pass: it rides in the first gradient bucket */
  DP_TRY(be->loss_flag(m->dev, m->grads + m->nparams));
  DP_TRY(backward(m, n, coll));
  dp_trace_end(DP_PHASE_BACKWARD, -1, 0, t1);
  return DP_OK;
}

dp_status dp_model_forward_backward_loaded(dp_model *m, int64_t n, float grad_scale, const dp_collective *coll,
                                           double *loss_sum, int64_t *correct) {
  DP_TRY(require_finalized(m));
  if (n > m->act_batch) return DP_FAIL(DP_ERR_VALUE, "forward_backward: %lld samples were not loaded", (long long)n);
  /* a synchronized BatchNorm counts the global batch; its runner checks that */
  if (!dp_collective_syncs_batchnorm(coll)) DP_TRY(dp_model_check_batchnorm_batch(m, n));
  m->training = 1;
  const dp_backend *be = m->dev->backend;
  /* the running statistics this forward pass updates, to put back if its loss is not finite */
  if (m->nstate > 0)
    DP_TRY(be->copy_to_device(m->dev, m->state_before, m->state, sizeof(float) * (size_t)m->nstate));
  /* the convolutions' filter transforms kept from the forward pass for the
   * backward one: only inside this call, where w cannot change between them
   * (each forward pass clears its layer's keep before it writes it, and none
   * stays valid past the call) */
  if (!m->conv_keep && !(m->conv_keep = calloc((size_t)m->nlayers, sizeof *m->conv_keep)))
    return DP_FAIL(DP_ERR_MEMORY, "cannot allocate the filter-transform table");
  m->keep_on = 1;
  const dp_status st = forward_backward_steps(m, n, grad_scale, coll, loss_sum, correct);
  m->keep_on = 0;
  for (int i = 0; i < m->nlayers; ++i) m->conv_keep[i].valid = 0;
  return st;
}

dp_status dp_model_forward_backward(dp_model *m, const dp_batch *b, float grad_scale, double *loss_sum,
                                    int64_t *correct) {
  DP_TRY(require_finalized(m));
  DP_TRY(dp_grad_scale_check(grad_scale));
  DP_TRY(dp_model_load(m, b, 1));
  return dp_model_forward_backward_loaded(m, b->n, grad_scale, NULL, loss_sum, correct);
}

dp_status dp_model_read_metrics(dp_model *m, double *loss_sum, int64_t *correct) {
  return m->dev->backend->metrics_read(m->dev, loss_sum, correct);
}

static dp_status sgd_step_guarded(dp_model *m, float lr, float momentum, float weight_decay, const float *guard);

/* !(x >= 0) and !(x <= FLT_MAX) are also true for NaN; a float argument
 * from a double beyond FLT_MAX arrives as inf */
dp_status dp_sgd_args_check(double lr, double momentum, double weight_decay) {
  const struct {
    const char *name;
    double value;
  } args[] = {{"lr", lr}, {"momentum", momentum}, {"weight_decay", weight_decay}};
  for (size_t i = 0; i < sizeof args / sizeof args[0]; ++i)
    if (!(args[i].value >= 0.0) || !(args[i].value <= FLT_MAX))
      return DP_FAIL(DP_ERR_VALUE, "%s must be a finite number >= 0 (within float32's range), got %g", args[i].name,
                     args[i].value);
  return DP_OK;
}

dp_status dp_grad_scale_check(double grad_scale) {
  if (!(fabs(grad_scale) <= FLT_MAX))
    return DP_FAIL(DP_ERR_VALUE, "grad_scale must be a finite number (within float32's range), got %g", grad_scale);
  return DP_OK;
}

dp_status dp_model_train_step_loaded(dp_model *m, int64_t n, float lr, float momentum, float weight_decay,
                                     double *loss_sum, int64_t *correct) {
  *loss_sum = 0.0;
  *correct = 0;
  if (n == 0) return DP_OK; /* no samples, no step (not even weight decay) */
  /* the loss is read last, after the whole step is queued */
  DP_TRY(dp_model_forward_backward_loaded(m, n, 1.0f / (float)n, NULL, NULL, NULL));
  DP_TRY(dp_model_guarded_step(m, lr, momentum, weight_decay));
  DP_TRY(dp_model_read_metrics(m, loss_sum, correct));
  return dp_model_check_loss(m, 0, *loss_sum);
}

const char *dp_loss_text(double loss, char *buf) {
  if (isnan(loss)) return "nan";
  snprintf(buf, 32, "%g", loss);
  return buf;
}

dp_status dp_model_check_loss(const dp_model *m, int replica, double loss_sum) {
  if (isfinite(loss_sum)) return DP_OK;
  char text[32];
  return DP_FAIL(DP_ERR_NUMERIC,
                 "the loss is not finite (%s) on replica %d (%s); the step applied no update: the parameters, "
                 "momentum and BatchNorm statistics are those of the last finite step",
                 dp_loss_text(loss_sum, text), replica, m->dev->name);
}

dp_status dp_model_guarded_step(dp_model *m, float lr, float momentum, float weight_decay) {
  const int64_t t0 = dp_trace_begin();
  DP_TRY(sgd_step_guarded(m, lr, momentum, weight_decay, m->grads + m->nparams));
  if (m->nstate > 0)
    DP_TRY(m->dev->backend->restore_unless_allowed(m->dev, m->nstate, m->state, m->state_before,
                                                   m->grads + m->nparams));
  dp_trace_end(DP_PHASE_UPDATE, -1, 0, t0);
  return DP_OK;
}

static dp_status sgd_step_guarded(dp_model *m, float lr, float momentum, float weight_decay,
                                        const float *guard) {
  DP_TRY(require_finalized(m));
  DP_TRY(dp_sgd_args_check(lr, momentum, weight_decay));
  return m->dev->backend->sgd_update(m->dev, m->nparams, m->params, m->grads, m->velocity, lr, momentum, weight_decay,
                                     guard);
}

dp_status dp_model_sgd_step(dp_model *m, float lr, float momentum, float weight_decay) {
  return sgd_step_guarded(m, lr, momentum, weight_decay, NULL);
}

/* 1 when every one of n floats of device memory at p is finite (via host memory at tmp). */
static dp_status all_finite(dp_model *m, const float *p, int64_t n, float *tmp, int *ok) {
  DP_TRY(m->dev->backend->copy_to_host(m->dev, tmp, p, sizeof(float) * (size_t)n));
  *ok = 1;
  for (int64_t i = 0; i < n && *ok; ++i) *ok = isfinite(tmp[i]) != 0;
  return DP_OK;
}

static dp_status scan_nonfinite(dp_model *m, int64_t n, float *tmp, int *layer, int *what) {
  double loss;
  int64_t hits;
  int ok = 1;
  DP_TRY(dp_model_read_metrics(m, &loss, &hits));
  for (int i = 0; i < m->nlayers; ++i) {
    DP_TRY(all_finite(m, m->acts[i], n * layer_out_size(&m->layers[i]), tmp, &ok));
    if (!ok) {
      *layer = i;
      *what = DP_NONFINITE_OUTPUT;
      return DP_OK;
    }
  }
  if (!isfinite(loss)) {
    *layer = DP_NONFINITE_LOSS;
    return DP_OK;
  }
  for (int i = m->nlayers - 1; i >= 0; --i) {
    const dp_layer *l = &m->layers[i];
    int out_ok = 1, w_ok = 1, b_ok = 1;
    if (m->dready[i]) DP_TRY(all_finite(m, grad_of(m, i), n * layer_out_size(l), tmp, &out_ok));
    if (out_ok && l->w_len > 0) DP_TRY(all_finite(m, m->grads + l->w_off, l->w_len, tmp, &w_ok));
    if (out_ok && w_ok && l->b_len > 0) DP_TRY(all_finite(m, m->grads + l->b_off, l->b_len, tmp, &b_ok));
    if (!out_ok || !w_ok || !b_ok) {
      *layer = i;
      *what = !out_ok ? DP_NONFINITE_OUTPUT_GRAD : DP_NONFINITE_PARAM_GRAD;
      return DP_OK;
    }
  }
  return DP_OK;
}

dp_status dp_model_find_nonfinite(dp_model *m, const dp_batch *b, int *layer, int *what) {
  *layer = DP_NONFINITE_NONE;
  *what = DP_NONFINITE_OUTPUT;
  DP_TRY(require_finalized(m));
  if (b->n == 0) return DP_OK;
  DP_TRY(dp_model_load(m, b, 1));
  int64_t most = m->nparams + 1;
  for (int i = 0; i < m->nlayers; ++i)
    if (b->n * layer_out_size(&m->layers[i]) > most) most = b->n * layer_out_size(&m->layers[i]);
  float *tmp = malloc(sizeof(float) * (size_t)(most + m->nstate + 1));
  if (!tmp) return DP_FAIL(DP_ERR_MEMORY, "check_numerics: cannot allocate %lld floats", (long long)most);
  float *state = tmp + most; /* the running statistics the diagnosis must not change */
  dp_status st = dp_model_get_state(m, state);
  m->unfused = 1; /* every layer's output gradient written, for the scan */
  if (st == DP_OK) st = dp_model_forward_backward_loaded(m, b->n, 1.0f / (float)b->n, NULL, NULL, NULL);
  m->unfused = 0;
  if (st == DP_OK) st = scan_nonfinite(m, b->n, tmp, layer, what);
  const dp_status restored = dp_model_set_state(m, state);
  free(tmp);
  return st != DP_OK ? st : restored;
}

dp_status dp_model_evaluate(dp_model *m, const dp_batch *b, double *loss_sum, int64_t *correct) {
  DP_TRY(require_finalized(m));
  DP_TRY(dp_model_load(m, b, 1));
  m->training = 0;
  DP_TRY(forward(m, b->n, NULL));
  return m->dev->backend->softmax_xent(m->dev, b->n, dp_model_num_classes(m), logits_of(m), m->labels, 0.0f, NULL,
                                       loss_sum, correct);
}

/* Inference runs a batch in pieces of DP_PREDICT_PIECE samples, so that it
 * needs the activations of that many samples at most (a whole training-sized
 * set for a 1,024-image predict of ResNet-18 on 28x28 was 12 GiB). The piece
 * is a constant, not the activations already there: a sample's logits may
 * depend in the last bits on the samples computed beside it (GEMM rows and
 * grouped narrow planes), and must not depend on what the model did before. */
#define DP_PREDICT_PIECE 64

dp_status dp_model_predict(dp_model *m, const dp_batch *b, float *logits_host) {
  DP_TRY(require_finalized(m));
  /* resident rows are gathered whole (the rows index a dataset, not the images) */
  const int64_t piece = b->rows && b->n > DP_PREDICT_PIECE ? b->n : DP_PREDICT_PIECE;
  const int64_t in_size = (int64_t)m->in_c * m->in_h * m->in_w, K = dp_model_num_classes(m);
  int64_t i0 = 0;
  do { /* once for an empty batch too: it is staged and checked as any other */
    dp_batch part = *b;
    part.n = b->n - i0 < piece ? b->n - i0 : piece;
    if (!b->rows) part.x = (const char *)b->x + (size_t)(i0 * in_size) * (b->x_is_u8 ? 1 : sizeof(float));
    if (b->y) part.y = b->y + i0;
    DP_TRY(dp_model_load(m, &part, 0));
    m->training = 0;
    DP_TRY(forward(m, part.n, NULL));
    DP_TRY(m->dev->backend->copy_to_host(m->dev, logits_host + i0 * K, logits_of(m),
                                         sizeof(float) * (size_t)(part.n * K)));
    i0 += piece;
  } while (i0 < b->n);
  return DP_OK;
}

dp_status dp_model_set_params(dp_model *m, const float *host) {
  DP_TRY(require_finalized(m));
  return m->dev->backend->copy_to_device(m->dev, m->params, host, sizeof(float) * (size_t)m->nparams);
}

dp_status dp_model_get_params(dp_model *m, float *host) {
  DP_TRY(require_finalized(m));
  return m->dev->backend->copy_to_host(m->dev, host, m->params, sizeof(float) * (size_t)m->nparams);
}

dp_status dp_model_get_grads(dp_model *m, float *host) {
  DP_TRY(require_finalized(m));
  return m->dev->backend->copy_to_host(m->dev, host, m->grads, sizeof(float) * (size_t)m->nparams);
}

dp_status dp_model_zero_grads(dp_model *m) {
  DP_TRY(require_finalized(m));
  return m->dev->backend->fill(m->dev, m->grads, m->nparams, 0.0f);
}

dp_status dp_model_reset_velocity(dp_model *m) {
  DP_TRY(require_finalized(m));
  return m->dev->backend->fill(m->dev, m->velocity, m->nparams, 0.0f);
}

dp_status dp_model_get_velocity(dp_model *m, float *host) {
  DP_TRY(require_finalized(m));
  return m->dev->backend->copy_to_host(m->dev, host, m->velocity, sizeof(float) * (size_t)m->nparams);
}

dp_status dp_model_set_velocity(dp_model *m, const float *host) {
  DP_TRY(require_finalized(m));
  return m->dev->backend->copy_to_device(m->dev, m->velocity, host, sizeof(float) * (size_t)m->nparams);
}

dp_status dp_model_get_state(dp_model *m, float *host) {
  DP_TRY(require_finalized(m));
  return m->dev->backend->copy_to_host(m->dev, host, m->state, sizeof(float) * (size_t)m->nstate);
}

dp_status dp_model_set_state(dp_model *m, const float *host) {
  DP_TRY(require_finalized(m));
  return m->dev->backend->copy_to_device(m->dev, m->state, host, sizeof(float) * (size_t)m->nstate);
}

/* ---- pipeline stages ---------------------------------------------------------- */

dp_status dp_model_set_stage(dp_model *m, int headless, int input_grad) {
  if (m->finalized || m->nlayers > 0) return DP_FAIL(DP_ERR_VALUE, "a stage is chosen before any layer is added");
  m->headless = headless != 0;
  m->input_grad = input_grad != 0;
  return DP_OK;
}

dp_status dp_model_use_slot(dp_model *m, int slot) {
  DP_TRY(require_finalized(m));
  if (slot < 0 || slot >= DP_MAX_SLOTS)
    return DP_FAIL(DP_ERR_VALUE, "activation set %d is outside [0, %d)", slot, DP_MAX_SLOTS);
  if (slot == m->cur_slot) return DP_OK;
  if (slot >= m->nslots) {
    const int n = slot + 1, old = m->nslots ? m->nslots : 1;
    struct dp_act_set *p = realloc(m->slots, sizeof *p * (size_t)n);
    if (!p) return DP_FAIL(DP_ERR_MEMORY, "cannot grow the activation sets to %d", n);
    memset(p + old, 0, sizeof *p * (size_t)(n - old));
    if (!m->slots) slot_save(m, &p[0]); /* the model's own set is set 0 */
    m->slots = p;
    m->nslots = n;
  }
  struct dp_act_set *next = &m->slots[slot];
  /* a new set's BatchNorm batch statistics and counts, before anything moves */
  if (!next->bn_count) {
    next->bn_count = calloc((size_t)m->nlayers, sizeof *next->bn_count);
    if (!next->bn_count) return DP_FAIL(DP_ERR_MEMORY, "cannot allocate the BatchNorm counts");
    dp_status st = dp_device_alloc(m->dev, sizeof(float) * (size_t)(m->nstate ? m->nstate : 1),
                                   (void **)&next->bn_saved);
    if (st != DP_OK) {
      free(next->bn_count);
      next->bn_count = NULL;
      return st;
    }
  }
  slot_save(m, &m->slots[m->cur_slot]);
  slot_load(m, next);
  m->cur_slot = slot;
  return DP_OK;
}

int64_t dp_model_activation_bytes(const dp_model *m) {
  int64_t total = m->act_bytes;
  for (int k = 0; k < m->nslots; ++k)
    if (k != m->cur_slot) total += m->slots[k].act_bytes;
  return total;
}

dp_status dp_model_stage_forward(dp_model *m, int slot, const dp_batch *b, int training, float grad_scale,
                                 float *out, double *loss_sum, int64_t *correct) {
  DP_TRY(require_finalized(m));
  if (loss_sum) *loss_sum = 0.0;
  if (correct) *correct = 0;
  const int want_loss = !m->headless && b->y != NULL;
  if (training) DP_TRY(dp_grad_scale_check(grad_scale));
  if (b->n <= 0) return DP_FAIL(DP_ERR_VALUE, "a stage's micro-batch needs at least one sample, got %lld", (long long)b->n);
  if (training) DP_TRY(dp_model_check_batchnorm_batch(m, b->n));
  DP_TRY(dp_model_use_slot(m, slot));
  DP_TRY(dp_model_load(m, b, want_loss));
  m->training = training != 0;
  const int64_t t0 = dp_trace_begin();
  DP_TRY(forward(m, b->n, NULL));
  const dp_backend *be = m->dev->backend;
  const int last = m->nlayers - 1;
  if (want_loss) {
    double loss = 0.0;
    int64_t hits = 0;
    DP_TRY(be->softmax_xent(m->dev, b->n, dp_model_num_classes(m), m->acts[last], m->labels,
                            training ? grad_scale : 0.0f, training ? m->dacts[last] : NULL, &loss, &hits));
    if (loss_sum) *loss_sum = loss;
    if (correct) *correct = hits;
  }
  if (out)
    DP_TRY(be->copy_to_host(m->dev, out, m->acts[last],
                            sizeof(float) * (size_t)(b->n * layer_out_size(&m->layers[last]))));
  /* settled: the input may be freed and the output read by any device's stream */
  DP_TRY(be->synchronize(m->dev));
  dp_trace_end(DP_PHASE_FORWARD, -1, 0, t0);
  return DP_OK;
}

dp_status dp_model_stage_backward(dp_model *m, int slot, int64_t n, const float *dy, float *dx,
                                  int accumulate) {
  DP_TRY(require_finalized(m));
  if (dx && !m->input_grad)
    return DP_FAIL(DP_ERR_VALUE, "this stage was not made to compute its input's gradient");
  if (!dy && m->headless)
    return DP_FAIL(DP_ERR_VALUE, "a stage before the last needs the gradient of its output");
  DP_TRY(dp_model_use_slot(m, slot));
  if (n <= 0 || n > m->act_batch || !m->training)
    return DP_FAIL(DP_ERR_VALUE, "activation set %d holds no training forward pass of %lld samples", slot,
                   (long long)n);
  const dp_backend *be = m->dev->backend;
  const int last = m->nlayers - 1;
  if (dy)
    DP_TRY(be->copy_to_device(m->dev, m->dacts[last], dy,
                              sizeof(float) * (size_t)(n * layer_out_size(&m->layers[last]))));
  if (accumulate && !m->grad_scratch)
    DP_TRY(dp_device_alloc(m->dev, sizeof(float) * (size_t)(m->nparams + 1), (void **)&m->grad_scratch));
  const int64_t t0 = dp_trace_begin();
  float *grads = m->grads;
  if (accumulate) m->grads = m->grad_scratch; /* this micro-batch's, added below */
  dp_status st = backward(m, n, NULL);
  m->grads = grads;
  if (st == DP_OK && accumulate) st = be->add(m->dev, m->nparams, m->grads, m->grad_scratch, m->grads);
  DP_TRY(st);
  if (dx) {
    const int64_t in_size = (int64_t)m->in_c * m->in_h * m->in_w;
    if (!m->dinput_ready) DP_TRY(be->fill(m->dev, m->dinput, n * in_size, 0.0f));
    DP_TRY(be->copy_to_host(m->dev, dx, m->dinput, sizeof(float) * (size_t)(n * in_size)));
  }
  DP_TRY(be->synchronize(m->dev)); /* dy may be freed, dx read by any device's stream */
  dp_trace_end(DP_PHASE_BACKWARD, -1, 0, t0);
  return DP_OK;
}
