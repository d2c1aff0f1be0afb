"""The C core under AddressSanitizer, LeakSanitizer, UndefinedBehaviorSanitizer
and ThreadSanitizer.

The C programs of tests/c drive the core without Python (so leak detection sees
only dpcore's allocations, with whole stacks); each is built here with
-fsanitize=address,undefined (tsan_stress.c: -fsanitize=thread) and must exit 0
with no sanitizer report. The whole suite, Python and binding included, runs
under ASan and UBSan in `make test-asan` (scripts/sanitized-pytest.sh).
"""
import atexit
import concurrent.futures
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile

import pytest

from build_order import compile_order

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def blas_paths():
    for variant in ("openblas-openmp", "openblas-pthread", "openblas-serial"):
        inc = f"/usr/include/x86_64-linux-gnu/{variant}"
        lib = f"/usr/lib/x86_64-linux-gnu/{variant}/libopenblas.so"
        if os.path.exists(os.path.join(inc, "cblas.h")) and os.path.exists(lib):
            return inc, lib
    return None


# What scripts/sanitized-pytest.sh (make test-asan) sets for the Python
# processes of its run; the compilers, mpirun and the C programs here run
# without them (gcc's own leaks at exit would fail it under a preloaded
# LeakSanitizer), each program with the options its test gives.
SANITIZED_RUN = ("LD_PRELOAD", "ASAN_OPTIONS", "LSAN_OPTIONS", "UBSAN_OPTIONS", "TSAN_OPTIONS", "PYTHONMALLOC")
# the path switches a run may set (CI's CPU-only run sets DPCORE_OWN_GEMM=0): the C programs choose
# their paths themselves, and test the kernels they name
PATH_SWITCHES = ("DPCORE_OWN_GEMM", "DPCORE_WINOGRAD", "DPCORE_WINOGRAD_F43", "DPCORE_FUSE")


def clean_env(**options):
    env = {k: v for k, v in os.environ.items() if k not in SANITIZED_RUN + PATH_SWITCHES}
    env.update(options)
    return env


ASAN_UBSAN = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]
# the CPU backend's files with device.c (dp_device_destroy; the registry, which names the CUDA backend's
# entries too); the core of the replica threads (replicas, collectives, comm, mirrored runners), and the
# device registry's
CPU_DEVICE = ["backend_cpu.c", "implicit_gemm.c", "small_gemm.c", "winograd.c", "winograd_lanes.c", "winograd_s2.c", "fft_lanes.c",
              "cpu_caches.c", "backend_cuda.c", "device.c"]
MIRRORED_CORE = [*CPU_DEVICE, "collective.c", "comm.c", "dist.c", "dist_nccl.c", "mirrored.c", "layers.c", "model.c",
                 "replica.c", "resident.c", "shapes.c", "status.c"]
REGISTRY_CORE = [*CPU_DEVICE, "layers.c", "model.c", "resident.c", "shapes.c", "status.c"]


# Objects compiled once a session for each (source, compiler flags): the programs here share most of
# the core, and compiling it once a program was most of these tests' time. Compiled on every core.
_OBJECTS = {}
_OBJECT_DIR = []


def _is_link_only(flag):
    return flag.startswith(("-l", "-L", "-Wl,"))


def _objects(cc, sources, cflags):
    """The object of each source built with cflags (compiled now if this session has not)."""
    if not _OBJECT_DIR:
        _OBJECT_DIR.append(tempfile.mkdtemp(prefix="dpcore-sanitizer-objects."))
        atexit.register(shutil.rmtree, _OBJECT_DIR[0], True)
    key = tuple(cflags)
    todo = {src: os.path.join(_OBJECT_DIR[0], f"{len(_OBJECTS) + i}-{os.path.basename(src)}.o")
            for i, src in enumerate(s for s in compile_order(dict.fromkeys(sources)) if (s, key) not in _OBJECTS)}
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        list(pool.map(lambda src: subprocess.run([cc, *cflags, "-c", src, "-o", todo[src]], check=True,
                                                 env=clean_env()), todo))
    _OBJECTS.update(((src, key), obj) for src, obj in todo.items())
    return [_OBJECTS[(src, key)] for src in sources]


def compile_program(tmp_path, program, core_sources, sanitizers, link_flags=(), source_flags=None):
    """tests/c/<program>.c with the named csrc/ files, built with the given
    -fsanitize flags (and link_flags after the objects; those that are not the
    linker's, -D, -I, -march, reach every source's compilation too, as on one
    gcc command line); source_flags: {file name: flags} for those sources'
    compilations alone. Returns the executable."""
    cc = shutil.which("gcc") or shutil.which("cc")
    paths = blas_paths()
    if cc is None or paths is None:
        pytest.fail("the sanitizer build needs gcc and Debian's OpenBLAS (scripts/bootstrap.sh installs them)")
    inc, lib = paths
    exe = tmp_path / program
    # trace.c: the step timeline's recorder, which the model, the collectives and the barrier call
    core_sources = list(core_sources) + (["trace.c"] if {"model.c", "collective.c"} & set(core_sources) else [])
    sources = [os.path.join(ROOT, "tests", "c", program + ".c")] + [os.path.join(ROOT, "csrc", f) for f in core_sources]
    # -fno-var-tracking: no locations of local variables (a report's stack keeps its lines and
    # inlined frames), a quarter less compile time (setup.py's sanitized build does the same)
    cflags = ["-std=c11", "-O1", "-g", "-fno-var-tracking", "-fno-omit-frame-pointer", *sanitizers, "-fopenmp",
              "-D_GNU_SOURCE", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Werror", "-I", os.path.join(ROOT, "csrc"),
              "-I", os.path.join(ROOT, "kernels"), "-I", inc, *(f for f in link_flags if not _is_link_only(f))]
    source_flags = source_flags or {}
    own = {src: tuple(source_flags.get(os.path.basename(src), ())) for src in sources}
    objects = {}
    for extra in dict.fromkeys(own.values()):
        group = [src for src in sources if own[src] == extra]
        objects.update(zip(group, _objects(cc, group, cflags + list(extra))))
    subprocess.run([cc, *sanitizers, "-fopenmp", *(objects[src] for src in sources), lib, "-lm", *link_flags,
                    "-o", str(exe)], check=True, env=clean_env())
    return exe


def build_and_run(tmp_path, program, core_sources, link_flags=(), cflags=()):
    exe = compile_program(tmp_path, program, core_sources, ASAN_UBSAN + list(cflags), link_flags)
    env = clean_env(ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:halt_on_error=1",
                    UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1", OMP_NUM_THREADS="2")
    proc = subprocess.run([str(exe)], capture_output=True, text=True, env=env, timeout=300)
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0, report
    assert f"{program}: ok" in proc.stdout
    assert "runtime error" not in report and "Sanitizer" not in report, report


def test_core_is_clean_under_asan_lsan_ubsan(tmp_path):
    """Models (LeNet, strides/padding/max-pool) trained, evaluated and misused, a
    resident dataset gathered from, all freed."""
    build_and_run(tmp_path, "core_smoke", [*CPU_DEVICE, "layers.c", "model.c", "resident.c", "shapes.c", "status.c"])


def test_dp_hd_bodies_as_the_gpu_runs_them(tmp_path):
    """tests/c/kernel_bodies.c: every DP_HD body in the flat-index form the CUDA
    launchers call, and the CPU backend's loops over them, against reference
    loops written in the test (exact where the formula fixes the bits, a
    stated tolerance otherwise), under the sanitizers too."""
    build_and_run(tmp_path, "kernel_bodies", [*CPU_DEVICE, "collective.c", "status.c"])


def test_replica_threads_and_collectives_are_clean(tmp_path):
    """tests/c/mirrored_smoke.c: three replica threads train with gradient
    buckets, per-replica and synchronized BatchNorm and resident data; a bad
    label or row is refused before any replica starts; a step whose memory
    would grow after its warm-up is a reported error before any collective;
    everything joined and freed."""
    build_and_run(tmp_path, "mirrored_smoke", MIRRORED_CORE)


def test_device_registry_is_clean(tmp_path):
    """tests/c/device_registry.c: a device made once and shared by models,
    destroyed with its last reference; bad names refused; the logical CPU
    devices' core shares; a device made before a reconfiguration keeps
    working; gets, puts and step locks from four threads at once; nothing
    left alive or leaked."""
    build_and_run(tmp_path, "device_registry", REGISTRY_CORE, link_flags=["-lpthread"])


def test_every_failed_allocation_is_a_memory_error(tmp_path):
    """tests/c/alloc_failures.c: with malloc, calloc, realloc and aligned_alloc
    wrapped (ld --wrap), a training run is repeated with each of its
    allocations failing in turn; every run ends in DP_ERR_MEMORY with nothing
    leaked, and pooling's window tables and the convolution scratch, failed
    through the backend table as the single ops call it, are DP_ERR_MEMORY too."""
    build_and_run(tmp_path, "alloc_failures", [*CPU_DEVICE, "layers.c", "model.c", "resident.c", "shapes.c", "status.c"],
                  link_flags=["-Wl,--wrap=malloc,--wrap=calloc,--wrap=realloc,--wrap=aligned_alloc"])


def test_a_replica_group_whose_locks_cannot_be_made_is_a_runtime_error(tmp_path):
    """tests/c/sync_failures.c: with pthread_mutex_init and pthread_cond_init
    wrapped (ld --wrap), a replica group is made with each of its inits failing
    in turn: every one is DP_ERR_RUNTIME, with the locks it did make destroyed
    and nothing leaked; then a whole group runs its three threads."""
    build_and_run(tmp_path, "sync_failures", ["replica.c", "collective.c", *REGISTRY_CORE],
                  link_flags=["-Wl,--wrap=pthread_mutex_init,--wrap=pthread_cond_init,"
                              "--wrap=pthread_mutex_destroy,--wrap=pthread_cond_destroy", "-lpthread"])


# The sources that read DP_HAVE_MPI or include <mpi.h> (a test below checks that no other does):
# only they are compiled with MPI's flags, so the MPI program shares the other objects with the
# programs before it
MPI_SOURCES = ("comm.c", "dist.c", "dist_mpi.c")


def mpi_flags():
    """(-DDP_HAVE_MPI and Open MPI's compile flags, its link flags), from mpicc -showme."""
    mpicc = shutil.which("mpicc")
    if mpicc is None:
        pytest.fail("the MPI sanitizer tests need Open MPI's mpicc (scripts/bootstrap.sh installs it)")
    compile_flags, link_flags = (shlex.split(subprocess.run([mpicc, what], check=True, capture_output=True, text=True,
                                                            env=clean_env()).stdout)
                                 for what in ("-showme:compile", "-showme:link"))
    return ["-DDP_HAVE_MPI", *compile_flags], link_flags


def test_only_the_mpi_sources_see_mpi():
    """MPI_SOURCES are all the C files that read DP_HAVE_MPI or include mpi.h: the others' objects,
    compiled without MPI's flags, are the same in an MPI build."""
    seen = set()
    for folder in ("csrc", "kernels", os.path.join("tests", "c")):
        for name in os.listdir(os.path.join(ROOT, folder)):
            if name.endswith((".c", ".h", ".cu")):
                with open(os.path.join(ROOT, folder, name), encoding="utf-8") as f:
                    text = f.read()
                if "DP_HAVE_MPI" in text or re.search(r"#\s*include\s*<mpi\.h>", text):
                    seen.add(name)
    assert seen == set(MPI_SOURCES), seen


# Open MPI's own allocations that it never frees (LeakSanitizer reports them at
# exit); dpcore's are never suppressed: a leak in dpcore's code has no frame of
# these libraries on its allocation stack (dpcore calls MPI, MPI never calls
# back into dpcore). The stacks are complete only with
# fast_unwind_on_malloc=0 (below).
MPI_LSAN_SUPPRESSIONS = """\
# libmpi: what MPI_Init_thread sets up (operations, attributes, keyvals, the
# run-time and PMIx state it loads through orte_init) and what MPI_Finalize
# allocates on its way out, which Open MPI 4.1 never frees; and dist.c's two
# communicators of the job (MPI_Comm_idup in dp_dist_init), freed only by
# dp_dist_finalize, which refuses once the job is out of step: the test ends
# MPI itself. Every allocation made under an MPI_* call has a libmpi frame.
leak:libmpi.so
# libevent_core: PMIx's progress thread, started by Open MPI's pmix component
# (mca_pmix_ext3x.so and libpmix.so.2, unloaded at MPI_Finalize, so their
# frames have no name to suppress by); its allocations run under
# event_base_loop of libevent_core, which Open MPI links and keeps loaded.
leak:libevent_core
"""


def test_mpi_processes_are_clean_under_asan_ubsan(tmp_path):
    """tests/c/dist_mpi.c under `mpirun -np 3`, two CPU replicas per process:
    dp_dist_init agrees with MPI; allgather, broadcast and barrier move the
    right bytes; the chain all-reduce is bit for bit the left fold over the
    six replicas in global order (1, 17 and several segments' worth of
    floats, scaled by 1 and 1/6); mirrored training across the processes
    (per-replica and synchronized BatchNorm, buckets) matches one process with
    six replicas bit for bit, digests included; a rank late for a barrier is
    a DP_ERR_DIST naming it on the others within seconds, and the job still
    ends cleanly. No sanitizer report, no leak of dpcore's."""
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.fail("the MPI sanitizer test needs Open MPI's mpirun (scripts/bootstrap.sh installs it)")
    mpi_compile, mpi_link = mpi_flags()
    exe = compile_program(tmp_path, "dist_mpi", MIRRORED_CORE, ASAN_UBSAN, [*mpi_link, "-lpthread"],
                          {name: mpi_compile for name in MPI_SOURCES})
    suppressions = tmp_path / "lsan_open_mpi.supp"
    suppressions.write_text(MPI_LSAN_SUPPRESSIONS)
    # fast_unwind_on_malloc=0: Open MPI's libraries are built without frame
    # pointers, so the fast unwinder stops at their first frame and a leak of
    # theirs shows only an address in a component that MPI_Finalize has
    # unloaded, which no suppression can name. The slow (DWARF) unwinder
    # records the whole stack, down to the MPI_* call; nothing else changes.
    env = clean_env(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                    ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:halt_on_error=1:fast_unwind_on_malloc=0",
                    LSAN_OPTIONS=f"suppressions={suppressions}",
                    UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1", OMP_NUM_THREADS="2")
    proc = subprocess.run([mpirun, "-np", "3", "--oversubscribe", "--bind-to", "none", str(exe)], capture_output=True,
                          text=True, env=env, timeout=300)
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0, report
    assert proc.stdout.count("dist_mpi: ok") == 3, report
    assert "runtime error" not in report and "Sanitizer" not in report, report


# OMP_NUM_THREADS=1 (and one thread per CPU device in the programs): GCC's
# libgomp is not built with TSan, so the hand-offs inside a team of its threads
# (the barrier that ends a parallel region) are invisible to it and every
# parallel loop would be a reported race (with two threads per device it
# reports cpu_conv2d_forward's loop against the BatchNorm sums that follow it).
# dpcore's own threads and their synchronization are all seen; nothing is
# suppressed.
TSAN_ENV = {"TSAN_OPTIONS": "halt_on_error=1:second_deadlock_stack=1", "OMP_NUM_THREADS": "1"}


def run_tsan_clean(exe, program):
    proc = subprocess.run([str(exe)], capture_output=True, text=True, env=clean_env(**TSAN_ENV), timeout=300)
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0, report
    assert f"{program}: ok" in proc.stdout, report
    assert "ThreadSanitizer" not in report, report


# csrc/dist_nccl.c built as with CUDA and NCCL, against the fakes of tests/c/fake_cuda/ (first on the
# include path) that tests/c/p2p_order.c defines
FAKE_NCCL = ["-I", os.path.join(ROOT, "tests", "c", "fake_cuda"), "-DDP_HAVE_CUDA", "-DDP_HAVE_NCCL"]


def test_gpu_messages_keep_their_order_and_deadlines_on_the_cpu(tmp_path):
    """tests/c/p2p_order.c: the GPU messages' NCCL layer (csrc/dist_nccl.c) with CUDA and NCCL
    faked on the host: a pair's messages queued in ticket order whatever order their threads come
    in; NCCL's non-blocking contract kept; the lower rank's tickets; a turn that never comes, an
    asynchronous NCCL error and a message that never finishes each a DP_ERR_DIST with the
    communicator aborted; shutdown leaving nothing behind. The CPU twin of tests/test_p2p_gpu.py's
    two-GPU test."""
    build_and_run(tmp_path, "p2p_order", ["dist_nccl.c", "status.c"], ["-lpthread"], FAKE_NCCL)


def test_gpu_messages_are_race_free_under_tsan(tmp_path):
    """The same program under ThreadSanitizer: eight threads taking turns on one communicator."""
    exe = compile_program(tmp_path, "p2p_order", ["dist_nccl.c", "status.c"], ["-fsanitize=thread", *FAKE_NCCL],
                          ["-lpthread"])
    run_tsan_clean(exe, "p2p_order")


def test_the_mpi_library_version_is_filled_once_without_a_race(tmp_path):
    """tests/c/dist_version.c under ThreadSanitizer: eight threads ask for
    dp_dist_library_version at once (MPI_Get_library_version wrapped by the
    program, so that its writes are seen); one fill, one answer, no race."""
    mpi_compile, mpi_link = mpi_flags()
    exe = compile_program(tmp_path, "dist_version", ["dist.c", "dist_nccl.c", "status.c"], ["-fsanitize=thread"],
                          [*mpi_compile, *mpi_link, "-lpthread", "-Wl,--wrap=MPI_Get_library_version"])
    run_tsan_clean(exe, "dist_version")


@pytest.mark.alone  # its replica threads spin at barriers: beside another worker, 5x its time
def test_replica_threads_barriers_and_all_reduce_are_race_free_under_tsan(tmp_path):
    """tests/c/tsan_stress.c built with -fsanitize=thread: replica groups of 2
    to 8 threads through thousands of barriers (spinning and sleeping) and
    all-reduces of every chunk shape, each result checked against the
    rank-ordered fold; a replica failing at varying points while its peers
    wait in the barrier, the all-reduce or the comm's collective interface,
    the group reused after each; mirrored models made, trained and destroyed
    for 2, 3 and 4 replicas, two runners stepping at once from two threads;
    dp.all_reduce's kept groups from four threads at once, replaced while
    others run. No ThreadSanitizer report. Its `race` mode writes one plain
    int from two replica threads, which TSan must report: the check can fail."""
    exe = compile_program(tmp_path, "tsan_stress", MIRRORED_CORE, ["-fsanitize=thread"], ["-lpthread"])
    run_tsan_clean(exe, "tsan_stress")
    proc = subprocess.run([str(exe), "race"], capture_output=True, text=True, env=clean_env(**TSAN_ENV), timeout=60)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "WARNING: ThreadSanitizer: data race" in proc.stderr and "race_rank" in proc.stderr, proc.stderr


def test_device_registry_is_race_free_under_tsan(tmp_path):
    """tests/c/device_registry.c (four threads getting and putting devices and
    counting under a device's step lock, the registry reconfigured between)
    under ThreadSanitizer: no report."""
    exe = compile_program(tmp_path, "device_registry", REGISTRY_CORE, ["-fsanitize=thread"], ["-lpthread"])
    run_tsan_clean(exe, "device_registry")
