/* py_device.c — the device registry's module functions (csrc/device.h):
 * the logical-device configuration, the listing with each device's physical
 * GPU and core share, and the live devices (a debugging aid for the tests).
 * python/dpcore/devices.py is the public API over them.
 */
#include "py_private.h"

#include <limits.h>
#include <string.h>

/* (name, kind, index, physical, threads) */
static PyObject *device_info_tuple(const dp_device_info *d) {
  return Py_BuildValue("(ssiii)", d->name, d->kind == DP_DEVICE_CPU ? "cpu" : "cuda", d->index, d->physical,
                       d->nthreads);
}

/* set_logical_devices(kind, count): 'cpu' or 'cuda'. */
static PyObject *mod_set_logical_devices(PyObject *mod, PyObject *args) {
  const char *kind;
  PyObject *count_obj;
  if (!PyArg_ParseTuple(args, "sO!", &kind, &PyLong_Type, &count_obj)) return NULL;
  int overflow = 0;
  long long count = PyLong_AsLongLongAndOverflow(count_obj, &overflow);
  if (count == -1 && PyErr_Occurred()) return NULL;
  /* out of range either way: the registry names the range */
  if (overflow || count > INT_MAX || count < INT_MIN) count = overflow < 0 || count < 0 ? INT_MIN : INT_MAX;
  dp_device_kind k;
  if (strcmp(kind, "cpu") == 0) {
    k = DP_DEVICE_CPU;
  } else if (strcmp(kind, "cuda") == 0) {
    k = DP_DEVICE_CUDA;
  } else {
    PyErr_Format(PyExc_ValueError, "logical devices can be set for 'cpu' or 'cuda', got '%s'", kind);
    return NULL;
  }
  dp_status st = dp_devices_set_logical(k, (int)count);
  if (st != DP_OK) return raise_from_status(st);
  Py_RETURN_NONE;
}

/* list_devices() -> [(name, kind, index, physical, threads)]: what a get makes now. */
static PyObject *mod_list_devices(PyObject *mod, PyObject *unused) {
  dp_device_info infos[2 * DP_DEVICES_MAX];
  int n = dp_devices_list(infos, 2 * DP_DEVICES_MAX);
  if (n > 2 * DP_DEVICES_MAX) n = 2 * DP_DEVICES_MAX;
  PyObject *out = PyList_New(n);
  for (int i = 0; out && i < n; ++i) {
    PyObject *t = device_info_tuple(&infos[i]);
    if (!t) Py_CLEAR(out);
    else PyList_SET_ITEM(out, i, t);
  }
  return out;
}

/* live_devices() -> [(name, kind, index, physical, threads, references)] */
static PyObject *mod_live_devices(PyObject *mod, PyObject *unused) {
  enum { MAX_LIVE = 256 };
  dp_device_info infos[MAX_LIVE];
  int refs[MAX_LIVE];
  int n = dp_devices_live(infos, refs, MAX_LIVE);
  if (n > MAX_LIVE) n = MAX_LIVE;
  PyObject *out = PyList_New(n);
  for (int i = 0; out && i < n; ++i) {
    const dp_device_info *d = &infos[i];
    PyObject *t = Py_BuildValue("(ssiiii)", d->name, d->kind == DP_DEVICE_CPU ? "cpu" : "cuda", d->index,
                                d->physical, d->nthreads, refs[i]);
    if (!t) Py_CLEAR(out);
    else PyList_SET_ITEM(out, i, t);
  }
  return out;
}

PyMethodDef device_functions[] = {
    {"set_logical_devices", mod_set_logical_devices, METH_VARARGS,
     "set_logical_devices(kind, count): split the CPU ('cpu') or each physical GPU ('cuda') into count devices"},
    {"list_devices", mod_list_devices, METH_NOARGS,
     "list_devices() -> [(name, kind, index, physical_gpu, threads)] under the current configuration"},
    {"live_devices", mod_live_devices, METH_NOARGS,
     "live_devices() -> [(name, kind, index, physical_gpu, threads, references)]: the registry's devices"},
    {NULL, NULL, 0, NULL}};
