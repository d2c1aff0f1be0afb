/* py_tensor.c — Tensor (a buffer on a device) and the chapter-12.5 primitive
 * that works on tensors in place: all_reduce. scatter, broadcast and gather
 * are Python (python/dpcore/parallel.py) over Tensor.
 */
#include "py_private.h"

#include <stdlib.h>
#include <string.h>

typedef struct {
  PyObject_HEAD
  char device[32];
  int dtype; /* NPY_FLOAT32, NPY_INT64 or NPY_UINT8 (images) */
  int ndim;
  npy_intp shape[NPY_MAXDIMS];
  void *data;
  /* NULL: the tensor owns data; else the ModelObject whose flat buffer it
   * views (model_view): kept alive, and busy while the model computes */
  PyObject *owner;
} TensorObject;

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

static const char *tensor_dtype_name(const TensorObject *t) {
  return t->dtype == NPY_INT64 ? "int64" : t->dtype == NPY_UINT8 ? "uint8" : "float32";
}

/* A view of a model's buffer may be read only while no other thread's call
 * writes it; 0, or -1 with RuntimeError set. */
static int tensor_check_readable(const TensorObject *t) {
  return t->owner ? model_check_idle((const ModelObject *)t->owner) : 0;
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

PyObject *tensor_view_of_model(ModelObject *owner, float *data, npy_intp n) {
  TensorObject *t = (TensorObject *)TensorType.tp_alloc(&TensorType, 0);
  if (!t) return NULL;
  snprintf(t->device, sizeof t->device, "%s", owner->device.name);
  t->dtype = NPY_FLOAT32;
  t->ndim = 1;
  t->shape[0] = n;
  t->data = data;
  t->owner = Py_NewRef((PyObject *)owner);
  return (PyObject *)t;
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
  TensorObject *t = tensor_alloc(device, PyArray_TYPE(a), PyArray_NDIM(a), PyArray_DIMS(a));
  if (t) memcpy(t->data, PyArray_DATA(a), (size_t)PyArray_NBYTES(a));
  Py_DECREF(a);
  return (PyObject *)t;
}

/* A NumPy array sharing the tensor's memory (CPU devices). */
static PyObject *Tensor_view(TensorObject *self, PyObject *unused) {
  if (tensor_check_readable(self) < 0) return NULL;
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
static PyObject *Tensor_get_dtype(TensorObject *self, void *c) { return PyUnicode_FromString(tensor_dtype_name(self)); }

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
  int k;
  int64_t n;
  dp_reduce_op op;
} allreduce_work;

/* on the device set's kept group (mirrored.c), not a new one per call */
static dp_status allreduce_run(void *p) {
  allreduce_work *w = p;
  return dp_allreduce_buffers(w->devices, w->bufs, w->k, w->n, w->op);
}

/* all_reduce(tensors, op): in place; op 0 = sum, 1 = mean. */
static PyObject *mod_all_reduce(PyObject *mod, PyObject *args) {
  PyObject *seq_obj;
  int op;
  if (!PyArg_ParseTuple(args, "Oi", &seq_obj, &op)) return NULL;
  /* the reduction runs without the GIL: the tuple keeps every tensor, and
   * every model a view belongs to, alive whatever happens to the list */
  PyObject *items = items_of(seq_obj, "all_reduce needs a list of tensors");
  if (!items) return NULL;
  const Py_ssize_t k = PyTuple_GET_SIZE(items);
  float **bufs = NULL;
  const char **devices = NULL; /* the tensors' names, which the tuple keeps alive */
  PyObject **owners = NULL; /* the models whose buffers some of the tensors view */
  Py_ssize_t nowners = 0;
  PyObject *ret = NULL;
  if (k < 1) {
    PyErr_SetString(PyExc_ValueError, "all_reduce needs at least one tensor");
    goto done;
  }
  /* read without the GIL: raw allocations */
  bufs = PyMem_RawMalloc(sizeof(float *) * (size_t)k);
  devices = PyMem_RawMalloc(sizeof(const char *) * (size_t)k);
  owners = PyMem_Malloc(sizeof(PyObject *) * (size_t)k);
  if (!bufs || !devices || !owners) {
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
      if (strcmp(((const TensorObject *)PyTuple_GET_ITEM(items, j))->device, t->device) == 0) {
        PyErr_Format(PyExc_ValueError, "all_reduce: tensors %zd and %zd are both on %s; give one tensor per device",
                     j, i, t->device);
        goto done;
      }
    bufs[i] = t->data;
    devices[i] = t->device;
    if (t->owner) owners[nowners++] = t->owner;
  }
  allreduce_work w = {devices, bufs, (int)k, (int64_t)tensor_size(first), op == 1 ? DP_REDUCE_MEAN : DP_REDUCE_SUM};
  if (models_run_without_gil(owners, nowners, allreduce_run, &w) < 0) goto done;
  ret = Py_NewRef(Py_None);
done:
  PyMem_RawFree(bufs);
  PyMem_RawFree(devices);
  PyMem_Free(owners);
  Py_DECREF(items);
  return ret;
}

PyMethodDef tensor_functions[] = {
    {"all_reduce", mod_all_reduce, METH_VARARGS, "all_reduce(tensors, op): in place, op 0 = sum, 1 = mean"},
    {NULL, NULL, 0, NULL}};
