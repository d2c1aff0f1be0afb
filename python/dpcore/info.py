"""What the build found and what this machine has."""
import functools
import json

from . import _core
from .config import get_precision


@functools.lru_cache(maxsize=None)
def build_flags():
    """What the build found and used (fixed for the life of the process; parsed once)."""
    return json.loads(_core.build_info_json())


def build_info():
    """What dpcore was built with and what it finds at run time.

    Keys include ``cuda`` (compiled with CUDA), ``cuda_toolkit``, ``cuda_archs``,
    ``cudnn_found``, ``cublas_found``, ``nccl_found``, ``mpi_found``, ``blas``,
    ``cflags``, ``sanitizers`` (``["address", "undefined"]`` in a build made
    with DPCORE_SANITIZE=1, else ``[]``), ``openmp``, ``cpu_cores``, ``cpu_l2_bytes`` (one core's L2, which the CPU
    convolutions' blocking follows) and ``cpu_l2_source`` (``sysfs``, ``sysconf``,
    ``DPCORE_L2_BYTES`` or ``default``), ``cuda_device_count``,
    ``cuda_devices`` (each physical GPU's name, memory_bytes and
    compute_capability), ``cuda_why`` (why no CUDA device is usable, e.g. no
    driver), ``cpu_gemm`` (whose kernel runs the CPU convolutions' GEMMs:
    dpcore's own AVX-512 or AVX2 one where the build targets them, else the BLAS),
    ``precision`` (dp.get_precision(): the arithmetic in force now),
    and ``summary``, a one-line dict for logs (with ``cuda_why`` where a CUDA build
    sees no device: the one place a CPU-only machine's run says so).
    """
    info = dict(build_flags())
    info.update(_core.runtime_info())
    info["precision"] = get_precision()
    info["summary"] = {
        "cuda": info["cuda_toolkit"] if info["cuda"] else "not built",
        "cuda_devices": [d["name"] for d in info["cuda_devices"]],
        "blas": info["blas"],
        "openmp": info["openmp"],
        "cpu_cores": info["cpu_cores"],
        "precision": info["precision"],
    }
    if info["cuda"] and not info["cuda_devices"]:
        info["summary"]["cuda_why"] = info["cuda_why"]
    if info.get("sanitizers"):
        info["summary"]["sanitizers"] = info["sanitizers"]
    return info
