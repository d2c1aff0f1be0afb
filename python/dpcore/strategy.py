"""MirroredStrategy: one replica of the model per device, trained in lockstep.

    strategy = dp.MirroredStrategy()          # every GPU, else the logical CPU devices
    with strategy.scope():
        net = dp.models.LeNet()               # mirrored: one replica per device
    dp.train(net, train_iter, test_iter, num_epochs=10, lr=0.2)

Each minibatch is split over the replicas (shards differ by at most one sample),
the replicas run forward and backward at once, one thread each, the flat
gradient buffers are all-reduced so that every replica holds the exact mean
gradient of the global batch, and all take the same SGD step.
"""
import contextlib
import contextvars
import warnings

from . import _core
from .devices import list_devices
from .info import build_flags
from .parallel import _devices

__all__ = ["MirroredStrategy", "get_strategy"]

_current = contextvars.ContextVar("dpcore_strategy", default=None)


class MirroredStrategy:
    def __init__(self, devices=None):
        if devices is None:
            available = list_devices()
            gpus = [d for d in available if d.startswith("cuda:")]
            if len(gpus) > 1:
                # TODO(issue 5, item 3): NCCL / logical-GPU all-reduce; until then one GPU replica
                warnings.warn(f"MirroredStrategy: all-reduce across CUDA replicas is not implemented yet; "
                              f"using {gpus[0]} of {gpus}", RuntimeWarning, stacklevel=2)
                gpus = gpus[:1]
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
        return f"MirroredStrategy(devices={self._devices})"


def get_strategy():
    """The strategy whose scope is active, or None."""
    return _current.get()
