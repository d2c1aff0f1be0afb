/* py_model.c — Model (one replica: a network on one device, its flat
 * parameter, gradient and state buffers) and Resident (a dataset copied once
 * to a model's device).
 *
 * A model takes one call at a time: a call that runs without the GIL marks it
 * busy (models_run_without_gil), and every method checks model_ready first, so
 * a second thread gets RuntimeError instead of racing with the first.
 */
#include "py_private.h"

#include <limits.h>
#include <stdio.h>
#include <string.h>

static void model_destroy_in_dealloc(void *model) { dp_model_destroy(model); }

/* A failed __init__ leaves the object as new, so that a retry can succeed:
 * the model and the device reference go (as in a dealloc). The fields are
 * cleared first, since freeing a CUDA model waits without the GIL. Keeps the
 * exception set. */
static void model_init_undo(ModelObject *self) {
  dp_device *dev = self->device;
  dp_model *m = self->model;
  self->device = NULL;
  self->model = NULL;
  if (dev) device_free_in_dealloc(dev, model_destroy_in_dealloc, m, 1, "a Model's memory");
}

static void Model_dealloc(ModelObject *self) {
  /* the model before the device reference, since its buffers are the device's; both
   * stay when the device's work does not finish (device_free_in_dealloc) */
  if (self->device)
    device_free_in_dealloc(self->device, model_destroy_in_dealloc, self->model, 1, "a Model's memory");
  Py_TYPE(self)->tp_free((PyObject *)self);
}

int model_ready(ModelObject *self) {
  if (!self->model || !self->model->finalized) {
    PyErr_SetString(PyExc_RuntimeError, "Model is not initialized");
    return 0;
  }
  return model_check_idle(self) == 0;
}

/* Runs work on this model alone without the GIL; see models_run_without_gil. */
static int model_run_without_gil(ModelObject *self, nogil_work work, void *ctx) {
  PyObject *models[1] = {(PyObject *)self};
  return models_run_without_gil(models, 1, work, ctx);
}

typedef struct {
  dp_device_kind kind;
  int index, threads;
  dp_device *out;
} device_get_work;

static dp_status device_get_run(void *p) {
  device_get_work *w = p;
  return dp_device_get_index(w->kind, w->index, w->threads, &w->out);
}

/* The model's device from the registry (csrc/device.h): cpu:index with its
 * share of the cores, or `threads` cores when threads > 0; or logical GPU
 * cuda:index, whose physical GPU is the registry's mapping (gpu >= 0 must
 * name that one). 0, or -1 with the exception set. */
static int model_device_init(ModelObject *self, const char *kind, int index, int threads, int gpu) {
  device_get_work w = {DP_DEVICE_CPU, index, threads, NULL};
  if (strcmp(kind, "cuda") == 0) {
    w.kind = DP_DEVICE_CUDA;
    w.threads = 0; /* a GPU's replica thread only issues work */
    const int k = dp_devices_logical(DP_DEVICE_CUDA);
    if (gpu >= 0 && index >= 0 && gpu != index / k) {
      PyErr_Format(PyExc_ValueError, "cuda:%d is logical GPU %d of physical GPU %d (%d logical GPUs per GPU), not "
                   "on GPU %d", index, index % k, index / k, k, gpu);
      return -1;
    }
  } else if (strcmp(kind, "cpu") != 0) {
    PyErr_Format(PyExc_ValueError, "device_kind must be 'cpu' or 'cuda', got '%s'", kind);
    return -1;
  }
  /* creating a CUDA context takes a while */
  if (model_run_without_gil(self, device_get_run, &w) < 0) return -1;
  self->device = w.out;
  return 0;
}

static dp_status model_finalize_run(void *p) { return dp_model_finalize(p); }

/* Model(input_shape=(C, H, W), layers=[...], threads=0, device_index=0, sources=None,
 *       device_kind='cpu', gpu=-1) — on the registry's device
 * device_kind:device_index, shared with every model and tensor there;
 * threads 0: the device's share of the cores. gpu (-1: the mapping's) must be
 * the physical GPU of cuda:device_index. */
static int Model_init(ModelObject *self, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"input_shape", "layers",  "threads",    "device_index", "sources",
                           "device_kind", "gpu",     "headless",   "input_grad",   NULL};
  int threads = 0, index = 0, gpu = -1, headless = 0, input_grad = 0;
  int64_t shape[3];
  const char *kind = "cpu";
  PyObject *shape_obj, *layers, *sources = Py_None, *threads_obj = NULL, *index_obj = NULL, *gpu_obj = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|OOOsOpp", kwlist, &shape_obj, &layers, &threads_obj, &index_obj,
                                   &sources, &kind, &gpu_obj, &headless, &input_grad))
    return -1;
  /* in 64 bits first: threads=2**40 is a ValueError naming it, not an OverflowError */
  if ((threads_obj && int_arg(threads_obj, "Model", "threads", 0, DP_MAX_THREADS, &threads) < 0) ||
      (index_obj && int_arg(index_obj, "Model", "device_index", 0, DP_DEVICES_MAX - 1, &index) < 0) ||
      (gpu_obj && int_arg(gpu_obj, "Model", "gpu", -1, DP_DEVICES_MAX - 1, &gpu) < 0))
    return -1;
  if (input_shape_from(shape_obj, shape) < 0) return -1;
  /* busy: another thread's __init__ is creating the device right now */
  if (model_check_idle(self) < 0) return -1;
  if (self->model || self->device) {
    PyErr_SetString(PyExc_RuntimeError, "Model is already initialized");
    return -1;
  }
  if (model_device_init(self, kind, index, threads, gpu) < 0) return -1;
  int rc = -1;
  dp_status st = dp_model_create(self->device, shape[0], shape[1], shape[2], &self->model);
  if (check_status(st) < 0) goto done;
  if ((headless || input_grad) && check_status(dp_model_set_stage(self->model, headless, input_grad)) < 0) goto done;
  if (model_add_layers(self->model, layers, sources) < 0) goto done;
  /* its buffers are allocated holding the device's step lock (device.h) */
  if (model_run_without_gil(self, model_finalize_run, self->model) < 0) goto done;
  rc = 0;
done:
  if (rc < 0) model_init_undo(self);
  return rc;
}

/* Appends item (a new reference, or NULL after a failed build) to list, and drops it. */
static int list_append_new(PyObject *list, PyObject *item) {
  int rc = item ? PyList_Append(list, item) : -1;
  Py_XDECREF(item);
  return rc;
}

/* [(layer_index, name, offset, shape)] of the tensors of every layer that
 * live in one flat buffer (params: weights and biases; state: BatchNorm's
 * running statistics), named and shaped by the layer kinds' table. */
static PyObject *model_layout(ModelObject *self, dp_layer_buffer buffer) {
  if (!model_ready(self)) return NULL;
  PyObject *out = PyList_New(0);
  if (!out) return NULL;
  const dp_model *m = self->model;
  for (int i = 0; i < m->nlayers; ++i) {
    const dp_layer *l = &m->layers[i];
    const dp_layer_kind_info *info = dp_layer_kind_info_of(l->kind);
    for (int t = 0; t < info->ntensors; ++t) {
      const dp_layer_tensor *x = &info->tensors[t];
      if (x->buffer != buffer) continue;
      PyObject *shape = layer_tensor_shape(l, t);
      if (!shape || list_append_new(out, Py_BuildValue("(isLN)", i, x->name, (long long)dp_layer_tensor_offset(l, t),
                                                       shape)) < 0) {
        Py_DECREF(out);
        return NULL;
      }
    }
  }
  return out;
}

static PyObject *Model_param_layout(ModelObject *self, PyObject *unused) {
  return model_layout(self, DP_BUFFER_PARAMS);
}
static PyObject *Model_state_layout(ModelObject *self, PyObject *unused) { return model_layout(self, DP_BUFFER_STATE); }

static PyObject *Model_layers(ModelObject *self, PyObject *unused) {
  if (!model_ready(self)) return NULL;
  const dp_model *m = self->model;
  PyObject *out = PyList_New(m->nlayers);
  if (!out) return NULL;
  for (int i = 0; i < m->nlayers; ++i) {
    const dp_layer *l = &m->layers[i];
    PyObject *t = Py_BuildValue("(s(iii)(iii))", dp_layer_kind_info_of(l->kind)->name, l->in_c, l->in_h, l->in_w,
                                l->out_c, l->out_h, l->out_w);
    if (!t) {
      Py_DECREF(out);
      return NULL;
    }
    PyList_SET_ITEM(out, i, t);
  }
  return out;
}

/* ---- the flat buffers: copies in and out, with the GIL held (one copy each) -- */

typedef dp_status (*flat_getter)(dp_model *, float *);
typedef dp_status (*flat_setter)(dp_model *, const float *);

/* A new float32 array of the n floats get copies out of the model. */
static PyObject *get_flat(ModelObject *self, int64_t n, flat_getter get) {
  npy_intp len = (npy_intp)n;
  PyArrayObject *out = new_float32(1, &len);
  if (!out) return NULL;
  dp_status st = get(self->model, (float *)PyArray_DATA(out));
  if (st != DP_OK) {
    Py_DECREF(out);
    return raise_from_status(st);
  }
  return (PyObject *)out;
}

/* set(model, arg) after checking that arg holds n float32 values. */
static PyObject *set_flat(ModelObject *self, PyObject *arg, const char *what, int64_t n, flat_setter set) {
  PyArrayObject *a = as_float32(arg, 1, what);
  if (!a) return NULL;
  PyObject *ret = NULL;
  if (PyArray_DIM(a, 0) != n) {
    PyErr_Format(PyExc_ValueError, "%s must have %lld elements, got %ld", what, (long long)n, (long)PyArray_DIM(a, 0));
    goto done;
  }
  /* again: converting a strided array may have let another thread start a call on the model */
  if (model_check_idle(self) < 0) goto done;
  dp_status st = set(self->model, (const float *)PyArray_DATA(a));
  if (st != DP_OK) {
    raise_from_status(st);
    goto done;
  }
  ret = Py_NewRef(Py_None);
done:
  Py_DECREF(a);
  return ret;
}

/* set_replicas(models, params, state, velocity=None): the same flat buffers
 * on every model, all or none: every array is checked against every model and
 * every model found idle before the first copy, and the GIL is held from the
 * check to the last copy, so another thread's call cannot start in between
 * and leave the replicas holding different parameters. */
static PyObject *mod_set_replicas(PyObject *mod, PyObject *args) {
  PyObject *models_obj, *arrays[3] = {NULL, NULL, Py_None};
  if (!PyArg_ParseTuple(args, "OOO|O", &models_obj, &arrays[0], &arrays[1], &arrays[2])) return NULL;
  static const char *names[3] = {"params", "state", "velocity"};
  static const flat_setter setters[3] = {dp_model_set_params, dp_model_set_state, dp_model_set_velocity};
  PyObject *models = items_of(models_obj, "models must be a sequence of Models");
  if (!models) return NULL;
  PyArrayObject *a[3] = {NULL, NULL, NULL};
  PyObject *ret = NULL;
  const Py_ssize_t k = PySequence_Fast_GET_SIZE(models);
  for (int b = 0; b < 3; ++b)
    if (arrays[b] != Py_None && !(a[b] = as_float32(arrays[b], 1, names[b]))) goto done;
  for (Py_ssize_t r = 0; r < k; ++r) {
    PyObject *o = PySequence_Fast_GET_ITEM(models, r);
    if (!PyObject_TypeCheck(o, &ModelType)) {
      PyErr_Format(PyExc_TypeError, "models: item %zd is %s, not a Model", r, Py_TYPE(o)->tp_name);
      goto done;
    }
    const dp_model *m = ((ModelObject *)o)->model;
    if (!model_ready((ModelObject *)o)) goto done;
    for (int b = 0; b < 3; ++b) {
      const int64_t n = b == 1 ? m->nstate : m->nparams;
      if (a[b] && PyArray_DIM(a[b], 0) != n) {
        PyErr_Format(PyExc_ValueError, "%s must have %lld elements, got %lld", names[b], (long long)n,
                     (long long)PyArray_DIM(a[b], 0));
        goto done;
      }
    }
  }
  for (Py_ssize_t r = 0; r < k; ++r)
    for (int b = 0; b < 3; ++b) {
      if (!a[b]) continue;
      const dp_status st = setters[b](((ModelObject *)PySequence_Fast_GET_ITEM(models, r))->model,
                                      (const float *)PyArray_DATA(a[b]));
      if (st != DP_OK) {
        raise_from_status(st);
        goto done;
      }
    }
  ret = Py_NewRef(Py_None);
done:
  for (int b = 0; b < 3; ++b) Py_XDECREF(a[b]);
  Py_DECREF(models);
  return ret;
}

PyMethodDef model_functions[] = {
    {"set_replicas", mod_set_replicas, METH_VARARGS,
     "set_replicas(models, params, state, velocity=None): the same flat buffers on every model, all or none"},
    {NULL, NULL, 0, NULL}};

static PyObject *Model_get_params(ModelObject *self, PyObject *unused) {
  if (!model_ready(self)) return NULL;
  return get_flat(self, self->model->nparams, dp_model_get_params);
}

static PyObject *Model_get_grads(ModelObject *self, PyObject *unused) {
  if (!model_ready(self)) return NULL;
  return get_flat(self, self->model->nparams, dp_model_get_grads);
}

static PyObject *Model_get_state(ModelObject *self, PyObject *unused) {
  if (!model_ready(self)) return NULL;
  return get_flat(self, self->model->nstate, dp_model_get_state);
}

static PyObject *Model_set_params(ModelObject *self, PyObject *arg) {
  if (!model_ready(self)) return NULL;
  return set_flat(self, arg, "params", self->model->nparams, dp_model_set_params);
}

static PyObject *Model_set_state(ModelObject *self, PyObject *arg) {
  if (!model_ready(self)) return NULL;
  return set_flat(self, arg, "state", self->model->nstate, dp_model_set_state);
}

static PyObject *Model_get_velocity(ModelObject *self, PyObject *unused) {
  if (!model_ready(self)) return NULL;
  return get_flat(self, self->model->nparams, dp_model_get_velocity);
}

static PyObject *Model_set_velocity(ModelObject *self, PyObject *arg) {
  if (!model_ready(self)) return NULL;
  return set_flat(self, arg, "velocity", self->model->nparams, dp_model_set_velocity);
}

/* set_profiling(on): record this replica's step timeline, or stop */
static PyObject *Model_set_profiling(ModelObject *self, PyObject *arg) {
  if (!model_ready(self)) return NULL;
  const int on = PyObject_IsTrue(arg);
  if (on < 0) return NULL;
  dp_status st = dp_model_set_profiling(self->model, on);
  if (st != DP_OK) return raise_from_status(st);
  Py_RETURN_NONE;
}

/* take_trace() -> (events, dropped): the events recorded since the last call,
 * an int64 array (n, 6) of phase, bucket, bytes, step, t0 ns, t1 ns */
static PyObject *Model_take_trace(ModelObject *self, PyObject *unused) {
  if (!model_ready(self)) return NULL;
  int64_t n = 0, dropped = 0;
  dp_trace_event *events = dp_trace_take(&self->model->trace, &n, &dropped);
  npy_intp dims[2] = {(npy_intp)n, 6};
  PyObject *out = PyArray_SimpleNew(2, dims, NPY_INT64);
  if (!out) {
    free(events);
    return NULL;
  }
  int64_t *row = PyArray_DATA((PyArrayObject *)out);
  for (int64_t i = 0; i < n; ++i, row += 6) {
    const dp_trace_event *e = &events[i];
    row[0] = e->phase;
    row[1] = e->bucket;
    row[2] = e->bytes;
    row[3] = e->step;
    row[4] = e->t0;
    row[5] = e->t1;
  }
  free(events);
  return Py_BuildValue("(NL)", out, (long long)dropped);
}

static PyObject *Model_reset_velocity(ModelObject *self, PyObject *unused) {
  if (!model_ready(self)) return NULL;
  dp_status st = dp_model_reset_velocity(self->model);
  if (st != DP_OK) return raise_from_status(st);
  Py_RETURN_NONE;
}

static PyObject *Model_zero_grads(ModelObject *self, PyObject *unused) {
  if (!model_ready(self)) return NULL;
  dp_status st = dp_model_zero_grads(self->model);
  if (st != DP_OK) return raise_from_status(st);
  Py_RETURN_NONE;
}

/* The flat buffers as Tensors sharing their memory (device memory on a
 * CUDA model): the chapter-12.5 replica's grads and params that
 * dp.all_reduce works on. */
static PyObject *model_view(ModelObject *self, int grads) {
  if (!model_ready(self)) return NULL;
  return tensor_view_of_model(self, grads ? self->model->grads : self->model->params, (npy_intp)self->model->nparams);
}

static PyObject *Model_grads_tensor(ModelObject *self, PyObject *u) { return model_view(self, 1); }
static PyObject *Model_params_tensor(ModelObject *self, PyObject *u) { return model_view(self, 0); }

/* ---- the calls that compute: without the GIL, the model marked busy --------- */

/* The calls on a batch are py_batch.c's, over this batch_type. */
static int model_batch_ready(PyObject *self, batch_work *w) {
  ModelObject *mo = (ModelObject *)self;
  if (!model_ready(mo)) return 0;
  w->core = mo->model;
  w->input = mo->model;
  return 1;
}

/* train_step_rows' resident: a Resident on this model's device (R, held by
 * the call's arguments, keeps the dataset alive) */
static int model_batch_datasets(PyObject *self, PyObject *R, dp_resident **data, PyObject **keep) {
  if (!(data[0] = resident_of(R, (const ModelObject *)self))) return -1;
  *keep = Py_NewRef(R);
  return 0;
}

static int model_batch_run_without_gil(PyObject *self, nogil_work work, void *ctx) {
  return model_run_without_gil((ModelObject *)self, work, ctx);
}

static dp_status model_batch_compute(batch_work *w) {
  dp_model *m = w->core;
  const dp_batch *b = &w->batch;
  switch (w->call) {
    case BATCH_EVALUATE: return dp_model_evaluate(m, b, &w->loss, &w->correct);
    case BATCH_FORWARD_BACKWARD: return dp_model_forward_backward(m, b, w->grad_scale, &w->loss, &w->correct);
    case BATCH_FIND_NONFINITE: return dp_model_find_nonfinite(m, b, &w->layer, &w->what);
    case BATCH_TRAIN_STEP: break;
  }
  /* one replica's step, recorded in its timeline when it profiles (trace.h) */
  dp_trace_count_step(&m->trace);
  dp_trace *previous = dp_trace_step_begin(&m->trace);
  const int64_t t0 = dp_trace_begin();
  dp_status st = b->resident ? dp_model_load_rows(m, b->resident[0], b->rows, b->n) : dp_model_load(m, b, 1);
  if (st == DP_OK) {
    dp_trace_end(DP_PHASE_SCATTER, -1, 0, t0);
    st = dp_model_train_step_loaded(m, b->n, w->lr, w->momentum, w->weight_decay, &w->loss, &w->correct);
  }
  if (st == DP_OK) dp_trace_end(DP_PHASE_STEP, -1, 0, t0);
  dp_trace_step_end(previous);
  return st;
}

static const batch_type model_batches = {model_batch_ready, "resident", model_batch_datasets,
                                         model_batch_run_without_gil, model_batch_compute};

static PyObject *Model_train_step(PyObject *self, PyObject *args, PyObject *kwds) {
  return batch_train_step(&model_batches, self, args, kwds);
}
static PyObject *Model_train_step_rows(PyObject *self, PyObject *args, PyObject *kwds) {
  return batch_train_step_rows(&model_batches, self, args, kwds);
}
static PyObject *Model_forward_backward(PyObject *self, PyObject *args, PyObject *kwds) {
  return batch_forward_backward(&model_batches, self, args, kwds);
}
static PyObject *Model_evaluate(PyObject *self, PyObject *args, PyObject *kwds) {
  return batch_on_images(&model_batches, BATCH_EVALUATE, self, args, kwds);
}
static PyObject *Model_find_nonfinite(PyObject *self, PyObject *args, PyObject *kwds) {
  return batch_on_images(&model_batches, BATCH_FIND_NONFINITE, self, args, kwds);
}

typedef struct {
  dp_model *model;
  float lr, momentum, weight_decay;
} sgd_work;

static dp_status sgd_run(void *p) {
  const sgd_work *w = p;
  return dp_model_sgd_step(w->model, w->lr, w->momentum, w->weight_decay);
}

static PyObject *Model_sgd_step(ModelObject *self, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"lr", "momentum", "weight_decay", NULL};
  sgd_work w = {NULL, 0.0f, 0.0f, 0.0f};
  PyObject *lr, *momentum = NULL, *weight_decay = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|OO", kwlist, &lr, &momentum, &weight_decay) ||
      sgd_args_from("sgd_step", lr, momentum, weight_decay, &w.lr, &w.momentum, &w.weight_decay) < 0)
    return NULL;
  if (!model_ready(self)) return NULL;
  w.model = self->model;
  if (model_run_without_gil(self, sgd_run, &w) < 0) return NULL;
  Py_RETURN_NONE;
}

typedef struct {
  dp_model *model;
  dp_batch batch;
  float *logits; /* (n, num_classes), host memory */
} predict_work;

static dp_status predict_run(void *p) {
  const predict_work *w = p;
  return dp_model_predict(w->model, &w->batch, w->logits);
}

static PyObject *Model_predict(ModelObject *self, PyObject *X) {
  if (!model_ready(self)) return NULL;
  PyArrayObject *xa = NULL, *out = NULL;
  PyObject *ret = NULL;
  int is_u8 = 0;
  if (convert_images(X, self->model, &xa, &is_u8) < 0) goto done;
  npy_intp dims[2] = {PyArray_DIM(xa, 0), dp_model_num_classes(self->model)};
  if (!(out = new_float32(2, dims))) goto done;
  predict_work w = {self->model, {PyArray_DATA(xa), is_u8, NULL, (int64_t)dims[0], NULL, NULL},
                    (float *)PyArray_DATA(out)};
  if (model_run_without_gil(self, predict_run, &w) < 0) goto done;
  ret = Py_NewRef(out);
done:
  Py_XDECREF(xa);
  Py_XDECREF(out);
  return ret;
}

/* ---- pipeline stages (python/dpcore/pipeline.py) ---------------------------- */

typedef struct {
  dp_model *model;
  int slot, training, accumulate;
  dp_batch batch;
  float grad_scale;
  float *out, *dx;
  const float *dy;
  int64_t n;
  double loss;
  int64_t correct;
} stage_work;

static dp_status stage_forward_run(void *p) {
  stage_work *w = p;
  return dp_model_stage_forward(w->model, w->slot, &w->batch, w->training, w->grad_scale, w->out, &w->loss,
                                &w->correct);
}

static dp_status stage_backward_run(void *p) {
  stage_work *w = p;
  return dp_model_stage_backward(w->model, w->slot, w->n, w->dy, w->dx, w->accumulate);
}

static int64_t layer_output_size(const dp_model *m) {
  const dp_layer *l = &m->layers[m->nlayers - 1];
  return (int64_t)l->out_c * l->out_h * l->out_w;
}

/* A Tensor of activations (or their gradient) for this model: on a device
 * whose memory the model's device can copy from (CPU devices: a CPU device's;
 * a GPU: any device's) and of n samples of `each` values. 1 with *data, *n; 0
 * when obj is not a Tensor; -1 with the exception set. */
static int stage_tensor_arg(ModelObject *self, PyObject *obj, const char *what, int64_t each, int64_t want_n,
                            const float **data, int64_t *n) {
  dp_device *dev = NULL;
  void *p = NULL;
  npy_intp first = 0;
  int64_t size = 0;
  int is = tensor_float32_data(obj, what, &dev, &p, &first, &size);
  if (is <= 0) return is;
  if (self->model->dev->kind == DP_DEVICE_CPU && dev->kind != DP_DEVICE_CPU) {
    PyErr_Format(PyExc_ValueError, "%s: a model on %s cannot read a tensor on %s: pass tensor.numpy()", what,
                 self->model->dev->name, dev->name);
    return -1;
  }
  if (first < 1 || first > DP_MAX_BATCH || size != (int64_t)first * each || (want_n >= 0 && first != want_n)) {
    if (want_n >= 0)
      PyErr_Format(PyExc_ValueError, "%s: the tensor must hold %lld samples of %lld values, got %lld values in %lld "
                   "rows", what, (long long)want_n, (long long)each, (long long)size, (long long)first);
    else
      PyErr_Format(PyExc_ValueError, "%s: the tensor must hold samples of %lld values, got %lld values in %lld rows",
                   what, (long long)each, (long long)size, (long long)first);
    return -1;
  }
  *data = p;
  *n = first;
  return 1;
}

/* What a stage call writes: a new NumPy array, or a new Tensor on the model's device (to_tensor). */
static PyObject *stage_output(ModelObject *self, int to_tensor, const npy_intp dims[4], float **data) {
  if (!to_tensor) {
    PyArrayObject *a = new_float32(4, dims);
    if (a) *data = PyArray_DATA(a);
    return (PyObject *)a;
  }
  return tensor_empty_float32(self->device, 4, dims, data);
}

/* stage_forward(slot, images, labels=None, training=True, grad_scale=0.0, output=True, to_tensor=False)
 *   -> (output (N, C, H, W) float32, or a Tensor on this model's device (to_tensor), or None; loss_sum, correct)
 * images: NumPy images or activations, or a Tensor of activations (a previous
 * stage's on any device this one can copy from: no host copy between GPUs). */
static PyObject *Model_stage_forward(ModelObject *self, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"slot", "images", "labels", "training", "grad_scale", "output", "to_tensor", NULL};
  PyObject *slot_obj, *X, *Y = Py_None, *scale_obj = NULL;
  int training = 1, output = 1, to_tensor = 0;
  stage_work w = {0};
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|OpOpp", kwlist, &slot_obj, &X, &Y, &training, &scale_obj, &output,
                                   &to_tensor))
    return NULL;
  if (int_arg(slot_obj, "stage_forward", "slot", 0, DP_MAX_SLOTS - 1, &w.slot) < 0) return NULL;
  if (scale_obj && grad_scale_from("stage_forward", scale_obj, &w.grad_scale) < 0) return NULL;
  if (!model_ready(self)) return NULL;
  PyArrayObject *xa = NULL, *ya = NULL;
  PyObject *out = NULL, *ret = NULL;
  int is_u8 = 0;
  const dp_model *m = self->model;
  const float *x_dev = NULL;
  int64_t n = 0;
  int is_tensor = stage_tensor_arg(self, X, "stage_forward: images", (int64_t)m->in_c * m->in_h * m->in_w, -1,
                                   &x_dev, &n);
  if (is_tensor < 0) return NULL;
  if (!is_tensor) {
    if (convert_images(X, self->model, &xa, &is_u8) < 0) goto done;
    n = PyArray_DIM(xa, 0);
  }
  if (Y != Py_None && convert_labels(Y, (npy_intp)n, &ya) < 0) goto done;
  const dp_layer *last = &m->layers[m->nlayers - 1];
  npy_intp dims[4] = {(npy_intp)n, last->out_c, last->out_h, last->out_w};
  if (output && !(out = stage_output(self, to_tensor, dims, &w.out))) goto done;
  w.model = self->model;
  w.training = training;
  w.batch = (dp_batch){is_tensor ? (const void *)x_dev : PyArray_DATA(xa), is_u8,
                       ya ? (const int64_t *)PyArray_DATA(ya) : NULL, n, NULL, NULL};
  if (model_run_without_gil(self, stage_forward_run, &w) < 0) goto done;
  ret = Py_BuildValue("(OdL)", out ? out : Py_None, w.loss, (long long)w.correct);
done:
  Py_XDECREF(xa);
  Py_XDECREF(ya);
  Py_XDECREF(out);
  return ret;
}

/* stage_backward(slot, n, dy=None, input_grad=False, accumulate=False, to_tensor=False)
 *   -> the input's gradient (N, C, H, W) float32 (a Tensor on this model's device: to_tensor), or None
 * dy: NumPy, or a Tensor (the next stage's dx on any device this one can copy from). */
static PyObject *Model_stage_backward(ModelObject *self, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"slot", "n", "dy", "input_grad", "accumulate", "to_tensor", NULL};
  PyObject *slot_obj, *n_obj, *dy_obj = Py_None;
  int want_dx = 0, accumulate = 0, to_tensor = 0;
  stage_work w = {0};
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|Oppp", kwlist, &slot_obj, &n_obj, &dy_obj, &want_dx, &accumulate,
                                   &to_tensor))
    return NULL;
  if (int_arg(slot_obj, "stage_backward", "slot", 0, DP_MAX_SLOTS - 1, &w.slot) < 0) return NULL;
  int n = 0;
  if (int_arg(n_obj, "stage_backward", "n", 1, DP_MAX_BATCH, &n) < 0) return NULL;
  if (!model_ready(self)) return NULL;
  PyArrayObject *dy = NULL;
  PyObject *dx = NULL, *ret = NULL;
  const float *dy_dev = NULL;
  int64_t dy_n = 0;
  int is_tensor = 0;
  if (dy_obj != Py_None) {
    is_tensor = stage_tensor_arg(self, dy_obj, "stage_backward: dy", layer_output_size(self->model), n, &dy_dev,
                                 &dy_n);
    if (is_tensor < 0) return NULL;
  }
  if (dy_obj != Py_None && !is_tensor) {
    if (!(dy = (PyArrayObject *)PyArray_FROM_OTF(dy_obj, NPY_FLOAT32, NPY_ARRAY_IN_ARRAY | NPY_ARRAY_NOTSWAPPED)))
      goto done;
    if ((int64_t)PyArray_SIZE(dy) != (int64_t)n * layer_output_size(self->model)) {
      PyErr_Format(PyExc_ValueError, "stage_backward: dy must hold %lld values (%d samples of %lld), got %lld",
                   (long long)n * layer_output_size(self->model), n, (long long)layer_output_size(self->model),
                   (long long)PyArray_SIZE(dy));
      goto done;
    }
  }
  const dp_model *m = self->model;
  npy_intp dims[4] = {n, m->in_c, m->in_h, m->in_w};
  if (want_dx && !(dx = stage_output(self, to_tensor, dims, &w.dx))) goto done;
  w.model = self->model;
  w.n = n;
  w.dy = is_tensor ? dy_dev : dy ? (const float *)PyArray_DATA(dy) : NULL;
  w.accumulate = accumulate;
  if (model_run_without_gil(self, stage_backward_run, &w) < 0) goto done;
  ret = Py_NewRef(dx ? dx : Py_None);
done:
  Py_XDECREF(dy);
  Py_XDECREF(dx);
  return ret;
}

static PyObject *Model_get_activation_bytes(ModelObject *self, void *c) {
  return PyLong_FromLongLong(self->model ? dp_model_activation_bytes(self->model) : 0);
}

/* memory_stats() -> dict of the device arena's statistics (CUDA), None on a CPU device */
static PyObject *Model_memory_stats(ModelObject *self, PyObject *unused) {
  if (!model_ready(self)) return NULL;
  if (self->model->dev->kind != DP_DEVICE_CUDA) Py_RETURN_NONE;
  dp_arena_stats s;
  dp_status st = dp_cuda_memory_stats(self->model->dev, &s);
  if (st != DP_OK) return raise_from_status(st);
  char last_failed_free[64];
  const unsigned long long failed_frees = dp_cuda_failed_frees(last_failed_free, sizeof last_failed_free);
  return Py_BuildValue("{s:n,s:n,s:n,s:n,s:n,s:K,s:s}", "reserved_bytes", (Py_ssize_t)s.reserved_bytes,
                       "in_use_bytes", (Py_ssize_t)s.in_use_bytes, "peak_in_use_bytes",
                       (Py_ssize_t)s.peak_in_use_bytes, "chunks", (Py_ssize_t)s.chunks, "blocks",
                       (Py_ssize_t)s.blocks, "failed_frees", failed_frees, "last_failed_free", last_failed_free);
}

static PyObject *Model_get_nparams(ModelObject *self, void *c) {
  return self->model ? PyLong_FromLongLong(self->model->nparams) : PyLong_FromLong(0);
}
static PyObject *Model_get_num_classes(ModelObject *self, void *c) {
  return self->model ? PyLong_FromLong(dp_model_num_classes(self->model)) : PyLong_FromLong(0);
}
static PyObject *Model_get_fused_layers(ModelObject *self, void *c) {
  PyObject *out = PyList_New(0);
  for (int i = 0; out && self->model && i < self->model->nlayers; ++i) {
    if (!self->model->layers[i].fused) continue;
    PyObject *pair = Py_BuildValue("(ii)", i, i + 1);
    if (!pair || PyList_Append(out, pair) < 0) Py_CLEAR(out);
    Py_XDECREF(pair);
  }
  return out;
}
static PyObject *Model_get_threads(ModelObject *self, void *c) {
  return PyLong_FromLong(self->device ? self->device->nthreads : 0);
}
static PyObject *Model_get_device(ModelObject *self, void *c) {
  if (!self->device) Py_RETURN_NONE;
  return PyUnicode_FromString(self->device->name);
}
static PyObject *Model_get_input_shape(ModelObject *self, void *c) {
  if (!self->model) Py_RETURN_NONE;
  return Py_BuildValue("(iii)", self->model->in_c, self->model->in_h, self->model->in_w);
}

static PyMethodDef Model_methods[] = {
    {"memory_stats", (PyCFunction)Model_memory_stats, METH_NOARGS,
     "the device arena's statistics (reserved_bytes, in_use_bytes, peak_in_use_bytes, chunks, blocks) and the "
     "process's CUDA frees that failed (failed_frees, last_failed_free: the CUDA error); None on a CPU device"},
    {"train_step_rows", (PyCFunction)(void (*)(void))Model_train_step_rows, METH_VARARGS | METH_KEYWORDS,
     "train_step_rows(resident, rows, lr, momentum=0, weight_decay=0) -> (loss_sum, correct): a step on rows of "
     "a Resident dataset"},
    {"stage_forward", (PyCFunction)(void (*)(void))Model_stage_forward, METH_VARARGS | METH_KEYWORDS,
     "stage_forward(slot, images, labels=None, training=True, grad_scale=0.0, output=True) -> (output, loss_sum, "
     "correct): a pipeline stage's forward pass in activation set slot"},
    {"stage_backward", (PyCFunction)(void (*)(void))Model_stage_backward, METH_VARARGS | METH_KEYWORDS,
     "stage_backward(slot, n, dy=None, input_grad=False, accumulate=False) -> input gradient or None"},
    {"grads_tensor", (PyCFunction)Model_grads_tensor, METH_NOARGS, "the flat gradient buffer as a Tensor (a view)"},
    {"params_tensor", (PyCFunction)Model_params_tensor, METH_NOARGS, "the flat parameter buffer as a Tensor (a view)"},
    {"param_layout", (PyCFunction)Model_param_layout, METH_NOARGS,
     "[(layer_index, 'weight'|'bias', offset, shape)] into the flat parameter buffer"},
    {"layers", (PyCFunction)Model_layers, METH_NOARGS, "[(kind, input_shape, output_shape)]"},
    {"state_layout", (PyCFunction)Model_state_layout, METH_NOARGS,
     "[(layer_index, 'running_mean'|'running_var', offset, shape)] into the flat state buffer"},
    {"get_state", (PyCFunction)Model_get_state, METH_NOARGS, "a copy of the BatchNorm running statistics"},
    {"set_state", (PyCFunction)Model_set_state, METH_O, "replace the BatchNorm running statistics"},
    {"get_params", (PyCFunction)Model_get_params, METH_NOARGS, "a copy of the flat parameter buffer"},
    {"get_grads", (PyCFunction)Model_get_grads, METH_NOARGS, "a copy of the flat gradient buffer"},
    {"set_params", (PyCFunction)Model_set_params, METH_O, "replace the flat parameter buffer"},
    {"reset_velocity", (PyCFunction)Model_reset_velocity, METH_NOARGS, "zero the SGD momentum buffer"},
    {"zero_grads", (PyCFunction)Model_zero_grads, METH_NOARGS, "zero the flat gradient buffer"},
    {"get_velocity", (PyCFunction)Model_get_velocity, METH_NOARGS,
     "a copy of the SGD momentum buffer (the flat parameters' layout)"},
    {"set_velocity", (PyCFunction)Model_set_velocity, METH_O, "replace the SGD momentum buffer"},
    {"set_profiling", (PyCFunction)Model_set_profiling, METH_O, "record this replica's step timeline (True) or stop"},
    {"take_trace", (PyCFunction)Model_take_trace, METH_NOARGS,
     "take_trace() -> (int64 array (n, 6): phase, bucket, bytes, step, t0_ns, t1_ns; events dropped)"},
    {"train_step", (PyCFunction)(void (*)(void))Model_train_step, METH_VARARGS | METH_KEYWORDS,
     "train_step(images, labels, lr, momentum=0, weight_decay=0) -> (loss_sum, correct)"},
    {"find_nonfinite", (PyCFunction)(void (*)(void))Model_find_nonfinite, METH_VARARGS | METH_KEYWORDS,
     "find_nonfinite(images, labels) -> (layer, what): where a training pass of the batch stops being finite "
     "(layer -1: nowhere, -2: the loss; what 0 output, 1 output gradient, 2 parameter gradients); "
     "the parameters, momentum and running statistics are kept"},
    {"forward_backward", (PyCFunction)(void (*)(void))Model_forward_backward, METH_VARARGS | METH_KEYWORDS,
     "forward_backward(images, labels, grad_scale) -> (loss_sum, correct); gradients stay in the model"},
    {"sgd_step", (PyCFunction)(void (*)(void))Model_sgd_step, METH_VARARGS | METH_KEYWORDS,
     "sgd_step(lr, momentum=0, weight_decay=0)"},
    {"evaluate", (PyCFunction)(void (*)(void))Model_evaluate, METH_VARARGS | METH_KEYWORDS,
     "evaluate(images, labels) -> (loss_sum, correct)"},
    {"predict", (PyCFunction)Model_predict, METH_O, "predict(images) -> logits (N, classes) float32"},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef Model_getset[] = {
    {"nparams", (getter)Model_get_nparams, NULL, "length of the flat parameter buffer", NULL},
    {"activation_bytes", (getter)Model_get_activation_bytes, NULL,
     "device bytes of every activation set allocated (a pipeline stage keeps one per micro-batch in flight)", NULL},
    {"num_classes", (getter)Model_get_num_classes, NULL, "width of the logits", NULL},
    {"threads", (getter)Model_get_threads, NULL, "cores the model's device uses", NULL},
    {"fused_layers", (getter)Model_get_fused_layers, NULL,
     "[(relu, avgpool)]: the layer pairs run as one op (DPCORE_FUSE=0 when the model was built: none)", NULL},
    {"device", (getter)Model_get_device, NULL, "device name", NULL},
    {"input_shape", (getter)Model_get_input_shape, NULL, "(C, H, W)", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

PyTypeObject ModelType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "dpcore._core.Model",
    .tp_basicsize = sizeof(ModelObject),
    .tp_dealloc = (destructor)Model_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A network on one device (shared through the device registry) with flat parameter and gradient "
              "buffers.",
    .tp_methods = Model_methods,
    .tp_getset = Model_getset,
    .tp_init = (initproc)Model_init,
    .tp_new = PyType_GenericNew,
};

/* ---- Resident: a dataset copied once to a model's device ----------------------- */

typedef struct {
  PyObject_HEAD
  PyObject *owner; /* the ModelObject whose device holds the data (kept alive); set first by __init__ */
  dp_resident *data;
  PyObject *dataset; /* the token its copies on the other replicas share (make_resident's), or NULL: its own */
} ResidentObject;

static void resident_destroy_in_dealloc(void *data) { dp_resident_destroy(data); }

static void Resident_dealloc(ResidentObject *self) {
  /* the owner model holds the device reference */
  if (self->data)
    device_free_in_dealloc(self->data->dev, resident_destroy_in_dealloc, self->data, 0, "a Resident dataset");
  Py_XDECREF(self->owner);
  Py_XDECREF(self->dataset);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

typedef struct {
  const dp_model *model;
  const void *x;
  int x_is_u8;
  const int64_t *y;
  int64_t n;
  dp_resident *out;
} resident_work;

static dp_status resident_run(void *p) {
  resident_work *w = p;
  const dp_model *m = w->model;
  return dp_resident_create(m->dev, w->x, w->x_is_u8, w->y, w->n, (int64_t)m->in_c * m->in_h * m->in_w,
                            dp_model_num_classes(m), &w->out);
}

/* Resident(model, images, labels, dataset=None): images (N, C, H, W) uint8 or
 * float32 as the model takes them, labels (N,) int64 in [0, num_classes);
 * dataset: any object, the same for the copies of one dataset on the replicas
 * of a Mirrored (resident_dataset). */
static int Resident_init(ResidentObject *self, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"model", "images", "labels", "dataset", NULL};
  PyObject *model, *X, *Y, *dataset = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!OO|O", kwlist, &ModelType, &model, &X, &Y, &dataset)) return -1;
  /* owner is set before the copy runs without the GIL, so that a second
   * __init__ meanwhile is refused too */
  if (self->data || self->owner) {
    PyErr_SetString(PyExc_RuntimeError, "Resident is already initialized");
    return -1;
  }
  ModelObject *mo = (ModelObject *)model;
  if (!model_ready(mo)) return -1;
  PyArrayObject *xa = NULL, *ya = NULL;
  int is_u8 = 0, rc = -1;
  if (convert_images(X, mo->model, &xa, &is_u8) < 0) goto done;
  if (convert_labels(Y, PyArray_DIM(xa, 0), &ya) < 0) goto done;
  resident_work w = {mo->model, PyArray_DATA(xa), is_u8, (const int64_t *)PyArray_DATA(ya),
                     (int64_t)PyArray_DIM(xa, 0), NULL};
  self->owner = Py_NewRef(model);
  if (model_run_without_gil(mo, resident_run, &w) < 0) {
    Py_CLEAR(self->owner);
    goto done;
  }
  self->data = w.out;
  if (dataset != Py_None) self->dataset = Py_NewRef(dataset);
  rc = 0;
done:
  Py_XDECREF(xa);
  Py_XDECREF(ya);
  return rc;
}

static PyObject *Resident_get_len(ResidentObject *self, void *c) {
  return self->data ? PyLong_FromLongLong((long long)self->data->count) : PyLong_FromLong(0);
}
static PyObject *Resident_get_nbytes(ResidentObject *self, void *c) {
  return PyLong_FromSize_t(self->data ? dp_resident_bytes(self->data) : 0);
}
static PyObject *Resident_get_device(ResidentObject *self, void *c) {
  if (!self->data) Py_RETURN_NONE;
  return PyUnicode_FromString(self->data->dev->name);
}

static PyGetSetDef Resident_getset[] = {
    {"num_samples", (getter)Resident_get_len, NULL, "samples held", NULL},
    {"nbytes", (getter)Resident_get_nbytes, NULL, "device bytes held (images and labels)", NULL},
    {"device", (getter)Resident_get_device, NULL, "the device holding the data", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

PyTypeObject ResidentType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "dpcore._core.Resident",
    .tp_basicsize = sizeof(ResidentObject),
    .tp_dealloc = (destructor)Resident_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Resident(model, images, labels): a dataset copied once to the model's device; train_step_rows "
              "then moves only the indices of each batch",
    .tp_getset = Resident_getset,
    .tp_init = (initproc)Resident_init,
    .tp_new = PyType_GenericNew,
};

const void *resident_dataset(PyObject *obj) {
  const ResidentObject *r = (const ResidentObject *)obj;
  return r->dataset ? (const void *)r->dataset : (const void *)r;
}

dp_resident *resident_of(PyObject *obj, const ModelObject *mo) {
  if (!PyObject_TypeCheck(obj, &ResidentType) || !((ResidentObject *)obj)->data) {
    PyErr_Format(PyExc_TypeError, "expected an initialized dpcore Resident, got %s", Py_TYPE(obj)->tp_name);
    return NULL;
  }
  ResidentObject *r = (ResidentObject *)obj;
  if (r->data->dev != mo->model->dev) {
    PyErr_Format(PyExc_ValueError, "the resident dataset is on %s, the model replica on %s", r->data->dev->name,
                 mo->model->dev->name);
    return NULL;
  }
  return r->data;
}
