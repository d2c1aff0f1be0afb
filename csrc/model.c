#include "model.h"

#include <stdlib.h>
#include <string.h>

static int64_t layer_in_size(const dp_layer *l) { return (int64_t)l->in_c * l->in_h * l->in_w; }
static int64_t layer_out_size(const dp_layer *l) { return (int64_t)l->out_c * l->out_h * l->out_w; }

dp_status dp_model_create(dp_device *dev, int in_c, int in_h, int in_w, dp_model **out) {
  *out = NULL;
  if (in_c < 1 || in_h < 1 || in_w < 1)
    return DP_FAIL(DP_ERR_VALUE, "model input shape must be positive, got (%d, %d, %d)", in_c, in_h, in_w);
  dp_model *m = calloc(1, sizeof *m);
  if (!m) return DP_FAIL(DP_ERR_MEMORY, "cannot allocate a model");
  m->dev = dev;
  m->in_c = in_c;
  m->in_h = in_h;
  m->in_w = in_w;
  *out = m;
  return DP_OK;
}

static void free_activations(dp_model *m) {
  if (m->acts) {
    for (int i = 0; i < m->nlayers; ++i)
      if (m->layers[i].kind != DP_LAYER_FLATTEN) dp_device_free(m->dev, m->acts[i]);
  }
  if (m->argmax)
    for (int i = 0; i < m->nlayers; ++i) dp_device_free(m->dev, m->argmax[i]);
  free(m->acts);
  free(m->argmax);
  m->acts = NULL;
  m->argmax = NULL;
  dp_device_free(m->dev, m->grad_a);
  dp_device_free(m->dev, m->grad_b);
  dp_device_free(m->dev, m->input);
  dp_device_free(m->dev, m->labels);
  m->grad_a = m->grad_b = m->input = NULL;
  m->labels = NULL;
  m->act_batch = 0;
}

void dp_model_destroy(dp_model *m) {
  if (!m) return;
  free_activations(m);
  dp_device_free(m->dev, m->params);
  dp_device_free(m->dev, m->grads);
  dp_device_free(m->dev, m->velocity);
  free(m->layers);
  free(m);
}

/* Append a layer whose input is the previous layer's output. */
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
  if (m->nlayers == 0) {
    l->in_c = m->in_c;
    l->in_h = m->in_h;
    l->in_w = m->in_w;
  } else {
    const dp_layer *p = &m->layers[m->nlayers - 1];
    l->in_c = p->out_c;
    l->in_h = p->out_h;
    l->in_w = p->out_w;
  }
  *out = l;
  return DP_OK;
}

dp_status dp_model_add_conv2d(dp_model *m, int out_c, int k, int stride, int pad) {
  dp_layer *l = NULL;
  DP_TRY(push_layer(m, &l));
  if (out_c < 1 || k < 1 || stride < 1 || pad < 0)
    return DP_FAIL(DP_ERR_VALUE, "conv2d: need out_channels, kernel, stride >= 1 and padding >= 0, got %d, %d, %d, %d",
                   out_c, k, stride, pad);
  if (l->in_h + 2 * pad < k || l->in_w + 2 * pad < k)
    return DP_FAIL(DP_ERR_VALUE, "conv2d: kernel %d is larger than the padded input %dx%d (padding %d)", k, l->in_h,
                   l->in_w, pad);
  l->kind = DP_LAYER_CONV2D;
  l->k = k;
  l->stride = stride;
  l->pad = pad;
  l->out_c = out_c;
  l->out_h = (l->in_h + 2 * pad - k) / stride + 1;
  l->out_w = (l->in_w + 2 * pad - k) / stride + 1;
  l->w_len = (int64_t)out_c * l->in_c * k * k;
  l->b_len = out_c;
  m->nlayers++;
  return DP_OK;
}

dp_status dp_model_add_dense(dp_model *m, int out_features) {
  dp_layer *l = NULL;
  DP_TRY(push_layer(m, &l));
  if (out_features < 1) return DP_FAIL(DP_ERR_VALUE, "dense: out_features must be >= 1, got %d", out_features);
  if (l->in_h != 1 || l->in_w != 1)
    return DP_FAIL(DP_ERR_VALUE, "dense: input is (%d, %d, %d); add a flatten layer first", l->in_c, l->in_h, l->in_w);
  l->kind = DP_LAYER_DENSE;
  l->out_c = out_features;
  l->out_h = l->out_w = 1;
  l->w_len = (int64_t)out_features * l->in_c;
  l->b_len = out_features;
  m->nlayers++;
  return DP_OK;
}

dp_status dp_model_add_relu(dp_model *m) {
  dp_layer *l = NULL;
  DP_TRY(push_layer(m, &l));
  l->kind = DP_LAYER_RELU;
  l->out_c = l->in_c;
  l->out_h = l->in_h;
  l->out_w = l->in_w;
  m->nlayers++;
  return DP_OK;
}

static dp_status add_pool(dp_model *m, dp_layer_kind kind, int k, int stride, int pad) {
  dp_layer *l = NULL;
  DP_TRY(push_layer(m, &l));
  const char *name = kind == DP_LAYER_AVGPOOL ? "avg_pool2d" : "max_pool2d";
  if (k < 1 || stride < 1 || pad < 0)
    return DP_FAIL(DP_ERR_VALUE, "%s: need kernel, stride >= 1 and padding >= 0, got %d, %d, %d", name, k, stride, pad);
  if (2 * pad > k) return DP_FAIL(DP_ERR_VALUE, "%s: padding %d must be at most half the kernel %d", name, pad, k);
  if (l->in_h + 2 * pad < k || l->in_w + 2 * pad < k)
    return DP_FAIL(DP_ERR_VALUE, "%s: kernel %d is larger than the padded input %dx%d", name, k, l->in_h, l->in_w);
  l->kind = kind;
  l->k = k;
  l->stride = stride;
  l->pad = pad;
  l->out_c = l->in_c;
  l->out_h = dp_pool_out_dim(l->in_h, k, stride, pad);
  l->out_w = dp_pool_out_dim(l->in_w, k, stride, pad);
  m->nlayers++;
  return DP_OK;
}

dp_status dp_model_add_avgpool(dp_model *m, int k, int stride, int pad) {
  return add_pool(m, DP_LAYER_AVGPOOL, k, stride, pad);
}
dp_status dp_model_add_maxpool(dp_model *m, int k, int stride, int pad) {
  return add_pool(m, DP_LAYER_MAXPOOL, k, stride, pad);
}

dp_status dp_model_add_flatten(dp_model *m) {
  dp_layer *l = NULL;
  DP_TRY(push_layer(m, &l));
  l->kind = DP_LAYER_FLATTEN;
  l->out_c = l->in_c * l->in_h * l->in_w;
  l->out_h = l->out_w = 1;
  m->nlayers++;
  return DP_OK;
}

int dp_model_num_classes(const dp_model *m) {
  return m->nlayers ? m->layers[m->nlayers - 1].out_c * m->layers[m->nlayers - 1].out_h * m->layers[m->nlayers - 1].out_w
                    : 0;
}

dp_status dp_model_finalize(dp_model *m) {
  if (m->finalized) return DP_OK;
  if (m->nlayers == 0) return DP_FAIL(DP_ERR_VALUE, "a model needs at least one layer");
  const dp_layer *last = &m->layers[m->nlayers - 1];
  if (last->out_h != 1 || last->out_w != 1)
    return DP_FAIL(DP_ERR_VALUE, "the last layer must produce logits (N, classes); it produces (%d, %d, %d)",
                   last->out_c, last->out_h, last->out_w);
  int64_t off = 0;
  for (int i = 0; i < m->nlayers; ++i) {
    dp_layer *l = &m->layers[i];
    /* Each tensor starts on a 16-float (64-byte) boundary of the flat buffer. */
    if (l->w_len) {
      l->w_off = off;
      off += (l->w_len + 15) & ~(int64_t)15;
      l->b_off = off;
      off += (l->b_len + 15) & ~(int64_t)15;
    }
  }
  m->nparams = off;
  size_t bytes = sizeof(float) * (size_t)off;
  DP_TRY(dp_device_alloc(m->dev, bytes, (void **)&m->params));
  DP_TRY(dp_device_alloc(m->dev, bytes, (void **)&m->grads));
  DP_TRY(dp_device_alloc(m->dev, bytes, (void **)&m->velocity));
  m->acts = calloc((size_t)m->nlayers, sizeof *m->acts);
  m->argmax = calloc((size_t)m->nlayers, sizeof *m->argmax);
  if (!m->acts || !m->argmax) return DP_FAIL(DP_ERR_MEMORY, "cannot allocate the activation table");
  m->finalized = 1;
  return DP_OK;
}

static dp_status require_finalized(const dp_model *m) {
  if (!m->finalized) return DP_FAIL(DP_ERR_VALUE, "the model is not finalized");
  return DP_OK;
}

/* Make room for batches of n samples (activations grow, never shrink). */
static dp_status ensure_batch(dp_model *m, int64_t n) {
  if (n <= m->act_batch) return DP_OK;
  int64_t cap = n;
  free_activations(m);
  m->acts = calloc((size_t)m->nlayers, sizeof *m->acts);
  m->argmax = calloc((size_t)m->nlayers, sizeof *m->argmax);
  if (!m->acts || !m->argmax) return DP_FAIL(DP_ERR_MEMORY, "cannot allocate the activation table");
  int64_t largest = layer_in_size(&m->layers[0]);
  for (int i = 0; i < m->nlayers; ++i) {
    const dp_layer *l = &m->layers[i];
    int64_t sz = layer_out_size(l);
    if (sz > largest) largest = sz;
    if (l->kind == DP_LAYER_FLATTEN) continue; /* a view of its input */
    DP_TRY(dp_device_alloc(m->dev, sizeof(float) * (size_t)(cap * sz), (void **)&m->acts[i]));
    if (l->kind == DP_LAYER_MAXPOOL)
      DP_TRY(dp_device_alloc(m->dev, sizeof(int32_t) * (size_t)(cap * sz), (void **)&m->argmax[i]));
  }
  DP_TRY(dp_device_alloc(m->dev, sizeof(float) * (size_t)(cap * largest), (void **)&m->grad_a));
  DP_TRY(dp_device_alloc(m->dev, sizeof(float) * (size_t)(cap * largest), (void **)&m->grad_b));
  DP_TRY(dp_device_alloc(m->dev, sizeof(float) * (size_t)(cap * layer_in_size(&m->layers[0])), (void **)&m->input));
  DP_TRY(dp_device_alloc(m->dev, sizeof(int32_t) * (size_t)cap, (void **)&m->labels));
  m->act_batch = cap;
  return DP_OK;
}

/* Stage the batch on the device; labels are checked against the class count. */
static dp_status load_batch(dp_model *m, const dp_batch *b, int need_labels) {
  if (b->n < 0) return DP_FAIL(DP_ERR_VALUE, "batch size must be >= 0, got %lld", (long long)b->n);
  DP_TRY(ensure_batch(m, b->n > 0 ? b->n : 1));
  const dp_backend *be = m->dev->backend;
  const int64_t nx = b->n * layer_in_size(&m->layers[0]);
  if (b->x_is_u8) {
    if (m->dev->kind == DP_DEVICE_CPU) {
      DP_TRY(be->u8_to_unit(m->dev, m->input, b->x, nx));
    } else {
      return DP_FAIL(DP_ERR_UNSUPPORTED, "uint8 staging is not implemented for %s", m->dev->name);
    }
  } else {
    DP_TRY(be->copy_to_device(m->dev, m->input, b->x, sizeof(float) * (size_t)nx));
  }
  if (need_labels) {
    if (!b->y) return DP_FAIL(DP_ERR_VALUE, "labels are required");
    const int K = dp_model_num_classes(m);
    int32_t *tmp = malloc(sizeof(int32_t) * (size_t)(b->n ? b->n : 1));
    if (!tmp) return DP_FAIL(DP_ERR_MEMORY, "cannot allocate labels");
    for (int64_t i = 0; i < b->n; ++i) {
      if (b->y[i] < 0 || b->y[i] >= K) {
        long long bad = (long long)b->y[i];
        free(tmp);
        return DP_FAIL(DP_ERR_VALUE, "label %lld at index %lld is outside [0, %d)", bad, (long long)i, K);
      }
      tmp[i] = (int32_t)b->y[i];
    }
    dp_status s = be->copy_to_device(m->dev, m->labels, tmp, sizeof(int32_t) * (size_t)b->n);
    free(tmp);
    DP_TRY(s);
  }
  return DP_OK;
}

static dp_status forward(dp_model *m, int64_t N) {
  const dp_backend *be = m->dev->backend;
  dp_device *dev = m->dev;
  const float *x = m->input;
  for (int i = 0; i < m->nlayers; ++i) {
    dp_layer *l = &m->layers[i];
    float *y = m->acts[i];
    switch (l->kind) {
      case DP_LAYER_CONV2D: {
        dp_conv_geom g = {l->in_c, l->in_h, l->in_w, l->out_c, l->k, l->k, l->stride, l->pad, l->out_h, l->out_w};
        DP_TRY(be->conv2d_forward(dev, &g, N, x, m->params + l->w_off, m->params + l->b_off, y));
        break;
      }
      case DP_LAYER_DENSE:
        DP_TRY(be->dense_forward(dev, N, l->in_c, l->out_c, x, m->params + l->w_off, m->params + l->b_off, y));
        break;
      case DP_LAYER_RELU:
        DP_TRY(be->relu_forward(dev, N * layer_out_size(l), x, y));
        break;
      case DP_LAYER_AVGPOOL:
      case DP_LAYER_MAXPOOL: {
        dp_pool_geom g = {l->in_c, l->in_h, l->in_w, l->out_h, l->out_w, l->k, l->stride, l->pad};
        if (l->kind == DP_LAYER_AVGPOOL)
          DP_TRY(be->avgpool_forward(dev, &g, N, x, y));
        else
          DP_TRY(be->maxpool_forward(dev, &g, N, x, y, m->argmax[i]));
        break;
      }
      case DP_LAYER_FLATTEN:
        m->acts[i] = (float *)x; /* same memory, (N, C*H*W) */
        y = m->acts[i];
        break;
    }
    x = y;
  }
  return DP_OK;
}

/* Backward from dlogits in grad_a; writes m->grads. */
static dp_status backward(dp_model *m, int64_t N) {
  const dp_backend *be = m->dev->backend;
  dp_device *dev = m->dev;
  float *dy = m->grad_a, *spare = m->grad_b;
  for (int i = m->nlayers - 1; i >= 0; --i) {
    dp_layer *l = &m->layers[i];
    const float *x = i > 0 ? m->acts[i - 1] : m->input;
    /* The first layer's input gradient is never needed. */
    float *dx = i > 0 ? spare : NULL;
    switch (l->kind) {
      case DP_LAYER_CONV2D: {
        dp_conv_geom g = {l->in_c, l->in_h, l->in_w, l->out_c, l->k, l->k, l->stride, l->pad, l->out_h, l->out_w};
        DP_TRY(be->conv2d_backward(dev, &g, N, x, m->params + l->w_off, dy, dx, m->grads + l->w_off,
                                   m->grads + l->b_off));
        break;
      }
      case DP_LAYER_DENSE:
        DP_TRY(be->dense_backward(dev, N, l->in_c, l->out_c, x, m->params + l->w_off, dy, dx, m->grads + l->w_off,
                                  m->grads + l->b_off));
        break;
      case DP_LAYER_RELU:
        if (dx) DP_TRY(be->relu_backward(dev, N * layer_out_size(l), m->acts[i], dy, dx));
        break;
      case DP_LAYER_AVGPOOL:
      case DP_LAYER_MAXPOOL: {
        dp_pool_geom g = {l->in_c, l->in_h, l->in_w, l->out_h, l->out_w, l->k, l->stride, l->pad};
        if (!dx) break;
        if (l->kind == DP_LAYER_AVGPOOL)
          DP_TRY(be->avgpool_backward(dev, &g, N, dy, dx));
        else
          DP_TRY(be->maxpool_backward(dev, &g, N, dy, m->argmax[i], dx));
        break;
      }
      case DP_LAYER_FLATTEN:
        continue; /* the gradient passes through unchanged */
    }
    if (!dx) break;
    spare = dy;
    dy = dx;
  }
  return DP_OK;
}

static const float *logits_of(const dp_model *m) { return m->acts[m->nlayers - 1]; }

dp_status dp_model_forward_backward(dp_model *m, const dp_batch *b, float grad_scale, double *loss_sum,
                                    int64_t *correct) {
  DP_TRY(require_finalized(m));
  DP_TRY(load_batch(m, b, 1));
  DP_TRY(forward(m, b->n));
  const int K = dp_model_num_classes(m);
  DP_TRY(m->dev->backend->softmax_xent(m->dev, b->n, K, logits_of(m), m->labels, grad_scale, m->grad_a, loss_sum,
                                       correct));
  return backward(m, b->n);
}

dp_status dp_model_sgd_step(dp_model *m, float lr, float momentum, float weight_decay) {
  DP_TRY(require_finalized(m));
  if (!(lr >= 0.0f)) return DP_FAIL(DP_ERR_VALUE, "learning rate must be >= 0, got %g", (double)lr);
  if (!(momentum >= 0.0f)) return DP_FAIL(DP_ERR_VALUE, "momentum must be >= 0, got %g", (double)momentum);
  if (!(weight_decay >= 0.0f)) return DP_FAIL(DP_ERR_VALUE, "weight decay must be >= 0, got %g", (double)weight_decay);
  return m->dev->backend->sgd_update(m->dev, m->nparams, m->params, m->grads, m->velocity, lr, momentum, weight_decay);
}

dp_status dp_model_evaluate(dp_model *m, const dp_batch *b, double *loss_sum, int64_t *correct) {
  DP_TRY(require_finalized(m));
  DP_TRY(load_batch(m, b, 1));
  DP_TRY(forward(m, b->n));
  return m->dev->backend->softmax_xent(m->dev, b->n, dp_model_num_classes(m), logits_of(m), m->labels, 0.0f, NULL,
                                       loss_sum, correct);
}

dp_status dp_model_predict(dp_model *m, const dp_batch *b, float *logits_host) {
  DP_TRY(require_finalized(m));
  DP_TRY(load_batch(m, b, 0));
  DP_TRY(forward(m, b->n));
  size_t bytes = sizeof(float) * (size_t)(b->n * dp_model_num_classes(m));
  return m->dev->backend->copy_to_host(m->dev, logits_host, logits_of(m), bytes);
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

dp_status dp_model_reset_velocity(dp_model *m) {
  DP_TRY(require_finalized(m));
  return m->dev->backend->fill(m->dev, m->velocity, m->nparams, 0.0f);
}
