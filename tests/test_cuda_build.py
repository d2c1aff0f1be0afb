"""What can be proven of the CUDA build without a GPU.

- No GPU is not an error: list_devices has no CUDA device, build_info says why,
  MirroredStrategy falls back to the CPU devices with a warning.
- For every convolution of LeNet and ResNet-18, cuDNN's own shape inference
  (cudnnGetConvolution2dForwardOutputDim, on the descriptors the CUDA backend
  builds) agrees with dpcore's. Descriptor calls need no driver.
"""
import os
import re
import subprocess
import warnings
from pathlib import Path

import pytest

import dpcore as dp
from build_order import compile_order, heavy_first

ROOT = Path(__file__).resolve().parent.parent
INFO = dp.build_info()
needs_cudnn = pytest.mark.skipif(not INFO.get("cudnn_found"), reason="dpcore was built without cuDNN "
                                 "(no CUDA toolkit found, or DPCORE_CUDA=0)")


def test_no_gpu_is_not_an_error():
    if INFO["cuda_device_count"] > 0:
        pytest.skip("a CUDA device is present: this test is about machines without one")
    assert not [d for d in dp.list_devices() if d.startswith("cuda")]
    assert INFO["cuda_devices"] == [] and INFO["summary"]["cuda_devices"] == []
    # a machine without a GPU is a CPU user's normal case: said where asked for, never warned
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        strategy = dp.MirroredStrategy()
    if INFO["cuda"]:
        assert INFO["cuda_why"], "build_info must say why no CUDA device is usable"
        assert INFO["summary"]["cuda_why"] == INFO["cuda_why"]
        assert strategy.no_gpu_reason == "no usable CUDA device: " + INFO["cuda_why"]
    else:
        assert "cuda_why" not in INFO["summary"]
        assert strategy.no_gpu_reason == "dpcore was built without CUDA"
    assert strategy.devices == [d for d in dp.list_devices() if d.startswith("cpu")]
    assert dp.MirroredStrategy(devices=["cpu:0"]).no_gpu_reason is None  # devices chosen: nothing to explain


def convolutions(net):
    """(N-independent) geometry of every conv: (C, H, W, O, K, stride, pad, OH, OW)."""
    shapes = net._model.layers()
    for spec, (kind, (c, h, w), (o, oh, ow)) in zip(net._specs, shapes):
        if kind == "conv2d":
            _, out_channels, k, stride, pad = spec
            assert out_channels == o
            yield c, h, w, o, k, stride, pad, oh, ow


@needs_cudnn
@pytest.mark.parametrize("model", ["LeNet", "ResNet18"])
@pytest.mark.parametrize("batch", [1, 7, 256])
def test_cudnn_shape_inference_agrees_for_every_convolution(model, batch):
    net = getattr(dp.models, model)()
    convs = list(convolutions(net))
    assert len(convs) == (2 if model == "LeNet" else 20)
    for c, h, w, o, k, stride, pad, oh, ow in convs:
        n_, c_, h_, w_ = dp._core.cudnn_conv_output_dim(batch, c, h, w, o, k, k, stride, pad)
        assert (n_, c_, h_, w_) == (batch, o, oh, ow), (c, h, w, o, k, stride, pad)


@needs_cudnn
def test_cudnn_reports_bad_descriptors_as_errors():
    with pytest.raises(dp.DeviceError, match="cudnnSet"):
        dp._core.cudnn_conv_output_dim(1, 0, 28, 28, 8, 3, 3, 1, 0)


def test_every_dp_hd_body_is_used_by_the_cpu_backend():
    """Each DP_HD body of kernels/dp_kernels.h is called from the CPU side
    (csrc/) or from the flat-index wrapper the CPU-tested body sits in, so the
    CPU suite runs the arithmetic the CUDA launchers run."""
    header = (ROOT / "kernels" / "dp_kernels.h").read_text()
    bodies = re.findall(r"static inline DP_HD \w+ (dp_\w+)\(", header)
    assert len(bodies) >= 20
    csrc = "\n".join(p.read_text() for p in (ROOT / "csrc").glob("*.c"))
    cuda = "\n".join(p.read_text() for p in (ROOT / "kernels").glob("*.cu"))
    c_checks = (ROOT / "tests" / "c" / "kernel_bodies.c").read_text()
    for body in bodies:
        assert re.search(rf"\b{body}\(", csrc) or re.search(rf"\b{body}\(", c_checks), \
            f"{body} is not exercised on the CPU"
    # and the CUDA launchers use the same bodies, not copies
    for body in re.findall(r"\b(dp_\w+_elem)\(", cuda):
        assert body in bodies


needs_cuda_backend = pytest.mark.skipif(not INFO.get("cuda_backend"), reason="dpcore was built without the CUDA "
                                        "backend (needs the CUDA toolkit, cuDNN and cuBLAS; or DPCORE_CUDA=0)")


def test_cpu_backend_fills_every_table_entry():
    assert dp._core.backend_null_entries("cpu") == []


@needs_cuda_backend
def test_cuda_backend_fills_every_table_entry():
    """csrc/backend_table.c lists every member of dp_backend (a _Static_assert
    checks the count), so an entry the CUDA table forgets shows up here."""
    assert dp._core.backend_null_entries("cuda") == []


def test_comm_kinds_fill_every_table_entry():
    """Each all-reduce kind is an ops table (csrc/comm.c; a _Static_assert
    checks that the list of its entries is complete): every built kind fills
    every entry; kinds not built are None."""
    assert dp._core.comm_null_entries("host") == []
    assert dp._core.comm_null_entries("kernel") == ([] if INFO.get("cuda") else None)
    assert dp._core.comm_null_entries("nccl") == ([] if INFO.get("nccl_found") else None)
    assert dp._core.comm_null_entries("mpi") == ([] if INFO.get("mpi_linked") else None)
    with pytest.raises(ValueError, match="unknown all-reduce kind"):
        dp._core.comm_null_entries("tcp")


def test_backend_null_entries_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown backend"):
        dp._core.backend_null_entries("tpu")
    if not INFO.get("cuda_backend"):
        assert dp._core.backend_null_entries("cuda") is None


def test_every_cuda_launcher_is_defined_once():
    """Each launcher declared in kernels/dp_cuda.h has exactly one definition in kernels/*.cu,
    and its declaration is DP_MUST_CHECK (a dropped cudaError_t is a compiler error under -Werror)."""
    header = (ROOT / "kernels" / "dp_cuda.h").read_text()
    declared = re.findall(r"^(?:DP_MUST_CHECK )?int (dp_cuda_\w+)\(", header, flags=re.M)
    assert len(declared) >= 20
    unchecked = re.findall(r"^int (dp_cuda_\w+)\(", header, flags=re.M)
    assert not unchecked, f"launchers declared without DP_MUST_CHECK: {unchecked}"
    sources = "\n".join(p.read_text() for p in (ROOT / "kernels").glob("*.cu"))
    for name in declared:
        assert len(re.findall(rf"^int {name}\(", sources, flags=re.M)) == 1, name


@needs_cuda_backend
def test_cuda_model_without_a_gpu_is_a_device_error():
    if INFO["cuda_device_count"] > 0:
        pytest.skip("a CUDA device is present: this test is about machines without one")
    with pytest.raises(dp.DeviceError, match="cudaGetDeviceCount"):
        dp._core.Model((1, 28, 28), [("flatten",), ("dense", 10)], device_kind="cuda")


def test_model_rejects_unknown_device_kinds():
    with pytest.raises(ValueError, match="device_kind"):
        dp._core.Model((1, 28, 28), [("flatten",), ("dense", 10)], device_kind="tpu")


def test_logical_gpus_need_a_gpu():
    if INFO["cuda_device_count"] > 0:
        pytest.skip("a CUDA device is present")
    with pytest.raises(ValueError, match="usable CUDA device"):
        dp.set_logical_devices("cuda", 2)
    assert not [d for d in dp.list_devices() if d.startswith("cuda")]


def c_sources():
    """csrc/*.c, in the order the build starts their compiles (the heaviest first)."""
    return compile_order(str(p) for p in (ROOT / "csrc").glob("*.c"))


def test_the_sources_the_build_compiles_first_exist():
    """A renamed or removed source left in setup.py's HEAVY_FIRST would quietly fall back to name
    order: the long compiles last, one core idle while they end."""
    names = heavy_first()
    assert len(set(names)) == len(names) and names
    assert not [n for n in names if not (ROOT / "csrc" / n).is_file()]


def test_the_test_files_run_first_exist():
    """The same for the test files tests/conftest.py starts first (LONG_FILES): a renamed one
    would run in name order again, perhaps last, alone in its worker."""
    from conftest import LONG_FILES
    assert len(set(LONG_FILES)) == len(LONG_FILES) and LONG_FILES
    assert not [n for n in LONG_FILES if not (ROOT / "tests" / n).is_file()]


@pytest.mark.parametrize("variant", ["cpu", "cpu-mpi", "cuda-mpi"])
def test_core_compiles_warning_free(variant, tmp_path):
    """Every csrc/*.c under -O2 -Wall -Wextra -Werror (-O2: some warnings, such as
    maybe-uninitialized, need the optimizer), as the CPU-only build without MPI,
    with MPI, and as the full build (CUDA, cuDNN, cuBLAS, NCCL, MPI) compile it:
    the CUDA build's C side is checked here even where it cannot run (nvcc
    already compiles the kernels with --Werror all-warnings)."""
    import shutil
    import sysconfig

    import numpy as np

    cc = shutil.which("gcc") or shutil.which("cc")
    cuda_inc = "/usr/local/cuda/include"
    if variant.startswith("cuda") and not all(os.path.exists(os.path.join(cuda_inc, h))
                                     for h in ("cuda_runtime.h", "cudnn.h", "cublas_v2.h", "nccl.h")):
        pytest.skip("the CUDA toolkit with cuDNN, cuBLAS and NCCL is not installed at /usr/local/cuda")
    blas = next((d for d in ("/usr/include/x86_64-linux-gnu/openblas-openmp", "/usr/include/x86_64-linux-gnu/openblas-pthread")
                 if os.path.exists(os.path.join(d, "cblas.h"))), None)
    if cc is None or blas is None:
        pytest.fail("needs gcc and Debian's OpenBLAS headers (scripts/bootstrap.sh installs them)")
    # setup.py generates this header; any content of the right form will do here
    (tmp_path / "dp_build_config.h").write_text('#define DP_BUILD_INFO_JSON "{}"\n')
    cmd = [cc, "-std=c11", "-O2", "-c", "-o", os.devnull, "-Wall", "-Wextra", "-Wno-unused-parameter", "-Werror", "-fopenmp",
           "-D_GNU_SOURCE", "-DNPY_NO_DEPRECATED_API=NPY_1_7_API_VERSION", "-I", str(ROOT / "csrc"),
           "-I", str(ROOT / "kernels"), "-I", str(tmp_path), "-I", sysconfig.get_paths()["include"],
           "-I", np.get_include(), "-I", blas]
    if variant.startswith("cuda"):
        cmd += ["-DDP_HAVE_CUDA", "-DDP_HAVE_CUDNN", "-DDP_HAVE_CUBLAS", "-DDP_HAVE_NCCL", "-I", cuda_inc]
    if variant.endswith("mpi"):
        mpicc = shutil.which("mpicc")
        if mpicc is None:
            pytest.fail("needs Open MPI's mpicc (scripts/bootstrap.sh installs libopenmpi-dev)")
        cmd += ["-DDP_HAVE_MPI"] + subprocess.run([mpicc, "-showme:compile"], capture_output=True, text=True,
                                                   check=True).stdout.split()
    import concurrent.futures
    sources = c_sources()
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:  # a file a core
        procs = list(pool.map(lambda src: subprocess.run(cmd + [src], capture_output=True, text=True), sources))
    for src, proc in zip(sources, procs):
        assert proc.returncode == 0, f"{src} ({variant}):\n{proc.stderr}"

