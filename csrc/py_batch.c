/* py_batch.c — the calls on a batch that Model and Mirrored share
 * (train_step, train_step_rows, forward_backward, evaluate, find_nonfinite):
 * the arguments parsed, the batch converted, the call run without the GIL
 * by the type's own compute, (loss_sum, correct) built. A type brings a
 * batch_type (py_private.h) and a method table of one-line wrappers, so that
 * both take the same argument names and raise the same errors.
 */
#include "py_private.h"

static dp_status batch_run(void *p) {
  batch_work *w = p;
  if (w->call == BATCH_TRAIN_STEP && w->batch.n == 0) return DP_OK; /* an empty batch changes nothing */
  return w->type->compute(w);
}

/* Runs w on self and builds its result; w holds the call, its arguments and
 * its batch. */
static PyObject *batch_result(PyObject *self, batch_work *w) {
  if (w->type->run_without_gil(self, batch_run, w) < 0) return NULL;
  if (w->call == BATCH_FIND_NONFINITE) return Py_BuildValue("(ii)", w->layer, w->what);
  return Py_BuildValue("(dL)", w->loss, (long long)w->correct);
}

/* The call w on host images X and labels Y (converted for w->input). */
static PyObject *batch_on_arrays(PyObject *self, PyObject *X, PyObject *Y, batch_work *w) {
  if (!w->type->ready(self, w)) return NULL;
  PyArrayObject *xa = NULL, *ya = NULL;
  PyObject *ret = NULL;
  int is_u8 = 0;
  if (convert_images(X, w->input, &xa, &is_u8) < 0) goto done;
  if (convert_labels(Y, PyArray_DIM(xa, 0), &ya) < 0) goto done;
  w->batch = (dp_batch){PyArray_DATA(xa), is_u8, (const int64_t *)PyArray_DATA(ya), (int64_t)PyArray_DIM(xa, 0),
                        NULL, NULL};
  ret = batch_result(self, w);
done:
  Py_XDECREF(xa);
  Py_XDECREF(ya);
  return ret;
}

PyObject *batch_train_step(const batch_type *t, PyObject *self, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"images", "labels", "lr", "momentum", "weight_decay", NULL};
  PyObject *X, *Y, *lr, *momentum = NULL, *weight_decay = NULL;
  batch_work w = {.type = t, .call = BATCH_TRAIN_STEP};
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO|OO", kwlist, &X, &Y, &lr, &momentum, &weight_decay) ||
      sgd_args_from("train_step", lr, momentum, weight_decay, &w.lr, &w.momentum, &w.weight_decay) < 0)
    return NULL;
  return batch_on_arrays(self, X, Y, &w);
}

PyObject *batch_forward_backward(const batch_type *t, PyObject *self, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"images", "labels", "grad_scale", NULL};
  PyObject *X, *Y, *grad_scale;
  batch_work w = {.type = t, .call = BATCH_FORWARD_BACKWARD};
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO", kwlist, &X, &Y, &grad_scale) ||
      grad_scale_from("forward_backward", grad_scale, &w.grad_scale) < 0)
    return NULL;
  return batch_on_arrays(self, X, Y, &w);
}

PyObject *batch_on_images(const batch_type *t, batch_call call, PyObject *self, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"images", "labels", NULL};
  PyObject *X, *Y;
  batch_work w = {.type = t, .call = call};
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO", kwlist, &X, &Y)) return NULL;
  return batch_on_arrays(self, X, Y, &w);
}

PyObject *batch_train_step_rows(const batch_type *t, PyObject *self, PyObject *args, PyObject *kwds) {
  char *kwlist[] = {(char *)t->datasets_name, "rows", "lr", "momentum", "weight_decay", NULL};
  PyObject *R, *rows_obj, *lr, *momentum = NULL, *weight_decay = NULL;
  batch_work w = {.type = t, .call = BATCH_TRAIN_STEP};
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO|OO", kwlist, &R, &rows_obj, &lr, &momentum, &weight_decay) ||
      sgd_args_from("train_step_rows", lr, momentum, weight_decay, &w.lr, &w.momentum, &w.weight_decay) < 0)
    return NULL;
  if (!t->ready(self, &w)) return NULL;
  /* the step runs without the GIL: keep holds every dataset alive whatever
   * happens to the caller's objects */
  dp_resident *data[DP_COMM_MAX_REPLICAS];
  PyObject *keep = NULL, *ret = NULL;
  PyArrayObject *rows = NULL;
  if (t->datasets(self, R, data, &keep) < 0) goto done;
  if (!(rows = convert_rows(rows_obj))) goto done;
  w.batch = (dp_batch){NULL, 0, NULL, (int64_t)PyArray_DIM(rows, 0), (const int64_t *)PyArray_DATA(rows), data};
  ret = batch_result(self, &w);
done:
  Py_XDECREF(rows);
  Py_XDECREF(keep);
  return ret;
}
