"""Checks and conversions of user batches before they reach the C core.

The core accepts exactly: images (N, C, H, W) uint8 or float32, C-contiguous;
labels (N,) int64. Everything a user may reasonably pass is converted here,
and everything else gets a ValueError / TypeError saying what was expected.
"""
import numpy as np


def as_images(X, input_shape):
    """(N, C, H, W) uint8 or float32, C-contiguous. (N, H, W) gains a channel axis when C == 1."""
    if not isinstance(X, np.ndarray):
        X = np.asarray(X)
    if X.dtype.kind not in "fu" and X.dtype.kind != "i" or X.dtype == np.bool_:
        raise TypeError(f"images must be uint8 or floating point, got dtype {X.dtype}")
    if X.ndim == 3 and input_shape[0] == 1:
        X = X[:, None, :, :]
    if X.ndim != 4 or tuple(X.shape[1:]) != tuple(input_shape):
        raise ValueError(f"images must have shape (N, {', '.join(map(str, input_shape))}), got {tuple(X.shape)}")
    if X.dtype != np.uint8 and X.dtype != np.float32:
        if X.dtype.kind in "iu":
            raise TypeError(f"integer images must be uint8 (scaled by 1/255), got dtype {X.dtype}")
        X = X.astype(np.float32)
    return np.ascontiguousarray(X)


def as_labels(y, n):
    """(n,) int64, C-contiguous."""
    y = np.asarray(y)
    if y.dtype.kind not in "iu":
        raise TypeError(f"labels must be integers, got dtype {y.dtype}")
    if y.shape != (n,):
        raise ValueError(f"labels must have shape ({n},) to match the images, got {y.shape}")
    return int64_labels(y)


def int64_labels(y, what="label"):
    """Integer labels (or other integers: ``what`` names them) as C-contiguous int64; a
    uint64 value beyond int64 is refused as itself (the conversion would wrap it to a
    negative number the caller never gave)."""
    if y.dtype == np.uint64 and y.size:
        big = np.flatnonzero(y > np.iinfo(np.int64).max)
        if big.size:
            raise ValueError(f"{what} {int(y.flat[big[0]])} at index {int(big[0])} is outside int64's range")
    return np.ascontiguousarray(y, dtype=np.int64)
