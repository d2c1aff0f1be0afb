/* py_dist.c — the processes of a job (csrc/dist.h) as module functions:
 * joining the job, its ranks, and the few collectives python/dpcore needs
 * beside the mirrored steps (broadcast, allgather, barrier), each waiting
 * without the GIL and against a deadline. python/dpcore/distributed.py is the
 * public API over them.
 */
#include "py_private.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "dist.h"
#include "dist_nccl.h"

static PyObject *info_dict(const dp_dist_info *i) {
  return Py_BuildValue("{s:i,s:i,s:i,s:i,s:O,s:O,s:i,s:O}", "rank", i->rank, "world_size", i->size, "local_rank",
                       i->local_rank, "local_size", i->local_size, "mpi_initialized",
                       i->mpi_initialized ? Py_True : Py_False, "initialized_here",
                       i->initialized_here ? Py_True : Py_False, "thread_level", i->thread_level, "launched",
                       i->launched ? Py_True : Py_False);
}

typedef struct {
  dp_dist_info info;
} init_work;

static dp_status init_run(void *p) { return dp_dist_init(&((init_work *)p)->info); }

/* dist_init() -> info dict: joins the job (MPI_Init_thread under mpirun). */
static PyObject *mod_dist_init(PyObject *m, PyObject *unused) {
  init_work w;
  memset(&w, 0, sizeof w);
  /* MPI_Init waits for the other processes: without the GIL */
  if (models_run_without_gil(NULL, 0, init_run, &w) < 0) return NULL;
  return info_dict(&w.info);
}

static PyObject *mod_dist_info(PyObject *m, PyObject *unused) {
  const dp_dist_info i = dp_dist_get_info();
  return info_dict(&i);
}

static dp_status finalize_run(void *p) { return dp_dist_finalize(); }

static PyObject *mod_dist_finalize(PyObject *m, PyObject *unused) {
  if (models_run_without_gil(NULL, 0, finalize_run, NULL) < 0) return NULL;
  Py_RETURN_NONE;
}

static dp_status abort_run(void *p) {
  dp_dist_abort(*(const int *)p);
  return DP_OK;
}

/* dist_abort(code): MPI_Abort; returns only when MPI is not running. */
static PyObject *mod_dist_abort(PyObject *m, PyObject *args) {
  int code = 1;
  PyObject *code_obj = NULL;
  if (!PyArg_ParseTuple(args, "|O", &code_obj) ||
      (code_obj && int_arg(code_obj, "dist_abort", "code", INT_MIN, INT_MAX, &code) < 0))
    return NULL;
  /* without the GIL: mpirun may take a moment to end us */
  if (models_run_without_gil(NULL, 0, abort_run, &code) < 0) return NULL;
  Py_RETURN_NONE;
}

static PyObject *mod_dist_is_broken(PyObject *m, PyObject *unused) { return PyBool_FromLong(dp_dist_is_broken()); }

static PyObject *mod_dist_library(PyObject *m, PyObject *unused) {
  return Py_BuildValue("{s:O,s:s,s:i,s:O}", "built", dp_dist_built() ? Py_True : Py_False, "version",
                       dp_dist_library_version(), "cuda_aware", dp_dist_cuda_aware(), "nccl_p2p",
                       dp_nccl_p2p_built() ? Py_True : Py_False);
}

/* dist_gpu_uid(gpu) -> the number naming physical GPU `gpu` among the job's (two processes on one GPU get
 * the same), 0 when CUDA cannot say or dpcore was built without NCCL. */
static PyObject *mod_dist_gpu_uid(PyObject *m, PyObject *args) {
  int gpu;
  if (!PyArg_ParseTuple(args, "i", &gpu)) return NULL;
  if (gpu < 0) {
    PyErr_Format(PyExc_ValueError, "gpu must be >= 0, got %d", gpu);
    return NULL;
  }
  uint64_t uid;
  Py_BEGIN_ALLOW_THREADS
  uid = dp_nccl_gpu_uid(gpu); /* the first call starts CUDA */
  Py_END_ALLOW_THREADS
  return PyLong_FromUnsignedLongLong((unsigned long long)uid);
}

/* The timeout and what-string arguments every collective takes. */
static int wait_args(double timeout, const char *what) {
  if (!(timeout > 0.0) || !isfinite(timeout)) {
    char text[96]; /* PyErr_Format has no %g */
    snprintf(text, sizeof text, "timeout must be a finite number of seconds > 0, got %g", timeout);
    PyErr_SetString(PyExc_ValueError, text);
    return -1;
  }
  return what ? 0 : -1;
}

/* One call's arguments, for the function that runs it without the GIL. */
typedef struct {
  const void *mine;
  int64_t bytes;
  void *all;
  void *buf;
  int root;
  double timeout;
  const char *what;
  double scale;      /* all-reduce */
  dp_dist_desc desc; /* point to point */
  int peer, tag, is_send;
  int64_t seq;
  void *stream; /* a GPU message: its device's stream */
} coll_work;

static dp_status allgather_run(void *p) {
  coll_work *w = p;
  return dp_dist_allgather(w->mine, w->bytes, w->all, w->timeout, w->what);
}

/* dist_allgather(data: bytes, timeout, what) -> [bytes of rank 0, rank 1, ...];
 * every process passes the same length. */
static PyObject *mod_dist_allgather(PyObject *m, PyObject *args) {
  Py_buffer mine;
  coll_work w;
  memset(&w, 0, sizeof w);
  if (!PyArg_ParseTuple(args, "y*ds", &mine, &w.timeout, &w.what)) return NULL;
  PyObject *ret = NULL, *all = NULL;
  if (wait_args(w.timeout, w.what) < 0) goto done;
  const dp_dist_info info = dp_dist_get_info();
  if (mine.len > (1 << 30) / (info.size > 0 ? info.size : 1)) {
    PyErr_Format(PyExc_ValueError, "allgather: %zd bytes from each of %d processes is too much", mine.len, info.size);
    goto done;
  }
  all = PyBytes_FromStringAndSize(NULL, mine.len * info.size);
  if (!all) goto done;
  w.mine = mine.buf;
  w.bytes = mine.len;
  w.all = PyBytes_AS_STRING(all);
  if (models_run_without_gil(NULL, 0, allgather_run, &w) < 0) goto done;
  ret = PyList_New(info.size);
  for (int q = 0; ret && q < info.size; ++q) {
    PyObject *b = PyBytes_FromStringAndSize(PyBytes_AS_STRING(all) + (Py_ssize_t)q * mine.len, mine.len);
    if (!b) Py_CLEAR(ret);
    else PyList_SET_ITEM(ret, q, b);
  }
done:
  Py_XDECREF(all);
  PyBuffer_Release(&mine);
  return ret;
}

/* run(w) without the GIL over obj's writable, C-contiguous buffer (w->buf, w->bytes); float32:
 * the buffer must hold float32. The buffer stays exported (and so unresizable) meanwhile. */
static PyObject *run_on_buffer(PyObject *obj, int float32, coll_work *w, dp_status (*run)(void *)) {
  Py_buffer buf;
  if (PyObject_GetBuffer(obj, &buf, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | (float32 ? PyBUF_FORMAT : 0)) < 0)
    return NULL;
  if (float32 && (!buf.format || strcmp(buf.format, "f") != 0 || buf.itemsize != 4)) {
    PyErr_Format(PyExc_TypeError, "%s: a float32 buffer, got format '%s'", w->what, buf.format ? buf.format : "B");
    PyBuffer_Release(&buf);
    return NULL;
  }
  w->buf = buf.buf;
  w->bytes = buf.len;
  const int rc = models_run_without_gil(NULL, 0, run, w);
  PyBuffer_Release(&buf);
  if (rc < 0) return NULL;
  Py_RETURN_NONE;
}

static dp_status bcast_run(void *p) {
  coll_work *w = p;
  return dp_dist_bcast(w->buf, w->bytes, w->root, w->timeout, w->what);
}

/* dist_bcast(buffer, root, timeout, what): root's bytes into every process's
 * writable, contiguous buffer (a bytearray, a NumPy array), in place. */
static PyObject *mod_dist_bcast(PyObject *m, PyObject *args) {
  PyObject *obj;
  coll_work w;
  memset(&w, 0, sizeof w);
  PyObject *root;
  if (!PyArg_ParseTuple(args, "OOds", &obj, &root, &w.timeout, &w.what) ||
      int_arg(root, "dist_bcast", "root", 0, INT_MAX, &w.root) < 0)
    return NULL;
  if (wait_args(w.timeout, w.what) < 0) return NULL;
  return run_on_buffer(obj, 0, &w, bcast_run);
}

static dp_status barrier_run(void *p) {
  coll_work *w = p;
  return dp_dist_barrier(w->timeout, w->what);
}

static PyObject *mod_dist_barrier(PyObject *m, PyObject *args) {
  coll_work w;
  memset(&w, 0, sizeof w);
  if (!PyArg_ParseTuple(args, "ds", &w.timeout, &w.what)) return NULL;
  if (wait_args(w.timeout, w.what) < 0) return NULL;
  if (models_run_without_gil(NULL, 0, barrier_run, &w) < 0) return NULL;
  Py_RETURN_NONE;
}

typedef struct {
  int64_t n;
  int k, iters;
  double timeout, seconds;
} chain_bench_work;

static double monotonic_seconds(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* k buffers of n zeros (finite however many sums), two warm-up calls, then
 * iters timed calls of the gradient all-reduce's chain. */
static dp_status chain_bench_run(void *p) {
  chain_bench_work *w = p;
  float *bufs[DP_COMM_MAX_REPLICAS] = {0};
  float *stage = malloc(sizeof(float) * 2 * DP_DIST_SEGMENT);
  dp_status st = stage ? DP_OK : DP_FAIL(DP_ERR_MEMORY, "chain benchmark: staging");
  for (int r = 0; r < w->k && st == DP_OK; ++r)
    if (!(bufs[r] = calloc((size_t)w->n, sizeof(float))))
      st = DP_FAIL(DP_ERR_MEMORY, "chain benchmark: %lld floats", (long long)w->n);
  for (int i = 0; i < 2 && st == DP_OK; ++i)
    st = dp_dist_chain_allreduce(bufs, w->k, w->n, 1.0f, 0, stage, w->timeout, "the chain benchmark (warm-up)");
  const double start = monotonic_seconds();
  for (int i = 0; i < w->iters && st == DP_OK; ++i)
    st = dp_dist_chain_allreduce(bufs, w->k, w->n, 1.0f, 0, stage, w->timeout, "the chain benchmark");
  w->seconds = monotonic_seconds() - start;
  for (int r = 0; r < w->k; ++r) free(bufs[r]);
  free(stage);
  return st;
}

/* dist_chain_benchmark(n, k, iters, timeout) -> seconds for iters all-reduces
 * of n floats over k local buffers per process (every process calls it). */
static PyObject *mod_dist_chain_benchmark(PyObject *m, PyObject *args) {
  chain_bench_work w;
  memset(&w, 0, sizeof w);
  PyObject *n_obj, *k_obj, *iters_obj;
  int64_t n;
  if (!PyArg_ParseTuple(args, "OOOd", &n_obj, &k_obj, &iters_obj, &w.timeout) ||
      int64_arg(n_obj, "chain benchmark", "n", &n) < 0 ||
      int_arg(k_obj, "chain benchmark", "k", 1, DP_COMM_MAX_REPLICAS, &w.k) < 0 ||
      int_arg(iters_obj, "chain benchmark", "iters", 1, INT_MAX, &w.iters) < 0)
    return NULL;
  if (n < 1) {
    PyErr_Format(PyExc_ValueError, "chain benchmark: n must be >= 1, got %lld", (long long)n);
    return NULL;
  }
  if (wait_args(w.timeout, "") < 0) return NULL;
  w.n = n;
  if (models_run_without_gil(NULL, 0, chain_bench_run, &w) < 0) return NULL;
  return PyFloat_FromDouble(w.seconds);
}

/* dist_p2p_seq(is_send, peer, tag) -> the sequence number of the next send to / receive from peer */
static PyObject *mod_dist_p2p_seq(PyObject *m, PyObject *args) {
  PyObject *peer_obj, *tag_obj;
  int is_send, peer, tag;
  if (!PyArg_ParseTuple(args, "pOO", &is_send, &peer_obj, &tag_obj) ||
      int_arg(peer_obj, is_send ? "send" : "recv", "peer", INT_MIN, INT_MAX, &peer) < 0 ||
      int_arg(tag_obj, is_send ? "send" : "recv", "tag", INT_MIN, INT_MAX, &tag) < 0)
    return NULL;
  int64_t seq;
  if (check_status(dp_dist_p2p_next_seq(is_send, peer, tag, &seq)) < 0) return NULL;
  return PyLong_FromLongLong((long long)seq);
}

static dp_status p2p_run(void *p) {
  coll_work *w = p;
  return w->is_send ? dp_dist_send_seq(w->buf, &w->desc, w->peer, w->tag, w->seq, w->stream, w->timeout, w->what)
                    : dp_dist_recv_seq(w->buf, &w->desc, w->peer, w->tag, w->seq, w->stream, w->timeout, w->what);
}

/* The point-to-point code of a Tensor's element type (dp_dist_desc.dtype). */
static int p2p_dtype_of(int npy_type) { return npy_type == NPY_INT64 ? 3 : npy_type == NPY_UINT8 ? 4 : 0; }

/* dist_p2p(is_send, array, dtype_code, peer, tag, seq, timeout, what): the C-contiguous
 * buffer's bytes to peer (is_send) or from it into the buffer (writable), described by
 * dtype_code (dp_dist_desc) and the buffer's shape. A Tensor on a CUDA device instead:
 * its device memory, described by its own element type and shape (dtype_code must agree),
 * moved by NCCL; received in place. */
static PyObject *mod_dist_p2p(PyObject *m, PyObject *args) {
  PyObject *obj, *peer_obj, *tag_obj;
  coll_work w;
  memset(&w, 0, sizeof w);
  long long seq;
  if (!PyArg_ParseTuple(args, "pOiOOLds", &w.is_send, &obj, &w.desc.dtype, &peer_obj, &tag_obj, &seq, &w.timeout,
                        &w.what) ||
      int_arg(peer_obj, w.is_send ? "send" : "recv", "peer", INT_MIN, INT_MAX, &w.peer) < 0 ||
      int_arg(tag_obj, w.is_send ? "send" : "recv", "tag", INT_MIN, INT_MAX, &w.tag) < 0)
    return NULL;
  if (wait_args(w.timeout, w.what) < 0) return NULL;
  w.seq = (int64_t)seq;
  dp_device *dev = NULL;
  int npy_type = 0, ndim = 0;
  npy_intp shape[NPY_MAXDIMS];
  const int is_tensor = tensor_memory(obj, &dev, &w.buf, &npy_type, &ndim, shape);
  if (is_tensor < 0) return NULL;
  if (is_tensor && dev->kind == DP_DEVICE_CUDA) {
    if (ndim > DP_DIST_MAX_DIMS || p2p_dtype_of(npy_type) != w.desc.dtype) {
      PyErr_Format(PyExc_ValueError, "%s: a tensor of %d dimensions (at most %d) and dtype code %d (%d given)", w.what,
                   ndim, DP_DIST_MAX_DIMS, p2p_dtype_of(npy_type), w.desc.dtype);
      return NULL;
    }
    w.desc.device = 1;
    w.desc.gpu = dp_cuda_device_gpu(dev);
    w.desc.gpu_uid = dp_nccl_gpu_uid(w.desc.gpu);
    w.desc.ndim = ndim;
    for (int i = 0; i < ndim; ++i) w.desc.shape[i] = (int64_t)shape[i];
    w.stream = dp_cuda_device_stream(dev);
    /* Without the device's step lock: the wait may last until the peer comes (a receive on this
     * device meanwhile must not wait for it), and NCCL works on a stream of its own, after the
     * work queued on the device's stream so far; obj (in args) keeps the memory alive. */
    if (models_run_without_gil(NULL, 0, p2p_run, &w) < 0) return NULL;
    Py_RETURN_NONE;
  }
  Py_buffer buf;
  const int flags = PyBUF_C_CONTIGUOUS | PyBUF_ND | (w.is_send ? 0 : PyBUF_WRITABLE);
  if (PyObject_GetBuffer(obj, &buf, flags) < 0) return NULL;
  if (buf.ndim > DP_DIST_MAX_DIMS) {
    PyBuffer_Release(&buf);
    PyErr_Format(PyExc_ValueError, "%s: at most %d dimensions, got %d", w.what, DP_DIST_MAX_DIMS, buf.ndim);
    return NULL;
  }
  w.desc.ndim = buf.ndim;
  for (int i = 0; i < buf.ndim; ++i) w.desc.shape[i] = (int64_t)buf.shape[i];
  w.buf = buf.buf;
  /* the buffer stays exported (and so unresizable) while the GIL is released */
  const int rc = models_run_without_gil(NULL, 0, p2p_run, &w);
  PyBuffer_Release(&buf);
  if (rc < 0) return NULL;
  Py_RETURN_NONE;
}

static dp_status handshake_run(void *p) {
  coll_work *w = p;
  return dp_dist_p2p_handshake(w->is_send, &w->desc, w->peer, w->tag, w->seq, w->timeout, w->what);
}

/* dist_p2p_handshake(is_send, dtype_code, shape, device, gpu, gpu_uid, peer, tag, seq, timeout, what):
 * only the description and the answer of a message so described (device 0 host, 1 GPU memory);
 * no byte moves. The peer calls it too. For the tests of the protocol on machines without GPUs. */
static PyObject *mod_dist_p2p_handshake(PyObject *m, PyObject *args) {
  PyObject *shape_obj, *peer_obj, *tag_obj;
  coll_work w;
  memset(&w, 0, sizeof w);
  long long seq;
  unsigned long long uid;
  if (!PyArg_ParseTuple(args, "piOiiKOOLds", &w.is_send, &w.desc.dtype, &shape_obj, &w.desc.device, &w.desc.gpu, &uid,
                        &peer_obj, &tag_obj, &seq, &w.timeout, &w.what) ||
      int_arg(peer_obj, "handshake", "peer", INT_MIN, INT_MAX, &w.peer) < 0 ||
      int_arg(tag_obj, "handshake", "tag", INT_MIN, INT_MAX, &w.tag) < 0)
    return NULL;
  if (wait_args(w.timeout, w.what) < 0) return NULL;
  PyObject *dims = PySequence_Fast(shape_obj, "dist_p2p_handshake: shape must be a sequence of ints");
  if (!dims) return NULL;
  const Py_ssize_t nd = PySequence_Fast_GET_SIZE(dims);
  if (nd > DP_DIST_MAX_DIMS) {
    Py_DECREF(dims);
    PyErr_Format(PyExc_ValueError, "%s: at most %d dimensions, got %zd", w.what, DP_DIST_MAX_DIMS, nd);
    return NULL;
  }
  w.desc.ndim = (int32_t)nd;
  for (Py_ssize_t i = 0; i < nd; ++i) w.desc.shape[i] = (int64_t)PyLong_AsLongLong(PySequence_Fast_GET_ITEM(dims, i));
  Py_DECREF(dims);
  if (PyErr_Occurred()) return NULL;
  w.desc.gpu_uid = (uint64_t)uid;
  w.seq = (int64_t)seq;
  if (models_run_without_gil(NULL, 0, handshake_run, &w) < 0) return NULL;
  Py_RETURN_NONE;
}

typedef struct {
  coll_work w;
  float *bufs[DP_COMM_MAX_REPLICAS];
  int k;
  int *ks; /* every process's buffer count: the owner-computes form; NULL: the chain */
  int64_t n;
} allreduce_work;

static dp_status allreduce_run(void *p) {
  allreduce_work *a = p;
  /* tag 1 on the job's default channel: the strategies' chains run on channels of their own */
  if (a->ks)
    return dp_dist_owner_allreduce_on(NULL, a->bufs, a->k, a->ks, a->n, (float)a->w.scale, 1, a->w.timeout, a->w.what,
                                      NULL);
  float *stage = malloc(sizeof(float) * 2 * DP_DIST_SEGMENT);
  if (!stage) return DP_FAIL(DP_ERR_MEMORY, "%s: staging", a->w.what);
  const dp_status st = dp_dist_chain_allreduce(a->bufs, a->k, a->n, (float)a->w.scale, 1, stage, a->w.timeout,
                                               a->w.what);
  free(stage);
  return st;
}

/* dist_allreduce_sum([arrays], scale, timeout, what, ks=None): this process's k C-contiguous,
 * writable float32 buffers of one length (its replicas, in order) each become scale * the sum of
 * every process's buffers in global order (process by process): the same bits everywhere, by
 * the chain (dp_dist_chain_allreduce), or by the owner-computes form when ks (every process's
 * k, the same list on every process) is given. */
static PyObject *mod_dist_allreduce_sum(PyObject *m, PyObject *args) {
  PyObject *seq, *ks_obj = Py_None;
  allreduce_work a;
  memset(&a, 0, sizeof a);
  if (!PyArg_ParseTuple(args, "Odds|O", &seq, &a.w.scale, &a.w.timeout, &a.w.what, &ks_obj)) return NULL;
  if (wait_args(a.w.timeout, a.w.what) < 0) return NULL;
  PyObject *items = PySequence_Fast(seq, "dist_allreduce_sum: a list of float32 arrays");
  if (!items) return NULL;
  Py_buffer views[DP_COMM_MAX_REPLICAS];
  const Py_ssize_t k = PySequence_Fast_GET_SIZE(items);
  PyObject *ret = NULL;
  int got = 0;
  const dp_dist_info info = dp_dist_get_info();
  if (k < 1 || k > DP_COMM_MAX_REPLICAS) {
    PyErr_Format(PyExc_ValueError, "%s: 1 to %d buffers, got %zd", a.w.what, DP_COMM_MAX_REPLICAS, k);
    goto done;
  }
  for (; got < k; ++got) {
    Py_buffer *v = &views[got];
    if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(items, got), v,
                           PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
      goto done;
    if (!v->format || strcmp(v->format, "f") != 0 || v->itemsize != 4 || v->len != views[0].len) {
      PyErr_Format(PyExc_TypeError, "%s: float32 buffers of one length", a.w.what);
      PyBuffer_Release(v);
      goto done;
    }
    a.bufs[got] = v->buf;
  }
  a.k = (int)k;
  a.n = views[0].len / 4;
  if (ks_obj != Py_None) {
    PyObject *ks = PySequence_Fast(ks_obj, "dist_allreduce_sum: ks must be a list of ints");
    if (!ks) goto done;
    if (PySequence_Fast_GET_SIZE(ks) != info.size) {
      PyErr_Format(PyExc_ValueError, "%s: ks has %zd counts for %d processes", a.w.what, PySequence_Fast_GET_SIZE(ks),
                   info.size);
      Py_DECREF(ks);
      goto done;
    }
    a.ks = malloc(sizeof(int) * (size_t)info.size);
    for (int q = 0; a.ks && q < info.size; ++q) a.ks[q] = (int)PyLong_AsLong(PySequence_Fast_GET_ITEM(ks, q));
    Py_DECREF(ks);
    if (!a.ks) {
      PyErr_NoMemory();
      goto done;
    }
    if (PyErr_Occurred()) goto done;
  }
  if (models_run_without_gil(NULL, 0, allreduce_run, &a) < 0) goto done;
  ret = Py_None;
  Py_INCREF(ret);
done:
  free(a.ks);
  for (int i = 0; i < got; ++i) PyBuffer_Release(&views[i]);
  Py_DECREF(items);
  return ret;
}

PyMethodDef dist_functions[] = {
    {"dist_allreduce_sum", mod_dist_allreduce_sum, METH_VARARGS,
     "dist_allreduce_sum([float32 arrays], scale, timeout, what, ks=None): in place, the globally ordered sum "
     "times scale"},
    {"dist_p2p_seq", mod_dist_p2p_seq, METH_VARARGS,
     "dist_p2p_seq(is_send, peer, tag) -> the sequence number of the next send to / receive from peer"},
    {"dist_p2p", mod_dist_p2p, METH_VARARGS,
     "dist_p2p(is_send, array, dtype_code, peer, tag, seq, timeout, what): point to point, described and checked"},
    {"dist_p2p_handshake", mod_dist_p2p_handshake, METH_VARARGS,
     "dist_p2p_handshake(is_send, dtype_code, shape, device, gpu, gpu_uid, peer, tag, seq, timeout, what): only "
     "the description and answer of a message (the protocol's tests)"},
    {"dist_chain_benchmark", mod_dist_chain_benchmark, METH_VARARGS,
     "dist_chain_benchmark(n, k, iters, timeout) -> seconds: the rank-ordered all-reduce across the job's processes"},
    {"dist_init", mod_dist_init, METH_NOARGS, "dist_init() -> info: join the job (MPI under mpirun), idempotent"},
    {"dist_info", mod_dist_info, METH_NOARGS, "dist_info() -> info, without joining"},
    {"dist_finalize", mod_dist_finalize, METH_NOARGS, "MPI_Finalize, when dpcore initialised MPI"},
    {"dist_abort", mod_dist_abort, METH_VARARGS, "dist_abort(code=1): MPI_Abort over the whole job"},
    {"dist_is_broken", mod_dist_is_broken, METH_NOARGS, "True once the processes are out of step"},
    {"dist_library", mod_dist_library, METH_NOARGS,
     "{'built', 'version', 'cuda_aware'} of the MPI library, 'nccl_p2p': GPU messages by NCCL built in"},
    {"dist_gpu_uid", mod_dist_gpu_uid, METH_VARARGS,
     "dist_gpu_uid(gpu) -> int naming the physical GPU among the job's (0: unknown, or no NCCL)"},
    {"dist_allgather", mod_dist_allgather, METH_VARARGS,
     "dist_allgather(data, timeout, what) -> [bytes per rank]"},
    {"dist_bcast", mod_dist_bcast, METH_VARARGS, "dist_bcast(buffer, root, timeout, what): in place"},
    {"dist_barrier", mod_dist_barrier, METH_VARARGS, "dist_barrier(timeout, what)"},
    {NULL, NULL, 0, NULL}};
