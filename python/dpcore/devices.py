"""Devices: the CPU split into logical devices, and (with the CUDA backend) GPUs.

``set_logical_devices('cpu', k)`` splits this machine's cores into k devices
``cpu:0 .. cpu:k-1``; each gets cores // k threads (the first cores % k get one
more), so k replicas running at once never oversubscribe the machine when
k <= cores. Like TensorFlow's logical device configuration, it lets scatter,
all-reduce and replica training run on any machine.

With the CUDA backend built and GPUs present, ``cuda:0 .. cuda:{g-1}`` name the
g usable GPUs. ``set_logical_devices('cuda', k)`` splits each physical GPU into
k logical GPUs (each replica then has its own stream on the shared GPU):
``cuda:i`` is logical GPU i % k of physical GPU i // k.
"""
import warnings

from . import _core
from .info import build_flags

__all__ = ["list_devices", "set_logical_devices", "device_threads", "check_device"]

_cpu_devices = 1
_cuda_per_gpu = 1  # logical GPUs per physical GPU


def _cores():
    return _core.runtime_info()["cpu_cores"]


def _gpu_count():
    """Physical GPUs the CUDA backend can use here (0 without the backend or a driver)."""
    if not build_flags().get("cuda_backend"):
        return 0
    return _core.runtime_info()["cuda_device_count"]


def set_logical_devices(kind, count):
    """Split the CPU into ``count`` logical devices ``cpu:0 .. cpu:{count-1}``,
    or (kind 'cuda') each physical GPU into ``count`` logical GPUs.

    Models and tensors made before keep the devices they were made on.
    """
    global _cpu_devices, _cuda_per_gpu
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"logical devices can be set for 'cpu' or 'cuda', got {kind!r}")
    if isinstance(count, bool) or not isinstance(count, int):
        raise TypeError(f"count must be an int, got {type(count).__name__}")
    if not 1 <= count <= 64:
        raise ValueError(f"count must be between 1 and 64, got {count}")
    if kind == "cuda":
        if _gpu_count() == 0:
            raise ValueError("logical GPUs need a usable CUDA device; there is none here "
                             f"({_core.runtime_info()['cuda_why'] or 'built without the CUDA backend'})")
        if count * _gpu_count() > 64:
            raise ValueError(f"{count} logical GPUs on each of {_gpu_count()} GPUs is more than 64 devices")
        _cuda_per_gpu = count
        return
    if count > _cores():
        warnings.warn(f"{count} logical CPU devices on {_cores()} cores: each gets one thread and they share cores",
                      RuntimeWarning, stacklevel=2)
    _cpu_devices = count


def list_devices():
    """Names of the devices dpcore can train on, e.g. ``['cpu:0', 'cpu:1']``."""
    return [f"cpu:{i}" for i in range(_cpu_devices)] + [f"cuda:{i}" for i in range(_gpu_count() * _cuda_per_gpu)]


def check_device(name):
    """The canonical name of a device ('cpu' means 'cpu:0'); ValueError if unknown."""
    if not isinstance(name, str):
        raise TypeError(f"a device is named by a string like 'cpu:0', got {type(name).__name__}")
    canonical = name if ":" in name else name + ":0"
    if canonical not in list_devices():
        raise ValueError(f"unknown device {name!r}; the devices are {list_devices()} "
                         f"(dp.set_logical_devices('cpu', k) makes more CPU devices)")
    return canonical


def device_index(name):
    return int(check_device(name).split(":")[1])


def device_kind(name):
    """'cpu' or 'cuda'."""
    return check_device(name).split(":")[0]


def device_gpu(name):
    """The physical GPU of logical GPU ``name`` ('cuda:i')."""
    return device_index(name) // _cuda_per_gpu


def device_threads(name):
    """Cores a device's replica may use: its share of the machine (1 for a GPU's
    replica thread, which only issues work)."""
    if device_kind(name) == "cuda":
        return 1
    index = device_index(name)
    cores = _cores()
    base, extra = divmod(cores, _cpu_devices)
    return max(1, base + (1 if index < extra else 0))
