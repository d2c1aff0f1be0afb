/* py_common.c — what every file of the binding shares (py_private.h): the
 * exception types and the one place a dp_status becomes an exception, NumPy's
 * API table, the one way to release the GIL (with the busy mark of the
 * models a call runs on), freeing device memory in a tp_dealloc, the NumPy
 * converters and the argument parsers. It uses no other file of the binding.
 */
#define DP_PY_NUMPY_TABLE /* this file defines NumPy's API table (py_private.h) */
#include "py_private.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

PyObject *DpcoreError;
PyObject *DeviceError;
PyObject *DistributedError;

/* ---- errors: the one place ------------------------------------------------ */

PyObject *raise_from_status(dp_status s) {
  const char *msg = dp_error_message();
  if (!msg || !msg[0]) msg = dp_status_name(s);
  PyObject *type;
  switch (s) {
    case DP_ERR_VALUE: type = PyExc_ValueError; break;
    case DP_ERR_TYPE: type = PyExc_TypeError; break;
    case DP_ERR_MEMORY: type = PyExc_MemoryError; break;
    case DP_ERR_IO: type = PyExc_OSError; break;
    case DP_ERR_CUDA: type = DeviceError; break;
    case DP_ERR_DIST: type = DistributedError; break;
    case DP_ERR_NUMERIC: type = PyExc_FloatingPointError; break;
    default: type = DpcoreError; break;
  }
  PyErr_SetString(type, msg);
  dp_error_clear();
  return NULL;
}

/* ---- set up once, by PyInit__core ------------------------------------------ */

int common_init(void) {
  import_array1(-1);
  PyObject *errors = PyImport_ImportModule("dpcore.errors");
  if (!errors) return -1;
  DpcoreError = PyObject_GetAttrString(errors, "DpcoreError");
  DeviceError = DpcoreError ? PyObject_GetAttrString(errors, "DeviceError") : NULL;
  DistributedError = DeviceError ? PyObject_GetAttrString(errors, "DistributedError") : NULL;
  Py_DECREF(errors);
  return DpcoreError && DeviceError && DistributedError ? 0 : -1;
}

/* ---- the GIL ---------------------------------------------------------------- */

int model_check_idle(const ModelObject *self) {
  if (self->busy) {
    PyErr_SetString(PyExc_RuntimeError, "this model is in use by another thread");
    return -1;
  }
  return 0;
}

/* qsort's comparison of two dp_device pointers by address */
static int device_address_order(const void *a, const void *b) {
  const dp_device *const *x = a, *const *y = b;
  return (uintptr_t)*x < (uintptr_t)*y ? -1 : (uintptr_t)*x > (uintptr_t)*y;
}

/* The one place the GIL is released. Without it: takes the step locks of
 * locks[0..nlocks-1] (distinct, in address order), has the devices take the
 * process-wide CUDA settings (once per call, before its work), runs
 * work(ctx), drops the locks, then runs after(after_ctx, status) unless it is
 * NULL. The step locks are waited for without the GIL and dropped before it
 * is taken back: a thread holding one never waits for the GIL. Returns
 * work's status (or the settings' failure, work not run); its message is this
 * thread's. */
static dp_status locked_run_without_gil(dp_device *const *locks, Py_ssize_t nlocks, nogil_work work, void *ctx,
                                        void (*after)(void *after_ctx, dp_status st), void *after_ctx) {
  dp_status st;
  Py_BEGIN_ALLOW_THREADS
  for (Py_ssize_t i = 0; i < nlocks; ++i) dp_device_lock(locks[i]);
  const unsigned long long settings = dp_cuda_defaults_snapshot();
  st = DP_OK;
  for (Py_ssize_t i = 0; i < nlocks && st == DP_OK; ++i) st = dp_cuda_take_defaults(locks[i], settings);
  if (st == DP_OK) st = work(ctx);
  for (Py_ssize_t i = nlocks; i-- > 0;) dp_device_unlock(locks[i]);
  if (after) after(after_ctx, st);
  Py_END_ALLOW_THREADS
  return st;
}

int devices_run_without_gil(PyObject *const *models, Py_ssize_t n, dp_device *const *devs, Py_ssize_t ndevs,
                            nogil_work work, void *ctx) {
  /* all idle before any is marked, so that a refusal leaves no mark behind */
  for (Py_ssize_t i = 0; i < n; ++i)
    if (model_check_idle((const ModelObject *)models[i]) < 0) return -1;
  /* the distinct devices in address order: the one order every caller takes
   * them in, so that two calls over overlapping sets cannot deadlock */
  dp_device **locks = PyMem_Malloc(sizeof(dp_device *) * (size_t)(n + ndevs + 1));
  if (!locks) return PyErr_NoMemory(), -1;
  Py_ssize_t nlocks = 0;
  for (Py_ssize_t i = 0; i < n + ndevs; ++i) {
    dp_device *d = i < n ? ((const ModelObject *)models[i])->device : devs[i - n];
    if (d) locks[nlocks++] = d; /* NULL: a model whose __init__ is getting its device */
  }
  qsort(locks, (size_t)nlocks, sizeof *locks, device_address_order);
  Py_ssize_t distinct = 0;
  for (Py_ssize_t i = 0; i < nlocks; ++i)
    if (!distinct || locks[distinct - 1] != locks[i]) locks[distinct++] = locks[i];
  for (Py_ssize_t i = 0; i < n; ++i) ((ModelObject *)models[i])->busy = 1;
  const dp_status st = locked_run_without_gil(locks, distinct, work, ctx, NULL, NULL);
  PyMem_Free(locks);
  for (Py_ssize_t i = 0; i < n; ++i) ((ModelObject *)models[i])->busy = 0;
  /* the message is thread-local and the work ran on this thread */
  if (st != DP_OK) return raise_from_status(st), -1;
  return 0;
}

int models_run_without_gil(PyObject *const *models, Py_ssize_t n, nogil_work work, void *ctx) {
  return devices_run_without_gil(models, n, NULL, 0, work, ctx);
}

/* A RuntimeWarning from a tp_dealloc: the exception being raised (if any)
 * is kept, and a warning that cannot be issued (warnings as errors, or the
 * interpreter shutting down) is printed as unraisable instead. */
static void warn_in_dealloc(const char *message) {
#if PY_VERSION_HEX >= 0x030C0000
  PyObject *raised = PyErr_GetRaisedException();
#else
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
#endif
  if (PyErr_WarnEx(PyExc_RuntimeWarning, message, 1) < 0) PyErr_WriteUnraisable(NULL);
#if PY_VERSION_HEX >= 0x030C0000
  PyErr_SetRaisedException(raised);
#else
  PyErr_Restore(type, value, traceback);
#endif
}

/* device_free_in_dealloc's work, under the device's step lock */
typedef struct dealloc_work {
  dp_device *dev;
  void (*free_fn)(void *ctx);
  void *ctx;
  int put_device;
} dealloc_work;

static dp_status dealloc_run(void *p) {
  const dealloc_work *w = p;
  DP_TRY(dp_cuda_wait_idle(w->dev, DP_DEALLOC_WAIT_SECONDS));
  w->free_fn(w->ctx);
  return DP_OK;
}

/* after the lock is dropped: the last reference destroys the device (and its
 * lock), which waits for its GPU too */
static void dealloc_put(void *p, dp_status st) {
  const dealloc_work *w = p;
  if (st == DP_OK && w->put_device) dp_device_put(w->dev);
}

int device_free_in_dealloc(dp_device *dev, void (*free_fn)(void *ctx), void *ctx, int put_device, const char *what) {
  if (dev->kind != DP_DEVICE_CUDA) {
    /* host memory that no queued work reads: freed at once, as ever */
    free_fn(ctx);
    if (put_device) dp_device_put(dev);
    return 1;
  }
  char name[sizeof dev->name];
  memcpy(name, dev->name, sizeof name); /* dev may be gone after the call */
  dealloc_work w = {dev, free_fn, ctx, put_device};
  dp_device *const locks[1] = {dev};
  const dp_status st = locked_run_without_gil(locks, 1, dealloc_run, &w, dealloc_put, &w);
  if (st == DP_OK) return 1;
  char message[768];
  snprintf(message, sizeof message, "dpcore: %s on %s was not freed, and its device memory stays allocated for "
           "good: %s", what, name, dp_error_message());
  dp_error_clear();
  warn_in_dealloc(message);
  return 0;
}

/* ---- array converters ----------------------------------------------------- */

const char *dtype_name(PyArrayObject *a) { return PyArray_DESCR(a)->typeobj->tp_name; }

PyArrayObject *as_float32(PyObject *obj, int rank, const char *what) {
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

PyArrayObject *new_float32(int rank, const npy_intp *dims) {
  return (PyArrayObject *)PyArray_ZEROS(rank, (npy_intp *)dims, NPY_FLOAT32, 0);
}

int convert_images(PyObject *obj, const dp_model *m, PyArrayObject **out, int *is_u8) {
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

int convert_labels(PyObject *obj, npy_intp n, PyArrayObject **out) {
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

PyArrayObject *convert_rows(PyObject *obj) {
  if (!PyArray_Check(obj) || PyArray_TYPE((PyArrayObject *)obj) != NPY_INT64 ||
      PyArray_NDIM((PyArrayObject *)obj) != 1) {
    PyErr_SetString(PyExc_TypeError, "rows must be a 1-D int64 numpy array of sample indices");
    return NULL;
  }
  return (PyArrayObject *)PyArray_FROM_OTF(obj, NPY_INT64, NPY_ARRAY_IN_ARRAY | NPY_ARRAY_NOTSWAPPED);
}

PyObject *items_of(PyObject *obj, const char *what) {
  PyObject *seq = PySequence_Fast(obj, what);
  if (!seq) return NULL;
  PyObject *items = PyList_Check(seq) ? PyList_AsTuple(seq) : Py_NewRef(seq);
  Py_DECREF(seq);
  return items;
}

/* ---- arguments ------------------------------------------------------------- */

int int64_arg(PyObject *obj, const char *what, const char *name, int64_t *out) {
  /* True is an int to Python, but as a size it is a mistake, not a 1 */
  if (!PyIndex_Check(obj) || PyBool_Check(obj)) {
    PyErr_Format(PyExc_TypeError, "%s: %s must be an integer, got %s", what, name, Py_TYPE(obj)->tp_name);
    return -1;
  }
  int overflow = 0;
  long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
  if (v == -1 && PyErr_Occurred()) return -1;
  if (overflow) {
    PyErr_Format(PyExc_ValueError, "%s: %s %S is out of range (more than 64 bits)", what, name, obj);
    return -1;
  }
  *out = v;
  return 0;
}

int int_arg(PyObject *obj, const char *what, const char *name, int64_t lo, int64_t hi, int *out) {
  int64_t v;
  if (int64_arg(obj, what, name, &v) < 0) return -1;
  if (v < lo || v > hi) {
    PyErr_Format(PyExc_ValueError, "%s: %s must be in [%lld, %lld], got %lld", what, name, (long long)lo,
                 (long long)hi, (long long)v);
    return -1;
  }
  *out = (int)v;
  return 0;
}

int float64_arg(PyObject *obj, const char *what, const char *name, double *out) {
  if (PyBool_Check(obj)) {
    PyErr_Format(PyExc_TypeError, "%s: %s must be a real number, got bool", what, name);
    return -1;
  }
  double v = PyFloat_AsDouble(obj);
  if (v == -1.0 && PyErr_Occurred()) {
    if (PyErr_ExceptionMatches(PyExc_OverflowError)) { /* an int beyond a double's range */
      PyErr_Clear();
      PyErr_Format(PyExc_ValueError, "%s: %s %S is out of range", what, name, obj);
    } else if (PyErr_ExceptionMatches(PyExc_TypeError)) {
      PyErr_Clear();
      PyErr_Format(PyExc_TypeError, "%s: %s must be a real number, got %s", what, name, Py_TYPE(obj)->tp_name);
    }
    return -1;
  }
  *out = v;
  return 0;
}

int sgd_args_from(const char *what, PyObject *lr, PyObject *momentum, PyObject *weight_decay, float *lr_out,
                  float *momentum_out, float *weight_decay_out) {
  PyObject *const objs[3] = {lr, momentum, weight_decay};
  static const char *names[3] = {"lr", "momentum", "weight_decay"};
  double v[3] = {0.0, 0.0, 0.0};
  for (int i = 0; i < 3; ++i)
    if (objs[i] && float64_arg(objs[i], what, names[i], &v[i]) < 0) return -1;
  if (check_status(dp_sgd_args_check(v[0], v[1], v[2])) < 0) return -1;
  *lr_out = (float)v[0];
  *momentum_out = (float)v[1];
  *weight_decay_out = (float)v[2];
  return 0;
}

int grad_scale_from(const char *what, PyObject *obj, float *out) {
  double v;
  if (float64_arg(obj, what, "grad_scale", &v) < 0 || check_status(dp_grad_scale_check(v)) < 0) return -1;
  *out = (float)v;
  return 0;
}

