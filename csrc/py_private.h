/* py_private.h — what the files of the CPython binding (module dpcore._core)
 * share, as CPython's Modules/_io shares _iomodule.h:
 *
 *   py_common.c    the helpers every file uses (errors, NumPy converters,
 *                  arguments, the one way to release the GIL)
 *   py_device.c    the device registry's functions (list, logical devices)
 *   py_tensor.c    Tensor, and all_reduce over tensors (chapter 12.5)
 *   py_batch.c     the calls on a batch that Model and Mirrored share
 *   py_layers.c    layer specs into a model; layer_shapes (a model's layout, built without one)
 *   py_model.c     Model (one replica) and Resident (a dataset on its device)
 *   py_mirrored.c  Mirrored (k replicas in lockstep, in one process or many)
 *   py_dist.c      the processes of a job (MPI): ranks, broadcast, allgather
 *   py_ops.c       single ops on NumPy arrays (tests, notebooks)
 *   py_module.c    the module: PyInit__core, which gathers the types and
 *                  functions of the files above, and its own module
 *                  functions (build and runtime info)
 *
 * A file uses only files listed above it (py_model.c py_tensor.c's views,
 * py_batch.c's calls and py_layers.c's specs, py_mirrored.c py_model.c's types, py_module.c every
 * file), so that the binding has no cycle (tests/test_binding_files.py
 * checks it).
 *
 * Rules every file keeps: dp_status values become Python exceptions only
 * through raise_from_status; NumPy inputs go through the converters below,
 * which require the exact dtype, C order, alignment and native byte order
 * (python/dpcore does the friendly conversions); the GIL is released only by
 * models_run_without_gil; a wrapper holding more than one owned reference
 * cleans up at one `done:` label.
 */
#ifndef DP_PY_PRIVATE_H
#define DP_PY_PRIVATE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
/* NumPy's C API is a table of pointers filled by import_array(). With several
 * files, all share one table under this name; only py_common.c (which
 * defines DP_PY_NUMPY_TABLE) defines it, and fills it in common_init. */
#define PY_ARRAY_UNIQUE_SYMBOL dpcore_ARRAY_API
#ifndef DP_PY_NUMPY_TABLE
#define NO_IMPORT_ARRAY
#endif
#include <numpy/arrayobject.h>

#include "backend.h"
#include "device.h"
#include "mirrored.h"
#include "model.h"

/* Names shared between the binding's files but not exported from _core.so,
 * so that they cannot clash with another extension's (NumPy's NPY_NO_EXPORT). */
#define DP_PY_LOCAL __attribute__((visibility("hidden")))

/* ---- errors (py_common.c) ------------------------------------------------- */

DP_PY_LOCAL extern PyObject *DpcoreError; /* dpcore.errors.DpcoreError */
DP_PY_LOCAL extern PyObject *DeviceError; /* dpcore.errors.DeviceError */
DP_PY_LOCAL extern PyObject *DistributedError; /* dpcore.errors.DistributedError */

/* The one place a dp_status becomes an exception (with the core's message).
 * Always returns NULL, so that a wrapper can `return raise_from_status(st);`. */
DP_PY_LOCAL PyObject *raise_from_status(dp_status s);

/* 0 when st is DP_OK; else the exception raised and -1. For `goto done` wrappers. */
static inline int check_status(dp_status st) { return st == DP_OK ? 0 : (raise_from_status(st), -1); }

/* Fills NumPy's API table and looks up the exception types above; PyInit__core
 * calls it first. 0, or -1 with the exception set. */
DP_PY_LOCAL int common_init(void);

/* ---- NumPy converters (py_common.c) ---------------------------------------- */

DP_PY_LOCAL const char *dtype_name(PyArrayObject *a);
/* A C-contiguous, aligned, native float32 array of the given rank (rank < 0:
 * any). Returns a new reference or NULL with TypeError/ValueError set. */
DP_PY_LOCAL PyArrayObject *as_float32(PyObject *obj, int rank, const char *what);
/* A new zero-filled float32 array. */
DP_PY_LOCAL PyArrayObject *new_float32(int rank, const npy_intp *dims);
/* Images for model m: (N, C, H, W) uint8 or float32 matching its input.
 * 0 and a new reference in *out, or -1 with the exception set. */
DP_PY_LOCAL int convert_images(PyObject *obj, const dp_model *m, PyArrayObject **out, int *is_u8);
/* Labels: (n,) int64. 0 and a new reference in *out, or -1. */
DP_PY_LOCAL int convert_labels(PyObject *obj, npy_intp n, PyArrayObject **out);
/* Row indices: a 1-D int64 array; a new reference or NULL with TypeError set. */
DP_PY_LOCAL PyArrayObject *convert_rows(PyObject *obj);
/* The items of a sequence as a new tuple (TypeError with `what` when obj is
 * not one): strong references that another thread cannot take away while a
 * call runs without the GIL, as it could empty a list. */
DP_PY_LOCAL PyObject *items_of(PyObject *obj, const char *what);

/* ---- arguments (py_common.c) ------------------------------------------------ */

/* An integer argument (an int, or anything with __index__) in 64 bits, for
 * the core to range-check with a message naming it. 0, or -1 with TypeError
 * (not an integer) or ValueError (beyond 64 bits), both naming `what` (the
 * op or layer, "conv2d (layer 0)") and the argument's name ("padding"):
 * never OverflowError. */
DP_PY_LOCAL int int64_arg(PyObject *obj, const char *what, const char *name, int64_t *out);
/* An integer argument in [lo, hi] (both within an int), through int64_arg:
 * ValueError naming it when out of range, never OverflowError, nor a value
 * wrapped to an int. */
DP_PY_LOCAL int int_arg(PyObject *obj, const char *what, const char *name, int64_t lo, int64_t hi, int *out);
/* A real-number argument as a double; TypeError naming it when it is not one. */
DP_PY_LOCAL int float64_arg(PyObject *obj, const char *what, const char *name, double *out);
/* The SGD arguments lr, momentum, weight_decay (NULL: 0) as floats, read as
 * doubles and checked by the core's dp_sgd_args_check first, so that 1e39 is
 * refused as 1e39 rather than rounded to inf: 0, or -1 with TypeError or
 * ValueError naming the argument. */
DP_PY_LOCAL int sgd_args_from(const char *what, PyObject *lr, PyObject *momentum, PyObject *weight_decay,
                              float *lr_out, float *momentum_out, float *weight_decay_out);
/* A gradient scale, the same way (dp_grad_scale_check). */
DP_PY_LOCAL int grad_scale_from(const char *what, PyObject *obj, float *out);

/* ---- Model (py_model.c; its busy mark is py_common.c's) --------------------- */

typedef struct {
  PyObject_HEAD
  dp_device *device; /* a reference from the registry (csrc/device.h); set first by __init__ */
  dp_model *model;
  /* Set while a call runs on this model without the GIL (models_run_without_gil).
   * Read and written only with the GIL held, so a plain int suffices. */
  int busy;
} ModelObject;

DP_PY_LOCAL extern PyTypeObject ModelType;
DP_PY_LOCAL extern PyTypeObject ResidentType;
DP_PY_LOCAL extern PyMethodDef model_functions[]; /* set_replicas */

/* 1 when the model is initialized and no call runs on it without the GIL;
 * else 0 with RuntimeError set. Every method that touches the model checks it. */
DP_PY_LOCAL int model_ready(ModelObject *self);
/* The dataset of an initialized Resident on model mo's device, or NULL with
 * TypeError/ValueError set. Borrowed: the Resident object owns it. */
DP_PY_LOCAL dp_resident *resident_of(PyObject *obj, const ModelObject *mo);
/* What identifies an initialized Resident's dataset (resident_of first): the
 * token Resident(..., dataset=) was given, else the Resident itself; copies of
 * one dataset on the replicas compare equal. */
DP_PY_LOCAL const void *resident_dataset(PyObject *obj);

/* ---- the one way to release the GIL (py_common.c) --------------------------- */

/* Pure C work done without the GIL; it may touch only memory the caller keeps
 * alive (strong references taken before the call) and the models marked busy. */
typedef dp_status (*nogil_work)(void *ctx);

/* Marks models[0..n-1] (ModelObjects; n may be 0, repeats allowed) busy,
 * releases the GIL, takes the step lock of every model's device (device.h:
 * one call computes on a device at a time), has those devices take the
 * process-wide CUDA settings (dp_cuda_take_defaults: once per call, before
 * its work), runs work(ctx), drops the locks,
 * takes the GIL back and clears the marks. Another thread that calls into one
 * of those models meanwhile gets RuntimeError from model_ready instead of
 * racing with the work; one that calls into another model on the same device
 * waits for the device.
 * Returns 0, or -1 with an exception set: RuntimeError when a model is busy
 * already (work not run), or the work's failure through raise_from_status. */
DP_PY_LOCAL int models_run_without_gil(PyObject *const *models, Py_ssize_t n, nogil_work work, void *ctx);
/* The same, with the step locks of devs[0..ndevs-1] (registry devices;
 * NULLs and repeats allowed) taken too: work on tensors' devices. */
DP_PY_LOCAL int devices_run_without_gil(PyObject *const *models, Py_ssize_t n, dp_device *const *devs,
                                        Py_ssize_t ndevs, nogil_work work, void *ctx);
/* 0 when no call runs on the model without the GIL, else -1 with RuntimeError
 * set ("in use by another thread"). */
DP_PY_LOCAL int model_check_idle(const ModelObject *self);

/* Seconds a deallocation waits for its device's queued work before it leaves
 * the memory allocated (device_free_in_dealloc). */
#define DP_DEALLOC_WAIT_SECONDS 30.0

/* For a tp_dealloc, or a failed __init__, whose object holds memory of dev (a
 * registry device). A CPU device's memory is freed at once. A CUDA device's:
 * with the GIL released (no other thread reaches the memory through the
 * object: it is dying, or no longer points at it), takes dev's step lock as
 * every user of the device does, waits at most
 * DP_DEALLOC_WAIT_SECONDS for the work queued on dev (dp_cuda_wait_idle),
 * then calls free_fn(ctx) and, when put_device, drops one reference to dev.
 * When the work did not finish (or the stream failed), nothing is freed and
 * no reference dropped (the GPU may still use the memory; it stays allocated
 * for good) and a RuntimeWarning naming `what` says so. Returns 1 when freed,
 * 0 when left allocated. Keeps any exception that was set. */
DP_PY_LOCAL int device_free_in_dealloc(dp_device *dev, void (*free_fn)(void *ctx), void *ctx, int put_device,
                                       const char *what);

/* ---- layer specs (py_layers.c) ---------------------------------------------- */

/* input_shape (C, H, W): three integers, in 64 bits for the core to check.
 * 0, or -1 with TypeError/ValueError set. */
DP_PY_LOCAL int input_shape_from(PyObject *obj, int64_t shape[3]);
/* Adds `layers` (a sequence of tuples (kind, *args)) to m, layer i reading
 * sources[i] (None, or sources None: the previous layer); each through
 * dp_model_add_layer. 0, or -1 with the exception set. */
DP_PY_LOCAL int model_add_layers(dp_model *m, PyObject *layers, PyObject *sources);
/* The shape of tensor t of layer l, a new tuple or NULL. */
DP_PY_LOCAL PyObject *layer_tensor_shape(const dp_layer *l, int t);
DP_PY_LOCAL extern PyMethodDef layer_functions[]; /* layer_shapes */

/* ---- calls on a batch, shared by Model and Mirrored (py_batch.c) ------------ */

typedef enum { BATCH_TRAIN_STEP, BATCH_FORWARD_BACKWARD, BATCH_EVALUATE, BATCH_FIND_NONFINITE } batch_call;

typedef struct batch_type batch_type;

/* One call on a batch: its arguments, then its results. */
typedef struct batch_work {
  const batch_type *type;
  batch_call call;
  void *core;            /* the type's dp_model or dp_mirrored (set by ready) */
  const dp_model *input; /* the model whose input the images must fit (set by ready) */
  dp_batch batch;        /* host images and labels, or rows of the datasets batch.resident[r] */
  float lr, momentum, weight_decay, grad_scale;
  double loss;           /* the loss sum, and the samples classified right */
  int64_t correct;
  int layer, what;       /* find_nonfinite */
} batch_work;

/* What the batch calls need of a type. */
struct batch_type {
  /* 1 with w->core and w->input set when self can take a call, else 0 with
   * RuntimeError set */
  int (*ready)(PyObject *self, batch_work *w);
  /* train_step_rows' first argument's keyword ("resident", "residents") */
  const char *datasets_name;
  /* The datasets of train_step_rows in data[r], one per replica, from that
   * argument: 0 with *keep a new reference that keeps them alive, or -1 with
   * the exception set */
  int (*datasets)(PyObject *self, PyObject *obj, dp_resident **data, PyObject **keep);
  /* runs work(ctx) without the GIL, every replica of self marked busy
   * (models_run_without_gil) */
  int (*run_without_gil)(PyObject *self, nogil_work work, void *ctx);
  /* the call, without the GIL; a training step on no samples never gets here */
  dp_status (*compute)(batch_work *w);
};

/* Method bodies: the wrappers in a type's method table call these with its
 * batch_type. Each returns (loss_sum, correct), or find_nonfinite's (layer,
 * what), or NULL with the exception set. */
/* train_step(images, labels, lr, momentum=0, weight_decay=0) */
DP_PY_LOCAL PyObject *batch_train_step(const batch_type *t, PyObject *self, PyObject *args, PyObject *kwds);
/* train_step_rows(<datasets_name>, rows, lr, momentum=0, weight_decay=0) */
DP_PY_LOCAL PyObject *batch_train_step_rows(const batch_type *t, PyObject *self, PyObject *args, PyObject *kwds);
/* forward_backward(images, labels, grad_scale) */
DP_PY_LOCAL PyObject *batch_forward_backward(const batch_type *t, PyObject *self, PyObject *args, PyObject *kwds);
/* call(images, labels): evaluate, find_nonfinite, or a forward_backward without a grad_scale */
DP_PY_LOCAL PyObject *batch_on_images(const batch_type *t, batch_call call, PyObject *self, PyObject *args,
                                      PyObject *kwds);

/* ---- Tensor (py_tensor.c) --------------------------------------------------- */

DP_PY_LOCAL extern PyTypeObject TensorType;
/* A 1-D float32 Tensor of n elements on owner's device (any kind), viewing
 * data, which model `owner` holds (kept alive by the tensor, and with it the
 * device; the tensor refuses to be read while the model is busy). */
DP_PY_LOCAL PyObject *tensor_view_of_model(ModelObject *owner, float *data, npy_intp n);
/* obj a Tensor: 1, with its device, memory, first axis and element count;
 * -1 with TypeError when it is not float32 with a batch axis (or RuntimeError:
 * a view of a busy model); 0 when obj is not a Tensor. */
DP_PY_LOCAL int tensor_float32_data(PyObject *obj, const char *what, dp_device **dev, void **data, npy_intp *first,
                                    int64_t *size);
/* obj a Tensor: 1, with its device, memory, NumPy element type (NPY_FLOAT32, NPY_INT64, NPY_UINT8) and shape
 * (NPY_MAXDIMS entries); -1 with RuntimeError for a view of a busy model; 0 when obj is not a Tensor. */
DP_PY_LOCAL int tensor_memory(PyObject *obj, dp_device **dev, void **data, int *npy_type, int *ndim, npy_intp *shape);
/* A new float32 Tensor of `shape` on the device `like` (zero-filled), its memory in *data; NULL with the
 * exception set. */
DP_PY_LOCAL PyObject *tensor_empty_float32(dp_device *like, int ndim, const npy_intp *shape, float **data);
DP_PY_LOCAL extern PyMethodDef tensor_functions[]; /* all_reduce */

/* ---- the device registry (py_device.c) ------------------------------------- */

DP_PY_LOCAL extern PyMethodDef device_functions[]; /* set_logical_devices, list_devices, live_devices */

/* ---- the processes of a job (py_dist.c) -------------------------------------- */

DP_PY_LOCAL extern PyMethodDef dist_functions[]; /* dist_init, dist_allgather, dist_bcast, ... */

/* ---- Mirrored (py_mirrored.c) ----------------------------------------------- */

DP_PY_LOCAL extern PyTypeObject MirroredType;

/* ---- single ops (py_ops.c) -------------------------------------------------- */

/* Sets up the CPU device the ops run on; 0, or -1 with the exception set. */
DP_PY_LOCAL int ops_init(void);
DP_PY_LOCAL extern PyMethodDef ops_functions[];

#endif
