/* py_module.c — module dpcore._core: PyInit__core, which gathers the types
 * and functions of the other files, and the module functions of its own
 * (build and runtime info, CUDA options, shard ranges, benchmarks). The
 * helpers the files share are py_common.c's.
 */
#include "py_private.h"

#include <cblas.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "comm.h"
#include "cpu_caches.h"
#include "dist.h"
#include "dp_limits.h"
#include "small_gemm.h"
#include "winograd_lanes.h"
#include "fft_lanes.h"
#include "dp_build_config.h"
#ifdef DP_HAVE_CUDA
#include "dp_cuda.h"
#endif

/* OpenBLAS extension: the build's configuration string. */
extern char *openblas_get_config(void);
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
  return Py_BuildValue("{s:i,s:s,s:N,s:i,s:i,s:i,s:L,s:s,s:i,s:s,s:n,s:s,s:i,s:s}", "cuda_device_count", count, "cuda_why", why,
                       "cuda_devices", gpus, "cuda_runtime_version", rt, "cuda_driver_version", drv, "cpu_cores",
                       dp_cpu_core_count(), "cpu_l2_bytes", (long long)dp_cpu_l2_bytes(), "cpu_l2_source",
                       dp_cpu_l2_source(), "openmp", (int)_OPENMP, "blas_config", openblas_get_config(),
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
 * 'winograd_f35' / 'winograd_f43': passes run by those Winograd forms, 'fft': by fft_lanes.h, 'fft_redone': its forward outputs recomputed directly,
 * 'conv_relu_pool': backward passes of a direct convolution run from its fused ReLU + pooling's output gradient} */
static PyObject *mod_debug_counters(PyObject *m, PyObject *unused) {
  long long blas, own, f35, f43;
  dp_gemm_counts(&blas, &own);
  dp_wl_counts(&f35, &f43);
  return Py_BuildValue("{s:l,s:L,s:L,s:L,s:L,s:L,s:L,s:L}", "groups_created", dp_group_created_count(),
                       "gemm_blas", blas, "gemm_own", own, "winograd_f35", f35, "winograd_f43", f43, "fft",
                       dp_fft_count(), "fft_redone", dp_fft_redone(), "conv_relu_pool", dp_cpu_conv_relu_pool_count());
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
    {"debug_counters", mod_debug_counters, METH_NOARGS, "debug_counters() -> {'groups_created': n, 'gemm_blas': n, 'gemm_own': n, 'winograd_f35': n, 'winograd_f43': n, 'fft': n, 'fft_redone': n, 'conv_relu_pool': n}"},
    {"set_cuda_options", mod_set_cuda_options, METH_VARARGS,
     "set_cuda_options(deterministic, allow_tf32): process-wide settings of every CUDA device"},
    {"get_cuda_options", mod_get_cuda_options, METH_NOARGS, "get_cuda_options() -> (deterministic, allow_tf32)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "dpcore._core",
                                        "dpcore's C core (see python/dpcore for the API)", -1, module_methods,
                                        NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__core(void) {
  if (common_init() < 0) return NULL;
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
      PyModule_AddFunctions(m, layer_functions) < 0 || PyModule_AddFunctions(m, model_functions) < 0 ||
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
