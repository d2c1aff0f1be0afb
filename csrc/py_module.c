/* py_module.c — module dpcore._core: PyInit__core, the module functions
 * (build and runtime info, CUDA options, shard ranges, benchmarks), and the
 * helpers every file of the binding shares (py_private.h): dp_status to
 * exception, the NumPy converters, and the one way to release the GIL.
 */
#define DP_PY_MODULE_INIT /* this file defines NumPy's API table (py_private.h) */
#include "py_private.h"

#include <cblas.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "comm.h"
#include "dist.h"
#include "dp_limits.h"
#include "small_gemm.h"
#include "winograd_lanes.h"
#include "dp_build_config.h"
#ifdef DP_HAVE_CUDA
#include "dp_cuda.h"
#endif

/* OpenBLAS extension: the build's configuration string. */
extern char *openblas_get_config(void);

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

/* ---- the GIL ---------------------------------------------------------------- */

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

/* ---- module functions ------------------------------------------------------- */

typedef struct {
  int k, iters;
  int64_t n;
  double seconds;
} benchmark_work;

static dp_status benchmark_run(void *p) {
  benchmark_work *w = p;
  return dp_allreduce_benchmark(w->k, w->n, w->iters, &w->seconds);
}

/* allreduce_benchmark(k, n, iters) -> seconds for iters all-reduces of n floats */
static PyObject *mod_allreduce_benchmark(PyObject *mod, PyObject *args) {
  PyObject *k_obj, *n_obj, *iters_obj;
  benchmark_work w = {0, 0, 0, 0.0};
  if (!PyArg_ParseTuple(args, "OOO", &k_obj, &n_obj, &iters_obj) ||
      int_arg(k_obj, "allreduce_benchmark", "k", 1, DP_COMM_MAX_REPLICAS, &w.k) < 0 ||
      int64_arg(n_obj, "allreduce_benchmark", "n", &w.n) < 0 ||
      int_arg(iters_obj, "allreduce_benchmark", "iters", 1, INT_MAX, &w.iters) < 0)
    return NULL;
  if (models_run_without_gil(NULL, 0, benchmark_run, &w) < 0) return NULL;
  return PyFloat_FromDouble(w.seconds);
}

/* cudnn_conv_output_dim(N, C, H, W, O, KH, KW, stride, pad) -> (n, c, h, w) as cuDNN infers it */
static PyObject *mod_cudnn_conv_output_dim(PyObject *mod, PyObject *args) {
  dp_conv_geom g = {0};
  int N;
  static const char *names[9] = {"N", "C", "H", "W", "O", "KH", "KW", "stride", "pad"};
  int *const fields[9] = {&N, &g.C, &g.H, &g.W, &g.O, &g.KH, &g.KW, &g.stride, &g.pad};
  PyObject *objs[9];
  if (!PyArg_ParseTuple(args, "OOOOOOOOO", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4], &objs[5], &objs[6],
                        &objs[7], &objs[8]))
    return NULL;
  for (int i = 0; i < 9; ++i)
    if (int_arg(objs[i], "cudnn_conv_output_dim", names[i], INT_MIN, INT_MAX, fields[i]) < 0) return NULL;
  int out[4] = {0, 0, 0, 0};
  dp_status st = dp_cudnn_conv_output_dim(&g, N, out);
  if (st != DP_OK) return raise_from_status(st);
  return Py_BuildValue("(iiii)", out[0], out[1], out[2], out[3]);
}

/* shard_ranges(n, k) -> [(begin, end)]: the split the trainer uses. */
static PyObject *mod_shard_ranges(PyObject *mod, PyObject *args) {
  PyObject *n_obj, *k_obj;
  int64_t n;
  int k;
  if (!PyArg_ParseTuple(args, "OO", &n_obj, &k_obj) || int64_arg(n_obj, "shard_ranges", "n", &n) < 0 ||
      int_arg(k_obj, "shard_ranges", "k", 1, DP_MAX_FEATURES, &k) < 0)
    return NULL;
  if (n < 0) {
    PyErr_Format(PyExc_ValueError, "shard_ranges: n must be >= 0, got %lld", (long long)n);
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

/* One layer kind's table entry (layers.h) as a dict; a new reference or NULL. */
static PyObject *layer_kind_dict(const dp_layer_kind_info *info) {
  PyObject *d = NULL, *args = PyTuple_New(info->nargs), *types = PyTuple_New(info->nargs), *defaults = PyDict_New(),
           *tensors = PyTuple_New(info->ntensors);
  if (!args || !types || !defaults || !tensors) goto done;
  for (int i = 0; i < info->nargs; ++i) {
    const dp_layer_arg *a = &info->args[i];
    const int is_int = a->type == DP_ARG_INT;
    PyObject *name = PyUnicode_FromString(a->name), *type = PyUnicode_FromString(is_int ? "int" : "float");
    if (!name || !type) {
      Py_XDECREF(name);
      Py_XDECREF(type);
      goto done;
    }
    PyTuple_SET_ITEM(args, i, name);
    PyTuple_SET_ITEM(types, i, type);
    if (!a->optional) continue;
    PyObject *v = is_int ? PyLong_FromLongLong(a->fallback.i) : PyFloat_FromDouble(a->fallback.f);
    if (!v || PyDict_SetItemString(defaults, a->name, v) < 0) {
      Py_XDECREF(v);
      goto done;
    }
    Py_DECREF(v);
  }
  for (int t = 0; t < info->ntensors; ++t) {
    const dp_layer_tensor *x = &info->tensors[t];
    PyObject *dims = PyTuple_New(x->rank), *init = PyDict_New(), *item = NULL;
    for (int k = 0; dims && k < x->rank; ++k) {
      PyObject *dim = PyUnicode_FromString(dp_layer_dim_name(x->dims[k]));
      if (!dim) Py_CLEAR(dims);
      else PyTuple_SET_ITEM(dims, k, dim);
    }
    for (int mode = 0; init && mode < DP_INIT_MODE_COUNT; ++mode) {
      PyObject *rule = PyUnicode_FromString(dp_init_rule_name(x->init[mode]));
      if (!rule || PyDict_SetItemString(init, dp_init_mode_name((dp_init_mode)mode), rule) < 0) Py_CLEAR(init);
      Py_XDECREF(rule);
    }
    if (dims && init)
      item = Py_BuildValue("(ssOO)", x->name, x->buffer == DP_BUFFER_PARAMS ? "params" : "state", dims, init);
    Py_XDECREF(dims);
    Py_XDECREF(init);
    if (!item) goto done;
    PyTuple_SET_ITEM(tensors, t, item);
  }
  d = Py_BuildValue("{s:s,s:O,s:O,s:O,s:i,s:z,s:z,s:N,s:O}", "op", info->op, "args", args, "types", types, "defaults",
                    defaults, "sources", info->sources, "joins", dp_layer_join_name(info->joins), "split",
                    dp_layer_split_name(info->split), "view", PyBool_FromLong(info->view), "tensors", tensors);
done:
  Py_XDECREF(args);
  Py_XDECREF(types);
  Py_XDECREF(defaults);
  Py_XDECREF(tensors);
  return d;
}

/* layer_kinds() -> {name: {op, args, types, defaults, sources, joins, split, view, tensors}}: the
 * layer kinds' table (csrc/layers.c), in its order. joins: 'sum' or None; split: 'output', 'channels' or
 * None (layers.h). A tensor is (name, 'params'|'state', dims, {init mode: rule}). */
static PyObject *mod_layer_kinds(PyObject *m, PyObject *unused) {
  PyObject *out = PyDict_New();
  for (int k = 0; out && k < DP_LAYER_KIND_COUNT; ++k) {
    const dp_layer_kind_info *info = dp_layer_kind_info_of((dp_layer_kind)k);
    PyObject *d = layer_kind_dict(info);
    if (!d || PyDict_SetItemString(out, info->name, d) < 0) Py_CLEAR(out);
    Py_XDECREF(d);
  }
  return out;
}

static PyObject *mod_build_info_json(PyObject *m, PyObject *unused) { return PyUnicode_FromString(DP_BUILD_INFO_JSON); }

/* The physical GPUs: [{'name', 'memory_bytes', 'compute_capability'}], a new list or NULL. */
static PyObject *runtime_gpus(int count) {
  PyObject *gpus = PyList_New(0);
#ifdef DP_HAVE_CUDA
  for (int g = 0; gpus && g < count; ++g) {
    char name[256];
    size_t mem = 0;
    int major = 0, minor = 0;
    if (dp_cuda_describe(g, name, sizeof name, &mem, &major, &minor) != 0) continue;
    PyObject *d = Py_BuildValue("{s:s,s:n,s:(ii)}", "name", name, "memory_bytes", (Py_ssize_t)mem,
                                "compute_capability", major, minor);
    if (!d || PyList_Append(gpus, d) < 0) Py_CLEAR(gpus);
    Py_XDECREF(d);
  }
#endif
  return gpus;
}

static PyObject *mod_runtime_info(PyObject *m, PyObject *unused) {
  int count = 0, rt = 0, drv = 0;
  char why[256] = "built without CUDA";
#ifdef DP_HAVE_CUDA
  /* fails only as "no GPU": count 0 and why say what is missing */
  if (dp_cuda_probe(&count, why, sizeof why, &rt, &drv) != 0) count = 0;
#endif
  PyObject *gpus = runtime_gpus(count);
  if (!gpus) return NULL;
  return Py_BuildValue("{s:i,s:s,s:N,s:i,s:i,s:i,s:i,s:s,s:n,s:s,s:i,s:s}", "cuda_device_count", count, "cuda_why", why,
                       "cuda_devices", gpus, "cuda_runtime_version", rt, "cuda_driver_version", drv, "cpu_cores",
                       dp_cpu_core_count(), "openmp", (int)_OPENMP, "blas_config", openblas_get_config(),
                       "cudnn_version", (Py_ssize_t)dp_cudnn_version(), "mpi_library", dp_dist_library_version(),
                       "mpi_cuda_aware", dp_dist_cuda_aware(), "cpu_gemm",
                       dp_small_gemm_built() == 2   ? "dpcore AVX-512 8x32 (DPCORE_OWN_GEMM=0: the BLAS)"
                       : dp_small_gemm_built() == 1 ? "dpcore AVX2 6x16 (DPCORE_OWN_GEMM=0: the BLAS)"
                                                    : "the BLAS");
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
    if (!u || PyList_Append(out, u) < 0) Py_CLEAR(out);
    Py_XDECREF(u);
  }
  return out;
}

/* comm_null_entries(kind) -> [names of the entries the comm kind's ops table
 * leaves NULL]; None when this build has no table for the kind. Needs no device. */
static PyObject *mod_comm_null_entries(PyObject *m, PyObject *args) {
  const char *name;
  if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
  dp_comm_kind kind = DP_COMM_KIND_COUNT;
  for (int i = 0; i < DP_COMM_KIND_COUNT; ++i)
    if (strcmp(name, dp_comm_kind_name((dp_comm_kind)i)) == 0) kind = (dp_comm_kind)i;
  if (kind == DP_COMM_KIND_COUNT) {
    PyErr_Format(PyExc_ValueError, "unknown all-reduce kind '%s' (host, kernel, nccl, mpi)", name);
    return NULL;
  }
  const char *names[16];
  const int n = dp_comm_ops_null_entries(kind, names, 16);
  if (n < 0) Py_RETURN_NONE;
  PyObject *out = PyList_New(0);
  for (int i = 0; out && i < n && i < 16; ++i) {
    PyObject *u = PyUnicode_FromString(names[i]);
    if (!u || PyList_Append(out, u) < 0) Py_CLEAR(out);
    Py_XDECREF(u);
  }
  return out;
}

/* set_fast_convolutions(flag) / get_fast_convolutions(): the CPU's fast
 * convolution forms (backend.h: dp_set_fast_convolutions); dpcore.config
 * validates the flag. */
static PyObject *mod_set_fast_convolutions(PyObject *m, PyObject *args) {
  int fast;
  if (!PyArg_ParseTuple(args, "p", &fast)) return NULL;
  dp_set_fast_convolutions(fast);
  Py_RETURN_NONE;
}

static PyObject *mod_get_fast_convolutions(PyObject *m, PyObject *unused) {
  return PyBool_FromLong(dp_get_fast_convolutions());
}

/* debug_counters() -> {'groups_created': replica thread groups made by this process,
 * 'gemm_blas' / 'gemm_own': dp_gemm calls sent to the BLAS / to dpcore's kernel,
 * 'winograd_f35' / 'winograd_f43': passes run by those Winograd forms} */
static PyObject *mod_debug_counters(PyObject *m, PyObject *unused) {
  long long blas, own, f35, f43;
  dp_gemm_counts(&blas, &own);
  dp_wl_counts(&f35, &f43);
  return Py_BuildValue("{s:l,s:L,s:L,s:L,s:L}", "groups_created", dp_group_created_count(), "gemm_blas", blas,
                       "gemm_own", own, "winograd_f35", f35, "winograd_f43", f43);
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
    {"layer_kinds", mod_layer_kinds, METH_NOARGS,
     "layer_kinds() -> {name: {op, args, types, defaults, sources, joins, split, view, tensors}}: the table of "
     "layer kinds"},
    {"build_info_json", mod_build_info_json, METH_NOARGS, "what the build found and used, as JSON"},
    {"runtime_info", mod_runtime_info, METH_NOARGS, "devices and libraries found at run time"},
    {"allreduce_benchmark", mod_allreduce_benchmark, METH_VARARGS,
     "allreduce_benchmark(k, n, iters) -> seconds for iters in-process all-reduces of n floats"},
    {"cudnn_conv_output_dim", mod_cudnn_conv_output_dim, METH_VARARGS,
     "cudnn_conv_output_dim(N, C, H, W, O, KH, KW, stride, pad) -> (n, c, h, w) from cuDNN's shape inference"},
    {"shard_ranges", mod_shard_ranges, METH_VARARGS, "shard_ranges(n, k) -> [(begin, end)] per replica"},
    {"comm_null_entries", mod_comm_null_entries, METH_VARARGS,
     "comm_null_entries(kind) -> names of the NULL entries of the all-reduce kind's ops table (None: not built)"},
    {"set_fast_convolutions", mod_set_fast_convolutions, METH_VARARGS,
     "set_fast_convolutions(flag): let the CPU take the convolution forms of larger rounding error"},
    {"get_fast_convolutions", mod_get_fast_convolutions, METH_NOARGS, "get_fast_convolutions() -> bool"},
    {"debug_counters", mod_debug_counters, METH_NOARGS, "debug_counters() -> {'groups_created': n, 'gemm_blas': n, 'gemm_own': n, 'winograd_f35': n, 'winograd_f43': n}"},
    {"set_cuda_options", mod_set_cuda_options, METH_VARARGS,
     "set_cuda_options(deterministic, allow_tf32): process-wide settings of every CUDA device"},
    {"get_cuda_options", mod_get_cuda_options, METH_NOARGS, "get_cuda_options() -> (deterministic, allow_tf32)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "dpcore._core",
                                        "dpcore's C core (see python/dpcore for the API)", -1, module_methods,
                                        NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__core(void) {
  import_array();
  PyObject *errors = PyImport_ImportModule("dpcore.errors");
  if (!errors) return NULL;
  DpcoreError = PyObject_GetAttrString(errors, "DpcoreError");
  DeviceError = DpcoreError ? PyObject_GetAttrString(errors, "DeviceError") : NULL;
  DistributedError = DeviceError ? PyObject_GetAttrString(errors, "DistributedError") : NULL;
  Py_DECREF(errors);
  if (!DpcoreError || !DeviceError || !DistributedError) return NULL;
  if (PyType_Ready(&ModelType) < 0 || PyType_Ready(&TensorType) < 0 || PyType_Ready(&MirroredType) < 0 ||
      PyType_Ready(&ResidentType) < 0)
    return NULL;
  if (ops_init() < 0) return NULL;
  /* before any thread of dpcore exists: it sets the environment */
  const dp_status env = dp_comm_process_init();
  if (env != DP_OK) return raise_from_status(env);
  PyObject *m = PyModule_Create(&module_def);
  if (!m) return NULL;
  if (PyModule_AddFunctions(m, tensor_functions) < 0 || PyModule_AddFunctions(m, ops_functions) < 0 ||
      PyModule_AddFunctions(m, device_functions) < 0 || PyModule_AddFunctions(m, dist_functions) < 0 ||
      PyModule_AddFunctions(m, layer_functions) < 0 ||
      PyModule_AddObjectRef(m, "Model", (PyObject *)&ModelType) < 0 ||
      PyModule_AddObjectRef(m, "Tensor", (PyObject *)&TensorType) < 0 ||
      PyModule_AddObjectRef(m, "Mirrored", (PyObject *)&MirroredType) < 0 ||
      PyModule_AddObjectRef(m, "Resident", (PyObject *)&ResidentType) < 0 ||
      PyModule_AddIntConstant(m, "MAX_THREADS", DP_MAX_THREADS) < 0 ||
      PyModule_AddIntConstant(m, "MAX_FEATURES", DP_MAX_FEATURES) < 0 ||
      PyModule_AddIntConstant(m, "MAX_PARAMS", DP_MAX_PARAMS) < 0 ||
      PyModule_AddIntConstant(m, "MAX_BATCH", DP_MAX_BATCH) < 0 ||
      PyModule_AddIntConstant(m, "MAX_DEVICES", DP_DEVICES_MAX) < 0) {
    Py_DECREF(m);
    return NULL;
  }
  return m;
}
