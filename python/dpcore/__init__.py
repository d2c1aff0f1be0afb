"""dpcore — data-parallel training of convolutional networks with a C core.

    import dpcore as dp
    net = dp.models.LeNet()
    train_iter, test_iter = dp.data.load_fashion_mnist(batch_size=256)
    history = dp.train(net, train_iter, test_iter, num_epochs=10, lr=0.2)
"""
__version__ = "0.1.0"

from .errors import DataError, DeviceError, DistributedError, DpcoreError  # noqa: F401  (first: the extension imports them)
from . import _blas_kernels

with _blas_kernels.loading():  # OpenBLAS picks its kernels as the extension loads it
    from . import _core  # noqa: F401
from . import data, distributed, models, ops  # noqa: F401
from .config import (get_allow_tf32, get_deterministic, get_precision, set_allow_tf32,  # noqa: F401
                     set_deterministic, set_precision)
from .devices import list_devices, set_logical_devices  # noqa: F401
from .info import build_info  # noqa: F401
from .launch import launch  # noqa: F401
from .parallel import Tensor, all_reduce, broadcast, gather, scatter, split_batch, tensor  # noqa: F401
from .strategy import (MirroredStrategy, ModelParallelStrategy, MultiWorkerMirroredStrategy,  # noqa: F401
                       PipelineStrategy, get_strategy)  # noqa: F401
from .scaling import ScalingReport, scaling_report  # noqa: F401
from .timeline import Timeline, profile  # noqa: F401
from .train import History, train  # noqa: F401

__all__ = [
    "DataError", "DeviceError", "DistributedError", "DpcoreError", "History", "MirroredStrategy",
    "ModelParallelStrategy", "MultiWorkerMirroredStrategy", "PipelineStrategy", "Tensor", "all_reduce", "broadcast", "build_info", "data", "distributed", "gather", "get_allow_tf32", "get_deterministic", "get_precision", "get_strategy", "launch", "list_devices", "models",
    "ops", "scatter", "set_allow_tf32", "set_deterministic", "set_logical_devices", "set_precision", "split_batch", "tensor", "Timeline", "train",
    "profile", "scaling_report", "ScalingReport",
]
