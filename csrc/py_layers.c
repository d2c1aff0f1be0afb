/* py_layers.c — layer specs from Python into a model, and the layer kinds'
 * shape inference without a model: _core.layer_shapes.
 *
 * A Model and layer_shapes read layer tuples through the one function here
 * (model_add_layers), and the core's dp_model_add_layer infers every shape,
 * so that a network is accepted, shaped and refused with the same messages
 * whether it is built or only checked (a checkpoint before its buffers are
 * allocated, a split before its devices are chosen).
 */
#include "py_private.h"

#include <limits.h>
#include <stdio.h>
#include <string.h>

/* One layer spec: (kind, *args), its arguments named and typed by the
 * layer kinds' table (layers.c). Returns -1 with a Python exception for a
 * malformed spec; otherwise 0 and the core's verdict in *st. */
static int layer_from_tuple(dp_model *m, PyObject *spec, dp_status *st) {
  if (!PyTuple_Check(spec) || PyTuple_GET_SIZE(spec) < 1 || !PyUnicode_Check(PyTuple_GET_ITEM(spec, 0))) {
    PyErr_SetString(PyExc_TypeError, "each layer must be a tuple (name, *args)");
    return -1;
  }
  Py_ssize_t len;
  const char *name = PyUnicode_AsUTF8AndSize(PyTuple_GET_ITEM(spec, 0), &len);
  if (!name) return -1;
  /* the whole name: "relu\0x" is not relu */
  const int kind = strlen(name) == (size_t)len ? dp_layer_kind_find(name) : -1;
  if (kind < 0) {
    PyErr_Format(PyExc_ValueError, "unknown layer kind %R", PyTuple_GET_ITEM(spec, 0));
    return -1;
  }
  const dp_layer_kind_info *info = dp_layer_kind_info_of((dp_layer_kind)kind);
  char what[48];
  snprintf(what, sizeof what, "%s (layer %d)", info->op, m->nlayers);
  /* only the arguments the kind takes are parsed; a count it does not take
   * is the core's to refuse, naming the arguments */
  const Py_ssize_t n = PyTuple_GET_SIZE(spec) - 1;
  dp_layer_arg_value args[DP_LAYER_MAX_ARGS] = {{0}};
  for (Py_ssize_t i = 0; i < n && i < info->nargs; ++i) {
    PyObject *item = PyTuple_GET_ITEM(spec, i + 1);
    const dp_layer_arg *arg = &info->args[i];
    if (arg->type == DP_ARG_INT ? int64_arg(item, what, arg->name, &args[i].i) < 0
                                : float64_arg(item, what, arg->name, &args[i].f) < 0)
      return -1;
  }
  *st = dp_model_add_layer(m, (dp_layer_kind)kind, args, n > INT_MAX ? INT_MAX : (int)n);
  return 0;
}

int input_shape_from(PyObject *obj, int64_t shape[3]) {
  PyObject *items = items_of(obj, "input_shape must be a sequence (C, H, W)");
  if (!items) return -1;
  static const char *names[3] = {"channels", "height", "width"};
  int rc = -1;
  if (PySequence_Fast_GET_SIZE(items) != 3) {
    PyErr_Format(PyExc_TypeError, "input_shape must be (C, H, W), got %zd values", PySequence_Fast_GET_SIZE(items));
    goto done;
  }
  for (int i = 0; i < 3; ++i)
    if (int64_arg(PySequence_Fast_GET_ITEM(items, i), "model input", names[i], &shape[i]) < 0) goto done;
  rc = 0;
done:
  Py_DECREF(items);
  return rc;
}

int model_add_layers(dp_model *m, PyObject *layers, PyObject *sources) {
  PyObject *seq = NULL, *srcs = NULL;
  int rc = -1;
  dp_status st;
  /* tuples: converting an item may run Python code, which could shrink a list */
  if (!(seq = items_of(layers, "layers must be a sequence of tuples"))) goto done;
  if (sources != Py_None && !(srcs = items_of(sources, "sources must be a sequence of ints"))) goto done;
  if (srcs && PySequence_Fast_GET_SIZE(srcs) != PySequence_Fast_GET_SIZE(seq)) {
    PyErr_SetString(PyExc_ValueError, "sources must have one entry per layer");
    goto done;
  }
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); ++i) {
    /* the layer's input: an earlier layer, -1 for the model input, None for the previous layer */
    PyObject *src = srcs ? PySequence_Fast_GET_ITEM(srcs, i) : Py_None;
    if (src != Py_None) {
      int64_t v;
      char what[32];
      snprintf(what, sizeof what, "sources[%zd]", i);
      if (int64_arg(src, what, "layer", &v) < 0 || check_status(dp_model_set_source(m, v)) < 0) goto done;
    }
    if (layer_from_tuple(m, PySequence_Fast_GET_ITEM(seq, i), &st) < 0 || check_status(st) < 0) goto done;
  }
  rc = 0;
done:
  Py_XDECREF(srcs);
  Py_XDECREF(seq);
  return rc;
}

PyObject *layer_tensor_shape(const dp_layer *l, int t) {
  const dp_layer_tensor *x = &dp_layer_kind_info_of(l->kind)->tensors[t];
  PyObject *shape = PyTuple_New(x->rank);
  for (int d = 0; shape && d < x->rank; ++d) {
    PyObject *extent = PyLong_FromLongLong(dp_layer_dim_of(l, x->dims[d]));
    if (!extent) Py_CLEAR(shape);
    else PyTuple_SET_ITEM(shape, d, extent);
  }
  return shape;
}

/* (kind, input (C, H, W), output (C, H, W), (shape of each tensor, in the table's order)) of layer l. */
static PyObject *layer_shapes_entry(const dp_layer *l) {
  const dp_layer_kind_info *info = dp_layer_kind_info_of(l->kind);
  PyObject *tensors = PyTuple_New(info->ntensors);
  for (int t = 0; tensors && t < info->ntensors; ++t) {
    PyObject *shape = layer_tensor_shape(l, t);
    if (!shape) Py_CLEAR(tensors);
    else PyTuple_SET_ITEM(tensors, t, shape);
  }
  if (!tensors) return NULL;
  return Py_BuildValue("(s(iii)(iii)N)", info->name, l->in_c, l->in_h, l->in_w, l->out_c, l->out_h, l->out_w,
                       tensors);
}

/* layer_shapes(input_shape, layers, sources=None) -> [(kind, input, output, tensor shapes)]: what a Model of
 * these arguments would be laid out as, refused as a Model refuses it, with no device and nothing allocated. */
static PyObject *mod_layer_shapes(PyObject *mod, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"input_shape", "layers", "sources", NULL};
  PyObject *shape_obj, *layers, *sources = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|O", kwlist, &shape_obj, &layers, &sources)) return NULL;
  int64_t shape[3];
  if (input_shape_from(shape_obj, shape) < 0) return NULL;
  dp_model *m = NULL;
  if (check_status(dp_model_create(NULL, shape[0], shape[1], shape[2], &m)) < 0) return NULL;
  PyObject *out = NULL;
  if (model_add_layers(m, layers, sources) == 0) out = PyList_New(m->nlayers);
  for (int i = 0; out && i < m->nlayers; ++i) {
    PyObject *entry = layer_shapes_entry(&m->layers[i]);
    if (!entry) Py_CLEAR(out);
    else PyList_SET_ITEM(out, i, entry);
  }
  dp_model_destroy(m);
  return out;
}

PyMethodDef layer_functions[] = {
    {"layer_shapes", (PyCFunction)(void (*)(void))mod_layer_shapes, METH_VARARGS | METH_KEYWORDS,
     "layer_shapes(input_shape, layers, sources=None) -> [(kind, input_shape, output_shape, tensor_shapes)]: "
     "a Model's layout of these layers, checked as a Model checks it, without building one"},
    {NULL, NULL, 0, NULL}};
