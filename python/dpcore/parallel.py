"""The pieces of chapter 12.5: tensors on devices, broadcast, scatter, split_batch,
gather, all_reduce.

    data = [dp.tensor(np.ones((1, 2)) * (i + 1), device=f'cpu:{i}') for i in range(2)]
    dp.all_reduce(data)          # both become [[3., 3.]]
    dp.scatter(np.arange(20).reshape(4, 5), ['cpu:0', 'cpu:1'])   # two 2x5 halves

A batch of n samples over k devices is split into contiguous shards whose sizes
differ by at most one (the first n % k shards get one more); fewer samples than
devices gives empty shards. dp.train splits every batch the same way.
"""
import numpy as np

from . import _core
from .devices import check_device

__all__ = ["Tensor", "tensor", "broadcast", "scatter", "split_batch", "gather", "all_reduce"]

Tensor = _core.Tensor


def tensor(data, device="cpu:0"):
    """A copy of ``data`` on ``device``: float32 for real data, uint8 kept as uint8
    (images), other integers as int64 (labels)."""
    device = check_device(device)
    if isinstance(data, Tensor):
        data = data.numpy()
    a = np.asarray(data)
    if a.dtype == np.uint8:
        pass
    elif a.dtype.kind in "iu":
        a = a.astype(np.int64)
    elif a.dtype.kind == "f":
        a = a.astype(np.float32)
    else:
        raise TypeError(f"dp.tensor needs real or integer data, got dtype {a.dtype}")
    return Tensor(np.ascontiguousarray(a), device)


def broadcast(t, devices):
    """A copy of ``t`` on each device."""
    src = t.numpy() if isinstance(t, Tensor) else t
    return [tensor(src, d) for d in _devices(devices)]


def _devices(devices):
    if isinstance(devices, str):
        raise TypeError("devices must be a list of device names, e.g. ['cpu:0', 'cpu:1']")
    names = [check_device(d) for d in devices]
    if not names:
        raise ValueError("need at least one device")
    if len(set(names)) != len(names):
        raise ValueError(f"a device appears twice in {names}")
    return names


def scatter(data, devices):
    """Split ``data`` along axis 0 into one shard per device (sizes differ by at most one)."""
    names = _devices(devices)
    a = data.numpy() if isinstance(data, Tensor) else np.asarray(data)
    if a.ndim == 0:
        raise ValueError("scatter needs an array with a first axis to split")
    return [tensor(a[b:e], d) for (b, e), d in zip(_core.shard_ranges(len(a), len(names)), names)]


def split_batch(X, y, devices):
    """(X shards, y shards) on the devices, split the same way (d2l's split_batch)."""
    X = X.numpy() if isinstance(X, Tensor) else np.asarray(X)
    y = y.numpy() if isinstance(y, Tensor) else np.asarray(y)
    if len(X) != len(y):
        raise ValueError(f"X has {len(X)} samples but y has {len(y)}")
    return scatter(X, devices), scatter(y, devices)


def gather(tensors, device):
    """Concatenate tensors along axis 0 onto one device."""
    tensors = list(tensors)
    if not tensors:
        raise ValueError("gather needs at least one tensor")
    parts = [t.numpy() if isinstance(t, Tensor) else np.asarray(t) for t in tensors]
    if len({p.shape[1:] for p in parts}) != 1:
        raise ValueError(f"gather: shapes after the first axis differ: {[p.shape for p in parts]}")
    return tensor(np.concatenate(parts), device)


def all_reduce(tensors, op="sum"):
    """Reduce float32 tensors on distinct devices in place: afterwards every one holds
    the sum (or mean) of all. Every replica thread reduces 1/k of the buffer; the
    result is the same bits every run."""
    if op not in ("sum", "mean"):
        raise ValueError(f"op must be 'sum' or 'mean', got {op!r}")
    tensors = list(tensors)
    _core.all_reduce(tensors, 1 if op == "mean" else 0)
    return tensors
