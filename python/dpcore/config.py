"""Process-wide numerical settings of the CUDA backend.

    import dpcore as dp
    dp.set_deterministic(True)   # the default: cuDNN's deterministic algorithms only
    dp.set_allow_tf32(False)     # the default: float32 arithmetic in cuBLAS and cuDNN

A setting applies to every CUDA device: those created afterwards start with
it, existing ones take it before their next convolution or dense layer. On CPU
devices the settings change nothing: the CPU backend is deterministic already
(fixed summation orders) and never uses TF32.
"""
from . import _check, _core

__all__ = ["get_allow_tf32", "get_deterministic", "set_allow_tf32", "set_deterministic"]


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
