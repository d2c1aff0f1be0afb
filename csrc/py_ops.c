/* py_ops.c — single ops (tests, notebooks): the CPU backend's kernels on
 * NumPy arrays, each checked against a reference in tests/test_ops.py.
 *
 * They run on one module-level CPU device with every core and hold the GIL:
 * the device's scratch memory is shared by all calls. Every status the
 * backend returns is checked: a failing kernel is an exception, never a
 * result full of whatever the output held. Strides, paddings and kernels are
 * parsed in 64 bits and shapes made by shapes.c, as a model's layers' are: an
 * absurd one is a ValueError naming it, never an OverflowError or a size that
 * wrapped around an int.
 */
#include "py_private.h"

#include <limits.h>

#include <stdlib.h>

static dp_device ops_device;

int ops_init(void) { return check_status(dp_cpu_device_init(&ops_device, 0, dp_cpu_core_count())); }

/* The arrays of a layer op (conv2d, dense): inputs x, w and b or dy (t);
 * outputs y (forward) or dx, dw, db (backward). */
typedef struct {
  PyArrayObject *x, *w, *t, *y, *dx, *dw, *db;
} layer_arrays;

/* x and w of the given rank, and third (b: (out,), or dy of x's rank; None
 * allowed). 0, or -1 with the exception set. */
static int layer_arrays_convert(layer_arrays *a, PyObject *xo, PyObject *wo, PyObject *third, int rank,
                                int backward) {
  if (!(a->x = as_float32(xo, rank, "x")) || !(a->w = as_float32(wo, rank, "w"))) return -1;
  if (third != Py_None && !(a->t = as_float32(third, backward ? rank : 1, backward ? "dy" : "b"))) return -1;
  return 0;
}

/* The op's result: y, or (dx, dw, db); a new reference or NULL. */
static PyObject *layer_arrays_result(const layer_arrays *a, int backward) {
  return backward ? Py_BuildValue("(OOO)", a->dx, a->dw, a->db) : Py_NewRef(a->y);
}

static void layer_arrays_clear(layer_arrays *a) {
  Py_CLEAR(a->x);
  Py_CLEAR(a->w);
  Py_CLEAR(a->t);
  Py_CLEAR(a->y);
  Py_CLEAR(a->dx);
  Py_CLEAR(a->dw);
  Py_CLEAR(a->db);
}

static PyObject *ops_conv2d(PyObject *args, int backward) {
  PyObject *xo, *wo, *third, *stride_obj, *pad_obj;
  int64_t stride, pad;
  if (!PyArg_ParseTuple(args, "OOOOO", &xo, &wo, &third, &stride_obj, &pad_obj)) return NULL;
  if (int64_arg(stride_obj, "conv2d", "stride", &stride) < 0 || int64_arg(pad_obj, "conv2d", "padding", &pad) < 0)
    return NULL;
  layer_arrays a = {0};
  PyObject *ret = NULL;
  const dp_backend *be = ops_device.backend;
  if (layer_arrays_convert(&a, xo, wo, third, 4, backward) < 0) goto done;
  const npy_intp *xd = PyArray_DIMS(a.x), *wd = PyArray_DIMS(a.w);
  if (xd[1] != wd[1]) {
    PyErr_Format(PyExc_ValueError, "x has %ld channels but w expects %ld", (long)xd[1], (long)wd[1]);
    goto done;
  }
  dp_conv_geom g;
  if (check_status(dp_conv_geom_make("conv2d", xd[1], xd[2], xd[3], wd[0], wd[2], wd[3], stride, pad, &g)) < 0)
    goto done;
  npy_intp yd[4] = {xd[0], g.O, g.OH, g.OW};
  /* the process-wide precision (dpcore.set_precision), as a model's call takes it; the GIL is held */
  if (check_status(dp_cuda_take_defaults(&ops_device, dp_cuda_defaults_snapshot())) < 0) goto done;
  if (!backward) {
    if (a.t && PyArray_DIM(a.t, 0) != g.O) {
      PyErr_Format(PyExc_ValueError, "b must have shape (%d,), got (%ld,)", g.O, (long)PyArray_DIM(a.t, 0));
      goto done;
    }
    if (!(a.y = new_float32(4, yd))) goto done;
    if (check_status(be->conv2d_forward(&ops_device, &g, xd[0], PyArray_DATA(a.x), PyArray_DATA(a.w),
                                        a.t ? PyArray_DATA(a.t) : NULL, PyArray_DATA(a.y), NULL)) < 0)
      goto done;
  } else {
    if (!a.t) {
      PyErr_SetString(PyExc_TypeError, "dy is required");
      goto done;
    }
    for (int i = 0; i < 4; ++i)
      if (PyArray_DIM(a.t, i) != yd[i]) {
        PyErr_Format(PyExc_ValueError, "dy must have shape (%ld, %ld, %ld, %ld)", (long)yd[0], (long)yd[1],
                     (long)yd[2], (long)yd[3]);
        goto done;
      }
    npy_intp bd = g.O;
    if (!(a.dx = new_float32(4, xd)) || !(a.dw = new_float32(4, wd)) || !(a.db = new_float32(1, &bd))) goto done;
    if (check_status(be->conv2d_backward(&ops_device, &g, xd[0], PyArray_DATA(a.x), PyArray_DATA(a.w),
                                         PyArray_DATA(a.t), PyArray_DATA(a.dx), PyArray_DATA(a.dw),
                                         PyArray_DATA(a.db), NULL)) < 0)
      goto done;
  }
  ret = layer_arrays_result(&a, backward);
done:
  layer_arrays_clear(&a);
  return ret;
}

static PyObject *op_conv2d_forward(PyObject *m, PyObject *a) { return ops_conv2d(a, 0); }
static PyObject *op_conv2d_backward(PyObject *m, PyObject *a) { return ops_conv2d(a, 1); }

/* 0 when extent fits the int the backends take; else -1 with a ValueError naming it */
static int fits_int(npy_intp extent, const char *what) {
  if (extent <= INT_MAX) return 0;
  PyErr_Format(PyExc_ValueError, "%s: %lld is more than dpcore takes (at most %d)", what, (long long)extent, INT_MAX);
  return -1;
}

static PyObject *ops_dense(PyObject *args, int backward) {
  PyObject *xo, *wo, *third;
  if (!PyArg_ParseTuple(args, "OOO", &xo, &wo, &third)) return NULL;
  layer_arrays a = {0};
  PyObject *ret = NULL;
  const dp_backend *be = ops_device.backend;
  if (layer_arrays_convert(&a, xo, wo, third, 2, backward) < 0) goto done;
  npy_intp N = PyArray_DIM(a.x, 0), nin = PyArray_DIM(a.x, 1), nout = PyArray_DIM(a.w, 0);
  if (PyArray_DIM(a.w, 1) != nin) {
    PyErr_Format(PyExc_ValueError, "x has %ld features but w expects %ld", (long)nin, (long)PyArray_DIM(a.w, 1));
    goto done;
  }
  if (fits_int(nin, "dense: the input features") < 0 || fits_int(nout, "dense: the output features") < 0) goto done;
  if (!backward) {
    if (a.t && PyArray_DIM(a.t, 0) != nout) {
      PyErr_Format(PyExc_ValueError, "b must have shape (%ld,)", (long)nout);
      goto done;
    }
    npy_intp yd[2] = {N, nout};
    if (!(a.y = new_float32(2, yd))) goto done;
    if (check_status(be->dense_forward(&ops_device, N, (int)nin, (int)nout, PyArray_DATA(a.x), PyArray_DATA(a.w),
                                       a.t ? PyArray_DATA(a.t) : NULL, PyArray_DATA(a.y))) < 0)
      goto done;
  } else {
    if (!a.t || PyArray_DIM(a.t, 0) != N || PyArray_DIM(a.t, 1) != nout) {
      PyErr_Format(PyExc_ValueError, "dy must have shape (%ld, %ld)", (long)N, (long)nout);
      goto done;
    }
    if (!(a.dx = new_float32(2, PyArray_DIMS(a.x))) || !(a.dw = new_float32(2, PyArray_DIMS(a.w))) ||
        !(a.db = new_float32(1, &nout)))
      goto done;
    if (check_status(be->dense_backward(&ops_device, N, (int)nin, (int)nout, PyArray_DATA(a.x), PyArray_DATA(a.w),
                                        PyArray_DATA(a.t), PyArray_DATA(a.dx), PyArray_DATA(a.dw),
                                        PyArray_DATA(a.db))) < 0)
      goto done;
  }
  ret = layer_arrays_result(&a, backward);
done:
  layer_arrays_clear(&a);
  return ret;
}

static PyObject *op_dense_forward(PyObject *m, PyObject *a) { return ops_dense(a, 0); }
static PyObject *op_dense_backward(PyObject *m, PyObject *a) { return ops_dense(a, 1); }

static PyObject *op_relu_forward(PyObject *mod, PyObject *xo) {
  PyArrayObject *x = NULL, *y = NULL;
  PyObject *ret = NULL;
  if (!(x = as_float32(xo, -1, "x")) || !(y = new_float32(PyArray_NDIM(x), PyArray_DIMS(x)))) goto done;
  if (check_status(ops_device.backend->relu_forward(&ops_device, PyArray_SIZE(x), PyArray_DATA(x),
                                                    PyArray_DATA(y))) < 0)
    goto done;
  ret = Py_NewRef(y);
done:
  Py_XDECREF(x);
  Py_XDECREF(y);
  return ret;
}

/* relu_backward(y, dy): y is the forward output */
static PyObject *op_relu_backward(PyObject *mod, PyObject *args) {
  PyObject *yo, *dyo;
  if (!PyArg_ParseTuple(args, "OO", &yo, &dyo)) return NULL;
  PyArrayObject *y = NULL, *dy = NULL, *dx = NULL;
  PyObject *ret = NULL;
  if (!(y = as_float32(yo, -1, "y")) || !(dy = as_float32(dyo, PyArray_NDIM(y), "dy"))) goto done;
  if (!PyArray_SAMESHAPE(y, dy)) {
    PyErr_SetString(PyExc_ValueError, "y and dy must have the same shape");
    goto done;
  }
  if (!(dx = new_float32(PyArray_NDIM(y), PyArray_DIMS(y)))) goto done;
  if (check_status(ops_device.backend->relu_backward(&ops_device, PyArray_SIZE(y), PyArray_DATA(y), PyArray_DATA(dy),
                                                     PyArray_DATA(dx))) < 0)
    goto done;
  ret = Py_NewRef(dx);
done:
  Py_XDECREF(y);
  Py_XDECREF(dy);
  Py_XDECREF(dx);
  return ret;
}

/* pool(kind, x, k, stride, pad[, dy]) — forward returns y, backward returns dx. */
static PyObject *ops_pool(PyObject *args, int is_max, int backward) {
  PyObject *xo, *dyo = NULL, *k_obj, *stride_obj, *pad_obj;
  if (backward ? !PyArg_ParseTuple(args, "OOOOO", &xo, &dyo, &k_obj, &stride_obj, &pad_obj)
               : !PyArg_ParseTuple(args, "OOOO", &xo, &k_obj, &stride_obj, &pad_obj))
    return NULL;
  const char *op = is_max ? "max_pool2d" : "avg_pool2d";
  int64_t k, stride, pad;
  if (int64_arg(k_obj, op, "kernel", &k) < 0 || int64_arg(stride_obj, op, "stride", &stride) < 0 ||
      int64_arg(pad_obj, op, "padding", &pad) < 0)
    return NULL;
  PyArrayObject *x = NULL, *dy = NULL, *y = NULL, *dx = NULL;
  int32_t *arg = NULL;
  PyObject *ret = NULL;
  const dp_backend *be = ops_device.backend;
  if (!(x = as_float32(xo, 4, "x"))) goto done;
  const npy_intp *xd = PyArray_DIMS(x);
  dp_pool_geom g;
  if (check_status(dp_pool_geom_make(op, xd[1], xd[2], xd[3], k, stride, pad, &g)) < 0) goto done;
  npy_intp yd[4] = {xd[0], xd[1], g.OH, g.OW};
  if (!(y = new_float32(4, yd))) goto done;
  /* max pooling's backward needs the forward's winners: the forward runs either way */
  if (is_max) {
    arg = malloc(sizeof(int32_t) * (size_t)(PyArray_SIZE(y) ? PyArray_SIZE(y) : 1));
    if (!arg) {
      PyErr_NoMemory();
      goto done;
    }
  }
  if (check_status(is_max ? be->maxpool_forward(&ops_device, &g, xd[0], PyArray_DATA(x), PyArray_DATA(y), arg)
                          : be->avgpool_forward(&ops_device, &g, xd[0], PyArray_DATA(x), PyArray_DATA(y))) < 0)
    goto done;
  if (!backward) {
    ret = Py_NewRef(y);
    goto done;
  }
  if (!(dy = as_float32(dyo, 4, "dy"))) goto done;
  if (!PyArray_SAMESHAPE(dy, y)) {
    PyErr_Format(PyExc_ValueError, "dy must have shape (%ld, %ld, %ld, %ld)", (long)yd[0], (long)yd[1], (long)yd[2],
                 (long)yd[3]);
    goto done;
  }
  if (!(dx = new_float32(4, xd))) goto done;
  if (check_status(is_max ? be->maxpool_backward(&ops_device, &g, xd[0], PyArray_DATA(dy), arg, PyArray_DATA(dx))
                          : be->avgpool_backward(&ops_device, &g, xd[0], PyArray_DATA(dy), PyArray_DATA(dx))) < 0)
    goto done;
  ret = Py_NewRef(dx);
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
  if (fits_int(K, "softmax_cross_entropy: the classes") < 0) goto done;
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
  if (check_status(ops_device.backend->softmax_xent(&ops_device, N, (int)K, PyArray_DATA(logits), lab, scale,
                                                    PyArray_DATA(d), &loss, &correct)) < 0)
    goto done;
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
  PyObject *lr_obj, *mu_obj, *wd_obj;
  float lr, mu, wd;
  if (!PyArg_ParseTuple(args, "OOOOOO", &wo, &go, &vo, &lr_obj, &mu_obj, &wd_obj) ||
      sgd_args_from("sgd_update", lr_obj, mu_obj, wd_obj, &lr, &mu, &wd) < 0)
    return NULL;
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
  if (check_status(ops_device.backend->sgd_update(&ops_device, PyArray_SIZE(arrs[0]), PyArray_DATA(arrs[0]),
                                                  PyArray_DATA(arrs[1]), PyArray_DATA(arrs[2]), lr, mu, wd, NULL)) < 0)
    goto done;
  ret = Py_NewRef(Py_None);
done:
  for (int i = 0; i < 3; ++i) Py_XDECREF(arrs[i]);
  return ret;
}

PyMethodDef ops_functions[] = {
    {"conv2d_forward", op_conv2d_forward, METH_VARARGS, "conv2d_forward(x, w, b|None, stride, pad) -> y"},
    {"conv2d_backward", op_conv2d_backward, METH_VARARGS, "conv2d_backward(x, w, dy, stride, pad) -> (dx, dw, db)"},
    {"dense_forward", op_dense_forward, METH_VARARGS, "dense_forward(x, w, b|None) -> y"},
    {"dense_backward", op_dense_backward, METH_VARARGS, "dense_backward(x, w, dy) -> (dx, dw, db)"},
    {"relu_forward", op_relu_forward, METH_O, "relu_forward(x) -> y"},
    {"relu_backward", op_relu_backward, METH_VARARGS, "relu_backward(y, dy) -> dx (y: forward output)"},
    {"avg_pool2d_forward", op_avg_pool2d_forward, METH_VARARGS, "avg_pool2d_forward(x, k, stride, pad)"},
    {"avg_pool2d_backward", op_avg_pool2d_backward, METH_VARARGS, "avg_pool2d_backward(x, dy, k, stride, pad) -> dx"},
    {"max_pool2d_forward", op_max_pool2d_forward, METH_VARARGS, "max_pool2d_forward(x, k, stride, pad)"},
    {"max_pool2d_backward", op_max_pool2d_backward, METH_VARARGS, "max_pool2d_backward(x, dy, k, stride, pad) -> dx"},
    {"softmax_cross_entropy", op_softmax_cross_entropy, METH_VARARGS,
     "softmax_cross_entropy(logits, labels, scale) -> (loss_sum, correct, dlogits)"},
    {"sgd_update", op_sgd_update, METH_VARARGS, "sgd_update(w, g, v, lr, momentum, weight_decay), in place"},
    {NULL, NULL, 0, NULL}};
