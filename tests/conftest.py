"""Fixtures shared by the test files."""
import os
import warnings

import pytest

import dpcore as dp


@pytest.fixture
def logical_cpus():
    """``logical_cpus(k)`` splits the CPU into k logical devices (silencing the
    warning that they share cores); one device again afterwards."""
    def split(k):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # more logical devices than cores
            dp.set_logical_devices("cpu", k)
    yield split
    dp.set_logical_devices("cpu", 1)


def pytest_terminal_summary(terminalreporter):
    """Which BLAS kernels this run's numerics went through (shown under -q too): CI runs the suite
    on the machine's kernels (OPENBLAS_CORETYPE as the machine has it), and again with the GEMMs on the BLAS
    instead of dpcore's kernel (DPCORE_OWN_GEMM=0, .ci/run)."""
    info = dp.build_info()
    forced = os.environ.get("OPENBLAS_CORETYPE")
    terminalreporter.write_line(f"dpcore BLAS: {info.get('blas_config', info['blas'])}"
                                + (f" (OPENBLAS_CORETYPE={forced})" if forced else " (this CPU's own kernels)"))
    terminalreporter.write_line(f"dpcore build: {os.path.dirname(dp.__file__)}, CPU GEMM {info.get('cpu_gemm')}")


# The files that take longest (CI's measured durations, the plain run's and the sanitized run's
# together), longest first. They run first: with pytest-xdist's --dist loadfile
# --no-loadscope-reorder (make test, test-asan, test-cpu-only) a worker takes the next file when
# it has little left, so the long files start early rather than one of them ending the run alone.
LONG_FILES = ("test_distributed.py", "test_gpu_day.py", "test_avx2_build.py", "test_notebooks.py",
              "test_benchmarks.py", "test_pipeline.py", "test_sanitizers.py", "test_fuzz.py", "test_small_gemm.py",
              "test_pipeline_mpi.py", "test_cuda_build.py", "test_tensor_parallel_mpi.py", "test_tensor_parallel.py",
              "test_resnet.py", "test_checkpoints.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
