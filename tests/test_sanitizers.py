"""The C core under AddressSanitizer, LeakSanitizer and UndefinedBehaviorSanitizer.

tests/c/core_smoke.c drives the core without Python (so leak detection sees only
dpcore's allocations); it is built here with -fsanitize=address,undefined and
must exit 0 with no sanitizer report.
"""
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def blas_paths():
    for variant in ("openblas-openmp", "openblas-pthread", "openblas-serial"):
        inc = f"/usr/include/x86_64-linux-gnu/{variant}"
        lib = f"/usr/lib/x86_64-linux-gnu/{variant}/libopenblas.so"
        if os.path.exists(os.path.join(inc, "cblas.h")) and os.path.exists(lib):
            return inc, lib
    return None


def build_and_run(tmp_path, program, core_sources, link_flags=()):
    cc = shutil.which("gcc") or shutil.which("cc")
    paths = blas_paths()
    if cc is None or paths is None:
        pytest.fail("the sanitizer build needs gcc and Debian's OpenBLAS (scripts/bootstrap.sh installs them)")
    inc, lib = paths
    exe = tmp_path / program
    sources = [os.path.join(ROOT, "tests", "c", program + ".c")] + [os.path.join(ROOT, "csrc", f) for f in core_sources]
    cmd = [cc, "-std=c11", "-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
           "-fno-sanitize-recover=undefined", "-fopenmp", "-D_GNU_SOURCE", "-Wall", "-Wextra",
           "-Wno-unused-parameter", "-Werror", "-I", os.path.join(ROOT, "csrc"), "-I", os.path.join(ROOT, "kernels"),
           "-I", inc, *sources, lib, "-lm", *link_flags, "-o", str(exe)]
    subprocess.run(cmd, check=True)
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:halt_on_error=1",
               UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1", OMP_NUM_THREADS="2")
    proc = subprocess.run([str(exe)], capture_output=True, text=True, env=env, timeout=300)
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0, report
    assert f"{program}: ok" in proc.stdout
    assert "runtime error" not in report and "Sanitizer" not in report, report


def test_core_is_clean_under_asan_lsan_ubsan(tmp_path):
    """Models (LeNet, strides/padding/max-pool) trained, evaluated and misused, a
    resident dataset gathered from, all freed."""
    build_and_run(tmp_path, "core_smoke", ["backend_cpu.c", "layers.c", "model.c", "resident.c", "shapes.c", "status.c"])


def test_dp_hd_bodies_as_the_gpu_runs_them(tmp_path):
    """tests/c/kernel_bodies.c: every DP_HD body in the flat-index form the CUDA
    launchers call, and the CPU backend's loops over them, against reference
    loops written in the test (exact where the formula fixes the bits, a
    stated tolerance otherwise), under the sanitizers too."""
    build_and_run(tmp_path, "kernel_bodies", ["backend_cpu.c", "collective.c", "status.c"])


def test_replica_threads_and_collectives_are_clean(tmp_path):
    """tests/c/mirrored_smoke.c: three replica threads train with gradient
    buckets, per-replica and synchronized BatchNorm and resident data; a bad
    label or row is refused before any replica starts; a step whose memory
    would grow after its warm-up is a reported error before any collective;
    everything joined and freed."""
    build_and_run(tmp_path, "mirrored_smoke", ["backend_cpu.c", "backend_cuda.c", "collective.c", "comm.c", "dist.c", "mirrored.c",
                                                "layers.c", "model.c", "replica.c", "resident.c", "shapes.c", "status.c"])


def test_device_registry_is_clean(tmp_path):
    """tests/c/device_registry.c: a device made once and shared by models,
    destroyed with its last reference; bad names refused; the logical CPU
    devices' core shares; a device made before a reconfiguration keeps
    working; gets, puts and step locks from four threads at once; nothing
    left alive or leaked."""
    build_and_run(tmp_path, "device_registry", ["backend_cpu.c", "backend_cuda.c", "device.c", "layers.c", "model.c", "resident.c",
                                                 "shapes.c", "status.c"], link_flags=["-lpthread"])


def test_every_failed_allocation_is_a_memory_error(tmp_path):
    """tests/c/alloc_failures.c: with malloc, calloc, realloc and aligned_alloc
    wrapped (ld --wrap), a training run is repeated with each of its
    allocations failing in turn; every run ends in DP_ERR_MEMORY with nothing
    leaked, and pooling's window tables and the convolution scratch, failed
    through the backend table as the single ops call it, are DP_ERR_MEMORY too."""
    build_and_run(tmp_path, "alloc_failures", ["backend_cpu.c", "layers.c", "model.c", "resident.c", "shapes.c", "status.c"],
                  link_flags=["-Wl,--wrap=malloc,--wrap=calloc,--wrap=realloc,--wrap=aligned_alloc"])
