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
