"""Process-wide numerical settings.

    import dpcore as dp
    dp.set_precision("float32")  # the default: every path within ~2x float32 GEMM's rounding error
    dp.set_precision("fast")     # the faster forms of larger error, on the CPU and on GPUs
    dp.set_deterministic(True)   # the default: cuDNN's deterministic algorithms only
    dp.set_allow_tf32(False)     # the default: float32 arithmetic in cuBLAS and cuDNN

``set_precision`` sets the three switches together: "float32" is deterministic
cuDNN algorithms, no TF32, and on the CPU only convolution forms whose error
is within about 2x float32 GEMM's (im2col + GEMM, the implicit GEMM, Winograd
F(2x2, 3x3) and its stride-2 form: benchmarks/winograd_error.py);
"fast" admits non-deterministic cuDNN algorithms, TF32 tensor cores, and
Winograd F(3x3, 5x5) on the CPU (LeNet's 5x5 layer: forward ~5x, gradients
13-16x float32 GEMM's error). ``set_deterministic`` and ``set_allow_tf32``
change one GPU switch alone; ``get_precision`` then says "custom".

A setting applies to every device: those created afterwards start with it,
existing ones take it where their next call or training step begins, never in
the middle of one. The CPU backend is deterministic whatever the setting
(fixed summation orders) and never uses TF32.
"""
from . import _check, _core

__all__ = ["get_allow_tf32", "get_deterministic", "get_precision", "set_allow_tf32", "set_deterministic",
           "set_precision"]

PRECISIONS = ("float32", "fast")


def set_precision(precision):
    """Choose between float32-faithful arithmetic (``"float32"``, the default)
    and the faster forms of larger rounding error (``"fast"``), on every device.

    ``"float32"``: deterministic cuDNN algorithms, no TF32, and on the CPU only
    the convolution forms within about 2x float32 GEMM's error. ``"fast"``:
    non-deterministic cuDNN algorithms and TF32 allowed, and Winograd
    F(3x3, 5x5) for the CPU's 5x5 layers (LeNet trains ~1.3-1.5x faster there,
    its weights drift from float64 several times further: benchmarks/RESULTS.md).
    """
    if not isinstance(precision, str):
        raise TypeError(f"precision must be one of {PRECISIONS}, got {type(precision).__name__}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    fast = precision == "fast"
    _core.set_cuda_options(not fast, fast)
    _core.set_fast_convolutions(fast)


def get_precision():
    """``"float32"`` or ``"fast"`` as set_precision left it; ``"custom"`` where
    set_deterministic / set_allow_tf32 changed a switch since."""
    deterministic, tf32 = _core.get_cuda_options()
    fast = _core.get_fast_convolutions()
    if (deterministic, tf32, fast) == (True, False, False):
        return "float32"
    if (deterministic, tf32, fast) == (False, True, True):
        return "fast"
    return "custom"


def set_deterministic(flag=True):
    """Use only deterministic cuDNN algorithms on CUDA devices (the default).

    With ``flag=True`` two identical training steps on the same GPU give bitwise
    identical gradients; ``False`` also admits the heuristics' non-deterministic
    (sometimes faster) algorithms. No effect on CPU devices, which are always
    deterministic.
    """
    flag = _check.boolean("flag", flag)
    _core.set_cuda_options(flag, get_allow_tf32())


def get_deterministic():
    """Whether CUDA devices use only deterministic cuDNN algorithms."""
    return _core.get_cuda_options()[0]


def set_allow_tf32(flag):
    """Let cuBLAS and cuDNN use TF32 tensor cores for float32 on CUDA devices.

    TF32 rounds the inputs of matrix products and convolutions to 10 mantissa
    bits (Ampere and newer GPUs), which is faster and less accurate than
    float32. Off by default. No effect on CPU devices, which never use TF32.
    """
    flag = _check.boolean("flag", flag)
    _core.set_cuda_options(get_deterministic(), flag)


def get_allow_tf32():
    """Whether CUDA devices may use TF32 tensor cores (False by default)."""
    return _core.get_cuda_options()[1]
