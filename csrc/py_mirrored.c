/* py_mirrored.c — Mirrored: k replicas (Models, one per device) trained in
 * lockstep, one thread per replica (csrc/mirrored.c).
 *
 * A call marks every replica busy while it runs without the GIL, so a second
 * thread calling the Mirrored or one of its Models gets RuntimeError.
 */
#include "py_private.h"

typedef struct {
  PyObject_HEAD
  PyObject *models; /* tuple of ModelObject; set first by __init__ */
  dp_mirrored *mirrored;
} MirroredObject;

static void Mirrored_dealloc(MirroredObject *self) {
  dp_mirrored_destroy(self->mirrored);
  Py_XDECREF(self->models);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

static int mirrored_ready(MirroredObject *self) {
  if (!self->mirrored) {
    PyErr_SetString(PyExc_RuntimeError, "Mirrored is not initialized");
    return 0;
  }
  return 1;
}

/* Runs work without the GIL with every replica marked busy. */
static int mirrored_run_without_gil(MirroredObject *self, nogil_work work, void *ctx) {
  return models_run_without_gil(PySequence_Fast_ITEMS(self->models), PyTuple_GET_SIZE(self->models), work, ctx);
}

typedef struct {
  dp_model *ptrs[DP_COMM_MAX_REPLICAS];
  int k, sync_batchnorm, across;
  dp_comm_kind kind;
  int64_t bucket_bytes;
  double timeout;
  dp_mirrored *out;
} mirrored_create_work;

static dp_status mirrored_create_run(void *p) {
  mirrored_create_work *w = p;
  if (w->across)
    return dp_mirrored_create_across(w->ptrs, w->k, w->sync_batchnorm, w->kind, w->bucket_bytes, w->timeout, &w->out);
  return dp_mirrored_create(w->ptrs, w->k, w->sync_batchnorm, w->kind, w->bucket_bytes, &w->out);
}

static int Mirrored_init(MirroredObject *self, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"models", "sync_batchnorm", "all_reduce", "bucket_bytes", "timeout", NULL};
  PyObject *seq_obj;
  int sync_batchnorm = 0;
  const char *all_reduce = "auto";
  int64_t bucket_bytes = 25ll << 20; /* PyTorch DDP's default bucket, 25 MiB */
  double timeout = 0.0;              /* > 0: across the processes of the job (MPI) */
  PyObject *bucket_obj = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|psOd", kwlist, &seq_obj, &sync_batchnorm, &all_reduce,
                                   &bucket_obj, &timeout) ||
      (bucket_obj && int64_arg(bucket_obj, "Mirrored", "bucket_bytes", &bucket_bytes) < 0))
    return -1;
  mirrored_create_work w = {.sync_batchnorm = sync_batchnorm, .bucket_bytes = bucket_bytes, .timeout = timeout,
                            .across = timeout != 0.0};
  dp_status st = dp_comm_kind_parse(all_reduce, &w.kind);
  if (st != DP_OK) return raise_from_status(st), -1;
  if (bucket_bytes < 0) {
    PyErr_Format(PyExc_ValueError, "bucket_bytes must be >= 0, got %lld", (long long)bucket_bytes);
    return -1;
  }
  /* models is set before the communicators are made without the GIL, so that
   * a second __init__ meanwhile is refused too */
  if (self->mirrored || self->models) {
    PyErr_SetString(PyExc_RuntimeError, "Mirrored is already initialized");
    return -1;
  }
  PyObject *models = PySequence_Tuple(seq_obj);
  if (!models) return -1;
  Py_ssize_t k = PyTuple_GET_SIZE(models);
  if (k < 1 || k > DP_COMM_MAX_REPLICAS) {
    PyErr_Format(PyExc_ValueError, "Mirrored needs 1 to %d replicas, got %zd", DP_COMM_MAX_REPLICAS, k);
    Py_DECREF(models);
    return -1;
  }
  for (Py_ssize_t r = 0; r < k; ++r) {
    PyObject *o = PyTuple_GET_ITEM(models, r);
    if (!PyObject_TypeCheck(o, &ModelType) || !((ModelObject *)o)->model || !((ModelObject *)o)->model->finalized) {
      PyErr_Format(PyExc_TypeError, "Mirrored: replica %zd is not an initialized Model", r);
      Py_DECREF(models);
      return -1;
    }
    w.ptrs[r] = ((ModelObject *)o)->model;
  }
  w.k = (int)k;
  self->models = models;
  /* NCCL communicators take a while to make */
  if (mirrored_run_without_gil(self, mirrored_create_run, &w) < 0) {
    Py_CLEAR(self->models);
    return -1;
  }
  self->mirrored = w.out;
  return 0;
}

/* ---- the calls on a batch (py_batch.c) -------------------------------------- */

static int mirrored_batch_ready(PyObject *self, batch_work *w) {
  MirroredObject *mo = (MirroredObject *)self;
  if (!mirrored_ready(mo)) return 0;
  w->core = mo->mirrored;
  w->input = mo->mirrored->models[0];
  return 1;
}

/* train_step_rows' residents: residents[r] is the dataset resident on replica
 * r's device; the tuple *keep holds every Resident */
static int mirrored_batch_datasets(PyObject *self, PyObject *R, dp_resident **data, PyObject **keep) {
  PyObject *models = ((MirroredObject *)self)->models;
  PyObject *residents = items_of(R, "residents must be a sequence, one Resident per replica");
  if (!residents) return -1;
  const Py_ssize_t k = PyTuple_GET_SIZE(models);
  if (PyTuple_GET_SIZE(residents) != k) {
    PyErr_Format(PyExc_ValueError, "residents: need one per replica (%zd), got %zd", k, PyTuple_GET_SIZE(residents));
    goto fail;
  }
  for (Py_ssize_t r = 0; r < k; ++r)
    if (!(data[r] = resident_of(PyTuple_GET_ITEM(residents, r), (ModelObject *)PyTuple_GET_ITEM(models, r))))
      goto fail;
  /* one dataset: each replica would otherwise train on its own data under the same rows */
  for (Py_ssize_t r = 1; r < k; ++r)
    if (resident_dataset(PyTuple_GET_ITEM(residents, r)) != resident_dataset(PyTuple_GET_ITEM(residents, 0))) {
      PyErr_Format(PyExc_ValueError,
                   "residents: replica %zd's Resident holds another dataset than replica 0's (from another "
                   "make_resident call): pass the list one make_resident(X, y) returned",
                   r);
      goto fail;
    }
  *keep = residents;
  return 0;
fail:
  Py_DECREF(residents);
  return -1;
}

static int mirrored_batch_run_without_gil(PyObject *self, nogil_work work, void *ctx) {
  return mirrored_run_without_gil((MirroredObject *)self, work, ctx);
}

static dp_status mirrored_batch_compute(batch_work *w) {
  dp_mirrored *m = w->core;
  if (w->call == BATCH_FORWARD_BACKWARD) return dp_mirrored_forward_backward(m, &w->batch, &w->loss, &w->correct);
  if (w->call == BATCH_EVALUATE) return dp_mirrored_evaluate(m, &w->batch, &w->loss, &w->correct);
  return dp_mirrored_train_step(m, &w->batch, w->lr, w->momentum, w->weight_decay, &w->loss, &w->correct);
}

/* Mirrored has no find_nonfinite, and its forward_backward takes no
 * grad_scale: the gradients are all-reduced as a mean. */
static const batch_type mirrored_batches = {mirrored_batch_ready, "residents", mirrored_batch_datasets,
                                            mirrored_batch_run_without_gil, mirrored_batch_compute};

static PyObject *Mirrored_train_step(PyObject *self, PyObject *args, PyObject *kwds) {
  return batch_train_step(&mirrored_batches, self, args, kwds);
}
static PyObject *Mirrored_train_step_rows(PyObject *self, PyObject *args, PyObject *kwds) {
  return batch_train_step_rows(&mirrored_batches, self, args, kwds);
}
static PyObject *Mirrored_forward_backward(PyObject *self, PyObject *args, PyObject *kwds) {
  return batch_on_images(&mirrored_batches, BATCH_FORWARD_BACKWARD, self, args, kwds);
}
static PyObject *Mirrored_evaluate(PyObject *self, PyObject *args, PyObject *kwds) {
  return batch_on_images(&mirrored_batches, BATCH_EVALUATE, self, args, kwds);
}

/* ---- the calls on the replicas' parameters ---------------------------------- */

enum mirrored_call { MIRRORED_BROADCAST, MIRRORED_BROADCAST_ACROSS, MIRRORED_DIGEST };

typedef struct {
  dp_mirrored *mirrored;
  enum mirrored_call call;
  int root; /* broadcast */
  uint64_t digest;
} mirrored_work;

static dp_status mirrored_work_run(void *p) {
  mirrored_work *w = p;
  switch (w->call) {
    case MIRRORED_BROADCAST: return dp_mirrored_broadcast(w->mirrored, w->root);
    case MIRRORED_BROADCAST_ACROSS: return dp_mirrored_broadcast_across(w->mirrored);
    case MIRRORED_DIGEST: break;
  }
  return dp_mirrored_digest(w->mirrored, &w->digest);
}

/* Runs w on self's replicas: 0, or -1 with the exception set. */
static int mirrored_call(MirroredObject *self, mirrored_work *w) {
  if (!mirrored_ready(self)) return -1;
  w->mirrored = self->mirrored;
  return mirrored_run_without_gil(self, mirrored_work_run, w);
}

static PyObject *Mirrored_broadcast(MirroredObject *self, PyObject *args) {
  mirrored_work w = {.call = MIRRORED_BROADCAST};
  PyObject *root = NULL;
  if (!PyArg_ParseTuple(args, "|O", &root) ||
      (root && int_arg(root, "broadcast", "root", 0, DP_COMM_MAX_REPLICAS - 1, &w.root) < 0))
    return NULL;
  if (mirrored_call(self, &w) < 0) return NULL;
  Py_RETURN_NONE;
}

/* broadcast_across(): process 0's replica 0 to every replica of every process, checked. */
static PyObject *Mirrored_broadcast_across(MirroredObject *self, PyObject *unused) {
  mirrored_work w = {.call = MIRRORED_BROADCAST_ACROSS};
  if (mirrored_call(self, &w) < 0) return NULL;
  Py_RETURN_NONE;
}

static PyObject *Mirrored_digest(MirroredObject *self, PyObject *unused) {
  mirrored_work w = {.call = MIRRORED_DIGEST};
  if (mirrored_call(self, &w) < 0) return NULL;
  return PyLong_FromUnsignedLongLong(w.digest);
}

/* (processes, this process, its first replica, the job's replicas) */
static PyObject *Mirrored_get_placement(MirroredObject *self, void *c) {
  if (!mirrored_ready(self)) return NULL;
  const dp_mirrored *m = self->mirrored;
  PyObject *ks = PyTuple_New(m->nproc);
  for (int q = 0; ks && q < m->nproc; ++q) {
    PyObject *v = PyLong_FromLong(m->proc_k ? m->proc_k[q] : m->k);
    if (!v) Py_CLEAR(ks);
    else PyTuple_SET_ITEM(ks, q, v);
  }
  if (!ks) return NULL;
  return Py_BuildValue("{s:i,s:i,s:i,s:i,s:N}", "processes", m->nproc, "process", m->proc, "first", m->first, "total",
                       m->total, "replicas_per_process", ks);
}

static PyObject *Mirrored_get_all_reduce(MirroredObject *self, void *c) {
  if (!mirrored_ready(self)) return NULL;
  return PyUnicode_FromString(dp_comm_kind_name(dp_comm_get_kind(self->mirrored->comm)));
}

/* [(begin, end, ready_layer), ...] in the order the backward pass starts them */
static PyObject *Mirrored_get_buckets(MirroredObject *self, void *c) {
  if (!mirrored_ready(self)) return NULL;
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
    {"placement", (getter)Mirrored_get_placement, NULL,
     "{'processes', 'process', 'first', 'total', 'replicas_per_process'}: where this process's replicas stand", NULL},
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
    {"broadcast_across", (PyCFunction)Mirrored_broadcast_across, METH_NOARGS,
     "broadcast_across(): process 0's parameters and statistics to every replica of every process, checked"},
    {"digest", (PyCFunction)Mirrored_digest, METH_NOARGS,
     "digest() -> int: FNV-1a of replica 0's parameter and statistics bits"},
    {NULL, NULL, 0, NULL}};

PyTypeObject MirroredType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "dpcore._core.Mirrored",
    .tp_basicsize = sizeof(MirroredObject),
    .tp_dealloc = (destructor)Mirrored_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Mirrored(models, sync_batchnorm=False, all_reduce='auto', bucket_bytes=25 MiB, timeout=0): one "
              "replica per device, one thread per replica; timeout > 0: the replicas of every process of an MPI job, "
              "another process waited for at most timeout seconds",
    .tp_methods = Mirrored_methods,
    .tp_getset = Mirrored_getset,
    .tp_init = (initproc)Mirrored_init,
    .tp_new = PyType_GenericNew,
};
