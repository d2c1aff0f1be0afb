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

from . import _check, _core
from .batches import int64_labels
from .devices import check_device

__all__ = ["Tensor", "tensor", "broadcast", "scatter", "split_batch", "gather", "all_reduce"]

Tensor = _core.Tensor


def tensor(data, device="cpu:0"):
    """A copy of ``data`` on ``device``: float32 for real data, uint8 kept as uint8
    (images), other integers as int64 (labels)."""
    device = check_device(_check.string("device", device))
    if data is None:
        raise TypeError("data must be an array (or a list of numbers), got None")
    if isinstance(data, Tensor):
        data = data.numpy()
    a = np.asarray(data)
    if a.dtype == np.uint8:
        pass
    elif a.dtype.kind in "iu":
        a = int64_labels(a, "data: value")
    elif a.dtype.kind == "f":
        a = a.astype(np.float32)
    else:
        raise TypeError(f"data must be real or integer, got dtype {a.dtype}")
    return Tensor(np.ascontiguousarray(a), device)


def broadcast(t, devices):
    """A copy of ``t`` on each device."""
    if t is None:
        raise TypeError("t must be a dpcore tensor or an array, got None")
    src = t.numpy() if isinstance(t, Tensor) else t
    return [tensor(src, d) for d in _devices(devices)]


def _devices(devices, name="devices"):
    """The canonical names of a list of distinct devices (one name is a list of one)."""
    names = [check_device(d) for d in _check.device_names(name, devices)]
    if len(set(names)) != len(names):
        raise ValueError(f"{name} must name each device once, got {names}")
    return names


def scatter(data, devices):
    """Split ``data`` along axis 0 into one shard per device (sizes differ by at most one)."""
    names = _devices(devices)
    a = data.numpy() if isinstance(data, Tensor) else np.asarray(data)
    if a.ndim == 0:
        raise ValueError(f"data must be an array with a first axis to split, got {_check.shown(data)}")
    return [tensor(a[b:e], d) for (b, e), d in zip(_core.shard_ranges(len(a), len(names)), names)]


def split_batch(X, y, devices):
    """(X shards, y shards) on the devices, split the same way (d2l's split_batch)."""
    X = X.numpy() if isinstance(X, Tensor) else np.asarray(X)
    y = y.numpy() if isinstance(y, Tensor) else np.asarray(y)
    if len(X) != len(y):
        raise ValueError(f"y must have one label per sample of X ({len(X)}), got {len(y)}")
    return scatter(X, devices), scatter(y, devices)


def gather(tensors, device):
    """Concatenate tensors along axis 0 onto one device."""
    tensors = _tensor_list(tensors)
    parts = [t.numpy() if isinstance(t, Tensor) else np.asarray(t) for t in tensors]
    if any(p.ndim == 0 for p in parts) or len({p.shape[1:] for p in parts}) != 1:
        raise ValueError(f"tensors must have the same shape after the first axis, got {[p.shape for p in parts]}")
    return tensor(np.concatenate(parts), device)


def all_reduce(tensors, op="sum"):
    """Reduce float32 tensors on distinct devices in place: afterwards every one holds
    the sum (or mean) of all. Every replica thread reduces 1/k of the buffer; the
    result is the same bits every run."""
    op = _check.one_of("op", op, ("sum", "mean"))
    tensors = _tensor_list(tensors)
    for i, t in enumerate(tensors):
        if not isinstance(t, Tensor):
            raise TypeError(f"tensors must be dpcore tensors (dp.tensor, replica.grads), got "
                            f"{type(t).__name__} at position {i}")
    _core.all_reduce(tensors, 1 if op == "mean" else 0)
    return tensors


def _tensor_list(tensors):
    """A non-empty list from a list or tuple of tensors."""
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"tensors must be a list of tensors, got {type(tensors).__name__} {_check.shown(tensors)}")
    if not tensors:
        raise ValueError("tensors must hold at least one tensor, got an empty list")
    return list(tensors)
