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

__all__ = ["Tensor", "tensor", "broadcast", "scatter", "split_batch", "gather", "all_reduce"]

Tensor = _core.Tensor


def tensor(data, device="cpu:0"):
    """A copy of ``data`` on ``device``: float32 for real data, uint8 kept as uint8
    (images), other integers as int64 (labels)."""
    device = _check.device("device", device)
    a = _check.array("data", data.numpy() if isinstance(data, Tensor) else data)
    if a.dtype == np.uint8:
        pass
    elif a.dtype.kind in "iu":
        a = a.astype(np.int64)
    else:
        a = _check.float32_values("data", a)
    return Tensor(np.ascontiguousarray(a), device)


def broadcast(t, devices):
    """A copy of ``t`` on each device (a device name, or a list of them)."""
    names = _check.devices("devices", devices)
    src = _check.array("t", t.numpy() if isinstance(t, Tensor) else t)
    return [tensor(src, d) for d in names]


def scatter(data, devices):
    """Split ``data`` along axis 0 into one shard per device (sizes differ by at most one)."""
    names = _check.devices("devices", devices)
    a = _check.array("data", data.numpy() if isinstance(data, Tensor) else data)
    if a.ndim == 0:
        raise ValueError("data must be an array with a first axis to split, got a 0-d array")
    return [tensor(a[b:e], d) for (b, e), d in zip(_core.shard_ranges(len(a), len(names)), names)]


def split_batch(X, y, devices):
    """(X shards, y shards) on the devices, split the same way (d2l's split_batch)."""
    X = _check.array("X", X.numpy() if isinstance(X, Tensor) else X)
    y = _check.array("y", y.numpy() if isinstance(y, Tensor) else y, kinds="iu")
    if X.ndim == 0 or y.ndim == 0:
        raise ValueError(f"X and y must be arrays with a first axis (samples), got shapes {X.shape} and {y.shape}")
    if len(X) != len(y):
        raise ValueError(f"X has {len(X)} samples but y has {len(y)}: X and y must have the same number of samples")
    return scatter(X, devices), scatter(y, devices)


def gather(tensors, device):
    """Concatenate tensors along axis 0 onto one device."""
    device = _check.device("device", device)
    tensors = _check.sequence("tensors", tensors, "a list of tensors or arrays")
    if not tensors:
        raise ValueError("tensors must be a list of at least one tensor, got []")
    parts = [_check.array(f"tensors[{i}]", t.numpy() if isinstance(t, Tensor) else t) for i, t in enumerate(tensors)]
    if any(p.ndim == 0 for p in parts) or len({p.shape[1:] for p in parts}) != 1:
        raise ValueError(f"tensors must have one shape after the first axis; their shapes after the first axis "
                         f"differ: {[p.shape for p in parts]}")
    return tensor(np.concatenate(parts), device)


def all_reduce(tensors, op="sum"):
    """Reduce float32 tensors on distinct devices in place: afterwards every one holds
    the sum (or mean) of all. Every replica thread reduces 1/k of the buffer; the
    result is the same bits every run."""
    op = _check.one_of("op", op, ("sum", "mean"))
    tensors = _check.sequence("tensors", tensors, "a list of dp.Tensor")
    for i, t in enumerate(tensors):
        if not isinstance(t, Tensor):
            raise TypeError(f"tensors[{i}] is not a dpcore tensor: it must be a dp.Tensor (dp.tensor(data, device)), "
                            f"got {type(t).__name__}")
    _core.all_reduce(tensors, 1 if op == "mean" else 0)
    return tensors
