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
import warnings

from . import _core
from .devices import list_devices
from .info import build_flags
from .parallel import _devices

__all__ = ["MirroredStrategy", "get_strategy"]

DEFAULT_BUCKET_MB = 25
ALL_REDUCE_KINDS = ("auto", "host", "kernel", "nccl")


def check_all_reduce_options(all_reduce, bucket_mb):
    """Validated (all_reduce, bucket_mb)."""
    if not isinstance(all_reduce, str):
        raise TypeError(f"all_reduce must be one of {ALL_REDUCE_KINDS}, got {type(all_reduce).__name__}")
    if all_reduce not in ALL_REDUCE_KINDS:
        raise ValueError(f"all_reduce must be one of {ALL_REDUCE_KINDS}, got {all_reduce!r}")
    if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)):
        raise TypeError(f"bucket_mb must be a number of MiB, got {type(bucket_mb).__name__}")
    if not bucket_mb >= 0 or bucket_mb * 2**20 > 2**62:
        raise ValueError(f"bucket_mb must be >= 0 (and finite), got {bucket_mb!r}")
    return all_reduce, bucket_mb

_current = contextvars.ContextVar("dpcore_strategy", default=None)


class MirroredStrategy:
    """One replica per device. devices: default every GPU (every logical GPU
    after ``dp.set_logical_devices('cuda', k)``), else every logical CPU device.
    all_reduce, bucket_mb: see the module's documentation."""

    def __init__(self, devices=None, all_reduce="auto", bucket_mb=DEFAULT_BUCKET_MB):
        self.all_reduce, self.bucket_mb = check_all_reduce_options(all_reduce, bucket_mb)
        if devices is None:
            available = list_devices()
            gpus = [d for d in available if d.startswith("cuda:")]
            devices = gpus or [d for d in available if d.startswith("cpu:")]
            if not gpus and build_flags()["cuda"]:
                # built for GPUs but none is usable here: say why, then train on the CPU
                why = _core.runtime_info()["cuda_why"]
                warnings.warn(f"MirroredStrategy: no usable CUDA device ({why}); using {devices}", RuntimeWarning,
                              stacklevel=2)
        self._devices = _devices(devices)

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

    def __repr__(self):
        return f"MirroredStrategy(devices={self._devices}, all_reduce={self.all_reduce!r}, bucket_mb={self.bucket_mb})"


def get_strategy():
    """The strategy whose scope is active, or None."""
    return _current.get()
