"""Which OpenBLAS kernels dpcore's BLAS loads with.

Debian's OpenBLAS (a DYNAMIC_ARCH build) picks its kernels from the CPU when it
is loaded. On some virtual machines its detection fails and it falls back to
its oldest x86-64 kernels (Prescott: SSE3), 3 to 4 times slower for float32
GEMM on a CPU with AVX2 or AVX-512; seen on an "Intel(R) Xeon(R) Processor"
VM with AVX-512 (OpenBLAS 0.3.21 chose Prescott; SkylakeX ran a 1024^3 SGEMM
about 4.5x faster). So, unless the user has set OPENBLAS_CORETYPE, dpcore
names the kernels from the instruction sets the kernel reports in
/proc/cpuinfo, for the moment its extension (and with it OpenBLAS) is loaded,
and then removes the variable again, so that the user's subprocesses see the
environment they set. build_info()['blas_config'] says which kernels run.
"""
import os

# OpenBLAS kernel families and the CPU flags their float32 kernels need, best first
_KERNELS = (
    ("SkylakeX", {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"}),
    ("Haswell", {"avx2", "fma"}),
    ("Sandybridge", {"avx"}),
)


def cpu_flags(path="/proc/cpuinfo"):
    """The instruction-set flags of the first CPU in /proc/cpuinfo (empty if unreadable)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def choose(flags):
    """The OpenBLAS core type for these CPU flags, or None to leave OpenBLAS's own choice."""
    for name, needed in _KERNELS:
        if needed <= flags:
            return name
    return None


class loading:
    """Context for importing the extension: OPENBLAS_CORETYPE set (when the user has not) while
    OpenBLAS initialises, removed afterwards."""

    def __enter__(self):
        self.set = None
        if "OPENBLAS_CORETYPE" not in os.environ and os.environ.get("DPCORE_BLAS_AUTO_CORETYPE", "1") != "0":
            core = choose(cpu_flags())
            if core:
                os.environ["OPENBLAS_CORETYPE"] = self.set = core
        return self

    def __exit__(self, *exc):
        if self.set is not None and os.environ.get("OPENBLAS_CORETYPE") == self.set:
            del os.environ["OPENBLAS_CORETYPE"]
        return False
