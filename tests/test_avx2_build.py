"""The build an AVX2-only machine makes (an EPYC before Zen 4, a Xeon before
Skylake-SP): its -march=native build has no AVX-512, so the extension runs the
AVX2 forms of the CPU code (small_gemm.c's 6x16 kernel, winograd.c's 8-tile
transforms and its wide planes' blocks, the AVX2 paths of the other kernels),
which the build under test never runs on an AVX-512 machine.

Here the extension is built with -march=haswell (AVX2 + FMA, no AVX-512:
checked in the library's machine code) without CUDA into a temporary folder,
and the numeric test files run against it in a subprocess, with their own
derived bounds and the PyTorch fixtures' tolerances: the convolutions (GEMM,
implicit GEMM, both Winograd kinds, stride 2, the FFT), LeNet and ResNet-18, the
fusions. Skipped, with the reason, on a CPU without AVX2 and FMA (where such
a build cannot run). On a CPU with AVX2 and no AVX-512 the build under test is
itself the AVX2 build and runs the numeric files in the same run: its GEMM
kernel is checked, and nothing built again.

The generic build (-march=x86-64: SSE2, what a distribution package would
ship) runs the portable forms of the same code and the BLAS for every GEMM (no
dpcore kernel is built): another rounding on every machine, the variation CI
owns where it once forced OpenBLAS's kernel type (issue 29). Its SSE2 code is
several times slower, so it runs the files whose shapes are small: the
convolutions' GEMM and stride-2 checks, LeNet, the fusions and LeNet's
fixtures.
"""
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

NUMERIC_FILES = ["test_conv_cpu.py", "test_implicit_gemm.py", "test_winograd.py", "test_winograd_lanes.py",
                 "test_winograd_s2.py", "test_fft.py", "test_lenet.py", "test_resnet.py", "test_fusion.py", "test_fixtures.py"]
# the benchmark scripts' runs and the Sandybridge subprocess: the plain run's, on its own build
DESELECT = ["test_winograd.py::test_benchmark_quick_run", "test_winograd_lanes.py::test_benchmark_quick_run",
            "test_implicit_gemm.py::test_benchmark_quick_run", "test_fft.py::test_benchmark_quick_run",
            "test_winograd.py::test_on_the_blas_gemm"]
GENERIC_FILES = NUMERIC_FILES
GENERIC_K = "not resnet and not ResNet"  # ResNet-18's fixtures and fusions: minutes in SSE2 code

BUILDS = {
    # name: (CFLAGS, CPU flags it needs, the register its code must not name, build_info's cpu_gemm, files, -k)
    "avx2": ("-march=haswell", {"avx2", "fma"}, "zmm", "dpcore AVX2 6x16 (DPCORE_OWN_GEMM=0: the BLAS)",
             NUMERIC_FILES, None),
    "generic": ("-march=x86-64", set(), "ymm", "the BLAS", GENERIC_FILES, GENERIC_K),
}


def assert_no_vector_stores_to_stack(disassembly, function):
    """Under CPython's -fwrapv GCC 12 kept small_gemm.c's AVX2 accumulators in
    registers but also stored each to the stack after every FMA of the k loop
    (613 such stores in the function; the kernel at half its rate on AMD Zen 3)."""
    lines = disassembly.split(f"<{function}>:\n", 1)
    assert len(lines) == 2, f"no symbol {function} in the library"
    body = lines[1].split("\n\n", 1)[0]
    stores = [ln for ln in body.splitlines() if "vmovaps %ymm" in ln and "(%rsp)" in ln.split(",")[-1]]
    assert not stores, f"{function}: {len(stores)} vector stores to the stack, e.g. {stores[:3]}"


def own_build_is_avx2(want_gemm):
    """On a CPU without AVX-512 the build under test (-march=native) is itself an AVX2 build, and
    the numeric files run on it in this same run: checked (its GEMM kernel is the AVX2 one, whose
    accumulators stay in registers) instead of built again. False for any other build under test
    (DPCORE_NATIVE=0, a build without the kernel), which then gets the -march=haswell build."""
    import dpcore
    objdump = shutil.which("objdump")
    if dpcore.build_info()["cpu_gemm"] != want_gemm or objdump is None:
        return False
    here = os.path.dirname(dpcore.__file__)
    libs = [os.path.join(here, f) for f in os.listdir(here) if f.endswith(".so")]
    dis = [subprocess.run([objdump, "-d", lib], capture_output=True, text=True).stdout for lib in libs]
    found = [d for d in dis if "<kernel_gemm>:" in d]
    assert found, f"{libs}: no kernel_gemm in the AVX2 build under test"
    assert_no_vector_stores_to_stack(found[0], "kernel_gemm")
    return True


@pytest.mark.alone  # builds on every core, then trains in OpenMP loops: beside another worker, 2x its time
@pytest.mark.parametrize("name", sorted(BUILDS))
def test_build_passes_the_numeric_tests(tmp_path, name):
    cflags, needs, register, want_gemm, files, keyword = BUILDS[name]
    from dpcore._blas_kernels import cpu_flags
    if not needs <= cpu_flags():
        pytest.skip(f"this CPU has no {' + '.join(sorted(needs))}: a {cflags} build cannot run here")
    if name == "avx2" and "avx512f" not in cpu_flags() and own_build_is_avx2(want_gemm):
        return
    target = tmp_path / name
    env = dict(os.environ, CFLAGS=cflags, DPCORE_NATIVE="0", DPCORE_CUDA="0", DPCORE_MPI="0")
    for k in ("CPPFLAGS", "DPCORE_SANITIZE", "DPCORE_DEBUG"):  # the plain build's flags, whatever this run's
        env.pop(k, None)
    build = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps",
                            "--no-cache-dir", "--target", str(target), ROOT], env=env, capture_output=True,
                           text=True, timeout=900)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    libs = [os.path.join(dp, f) for dp, _, fs in os.walk(target / "dpcore") for f in fs if f.endswith(".so")]
    assert libs, "the build made no extension library"
    objdump = shutil.which("objdump")
    if objdump:  # binutils: AVX-512 code names zmm registers, AVX / AVX2 code ymm
        for lib in libs:
            dis = subprocess.run([objdump, "-d", lib], capture_output=True, text=True).stdout
            assert register not in dis, f"{lib}: {register} registers in the {cflags} build"
            if name == "avx2":  # the GEMM kernel's accumulators stay in registers (setup.py: -fno-wrapv)
                assert_no_vector_stores_to_stack(dis, "kernel_gemm")
    run_env = dict(os.environ, PYTHONPATH=str(target))
    for k in ("DPCORE_WINOGRAD", "DPCORE_WINOGRAD_F43", "DPCORE_OWN_GEMM", "DPCORE_FUSE", "DPCORE_FFT"):
        run_env.pop(k, None)
    probe = subprocess.run([sys.executable, "-c", "import dpcore; print(dpcore.__file__); "
                            "print(dpcore.build_info()['cpu_gemm'])"], env=run_env, capture_output=True, text=True,
                           cwd=str(tmp_path))
    assert probe.returncode == 0, probe.stderr
    where, gemm = probe.stdout.split("\n")[:2]
    assert where.startswith(str(target)), where
    assert gemm == want_gemm, gemm
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow"]
    cmd += [os.path.join(ROOT, "tests", f) for f in files] + (["-k", keyword] if keyword else [])
    for d in DESELECT:
        cmd += ["--deselect", os.path.join(ROOT, "tests", d)]
    run = subprocess.run(cmd, env=run_env, capture_output=True, text=True, cwd=ROOT, timeout=1800)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and " failed" not in run.stdout, run.stdout[-3000:]
    assert f"dpcore build: {target / 'dpcore'}," in run.stdout, run.stdout[-3000:]  # (tests/conftest.py)
