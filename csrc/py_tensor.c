/* py_tensor.c — Tensor (an allocation on a device) and the chapter-12.5
 * primitive that works on tensors in place: all_reduce. scatter, broadcast
 * and gather are Python (python/dpcore/parallel.py) over Tensor.
 *
 * A tensor holds a reference to its registry device (csrc/device.h) and
 * memory its backend allocated: device memory on a CUDA device, which only
 * the backend's copies touch. Making one from NumPy copies to the device,
 * numpy() copies back; both hold the device's step lock, as every call that
 * allocates or computes on a device does.
 */
#include "py_private.h"

#include <stdlib.h>
#include <string.h>

typedef struct {
  PyObject_HEAD
  /* a reference (put by dealloc), or, for a view, the owner model's device,
   * which the owner keeps alive */
  dp_device *dev;
  int dtype; /* NPY_FLOAT32, NPY_INT64 or NPY_UINT8 (images) */
  int ndim;
  npy_intp shape[NPY_MAXDIMS];
  void *data; /* memory of dev */
  /* NULL: the tensor owns data; else the ModelObject whose flat buffer it
   * views (model_view): kept alive, and busy while the model computes */
  PyObject *owner;
} TensorObject;

/* device_free_in_dealloc's work: the tensor's memory */
typedef struct {
  dp_device *dev;
  void *data;
} tensor_free_work;

static void tensor_free_in_dealloc(void *p) {
  const tensor_free_work *w = p;
  dp_device_free(w->dev, w->data);
}

static void Tensor_dealloc(TensorObject *self) {
  if (self->owner) {
    Py_DECREF(self->owner);
  } else if (self->dev) {
    /* the memory, then the device reference; both stay when the device's
     * work does not finish (device_free_in_dealloc) */
    tensor_free_work w = {self->dev, self->data};
    device_free_in_dealloc(self->dev, tensor_free_in_dealloc, &w, 1, "a Tensor's memory");
  }
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

static const char *tensor_dtype_name(const TensorObject *t) {
  return t->dtype == NPY_INT64 ? "int64" : t->dtype == NPY_UINT8 ? "uint8" : "float32";
}

/* A view of a model's buffer may be read only while no other thread's call
 * writes it; 0, or -1 with RuntimeError set. */
static int tensor_check_readable(const TensorObject *t) {
  return t->owner ? model_check_idle((const ModelObject *)t->owner) : 0;
}

static size_t tensor_nbytes(const TensorObject *t) { return (size_t)tensor_size(t) * tensor_itemsize(t); }

PyObject *tensor_view_of_model(ModelObject *owner, float *data, npy_intp n) {
  TensorObject *t = (TensorObject *)TensorType.tp_alloc(&TensorType, 0);
  if (!t) return NULL;
  t->dev = owner->device;
  t->dtype = NPY_FLOAT32;
  t->ndim = 1;
  t->shape[0] = n;
  t->data = data;
  t->owner = Py_NewRef((PyObject *)owner);
  return (PyObject *)t;
}

typedef struct {
  const char *name;
  dp_device *dev;
} tensor_device_work;

static dp_status tensor_device_run(void *p) {
  tensor_device_work *w = p;
  return dp_device_get(w->name, &w->dev);
}

/* bytes between the host and data, memory of dev; with dev's step lock held */
typedef struct {
  dp_device *dev;
  void *data;
  void *host;
  size_t bytes;
} tensor_copy_work;

/* ---- activations between pipeline stages (py_model.c) ------------------------ */

int tensor_float32_data(PyObject *obj, const char *what, dp_device **dev, void **data, npy_intp *first,
                        int64_t *size) {
  if (!PyObject_TypeCheck(obj, &TensorType)) return 0;
  TensorObject *t = (TensorObject *)obj;
  if (t->dtype != NPY_FLOAT32 || t->ndim < 1) {
    PyErr_Format(PyExc_TypeError, "%s: a tensor of float32 activations with a batch axis is needed, got a %d-D %s "
                 "tensor", what, t->ndim, tensor_dtype_name(t));
    return -1;
  }
  if (tensor_check_readable(t) < 0) return -1;
  *dev = t->dev;
  *data = t->data;
  *first = t->shape[0];
  *size = (int64_t)tensor_size(t);
  return 1;
}

int tensor_memory(PyObject *obj, dp_device **dev, void **data, int *npy_type, int *ndim, npy_intp *shape) {
  if (!PyObject_TypeCheck(obj, &TensorType)) return 0;
  TensorObject *t = (TensorObject *)obj;
  if (tensor_check_readable(t) < 0) return -1;
  *dev = t->dev;
  *data = t->data;
  *npy_type = t->dtype;
  *ndim = t->ndim;
  for (int i = 0; i < t->ndim; ++i) shape[i] = t->shape[i];
  return 1;
}

static dp_status tensor_alloc_run(void *p) {
  tensor_copy_work *w = p;
  return dp_device_alloc(w->dev, w->bytes, &w->data);
}

PyObject *tensor_empty_float32(dp_device *like, int ndim, const npy_intp *shape, float **data) {
  TensorObject *t = (TensorObject *)TensorType.tp_alloc(&TensorType, 0);
  if (!t) return NULL;
  t->dtype = NPY_FLOAT32;
  t->ndim = ndim;
  for (int i = 0; i < ndim; ++i) t->shape[i] = shape[i];
  tensor_device_work get = {like->name, NULL};
  if (devices_run_without_gil(NULL, 0, NULL, 0, tensor_device_run, &get) < 0) goto fail;
  t->dev = get.dev; /* a reference of the tensor's own, put by dealloc */
  tensor_copy_work a = {t->dev, NULL, NULL, tensor_nbytes(t)};
  if (devices_run_without_gil(NULL, 0, &t->dev, 1, tensor_alloc_run, &a) < 0) goto fail;
  t->data = a.data;
  *data = a.data;
  return (PyObject *)t;
fail:
  Py_DECREF(t);
  return NULL;
}

/* host to a new allocation (data) */
static dp_status tensor_upload_run(void *p) {
  tensor_copy_work *w = p;
  DP_TRY(dp_device_alloc(w->dev, w->bytes, &w->data));
  dp_status st = w->dev->backend->copy_to_device(w->dev, w->data, w->host, w->bytes);
  /* the data settled: a tensor is ready for any stream and any thread */
  if (st == DP_OK) st = w->dev->backend->synchronize(w->dev);
  if (st != DP_OK) {
    dp_device_free(w->dev, w->data);
    w->data = NULL;
  }
  return st;
}

/* Tensor(array, device): a copy of a float32, int64 or uint8 array on a device. */
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
  PyArrayObject *a = (PyArrayObject *)PyArray_FROM_OTF(obj, elem, NPY_ARRAY_IN_ARRAY | NPY_ARRAY_NOTSWAPPED);
  if (!a) return NULL;
  TensorObject *t = (TensorObject *)type->tp_alloc(type, 0);
  if (!t) goto fail;
  t->dtype = PyArray_TYPE(a);
  t->ndim = PyArray_NDIM(a);
  for (int i = 0; i < t->ndim; ++i) t->shape[i] = PyArray_DIM(a, i);
  /* making a CUDA device takes a while: without the GIL */
  tensor_device_work get = {device, NULL};
  if (devices_run_without_gil(NULL, 0, NULL, 0, tensor_device_run, &get) < 0) goto fail;
  t->dev = get.dev;
  /* a holds the bytes alive while the copy runs without the GIL */
  tensor_copy_work up = {t->dev, NULL, PyArray_DATA(a), tensor_nbytes(t)};
  if (devices_run_without_gil(NULL, 0, &t->dev, 1, tensor_upload_run, &up) < 0) goto fail;
  t->data = up.data;
  Py_DECREF(a);
  return (PyObject *)t;
fail:
  Py_XDECREF(t);
  Py_DECREF(a);
  return NULL;
}

/* A NumPy array sharing the tensor's memory (CPU devices only: the host
 * cannot read a GPU's memory). */
static PyObject *Tensor_view(TensorObject *self, PyObject *unused) {
  if (tensor_check_readable(self) < 0) return NULL;
  if (self->dev->kind != DP_DEVICE_CPU) {
    PyErr_Format(PyExc_ValueError, "a NumPy view of a tensor exists on CPU devices only; this one is on %s (use "
                 "numpy() for a copy)", self->dev->name);
    return NULL;
  }
  PyObject *arr = PyArray_New(&PyArray_Type, self->ndim, self->shape, self->dtype, NULL, self->data, 0,
                              NPY_ARRAY_CARRAY, NULL);
  if (!arr) return NULL;
  if (PyArray_SetBaseObject((PyArrayObject *)arr, Py_NewRef(self)) < 0) {
    Py_DECREF(arr);
    return NULL;
  }
  return arr;
}

static dp_status tensor_download_run(void *p) {
  tensor_copy_work *w = p;
  return w->dev->backend->copy_to_host(w->dev, w->host, w->data, w->bytes);
}

/* A host copy: after the work queued on the device before it (the copy is
 * ordered on the device's stream). A view's model is marked busy meanwhile. */
static PyObject *Tensor_numpy(TensorObject *self, PyObject *unused) {
  if (tensor_check_readable(self) < 0) return NULL;
  PyArrayObject *out = (PyArrayObject *)PyArray_SimpleNew(self->ndim, self->shape, self->dtype);
  if (!out) return NULL;
  tensor_copy_work w = {self->dev, self->data, PyArray_DATA(out), tensor_nbytes(self)};
  PyObject *owners[1] = {self->owner};
  if (devices_run_without_gil(owners, self->owner ? 1 : 0, &self->dev, 1, tensor_download_run, &w) < 0) {
    Py_DECREF(out);
    return NULL;
  }
  return (PyObject *)out;
}

static PyObject *Tensor_get_device(TensorObject *self, void *c) { return PyUnicode_FromString(self->dev->name); }
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
static PyObject *Tensor_get_dtype(TensorObject *self, void *c) { return PyUnicode_FromString(tensor_dtype_name(self)); }

/* tensor([[3. 3.]], device='cpu:0') */
static PyObject *Tensor_repr(TensorObject *self) {
  PyObject *view = Tensor_numpy(self, NULL);
  if (!view) return NULL;
  PyObject *body = PyObject_Str(view);
  Py_DECREF(view);
  if (!body) return NULL;
  PyObject *out = PyUnicode_FromFormat("tensor(%U, device='%s')", body, self->dev->name);
  Py_DECREF(body);
  return out;
}

static PyMethodDef Tensor_methods[] = {
    {"numpy", (PyCFunction)Tensor_numpy, METH_NOARGS, "a NumPy copy of the tensor"},
    {"_view", (PyCFunction)Tensor_view, METH_NOARGS, "a NumPy array sharing the tensor's memory (CPU devices only)"},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef Tensor_getset[] = {{"device", (getter)Tensor_get_device, NULL, "device name", NULL},
                                      {"shape", (getter)Tensor_get_shape, NULL, "shape", NULL},
                                      {"dtype", (getter)Tensor_get_dtype, NULL, "'float32' or 'int64'", NULL},
                                      {NULL, NULL, NULL, NULL, NULL}};

PyTypeObject TensorType = {
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

/* ---- all_reduce ------------------------------------------------------------- */

typedef struct {
  const char **devices;
  float **bufs;
  dp_device **devs; /* the tensors' devices */
  int k;
  int64_t n;
  dp_reduce_op op;
} allreduce_work;

/* Tensors in device memory (CUDA) are reduced through host copies: each
 * copied out, the host buffers reduced as CPU tensors are (the same
 * rank-ordered bits), the result copied back. A stopgap that keeps the
 * chapter-12.5 loop correct on every device kind until the collectives
 * interface reduces device memory where it lies. */
static dp_status allreduce_staged(allreduce_work *w) {
  float **host = calloc((size_t)w->k, sizeof *host);
  if (!host) return DP_FAIL(DP_ERR_MEMORY, "all_reduce: cannot allocate");
  const size_t bytes = sizeof(float) * (size_t)w->n;
  dp_status st = DP_OK;
  for (int r = 0; r < w->k && st == DP_OK; ++r) {
    if (w->devs[r]->kind == DP_DEVICE_CPU) {
      host[r] = w->bufs[r];
    } else if (!(host[r] = malloc(bytes ? bytes : 1))) {
      st = DP_FAIL(DP_ERR_MEMORY, "all_reduce: cannot allocate %zu bytes of host staging", bytes);
    } else {
      st = w->devs[r]->backend->copy_to_host(w->devs[r], host[r], w->bufs[r], bytes);
    }
  }
  if (st == DP_OK) st = dp_allreduce_buffers(w->devices, host, w->k, w->n, w->op);
  for (int r = 0; r < w->k && st == DP_OK; ++r) {
    if (w->devs[r]->kind == DP_DEVICE_CPU) continue;
    st = w->devs[r]->backend->copy_to_device(w->devs[r], w->bufs[r], host[r], bytes);
    if (st == DP_OK) st = w->devs[r]->backend->synchronize(w->devs[r]);
  }
  for (int r = 0; r < w->k; ++r)
    if (host[r] != w->bufs[r]) free(host[r]);
  free(host);
  return st;
}

static dp_status allreduce_run(void *p) {
  allreduce_work *w = p;
  for (int r = 0; r < w->k; ++r)
    if (w->devs[r]->kind != DP_DEVICE_CPU) return allreduce_staged(w);
  /* on the device set's kept group (mirrored.c), not a new one per call */
  return dp_allreduce_buffers(w->devices, w->bufs, w->k, w->n, w->op);
}

/* all_reduce(tensors, op): in place; op 0 = sum, 1 = mean. */
static PyObject *mod_all_reduce(PyObject *mod, PyObject *args) {
  PyObject *seq_obj;
  PyObject *op_obj;
  int op;
  if (!PyArg_ParseTuple(args, "OO", &seq_obj, &op_obj) || int_arg(op_obj, "all_reduce", "op", 0, 1, &op) < 0)
    return NULL;
  /* the reduction runs without the GIL: the tuple keeps every tensor, and
   * every model a view belongs to, alive whatever happens to the list */
  PyObject *items = items_of(seq_obj, "all_reduce needs a list of tensors");
  if (!items) return NULL;
  const Py_ssize_t k = PyTuple_GET_SIZE(items);
  float **bufs = NULL;
  dp_device **devs = NULL;
  const char **devices = NULL; /* the tensors' device names, for the kept group */
  PyObject **owners = NULL; /* the models whose buffers some of the tensors view */
  Py_ssize_t nowners = 0;
  PyObject *ret = NULL;
  if (k < 1) {
    PyErr_SetString(PyExc_ValueError, "all_reduce needs at least one tensor");
    goto done;
  }
  bufs = PyMem_RawMalloc(sizeof(float *) * (size_t)k); /* read without the GIL: a raw allocation */
  devs = PyMem_RawMalloc(sizeof(dp_device *) * (size_t)k);
  devices = PyMem_RawMalloc(sizeof(const char *) * (size_t)k);
  owners = PyMem_Malloc(sizeof(PyObject *) * (size_t)k);
  if (!bufs || !devs || !devices || !owners) {
    PyErr_NoMemory();
    goto done;
  }
  const TensorObject *first = NULL;
  for (Py_ssize_t i = 0; i < k; ++i) {
    PyObject *o = PyTuple_GET_ITEM(items, i);
    if (!PyObject_TypeCheck(o, &TensorType)) {
      PyErr_Format(PyExc_TypeError, "all_reduce: item %zd is %s, not a dpcore tensor", i, Py_TYPE(o)->tp_name);
      goto done;
    }
    TensorObject *t = (TensorObject *)o;
    if (t->dtype != NPY_FLOAT32) {
      PyErr_Format(PyExc_TypeError, "all_reduce: tensor %zd is %s; only float32 tensors are reduced", i,
                   tensor_dtype_name(t));
      goto done;
    }
    if (!first) first = t;
    if (t->ndim != first->ndim || memcmp(t->shape, first->shape, sizeof(npy_intp) * (size_t)t->ndim) != 0) {
      PyErr_Format(PyExc_ValueError, "all_reduce: tensor %zd has a different shape than tensor 0", i);
      goto done;
    }
    for (Py_ssize_t j = 0; j < i; ++j)
      if (strcmp(((const TensorObject *)PyTuple_GET_ITEM(items, j))->dev->name, t->dev->name) == 0) {
        PyErr_Format(PyExc_ValueError, "all_reduce: tensors %zd and %zd are both on %s; give one tensor per device",
                     j, i, t->dev->name);
        goto done;
      }
    bufs[i] = t->data;
    devs[i] = t->dev;
    devices[i] = t->dev->name;
    if (t->owner) owners[nowners++] = t->owner;
  }
  allreduce_work w = {devices, bufs, devs, (int)k, (int64_t)tensor_size(first), op == 1 ? DP_REDUCE_MEAN : DP_REDUCE_SUM};
  if (devices_run_without_gil(owners, nowners, devs, k, allreduce_run, &w) < 0) goto done;
  ret = Py_NewRef(Py_None);
done:
  PyMem_RawFree(bufs);
  PyMem_RawFree(devs);
  PyMem_RawFree(devices);
  PyMem_Free(owners);
  Py_DECREF(items);
  return ret;
}

PyMethodDef tensor_functions[] = {
    {"all_reduce", mod_all_reduce, METH_VARARGS, "all_reduce(tensors, op): in place, op 0 = sum, 1 = mean"},
    {NULL, NULL, 0, NULL}};
