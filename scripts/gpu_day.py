#!/usr/bin/env python3
"""The GPU day: build dpcore on a bare GPU machine and run its GPU tests and benchmark in one
command, leaving everything a developer needs in one folder (scripts/gpu-day.sh runs this).

    scripts/gpu-day.sh [OUTDIR]                     # on the GPU machine
    scripts/gpu-day.sh --rehearse [OUTDIR]          # on a CPU machine: every step up to the device

The machine it is made for (docs/gpu-day.md): no package registry, a Python that is itself a
venv with numpy, pytest, torch and NVIDIA's cuDNN / cuBLAS / NCCL wheels, nvcc, no OpenBLAS, no
Fashion-MNIST, no mpicc; at most 10 minutes a command, 15 in all; only files under $OUT come
back (at most 8, two folders deep). So:

  1. the machine is recorded (in the summary, and in full at the top of build.log);
  2. the .debs that scripts/gpu-day-prepare.sh fetched (.gpu/debs: OpenBLAS, its Fortran
     runtime, Fashion-MNIST) are unpacked into a prefix with dpkg-deb -x, never into /, and the
     build (DPCORE_BLAS_INC / DPCORE_BLAS_LIB) and dp.data (DPCORE_DATA) pointed there;
  3. a CUDA_HOME is assembled from the toolkit and the Python's NVIDIA wheels (the newest
     version of each library), whose folders are appended to LD_LIBRARY_PATH;
  4. dpcore is built for the GPU present only (DPCORE_CUDA_ARCHS from nvidia-smi), without MPI
     when there is no mpicc, into a folder put on PYTHONPATH (the image's Python is left as it
     is), and the run stops, loudly, unless the CUDA backend, cuDNN, cuBLAS and NCCL are built
     in and a device is visible;
  5. the GPU tests run in priority order, one pytest process per group (a sticky CUDA error
     ends its group only), each group with a time budget and every test with a timeout;
  6. with the time left: bench_gpu.py (dpcore against the image's PyTorch on the same GPU),
     gpu_profile.py (both with and without deterministic cuDNN, each one's kernels by time) and
     compute-sanitizer's memcheck over the smoke group, then the CPU benchmarks against PyTorch
     pinned to two of the host's vCPUs (one core's two threads, then two cores);
  7. summary.txt (machine, build, each group's counts and failures' first lines, the
     benchmark), build.log (the machine in full, the build), tests.log, bench.log, memcheck.log,
     junit.tar.gz, RESULTS-gpu.md (the benchmark's section) and also.log (--also) are written to
     OUTDIR ($OUT, else ./gpu-day-out), at most 8 files as the device returns, and the summary
     printed.

The rehearsal (--rehearse, in every CI run: tests/test_gpu_day.py) does steps 1-4 in the same
layout on a CPU machine, up to the first step that needs a device, then collects every GPU test
(pytest --collect-only -m gpu) and each group's selection, and says where it stopped.

Exit status: 0 when everything that ran passed (the rehearsal: when every step up to the device
did); 3 when the build is not what the day needs (no CUDA backend, no cuDNN / cuBLAS / NCCL);
4 when no device is visible; 1 when a test group or the memcheck failed; 2 on bad usage.
"""
import argparse
import codecs
import glob
import json
import os
import re
import select
import shutil
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The test groups, in priority order: (name, pytest arguments, seconds for the group, seconds a
# test). Each runs in its own process; every selection is of tests marked gpu.
SMOKE = ["tests/test_devices.py::test_tensor_round_trips_through_gpu_memory",
         "tests/test_gpu.py::test_every_layer_within_its_derived_bound",
         "tests/test_gpu.py::test_residual_add_within_its_derived_bound",
         "tests/test_gpu.py::test_training_step_on_cuda_matches_cpu"]
GROUPS = [
    ("smoke", SMOKE + ["-k", "not ResNet18 and (not test_every_layer or 7-)"], 75, 60),
    ("ops", ["tests/test_gpu.py", "-m", "gpu and not slow"], 100, 60),
    ("fixtures", ["tests/test_fixtures.py", "-m", "gpu"], 60, 45),
    ("multi", ["tests/test_devices.py", "tests/test_comm.py", "tests/test_resident.py", "tests/test_pipeline.py",
               "tests/test_tensor_parallel.py", "tests/test_timeline.py", "tests/test_distributed.py",
               "tests/test_pipeline_mpi.py", "tests/test_tensor_parallel_mpi.py", "tests/test_p2p_gpu.py",
               "-m", "gpu"], 90, 45),
    ("book", ["tests/test_gpu.py::test_book_lenet_accuracy_on_the_gpu"], 90, 85),
]
BENCH_SECONDS = 120
MEMCHECK_SECONDS = 90
# the CPU step (issue 31's Intel measurement): each benchmark's share of a pair's time, and the
# least worth starting
CPU_MIN_SECONDS = 60
# what the build, the checks and the summary need after the last group
RESERVE_SECONDS = 15


class Day:
    def __init__(self, args):
        self.args = args
        self.start = time.monotonic()
        self.deadline = self.start + args.budget
        self.out = os.path.abspath(args.outdir or os.environ.get("OUT") or os.path.join(HERE, "gpu-day-out"))
        self.work = os.path.abspath(args.work)
        self.python = args.python
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")  # each line in the logs as it is printed
        self.facts = {}       # machine and build facts for the summary
        self.groups = []      # (name, status, counts, failures, seconds)
        self.notes = []       # what the summary must say (skips, stops, fallbacks)
        self.bench = None
        self.memcheck = None
        self.cpu = None
        os.makedirs(self.out, exist_ok=True)
        if os.path.exists(self.work):
            shutil.rmtree(self.work)
        os.makedirs(os.path.join(self.work, "junit"))
        for name in ("build.log", "tests.log", "bench.log", "memcheck.log") + (("also.log",) if args.also else ()):
            open(os.path.join(self.out, name), "w").close()

    def left(self):
        return self.deadline - time.monotonic()

    def say(self, text):
        print("gpu-day: " + text, flush=True)

    def note(self, text):
        self.notes.append(text)
        self.say(text)

    def run(self, cmd, log, seconds, env=None, cwd=HERE):
        """Runs cmd with its output appended to OUTDIR/log (and echoed); (exit status or None when
        it ran out of time, seconds taken)."""
        t = time.monotonic()
        with open(os.path.join(self.out, log), "a") as f:
            f.write("\n$ " + " ".join(cmd) + "\n")
            f.flush()
            try:
                p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env or self.env,
                                     cwd=cwd, start_new_session=True)
            except OSError as e:
                f.write(f"cannot run: {e}\n")
                return 127, 0.0
            deadline = t + max(1.0, seconds)
            timed_out = False
            fd = p.stdout.fileno()
            decoder = codecs.getincrementaldecoder("utf-8")("replace")
            # raw reads, not lines: a test that hangs after printing half a line (pytest -v's
            # test id) must neither block the reader past the deadline nor lose that half line
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    timed_out = True
                    break
                ready, _, _ = select.select([fd], [], [], min(remaining, 1.0))
                if ready:
                    chunk = os.read(fd, 65536)
                    if not chunk:
                        break
                    text = decoder.decode(chunk)
                    f.write(text)
                    f.flush()
                    if self.args.verbose:
                        sys.stdout.write(text)
            if timed_out:
                f.write(f"\n[gpu-day: stopped after {seconds:.0f} s]\n")
                try:
                    os.killpg(p.pid, 9)
                except ProcessLookupError:
                    pass
            p.wait()
            p.stdout.close()
            return (None if timed_out else p.returncode), time.monotonic() - t

    def capture(self, cmd, env=None):
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env or self.env,
                                  errors="replace").stdout.strip()
        except (OSError, subprocess.SubprocessError) as e:
            return f"({cmd[0]}: {e})"

    # ---- 1. the machine ----
    def record_machine(self):
        lines = []
        smi = shutil.which("nvidia-smi")
        if smi:
            q = self.capture([smi, "--query-gpu=name,compute_cap,driver_version,memory.total",
                              "--format=csv,noheader"])
            self.facts["gpu"] = q
            lines += ["== nvidia-smi --query-gpu", q, "== nvidia-smi", self.capture([smi])]
        else:
            self.facts["gpu"] = "none (no nvidia-smi)"
            lines += ["== nvidia-smi: not found"]
        nvcc = self.find_nvcc()
        self.facts["nvcc"] = (self.capture([nvcc, "--version"]).splitlines() or ["?"])[-1] if nvcc else "not found"
        lines += ["== nvcc", nvcc or "not found", self.facts["nvcc"]]
        osr = {}
        if os.path.exists("/etc/os-release"):
            for line in open("/etc/os-release"):
                k, _, v = line.strip().partition("=")
                osr[k] = v.strip('"')
        self.facts["os"] = osr.get("PRETTY_NAME", "?")
        self.facts["kernel"] = self.capture(["uname", "-r"])
        self.facts["cpus"] = str(os.cpu_count())
        self.facts["gcc"] = (self.capture(["gcc", "--version"]).splitlines() or ["?"])[0]
        pyinfo = self.capture([self.python, "-c", "import sys; print(sys.version.split()[0], sys.executable, "
                               "sys.prefix != sys.base_prefix)"]).split()
        self.facts["python"] = " ".join(pyinfo[:2]) + (" (a venv)" if pyinfo[-1:] == ["True"] else "")
        wheels = self.capture([self.python, "-m", "pip", "list", "--format=freeze", "--disable-pip-version-check"])
        keep = [w for w in wheels.splitlines()
                if re.match(r"(nvidia-|torch|numpy|pytest|safetensors|setuptools|wheel|mpi4py|cuda-)", w.lower())]
        self.facts["wheels"] = ", ".join(keep)
        lines += ["== os", self.facts["os"], self.facts["kernel"], "cpus: " + self.facts["cpus"],
                  "== gcc", self.facts["gcc"], "== python", self.facts["python"], "== wheels"] + keep
        with open(os.path.join(self.out, "build.log"), "a") as f:  # at most 8 files come back: no file of its own
            f.write("\n".join(["== the machine"] + lines) + "\n")
        self.say(f"machine: {self.facts['gpu']}; {self.facts['os']}; python {self.facts['python']}; "
                 f"nvcc {self.facts['nvcc']}")

    def find_nvcc(self):
        candidates = [shutil.which("nvcc", path=self.env.get("PATH", ""))]
        for home in (self.env.get("CUDA_HOME"), self.env.get("CUDA_PATH"), "/usr/local/cuda"):
            if home:
                candidates.append(os.path.join(home, "bin", "nvcc"))
        candidates += sorted(glob.glob("/usr/local/cuda-*/bin/nvcc"), key=version_key, reverse=True)
        for site in self.sites():
            candidates += sorted(glob.glob(os.path.join(site, "nvidia", "*", "bin", "nvcc")), key=version_key,
                                 reverse=True)
        return next((c for c in candidates if c and os.access(c, os.X_OK)), None)

    def sites(self):
        if not hasattr(self, "_sites"):
            text = self.capture([self.python, "-c", "import site, sys; print('\\n'.join(site.getsitepackages()"
                                 " + [site.getusersitepackages()] + sys.path))"])
            seen, sites = set(), []
            for d in text.splitlines() + self.args.wheel_site:
                d = os.path.abspath(d)
                if d not in seen and os.path.isdir(os.path.join(d, "nvidia")):
                    seen.add(d)
                    sites.append(d)
            self._sites = sites
        return self._sites

    # ---- 2. the .debs ----
    def unpack_debs(self):
        debs = sorted(glob.glob(os.path.join(self.args.debs, "*.deb")))
        if not debs:
            return self.fail(3, f"no .deb in {self.args.debs}: run scripts/gpu-day-prepare.sh on a machine with "
                                "Debian's registry, and carry .gpu with the tree")
        prefix = os.path.join(self.work, "prefix")
        for deb in debs:
            st, _ = self.run(["dpkg-deb", "-x", deb, prefix], "build.log", 120)
            if st != 0:
                return self.fail(3, f"dpkg-deb -x {os.path.basename(deb)} failed (build.log)")
        multiarch = "x86_64-linux-gnu"
        inc = os.path.join(prefix, "usr/include", multiarch, "openblas-openmp")
        lib = os.path.join(prefix, "usr/lib", multiarch, "openblas-openmp", "libopenblas.so")
        if not (os.path.exists(os.path.join(inc, "cblas.h")) and os.path.exists(lib)):
            return self.fail(3, f"the .debs in {self.args.debs} hold no OpenBLAS (openmp) headers and library")
        self.env["DPCORE_BLAS_INC"], self.env["DPCORE_BLAS_LIB"] = inc, lib
        # libopenblas.so.0 finds libgfortran / libquadmath here (the extension's rpath has OpenBLAS's own folder)
        self.append_path("LD_LIBRARY_PATH", [os.path.join(prefix, "usr/lib", multiarch),
                                             os.path.dirname(lib)])
        data = os.path.join(prefix, "usr/share/datasets/fashion-mnist")
        if os.path.isdir(data):
            self.env["DPCORE_DATA"] = data
        else:
            self.note("no Fashion-MNIST among the .debs: the book group and the LeNet benchmark will fail")
        self.say(f"unpacked {len(debs)} .debs into {prefix}")
        return True

    def append_path(self, var, dirs):
        parts = [p for p in self.env.get(var, "").split(":") if p]
        for d in dirs:
            if d not in parts:
                parts.append(d)
        self.env[var] = ":".join(parts)

    # ---- 3. CUDA_HOME ----
    def assemble_cuda_home(self):
        nvcc = self.find_nvcc()
        if not nvcc:
            return self.fail(3, "no nvcc on PATH, in $CUDA_HOME, /usr/local/cuda* or the Python's wheels: "
                                "dpcore would build CPU-only")
        toolkit = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
        home = os.path.join(self.work, "cuda-home")
        plan, why = assemble_cuda_home(toolkit, self.sites(), home)
        for line in why:
            self.say(line)
        self.facts["cuda_libs"] = "; ".join(why)
        if plan is None:
            return self.fail(3, "cannot assemble CUDA_HOME: " + " ".join(why))
        if plan["fallback"]:
            self.note("not from wheels: " + ", ".join(plan["fallback"]) + " (the Python has no such wheel; "
                      "the toolkit's own are used)")
        self.env["CUDA_HOME"] = home
        self.env.pop("CUDA_PATH", None)
        self.env["PATH"] = os.path.join(home, "bin") + ":" + self.env.get("PATH", "")
        self.append_path("LD_LIBRARY_PATH", plan["libdirs"])
        return True

    # ---- 4. the build ----
    def build(self):
        archs = self.args.arch
        if not archs:
            cc = self.capture(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"]) \
                if shutil.which("nvidia-smi") else ""
            archs = " ".join(sorted({c.strip().replace(".", "") for c in cc.splitlines()
                                     if re.fullmatch(r"\d+\.\d+", c.strip())}))
        if not archs:
            return self.fail(4, "nvidia-smi names no GPU (no --arch given): no device to build for")
        self.env["DPCORE_CUDA_ARCHS"] = archs
        if not shutil.which("mpicc", path=self.env.get("PATH", "")):
            self.env["DPCORE_MPI"] = "0"
            self.note("no mpicc: built without MPI (the multi-process tests skip with that reason)")
        site = os.path.join(self.work, "site")
        self.env["PYTHONPATH"] = site + (":" + self.env["PYTHONPATH"] if self.env.get("PYTHONPATH") else "")
        self.env["PYTHONDONTWRITEBYTECODE"] = "1"
        self.env.setdefault("DPCORE_BUILD_JOBS", str(os.cpu_count() or 1))
        # its own build trees (kept for a rerun): the rehearsal in CI runs beside other builds from
        # the same checkout, one of them (CPU-only, without MPI) this day's variant under DPCORE_CUDA=0
        self.env.setdefault("DPCORE_BUILD_DIR", os.path.join(HERE, "build", "gpu-day"))
        st, secs = self.run([self.python, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
                             "--disable-pip-version-check", "--no-cache-dir", "--target", site, "--upgrade", HERE],
                            "build.log", min(self.left() - RESERVE_SECONDS, 420))
        self.facts["build_seconds"] = f"{secs:.0f}"
        if st != 0:
            tail = "".join(open(os.path.join(self.out, "build.log")).readlines()[-15:])
            return self.fail(3, f"the build failed ({'out of time' if st is None else 'status %d' % st}); "
                                f"build.log ends:\n{tail}")
        check = ("import dpcore, json; b = dpcore.build_info(); r = dpcore._core.runtime_info(); "
                 "print(json.dumps({'build': b, 'runtime': r}, default=str))")
        text = self.capture([self.python, "-c", check])
        try:
            info = json.loads(text.splitlines()[-1])
        except (ValueError, IndexError):
            return self.fail(3, f"import dpcore failed after the build: {text[-2000:]}")
        b, r = info["build"], info["runtime"]
        self.facts["build"] = (f"CUDA {b.get('cuda_toolkit')}, archs {' '.join(b.get('cuda_archs', []))}; "
                               f"cuda_backend={b.get('cuda_backend')} cudnn={b.get('cudnn_linked')} "
                               f"cublas={b.get('cublas_linked')} nccl={b.get('nccl_linked')} "
                               f"mpi={b.get('mpi_linked')}; BLAS {b.get('blas')}; {self.facts['build_seconds']} s")
        with open(os.path.join(self.out, "build.log"), "a") as f:
            f.write("\n== build_info\n" + json.dumps(info, indent=1, default=str) + "\n")
        self.say("build: " + self.facts["build"])
        core = glob.glob(os.path.join(site, "dpcore", "_core*.so"))
        if core:
            ldd = self.capture(["ldd", core[0]])
            linked = [x.strip() for x in ldd.splitlines() if re.search(r"cudnn|cublas|nccl|openblas|gfortran|not found", x)]
            self.facts["linked"] = "; ".join(linked)
            with open(os.path.join(self.out, "build.log"), "a") as f:
                f.write("\n== ldd " + core[0] + "\n" + ldd + "\n")
        missing = [k for k in ("cuda_backend", "cudnn_linked", "cublas_linked", "nccl_linked") if not b.get(k)]
        if missing:
            return self.fail(3, "the build lacks " + ", ".join(missing) + f" ({b.get('cuda_why')}): the GPU "
                                "tests would all skip; stopping rather than reporting a false green")
        self.facts["devices"] = f"{r.get('cuda_device_count')} visible ({r.get('cuda_why') or 'ok'})"
        if self.args.rehearse:
            return True
        if not r.get("cuda_device_count"):
            return self.fail(4, f"no CUDA device visible to dpcore: {r.get('cuda_why')}")
        return True

    # ---- the rehearsal's last step ----
    def collect(self):
        """Every GPU test and each group's selection, collected (no device needed)."""
        st, _ = self.run([self.python, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "tests",
                          "-p", "no:cacheprovider"], "tests.log", max(30, self.left()))
        lines = open(os.path.join(self.out, "tests.log")).read().splitlines()
        ids = [x for x in lines if "::" in x and not x.startswith("$")]
        self.facts["gpu_tests"] = str(len(ids))
        ok = st == 0 and len(ids) > 0
        self.say(f"collected {len(ids)} GPU tests" + ("" if st == 0 else f" (pytest status {st})"))
        for name, args, _, _ in GROUPS:
            text = self.capture([self.python, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
                                + args)
            n = len([x for x in text.splitlines() if "::" in x])
            self.groups.append((name, "collected" if n else "EMPTY", {"collected": n}, [] if n else [text[-800:]], 0))
            ok = ok and n > 0
        return ok

    # ---- 5. the groups ----
    def pytest_timeout_args(self, per_test):
        has = self.capture([self.python, "-c", "import pytest_timeout; print('yes')"]) == "yes"
        if not has:
            if "no-timeout" not in self.facts:
                self.facts["no-timeout"] = True
                self.note("pytest-timeout is not installed: only the group budgets bound a hung test")
            return []
        return ["--timeout", str(per_test), "--timeout-method", "signal"]

    def run_group(self, name, args, budget, per_test, prefix=(), log="tests.log"):
        seconds = min(budget, self.left() - RESERVE_SECONDS)
        if seconds < 10:
            self.groups.append((name, "not run (out of time)", {}, [], 0))
            return False
        junit = os.path.join(self.work, "junit", name + ".xml")
        # -v: each test's outcome is in the log as it ends, so a group killed at its budget (a hang
        # inside C, which the per-test timeout's signal cannot interrupt; no JUnit file then) still
        # shows what passed and which test hung
        cmd = list(prefix) + [self.python, "-m", "pytest", "-v", "-ra", "--tb=short", "-p", "no:cacheprovider",
                              f"--junitxml={junit}", "-o", "junit_family=xunit1"] + \
            self.pytest_timeout_args(per_test) + args
        self.say(f"group {name}: up to {seconds:.0f} s")
        logpath = os.path.join(self.out, log)
        offset = os.path.getsize(logpath) if os.path.exists(logpath) else 0
        st, secs = self.run(cmd, log, seconds)
        counts, failures = read_junit(junit)
        if not counts:
            with open(logpath, errors="replace") as f:
                f.seek(offset)
                counts, failures = read_verbose(f.read())
        if st is None:
            status = "TIMED OUT"
        elif st == 0:
            status = "passed"
        elif st == 5:
            status = "NO TESTS"
        else:
            status = "FAILED"
        if counts.get("tests", 0) and counts.get("skipped", 0) == counts.get("tests") and status == "passed":
            status = "ALL SKIPPED"  # the device check above makes this a defect, not a green
        self.groups.append((name, status, counts, failures, secs))
        self.say(f"group {name}: {status} {fmt_counts(counts)} in {secs:.0f} s")
        return status == "passed"

    def bench_run(self):
        seconds = min(BENCH_SECONDS, self.left() - RESERVE_SECONDS)
        if seconds < 20:
            self.bench = ("not run (out of time)", [])
            return
        st, secs = self.run([self.python, "benchmarks/bench_gpu.py", "--epochs", "2", "--resnet-steps", "20",
                             "--write"], "bench.log", seconds)
        status = "done" if st == 0 else ("TIMED OUT" if st is None else f"status {st}")
        # then where the time goes: dpcore and PyTorch with and without deterministic cuDNN, the
        # kernels of each (benchmarks/gpu_profile.py), into the same log
        if self.left() - RESERVE_SECONDS - MEMCHECK_SECONDS >= 40:
            pst, _ = self.run([self.python, "benchmarks/gpu_profile.py", "--steps", "20"], "bench.log",
                              min(120, self.left() - RESERVE_SECONDS - MEMCHECK_SECONDS))
            status += "; gpu_profile.py " + ("done" if pst == 0 else ("TIMED OUT" if pst is None else f"status {pst}"))
        text = open(os.path.join(self.out, "bench.log"), errors="replace").read()
        lines = [x.rstrip() for x in text.splitlines()
                 if re.search(r": [\d.]+( |$)", x) or re.match(r"(dpcore|torch) +deterministic=", x)
                 or x.startswith("== dpcore ResNet") or x.startswith("== PyTorch ResNet")]
        self.bench = (status, lines)
        results = os.path.join(HERE, "benchmarks", "RESULTS.md")
        if st == 0 and os.path.exists(results):
            text = open(results).read()
            i = text.find("## GPU (dpcore vs PyTorch")
            if i >= 0:
                j = text.find("\n## ", i + 1)
                with open(os.path.join(self.out, "RESULTS-gpu.md"), "w") as f:
                    f.write(text[i:j if j > 0 else None])

    def memcheck_run(self):
        sanitizer = shutil.which("compute-sanitizer", path=self.env.get("PATH", ""))
        if not sanitizer:
            home = self.env.get("CUDA_HOME", "")
            c = os.path.join(home, "bin", "compute-sanitizer")
            sanitizer = c if os.access(c, os.X_OK) else None
        if not sanitizer:
            self.memcheck = "not run: compute-sanitizer not found"
            return
        before = len(self.groups)
        ok = self.run_group("memcheck", GROUPS[0][1], MEMCHECK_SECONDS, MEMCHECK_SECONDS,
                            prefix=[sanitizer, "--tool", "memcheck", "--error-exitcode", "86",
                                    "--leak-check", "no", "--target-processes", "all"], log="memcheck.log")
        text = open(os.path.join(self.out, "memcheck.log")).read()
        summary = re.findall(r"ERROR SUMMARY: \d+ errors?", text)
        self.memcheck = (summary[-1] if summary else "no ERROR SUMMARY line") + ("" if ok else " (group failed)")
        if len(self.groups) > before:
            self.groups[-1] = self.groups[-1][:1] + (self.groups[-1][1] + "; " + self.memcheck,) + self.groups[-1][2:]

    # ---- the host's CPU: dpcore against PyTorch on two of its vCPUs ----
    def cpu_run(self):
        """The CPU benchmarks (bench_resnet_cpu.py, bench_lenet_cpu.py: dpcore against the image's
        PyTorch in the same run) pinned to two vCPUs as a 2-vCPU cloud machine has them: one
        core's two hardware threads first, then two physical cores; then bench_layers.py on the
        first pair. GPU machines' hosts are Intel Xeons, which this project's development
        machines are not. Output in bench.log."""
        facts = cpu_facts()
        self.facts["host_cpu"] = facts
        pairs = cpu_pairs()
        self.cpu = []
        if not pairs:
            self.cpu.append("not run: fewer than two usable vCPUs")
            return
        runs = [(f"{name}, vCPUs {pair[0]},{pair[1]} ({what})", pair, [script, "--threads", "2"] + args)
                for what, pair in pairs
                for name, script, args in (("ResNet-18 step", "benchmarks/bench_resnet_cpu.py",
                                            ["--steps", "4", "--rounds", "2"]),
                                           ("LeNet epoch", "benchmarks/bench_lenet_cpu.py",
                                            ["--epochs", "1", "--rounds", "1"]))]
        # then each layer against PyTorch's (the per-layer table that finds a slow layer), on the first pair
        what, pair = pairs[0]
        runs.append((f"per layer (bench_layers.py), vCPUs {pair[0]},{pair[1]} ({what})", pair,
                     ["benchmarks/bench_layers.py", "--rounds", "2"]))
        env = dict(self.env, CUDA_VISIBLE_DEVICES="")
        log = os.path.join(self.out, "bench.log")
        for label, pair, cmd in runs:
            seconds = self.left() - RESERVE_SECONDS
            if seconds < CPU_MIN_SECONDS:
                self.cpu.append(f"{label}: not run (out of time)")
                continue
            offset = os.path.getsize(log)
            pin = "import os, sys; os.sched_setaffinity(0, {%d, %d}); os.execv(sys.argv[1], sys.argv[1:])" % pair
            st, secs = self.run([self.python, "-c", pin, self.python] + cmd, "bench.log", seconds, env=env)
            with open(log, errors="replace") as f:
                f.seek(offset)
                head = cpu_headline(f.read())
            status = "TIMED OUT" if st is None else ("done" if st == 0 else f"status {st}")
            self.cpu.append(f"{label}: {status} in {secs:.0f} s" + (f"; {head}" if head else ""))

    def commit(self):
        """The tree's commit: git's where the tree has its .git, else GPU_DAY_COMMIT (the device
        machine gets a copy of the working tree without its history)."""
        if os.environ.get("GPU_DAY_COMMIT"):  # the device's copy of the tree may carry a stale .git
            return os.environ["GPU_DAY_COMMIT"]
        if shutil.which("git") and os.path.isdir(os.path.join(HERE, ".git")):
            head = self.capture(["git", "-C", HERE, "rev-parse", "--short", "HEAD"])
            dirty = self.capture(["git", "-C", HERE, "status", "--porcelain", "--untracked-files=no"])
            return head + (" (+ uncommitted changes)" if dirty else "")
        return os.environ.get("GPU_DAY_COMMIT", "unknown (no .git here; set GPU_DAY_COMMIT)")

    def also_run(self, cmd):
        """A command of the developer's in the day's build and environment, with the time left
        (its output in also.log; its status in the summary, not in the exit status)."""
        seconds = self.left() - RESERVE_SECONDS
        if seconds < 10:
            self.notes.append(f"not run (out of time): {cmd}")
            return
        st, secs = self.run(["bash", "-c", cmd], "also.log", seconds)
        self.notes.append(f"--also {cmd!r}: " + ("TIMED OUT" if st is None else f"status {st}") + f" in {secs:.0f} s "
                          "(also.log)")

    def fail(self, code, text):
        self.note("STOP: " + text)
        self.code = code
        return False

    # ---- 7. the summary ----
    def summary(self):
        L = [f"dpcore GPU day, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
             + (" (REHEARSAL on a CPU machine: stops at the first step that needs a device)"
                if self.args.rehearse else ""),
             f"commit: {self.commit()}",
             "", "== machine"]
        for k in ("gpu", "nvcc", "os", "kernel", "cpus", "gcc", "python", "wheels"):
            L.append(f"{k}: {self.facts.get(k, '?')}")
        L += ["", "== build", self.facts.get("build", "not built"), "libraries: " + self.facts.get("cuda_libs", "?"),
              "loaded (ldd): " + self.facts.get("linked", "?"),
              "devices: " + self.facts.get("devices", "?")]
        if "gpu_tests" in self.facts:
            L.append(f"GPU tests collected: {self.facts['gpu_tests']}")
        L += ["", "== test groups (priority order)"]
        for name, status, counts, failures, secs in self.groups:
            L.append(f"{name:9s} {status:12s} {fmt_counts(counts)}" + (f"  {secs:.0f} s" if secs else ""))
            for fail in failures[:12]:
                L += ["    " + x for x in fail.splitlines()[:6]]
            if len(failures) > 12:
                L.append(f"    ... and {len(failures) - 12} more (tests.log)")
        if self.bench:
            L += ["", f"== benchmark (bench_gpu.py, same GPU, same run): {self.bench[0]}"] + self.bench[1]
        if self.memcheck:
            L += ["", "== compute-sanitizer memcheck over the smoke tests: " + self.memcheck]
        if self.cpu:
            L += ["", "== the host's CPU against PyTorch (bench.log): " + self.facts.get("host_cpu", "?")] + self.cpu
        if self.notes:
            L += ["", "== notes"] + ["- " + n for n in self.notes]
        L += ["", f"total: {time.monotonic() - self.start:.0f} s; exit status {self.code}",
              "files: " + " ".join(sorted(os.listdir(self.out)) + ["junit.tar.gz"] * (
                  not os.path.exists(os.path.join(self.out, "junit.tar.gz"))))]
        text = "\n".join(L) + "\n"
        with open(os.path.join(self.out, "summary.txt"), "w") as f:
            f.write(text)
        with tarfile.open(os.path.join(self.out, "junit.tar.gz"), "w:gz") as tar:
            tar.add(os.path.join(self.work, "junit"), arcname="junit")
        print("\n" + text, flush=True)

    def main(self):
        self.code = 0
        self.record_machine()
        if self.unpack_debs() and self.assemble_cuda_home() and self.build():
            if self.args.rehearse:
                if self.collect():
                    self.note("rehearsal: stopped before the first step that needs a device (the test groups, "
                              "the benchmark, memcheck); every GPU test and each group's selection collected")
                else:
                    self.fail(1, "a group's selection collects no test, or collection failed (tests.log)")
                if self.args.only and "cpu" in self.args.only:
                    self.cpu_run()  # needs no device
            else:
                only = self.args.only
                for name, args, budget, per_test in GROUPS:
                    if (only is None or name in only) and not self.run_group(name, args, budget, per_test):
                        self.code = 1
                if only is None or "bench" in only:
                    self.bench_run()
                if only is None or "memcheck" in only:
                    self.memcheck_run()
                # the --also commands are the developer's plan for the time left: the CPU step only when named then
                if (only is None and not self.args.also) or (only is not None and "cpu" in only):
                    self.cpu_run()
                for cmd in self.args.also:
                    self.also_run(cmd)
                if self.memcheck and not self.memcheck.startswith(("ERROR SUMMARY: 0 ", "not run")):
                    self.code = 1
        self.summary()
        return self.code


def cpu_pairs(sysfs="/sys/devices/system/cpu", allowed=None):
    """[(what, (a, b))]: two usable vCPUs that are one core's hardware threads, then two on
    different cores of one package, each where the machine has them (from sysfs topology)."""
    allowed = sorted(allowed if allowed is not None else os.sched_getaffinity(0))
    topo = {}
    for c in allowed:
        d = os.path.join(sysfs, f"cpu{c}", "topology")
        try:
            topo[c] = (open(os.path.join(d, "physical_package_id")).read().strip(),
                       open(os.path.join(d, "core_id")).read().strip())
        except OSError:
            topo[c] = ("?", str(c))
    pairs = []
    same = [(a, b) for i, a in enumerate(allowed) for b in allowed[i + 1:] if topo[a] == topo[b]]
    if same:
        pairs.append(("one core's two threads", same[0]))
    apart = [(a, b) for i, a in enumerate(allowed) for b in allowed[i + 1:]
             if topo[a][0] == topo[b][0] and topo[a][1] != topo[b][1]]
    if apart:
        pairs.append(("two cores", apart[0]))
    return pairs


def cpu_headline(text):
    """A CPU benchmark's result as dpcore's time over PyTorch's (issue 31's measure), from its output."""
    m = re.search(r"dpcore images/s / PyTorch images/s: ([\d.]+)\** \(best steps; ([\d.]+) on the medians", text)
    if m and float(m.group(1)) > 0 and float(m.group(2)) > 0:
        return (f"dpcore / PyTorch step time {1 / float(m.group(1)):.3f}x (best steps), "
                f"{1 / float(m.group(2)):.3f}x (medians)")
    m = re.search(r"ratio dpcore_seconds / torch_seconds: ([\d.]+) \(best epochs\), ([\d.]+) \(means\)", text)
    if m:
        return f"dpcore / PyTorch epoch time {m.group(1)}x (best epochs), {m.group(2)}x (means)"
    layers = re.findall(r"^### (LeNet|ResNet-18)[^\n]*\n(?:(?!### )[^\n]*\n)*?- conv / dense layers: .*?"
                        r"\(\*\*dpcore / PyTorch ([\d.]+)x\*\*", text, re.M)
    if layers:
        return "conv / dense layers' time against PyTorch's: " + ", ".join(f"{n} {r}x" for n, r in layers)
    return ""


def cpu_facts(sysfs="/sys/devices/system/cpu"):
    """The CPU's model, vector extensions and cache sizes in one line."""
    model, flags = "?", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model == "?":
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    caches = []
    for i in range(4):
        d = os.path.join(sysfs, "cpu0", "cache", f"index{i}")
        try:
            level, kind = open(os.path.join(d, "level")).read().strip(), open(os.path.join(d, "type")).read().strip()
            size = open(os.path.join(d, "size")).read().strip()
        except OSError:
            continue
        if kind != "Instruction":
            caches.append(f"L{level} {size}")
    return f"{model}, {isa}, {os.cpu_count()} vCPUs, " + (", ".join(caches) or "caches ?")


def version_key(path):
    return [int(x) for x in re.findall(r"\d+", path)]


def so_version(path, stem):
    """(13, 1, 0) for libcublas.so.13.1.0; () for libcublas.so."""
    tail = os.path.basename(path)[len(stem) + 3:]
    return tuple(int(x) for x in tail.split(".") if x.isdigit()) if tail.startswith(".") else ()


# library stem -> (header that must sit in the include folder beside it, component, the headers
# of its own to take from there: a wheel's include folder is shared with other wheels, such as
# the CUDA runtime's, whose headers must not shadow the toolkit's that nvcc compiles with)
LIBRARIES = {"libcudnn": ("cudnn.h", "cudnn", "cudnn*.h"), "libcublas": ("cublas_v2.h", "cublas", "cublas*.h"),
             "libcublasLt": ("cublasLt.h", "cublas", "cublasLt*.h"), "libnccl": ("nccl.h", "nccl", "nccl*")}


def find_wheel_library(sites, stem, header):
    """The newest (version, lib folder, include folder, file) of stem among the NVIDIA wheels of
    these site folders, or None: a library file stem.so.N... whose folder's ../include holds
    header (cuDNN, NCCL and cuBLAS wheels lay themselves out so, under nvidia/)."""
    best = None
    for site in sites:
        for f in glob.glob(os.path.join(site, "nvidia", "**", stem + ".so*"), recursive=True):
            v = so_version(f, stem)
            libdir = os.path.dirname(f)
            inc = os.path.join(os.path.dirname(libdir), "include")
            if not v or not os.path.exists(os.path.join(inc, header)):
                continue
            cand = (v, libdir, inc, f)
            if best is None or cand[0] > best[0]:
                best = cand
    return best


def link_all(src_dir, dst_dir):
    os.makedirs(dst_dir, exist_ok=True)
    for e in os.listdir(src_dir):
        d = os.path.join(dst_dir, e)
        if not os.path.lexists(d):
            os.symlink(os.path.join(src_dir, e), d)


def assemble_cuda_home(toolkit, sites, home):
    """A CUDA_HOME at home: the toolkit's bin, include and lib64, with cuDNN's, cuBLAS's and
    NCCL's headers and libraries taken from the newest wheel of each among sites (the toolkit's
    own where no wheel has one). Returns ({'libdirs': folders for LD_LIBRARY_PATH, 'fallback':
    components from the toolkit}, lines saying where each came from), or (None, why)."""
    why = []
    tlib = next((os.path.join(toolkit, d) for d in ("lib64", "lib") if os.path.exists(
        os.path.join(toolkit, d, "libcudart_static.a"))), None)
    if tlib is None:
        return None, [f"no libcudart_static.a under {toolkit}/lib64 or lib"]
    if os.path.lexists(home):
        shutil.rmtree(home)
    os.makedirs(home)
    for e in os.listdir(toolkit):
        if e not in ("include", "lib64", "lib"):
            os.symlink(os.path.join(toolkit, e), os.path.join(home, e))
    inc, lib = os.path.join(home, "include"), os.path.join(home, "lib64")
    os.makedirs(inc)
    os.makedirs(lib)
    libdirs, fallback = [], []
    chosen = {}
    for stem, (header, component, _) in LIBRARIES.items():
        found = find_wheel_library(sites, stem, header)
        if found:
            chosen[stem] = found
    for stem, (header, component, headers) in LIBRARIES.items():
        if stem in chosen:
            v, libdir, winc, f = chosen[stem]
            # the wheel's own headers before the toolkit's (the library's version of them)
            for h in glob.glob(os.path.join(winc, headers)):
                d = os.path.join(inc, os.path.basename(h))
                if not os.path.lexists(d):
                    os.symlink(h, d)
            for g in glob.glob(os.path.join(libdir, stem + ".so*")) + glob.glob(os.path.join(libdir, stem + "_*.so*")):
                d = os.path.join(lib, os.path.basename(g))
                if not os.path.lexists(d):
                    os.symlink(g, d)
            unversioned = os.path.join(lib, stem + ".so")
            if os.path.lexists(unversioned):
                os.remove(unversioned)
            os.symlink(f, unversioned)  # what -l links: the newest version's soname goes in
            if libdir not in libdirs:
                libdirs.append(libdir)
            why.append(f"{stem}: {os.path.basename(f)} from {libdir}")
        else:
            if os.path.exists(os.path.join(toolkit, "include", header)) and glob.glob(
                    os.path.join(tlib, stem + ".so*")):
                if component not in fallback:
                    fallback.append(component)
                why.append(f"{stem}: the toolkit's ({tlib})")
            else:
                return None, why + [f"{stem}: neither a wheel nor the toolkit ({toolkit}) has it with {header}"]
    link_all(os.path.join(toolkit, "include"), inc)
    link_all(tlib, lib)
    return {"libdirs": libdirs, "fallback": fallback}, why


def read_junit(path):
    counts, failures = {}, []
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return counts, failures
    for case in root.iter("testcase"):
        counts["tests"] = counts.get("tests", 0) + 1
        name = case.get("classname", "") + "::" + case.get("name", "")
        for kind in ("failure", "error", "skipped"):
            el = case.find(kind)
            if el is not None:
                counts[kind] = counts.get(kind, 0) + 1
                if kind != "skipped":
                    msg = (el.get("message") or "") + "\n" + (el.text or "")
                    failures.append(f"{kind.upper()} {name}\n" + "\n".join(
                        x for x in msg.strip().splitlines() if x.strip())[:1500])
                else:
                    failures.append(f"skipped {name}: {(el.get('message') or '')[:300]}")
                break
        else:
            counts["passed"] = counts.get("passed", 0) + 1
    failures.sort(key=lambda x: x.startswith("skipped"))  # failures first
    return counts, failures


def read_verbose(text):
    """Counts and failures from pytest -v's lines, for a run that wrote no JUnit file (killed):
    the test whose line has no outcome is the one that was running."""
    counts, failures = {}, []
    names = {"PASSED": "passed", "FAILED": "failure", "ERROR": "error", "SKIPPED": "skipped"}
    pending = None
    for line in text.splitlines():
        m = re.match(r"^(\S+::\S+)(?: (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b)?", line)
        if not m:
            continue
        if m.group(2):
            kind = names.get(m.group(2), "passed")
            counts["tests"] = counts.get("tests", 0) + 1
            counts[kind] = counts.get(kind, 0) + 1
            if kind in ("failure", "error"):
                failures.append(f"{kind.upper()} {m.group(1)} (no JUnit file: see the log)")
            pending = None
        else:
            pending = m.group(1)
    if pending:
        counts["tests"] = counts.get("tests", 0) + 1
        counts["error"] = counts.get("error", 0) + 1
        failures.insert(0, f"HUNG {pending}: still running when the group was stopped")
    return counts, failures


def fmt_counts(c):
    return ", ".join(f"{c[k]} {k}" for k in ("collected", "passed", "failure", "error", "skipped") if c.get(k))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("outdir", nargs="?", help="where the files go (default: $OUT, else ./gpu-day-out)")
    p.add_argument("--rehearse", action="store_true",
                   help="on a CPU machine: every step up to the first that needs a device")
    p.add_argument("--debs", default=os.path.join(HERE, ".gpu", "debs"),
                   help="the .debs of scripts/gpu-day-prepare.sh (default .gpu/debs)")
    p.add_argument("--arch", default=os.environ.get("GPU_DAY_ARCH", ""),
                   help="compute capability to build for (default: the GPU's, from nvidia-smi)")
    p.add_argument("--python", default=os.environ.get("GPU_DAY_PYTHON") or shutil.which("python3") or sys.executable,
                   help="the Python to build into and test with (default: python3 on PATH)")
    p.add_argument("--wheel-site", action="append", default=[],
                   help="another folder holding NVIDIA wheels' nvidia/ tree (pip install --target)")
    p.add_argument("--work", default=os.environ.get("GPU_DAY_WORK", "/tmp/dpcore-gpu-day"),
                   help="scratch folder (the prefix, CUDA_HOME, the installed dpcore); emptied first")
    p.add_argument("--budget", type=float, default=float(os.environ.get("GPU_DAY_BUDGET", 450)),
                   help="seconds for the whole run (default 450: 7.5 minutes)")
    p.add_argument("--only", type=lambda t: [x for x in t.split(",") if x],
                   help="a short rerun: these steps only, comma-separated (%s, bench, memcheck, cpu)"
                   % ", ".join(g[0] for g in GROUPS))
    p.add_argument("--also", action="append", default=[],
                   help="a shell command to run last in the day's build (PYTHONPATH, LD_LIBRARY_PATH), "
                   "with the time left; output in also.log")
    p.add_argument("--verbose", action="store_true", help="echo every command's output")
    args = p.parse_args(argv)
    names = [g[0] for g in GROUPS] + ["bench", "memcheck", "cpu"]
    if args.only is not None and (not args.only or set(args.only) - set(names)):
        p.error(f"--only {','.join(args.only)}: expected some of {', '.join(names)}")
    return args


def main(argv=None):
    return Day(parse_args(argv)).main()


if __name__ == "__main__":
    sys.exit(main())
