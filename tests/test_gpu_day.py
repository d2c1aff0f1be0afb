"""The GPU-day kit (scripts/gpu_day.py, docs/gpu-day.md), checked on the CPU machine.

The GPU machine is lent rarely and briefly, so the kit must work the first time there. What a
CPU can prove is proved here: the CUDA_HOME assembly from wheel trees (newest version of each
library, the wheels' own headers only), the JUnit reading of the summary, and the whole kit
rehearsed in the device's layout (a venv made from a venv, the .debs unpacked into a prefix,
the build for one arch, the CUDA-backend check, every GPU test collected) under the default
Python and Python 3.12, up to the first step that needs a device; and that it stops, loudly,
when the build has no CUDA backend.
"""
import functools
import glob
import importlib.util
import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("gpu_day", os.path.join(HERE, "scripts", "gpu_day.py"))
gpu_day = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_day)


def touch(path, text=""):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return path


@pytest.fixture
def toolkit(tmp_path):
    t = tmp_path / "cuda"
    touch(t / "bin" / "nvcc")
    touch(t / "include" / "cuda_runtime.h", "toolkit")
    touch(t / "include" / "cudnn.h", "toolkit cudnn")
    touch(t / "include" / "nccl.h", "toolkit nccl")
    touch(t / "lib64" / "libcudart_static.a")
    touch(t / "lib64" / "libcudnn.so.9")
    touch(t / "lib64" / "libnccl.so.2")
    return str(t)


def wheel(site, folder, stem, version, header, extra_headers=()):
    lib = os.path.join(site, "nvidia", folder, "lib", f"{stem}.so.{version}")
    touch(lib)
    touch(os.path.join(site, "nvidia", folder, "include", header), f"{folder} {version}")
    for h in extra_headers:
        touch(os.path.join(site, "nvidia", folder, "include", h), f"{folder} {version}")
    return lib


def test_the_newest_wheel_of_each_library_is_taken_with_its_own_headers_only(tmp_path, toolkit):
    new, old = str(tmp_path / "site-new"), str(tmp_path / "site-old")
    cudnn = wheel(new, "cudnn", "libcudnn", "9", "cudnn.h")
    touch(os.path.join(new, "nvidia", "cudnn", "lib", "libcudnn_cnn.so.9"))
    # cu13's include folder is shared with the CUDA runtime wheel: its cuda_runtime.h must not
    # shadow the toolkit's, which nvcc compiles with
    cublas13 = wheel(new, "cu13", "libcublas", "13", "cublas_v2.h", ["cuda_runtime.h", "cublas_api.h"])
    wheel(new, "cu13", "libcublasLt", "13", "cublasLt.h")
    wheel(old, "cu12", "libcublas", "12", "cublas_v2.h")
    wheel(old, "cu12", "libcublasLt", "12", "cublasLt.h")
    nccl = wheel(old, "nccl", "libnccl", "2", "nccl.h")
    home = str(tmp_path / "home")
    plan, why = gpu_day.assemble_cuda_home(toolkit, [old, new], home)
    assert plan is not None, why
    assert plan["fallback"] == []
    lib, inc = os.path.join(home, "lib64"), os.path.join(home, "include")
    assert os.path.realpath(os.path.join(lib, "libcublas.so")) == os.path.realpath(cublas13)
    assert os.path.realpath(os.path.join(lib, "libcudnn.so")) == os.path.realpath(cudnn)
    assert os.path.realpath(os.path.join(lib, "libnccl.so")) == os.path.realpath(nccl)
    assert os.path.exists(os.path.join(lib, "libcudnn_cnn.so.9"))  # cuDNN's sub-libraries beside it
    assert os.path.exists(os.path.join(lib, "libcudart_static.a"))
    assert open(os.path.join(inc, "cublas_v2.h")).read() == "cu13 13"
    assert open(os.path.join(inc, "cudnn.h")).read() == "cudnn 9"  # the wheel's, not the toolkit's
    assert open(os.path.join(inc, "cuda_runtime.h")).read() == "toolkit"
    assert os.path.join(new, "nvidia", "cu13", "lib") in plan["libdirs"]
    assert not any("cu12" in d for d in plan["libdirs"])
    assert os.path.realpath(os.path.join(home, "bin", "nvcc")) == os.path.realpath(os.path.join(toolkit, "bin", "nvcc"))


def test_a_library_no_wheel_has_comes_from_the_toolkit_and_is_said(tmp_path, toolkit):
    site = str(tmp_path / "site")
    wheel(site, "cu13", "libcublas", "13", "cublas_v2.h")
    wheel(site, "cu13", "libcublasLt", "13", "cublasLt.h")
    plan, why = gpu_day.assemble_cuda_home(toolkit, [site], str(tmp_path / "home"))
    assert plan["fallback"] == ["cudnn", "nccl"]
    assert any("libcudnn: the toolkit's" in w for w in why)


def test_no_cudart_or_no_library_anywhere_is_a_stop_with_the_reason(tmp_path, toolkit):
    os.remove(os.path.join(toolkit, "include", "nccl.h"))
    site = str(tmp_path / "site")
    wheel(site, "cu13", "libcublas", "13", "cublas_v2.h")
    wheel(site, "cu13", "libcublasLt", "13", "cublasLt.h")
    plan, why = gpu_day.assemble_cuda_home(toolkit, [site], str(tmp_path / "home"))
    assert plan is None and "libnccl: neither a wheel nor the toolkit" in why[-1]
    os.remove(os.path.join(toolkit, "lib64", "libcudart_static.a"))
    plan, why = gpu_day.assemble_cuda_home(toolkit, [site], str(tmp_path / "home"))
    assert plan is None and "libcudart_static.a" in why[0]


def test_junit_counts_and_failures_first(tmp_path):
    xml = tmp_path / "g.xml"
    xml.write_text("""<?xml version="1.0"?><testsuites><testsuite name="pytest">
      <testcase classname="tests.test_gpu" name="test_a"/>
      <testcase classname="tests.test_gpu" name="test_b"><skipped message="no 2 GPUs"/></testcase>
      <testcase classname="tests.test_gpu" name="test_c"><failure message="AssertionError: 0.5 &lt;= 1e-4">
      long traceback line 1
      line 2</failure></testcase>
      <testcase classname="tests.test_gpu" name="test_d"><error message="CUDA error 700"/></testcase>
    </testsuite></testsuites>""")
    counts, failures = gpu_day.read_junit(str(xml))
    assert counts == {"tests": 4, "passed": 1, "skipped": 1, "failure": 1, "error": 1}
    assert failures[0].startswith("FAILURE tests.test_gpu::test_c") and "0.5 <= 1e-4" in failures[0]
    assert failures[1].startswith("ERROR tests.test_gpu::test_d")
    assert failures[2].startswith("skipped tests.test_gpu::test_b: no 2 GPUs")
    assert gpu_day.read_junit(str(tmp_path / "missing.xml")) == ({}, [])


@functools.lru_cache(maxsize=None)
def python312():
    """pyenv's 3.12 (the GPU image's version), or None where this machine has none."""
    for c in sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.12*/bin/python3"))) + [shutil.which("python3.12")]:
        # a pyenv shim exists for versions that are not selected, and fails: run each
        if c and subprocess.run([c, "-c", "import venv"], capture_output=True).returncode == 0:
            return c
    return None


def pythons():
    """pyenv's 3.12 where this machine has it, else the default python3 (one rehearsal: each
    builds the CUDA extension, 30-45 s on 2 cores)."""
    p312 = python312()
    return [
        pytest.param(shutil.which("python3") or sys.executable, id="default", marks=pytest.mark.skipif(
            p312 is not None, reason=f"the rehearsal runs in {p312}, the GPU image's Python 3.12 (py3.12)")),
        pytest.param(p312, id="py3.12", marks=pytest.mark.skipif(
            p312 is None, reason="no Python 3.12 on this machine: the rehearsal runs in the default python3")),
    ]


def rehearse(python, out, env=None, **kw):
    return subprocess.run([os.path.join(HERE, "scripts", "gpu-day-rehearse.sh"), python, str(out)],
                          capture_output=True, text=True, timeout=900, env=env, **kw)


@pytest.mark.parametrize("python", pythons())
def test_the_rehearsal_reaches_the_device_step(python, tmp_path):
    out = tmp_path / "out"
    r = rehearse(python, out)
    summary = (out / "summary.txt").read_text() if (out / "summary.txt").exists() else ""
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "REHEARSAL" in summary and "cuda_backend=True cudnn=True cublas=True nccl=True mpi=False" in summary
    assert "archs sm_90 compute_90" in summary
    collected = int(summary.split("GPU tests collected: ")[1].split()[0])
    assert collected >= 60, summary
    for group, *_ in gpu_day.GROUPS:
        line = next(x for x in summary.splitlines() if x.startswith(group + " "))
        assert "collected" in line and "EMPTY" not in line, line
    # the OpenBLAS the build links is the prefix's, not the system's
    assert "/work/prefix/usr/lib/x86_64-linux-gnu/openblas-openmp/libopenblas.so.0" in summary
    files = sorted(os.listdir(out))
    assert files == sorted(["summary.txt", "build.log", "tests.log", "bench.log", "memcheck.log", "junit.tar.gz"])
    # the device returns at most 8 files: a full day adds RESULTS-gpu.md and, with --also, also.log
    assert len(files) + 2 <= 8
    assert "== the machine" in (out / "build.log").read_text()


def test_a_build_without_the_cuda_backend_stops_the_day_loudly(tmp_path):
    """A stray DPCORE_CUDA=0 (or a toolkit setup.py cannot use) builds CPU-only: every GPU test
    would skip and the day would look green. The kit stops with status 3 and says why."""
    out = tmp_path / "out"
    # the rehearsal's Python (its venv made once)
    r = rehearse(python312() or shutil.which("python3") or sys.executable, out, env=dict(os.environ, DPCORE_CUDA="0"))
    summary = (out / "summary.txt").read_text()
    assert r.returncode == 3, r.stdout[-3000:]
    assert "STOP: the build lacks cuda_backend, cudnn_linked, cublas_linked, nccl_linked" in summary
    assert "false green" in summary and "GPU tests collected" not in summary


def test_no_debs_is_a_stop_with_the_way_to_get_them(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(HERE, "scripts", "gpu_day.py"), "--rehearse", "--debs",
                        str(tmp_path / "none"), "--work", str(tmp_path / "work"), str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 3
    assert "scripts/gpu-day-prepare.sh" in (tmp_path / "out" / "summary.txt").read_text()


def test_a_group_reports_passes_failures_and_a_hung_test(tmp_path):
    """run_group on a stand-in test file: counts from its JUnit file, each failure's first
    lines in the summary, a hung test ended by its per-test timeout (pytest-timeout) and a group
    that overruns its budget stopped and said so."""
    tests = tmp_path / "t"
    tests.mkdir()
    (tests / "test_stand_in.py").write_text(
        "import time\n"
        "def test_ok():\n    pass\n"
        "def test_wrong():\n    assert 0.5 <= 1e-4, 'rel 0.5 above the bound'\n"
        "def test_hangs():\n    time.sleep(600)\n")
    day = gpu_day.Day(gpu_day.parse_args([str(tmp_path / "out"), "--work", str(tmp_path / "work"),
                                          "--python", sys.executable, "--budget", "300"]))
    day.code = 0
    day.env["PYTHONPATH"] = ""
    assert not day.run_group("standin", [str(tests / "test_stand_in.py"), "-p", "no:randomly"], 120, 3)
    name, status, counts, failures, secs = day.groups[-1]
    assert status == "FAILED" and counts == {"tests": 3, "passed": 1, "failure": 2}
    assert secs < 60
    assert any("rel 0.5 above the bound" in f for f in failures)
    assert any("test_hangs" in f and "Timeout" in f for f in failures)
    # a group past its budget: stopped, reported as such, the running test named from the log
    assert not day.run_group("overrun", [str(tests / "test_stand_in.py")], 10, 600)
    name, status, counts, failures, secs = day.groups[-1]
    assert status == "TIMED OUT" and counts == {"tests": 3, "passed": 1, "failure": 1, "error": 1}
    assert failures[0].startswith("HUNG ") and "test_hangs" in failures[0]
    day.summary()
    text = (tmp_path / "out" / "summary.txt").read_text()
    assert "standin   FAILED" in text and "overrun   TIMED OUT" in text and "rel 0.5 above the bound" in text


def test_the_cpu_step_pins_one_cores_two_threads_then_two_cores(tmp_path):
    """The host's CPU is measured as a 2-vCPU cloud machine has it: a core's two hardware
    threads (siblings in sysfs), then two cores of one package; vCPUs outside the affinity
    mask are never picked."""
    def cpu(n, package, core):
        touch(tmp_path / f"cpu{n}" / "topology" / "physical_package_id", f"{package}\n")
        touch(tmp_path / f"cpu{n}" / "topology" / "core_id", f"{core}\n")
    # a 2-socket host: vCPU n and n + 4 are one core's threads
    for n in range(8):
        cpu(n, n % 4 // 2, n % 2)
    assert gpu_day.cpu_pairs(str(tmp_path), range(8)) == [("one core's two threads", (0, 4)), ("two cores", (0, 1))]
    assert gpu_day.cpu_pairs(str(tmp_path), [2, 3, 6]) == [("one core's two threads", (2, 6)), ("two cores", (2, 3))]
    # no hyperthreads (this development VM), or threads of one core only, or a single vCPU
    assert gpu_day.cpu_pairs(str(tmp_path), [0, 1]) == [("two cores", (0, 1))]
    assert gpu_day.cpu_pairs(str(tmp_path), [1, 5]) == [("one core's two threads", (1, 5))]
    assert gpu_day.cpu_pairs(str(tmp_path), [0, 2]) == []  # two packages: not a 2-vCPU machine
    assert gpu_day.cpu_pairs(str(tmp_path), [3]) == []


def test_the_cpu_steps_summary_line_is_dpcores_time_over_pytorchs():
    resnet = ("| dpcore | 0.609 | 105.0 |\n\n**dpcore images/s / PyTorch images/s: 1.60** (best steps; 2.00 on the "
              "medians of all 12 timed steps each; goal >= 1.0: met)\n")
    assert gpu_day.cpu_headline(resnet) == \
        "dpcore / PyTorch step time 0.625x (best steps), 0.500x (medians)"
    lenet = "ratio dpcore_seconds / torch_seconds: 0.297 (best epochs), 0.301 (means); goal <= 1.0\n"
    assert gpu_day.cpu_headline(lenet) == "dpcore / PyTorch epoch time 0.297x (best epochs), 0.301x (means)"
    layers = ("### LeNet, batch 256\n\n| layer |\n- conv / dense layers: dpcore 22.4 ms, PyTorch 46.9 ms (**dpcore / "
              "PyTorch 0.48x**; PyTorch / floor 2.75x)\n\n### ResNet-18 (28x28), batch 32\n\n| 0 | conv2d |\n"
              "- conv / dense layers: dpcore 369.2 ms, PyTorch 521.7 ms (**dpcore / PyTorch 0.71x**; PyTorch / floor "
              "1.19x)\n")
    assert gpu_day.cpu_headline(layers) == "conv / dense layers' time against PyTorch's: LeNet 0.48x, ResNet-18 0.71x"
    assert gpu_day.cpu_headline("Traceback (most recent call last):\n") == ""
    assert gpu_day.parse_args(["--only", "cpu"]).only == ["cpu"]
