"""The processes of a job: dpcore beyond one process, on MPI (Open MPI).

    mpirun -np 2 python train.py               # two processes on this machine
    mpirun -np 8 --hostfile hosts python train.py

    import dpcore as dp
    dp.distributed.rank(), dp.distributed.world_size(), dp.distributed.local_rank()
    strategy = dp.MultiWorkerMirroredStrategy()   # every process's local devices
    dp.distributed.send(x, 1)                  # on rank 0: x's bytes to rank 1
    x = dp.distributed.recv((64, 10), 0)       # on rank 1: a float32 (64, 10) from rank 0

A process started by mpirun joins the job the first time it asks (any function
here, or ``MultiWorkerMirroredStrategy()``); any other process is a world of
one (rank 0 of 1) and never starts MPI. dpcore asks MPI for
``MPI_THREAD_MULTIPLE`` (it needs ``MPI_THREAD_SERIALIZED``) and coexists with
mpi4py: whoever initialised MPI finalises it.

Failure never hangs. Every wait for another process has a deadline (the
strategy's ``timeout``, else the ``timeout=`` given here): a process that never
arrives is a :class:`dpcore.DistributedError` naming the rank and what was
waited for. Once a process of a job has joined it, an exception that nothing
catches ends the whole job through ``MPI_Abort`` (after printing the
traceback), instead of leaving the others to wait for it: mpirun then stops
every process. A job whose processes fell out of step is aborted at exit
rather than finalised (``MPI_Finalize`` would wait for the lost process).

Open MPI refuses to run as root unless ``OMPI_ALLOW_RUN_AS_ROOT=1`` and
``OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1`` are set; the Makefile and the tests set
them, dpcore itself never does.
"""
import atexit
import os
import pickle
import struct
import sys
import threading
import traceback

import numpy as np

from . import _core
from .errors import DistributedError

__all__ = ["rank", "world_size", "local_rank", "local_size", "is_initialized", "barrier", "broadcast_object",
           "allgather_object", "send", "recv", "isend", "irecv", "Work", "all_reduce", "broadcast",
           "all_gather", "reduce_scatter", "DEFAULT_TIMEOUT", "DistributedError"]

DEFAULT_TIMEOUT = 60.0  # seconds to wait for another process before giving up

_lock = threading.Lock()
_info = None
_hooks_installed = False


def _check_timeout(timeout):
    from . import _check

    return _check.real("timeout", timeout, 0.0, exclusive_minimum=True)


def _launched_size():
    """The job size a launcher's variables announce (1 when none does)."""
    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"):
        try:
            return int(os.environ[var])
        except (KeyError, ValueError):
            continue
    return 1


def _join():
    """The job's description, joining it on first use."""
    global _info
    with _lock:
        if _info is None:
            info = _core.dist_init()
            if info["world_size"] == 1 and not _core.dist_library()["built"] and _launched_size() > 1:
                # one of several processes that would each train alone
                raise DistributedError(f"this process was started by mpirun as one of {_launched_size()}, but "
                                       "dpcore was built without MPI (DPCORE_MPI=0 or no mpicc at build time): "
                                       "install Open MPI (libopenmpi-dev) and reinstall dpcore")
            _info = info
            if _info["world_size"] > 1:
                _install_hooks()
        return _info


def _abort_job(code=1):
    sys.stdout.flush()
    sys.stderr.flush()
    _core.dist_abort(code)


def _excepthook(kind, value, tb):
    """An exception nothing caught: print it, then end the whole job (the other
    processes would otherwise wait for this one until their deadline)."""
    info = _info or {}
    text = "".join(traceback.format_exception(kind, value, tb))
    sys.stderr.write(f"dpcore: rank {info.get('rank', '?')} of {info.get('world_size', '?')} failed; aborting the "
                     f"job (MPI_Abort)\n{text}")
    _abort_job(1)
    _previous_excepthook(kind, value, tb)  # MPI was not running after all


_previous_excepthook = sys.excepthook


def _at_exit():
    if _core.dist_is_broken():
        # the processes are out of step: MPI_Finalize would wait for a lost peer
        _abort_job(1)
    else:
        _core.dist_finalize()


def _install_hooks():
    global _hooks_installed, _previous_excepthook
    if _hooks_installed:
        return
    _previous_excepthook = sys.excepthook
    sys.excepthook = _excepthook
    atexit.register(_at_exit)
    _hooks_installed = True


def is_initialized():
    """True once MPI runs in this process (dpcore joined a job launched by
    mpirun, or mpi4py started MPI first). Starts nothing."""
    return bool(_info is not None and _info["mpi_initialized"])


def rank():
    """This process's rank in the job (0 .. world_size() - 1); 0 outside mpirun."""
    return _join()["rank"]


def world_size():
    """The number of processes of the job; 1 outside mpirun."""
    return _join()["world_size"]


def local_rank():
    """This process's rank among the processes of its host (for choosing a GPU)."""
    return _join()["local_rank"]


def local_size():
    """The number of processes of the job on this host."""
    return _join()["local_size"]


def barrier(timeout=DEFAULT_TIMEOUT, what="dp.distributed.barrier()"):
    """Waits until every process has called it (DistributedError after timeout s)."""
    _join()
    _core.dist_barrier(_check_timeout(timeout), what)


def allgather_object(obj, timeout=DEFAULT_TIMEOUT, what="dp.distributed.allgather_object()"):
    """Every process's ``obj`` (pickled), as a list in rank order."""
    timeout = _check_timeout(timeout)
    info = _join()
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    if info["world_size"] == 1:
        return [pickle.loads(data)]
    sizes = [struct.unpack("<q", b)[0] for b in _core.dist_allgather(struct.pack("<q", len(data)), timeout, what)]
    width = max(sizes)
    parts = _core.dist_allgather(data + bytes(width - len(data)), timeout, what)
    return [pickle.loads(part[:size]) for part, size in zip(parts, sizes)]


def broadcast_object(obj, root=0, timeout=DEFAULT_TIMEOUT, what="dp.distributed.broadcast_object()"):
    """Rank ``root``'s ``obj`` (pickled) on every process; the others' argument is ignored."""
    timeout = _check_timeout(timeout)
    info = _join()
    from . import _check

    root = _check.integer("root", root, 0, info["world_size"] - 1)
    if info["world_size"] == 1:
        return pickle.loads(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if info["rank"] == root else b""
    size = bytearray(struct.pack("<q", len(data)))
    _core.dist_bcast(size, root, timeout, what)
    buf = bytearray(data) if info["rank"] == root else bytearray(struct.unpack("<q", bytes(size))[0])
    _core.dist_bcast(buf, root, timeout, what)
    return pickle.loads(bytes(buf))


def agree(name, value, timeout=DEFAULT_TIMEOUT):
    """Raises DistributedError on every process unless every process passed
    the same ``value`` (compared by equality) for ``name``."""
    values = allgather_object(value, timeout, f"the comparison of {name}")
    for q, v in enumerate(values):
        if v != values[0]:
            raise DistributedError(f"the processes disagree about {name}: rank {q} has {v!r}, rank 0 has "
                                   f"{values[0]!r}; every process must make the same call")
    return values[0]


# ---- point to point: torch.distributed's send / recv / isend / irecv ----

_DTYPES = {"float32": 0, "float64": 1, "int32": 2, "int64": 3, "uint8": 4}


def _host_array(t, verb):
    """(NumPy array, rebuild) of what the collectives take: a NumPy array, or a dp.Tensor (a tensor on a
    GPU staged through a host copy; rebuild makes the dp.Tensor of a result array on the tensor's device)."""
    from . import parallel

    if isinstance(t, parallel.Tensor):
        return t.numpy(), (lambda a, dev=t.device: parallel.tensor(a, dev))
    if isinstance(t, np.ndarray):
        if t.dtype.name not in _DTYPES:
            raise TypeError(f"{verb}: arrays of {', '.join(_DTYPES)} only, got {t.dtype}")
        return t, None
    raise TypeError(f"{verb}: expected a NumPy array or a dp.Tensor, got {type(t).__name__}")


def _memory(t):
    """'GPU' for a dp.Tensor in GPU memory, else 'host': what the ranks of a collective must agree on."""
    from . import parallel

    return "GPU" if isinstance(t, parallel.Tensor) and not t.device.startswith("cpu") else "host"


def _peer(verb, peer, info):
    from . import _check

    peer = _check.integer("dst" if verb == "send" else "src", peer, 0, info["world_size"] - 1)
    if peer == info["rank"]:
        raise ValueError(f"{verb}: rank {peer} is this process; a message goes to another rank")
    return peer


def _tag(tag):
    from . import _check

    return _check.integer("tag", tag, 0, 99)


class Work:
    """A send or receive in flight (isend / irecv): ``wait()`` blocks until it is done (raising its
    error, if any) and returns what ``recv`` would; ``is_completed()`` asks without blocking."""

    def __init__(self, run, what):
        self._what = what
        self._result = self._error = None
        self._thread = threading.Thread(target=self._body, args=(run,), name=what, daemon=True)
        self._thread.start()

    def _body(self, run):
        try:
            self._result = run()
        except BaseException as e:  # re-raised by wait() on the caller's thread
            self._error = e

    def is_completed(self):
        return not self._thread.is_alive()

    def wait(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result


def _p2p(is_send, t, peer, tag, timeout, dtype=None):
    """(run, what) of one send or receive, its sequence number taken now (program order)."""
    verb = "send" if is_send else "recv"
    timeout = _check_timeout(timeout)
    info = _join()
    tag = _tag(tag)
    peer = _peer(verb, peer, info)
    if not is_send and isinstance(t, (tuple, list)):
        dt = np.dtype(dtype or "float32")
        if dt.name not in _DTYPES:
            raise TypeError(f"recv: dtype must be one of {', '.join(_DTYPES)}, got {dt}")
        array, rebuild, fill = np.empty(tuple(int(d) for d in t), dt), None, None
    elif _memory(t) == "GPU":
        # GPU memory: described over MPI, the bytes by NCCL from GPU to GPU (csrc/dist_nccl.h);
        # a receive lands in a new tensor on the same device
        if dtype is not None:
            raise TypeError(f"{verb}: dtype= is for a shape; an array or tensor has its own")
        if len(t.shape) > 8:
            raise ValueError(f"{verb}: at most 8 dimensions, got {len(t.shape)}")
        from . import parallel

        tensor = t if is_send else parallel.tensor(np.empty(t.shape, t.dtype), t.device)
        seq = _core.dist_p2p_seq(is_send, peer, tag)
        what = f"dp.distributed.{verb}({'to' if is_send else 'from'} rank {peer}, tag {tag})"

        def run_gpu():
            _core.dist_p2p(is_send, tensor, _DTYPES[tensor.dtype], peer, tag, seq, timeout, what)
            return None if is_send else tensor
        return run_gpu, what
    else:
        if dtype is not None:
            raise TypeError(f"{verb}: dtype= is for a shape; an array or tensor has its own")
        array, rebuild = _host_array(t, verb)
        fill = None
        if not is_send and rebuild is None and not (array.flags.c_contiguous and array.flags.writeable):
            raise ValueError("recv: the array must be C-contiguous and writable (it is filled in place)")
        if is_send:
            array = np.ascontiguousarray(array)
        elif rebuild is not None:
            fill = array = np.empty(array.shape, array.dtype)
    if array.ndim > 8:
        raise ValueError(f"{verb}: at most 8 dimensions, got {array.ndim}")
    seq = _core.dist_p2p_seq(is_send, peer, tag)
    what = f"dp.distributed.{verb}({'to' if is_send else 'from'} rank {peer}, tag {tag})"

    def run():
        _core.dist_p2p(is_send, array, _DTYPES[array.dtype.name], peer, tag, seq, timeout, what)
        if is_send:
            return None
        return rebuild(fill) if rebuild is not None else array
    return run, what


def send(tensor, dst, tag=0, timeout=DEFAULT_TIMEOUT):
    """Sends ``tensor`` (a NumPy array of float32/float64/int32/int64/uint8, or a dp.Tensor) to rank
    ``dst``; returns when its bytes have left (torch.distributed.send).
    The receiver's ``recv`` must expect the same dtype, shape and kind of memory (host, or a GPU):
    otherwise a DistributedError naming both on both ranks, and nothing moves. Messages with the
    same ``tag`` (0-99) between two ranks arrive in the order they were sent.

    A dp.Tensor on a GPU goes from GPU to GPU by NCCL (the description still over MPI): the
    receiver passes a dp.Tensor on one of its GPUs, and each process needs a GPU of its own
    (cuda:local_rank; NCCL refuses two ranks on one GPU, a DistributedError on both ranks here).
    Two processes get a two-rank NCCL communicator of their own on their first such message, and
    their GPU messages, either way, run one at a time in the order the lower rank numbers them. A
    GPU send returns only once the receiver has the bytes (NCCL keeps no eager buffer), so
    blocking sends and receives on different tags must come in the same order on both ranks, or
    use isend / irecv. A peer that does not come within ``timeout`` is named in a
    DistributedError, the communicator aborted (ncclCommAbort)."""
    run, _ = _p2p(True, tensor, dst, tag, timeout)
    run()


def recv(tensor_or_shape, src, tag=0, timeout=DEFAULT_TIMEOUT, dtype=None):
    """Receives from rank ``src``: into ``tensor_or_shape`` when it is a NumPy array (filled in
    place and returned), as a new dp.Tensor on the same device when it is a dp.Tensor (on a GPU:
    by NCCL, GPU to GPU, see ``send``), or as a new array of that shape (``dtype``, default
    float32) when it is a shape."""
    run, _ = _p2p(False, tensor_or_shape, src, tag, timeout, dtype)
    return run()


def isend(tensor, dst, tag=0, timeout=DEFAULT_TIMEOUT):
    """``send`` in the background: returns a :class:`Work` at once. The array must not change
    until ``wait()`` returns. At most 32 sends (and 32 receives) to one rank on one tag may be
    in flight: the 33rd is a ValueError until one of them is done."""
    return Work(*_p2p(True, tensor, dst, tag, timeout))


def irecv(tensor_or_shape, src, tag=0, timeout=DEFAULT_TIMEOUT, dtype=None):
    """``recv`` in the background: returns a :class:`Work` whose ``wait()`` returns what recv would."""
    return Work(*_p2p(False, tensor_or_shape, src, tag, timeout, dtype))


# ---- collectives on arrays and tensors across ranks ----

_OPS = ("sum", "mean", "max")


def _collective_input(name, t, timeout, extra=()):
    """(array, rebuild, timeout, info) after every rank agreed on the call: the same collective,
    dtype, shape and kind of memory (and `extra`), else a DistributedError on every rank."""
    timeout = _check_timeout(timeout)
    info = _join()
    memory = _memory(t)
    array, rebuild = _host_array(t, name)
    if rebuild is None and not (array.flags.c_contiguous and array.flags.writeable):
        raise ValueError(f"{name}: the array must be C-contiguous and writable (the result is written in place)")
    if rebuild is not None:
        array = np.array(array)
    if info["world_size"] > 1:
        agree(f"dp.distributed.{name}'s arguments (collective, dtype, shape, memory{', ' if extra else ''}"
              f"{', '.join(k for k, _ in extra)})",
              (name, array.dtype.name, array.shape, memory) + tuple(v for _, v in extra), timeout)
    return array, rebuild, timeout, info


def _result(array, rebuild):
    return rebuild(array) if rebuild is not None else array


def all_reduce(tensor, op="sum", timeout=DEFAULT_TIMEOUT):
    """Every rank's ``tensor`` combined by ``op`` ('sum', 'mean', 'max'), on every rank: a NumPy
    array is overwritten and returned, a dp.Tensor is returned as a new Tensor on its device.
    Every rank passes the same kind of memory (host, or a GPU).

    A dp.Tensor on a GPU goes through host memory: copied to the host, combined by the same
    rank-ordered path over MPI as host arrays (so the same bits), the result copied back to a
    new tensor on the GPU. Deliberately not NCCL's all-reduce, whose sums are not in rank order
    and so not bitwise the same from run to run or across job shapes.

    ``tensor`` may also be a list: this process's replicas (e.g. one tensor per logical
    device, in device order; each process may hold another number). Then every element of
    every list becomes the combination over the job's replicas in global order, process by
    process and then list order, and a list comes back. Sums are taken in that order,
    ((t0 + t1) + t2) + ..., so every rank gets the bits one process holding all the replicas
    would (float32 through the strategy's chain, or its owner-computes form with
    DPCORE_DIST_ALLREDUCE=owner; other dtypes gathered, then combined in order); 'mean'
    divides by the number of replicas."""
    from . import _check

    op = _check.one_of("op", op, _OPS)
    single = not isinstance(tensor, (list, tuple))
    items = [tensor] if single else list(tensor)
    if not items:
        raise ValueError("all_reduce: an empty list of tensors")
    timeout = _check_timeout(timeout)
    info = _join()
    memories = sorted({_memory(t) for t in items})
    if len(memories) > 1:
        raise ValueError("all_reduce: this process's tensors are in host and GPU memory; pass one kind")
    pairs = [_host_array(t, "all_reduce") for t in items]
    for a, rebuild in pairs:
        if rebuild is None and not (a.flags.c_contiguous and a.flags.writeable):
            raise ValueError("all_reduce: the arrays must be C-contiguous and writable (the result is written in "
                             "place)")
        if a.dtype != pairs[0][0].dtype or a.shape != pairs[0][0].shape:
            raise ValueError(f"all_reduce: this process's tensors differ: {pairs[0][0].dtype}{list(pairs[0][0].shape)}"
                             f" and {a.dtype}{list(a.shape)}")
    arrays = [np.array(a) if rebuild is not None else a for a, rebuild in pairs]
    dtype, shape = arrays[0].dtype, arrays[0].shape
    if op == "mean" and dtype.kind != "f":
        raise TypeError("all_reduce: op='mean' needs a float array (an integer mean is not an integer)")
    P = info["world_size"]
    ks = [len(arrays)]
    if P > 1:
        calls = allgather_object(("all_reduce", dtype.name, shape, memories[0], op, len(arrays)), timeout,
                                 "the comparison of dp.distributed.all_reduce's arguments")
        for q, c in enumerate(calls):
            if c[:5] != calls[0][:5]:
                raise DistributedError(
                    "the processes disagree about dp.distributed.all_reduce's arguments (collective, dtype, shape, "
                    f"memory, op): rank {q} has {c[:5]!r}, rank 0 has {calls[0][:5]!r}; every process must make the "
                    "same call")
        ks = [c[5] for c in calls]
    R = sum(ks)
    what = f"dp.distributed.all_reduce(op='{op}')"
    if R > 1:
        if op in ("sum", "mean") and dtype == np.float32 and P > 1:
            _core.dist_allreduce_sum(arrays, 1.0 / R if op == "mean" else 1.0, timeout, what,
                                     ks if _owner_computes() else None)
        else:
            parts = [np.frombuffer(b, dtype).reshape(shape)
                     for got in (allgather_object([a.tobytes() for a in arrays], timeout, what) if P > 1
                                 else [[a.tobytes() for a in arrays]])
                     for b in got]
            out = parts[0].copy()
            for p in parts[1:]:
                out = np.maximum(out, p) if op == "max" else out + p
            if op == "mean":  # times 1/R, rounded, as the chain scales
                out = out * dtype.type(1.0 / R)
            for a in arrays:
                a[...] = out
    results = [rebuild(a) if rebuild is not None else a for a, (_, rebuild) in zip(arrays, pairs)]
    return results[0] if single else results


def _owner_computes():
    """DPCORE_DIST_ALLREDUCE: 'chain' (the default) or 'owner' (the owner-computes form): the
    same bits either way; which is faster depends on the number of processes and the links."""
    form = os.environ.get("DPCORE_DIST_ALLREDUCE", "chain") or "chain"
    if form not in ("chain", "owner"):
        raise ValueError(f"DPCORE_DIST_ALLREDUCE must be 'chain' or 'owner', got {form!r}")
    return form == "owner"


def _gather_arrays(array, timeout, what):
    parts = _core.dist_allgather(array.tobytes(), timeout, what)
    return [np.frombuffer(b, array.dtype).reshape(array.shape) for b in parts]


def broadcast(tensor, src=0, timeout=DEFAULT_TIMEOUT):
    """Rank ``src``'s ``tensor`` on every rank (a NumPy array overwritten and returned, a
    dp.Tensor returned as a new Tensor on its device; a GPU's through a host copy, as in
    all_reduce); every rank passes the same dtype, shape and kind of memory."""
    from . import _check

    info = _join()
    src = _check.integer("src", src, 0, info["world_size"] - 1)
    array, rebuild, timeout, info = _collective_input("broadcast", tensor, timeout, (("src", src),))
    if info["world_size"] > 1:
        _core.dist_bcast(array, src, timeout, f"dp.distributed.broadcast(src={src})")
    return _result(array, rebuild)


def all_gather(tensor, timeout=DEFAULT_TIMEOUT):
    """Every rank's ``tensor``, as a list in rank order (NumPy arrays, or dp.Tensors on its device
    when ``tensor`` is one; a GPU's through host copies, as in all_reduce); every rank passes the
    same dtype, shape and kind of memory."""
    array, rebuild, timeout, info = _collective_input("all_gather", tensor, timeout)
    parts = _gather_arrays(array, timeout, "dp.distributed.all_gather()") if info["world_size"] > 1 \
        else [array.copy()]
    return [_result(np.array(p), rebuild) for p in parts]


def reduce_scatter(tensor, op="sum", timeout=DEFAULT_TIMEOUT):
    """``all_reduce(tensor, op)`` cut into world_size equal blocks along the first axis: rank r
    gets block r (a new array or Tensor; ``tensor`` is left as it was)."""
    from . import _check

    op = _check.one_of("op", op, _OPS)
    info = _join()
    P = info["world_size"]
    array, rebuild = _host_array(tensor, "reduce_scatter")
    if array.ndim == 0 or array.shape[0] % P:
        raise ValueError(f"reduce_scatter: the first axis ({array.shape[0] if array.ndim else 'none'}) must "
                         f"split into {P} equal blocks")
    reduced = all_reduce(np.array(array), op, timeout)
    block = array.shape[0] // P
    return _result(np.array(reduced[info["rank"] * block:(info["rank"] + 1) * block]), rebuild)


def _cpu_shared_by(local):
    """How many processes of this host share its cores: all of them when
    mpirun did not bind each process to its own cores (--bind-to none),
    else 1 (the affinity mask already is this process's share)."""
    try:
        mine = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return 1
    return local if mine >= (os.cpu_count() or mine) and local > 1 else 1


# ---- dpcore's own point-to-point channels (the multi-process pipeline) ----

# tags no user call can take (dp.distributed checks 0-99); csrc/dist.h: DP_DIST_P2P_TAGS
PRIVATE_TAGS = range(100, 256)


def _private_p2p(is_send, array, peer, tag, timeout, what):
    """A callable that sends the C-contiguous host array ``array`` to rank ``peer``
    (or receives into it, in place) on dpcore's own tag ``tag``, its sequence
    number taken now (program order pairs the k-th send with the k-th receive per
    peer and tag); ``what`` names the wait in a DistributedError. ``array`` may be
    a dp.Tensor in GPU memory: its bytes go by NCCL to the peer's GPU tensor (a
    different physical GPU: NCCL refuses one GPU for two ranks)."""
    if tag not in PRIVATE_TAGS:
        raise ValueError(f"a private tag is in [{PRIVATE_TAGS.start}, {PRIVATE_TAGS.stop}), got {tag}")
    gpu = _memory(array) == "GPU"
    code = _DTYPES.get(array.dtype if gpu else array.dtype.name)
    if code is None or not (gpu or array.flags.c_contiguous):
        raise TypeError(f"{what}: a C-contiguous array or a GPU tensor of {', '.join(_DTYPES)}, got {array.dtype}")
    seq = _core.dist_p2p_seq(is_send, peer, tag)

    def run():
        _core.dist_p2p(is_send, array, code, peer, tag, seq, timeout, what)
        return array
    return run


def _private_bcast(array, root, timeout, what):
    """Rank ``root``'s C-contiguous ``array`` on every rank, in place (collective; no
    agreement round: every rank already knows the dtype and shape)."""
    if _join()["world_size"] > 1:
        _core.dist_bcast(array, root, timeout, what)
    return array
