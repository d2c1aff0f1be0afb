# The two commands of the README, and the developer's helpers.
#   make train   set up (apt packages when root, .venv, pip install .) and train LeNet
#   make test    set up the same way and run the test suite
#   make train-resnet     the book's ResNet-18 (chapter 12.6) on every local device
#   make train-mpi NP=2   the main job in NP MPI processes
VENV ?= .venv
PY := $(VENV)/bin/python
NP ?= 2
export VENV
# Open MPI refuses to run as root without both (CI and these machines run as
# root); dpcore itself never sets them
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1

.PHONY: setup train train-resnet train-mpi two-process-split test test-cpu-only test-asan test-gpu gpu-day-prepare gpu-day gpu-day-rehearse bench bench-gpu clean

setup:
	scripts/bootstrap.sh

train: setup
	$(PY) examples/train_lenet.py

# The book's chapter 12.6: ResNet-18 on Fashion-MNIST (batch 256, lr 0.1, 10 epochs) on every
# local device; on a 2-core CPU an epoch takes 8-10 minutes (benchmarks/RESULTS.md)
train-resnet: setup
	$(PY) examples/train_resnet.py

# The PyTorch tutorial's two-layer network split over two processes with send / recv (issue 33)
two-process-split: setup
	mpirun -np 2 --oversubscribe --bind-to none $(PY) examples/two_process_split.py

# The same job in NP processes on this machine (make train-mpi NP=2): each process
# mirrors over its own devices; --bind-to none lets dpcore spread its threads over the cores
train-mpi: setup
	mpirun -np $(NP) --oversubscribe --bind-to none $(PY) examples/train_lenet.py

# The fuzzers run 10 s per harness here, 30 s in test-asan (the harnesses under the sanitizers,
# where a finding in the C loaders shows; test-cpu-only replays their corpus only);
# DPCORE_FUZZ_SECONDS set outside wins.
# TEST_WORKERS: the pytest-xdist workers of make test (0: none, the tests in pytest's process), a
# test file to a worker at a time, the long files first (tests/conftest.py). Most tests run in one
# thread, so two workers use a 2-core machine's second core (the suite less the two experiments:
# 662 s against 880-970 s in one process here). The minutes-long experiments (-m slow) and the
# tests that use every core (-m alone: builds, OpenMP training, threads spinning at barriers) run
# after, by themselves: beside another worker they took 2-5x their time.
TEST_WORKERS ?= 2
XDIST = -n $(1) --dist loadfile --no-loadscope-reorder
test: setup
	DPCORE_FUZZ_SECONDS=$${DPCORE_FUZZ_SECONDS:-10} $(PY) -m pytest -q -ra $(call XDIST,$(TEST_WORKERS)) \
	  -m "not slow and not alone" tests
	$(PY) -m pytest -q -ra -m "slow or alone" tests

# The same suite on a CPU-only build without MPI (DPCORE_CUDA=0 DPCORE_MPI=0), as on a machine
# without the CUDA toolkit and Open MPI: every process is a world of one. The build-independent
# tests are left to the plain run, and so are the ResNet-18 notebook (53 s: the training the
# short ResNet-18 tests run here) and the GPU benchmark's dry run on CPU devices (24 s: the
# benchmark script's code, as the other benchmark scripts' runs), and the timed fuzzing (the
# loaders' code is the same in every build: the plain run fuzzes it, the ASan run under the
# sanitizers; the committed corpus replays here).
test-cpu-only:
	DPCORE_CUDA=0 DPCORE_MPI=0 VENV=.venv-cpu scripts/bootstrap.sh
	.venv-cpu/bin/python -m pytest -q -ra $(call XDIST,$(TEST_WORKERS)) -m "not slow" $(BENCH_SCRIPT_DESELECT) \
	  $(BUILD_INDEPENDENT_DESELECT) $(CPU_ONLY_DESELECT) --deselect tests/test_fuzz.py::test_fuzz_for_a_bounded_time tests

# The whole suite under AddressSanitizer + UndefinedBehaviorSanitizer (LeakSanitizer in pytest's
# own processes): the extension built with DPCORE_SANITIZE=1 into .venv-asan (CPU-only, with MPI),
# pytest in a Python with GCC's sanitizer runtime preloaded; a report from any process of the run
# fails it (scripts/sanitized-pytest.sh: the options, and why). Every test file runs (but the two
# build-independent ones, BUILD_INDEPENDENT_DESELECT, which build their own sanitized programs), the
# multi-process ones (mpirun, dp.launch) included; mpirun itself runs without the runtime and
# hands it to its ranks (Open MPI's launcher has a use-after-free of its own). Left out: the two
# minutes-long experiments (-m "not slow": the book's LeNet for 10 epochs, ResNet-18 for 4
# epochs of 2,000 images), which run the training code the short training tests run, only longer, and would take
# 17 of this run's 25 minutes on 2 cores (make test runs them); and the three peak-RSS bounds of the
# loaders (ASAN_DESELECT): they measure a process's resident memory, which under ASan is its
# allocator's (freed blocks held in a 256 MB quarantine, redzones, shadow memory: 245 MB of growth
# for the 55 MB Fashion-MNIST load), while the loads themselves run under ASan in the other tests
# of those files. Also left out under ASan, to keep CI within its 45 minutes: the benchmark
# scripts' end-to-end runs (tests/test_benchmarks.py: Python driving the C calls the suite's own
# tests make; the plain run runs them, BENCH_SCRIPT_DESELECT), six of the eight ResNet-18 pipeline
# variants (the same stage code at other stage and micro-batch counts; the plain and CPU-only
# runs keep all eight, ASan keeps 1 micro-batch over 3 stages and 7 uneven ones over 2), the same
# for other counts of two more (synchronized BatchNorm over 2 replicas: 3 stay; LeNet in 2
# processes of 2 devices: 3 processes of 2 devices stay, chain and owner), and the
# ResNet-18 notebook (5.4 of the ASan run's 20 minutes on an AVX2-only Zen 3: the training code
# the short ResNet-18 tests run under ASan; the other notebooks run there, and the plain run
# runs it) and the GPU benchmark's dry run (CPU_ONLY_DESELECT), the main job's epoch of the real data under mpirun (55 s under ASan: the
# training the other multi-process tests run there on less data; the plain run runs it) and the
# checkpoint's SIGKILL loop (28 s: a killed process reports nothing; the plain and CPU-only runs).
# Skipped with the reason, as in any CPU build: the GPU tests (a sanitized build
# has no CUDA: ASan would see only the host side of nvcc's launchers) and the DPCORE_MPI=0 checks
# (make test-cpu-only runs those). tests/test_sanitizers.py, in every suite run, builds the C
# programs of tests/c with ASan/UBSan/LSan and tests/c/tsan_stress.c with ThreadSanitizer.
# The benchmark scripts' end-to-end runs (Python driving calls the suite's own tests make), and the
# Winograd tests' own subprocess on the BLAS's GEMM: the plain run keeps them, the CPU-only run (CI runs
# it with DPCORE_OWN_GEMM=0 already) and the ASan run leave them out, for CI's time.
BENCH_SCRIPT_DESELECT := \
  --deselect tests/test_benchmarks.py::test_thread_placement_benchmark_quick_run \
  --deselect tests/test_benchmarks.py::test_pipeline_benchmark_quick_run \
  --deselect tests/test_benchmarks.py::test_scaling_benchmark_quick_run \
  --deselect tests/test_benchmarks.py::test_layer_benchmark_quick_run \
  --deselect tests/test_benchmarks.py::test_book_resnet_quick_run \
  --deselect tests/test_winograd.py::test_benchmark_quick_run \
  --deselect tests/test_implicit_gemm.py::test_benchmark_quick_run \
  --deselect tests/test_winograd_lanes.py::test_benchmark_quick_run \
  --deselect tests/test_winograd_s2.py::test_benchmark_quick_run \
  --deselect tests/test_small_gemm.py::test_benchmark_quick_run \
  --deselect tests/test_winograd.py::test_on_the_blas_gemm
# Tests whose result does not depend on the extension build under test, which the plain run runs:
# tests/test_sanitizers.py (and six tests of tests/test_small_gemm.py) compile the C programs of tests/c
# from csrc/ with their own sanitizer flags,
# and test_core_compiles_warning_free compiles the core with -Werror in each configuration,
# tests/test_avx2_build.py builds the extension for an AVX2-only CPU and for generic x86-64 and runs the numeric tests on each; the same
# commands with the same sources would only repeat them in the ASan and CPU-only runs (2.5 minutes
# each).
BUILD_INDEPENDENT_DESELECT := \
  --deselect tests/test_sanitizers.py \
  --deselect tests/test_small_gemm.py::test_kernel_against_float64_under_the_sanitizers \
  --deselect tests/test_small_gemm.py::test_winograd_bits_do_not_depend_on_the_thread_count \
  --deselect tests/test_small_gemm.py::test_avx2_kernel_against_float64_under_the_sanitizers \
  --deselect tests/test_small_gemm.py::test_winograd_avx2_forms_bits_do_not_depend_on_the_thread_count \
  --deselect tests/test_small_gemm.py::test_stride2_winograd_bits_and_blocks \
  --deselect tests/test_small_gemm.py::test_stride2_winograd_avx2_forms \
  --deselect tests/test_cuda_build.py::test_core_compiles_warning_free \
  --deselect tests/test_avx2_build.py \
  --deselect tests/test_gpu_day.py
CPU_ONLY_DESELECT := \
  --deselect tests/test_benchmarks.py::test_gpu_benchmark_dry_run_on_cpu_devices \
  --deselect "tests/test_notebooks.py::test_notebook_runs_and_shows_the_book_line_the_bar_and_the_figures[chapter12_6_resnet18.ipynb]"
ASAN_DESELECT := $(BENCH_SCRIPT_DESELECT) $(BUILD_INDEPENDENT_DESELECT) $(CPU_ONLY_DESELECT) \
  --deselect "tests/test_pipeline.py::test_resnet_pipeline_gradient_is_the_sum_of_its_micro_batches[2-2]" \
  --deselect "tests/test_pipeline.py::test_resnet_pipeline_gradient_is_the_sum_of_its_micro_batches[2-3]" \
  --deselect "tests/test_pipeline.py::test_resnet_pipeline_gradient_is_the_sum_of_its_micro_batches[4-3]" \
  --deselect "tests/test_pipeline.py::test_resnet_pipeline_gradient_is_the_sum_of_its_micro_batches[7-3]" \
  --deselect "tests/test_pipeline.py::test_resnet_pipeline_gradient_is_the_sum_of_its_micro_batches[1-2]" \
  --deselect "tests/test_pipeline.py::test_resnet_pipeline_gradient_is_the_sum_of_its_micro_batches[4-2]" \
  --deselect "tests/test_resnet.py::test_resnet18_sync_batchnorm_equals_one_replica[2]" \
  --deselect "tests/test_distributed.py::test_lenet_bitwise_equal_to_one_process[2-2-64-chain]" \
  --deselect tests/test_distributed.py::test_the_main_job_runs_under_mpirun \
  --deselect tests/test_checkpoints.py::test_sigkill_during_save_leaves_the_old_file_or_a_new_one \
  --deselect tests/test_checkpoints.py::test_peak_memory_of_a_load_is_the_file_payload_plus_a_constant \
  --deselect tests/test_idx_hostile.py::test_bombs_stay_within_a_small_bounded_memory \
  --deselect tests/test_idx_hostile.py::test_real_fashion_mnist_loads_within_its_payload_plus_a_constant
# ASAN_WORKERS: the run's pytest-xdist workers (a test file to a worker at a time; each worker's
# leaks checked at its exit): the sanitized tests spend most of their time in one thread of one
# process, so two workers on two cores take 0.65x the time of one (709 s against 1088 s here).
ASAN_WORKERS ?= 2
test-asan:
	DPCORE_SANITIZE=1 DPCORE_CUDA=0 VENV=.venv-asan scripts/bootstrap.sh
	DPCORE_SANITIZED_WORKERS=$(ASAN_WORKERS) scripts/sanitized-pytest.sh .venv-asan -q -ra -m "not slow" $(ASAN_DESELECT) tests

# The GPU tests of every file. Refused, not skipped into green, when the build has no CUDA backend
# (no nvcc, cuDNN or cuBLAS found: setup.py then builds CPU-only) or no device is visible.
test-gpu: setup
	$(PY) -c "import dpcore, sys; b = dpcore.build_info(); r = dpcore._core.runtime_info(); \
	  why = None if b.get('cuda_backend') else 'dpcore was built without the CUDA backend: ' + str(b.get('cuda_why')); \
	  why = why or (None if r['cuda_device_count'] else 'no usable CUDA device: ' + r['cuda_why']); \
	  sys.exit('make test-gpu: ' + why if why else 0)"
	$(PY) -m pytest -m gpu tests -ra $(PYTEST_ARGS)

# The GPU day (docs/gpu-day.md): fetch the .debs a bare GPU machine lacks into .gpu/ (here), then on
# the GPU machine build, run the GPU tests by priority, the benchmark and memcheck in one command;
# gpu-day-rehearse runs it here in the GPU machine's layout, up to the first step that needs a device.
gpu-day-prepare:
	scripts/gpu-day-prepare.sh
gpu-day:
	scripts/gpu-day.sh
gpu-day-rehearse:
	scripts/gpu-day-rehearse.sh

# The GPU benchmark: LeNet epochs, ResNet-18 images/s, logical-GPU all-reduce; PyTorch beside when installed.
bench-gpu: setup
	$(PY) benchmarks/bench_gpu.py $(BENCH_ARGS)

bench: setup
	$(PY) benchmarks/bench_lenet_cpu.py

clean:
	rm -rf build $(VENV) .venv-cpu .venv-asan python/*.egg-info
