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

The configuration, the listing and the devices themselves live in the C core's
device registry (csrc/device.h): one refcounted device per name, made on first
use and shared by every model and tensor on it. This module is its Python face.
"""
import os
import warnings

from . import _check, _core

__all__ = ["list_devices", "set_logical_devices", "device_threads", "check_device"]


def _cores():
    return _core.runtime_info()["cpu_cores"]


def set_logical_devices(kind, count):
    """Split the CPU into ``count`` logical devices ``cpu:0 .. cpu:{count-1}``,
    or (kind 'cuda') each physical GPU into ``count`` logical GPUs.

    Models and tensors made before keep the devices they were made on (with
    the cores or GPU those were made with) until they are released; models
    and tensors made afterwards get the new mapping.
    """
    kind = _check.one_of("kind", kind, ("cpu", "cuda"))
    count = _check.integer("count", count, 1, _check.MAX_DEVICES)
    _core.set_logical_devices(kind, count)  # ValueError: a count out of range, or logical GPUs without a GPU
    if kind == "cpu" and count > _cores():
        warnings.warn(f"{count} logical CPU devices on {_cores()} cores: each gets one thread and they share cores",
                      RuntimeWarning, stacklevel=2)
    bind = os.environ.get("OMP_PROC_BIND", "").strip().lower()
    if kind == "cpu" and count > 1 and bind not in ("", "false"):
        warnings.warn(f"OMP_PROC_BIND={bind} binds every logical CPU device's OpenMP threads to the same places, so "
                      f"the replicas share cores (benchmarks/bench_threads.py measured 2 replicas about 1.8x slower "
                      f"with it): unset OMP_PROC_BIND before starting Python", RuntimeWarning, stacklevel=2)


def _listing():
    """{name: (kind, index, physical_gpu, threads)} under the current configuration."""
    return {name: tuple(rest) for name, *rest in _core.list_devices()}


def list_devices():
    """Names of the devices dpcore can train on, e.g. ``['cpu:0', 'cpu:1']``."""
    return [d[0] for d in _core.list_devices()]


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
    return _listing()[check_device(name)][2]


def device_threads(name):
    """Cores a device's replica may use: its share of the machine (1 for a GPU's
    replica thread, which only issues work)."""
    return _listing()[check_device(name)][3]
