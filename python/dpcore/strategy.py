"""MirroredStrategy: one replica of the model per device, trained in lockstep.

    strategy = dp.MirroredStrategy()          # every GPU, else the logical CPU devices
    with strategy.scope():
        net = dp.models.LeNet()               # mirrored: one replica per device
    dp.train(net, train_iter, test_iter, num_epochs=10, lr=0.2)

Each minibatch is split over the replicas (shards differ by at most one sample),
the replicas run forward and backward at once, one thread each, the flat
gradient buffers are all-reduced so that every replica holds the exact mean
gradient of the global batch, and all take the same SGD step.

The all-reduce (``all_reduce=``):

- ``'host'``: CPU replicas, in-process through shared memory (each replica
  thread reduces 1/k of the buffer, in rank order: deterministic).
- ``'nccl'``: CUDA replicas on distinct GPUs, through NCCL; the communicators
  are made with the strategy's first model, so a failure shows there.
- ``'kernel'``: CUDA replicas NCCL cannot serve: several logical GPUs on one
  physical GPU (``dp.set_logical_devices('cuda', k)``), or GPUs with peer
  access when NCCL is missing. dpcore's own reduction kernel, bitwise the CPU
  all-reduce's rank-ordered sum.
- ``'auto'`` (default): the one that fits the devices.

The gradient all-reduce runs in buckets of about ``bucket_mb`` MiB (PyTorch
DDP's default, 25), each started as soon as the backward pass has produced it,
so that on GPUs it overlaps the backward pass of the earlier layers;
``bucket_mb=0`` reduces the whole buffer after the backward pass.
"""
import contextlib
import contextvars

from . import _check, _core
from .devices import list_devices
from .info import build_flags
from .parallel import _devices

__all__ = ["MirroredStrategy", "ModelParallelStrategy", "MultiWorkerMirroredStrategy", "PipelineStrategy",
           "get_strategy"]

DEFAULT_BUCKET_MB = 25
ALL_REDUCE_KINDS = ("auto", "host", "kernel", "nccl", "mpi")


def check_all_reduce_options(all_reduce, bucket_mb):
    """Validated (all_reduce, bucket_mb)."""
    all_reduce = _check.one_of("all_reduce", all_reduce, ALL_REDUCE_KINDS)
    # 0: the whole buffer at once, after the backward pass
    return all_reduce, _check.real("bucket_mb", bucket_mb, 0.0, 2.0**40)

_current = contextvars.ContextVar("dpcore_strategy", default=None)


class MirroredStrategy:
    """One replica per device. devices: default every GPU (every logical GPU
    after ``dp.set_logical_devices('cuda', k)``), else every logical CPU device;
    then ``no_gpu_reason`` says why no GPU was taken (None otherwise). A machine
    without a GPU is a CPU user's normal case: no warning is given for it
    (``dp.build_info()['summary']`` says it too).
    all_reduce, bucket_mb: see the module's documentation."""

    def __init__(self, devices=None, all_reduce="auto", bucket_mb=DEFAULT_BUCKET_MB):
        self.all_reduce, self.bucket_mb = check_all_reduce_options(all_reduce, bucket_mb)
        self.no_gpu_reason = None
        if devices is None:
            available = list_devices()
            gpus = [d for d in available if d.startswith("cuda:")]
            devices = gpus or [d for d in available if d.startswith("cpu:")]
            if not gpus:
                self.no_gpu_reason = ("no usable CUDA device: " + _core.runtime_info()["cuda_why"]
                                      if build_flags()["cuda"] else "dpcore was built without CUDA")
        self._devices = _devices(devices, "devices")

    @property
    def devices(self):
        return list(self._devices)

    @property
    def num_replicas_in_sync(self):
        return len(self._devices)

    @contextlib.contextmanager
    def scope(self):
        """Models built inside are mirrored over this strategy's devices."""
        token = _current.set(self)
        try:
            yield self
        finally:
            _current.reset(token)

    # the strategy's replicas span processes (MultiWorkerMirroredStrategy)
    _across = False
    # threads per CPU replica; None: the device's share of the cores
    _threads = None

    def __repr__(self):
        return f"MirroredStrategy(devices={self._devices}, all_reduce={self.all_reduce!r}, bucket_mb={self.bucket_mb})"


class MultiWorkerMirroredStrategy(MirroredStrategy):
    """The replicas of every process of an MPI job, trained in lockstep: run the
    same script under ``mpirun -np P``; each process mirrors over its own local
    devices and the job's replicas are processes x local devices.

    devices: this process's devices; default one GPU per process on a host
    (``cuda:{local_rank}``) when there are GPUs, else this process's logical
    CPU devices. all_reduce: ``'auto'`` ('mpi' for CPU replicas, 'nccl' for GPU
    replicas), ``'mpi'`` or ``'nccl'``. timeout: seconds any process waits for
    another before raising :class:`dpcore.DistributedError` naming it (default
    60).

    What the job computes is what one process with all the replicas computes:
    each global batch is split over every replica of every process (contiguous
    shards, sizes differing by at most one, in rank order), the gradient is
    the exact mean over the global batch, and on CPU replicas the reduction is
    rank-ordered, so 2 processes x 1 replica give bitwise the weights of 1
    process x 2 replicas. Every process must pass the same global batches (the
    same data and the same shuffling seed): each step checks that they do.
    Models built in the scope start from rank 0's parameters.
    """

    _across = True

    def __init__(self, devices=None, all_reduce="auto", bucket_mb=DEFAULT_BUCKET_MB, timeout=None):
        from . import distributed

        self.timeout = distributed._check_timeout(distributed.DEFAULT_TIMEOUT if timeout is None else timeout)
        info = distributed._join()
        if devices is None:
            gpus = [d for d in list_devices() if d.startswith("cuda:")]
            if gpus:
                if info["local_size"] > len(gpus):
                    raise ValueError(f"MultiWorkerMirroredStrategy: {info['local_size']} processes on this host "
                                     f"share {len(gpus)} GPU(s); across processes GPU replicas need a GPU each "
                                     "(NCCL refuses two ranks on one GPU): start one process per GPU, or pass "
                                     "devices=")
                devices = [gpus[info["local_rank"]]]
            else:
                devices = [d for d in list_devices() if d.startswith("cpu:")]
        super().__init__(devices, all_reduce, bucket_mb)
        shared = distributed._cpu_shared_by(info["local_size"])
        if shared > 1:
            # mpirun did not bind the processes: they share the cores, so each
            # replica gets its share of its device's cores
            from .devices import device_threads
            self._threads = {d: max(1, device_threads(d) // shared) for d in self._devices}
        self._rank, self._world = info["rank"], info["world_size"]
        self._replicas_per_process = distributed.allgather_object(
            len(self._devices), self.timeout, "the start of MultiWorkerMirroredStrategy()")

    @property
    def num_replicas_in_sync(self):
        """Replicas of the whole job (every process's devices)."""
        return sum(self._replicas_per_process)

    @property
    def rank(self):
        return self._rank

    @property
    def world_size(self):
        return self._world

    def __repr__(self):
        return (f"MultiWorkerMirroredStrategy(rank {self._rank} of {self._world}, devices={self._devices}, "
                f"all_reduce={self.all_reduce!r}, bucket_mb={self.bucket_mb}, timeout={self.timeout})")


class PipelineStrategy(MirroredStrategy):
    """Pipeline parallelism (the chapter's network partitioning), alone or
    under data parallelism.

        strategy = dp.PipelineStrategy(devices=['cpu:0', 'cpu:1'], micro_batches=4, schedule='1f1b')
        with strategy.scope():
            net = dp.models.ResNet18()        # 2 stages, balanced by measured cost
        dp.train(net, train_iter, test_iter, num_epochs=10, lr=0.1)
        print(net.pipeline_report())

    devices: stage i of pipeline r on devices[r * p + i] (p = len(devices) /
    replicas stages); default: every GPU, else every logical CPU device.
    micro_batches: each (shard of a) minibatch is cut into this many (sizes
    differ by at most one; fewer when the batch is smaller). schedule: '1f1b'
    (a micro-batch's backward pass as early as possible: stage i keeps at most
    p - i micro-batches' activations) or 'gpipe' (every forward pass, then every
    backward pass: m micro-batches' activations). split: the layer indices
    where the stages begin; without it the stages balance each layer's
    training time measured alone on the first device (balance='measured':
    a few passes of 8 samples when the model is built; the split can differ
    between machines, the arithmetic does not) or its counted training FLOPs
    (balance='flops': the same split everywhere).
    replicas: pipelines side by side, each on 1/replicas of the batch, each
    stage's gradients all-reduced among its copies. The step applies the
    full-batch gradient; BatchNorm normalises each micro-batch with its own
    statistics (as GPipe does). See :mod:`dpcore.pipeline`.

    Across the processes of an MPI job (:mod:`dpcore.pipeline_mpi`): under
    ``mpirun -np W`` without devices, stage i of pipeline r runs on rank
    r * p + i (p = W / replicas), on ``cuda:{local_rank}`` where the host has
    GPUs, else ``cpu:0``; or devices name their ranks, ``['rank0/cpu:0',
    'rank1/cpu:0']`` (the same list on every rank). Every rank runs the same
    script and calls: the same bits as one process running the same stages.
    timeout: seconds a process waits for another before raising
    :class:`dpcore.DistributedError` naming it and the stage (default 60).
    """

    def __init__(self, devices=None, micro_batches=4, schedule="1f1b", split=None, replicas=1, balance="measured",
                 timeout=None):
        from . import distributed
        from .pipeline import SCHEDULES
        from .ranks import job_devices, spans_processes

        self.timeout = distributed._check_timeout(distributed.DEFAULT_TIMEOUT if timeout is None else timeout)
        self.micro_batches = _check.integer("micro_batches", micro_batches, 1, 2**31 - 1)
        self.schedule = _check.one_of("schedule", schedule.lower() if isinstance(schedule, str) else schedule,
                                      SCHEDULES)
        self.replicas = _check.integer("replicas", replicas, 1, _check.MAX_DEVICES)
        # across processes (dpcore.pipeline_mpi): [(rank, device)] of the job's stages; None: this process's
        self._placement = None
        if spans_processes(devices):
            self._placement = job_devices("PipelineStrategy", devices, self.replicas, self.timeout)
            self._devices = [f"rank{q}/{d}" for q, d in self._placement]
            self.all_reduce, self.bucket_mb, self.no_gpu_reason = "auto", DEFAULT_BUCKET_MB, None
        else:
            super().__init__(devices)
        self.replicas = _check.integer("replicas", replicas, 1, len(self._devices))
        if len(self._devices) % self.replicas:
            raise ValueError(f"replicas={self.replicas} must divide the {len(self._devices)} devices "
                             f"{self._devices} (each pipeline has the same number of stages)")
        if split is not None and (isinstance(split, (str, bytes)) or not isinstance(split, (list, tuple))):
            raise TypeError(f"split must be a list of the layer indices where stages begin, got "
                            f"{_check.shown(split)}")
        if split is not None:
            split = [_check.integer(f"split[{i}]", c, 0, 2**31 - 1) for i, c in enumerate(split)]
            p = len(self._devices) // self.replicas
            if len(split) not in (p, p - 1) or any(b <= a for a, b in zip(split, split[1:])) or (
                    len(split) == p and split[0] != 0):
                raise ValueError(f"split must be the {p} increasing layer indices where the stages begin (the "
                                 f"first 0, which may be left out), got {split}")
        self.split = split
        self.balance = _check.one_of("balance", balance, ("measured", "flops"))

    @property
    def num_stages(self):
        return len(self._devices) // self.replicas

    @property
    def across_ranks(self):
        """Whether the stages live on the ranks of an MPI job (devices 'rankQ/dev')."""
        return self._placement is not None

    @property
    def num_replicas_in_sync(self):
        return self.replicas

    def __repr__(self):
        return (f"PipelineStrategy(devices={self._devices}, micro_batches={self.micro_batches}, "
                f"schedule={self.schedule!r}, split={self.split}, replicas={self.replicas}, "
                f"balance={self.balance!r}{f', timeout={self.timeout}' if self.across_ranks else ''})")


class ModelParallelStrategy(MirroredStrategy):
    """Layerwise (tensor) parallelism: every convolution's output channels and
    every dense layer's output features split across the devices, so that each
    device holds 1/k of every weight and computes 1/k of every layer.

        strategy = dp.ModelParallelStrategy(devices=['cpu:0', 'cpu:1'])
        with strategy.scope():
            net = dp.models.LeNet()
        dp.train(net, train_iter, test_iter, num_epochs=10, lr=0.2)
        print(net.model_parallel_report())

    devices: default every GPU, else every logical CPU device. replicas=R:
    data parallelism over R copies of the split network, each over
    len(devices) / R devices (the first copy on the first ones): each copy
    trains on its shard of the batch, each slice's gradients are all-reduced
    among its R copies and BatchNorm's running statistics averaged, as
    MirroredStrategy does. See :mod:`dpcore.tensor_parallel`.

    Across the processes of an MPI job: under ``mpirun -np W`` without devices,
    slice i of every layer runs on rank i (``cuda:{local_rank}`` where the host
    has GPUs, else ``cpu:0``); or devices name their ranks, one each
    (``['rank0/cpu:0', 'rank1/cpu:0']``, the same list on every rank). The same
    bits as one process with the same slices. timeout: seconds a rank waits
    for another before raising :class:`dpcore.DistributedError` (default 60).
    """

    def __init__(self, devices=None, replicas=1, timeout=None):
        from . import distributed
        from .ranks import job_devices, spans_processes

        self.timeout = distributed._check_timeout(distributed.DEFAULT_TIMEOUT if timeout is None else timeout)
        replicas = _check.integer("replicas", replicas, 1, _check.MAX_DEVICES)
        self.across_ranks = spans_processes(devices)
        if self.across_ranks:
            placement = job_devices("ModelParallelStrategy", devices, replicas, self.timeout)
            ranks = sorted(q for q, _ in placement)
            if ranks != list(range(distributed.world_size())):
                raise ValueError(f"ModelParallelStrategy: across processes each rank holds one slice: "
                                 f"{[f'rank{q}/{d}' for q, d in placement]} names ranks {ranks}")
            self._devices = [f"rank{q}/{d}" for q, d in placement]
            self.all_reduce, self.bucket_mb, self.no_gpu_reason = "auto", DEFAULT_BUCKET_MB, None
        else:
            super().__init__(devices)
        self.replicas = _check.integer("replicas", replicas, 1, len(self._devices))
        if len(self._devices) % self.replicas:
            raise ValueError(f"replicas={self.replicas} must divide the {len(self._devices)} devices "
                             f"{self._devices} (each copy is split over the same number of devices)")

    @property
    def num_replicas_in_sync(self):
        return self.replicas

    def __repr__(self):
        return f"ModelParallelStrategy(devices={self._devices}, replicas={self.replicas})"


def get_strategy():
    """The strategy whose scope is active, or None."""
    return _current.get()
