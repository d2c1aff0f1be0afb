"""Build dpcore's extension from csrc/ (C11) and, when the CUDA toolkit is found,
the .cu launchers in kernels/ (nvcc).

Environment:
  DPCORE_CUDA=0        build CPU-only even when nvcc is found
  DPCORE_MPI=0         build without MPI even when mpicc is found (every process is then a world of one)
  CUDA_HOME=/path      where the CUDA toolkit lives (default: /usr/local/cuda, or nvcc on PATH)
  DPCORE_BLAS_INC / DPCORE_BLAS_LIB   CBLAS header dir / library file (default: Debian's OpenBLAS)
  DPCORE_CUDA_ARCHS="90"  cubins for these compute capabilities only (default: 7.5 8.0 8.6 8.9 9.0 + PTX)
  DPCORE_DEBUG=1       -O0 -g
  DPCORE_BUILD_JOBS=N  compile N sources at a time (default: the CPUs this process may use)
  DPCORE_BUILD_DIR=dir where the variants' build trees go (default: build); a build of one variant
                       must not run beside another build of the same variant in the same folder
  DPCORE_SANITIZE=1    AddressSanitizer + UndefinedBehaviorSanitizer (-g, UB fatal), CPU-only, in its
                       own build tree (build/cpu-asan, build/cpu-nompi-asan); Python must preload the
                       sanitizer runtime (make test-asan does)
"""
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor

import numpy
from setuptools import Extension, setup
from setuptools.command.build import build
from setuptools.command.build_ext import build_ext
from setuptools.command.egg_info import egg_info

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CUDA_ARCHS = ["75", "80", "86", "89", "90"]  # sm_XX cubins, plus PTX for the newest


def cuda_archs():
    """DPCORE_CUDA_ARCHS="90" (or "80 90", "8.0;9.0") builds cubins for those
    compute capabilities only: a shorter build for the GPU at hand."""
    text = os.environ.get("DPCORE_CUDA_ARCHS", "").strip()
    if not text:
        return DEFAULT_CUDA_ARCHS
    archs = [a.replace(".", "").replace("sm_", "") for a in re.split(r"[\s,;]+", text) if a]
    bad = [a for a in archs if not (a.isdigit() and len(a) in (2, 3))]
    if bad:
        raise SystemExit("dpcore build: DPCORE_CUDA_ARCHS=%r: expected compute capabilities such as "
                         "'90' or '8.6;9.0'" % text)
    return sorted(set(archs), key=int)


CUDA_ARCHS = cuda_archs()


def log(msg):
    print("dpcore build: " + msg, file=sys.stderr)


def find_blas():
    inc = os.environ.get("DPCORE_BLAS_INC")
    lib = os.environ.get("DPCORE_BLAS_LIB")
    if inc and lib:
        return {"name": "custom", "include": inc, "library": lib}
    multiarch = sysconfig.get_config_var("MULTIARCH") or "x86_64-linux-gnu"
    for variant in ("openblas-openmp", "openblas-pthread", "openblas-serial"):
        inc = f"/usr/include/{multiarch}/{variant}"
        lib = f"/usr/lib/{multiarch}/{variant}/libopenblas.so"
        if os.path.exists(os.path.join(inc, "cblas.h")) and os.path.exists(lib):
            return {"name": "OpenBLAS (%s)" % variant, "include": inc, "library": lib}
    return None


SANITIZE = os.environ.get("DPCORE_SANITIZE") == "1"


def find_cuda():
    if os.environ.get("DPCORE_CUDA", "1") == "0":
        return None, "disabled by DPCORE_CUDA=0"
    if SANITIZE:
        # Not worth it: ASan would check only the host side of nvcc's launchers (the kernels
        # run on the GPU, which compute-sanitizer checks, not ASan), and the CUDA driver
        # maps its memory under ASan only with protect_shadow_gap=0. The C core, the
        # binding and the CPU backend, where the host-side bugs would be, are all here.
        return None, "disabled by DPCORE_SANITIZE=1 (the sanitized build is CPU-only)"
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if not home:
        nvcc = shutil.which("nvcc")
        home = os.path.dirname(os.path.dirname(nvcc)) if nvcc else "/usr/local/cuda"
    nvcc = os.path.join(home, "bin", "nvcc")
    if not os.path.exists(nvcc):
        return None, "nvcc not found (looked in %s)" % home
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
        version = out.strip().splitlines()[-1]
    except (OSError, subprocess.CalledProcessError) as e:
        return None, "nvcc failed: %s" % e
    info = {"home": home, "nvcc": nvcc, "version": version}
    libdirs = [os.path.join(home, "lib64"), os.path.join(home, "lib")]
    libdir = next((d for d in libdirs if os.path.exists(os.path.join(d, "libcudart_static.a"))), None)
    if libdir is None:
        return None, "libcudart_static.a not found under %s" % home
    info["libdir"] = libdir
    inc = os.path.join(home, "include")
    info["include"] = inc
    for name, header, lib in (("cudnn", "cudnn.h", "libcudnn.so"), ("cublas", "cublas_v2.h", "libcublas.so"),
                              ("nccl", "nccl.h", "libnccl.so")):
        info[name] = os.path.exists(os.path.join(inc, header)) and os.path.exists(os.path.join(libdir, lib))
    return info, "found %s" % version


def find_mpi():
    """(info, why): Open MPI's (or MPICH's) compile and link flags from its
    compiler wrapper, which knows where its headers and libraries are."""
    if os.environ.get("DPCORE_MPI", "1") == "0":
        return None, "disabled by DPCORE_MPI=0"
    mpicc = shutil.which("mpicc")
    if not mpicc:
        return None, "mpicc not found (Debian: apt-get install libopenmpi-dev openmpi-bin)"
    flags = {}
    for what, args in (("compile", ["-showme:compile"]), ("link", ["-showme:link"])):
        try:
            out = subprocess.run([mpicc] + args, capture_output=True, text=True, check=True).stdout.split()
        except (OSError, subprocess.CalledProcessError):
            # MPICH's wrapper: -compile_info / -link_info print the whole command line
            try:
                out = subprocess.run([mpicc, "-" + what + "_info"], capture_output=True, text=True,
                                     check=True).stdout.split()[1:]
            except (OSError, subprocess.CalledProcessError) as e:
                return None, "mpicc %s failed: %s" % (args[0], e)
        flags[what] = out
    incs = [f[2:] for f in flags["compile"] if f.startswith("-I")]
    libdirs = [f[2:] for f in flags["link"] if f.startswith("-L")]
    libs = [f[2:] for f in flags["link"] if f.startswith("-l")]
    if not any(os.path.exists(os.path.join(d, "mpi.h")) for d in incs + ["/usr/include"]):
        return None, "mpi.h not found in %s" % incs
    return {"mpicc": mpicc, "include": incs, "libdirs": libdirs, "libs": libs}, "found %s" % mpicc


BUILD_DIR = os.environ.get("DPCORE_BUILD_DIR", "").strip() or "build"


class Build(build):
    """One build tree per variant (build/cuda, build/cpu, build/cpu-nompi): otherwise the CPU-only
    build finds the CUDA build's newer _core.so in the shared build/lib and
    installs it without relinking (or the reverse)."""

    def finalize_options(self):
        if self.build_base == "build":
            self.build_base = os.path.join(BUILD_DIR, VARIANT)
        super().finalize_options()


def build_jobs():
    text = os.environ.get("DPCORE_BUILD_JOBS", "").strip()
    if text:
        if not text.isdigit() or int(text) < 1:
            raise SystemExit("dpcore build: DPCORE_BUILD_JOBS=%r: expected a positive integer" % text)
        return int(text)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


# The sources that take the longest to compile, longest first: they start first, so that the
# others fill the remaining cores beside them rather than one long compile ending the build alone
# (under DPCORE_SANITIZE=1, UBSan's checks of the unrolled transforms make winograd_lanes.c several
# times the others). Any other source follows in name order.
HEAVY_FIRST = ("winograd_lanes.c", "winograd_s2.c", "winograd.c", "fft_lanes.c", "small_gemm.c", "backend_cpu.c",
               "implicit_gemm.c", "model.c", "mirrored.c")


def compile_order(sources):
    """Indices of sources in the order to start their compiles (HEAVY_FIRST first)."""
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    return sorted(range(len(sources)), key=lambda i: (rank.get(os.path.basename(sources[i]), len(rank)), i))


def parallel_compile(compiler, jobs):
    """Makes compiler.compile build its sources `jobs` at a time, the heaviest first (HEAVY_FIRST):
    setuptools compiles the sources of one extension one after another (its --parallel builds
    whole extensions in parallel, and dpcore has one). The objects keep the sources' order."""
    def compile(sources, output_dir=None, macros=None, include_dirs=None, debug=0, extra_preargs=None,
                extra_postargs=None, depends=None):
        macros, objects, extra_postargs, pp_opts, build = compiler._setup_compile(
            output_dir, macros, include_dirs, sources, depends, extra_postargs)
        cc_args = compiler._get_cc_args(pp_opts, debug, extra_preargs)

        def one(obj):
            if obj in build:
                src, ext = build[obj]
                compiler._compile(obj, src, ext, cc_args, extra_postargs, pp_opts)

        with ThreadPoolExecutor(jobs) as pool:
            # list(): the first compile error is raised here
            list(pool.map(one, [objects[i] for i in compile_order(sources)]))
        return objects
    compiler.compile = compile


class EggInfo(egg_info):
    """A wheel's build (pip install .) writes its egg-info under build/<variant> as well, not into
    python/: two builds of other variants from one tree at once (CI builds the sanitized extension
    while the suite builds others) would otherwise rewrite the same python/dpcore.egg-info under
    each other. Other commands (sdist, develop) keep setuptools' place for it."""

    def finalize_options(self):
        if self.egg_base is None and "bdist_wheel" in self.distribution.commands:
            self.egg_base = os.path.join(BUILD_DIR, VARIANT)
            os.makedirs(self.egg_base, exist_ok=True)
        super().finalize_options()


class BuildExt(build_ext):
    """Compiles kernels/*.cu with nvcc into objects linked into the extension, and the C sources
    DPCORE_BUILD_JOBS at a time."""

    def finalize_options(self):
        super().finalize_options()
        self.build_temp = os.path.join(self.build_temp, VARIANT)

    def build_extension(self, ext):
        jobs = build_jobs()
        if jobs > 1:
            parallel_compile(self.compiler, jobs)
        cuda = CONFIG["cuda"]
        if cuda:
            os.makedirs(self.build_temp, exist_ok=True)
            gencode = []
            for a in CUDA_ARCHS:
                gencode += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
            gencode += ["-gencode", f"arch=compute_{CUDA_ARCHS[-1]},code=compute_{CUDA_ARCHS[-1]}"]
            commands = []
            for src in sorted(glob.glob(os.path.join(HERE, "kernels", "*.cu"))):
                obj = os.path.join(self.build_temp, os.path.basename(src) + ".o")
                # --fmad=false: nvcc contracts a * b + c into one FMA by default, the C
                # build (-std=c11, so GCC's -ffp-contract=off) does not; without contraction
                # the DP_HD bodies of kernels/dp_kernels.h round the same on both sides, so
                # a GPU body is bit-identical to the CPU's (tests/c/kernel_bodies.c checks
                # the CPU side against independent loops) except where libm and CUDA's
                # expf/logf differ (the softmax rows). It costs nothing measurable: these
                # kernels are memory-bound element loops, and it reaches only our .cu files,
                # not cuBLAS or cuDNN.
                cmd = [cuda["nvcc"], "-c", src, "-o", obj, "-O3", "-std=c++17", "--fmad=false",
                       "--Werror", "all-warnings",
                       "-Xcompiler", "-fPIC,-Wall,-Wextra", "-I" + os.path.join(HERE, "kernels"),
                       "-I" + os.path.join(HERE, "csrc"), "--threads", "0"] + gencode
                commands.append((cmd, obj))

            def nvcc(job):
                log(" ".join(job[0]))
                subprocess.run(job[0], check=True)
                return job[1]
            with ThreadPoolExecutor(jobs) as pool:
                objs = list(pool.map(nvcc, commands))
            # before the static cudart archive, which resolves their symbols
            ext.extra_objects = objs + list(ext.extra_objects or [])
        super().build_extension(ext)


def make_config():
    blas = find_blas()
    if blas is None:
        raise SystemExit("dpcore build: no CBLAS found. Install Debian's libopenblas-openmp-dev "
                         "(scripts/bootstrap.sh does it) or set DPCORE_BLAS_INC and DPCORE_BLAS_LIB.")
    cuda, cuda_why = find_cuda()
    log("BLAS: %s" % blas["name"])
    log("CUDA: %s" % cuda_why + ("" if cuda else ", building CPU-only"))
    mpi, mpi_why = find_mpi()
    log("MPI: %s" % mpi_why + ("" if mpi else ", building without multi-process training"))
    return {"blas": blas, "cuda": cuda, "cuda_why": cuda_why, "mpi": mpi, "mpi_why": mpi_why}


CONFIG = make_config()
VARIANT = ("cuda" if CONFIG["cuda"] else "cpu") + ("" if CONFIG["mpi"] else "-nompi") + ("-asan" if SANITIZE else "")
# and the code generation: objects compiled for another -march (DPCORE_NATIVE=0, CFLAGS=-march=...)
# or -O0 were reused by the next build of the same variant (their sources unchanged), so that
# a "-march=haswell" build shipped the generic build's SSE2 objects
_codegen = "|".join(os.environ.get(k, "") for k in ("DPCORE_NATIVE", "DPCORE_DEBUG", "CFLAGS", "CPPFLAGS"))
if _codegen != "|||":
    import hashlib
    VARIANT += "-" + hashlib.sha256(_codegen.encode()).hexdigest()[:8]


def extension():
    blas, cuda = CONFIG["blas"], CONFIG["cuda"]
    debug = os.environ.get("DPCORE_DEBUG") == "1"
    # -ffp-contract=off: no FMA contraction (GCC's default under -std=c11 anyway, said here because
    # the DP_HD bodies are bit-identical to the GPU's only so; see --fmad=false below)
    # -Werror=unused-result: a dp_status (DP_MUST_CHECK) that is dropped does not build
    # -fno-wrapv: CPython's CFLAGS, which every extension inherits, carry -fwrapv, under which a
    # signed overflow is defined (it wraps). The C core is written to C11, where it is undefined
    # (the sanitizer build's UBSan checks it, the C test programs compile it so), and -fwrapv
    # costs: with it GCC 12 stored the AVX2 GEMM kernel's 12 accumulators to the stack after
    # every FMA of its k loop (half the kernel's rate on AMD Zen 3)
    cflags = ["-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Werror=unused-result", "-fopenmp",
              "-D_GNU_SOURCE", "-ffp-contract=off", "-fno-wrapv"]
    cflags += ["-O0", "-g"] if debug else ["-O3"]
    if os.environ.get("DPCORE_NATIVE", "1") != "0":
        cflags.append("-march=native")  # built from source on the machine that runs it
    ldflags = ["-fopenmp"]
    if SANITIZE:
        # -fno-sanitize-recover: undefined behaviour ends the process (a report nobody reads
        # is no check); the runtime is GCC's shared libasan/libubsan, preloaded into Python.
        # The optimization stays the shipped build's (-O3): the sanitizers check the code that
        # runs, vectorized loops and their tails included; -g names the inlined frames.
        # -fno-var-tracking: no locations of local variables (a report's stack needs the line
        # tables and the inlined frames, which stay): a quarter less compile time.
        # (-fno-wrapv above: under -fwrapv UBSan would never check a signed overflow)
        cflags += ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer", "-g",
                   "-fno-var-tracking"]
        ldflags += ["-fsanitize=address,undefined"]
    macros = [("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]
    libdirs, libs, objs, incs = [], [], [blas["library"]], [blas["include"]]
    rpath = [os.path.dirname(blas["library"])]
    if cuda:
        macros.append(("DP_HAVE_CUDA", "1"))
        incs.append(cuda["include"])
        objs.append(os.path.join(cuda["libdir"], "libcudart_static.a"))
        libs += ["dl", "rt", "pthread", "stdc++"]
        if cuda["cudnn"] or cuda["cublas"] or cuda["nccl"]:
            libdirs.append(cuda["libdir"])
            rpath.append(cuda["libdir"])
        if cuda["cudnn"]:
            macros.append(("DP_HAVE_CUDNN", "1"))
            libs.append("cudnn")
        if cuda["cublas"]:
            macros.append(("DP_HAVE_CUBLAS", "1"))
            libs.append("cublas")
        if cuda["nccl"]:
            # the all-reduce across distinct GPUs (csrc/comm.c)
            macros.append(("DP_HAVE_NCCL", "1"))
            libs.append("nccl")
    mpi = CONFIG["mpi"]
    if mpi:
        # the processes of a job (csrc/dist.c, the mpi all-reduce of csrc/comm.c)
        macros.append(("DP_HAVE_MPI", "1"))
        incs += mpi["include"]
        libdirs += mpi["libdirs"]
        rpath += mpi["libdirs"]
        libs += mpi["libs"]
    build_info = {
        "version": "0.1.0",
        "cuda": bool(cuda), "cuda_toolkit": cuda["version"] if cuda else None, "cuda_why": CONFIG["cuda_why"],
        "cuda_archs": ["sm_" + a for a in CUDA_ARCHS] + ["compute_" + CUDA_ARCHS[-1]] if cuda else [],
        "cudnn_found": bool(cuda and cuda["cudnn"]), "cudnn_linked": bool(cuda and cuda["cudnn"]), "cublas_found": bool(cuda and cuda["cublas"]),
        "cublas_linked": bool(cuda and cuda["cublas"]),
        # the CUDA backend (csrc/backend_cuda.c) needs the toolkit, cuDNN and cuBLAS
        "cuda_backend": bool(cuda and cuda["cudnn"] and cuda["cublas"]),
        "nccl_found": bool(cuda and cuda["nccl"]), "nccl_linked": bool(cuda and cuda["nccl"]),
        "mpi_found": bool(mpi), "mpi_linked": bool(mpi), "mpi_why": CONFIG["mpi_why"],
        "blas": blas["name"], "blas_library": blas["library"],
        "cflags": " ".join(cflags), "ldflags": " ".join(ldflags),
        "compiler": sysconfig.get_config_var("CC"),
        # the sanitizers compiled in (DPCORE_SANITIZE=1), [] in a normal build
        "sanitizers": ["address", "undefined"] if SANITIZE else [],
    }
    # one generated header and one object directory per variant, so that a
    # CPU-only build never links objects compiled for CUDA (or the reverse)
    gen_dir = os.path.join(HERE, BUILD_DIR, "generated-" + VARIANT)
    os.makedirs(gen_dir, exist_ok=True)
    header = os.path.join(gen_dir, "dp_build_config.h")
    text = "/* generated by setup.py; do not edit */\n#define DP_BUILD_INFO_JSON %s\n" % json.dumps(
        json.dumps(build_info))
    if not os.path.exists(header) or open(header).read() != text:  # keep the mtime when nothing changed
        with open(header + ".tmp", "w") as f:
            f.write(text)
        os.replace(header + ".tmp", header)
    sources = sorted(glob.glob(os.path.join("csrc", "*.c")))
    return Extension(
        "dpcore._core", sources=sources,
        include_dirs=["csrc", "kernels", gen_dir, numpy.get_include()] + incs,
        define_macros=macros, extra_compile_args=cflags, extra_link_args=ldflags + ["-Wl,-rpath," + d for d in rpath],
        libraries=libs, library_dirs=libdirs, extra_objects=objs,
        depends=glob.glob("csrc/*.h") + glob.glob("csrc/*.inc") + glob.glob("kernels/*.h") + glob.glob("kernels/*.cu")
        + glob.glob("kernels/*.cuh") + [header, os.path.join(HERE, "setup.py")],  # its flags too
    )


setup(ext_modules=[extension()], cmdclass={"build": Build, "build_ext": BuildExt, "egg_info": EggInfo})
