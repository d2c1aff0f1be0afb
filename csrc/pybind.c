/* pybind.c — the CPython binding of the dpcore core (module dpcore._core).
 *
 * The one place where dp_status values become Python exceptions
 * (raise_from_status). NumPy inputs go through converters that require the
 * exact dtype, C order, alignment and native byte order; the Python layer
 * (python/dpcore) does the friendly conversions before calling in here.
 * The GIL is released around pure C work only; every wrapper cleans up at
 * its `done:` label.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <numpy/arrayobject.h>
#include <cblas.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "dp_build_config.h"
#include "mirrored.h"
#include "model.h"
#ifdef DP_HAVE_CUDA
#include "dp_cuda.h"
#endif

/* OpenBLAS extension: the build's configuration string. */
extern char *openblas_get_config(void);

static PyObject *DpcoreError;  /* dpcore.errors.DpcoreError */
static PyObject *DeviceError;  /* dpcore.errors.DeviceError */

/* ---- errors: the one place ------------------------------------------------ */

static PyObject *raise_from_status(dp_status s) {
  const char *msg = dp_error_message();
  if (!msg || !msg[0]) msg = dp_status_name(s);
  PyObject *type;
  switch (s) {
    case DP_ERR_VALUE: type = PyExc_ValueError; break;
    case DP_ERR_TYPE: type = PyExc_TypeError; break;
    case DP_ERR_MEMORY: type = PyExc_MemoryError; break;
    case DP_ERR_IO: type = PyExc_OSError; break;
    case DP_ERR_CUDA: type = DeviceError; break;
    case DP_ERR_INTERRUPTED: type = PyExc_KeyboardInterrupt; break;
    default: type = DpcoreError; break;
  }
  PyErr_SetString(type, msg);
  dp_error_clear();
  return NULL;
}

/* ---- array converters ----------------------------------------------------- */

static const char *dtype_name(PyArrayObject *a) { return PyArray_DESCR(a)->typeobj->tp_name; }

/* A C-contiguous, aligned, native float32 array of the given rank (rank < 0: any).
 * Returns a new reference or NULL with TypeError/ValueError set. */
static PyArrayObject *as_float32(PyObject *obj, int rank, const char *what) {
  if (!PyArray_Check(obj)) {
    PyErr_Format(PyExc_TypeError, "%s must be a numpy.ndarray, got %s", what, Py_TYPE(obj)->tp_name);
    return NULL;
  }
  PyArrayObject *a = (PyArrayObject *)obj;
  if (PyArray_TYPE(a) != NPY_FLOAT32) {
    PyErr_Format(PyExc_TypeError, "%s must be float32, got %s", what, dtype_name(a));
    return NULL;
  }
  if (rank >= 0 && PyArray_NDIM(a) != rank) {
    PyErr_Format(PyExc_ValueError, "%s must have %d dimensions, got %d", what, rank, PyArray_NDIM(a));
    return NULL;
  }
  return (PyArrayObject *)PyArray_FROM_OTF(obj, NPY_FLOAT32, NPY_ARRAY_IN_ARRAY | NPY_ARRAY_NOTSWAPPED);
}

static PyArrayObject *new_float32(int rank, const npy_intp *dims) {
  return (PyArrayObject *)PyArray_ZEROS(rank, (npy_intp *)dims, NPY_FLOAT32, 0);
}

/* Images for a model: (N, C, H, W) uint8 or float32 matching the model input. */
static int convert_images(PyObject *obj, const dp_model *m, PyArrayObject **out, int *is_u8) {
  *out = NULL;
  if (!PyArray_Check(obj)) {
    PyErr_Format(PyExc_TypeError, "images must be a numpy.ndarray, got %s", Py_TYPE(obj)->tp_name);
    return -1;
  }
  PyArrayObject *a = (PyArrayObject *)obj;
  int t = PyArray_TYPE(a);
  if (t != NPY_UINT8 && t != NPY_FLOAT32) {
    PyErr_Format(PyExc_TypeError, "images must be uint8 or float32, got %s", dtype_name(a));
    return -1;
  }
  const npy_intp *d = PyArray_DIMS(a);
  if (PyArray_NDIM(a) != 4 || d[1] != m->in_c || d[2] != m->in_h || d[3] != m->in_w) {
    char got[128] = "(";
    for (int i = 0; i < PyArray_NDIM(a); ++i)
      snprintf(got + strlen(got), sizeof got - strlen(got), "%s%ld", i ? ", " : "", (long)d[i]);
    snprintf(got + strlen(got), sizeof got - strlen(got), ")");
    PyErr_Format(PyExc_ValueError, "images must have shape (N, %d, %d, %d), got %s", m->in_c, m->in_h, m->in_w, got);
    return -1;
  }
  *out = (PyArrayObject *)PyArray_FROM_OTF(obj, t, NPY_ARRAY_IN_ARRAY | NPY_ARRAY_NOTSWAPPED);
  *is_u8 = t == NPY_UINT8;
  return *out ? 0 : -1;
}

static int convert_labels(PyObject *obj, npy_intp n, PyArrayObject **out) {
  *out = NULL;
  if (!PyArray_Check(obj)) {
    PyErr_Format(PyExc_TypeError, "labels must be a numpy.ndarray, got %s", Py_TYPE(obj)->tp_name);
    return -1;
  }
  PyArrayObject *a = (PyArrayObject *)obj;
  if (PyArray_TYPE(a) != NPY_INT64) {
    PyErr_Format(PyExc_TypeError, "labels must be int64, got %s", dtype_name(a));
    return -1;
  }
  if (PyArray_NDIM(a) != 1 || PyArray_DIM(a, 0) != n) {
    PyErr_Format(PyExc_ValueError, "labels must have shape (%ld,) to match the images, got %d dimensions of length %ld",
                 (long)n, PyArray_NDIM(a), PyArray_NDIM(a) ? (long)PyArray_DIM(a, 0) : 0L);
    return -1;
  }
  *out = (PyArrayObject *)PyArray_FROM_OTF(obj, NPY_INT64, NPY_ARRAY_IN_ARRAY | NPY_ARRAY_NOTSWAPPED);
  return *out ? 0 : -1;
}

/* ---- Tensor: a buffer on a device ----------------------------------------- */

typedef struct {
  PyObject_HEAD
  char device[32];
  int dtype; /* NPY_FLOAT32, NPY_INT64 or NPY_UINT8 (images) */
  int ndim;
  npy_intp shape[NPY_MAXDIMS];
  void *data;
  PyObject *owner; /* NULL: the tensor owns data; else the object whose memory it views */
} TensorObject;

static PyTypeObject TensorType;

static void Tensor_dealloc(TensorObject *self) {
  if (self->owner)
    Py_DECREF(self->owner);
  else
    free(self->data);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

static npy_intp tensor_size(const TensorObject *t) {
  npy_intp n = 1;
  for (int i = 0; i < t->ndim; ++i) n *= t->shape[i];
  return n;
}

static size_t tensor_itemsize(const TensorObject *t) {
  return t->dtype == NPY_INT64 ? 8 : t->dtype == NPY_UINT8 ? 1 : 4;
}

static TensorObject *tensor_alloc(const char *device, int dtype, int ndim, const npy_intp *shape) {
  TensorObject *t = (TensorObject *)TensorType.tp_alloc(&TensorType, 0);
  if (!t) return NULL;
  snprintf(t->device, sizeof t->device, "%s", device);
  t->dtype = dtype;
  t->ndim = ndim;
  for (int i = 0; i < ndim; ++i) t->shape[i] = shape[i];
  size_t bytes = ((size_t)tensor_size(t) * tensor_itemsize(t) + 63) & ~(size_t)63;
  t->data = aligned_alloc(64, bytes ? bytes : 64);
  if (!t->data) {
    Py_DECREF(t);
    return (TensorObject *)PyErr_NoMemory();
  }
  return t;
}

/* Tensor(array, device): a copy of a float32 or int64 array on a device. */
static PyObject *Tensor_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"array", "device", NULL};
  PyObject *obj;
  const char *device;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "Os", kwlist, &obj, &device)) return NULL;
  int elem = PyArray_Check(obj) ? PyArray_TYPE((PyArrayObject *)obj) : -1;
  if (elem != NPY_FLOAT32 && elem != NPY_INT64 && elem != NPY_UINT8) {
    PyErr_SetString(PyExc_TypeError, "Tensor needs a float32, int64 or uint8 numpy array");
    return NULL;
  }
  PyArrayObject *a = (PyArrayObject *)PyArray_FROM_OTF(obj, PyArray_TYPE((PyArrayObject *)obj),
                                                       NPY_ARRAY_IN_ARRAY | NPY_ARRAY_NOTSWAPPED);
  if (!a) return NULL;
  TensorObject *t = tensor_alloc(device, PyArray_TYPE(a), PyArray_NDIM(a), PyArray_DIMS(a));
  if (t) memcpy(t->data, PyArray_DATA(a), (size_t)PyArray_NBYTES(a));
  Py_DECREF(a);
  return (PyObject *)t;
}

/* A NumPy array sharing the tensor's memory (CPU devices). */
static PyObject *Tensor_view(TensorObject *self, PyObject *unused) {
  PyObject *arr = PyArray_New(&PyArray_Type, self->ndim, self->shape, self->dtype, NULL, self->data, 0,
                              NPY_ARRAY_CARRAY, NULL);
  if (!arr) return NULL;
  if (PyArray_SetBaseObject((PyArrayObject *)arr, Py_NewRef(self)) < 0) {
    Py_DECREF(arr);
    return NULL;
  }
  return arr;
}

static PyObject *Tensor_numpy(TensorObject *self, PyObject *unused) {
  PyObject *view = Tensor_view(self, NULL);
  if (!view) return NULL;
  PyObject *copy = PyArray_NewCopy((PyArrayObject *)view, NPY_CORDER);
  Py_DECREF(view);
  return copy;
}

static PyObject *Tensor_get_device(TensorObject *self, void *c) { return PyUnicode_FromString(self->device); }
static PyObject *Tensor_get_shape(TensorObject *self, void *c) {
  PyObject *t = PyTuple_New(self->ndim);
  if (!t) return NULL;
  for (int i = 0; i < self->ndim; ++i) {
    PyObject *v = PyLong_FromSsize_t(self->shape[i]);
    if (!v) {
      Py_DECREF(t);
      return NULL;
    }
    PyTuple_SET_ITEM(t, i, v);
  }
  return t;
}
static PyObject *Tensor_get_dtype(TensorObject *self, void *c) {
  return PyUnicode_FromString(self->dtype == NPY_INT64 ? "int64" : self->dtype == NPY_UINT8 ? "uint8" : "float32");
}

/* tensor([[3. 3.]], device='cpu:0') */
static PyObject *Tensor_repr(TensorObject *self) {
  PyObject *view = Tensor_view(self, NULL);
  if (!view) return NULL;
  PyObject *body = PyObject_Str(view);
  Py_DECREF(view);
  if (!body) return NULL;
  PyObject *out = PyUnicode_FromFormat("tensor(%U, device='%s')", body, self->device);
  Py_DECREF(body);
  return out;
}

static PyMethodDef Tensor_methods[] = {
    {"numpy", (PyCFunction)Tensor_numpy, METH_NOARGS, "a NumPy copy of the tensor"},
    {"_view", (PyCFunction)Tensor_view, METH_NOARGS, "a NumPy array sharing the tensor's memory (CPU only)"},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef Tensor_getset[] = {{"device", (getter)Tensor_get_device, NULL, "device name", NULL},
                                      {"shape", (getter)Tensor_get_shape, NULL, "shape", NULL},
                                      {"dtype", (getter)Tensor_get_dtype, NULL, "'float32' or 'int64'", NULL},
                                      {NULL, NULL, NULL, NULL, NULL}};

static PyTypeObject TensorType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "dpcore._core.Tensor",
    .tp_basicsize = sizeof(TensorObject),
    .tp_dealloc = (destructor)Tensor_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "Tensor(array, device): float32, int64 or uint8 data on a device",
    .tp_repr = (reprfunc)Tensor_repr,
    .tp_methods = Tensor_methods,
    .tp_getset = Tensor_getset,
    .tp_new = Tensor_new,
};

/* all_reduce(tensors, op): in place; op 0 = sum, 1 = mean. */
static PyObject *mod_all_reduce(PyObject *mod, PyObject *args) {
  PyObject *seq_obj;
  int op;
  if (!PyArg_ParseTuple(args, "Oi", &seq_obj, &op)) return NULL;
  PyObject *seq = PySequence_Fast(seq_obj, "all_reduce needs a list of tensors");
  if (!seq) return NULL;
  Py_ssize_t k = PySequence_Fast_GET_SIZE(seq);
  float **bufs = NULL;
  PyObject *ret = NULL;
  if (k < 1) {
    PyErr_SetString(PyExc_ValueError, "all_reduce needs at least one tensor");
    goto done;
  }
  bufs = malloc(sizeof(float *) * (size_t)k);
  if (!bufs) {
    PyErr_NoMemory();
    goto done;
  }
  TensorObject *first = NULL;
  for (Py_ssize_t i = 0; i < k; ++i) {
    PyObject *o = PySequence_Fast_GET_ITEM(seq, i);
    if (!PyObject_TypeCheck(o, &TensorType)) {
      PyErr_Format(PyExc_TypeError, "all_reduce: item %zd is %s, not a dpcore tensor", i, Py_TYPE(o)->tp_name);
      goto done;
    }
    TensorObject *t = (TensorObject *)o;
    if (t->dtype != NPY_FLOAT32) {
      PyErr_Format(PyExc_TypeError, "all_reduce: tensor %zd is %s; only float32 tensors are reduced", i,
                   t->dtype == NPY_INT64 ? "int64" : "uint8");
      goto done;
    }
    if (!first) first = t;
    if (t->ndim != first->ndim || memcmp(t->shape, first->shape, sizeof(npy_intp) * (size_t)t->ndim) != 0) {
      PyErr_Format(PyExc_ValueError, "all_reduce: tensor %zd has a different shape than tensor 0", i);
      goto done;
    }
    for (Py_ssize_t j = 0; j < i; ++j)
      if (strcmp(((TensorObject *)PySequence_Fast_GET_ITEM(seq, j))->device, t->device) == 0) {
        PyErr_Format(PyExc_ValueError, "all_reduce: tensors %zd and %zd are both on %s; give one tensor per device",
                     j, i, t->device);
        goto done;
      }
    bufs[i] = t->data;
  }
  dp_status st;
  npy_intp n = tensor_size(first);
  Py_BEGIN_ALLOW_THREADS
  st = dp_allreduce_buffers(bufs, (int)k, n, op == 1 ? DP_REDUCE_MEAN : DP_REDUCE_SUM);
  Py_END_ALLOW_THREADS
  if (st != DP_OK) {
    raise_from_status(st);
    goto done;
  }
  ret = Py_NewRef(Py_None);
done:
  free(bufs);
  Py_DECREF(seq);
  return ret;
}

/* allreduce_benchmark(k, n, iters) -> seconds for iters all-reduces of n floats */
static PyObject *mod_allreduce_benchmark(PyObject *mod, PyObject *args) {
  int k, iters;
  long long n;
  if (!PyArg_ParseTuple(args, "iLi", &k, &n, &iters)) return NULL;
  double seconds = 0.0;
  dp_status st;
  Py_BEGIN_ALLOW_THREADS
  st = dp_allreduce_benchmark(k, n, iters, &seconds);
  Py_END_ALLOW_THREADS
  if (st != DP_OK) return raise_from_status(st);
  return PyFloat_FromDouble(seconds);
}

/* cudnn_conv_output_dim(N, C, H, W, O, KH, KW, stride, pad) -> (n, c, h, w) as cuDNN infers it */
static PyObject *mod_cudnn_conv_output_dim(PyObject *mod, PyObject *args) {
  dp_conv_geom g = {0};
  int N;
  if (!PyArg_ParseTuple(args, "iiiiiiiii", &N, &g.C, &g.H, &g.W, &g.O, &g.KH, &g.KW, &g.stride, &g.pad)) return NULL;
  int out[4] = {0, 0, 0, 0};
  dp_status st = dp_cudnn_conv_output_dim(&g, N, out);
  if (st != DP_OK) return raise_from_status(st);
  return Py_BuildValue("(iiii)", out[0], out[1], out[2], out[3]);
}

/* shard_ranges(n, k) -> [(begin, end)]: the split the trainer uses. */
static PyObject *mod_shard_ranges(PyObject *mod, PyObject *args) {
  long long n;
  int k;
  if (!PyArg_ParseTuple(args, "Li", &n, &k)) return NULL;
  if (n < 0 || k < 1) {
    PyErr_SetString(PyExc_ValueError, "shard_ranges needs n >= 0 and k >= 1");
    return NULL;
  }
  PyObject *out = PyList_New(k);
  if (!out) return NULL;
  for (int r = 0; r < k; ++r) {
    int64_t b, e;
    dp_shard_range(n, k, r, &b, &e);
    PyObject *t = Py_BuildValue("(LL)", (long long)b, (long long)e);
    if (!t) {
      Py_DECREF(out);
      return NULL;
    }
    PyList_SET_ITEM(out, r, t);
  }
  return out;
}

/* ---- Model ----------------------------------------------------------------- */

typedef struct {
  PyObject_HEAD
  dp_device device;
  int device_ready;
  dp_model *model;
  int busy;  /* set while the GIL is released inside a call on this model */
} ModelObject;

static void Model_dealloc(ModelObject *self) {
  dp_model_destroy(self->model);
  if (self->device_ready) dp_device_destroy(&self->device);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

/* One layer spec: (kind, *args). Integers for every kind but batchnorm,
 * whose optional arguments are (eps, momentum) as floats. */
static int layer_from_tuple(dp_model *m, PyObject *spec, dp_status *st) {
  if (!PyTuple_Check(spec) || PyTuple_GET_SIZE(spec) < 1 || !PyUnicode_Check(PyTuple_GET_ITEM(spec, 0))) {
    PyErr_SetString(PyExc_TypeError, "each layer must be a tuple (name, *args)");
    return -1;
  }
  const char *name = PyUnicode_AsUTF8(PyTuple_GET_ITEM(spec, 0));
  if (!name) return -1;
  Py_ssize_t n = PyTuple_GET_SIZE(spec) - 1;
  if (strcmp(name, "batchnorm") == 0) {
    double eps = 1e-5, momentum = 0.1;
    if (n > 2) {
      PyErr_SetString(PyExc_ValueError, "layer batchnorm takes (eps, momentum) at most");
      return -1;
    }
    if (n >= 1 && (eps = PyFloat_AsDouble(PyTuple_GET_ITEM(spec, 1))) == -1.0 && PyErr_Occurred()) return -1;
    if (n >= 2 && (momentum = PyFloat_AsDouble(PyTuple_GET_ITEM(spec, 2))) == -1.0 && PyErr_Occurred()) return -1;
    *st = dp_model_add_batchnorm(m, (float)eps, (float)momentum);
    return 0;
  }
  int v[4] = {0, 0, 0, 0};
  if (n > 4) {
    PyErr_Format(PyExc_ValueError, "layer %s: too many arguments", name);
    return -1;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    long x = PyLong_AsLong(PyTuple_GET_ITEM(spec, i + 1));
    if (x == -1 && PyErr_Occurred()) return -1;
    if (x < -1 || x > (1L << 30)) {
      PyErr_Format(PyExc_ValueError, "layer %s: argument %ld out of range", name, x);
      return -1;
    }
    v[i] = (int)x;
  }
  struct { const char *name; int nargs; } table[] = {{"conv2d", 4}, {"dense", 1},   {"relu", 0},
                                                      {"avgpool", 3}, {"maxpool", 3}, {"flatten", 0},
                                                      {"add", 2},     {"global_avgpool", 0}};
  for (size_t i = 0; i < sizeof table / sizeof table[0]; ++i) {
    if (strcmp(name, table[i].name) != 0) continue;
    if (n != table[i].nargs) {
      PyErr_Format(PyExc_ValueError, "layer %s takes %d arguments, got %zd", name, table[i].nargs, n);
      return -1;
    }
    switch (i) {
      case 0: *st = dp_model_add_conv2d(m, v[0], v[1], v[2], v[3]); break;
      case 1: *st = dp_model_add_dense(m, v[0]); break;
      case 2: *st = dp_model_add_relu(m); break;
      case 3: *st = dp_model_add_avgpool(m, v[0], v[1], v[2]); break;
      case 4: *st = dp_model_add_maxpool(m, v[0], v[1], v[2]); break;
      case 5: *st = dp_model_add_flatten(m); break;
      case 6: *st = dp_model_add_add(m, v[0], v[1]); break;
      default: *st = dp_model_add_global_avgpool(m); break;
    }
    return 0;
  }
  PyErr_Format(PyExc_ValueError, "unknown layer kind '%s'", name);
  return -1;
}

/* Model(input_shape=(C, H, W), layers=[...], threads=0, device_index=0, sources=None,
 *       device_kind='cpu', gpu=0) — threads 0: every core. device_kind 'cuda'
 * puts the model on logical GPU cuda:device_index of physical GPU `gpu`. */
static int Model_init(ModelObject *self, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"input_shape", "layers", "threads", "device_index", "sources", "device_kind", "gpu", NULL};
  int c, h, w, threads = 0, index = 0, gpu = 0;
  const char *kind = "cpu";
  PyObject *layers, *sources = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "(iii)O|iiOsi", kwlist, &c, &h, &w, &layers, &threads, &index,
                                   &sources, &kind, &gpu))
    return -1;
  if (self->model) {
    PyErr_SetString(PyExc_RuntimeError, "Model is already initialized");
    return -1;
  }
  if (threads < 0) {
    PyErr_Format(PyExc_ValueError, "threads must be >= 0, got %d", threads);
    return -1;
  }
  dp_status st;
  if (strcmp(kind, "cpu") == 0) {
    if (threads == 0) threads = dp_cpu_core_count();
    st = dp_cpu_device_init(&self->device, index, threads);
  } else if (strcmp(kind, "cuda") == 0) {
    Py_BEGIN_ALLOW_THREADS /* creating a CUDA context takes a while */
    st = dp_cuda_device_init(&self->device, index, gpu);
    Py_END_ALLOW_THREADS
  } else {
    PyErr_Format(PyExc_ValueError, "device_kind must be 'cpu' or 'cuda', got '%s'", kind);
    return -1;
  }
  if (st != DP_OK) return raise_from_status(st), -1;
  self->device_ready = 1;
  st = dp_model_create(&self->device, c, h, w, &self->model);
  if (st != DP_OK) return raise_from_status(st), -1;
  PyObject *seq = PySequence_Fast(layers, "layers must be a sequence of tuples");
  if (!seq) return -1;
  PyObject *srcs = sources == Py_None ? NULL : PySequence_Fast(sources, "sources must be a sequence of ints");
  if (sources != Py_None && !srcs) {
    Py_DECREF(seq);
    return -1;
  }
  if (srcs && PySequence_Fast_GET_SIZE(srcs) != PySequence_Fast_GET_SIZE(seq)) {
    PyErr_SetString(PyExc_ValueError, "sources must have one entry per layer");
    Py_DECREF(srcs);
    Py_DECREF(seq);
    return -1;
  }
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); ++i) {
    st = DP_OK;
    if (srcs) {
      /* the layer's input: an earlier layer, -1 for the model input, None for the previous layer */
      PyObject *src = PySequence_Fast_GET_ITEM(srcs, i);
      if (src != Py_None) {
        long v = PyLong_AsLong(src);
        if (v == -1 && PyErr_Occurred()) break;
        st = dp_model_set_source(self->model, (int)v);
        if (st != DP_OK) break;
      }
    }
    if (layer_from_tuple(self->model, PySequence_Fast_GET_ITEM(seq, i), &st) < 0) {
      Py_XDECREF(srcs);
      Py_DECREF(seq);
      return -1;
    }
    if (st != DP_OK) break;
  }
  Py_XDECREF(srcs);
  Py_DECREF(seq);
  if (PyErr_Occurred()) return -1;
  if (st != DP_OK) return raise_from_status(st), -1;
  st = dp_model_finalize(self->model);
  if (st != DP_OK) return raise_from_status(st), -1;
  return 0;
}

static int model_ready(ModelObject *self) {
  if (!self->model || !self->model->finalized) {
    PyErr_SetString(PyExc_RuntimeError, "Model is not initialized");
    return 0;
  }
  if (self->busy) {
    PyErr_SetString(PyExc_RuntimeError, "this model is in use by another thread");
    return 0;
  }
  return 1;
}

static PyObject *Model_param_layout(ModelObject *self, PyObject *unused) {
  if (!model_ready(self)) return NULL;
  PyObject *out = PyList_New(0);
  if (!out) return NULL;
  const dp_model *m = self->model;
  for (int i = 0; i < m->nlayers; ++i) {
    const dp_layer *l = &m->layers[i];
    if (!l->w_len) continue;
    PyObject *wshape = l->kind == DP_LAYER_CONV2D      ? Py_BuildValue("(iiii)", l->out_c, l->in_c, l->k, l->k)
                       : l->kind == DP_LAYER_BATCHNORM ? Py_BuildValue("(i)", l->out_c)
                                                       : Py_BuildValue("(ii)", l->out_c, l->in_c);
    PyObject *w = wshape ? Py_BuildValue("(isLN)", i, "weight", (long long)l->w_off, wshape) : NULL;
    PyObject *b = w ? Py_BuildValue("(isL(i))", i, "bias", (long long)l->b_off, l->out_c) : NULL;
    if (!w || !b || PyList_Append(out, w) < 0 || PyList_Append(out, b) < 0) {
      Py_XDECREF(w);
      Py_XDECREF(b);
      Py_DECREF(out);
      return NULL;
    }
    Py_DECREF(w);
    Py_DECREF(b);
  }
  return out;
}

static PyObject *Model_state_layout(ModelObject *self, PyObject *unused) {
  if (!model_ready(self)) return NULL;
  PyObject *out = PyList_New(0);
  if (!out) return NULL;
  const dp_model *m = self->model;
  for (int i = 0; i < m->nlayers; ++i) {
    const dp_layer *l = &m->layers[i];
    if (l->kind != DP_LAYER_BATCHNORM) continue;
    PyObject *a = Py_BuildValue("(isL(i))", i, "running_mean", (long long)l->state_off, l->in_c);
    PyObject *b = a ? Py_BuildValue("(isL(i))", i, "running_var", (long long)(l->state_off + l->in_c), l->in_c) : NULL;
    if (!a || !b || PyList_Append(out, a) < 0 || PyList_Append(out, b) < 0) {
      Py_XDECREF(a);
      Py_XDECREF(b);
      Py_DECREF(out);
      return NULL;
    }
    Py_DECREF(a);
    Py_DECREF(b);
  }
  return out;
}

static PyObject *Model_get_state(ModelObject *self, PyObject *unused) {
  if (!model_ready(self)) return NULL;
  npy_intp n = (npy_intp)self->model->nstate;
  PyArrayObject *out = new_float32(1, &n);
  if (!out) return NULL;
  dp_status st = dp_model_get_state(self->model, (float *)PyArray_DATA(out));
  if (st != DP_OK) {
    Py_DECREF(out);
    return raise_from_status(st);
  }
  return (PyObject *)out;
}

static PyObject *Model_set_state(ModelObject *self, PyObject *arg) {
  if (!model_ready(self)) return NULL;
  PyArrayObject *a = as_float32(arg, 1, "state");
  if (!a) return NULL;
  PyObject *ret = NULL;
  if (PyArray_DIM(a, 0) != self->model->nstate) {
    PyErr_Format(PyExc_ValueError, "state must have %lld elements, got %ld", (long long)self->model->nstate,
                 (long)PyArray_DIM(a, 0));
  } else {
    dp_status st = dp_model_set_state(self->model, (const float *)PyArray_DATA(a));
    ret = st == DP_OK ? Py_NewRef(Py_None) : raise_from_status(st);
  }
  Py_DECREF(a);
  return ret;
}

static PyObject *Model_layers(ModelObject *self, PyObject *unused) {
  if (!model_ready(self)) return NULL;
  static const char *names[] = {"conv2d", "dense",     "relu", "avgpool",       "maxpool",
                                "flatten", "batchnorm", "add",  "global_avgpool"};
  const dp_model *m = self->model;
  PyObject *out = PyList_New(m->nlayers);
  if (!out) return NULL;
  for (int i = 0; i < m->nlayers; ++i) {
    const dp_layer *l = &m->layers[i];
    PyObject *t = Py_BuildValue("(s(iii)(iii))", names[l->kind], l->in_c, l->in_h, l->in_w, l->out_c, l->out_h,
                                l->out_w);
    if (!t) {
      Py_DECREF(out);
      return NULL;
    }
    PyList_SET_ITEM(out, i, t);
  }
  return out;
}

typedef dp_status (*flat_getter)(dp_model *, float *);

static PyObject *get_flat(ModelObject *self, flat_getter get) {
  if (!model_ready(self)) return NULL;
  npy_intp n = (npy_intp)self->model->nparams;
  PyArrayObject *out = new_float32(1, &n);
  if (!out) return NULL;
  dp_status st = get(self->model, (float *)PyArray_DATA(out));
  if (st != DP_OK) {
    Py_DECREF(out);
    return raise_from_status(st);
  }
  return (PyObject *)out;
}

static PyObject *Model_get_params(ModelObject *self, PyObject *unused) { return get_flat(self, dp_model_get_params); }
static PyObject *Model_get_grads(ModelObject *self, PyObject *unused) { return get_flat(self, dp_model_get_grads); }

static PyObject *Model_set_params(ModelObject *self, PyObject *arg) {
  if (!model_ready(self)) return NULL;
  PyArrayObject *a = as_float32(arg, 1, "params");
  if (!a) return NULL;
  PyObject *ret = NULL;
  if (PyArray_DIM(a, 0) != self->model->nparams) {
    PyErr_Format(PyExc_ValueError, "params must have %lld elements, got %ld", (long long)self->model->nparams,
                 (long)PyArray_DIM(a, 0));
    goto done;
  }
  dp_status st = dp_model_set_params(self->model, (const float *)PyArray_DATA(a));
  if (st != DP_OK) {
    raise_from_status(st);
    goto done;
  }
  ret = Py_NewRef(Py_None);
done:
  Py_DECREF(a);
  return ret;
}

static PyObject *Model_reset_velocity(ModelObject *self, PyObject *unused) {
  if (!model_ready(self)) return NULL;
  dp_status st = dp_model_reset_velocity(self->model);
  if (st != DP_OK) return raise_from_status(st);
  Py_RETURN_NONE;
}

enum batch_call { CALL_TRAIN_STEP, CALL_FORWARD_BACKWARD, CALL_EVALUATE };

/* The common body of train_step / forward_backward / evaluate: convert,
 * release the GIL, run, take the GIL back, report. */
static PyObject *run_batch(ModelObject *self, PyObject *X, PyObject *Y, enum batch_call call, float grad_scale,
                           float lr, float momentum, float wd) {
  if (!model_ready(self)) return NULL;
  PyArrayObject *xa = NULL, *ya = NULL;
  PyObject *ret = NULL;
  int is_u8 = 0;
  if (convert_images(X, self->model, &xa, &is_u8) < 0) goto done;
  if (convert_labels(Y, PyArray_DIM(xa, 0), &ya) < 0) goto done;
  dp_batch b = {PyArray_DATA(xa), is_u8, (const int64_t *)PyArray_DATA(ya), (int64_t)PyArray_DIM(xa, 0), NULL,
                NULL};
  double loss = 0.0;
  int64_t correct = 0;
  dp_status st = DP_OK;
  self->busy = 1;
  Py_BEGIN_ALLOW_THREADS
  if (call == CALL_EVALUATE) {
    st = dp_model_evaluate(self->model, &b, &loss, &correct);
  } else if (call == CALL_FORWARD_BACKWARD) {
    st = dp_model_forward_backward(self->model, &b, grad_scale, &loss, &correct);
  } else if (b.n > 0) {
    st = dp_model_load(self->model, &b, 1);
    if (st == DP_OK) st = dp_model_train_step_loaded(self->model, b.n, lr, momentum, wd, &loss, &correct);
  }
  Py_END_ALLOW_THREADS
  self->busy = 0;
  if (st != DP_OK) {
    raise_from_status(st);
    goto done;
  }
  ret = Py_BuildValue("(dL)", loss, (long long)correct);
done:
  Py_XDECREF(xa);
  Py_XDECREF(ya);
  return ret;
}

static PyObject *Model_train_step(ModelObject *self, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"images", "labels", "lr", "momentum", "weight_decay", NULL};
  PyObject *X, *Y;
  float lr, mu = 0.0f, wd = 0.0f;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOf|ff", kwlist, &X, &Y, &lr, &mu, &wd)) return NULL;
  return run_batch(self, X, Y, CALL_TRAIN_STEP, 0.0f, lr, mu, wd);
}

static PyObject *Model_forward_backward(ModelObject *self, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"images", "labels", "grad_scale", NULL};
  PyObject *X, *Y;
  float scale;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOf", kwlist, &X, &Y, &scale)) return NULL;
  return run_batch(self, X, Y, CALL_FORWARD_BACKWARD, scale, 0, 0, 0);
}

static PyObject *Model_evaluate(ModelObject *self, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"images", "labels", NULL};
  PyObject *X, *Y;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO", kwlist, &X, &Y)) return NULL;
  return run_batch(self, X, Y, CALL_EVALUATE, 0, 0, 0, 0);
}

static PyObject *Model_sgd_step(ModelObject *self, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"lr", "momentum", "weight_decay", NULL};
  float lr, mu = 0.0f, wd = 0.0f;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "f|ff", kwlist, &lr, &mu, &wd)) return NULL;
  if (!model_ready(self)) return NULL;
  dp_status st;
  Py_BEGIN_ALLOW_THREADS
  st = dp_model_sgd_step(self->model, lr, mu, wd);
  Py_END_ALLOW_THREADS
  if (st != DP_OK) return raise_from_status(st);
  Py_RETURN_NONE;
}

static PyObject *Model_predict(ModelObject *self, PyObject *X) {
  if (!model_ready(self)) return NULL;
  PyArrayObject *xa = NULL, *out = NULL;
  int is_u8 = 0;
  if (convert_images(X, self->model, &xa, &is_u8) < 0) return NULL;
  npy_intp dims[2] = {PyArray_DIM(xa, 0), dp_model_num_classes(self->model)};
  out = new_float32(2, dims);
  if (!out) {
    Py_DECREF(xa);
    return NULL;
  }
  dp_batch b = {PyArray_DATA(xa), is_u8, NULL, (int64_t)dims[0], NULL, NULL};
  float *dst = (float *)PyArray_DATA(out);
  dp_status st;
  self->busy = 1;
  Py_BEGIN_ALLOW_THREADS
  st = dp_model_predict(self->model, &b, dst);
  Py_END_ALLOW_THREADS
  self->busy = 0;
  Py_DECREF(xa);
  if (st != DP_OK) {
    Py_DECREF(out);
    return raise_from_status(st);
  }
  return (PyObject *)out;
}

static PyObject *Model_get_nparams(ModelObject *self, void *c) {
  return self->model ? PyLong_FromLongLong(self->model->nparams) : PyLong_FromLong(0);
}
static PyObject *Model_get_num_classes(ModelObject *self, void *c) {
  return self->model ? PyLong_FromLong(dp_model_num_classes(self->model)) : PyLong_FromLong(0);
}
static PyObject *Model_get_threads(ModelObject *self, void *c) { return PyLong_FromLong(self->device.nthreads); }
static PyObject *Model_get_device(ModelObject *self, void *c) { return PyUnicode_FromString(self->device.name); }
static PyObject *Model_get_input_shape(ModelObject *self, void *c) {
  if (!self->model) Py_RETURN_NONE;
  return Py_BuildValue("(iii)", self->model->in_c, self->model->in_h, self->model->in_w);
}

/* ---- Resident: a dataset copied once to a model's device ----------------------- */

static PyTypeObject ModelType;

typedef struct {
  PyObject_HEAD
  PyObject *owner; /* the ModelObject whose device holds the data (kept alive) */
  dp_resident *data;
} ResidentObject;

static void Resident_dealloc(ResidentObject *self) {
  dp_resident_destroy(self->data);
  Py_XDECREF(self->owner);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Resident(model, images, labels): images (N, C, H, W) uint8 or float32 as
 * the model takes them, labels (N,) int64 in [0, num_classes). */
static int Resident_init(ResidentObject *self, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"model", "images", "labels", NULL};
  PyObject *model, *X, *Y;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!OO", kwlist, &ModelType, &model, &X, &Y)) return -1;
  if (self->data) {
    PyErr_SetString(PyExc_RuntimeError, "Resident is already initialized");
    return -1;
  }
  ModelObject *mo = (ModelObject *)model;
  if (!model_ready(mo)) return -1;
  PyArrayObject *xa = NULL, *ya = NULL;
  int is_u8 = 0, rc = -1;
  if (convert_images(X, mo->model, &xa, &is_u8) < 0) goto done;
  if (convert_labels(Y, PyArray_DIM(xa, 0), &ya) < 0) goto done;
  const dp_model *m = mo->model;
  dp_status st;
  mo->busy = 1;
  Py_BEGIN_ALLOW_THREADS
  st = dp_resident_create(m->dev, PyArray_DATA(xa), is_u8, (const int64_t *)PyArray_DATA(ya),
                          (int64_t)PyArray_DIM(xa, 0), (int64_t)m->in_c * m->in_h * m->in_w,
                          dp_model_num_classes(m), &self->data);
  Py_END_ALLOW_THREADS
  mo->busy = 0;
  if (st != DP_OK) {
    raise_from_status(st);
    goto done;
  }
  self->owner = Py_NewRef(model);
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

static PyTypeObject ResidentType = {
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

/* rows: a 1-D int64 array (a new reference) or NULL with the exception set. */
static PyArrayObject *convert_rows(PyObject *obj) {
  if (!PyArray_Check(obj) || PyArray_TYPE((PyArrayObject *)obj) != NPY_INT64 ||
      PyArray_NDIM((PyArrayObject *)obj) != 1) {
    PyErr_SetString(PyExc_TypeError, "rows must be a 1-D int64 numpy array of sample indices");
    return NULL;
  }
  return (PyArrayObject *)PyArray_FROM_OTF(obj, NPY_INT64, NPY_ARRAY_IN_ARRAY | NPY_ARRAY_NOTSWAPPED);
}

static dp_resident *resident_of(PyObject *obj, const ModelObject *mo) {
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

/* train_step_rows(resident, rows, lr, momentum=0, weight_decay=0) -> (loss_sum, correct) */
static PyObject *Model_train_step_rows(ModelObject *self, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"resident", "rows", "lr", "momentum", "weight_decay", NULL};
  PyObject *R, *rows_obj;
  float lr, mu = 0.0f, wd = 0.0f;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOf|ff", kwlist, &R, &rows_obj, &lr, &mu, &wd)) return NULL;
  if (!model_ready(self)) return NULL;
  dp_resident *d = resident_of(R, self);
  if (!d) return NULL;
  PyArrayObject *rows = convert_rows(rows_obj);
  if (!rows) return NULL;
  const int64_t n = (int64_t)PyArray_DIM(rows, 0);
  double loss = 0.0;
  int64_t correct = 0;
  dp_status st = DP_OK;
  if (n > 0) {
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    st = dp_model_load_rows(self->model, d, (const int64_t *)PyArray_DATA(rows), n);
    if (st == DP_OK) st = dp_model_train_step_loaded(self->model, n, lr, mu, wd, &loss, &correct);
    Py_END_ALLOW_THREADS
    self->busy = 0;
  }
  Py_DECREF(rows);
  if (st != DP_OK) return raise_from_status(st);
  return Py_BuildValue("(dL)", loss, (long long)correct);
}

/* memory_stats() -> dict of the device arena's statistics (CUDA), None on a CPU device */
static PyObject *Model_memory_stats(ModelObject *self, PyObject *unused) {
  if (!model_ready(self)) return NULL;
  if (self->model->dev->kind != DP_DEVICE_CUDA) Py_RETURN_NONE;
  dp_arena_stats s;
  dp_status st = dp_cuda_memory_stats(self->model->dev, &s);
  if (st != DP_OK) return raise_from_status(st);
  return Py_BuildValue("{s:n,s:n,s:n,s:n,s:n}", "reserved_bytes", (Py_ssize_t)s.reserved_bytes, "in_use_bytes",
                       (Py_ssize_t)s.in_use_bytes, "peak_in_use_bytes", (Py_ssize_t)s.peak_in_use_bytes, "chunks",
                       (Py_ssize_t)s.chunks, "blocks", (Py_ssize_t)s.blocks);
}

static PyObject *Model_grads_tensor(ModelObject *self, PyObject *u);
static PyObject *Model_params_tensor(ModelObject *self, PyObject *u);

static PyMethodDef Model_methods[] = {
    {"memory_stats", (PyCFunction)Model_memory_stats, METH_NOARGS,
     "the device arena's statistics (reserved_bytes, in_use_bytes, peak_in_use_bytes, chunks, blocks); None on a "
     "CPU device"},
    {"train_step_rows", (PyCFunction)(void (*)(void))Model_train_step_rows, METH_VARARGS | METH_KEYWORDS,
     "train_step_rows(resident, rows, lr, momentum=0, weight_decay=0) -> (loss_sum, correct): a step on rows of "
     "a Resident dataset"},
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
    {"train_step", (PyCFunction)(void (*)(void))Model_train_step, METH_VARARGS | METH_KEYWORDS,
     "train_step(images, labels, lr, momentum=0, weight_decay=0) -> (loss_sum, correct)"},
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
    {"num_classes", (getter)Model_get_num_classes, NULL, "width of the logits", NULL},
    {"threads", (getter)Model_get_threads, NULL, "cores the model's device uses", NULL},
    {"device", (getter)Model_get_device, NULL, "device name", NULL},
    {"input_shape", (getter)Model_get_input_shape, NULL, "(C, H, W)", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyTypeObject ModelType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "dpcore._core.Model",
    .tp_basicsize = sizeof(ModelObject),
    .tp_dealloc = (destructor)Model_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A sequential network on one CPU device with flat parameter and gradient buffers.",
    .tp_methods = Model_methods,
    .tp_getset = Model_getset,
    .tp_init = (initproc)Model_init,
    .tp_new = PyType_GenericNew,
};

/* ---- Model views and Mirrored: k replicas trained in lockstep --------------- */

static PyObject *model_view(ModelObject *self, int grads) {
  if (!model_ready(self)) return NULL;
  if (self->device.kind != DP_DEVICE_CPU) {
    /* a Tensor's memory is read from the host; use get_params / get_grads */
    PyErr_Format(PyExc_ValueError, "a view of the flat buffers exists for CPU models only; %s is not one",
                 self->device.name);
    return NULL;
  }
  TensorObject *t = (TensorObject *)TensorType.tp_alloc(&TensorType, 0);
  if (!t) return NULL;
  snprintf(t->device, sizeof t->device, "%s", self->device.name);
  t->dtype = NPY_FLOAT32;
  t->ndim = 1;
  t->shape[0] = (npy_intp)self->model->nparams;
  t->data = grads ? self->model->grads : self->model->params;
  t->owner = Py_NewRef((PyObject *)self);
  return (PyObject *)t;
}

static PyObject *Model_grads_tensor(ModelObject *self, PyObject *u) { return model_view(self, 1); }
static PyObject *Model_params_tensor(ModelObject *self, PyObject *u) { return model_view(self, 0); }

typedef struct {
  PyObject_HEAD
  PyObject *models; /* tuple of ModelObject */
  dp_mirrored *mirrored;
} MirroredObject;

static void Mirrored_dealloc(MirroredObject *self) {
  dp_mirrored_destroy(self->mirrored);
  Py_XDECREF(self->models);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

static int Mirrored_init(MirroredObject *self, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"models", "sync_batchnorm", "all_reduce", "bucket_bytes", NULL};
  PyObject *seq_obj;
  int sync_batchnorm = 0;
  const char *all_reduce = "auto";
  long long bucket_bytes = 25ll << 20; /* PyTorch DDP's default bucket, 25 MiB */
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|psL", kwlist, &seq_obj, &sync_batchnorm, &all_reduce,
                                   &bucket_bytes))
    return -1;
  dp_comm_kind kind;
  dp_status kst = dp_comm_kind_parse(all_reduce, &kind);
  if (kst != DP_OK) return raise_from_status(kst), -1;
  if (bucket_bytes < 0) {
    PyErr_Format(PyExc_ValueError, "bucket_bytes must be >= 0, got %lld", bucket_bytes);
    return -1;
  }
  if (self->mirrored) {
    PyErr_SetString(PyExc_RuntimeError, "Mirrored is already initialized");
    return -1;
  }
  PyObject *models = PySequence_Tuple(seq_obj);
  if (!models) return -1;
  Py_ssize_t k = PyTuple_GET_SIZE(models);
  if (k < 1 || k > 64) {
    Py_DECREF(models);
    PyErr_Format(PyExc_ValueError, "Mirrored needs 1 to 64 replicas, got %zd", k);
    return -1;
  }
  dp_model *ptrs[64];
  for (Py_ssize_t r = 0; r < k; ++r) {
    PyObject *o = PyTuple_GET_ITEM(models, r);
    if (!PyObject_TypeCheck(o, &ModelType) || !((ModelObject *)o)->model) {
      Py_DECREF(models);
      PyErr_Format(PyExc_TypeError, "Mirrored: replica %zd is not an initialized Model", r);
      return -1;
    }
    ptrs[r] = ((ModelObject *)o)->model;
  }
  dp_status st;
  Py_BEGIN_ALLOW_THREADS /* NCCL communicators take a while to make */
  st = dp_mirrored_create(ptrs, (int)k, sync_batchnorm, kind, (int64_t)bucket_bytes, &self->mirrored);
  Py_END_ALLOW_THREADS
  if (st != DP_OK) {
    Py_DECREF(models);
    return raise_from_status(st), -1;
  }
  self->models = models;
  return 0;
}

/* Every replica must be idle; mark them busy while the GIL is released. */
static int mirrored_acquire(MirroredObject *self) {
  if (!self->mirrored) {
    PyErr_SetString(PyExc_RuntimeError, "Mirrored is not initialized");
    return 0;
  }
  Py_ssize_t k = PyTuple_GET_SIZE(self->models);
  for (Py_ssize_t r = 0; r < k; ++r)
    if (!model_ready((ModelObject *)PyTuple_GET_ITEM(self->models, r))) return 0;
  for (Py_ssize_t r = 0; r < k; ++r) ((ModelObject *)PyTuple_GET_ITEM(self->models, r))->busy = 1;
  return 1;
}

static void mirrored_release(MirroredObject *self) {
  for (Py_ssize_t r = 0; r < PyTuple_GET_SIZE(self->models); ++r)
    ((ModelObject *)PyTuple_GET_ITEM(self->models, r))->busy = 0;
}

enum mirrored_call { MIRRORED_TRAIN, MIRRORED_FORWARD_BACKWARD, MIRRORED_EVALUATE };

static PyObject *mirrored_batch(MirroredObject *self, PyObject *X, PyObject *Y, enum mirrored_call call, float lr,
                                float mu, float wd) {
  if (!self->mirrored) {
    PyErr_SetString(PyExc_RuntimeError, "Mirrored is not initialized");
    return NULL;
  }
  PyArrayObject *xa = NULL, *ya = NULL;
  PyObject *ret = NULL;
  int is_u8 = 0;
  if (convert_images(X, self->mirrored->models[0], &xa, &is_u8) < 0) goto done;
  if (convert_labels(Y, PyArray_DIM(xa, 0), &ya) < 0) goto done;
  if (!mirrored_acquire(self)) goto done;
  dp_batch b = {PyArray_DATA(xa), is_u8, (const int64_t *)PyArray_DATA(ya), (int64_t)PyArray_DIM(xa, 0), NULL,
                NULL};
  double loss = 0.0;
  int64_t correct = 0;
  dp_status st;
  Py_BEGIN_ALLOW_THREADS
  if (call == MIRRORED_TRAIN)
    st = b.n ? dp_mirrored_train_step(self->mirrored, &b, lr, mu, wd, &loss, &correct) : DP_OK;
  else if (call == MIRRORED_FORWARD_BACKWARD)
    st = dp_mirrored_forward_backward(self->mirrored, &b, &loss, &correct);
  else
    st = dp_mirrored_evaluate(self->mirrored, &b, &loss, &correct);
  Py_END_ALLOW_THREADS
  mirrored_release(self);
  if (st != DP_OK) {
    raise_from_status(st);
    goto done;
  }
  ret = Py_BuildValue("(dL)", loss, (long long)correct);
done:
  Py_XDECREF(xa);
  Py_XDECREF(ya);
  return ret;
}

static PyObject *Mirrored_train_step(MirroredObject *self, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"images", "labels", "lr", "momentum", "weight_decay", NULL};
  PyObject *X, *Y;
  float lr, mu = 0.0f, wd = 0.0f;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOf|ff", kwlist, &X, &Y, &lr, &mu, &wd)) return NULL;
  return mirrored_batch(self, X, Y, MIRRORED_TRAIN, lr, mu, wd);
}

static PyObject *Mirrored_forward_backward(MirroredObject *self, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"images", "labels", NULL};
  PyObject *X, *Y;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO", kwlist, &X, &Y)) return NULL;
  return mirrored_batch(self, X, Y, MIRRORED_FORWARD_BACKWARD, 0, 0, 0);
}

static PyObject *Mirrored_evaluate(MirroredObject *self, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"images", "labels", NULL};
  PyObject *X, *Y;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO", kwlist, &X, &Y)) return NULL;
  return mirrored_batch(self, X, Y, MIRRORED_EVALUATE, 0, 0, 0);
}

/* train_step_rows(residents, rows, lr, momentum=0, weight_decay=0): residents[r]
 * is the dataset resident on replica r's device. */
static PyObject *Mirrored_train_step_rows(MirroredObject *self, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"residents", "rows", "lr", "momentum", "weight_decay", NULL};
  PyObject *R, *rows_obj;
  float lr, mu = 0.0f, wd = 0.0f;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOf|ff", kwlist, &R, &rows_obj, &lr, &mu, &wd)) return NULL;
  if (!self->mirrored) {
    PyErr_SetString(PyExc_RuntimeError, "Mirrored is not initialized");
    return NULL;
  }
  PyObject *seq = PySequence_Fast(R, "residents must be a sequence, one Resident per replica");
  if (!seq) return NULL;
  const Py_ssize_t k = PyTuple_GET_SIZE(self->models);
  dp_resident *data[DP_COMM_MAX_REPLICAS];
  PyArrayObject *rows = NULL;
  PyObject *ret = NULL;
  if (PySequence_Fast_GET_SIZE(seq) != k) {
    PyErr_Format(PyExc_ValueError, "residents: need one per replica (%zd), got %zd", k, PySequence_Fast_GET_SIZE(seq));
    goto done;
  }
  for (Py_ssize_t r = 0; r < k; ++r)
    if (!(data[r] = resident_of(PySequence_Fast_GET_ITEM(seq, r), (ModelObject *)PyTuple_GET_ITEM(self->models, r))))
      goto done;
  if (!(rows = convert_rows(rows_obj))) goto done;
  if (!mirrored_acquire(self)) goto done;
  dp_batch b = {NULL, 0, NULL, (int64_t)PyArray_DIM(rows, 0), (const int64_t *)PyArray_DATA(rows), data};
  double loss = 0.0;
  int64_t correct = 0;
  dp_status st;
  Py_BEGIN_ALLOW_THREADS
  st = b.n ? dp_mirrored_train_step(self->mirrored, &b, lr, mu, wd, &loss, &correct) : DP_OK;
  Py_END_ALLOW_THREADS
  mirrored_release(self);
  if (st != DP_OK) {
    raise_from_status(st);
    goto done;
  }
  ret = Py_BuildValue("(dL)", loss, (long long)correct);
done:
  Py_XDECREF(rows);
  Py_DECREF(seq);
  return ret;
}

static PyObject *Mirrored_broadcast(MirroredObject *self, PyObject *args) {
  int root = 0;
  if (!PyArg_ParseTuple(args, "|i", &root)) return NULL;
  if (!mirrored_acquire(self)) return NULL;
  dp_status st = dp_mirrored_broadcast(self->mirrored, root);
  mirrored_release(self);
  if (st != DP_OK) return raise_from_status(st);
  Py_RETURN_NONE;
}

static PyObject *Mirrored_get_all_reduce(MirroredObject *self, void *c) {
  if (!self->mirrored) {
    PyErr_SetString(PyExc_RuntimeError, "Mirrored is not initialized");
    return NULL;
  }
  return PyUnicode_FromString(dp_comm_kind_name(dp_comm_get_kind(self->mirrored->comm)));
}

/* [(begin, end, ready_layer), ...] in the order the backward pass starts them */
static PyObject *Mirrored_get_buckets(MirroredObject *self, void *c) {
  if (!self->mirrored) {
    PyErr_SetString(PyExc_RuntimeError, "Mirrored is not initialized");
    return NULL;
  }
  const dp_mirrored *m = self->mirrored;
  PyObject *list = PyList_New(m->nbuckets);
  if (!list) return NULL;
  for (int b = 0; b < m->nbuckets; ++b) {
    PyObject *t = Py_BuildValue("(LLi)", (long long)m->buckets[b].begin, (long long)m->buckets[b].end,
                                m->buckets[b].ready_layer);
    if (!t) {
      Py_DECREF(list);
      return NULL;
    }
    PyList_SET_ITEM(list, b, t);
  }
  return list;
}

static PyGetSetDef Mirrored_getset[] = {
    {"all_reduce", (getter)Mirrored_get_all_reduce, NULL, "the all-reduce in use: 'host', 'kernel' or 'nccl'", NULL},
    {"buckets", (getter)Mirrored_get_buckets, NULL,
     "the gradient buckets: (begin, end, ready_layer) ranges of the flat buffer, in backward order", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyMethodDef Mirrored_methods[] = {
    {"train_step", (PyCFunction)(void (*)(void))Mirrored_train_step, METH_VARARGS | METH_KEYWORDS,
     "train_step(images, labels, lr, momentum=0, weight_decay=0) -> (loss_sum, correct) over the global batch"},
    {"forward_backward", (PyCFunction)(void (*)(void))Mirrored_forward_backward, METH_VARARGS | METH_KEYWORDS,
     "forward_backward(images, labels) -> (loss_sum, correct); gradients all-reduced (mean), no step"},
    {"evaluate", (PyCFunction)(void (*)(void))Mirrored_evaluate, METH_VARARGS | METH_KEYWORDS,
     "evaluate(images, labels) -> (loss_sum, correct), the batch split over the replicas"},
    {"train_step_rows", (PyCFunction)(void (*)(void))Mirrored_train_step_rows, METH_VARARGS | METH_KEYWORDS,
     "train_step_rows(residents, rows, lr, momentum=0, weight_decay=0) -> (loss_sum, correct): a step on rows of "
     "the dataset resident on every replica's device"},
    {"broadcast", (PyCFunction)Mirrored_broadcast, METH_VARARGS,
     "broadcast(root=0): copy a replica's parameters to all and zero the momentum"},
    {NULL, NULL, 0, NULL}};

static PyTypeObject MirroredType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "dpcore._core.Mirrored",
    .tp_basicsize = sizeof(MirroredObject),
    .tp_dealloc = (destructor)Mirrored_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Mirrored(models, sync_batchnorm=False, all_reduce='auto', bucket_bytes=25 MiB): one replica per "
              "device, one thread per replica",
    .tp_methods = Mirrored_methods,
    .tp_getset = Mirrored_getset,
    .tp_init = (initproc)Mirrored_init,
    .tp_new = PyType_GenericNew,
};

/* ---- single ops (tests, notebooks): the backend's kernels on NumPy arrays ---
 * These run on a module-level CPU device with every core and hold the GIL
 * (the device's scratch memory is shared). */

static dp_device ops_device;

static int ops_init(void) {
  dp_status st = dp_cpu_device_init(&ops_device, 0, dp_cpu_core_count());
  if (st != DP_OK) return raise_from_status(st), -1;
  return 0;
}

static int check_pos(long v, const char *what) {
  if (v < 1) {
    PyErr_Format(PyExc_ValueError, "%s must be >= 1, got %ld", what, v);
    return -1;
  }
  return 0;
}

static PyObject *ops_conv2d(PyObject *mod, PyObject *args, int backward) {
  PyObject *xo, *wo, *third;
  int stride, pad;
  if (!PyArg_ParseTuple(args, "OOOii", &xo, &wo, &third, &stride, &pad)) return NULL;
  PyArrayObject *x = NULL, *w = NULL, *t = NULL, *y = NULL, *dx = NULL, *dw = NULL, *db = NULL;
  PyObject *ret = NULL;
  if (!(x = as_float32(xo, 4, "x")) || !(w = as_float32(wo, 4, "w"))) goto done;
  if (third != Py_None && !(t = as_float32(third, backward ? 4 : 1, backward ? "dy" : "b"))) goto done;
  if (check_pos(stride, "stride") < 0) goto done;
  if (pad < 0) {
    PyErr_Format(PyExc_ValueError, "padding must be >= 0, got %d", pad);
    goto done;
  }
  const npy_intp *xd = PyArray_DIMS(x), *wd = PyArray_DIMS(w);
  if (xd[1] < 1) {
    PyErr_SetString(PyExc_ValueError, "x must have at least one channel");
    goto done;
  }
  if (xd[1] != wd[1]) {
    PyErr_Format(PyExc_ValueError, "x has %ld channels but w expects %ld", (long)xd[1], (long)wd[1]);
    goto done;
  }
  if (xd[2] + 2 * pad < wd[2] || xd[3] + 2 * pad < wd[3] || wd[0] < 1 || wd[2] < 1 || wd[3] < 1) {
    PyErr_SetString(PyExc_ValueError, "the kernel is larger than the padded input (or empty)");
    goto done;
  }
  dp_conv_geom g = {(int)xd[1], (int)xd[2], (int)xd[3], (int)wd[0], (int)wd[2], (int)wd[3], stride, pad, 0, 0};
  g.OH = (g.H + 2 * pad - g.KH) / stride + 1;
  g.OW = (g.W + 2 * pad - g.KW) / stride + 1;
  npy_intp yd[4] = {xd[0], g.O, g.OH, g.OW};
  dp_status st;
  if (!backward) {
    if (t && PyArray_DIM(t, 0) != g.O) {
      PyErr_Format(PyExc_ValueError, "b must have shape (%d,), got (%ld,)", g.O, (long)PyArray_DIM(t, 0));
      goto done;
    }
    if (!(y = new_float32(4, yd))) goto done;
    st = ops_device.backend->conv2d_forward(&ops_device, &g, xd[0], PyArray_DATA(x), PyArray_DATA(w),
                                            t ? PyArray_DATA(t) : NULL, PyArray_DATA(y));
    if (st != DP_OK) {
      raise_from_status(st);
      goto done;
    }
    ret = (PyObject *)y;
    y = NULL;
  } else {
    if (!t) {
      PyErr_SetString(PyExc_TypeError, "dy is required");
      goto done;
    }
    for (int i = 0; i < 4; ++i)
      if (PyArray_DIM(t, i) != yd[i]) {
        PyErr_Format(PyExc_ValueError, "dy must have shape (%ld, %ld, %ld, %ld)", (long)yd[0], (long)yd[1],
                     (long)yd[2], (long)yd[3]);
        goto done;
      }
    npy_intp bd = g.O;
    if (!(dx = new_float32(4, xd)) || !(dw = new_float32(4, wd)) || !(db = new_float32(1, &bd))) goto done;
    st = ops_device.backend->conv2d_backward(&ops_device, &g, xd[0], PyArray_DATA(x), PyArray_DATA(w),
                                             PyArray_DATA(t), PyArray_DATA(dx), PyArray_DATA(dw), PyArray_DATA(db));
    if (st != DP_OK) {
      raise_from_status(st);
      goto done;
    }
    ret = Py_BuildValue("(OOO)", dx, dw, db);
  }
done:
  Py_XDECREF(x);
  Py_XDECREF(w);
  Py_XDECREF(t);
  Py_XDECREF(y);
  Py_XDECREF(dx);
  Py_XDECREF(dw);
  Py_XDECREF(db);
  return ret;
}

static PyObject *op_conv2d_forward(PyObject *m, PyObject *a) { return ops_conv2d(m, a, 0); }
static PyObject *op_conv2d_backward(PyObject *m, PyObject *a) { return ops_conv2d(m, a, 1); }

static PyObject *ops_dense(PyObject *mod, PyObject *args, int backward) {
  PyObject *xo, *wo, *third;
  if (!PyArg_ParseTuple(args, "OOO", &xo, &wo, &third)) return NULL;
  PyArrayObject *x = NULL, *w = NULL, *t = NULL, *y = NULL, *dx = NULL, *dw = NULL, *db = NULL;
  PyObject *ret = NULL;
  if (!(x = as_float32(xo, 2, "x")) || !(w = as_float32(wo, 2, "w"))) goto done;
  if (third != Py_None && !(t = as_float32(third, backward ? 2 : 1, backward ? "dy" : "b"))) goto done;
  npy_intp N = PyArray_DIM(x, 0), nin = PyArray_DIM(x, 1), nout = PyArray_DIM(w, 0);
  if (PyArray_DIM(w, 1) != nin) {
    PyErr_Format(PyExc_ValueError, "x has %ld features but w expects %ld", (long)nin, (long)PyArray_DIM(w, 1));
    goto done;
  }
  dp_status st;
  if (!backward) {
    if (t && PyArray_DIM(t, 0) != nout) {
      PyErr_Format(PyExc_ValueError, "b must have shape (%ld,)", (long)nout);
      goto done;
    }
    npy_intp yd[2] = {N, nout};
    if (!(y = new_float32(2, yd))) goto done;
    st = ops_device.backend->dense_forward(&ops_device, N, (int)nin, (int)nout, PyArray_DATA(x), PyArray_DATA(w),
                                           t ? PyArray_DATA(t) : NULL, PyArray_DATA(y));
    if (st != DP_OK) {
      raise_from_status(st);
      goto done;
    }
    ret = (PyObject *)y;
    y = NULL;
  } else {
    if (!t || PyArray_DIM(t, 0) != N || PyArray_DIM(t, 1) != nout) {
      PyErr_Format(PyExc_ValueError, "dy must have shape (%ld, %ld)", (long)N, (long)nout);
      goto done;
    }
    if (!(dx = new_float32(2, PyArray_DIMS(x))) || !(dw = new_float32(2, PyArray_DIMS(w))) ||
        !(db = new_float32(1, &nout)))
      goto done;
    st = ops_device.backend->dense_backward(&ops_device, N, (int)nin, (int)nout, PyArray_DATA(x), PyArray_DATA(w),
                                            PyArray_DATA(t), PyArray_DATA(dx), PyArray_DATA(dw), PyArray_DATA(db));
    if (st != DP_OK) {
      raise_from_status(st);
      goto done;
    }
    ret = Py_BuildValue("(OOO)", dx, dw, db);
  }
done:
  Py_XDECREF(x);
  Py_XDECREF(w);
  Py_XDECREF(t);
  Py_XDECREF(y);
  Py_XDECREF(dx);
  Py_XDECREF(dw);
  Py_XDECREF(db);
  return ret;
}

static PyObject *op_dense_forward(PyObject *m, PyObject *a) { return ops_dense(m, a, 0); }
static PyObject *op_dense_backward(PyObject *m, PyObject *a) { return ops_dense(m, a, 1); }

static PyObject *op_relu_forward(PyObject *mod, PyObject *xo) {
  PyArrayObject *x = as_float32(xo, -1, "x");
  if (!x) return NULL;
  PyArrayObject *y = new_float32(PyArray_NDIM(x), PyArray_DIMS(x));
  if (y) ops_device.backend->relu_forward(&ops_device, PyArray_SIZE(x), PyArray_DATA(x), PyArray_DATA(y));
  Py_DECREF(x);
  return (PyObject *)y;
}

/* relu_backward(y, dy): y is the forward output */
static PyObject *op_relu_backward(PyObject *mod, PyObject *args) {
  PyObject *yo, *dyo;
  if (!PyArg_ParseTuple(args, "OO", &yo, &dyo)) return NULL;
  PyArrayObject *y = NULL, *dy = NULL, *dx = NULL;
  if (!(y = as_float32(yo, -1, "y")) || !(dy = as_float32(dyo, PyArray_NDIM(y), "dy"))) goto done;
  if (!PyArray_SAMESHAPE(y, dy)) {
    PyErr_SetString(PyExc_ValueError, "y and dy must have the same shape");
    goto done;
  }
  if ((dx = new_float32(PyArray_NDIM(y), PyArray_DIMS(y))))
    ops_device.backend->relu_backward(&ops_device, PyArray_SIZE(y), PyArray_DATA(y), PyArray_DATA(dy),
                                      PyArray_DATA(dx));
done:
  Py_XDECREF(y);
  Py_XDECREF(dy);
  return (PyObject *)dx;
}

/* pool(kind, x, k, stride, pad[, dy]) — forward returns y, backward returns dx. */
static PyObject *ops_pool(PyObject *args, int is_max, int backward) {
  PyObject *xo, *dyo = NULL;
  int k, stride, pad;
  if (backward ? !PyArg_ParseTuple(args, "OOiii", &xo, &dyo, &k, &stride, &pad)
               : !PyArg_ParseTuple(args, "Oiii", &xo, &k, &stride, &pad))
    return NULL;
  PyArrayObject *x = NULL, *dy = NULL, *y = NULL, *dx = NULL;
  int32_t *arg = NULL;
  PyObject *ret = NULL;
  if (!(x = as_float32(xo, 4, "x"))) goto done;
  if (check_pos(k, "kernel") < 0 || check_pos(stride, "stride") < 0) goto done;
  const npy_intp *xd = PyArray_DIMS(x);
  if (pad < 0 || 2 * pad > k || xd[2] + 2 * pad < k || xd[3] + 2 * pad < k) {
    PyErr_Format(PyExc_ValueError, "pooling: need 0 <= padding <= kernel/2 and kernel <= padded input, got kernel %d, "
                 "padding %d, input %ldx%ld", k, pad, (long)xd[2], (long)xd[3]);
    goto done;
  }
  dp_pool_geom g = {(int)xd[1], (int)xd[2], (int)xd[3], dp_pool_out_dim((int)xd[2], k, stride, pad),
                    dp_pool_out_dim((int)xd[3], k, stride, pad), k, stride, pad};
  npy_intp yd[4] = {xd[0], xd[1], g.OH, g.OW};
  if (!(y = new_float32(4, yd))) goto done;
  if (is_max) {
    arg = malloc(sizeof(int32_t) * (size_t)(PyArray_SIZE(y) ? PyArray_SIZE(y) : 1));
    if (!arg) {
      PyErr_NoMemory();
      goto done;
    }
    ops_device.backend->maxpool_forward(&ops_device, &g, xd[0], PyArray_DATA(x), PyArray_DATA(y), arg);
  } else {
    ops_device.backend->avgpool_forward(&ops_device, &g, xd[0], PyArray_DATA(x), PyArray_DATA(y));
  }
  if (!backward) {
    ret = (PyObject *)y;
    y = NULL;
    goto done;
  }
  if (!(dy = as_float32(dyo, 4, "dy"))) goto done;
  if (!PyArray_SAMESHAPE(dy, y)) {
    PyErr_Format(PyExc_ValueError, "dy must have shape (%ld, %ld, %ld, %ld)", (long)yd[0], (long)yd[1], (long)yd[2],
                 (long)yd[3]);
    goto done;
  }
  if (!(dx = new_float32(4, xd))) goto done;
  if (is_max)
    ops_device.backend->maxpool_backward(&ops_device, &g, xd[0], PyArray_DATA(dy), arg, PyArray_DATA(dx));
  else
    ops_device.backend->avgpool_backward(&ops_device, &g, xd[0], PyArray_DATA(dy), PyArray_DATA(dx));
  ret = (PyObject *)dx;
  dx = NULL;
done:
  free(arg);
  Py_XDECREF(x);
  Py_XDECREF(dy);
  Py_XDECREF(y);
  Py_XDECREF(dx);
  return ret;
}

static PyObject *op_avg_pool2d_forward(PyObject *m, PyObject *a) { return ops_pool(a, 0, 0); }
static PyObject *op_avg_pool2d_backward(PyObject *m, PyObject *a) { return ops_pool(a, 0, 1); }
static PyObject *op_max_pool2d_forward(PyObject *m, PyObject *a) { return ops_pool(a, 1, 0); }
static PyObject *op_max_pool2d_backward(PyObject *m, PyObject *a) { return ops_pool(a, 1, 1); }

/* softmax_cross_entropy(logits (N,K), labels int64 (N), scale) -> (loss_sum, correct, dlogits) */
static PyObject *op_softmax_cross_entropy(PyObject *mod, PyObject *args) {
  PyObject *lo, *yo;
  float scale;
  if (!PyArg_ParseTuple(args, "OOf", &lo, &yo, &scale)) return NULL;
  PyArrayObject *logits = NULL, *labels = NULL, *d = NULL;
  int32_t *lab = NULL;
  PyObject *ret = NULL;
  if (!(logits = as_float32(lo, 2, "logits"))) goto done;
  npy_intp N = PyArray_DIM(logits, 0), K = PyArray_DIM(logits, 1);
  if (K < 1) {
    PyErr_SetString(PyExc_ValueError, "logits need at least one class");
    goto done;
  }
  if (convert_labels(yo, N, &labels) < 0) goto done;
  lab = malloc(sizeof(int32_t) * (size_t)(N ? N : 1));
  if (!lab) {
    PyErr_NoMemory();
    goto done;
  }
  const int64_t *y64 = PyArray_DATA(labels);
  for (npy_intp i = 0; i < N; ++i) {
    if (y64[i] < 0 || y64[i] >= K) {
      PyErr_Format(PyExc_ValueError, "label %lld at index %ld is outside [0, %ld)", (long long)y64[i], (long)i, (long)K);
      goto done;
    }
    lab[i] = (int32_t)y64[i];
  }
  if (!(d = new_float32(2, PyArray_DIMS(logits)))) goto done;
  double loss = 0;
  int64_t correct = 0;
  dp_status st = ops_device.backend->softmax_xent(&ops_device, N, (int)K, PyArray_DATA(logits), lab, scale,
                                                  PyArray_DATA(d), &loss, &correct);
  if (st != DP_OK) {
    raise_from_status(st);
    goto done;
  }
  ret = Py_BuildValue("(dLO)", loss, (long long)correct, d);
done:
  free(lab);
  Py_XDECREF(logits);
  Py_XDECREF(labels);
  Py_XDECREF(d);
  return ret;
}

/* sgd_update(w, g, v, lr, momentum, weight_decay): w and v updated in place */
static PyObject *op_sgd_update(PyObject *mod, PyObject *args) {
  PyObject *wo, *go, *vo;
  float lr, mu, wd;
  if (!PyArg_ParseTuple(args, "OOOfff", &wo, &go, &vo, &lr, &mu, &wd)) return NULL;
  PyArrayObject *arrs[3] = {NULL, NULL, NULL};
  PyObject *objs[3] = {wo, go, vo};
  const char *names[3] = {"w", "g", "v"};
  PyObject *ret = NULL;
  for (int i = 0; i < 3; ++i) {
    PyArrayObject *a = (PyArrayObject *)objs[i];
    if (!PyArray_Check(objs[i]) || PyArray_TYPE(a) != NPY_FLOAT32 || !PyArray_IS_C_CONTIGUOUS(a) ||
        !PyArray_ISWRITEABLE(a) || !PyArray_ISALIGNED(a) || !PyArray_ISNOTSWAPPED(a)) {
      PyErr_Format(PyExc_TypeError, "%s must be a writeable, aligned, C-contiguous native float32 ndarray", names[i]);
      goto done;
    }
    arrs[i] = (PyArrayObject *)Py_NewRef(objs[i]);
    if (PyArray_SIZE(arrs[i]) != PyArray_SIZE(arrs[0])) {
      PyErr_SetString(PyExc_ValueError, "w, g and v must have the same number of elements");
      goto done;
    }
  }
  ops_device.backend->sgd_update(&ops_device, PyArray_SIZE(arrs[0]), PyArray_DATA(arrs[0]), PyArray_DATA(arrs[1]),
                                 PyArray_DATA(arrs[2]), lr, mu, wd);
  ret = Py_NewRef(Py_None);
done:
  for (int i = 0; i < 3; ++i) Py_XDECREF(arrs[i]);
  return ret;
}

#define OPS_METHODS                                                                                           \
  {"conv2d_forward", op_conv2d_forward, METH_VARARGS, "conv2d_forward(x, w, b|None, stride, pad) -> y"},     \
      {"conv2d_backward", op_conv2d_backward, METH_VARARGS,                                                   \
       "conv2d_backward(x, w, dy, stride, pad) -> (dx, dw, db)"},                                             \
      {"dense_forward", op_dense_forward, METH_VARARGS, "dense_forward(x, w, b|None) -> y"},                  \
      {"dense_backward", op_dense_backward, METH_VARARGS, "dense_backward(x, w, dy) -> (dx, dw, db)"},        \
      {"relu_forward", op_relu_forward, METH_O, "relu_forward(x) -> y"},                                      \
      {"relu_backward", op_relu_backward, METH_VARARGS, "relu_backward(y, dy) -> dx (y: forward output)"},    \
      {"avg_pool2d_forward", op_avg_pool2d_forward, METH_VARARGS, "avg_pool2d_forward(x, k, stride, pad)"},   \
      {"avg_pool2d_backward", op_avg_pool2d_backward, METH_VARARGS,                                           \
       "avg_pool2d_backward(x, dy, k, stride, pad) -> dx"},                                                   \
      {"max_pool2d_forward", op_max_pool2d_forward, METH_VARARGS, "max_pool2d_forward(x, k, stride, pad)"},   \
      {"max_pool2d_backward", op_max_pool2d_backward, METH_VARARGS,                                           \
       "max_pool2d_backward(x, dy, k, stride, pad) -> dx"},                                                   \
      {"softmax_cross_entropy", op_softmax_cross_entropy, METH_VARARGS,                                       \
       "softmax_cross_entropy(logits, labels, scale) -> (loss_sum, correct, dlogits)"},                       \
      {"sgd_update", op_sgd_update, METH_VARARGS, "sgd_update(w, g, v, lr, momentum, weight_decay), in place"},

/* ---- module ---------------------------------------------------------------- */

static PyObject *mod_build_info_json(PyObject *m, PyObject *unused) { return PyUnicode_FromString(DP_BUILD_INFO_JSON); }

static PyObject *mod_runtime_info(PyObject *m, PyObject *unused) {
  int count = 0, rt = 0, drv = 0;
  char why[256] = "built without CUDA";
#ifdef DP_HAVE_CUDA
  dp_cuda_probe(&count, why, sizeof why, &rt, &drv);
#endif
  /* the physical GPUs: [{'name', 'memory_bytes', 'compute_capability'}] */
  PyObject *gpus = PyList_New(0);
  if (!gpus) return NULL;
#ifdef DP_HAVE_CUDA
  for (int g = 0; g < count; ++g) {
    char name[256];
    size_t mem = 0;
    int major = 0, minor = 0;
    if (dp_cuda_describe(g, name, sizeof name, &mem, &major, &minor) != 0) continue;
    PyObject *d = Py_BuildValue("{s:s,s:n,s:(ii)}", "name", name, "memory_bytes", (Py_ssize_t)mem,
                                "compute_capability", major, minor);
    if (!d || PyList_Append(gpus, d) < 0) {
      Py_XDECREF(d);
      Py_DECREF(gpus);
      return NULL;
    }
    Py_DECREF(d);
  }
#endif
  return Py_BuildValue("{s:i,s:s,s:N,s:i,s:i,s:i,s:i,s:s,s:n}", "cuda_device_count", count, "cuda_why", why,
                       "cuda_devices", gpus, "cuda_runtime_version", rt, "cuda_driver_version", drv, "cpu_cores",
                       dp_cpu_core_count(), "openmp", (int)_OPENMP, "blas_config", openblas_get_config(),
                       "cudnn_version", (Py_ssize_t)dp_cudnn_version());
}

/* backend_null_entries(name) -> [names of the entries the backend table leaves NULL];
 * None when the backend was not built. Needs no device. */
static PyObject *mod_backend_null_entries(PyObject *m, PyObject *args) {
  const char *name;
  if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
  const dp_backend *be = strcmp(name, "cpu") == 0 ? dp_cpu_backend() : strcmp(name, "cuda") == 0 ? dp_cuda_backend() : NULL;
  if (!be) {
    if (strcmp(name, "cpu") == 0 || strcmp(name, "cuda") == 0) Py_RETURN_NONE;
    PyErr_Format(PyExc_ValueError, "unknown backend '%s' (cpu, cuda)", name);
    return NULL;
  }
  const char *names[64];
  int n = dp_backend_null_entries(be, names, 64);
  if (n > 64) n = 64;
  PyObject *out = PyList_New(0);
  for (int i = 0; out && i < n; ++i) {
    PyObject *u = PyUnicode_FromString(names[i]);
    if (!u || PyList_Append(out, u) < 0) {
      Py_XDECREF(u);
      Py_CLEAR(out);
      break;
    }
    Py_DECREF(u);
  }
  return out;
}

/* set_cuda_options(deterministic, allow_tf32): the process-wide CUDA settings
 * (dpcore.config validates them); every CUDA device takes them before its next
 * convolution or dense layer, new devices start with them. */
static PyObject *mod_set_cuda_options(PyObject *m, PyObject *args) {
  int deterministic, allow_tf32;
  if (!PyArg_ParseTuple(args, "pp", &deterministic, &allow_tf32)) return NULL;
  dp_cuda_set_defaults(deterministic, allow_tf32);
  Py_RETURN_NONE;
}

static PyObject *mod_get_cuda_options(PyObject *m, PyObject *unused) {
  int deterministic, allow_tf32;
  dp_cuda_get_defaults(&deterministic, &allow_tf32);
  return Py_BuildValue("(NN)", PyBool_FromLong(deterministic), PyBool_FromLong(allow_tf32));
}

static PyMethodDef module_methods[] = {
    {"backend_null_entries", mod_backend_null_entries, METH_VARARGS,
     "backend_null_entries(name) -> names of the NULL entries of backend 'cpu' or 'cuda' (None if not built)"},
    {"build_info_json", mod_build_info_json, METH_NOARGS, "what the build found and used, as JSON"},
    {"runtime_info", mod_runtime_info, METH_NOARGS, "devices and libraries found at run time"},
    {"all_reduce", mod_all_reduce, METH_VARARGS, "all_reduce(tensors, op): in place, op 0 = sum, 1 = mean"},
    {"allreduce_benchmark", mod_allreduce_benchmark, METH_VARARGS,
     "allreduce_benchmark(k, n, iters) -> seconds for iters in-process all-reduces of n floats"},
    {"cudnn_conv_output_dim", mod_cudnn_conv_output_dim, METH_VARARGS,
     "cudnn_conv_output_dim(N, C, H, W, O, KH, KW, stride, pad) -> (n, c, h, w) from cuDNN's shape inference"},
    {"shard_ranges", mod_shard_ranges, METH_VARARGS, "shard_ranges(n, k) -> [(begin, end)] per replica"},
    {"set_cuda_options", mod_set_cuda_options, METH_VARARGS,
     "set_cuda_options(deterministic, allow_tf32): process-wide settings of every CUDA device"},
    {"get_cuda_options", mod_get_cuda_options, METH_NOARGS, "get_cuda_options() -> (deterministic, allow_tf32)"},
    OPS_METHODS{NULL, NULL, 0, NULL}};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "dpcore._core",
                                        "dpcore's C core (see python/dpcore for the API)", -1, module_methods,
                                        NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__core(void) {
  import_array();
  PyObject *errors = PyImport_ImportModule("dpcore.errors");
  if (!errors) return NULL;
  DpcoreError = PyObject_GetAttrString(errors, "DpcoreError");
  DeviceError = DpcoreError ? PyObject_GetAttrString(errors, "DeviceError") : NULL;
  Py_DECREF(errors);
  if (!DpcoreError || !DeviceError) return NULL;
  if (PyType_Ready(&ModelType) < 0 || PyType_Ready(&TensorType) < 0 || PyType_Ready(&MirroredType) < 0 ||
      PyType_Ready(&ResidentType) < 0)
    return NULL;
  if (ops_init() < 0) return NULL;
  PyObject *m = PyModule_Create(&module_def);
  if (!m) return NULL;
  if (PyModule_AddObjectRef(m, "Model", (PyObject *)&ModelType) < 0 ||
      PyModule_AddObjectRef(m, "Tensor", (PyObject *)&TensorType) < 0 ||
      PyModule_AddObjectRef(m, "Mirrored", (PyObject *)&MirroredType) < 0 ||
      PyModule_AddObjectRef(m, "Resident", (PyObject *)&ResidentType) < 0) {
    Py_DECREF(m);
    return NULL;
  }
  return m;
}
