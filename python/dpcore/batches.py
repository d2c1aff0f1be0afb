"""Checks and conversions of user batches before they reach the C core.

The core accepts exactly: images (N, C, H, W) uint8 or float32, C-contiguous;
labels (N,) int64. Everything a user may reasonably pass is converted here,
and everything else gets a ValueError / TypeError naming the argument and
saying what was expected.
"""
import numpy as np

from . import _check


def as_images(X, input_shape, name="X"):
    """(N, C, H, W) uint8 or float32, C-contiguous. (N, H, W) gains a channel axis when C == 1."""
    X = _check.array(name, X, kinds=None) if not isinstance(X, np.ndarray) else X
    if X.dtype.kind not in "fu" and X.dtype.kind != "i" or X.dtype == np.bool_:
        raise TypeError(f"{name}: images must be uint8 or floating point, got dtype {X.dtype}")
    if X.ndim == 3 and input_shape[0] == 1:
        X = X[:, None, :, :]
    if X.ndim != 4 or tuple(X.shape[1:]) != tuple(input_shape):
        raise ValueError(f"{name}: images must have shape (N, {', '.join(map(str, input_shape))}), "
                         f"got {tuple(X.shape)}")
    if len(X) > _check.MAX_BATCH:
        raise ValueError(f"{name}: a batch must have fewer than 2**31 images, got {len(X)}")
    if X.dtype != np.uint8 and X.dtype != np.float32:
        if X.dtype.kind in "iu":
            raise TypeError(f"{name}: integer images must be uint8 (scaled by 1/255), got dtype {X.dtype}")
        X = _check.float32_values(name, X)
    return np.ascontiguousarray(X)


def as_labels(y, n, name="y"):
    """(n,) int64, C-contiguous."""
    y = _check.array(name, y, kinds=None)
    if y.dtype.kind not in "iu":
        raise TypeError(f"{name}: labels must be integers, got dtype {y.dtype}")
    if y.shape != (n,):
        raise ValueError(f"{name}: labels must have shape ({n},) to match the images, got {y.shape}")
    return np.ascontiguousarray(y, dtype=np.int64)
