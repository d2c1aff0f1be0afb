"""Single operations of the C core on NumPy arrays (float32, NCHW).

The same backend kernels the models run, one call at a time: for tests, for
checking a layer by hand, and for building a network from scratch in a
notebook. Inputs are converted to C-contiguous float32; gradients follow the
PyTorch conventions (weights (O, C, KH, KW) and (O, I), biases (O,)).
"""
import numpy as np

from . import _check, _core
from .batches import int64_labels

__all__ = [
    "conv2d", "conv2d_backward", "dense", "dense_backward", "relu", "relu_backward", "avg_pool2d",
    "avg_pool2d_backward", "max_pool2d", "max_pool2d_backward", "softmax_cross_entropy", "sgd_update",
]


_INT_MAX = 2**31 - 1


def _f32(a, name):
    if a is None:
        raise TypeError(f"{name} must be a real numeric array, got None")
    a = np.asarray(a)
    if a.dtype.kind not in "fiu" or a.dtype == np.bool_:
        raise TypeError(f"{name} must be a real numeric array, got dtype {a.dtype}")
    return np.asarray(a, dtype=np.float32, order="C")


def _window(kernel_size, stride, padding):
    """(kernel_size, stride, padding) checked; PyTorch's pooling default: the
    stride is the kernel size unless given (0 is an error, not a default)."""
    kernel_size = _check.integer("kernel_size", kernel_size, 1, _INT_MAX)
    stride = kernel_size if stride is None else _check.integer("stride", stride, 1, _INT_MAX)
    return kernel_size, stride, _check.integer("padding", padding, 0, _INT_MAX)


def _conv_args(stride, padding):
    return _check.integer("stride", stride, 1, _INT_MAX), _check.integer("padding", padding, 0, _INT_MAX)


def conv2d(x, w, b=None, stride=1, padding=0):
    """y (N, O, OH, OW) = x (N, C, H, W) conv w (O, C, KH, KW) + b (O,)."""
    return _core.conv2d_forward(_f32(x, "x"), _f32(w, "w"), None if b is None else _f32(b, "b"),
                                *_conv_args(stride, padding))


def conv2d_backward(x, w, dy, stride=1, padding=0):
    """(dx, dw, db) of a convolution given dy (N, O, OH, OW)."""
    return _core.conv2d_backward(_f32(x, "x"), _f32(w, "w"), _f32(dy, "dy"), *_conv_args(stride, padding))


def dense(x, w, b=None):
    """y (N, O) = x (N, I) w^T + b; w is (O, I) like torch.nn.Linear."""
    return _core.dense_forward(_f32(x, "x"), _f32(w, "w"), None if b is None else _f32(b, "b"))


def dense_backward(x, w, dy):
    """(dx, dw, db) of a dense layer given dy (N, O)."""
    return _core.dense_backward(_f32(x, "x"), _f32(w, "w"), _f32(dy, "dy"))


def relu(x):
    return _core.relu_forward(_f32(x, "x"))


def relu_backward(y, dy):
    """dx given the forward *output* y and dy."""
    return _core.relu_backward(_f32(y, "y"), _f32(dy, "dy"))


def avg_pool2d(x, kernel_size, stride=None, padding=0):
    """Average pooling (count_include_pad=True, as PyTorch's default)."""
    return _core.avg_pool2d_forward(_f32(x, "x"), *_window(kernel_size, stride, padding))


def avg_pool2d_backward(x, dy, kernel_size, stride=None, padding=0):
    return _core.avg_pool2d_backward(_f32(x, "x"), _f32(dy, "dy"), *_window(kernel_size, stride, padding))


def max_pool2d(x, kernel_size, stride=None, padding=0):
    return _core.max_pool2d_forward(_f32(x, "x"), *_window(kernel_size, stride, padding))


def max_pool2d_backward(x, dy, kernel_size, stride=None, padding=0):
    return _core.max_pool2d_backward(_f32(x, "x"), _f32(dy, "dy"), *_window(kernel_size, stride, padding))


def softmax_cross_entropy(logits, labels, reduction="mean"):
    """(loss, correct, dlogits): loss is the mean or sum over rows; dlogits is its gradient."""
    reduction = _check.one_of("reduction", reduction, ("mean", "sum"))
    logits = _f32(logits, "logits")
    labels = np.asarray(labels)
    if labels.dtype.kind not in "iu":
        raise TypeError(f"labels must be integers, got dtype {labels.dtype}")
    labels = int64_labels(labels)
    n = logits.shape[0] if logits.ndim == 2 else 0
    scale = 1.0 / n if (reduction == "mean" and n) else 1.0
    loss_sum, correct, dlogits = _core.softmax_cross_entropy(logits, labels, scale)
    return (loss_sum * scale if reduction == "mean" else loss_sum), correct, dlogits


def sgd_update(w, g, v, lr, momentum=0.0, weight_decay=0.0):
    """In place: v = momentum*v + g + weight_decay*w; w -= lr*v (torch.optim.SGD).
    w, g and v have one shape (as a parameter, its gradient and its momentum do)."""
    shapes = [np.shape(a) if isinstance(a, np.ndarray) else None for a in (w, g, v)]
    if None not in shapes and len(set(shapes)) > 1:  # the core sees flat buffers; a transposed g would pass it
        raise ValueError(f"w, g and v must have the same shape, got {shapes[0]}, {shapes[1]} and {shapes[2]}")
    _core.sgd_update(w, g, v, *_check.sgd_arguments(lr, momentum, weight_decay, lr_zero=True))
