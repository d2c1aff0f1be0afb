"""The GPU benchmark cannot run here, but its code can: --device cpu runs the
same dpcore calls on CPU devices (a few batches), so that the script works on
the day a GPU is lent (make bench-gpu)."""
import os
import re
import subprocess
import sys

import pytest

import dpcore as dp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_benchmark(script, *args, timeout=600):
    """benchmarks/<script> with args, run by this interpreter from the repository root: the finished
    process (stdout and stderr as text), asserted to have exited 0."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_gpu_benchmark_dry_run_on_cpu_devices():
    proc = run_benchmark("bench_gpu.py", "--device", "cpu", "--epochs", "1",
                         "--max-batches", "2", "--resnet-steps", "1", "--logical", "2")
    for line in ("dpcore LeNet epoch, cpu:0, resident", "dpcore LeNet epoch, cpu:0, host batches",
                 "dpcore ResNet-18 training, cpu:0", "dpcore LeNet epoch, 2 logical cpu devices (host all-reduce)",
                 "dpcore ResNet-18 training, 2 logical cpu devices",
                 "dpcore ResNet-18 training, pipeline of 2 stages, 1F1B, 4 micro-batches logical cpu devices",
                 "dpcore ResNet-18 training, layerwise split over 2 logical cpu devices"):
        assert line in proc.stdout, proc.stdout


def test_pipeline_benchmark_quick_run():
    """bench_pipeline.py end to end on a few LeNet batches: every configuration's row, nothing written."""
    proc = run_benchmark("bench_pipeline.py", "--steps", "2", "--rounds", "1",
                         "--resnet-steps", "0", "--micro-batches", "1,2")
    for line in ("| LeNet | one device, 2 cores |", "| LeNet | 2 replicas (MirroredStrategy) |", "| 1f1b | 2 |",
                 "| gpipe | 1 |", "Layerwise split"):
        assert line in proc.stdout, proc.stdout


def test_layer_benchmark_quick_run():
    """bench_layers.py on a small LeNet batch: a row per layer with its floor where it multiplies."""
    proc = run_benchmark("bench_layers.py", "--rounds", "1", "--lenet-batch", "8", "--resnet-batch", "0", "--no-torch")
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [r.split(" | ")[1] for r in rows] == [kind for kind, *_ in dp.models.LeNet()._model.layers()]
    assert all(r.endswith("x |") for r in rows if " conv2d " in r or " dense " in r)
    assert "step / floor" in proc.stdout and "GFLOP/s" in proc.stdout


def test_thread_placement_benchmark_quick_run():
    """bench_threads.py end to end, from fresh subprocesses: the default's row and the pinned one's
    (the OpenMP rows differ only in the environment the same code runs under)."""
    proc = run_benchmark("bench_threads.py", "--steps", "1", "--rounds", "1", "--configs", "1,2")
    assert "| default" in proc.stdout and "| DPCORE_PIN_THREADS=1" in proc.stdout, proc.stdout
    assert "OMP_WAIT_POLICY" not in proc.stdout


def test_gpu_benchmark_without_a_gpu_says_why():
    if dp._core.runtime_info()["cuda_device_count"] > 0 and dp.build_info().get("cuda_backend"):
        pytest.skip("a GPU is present: the benchmark measures (make bench-gpu)")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_gpu.py")], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2
    assert "nothing to measure" in proc.stderr


def test_mpi_benchmark_quick_smoke():
    """bench_mpi.py --quick: the MPI all-reduce and LeNet comparisons run end to end (2 sizes, 1 round)."""
    import shutil
    if not dp.build_info().get("mpi_linked") or shutil.which("mpirun") is None:
        pytest.skip("dpcore built without MPI or mpirun missing: bench_mpi.py has nothing to measure")
    proc = run_benchmark("bench_mpi.py", "--quick", timeout=300)
    for line in ("(1) all-reduce, 2 ranks", "| 1 MiB |", "(2) LeNet throughput", "| 2p x 1r | 2 x 1 x ",
                 "2 processes x 1 replica / 1 process x 2 replicas:",
                 "the ranks' parameter digests agree after every run: True; parameters finite: True"):
        assert line in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("model", ["lenet", "resnet18"])
def test_scaling_benchmark_quick_run(model):
    """bench_scaling.py part (a) end to end on small synthetic batches: every configuration's row with
    its floor (the network's counted FLOPs at the SGEMM rate of the run's own threads) and time / floor."""
    proc = run_benchmark("bench_scaling.py", "--quick", "--part", "a",
                         "--model", model, "--batch", "4", "--data", "synthetic", "--steps", "3", "--warmup", "1")
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in proc.stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| configuration")}
    assert set(rows) == {"1rep-1core", "2rep", "1rep-2core", "2procs-1core"}, proc.stdout
    for name, cells in rows.items():
        floor_ips, gflops = cells[5].rstrip(")").split(" (")
        assert float(floor_ips) > 0 and float(gflops) > 0, cells
        assert cells[6].endswith("x") and float(cells[6][:-1]) > 0, cells


def test_book_resnet_quick_run():
    """benchmarks/book_resnet.py (the GPU day's book experiment) on 64 images for one epoch, on the
    CPU, both of dpcore's inits: each run's epoch line and the table's rows."""
    proc = run_benchmark("book_resnet.py", "--device", "cpu", "--epochs", "1", "--subset", "64",
                         "--test-subset", "32", "--batch-size", "16", "--lr", "0.05", "--seeds", "0", "1",
                         "--runs", "dpcore:d2l:float32,dpcore:torch:fast")
    for line in ("dpcore:d2l:float32 seed 0 epoch 1: test acc", "dpcore:torch:fast seed 1 epoch 1: test acc",
                 "| dpcore:d2l:float32 | 0 |", "| dpcore:torch:fast | 1 |", "batch 16, lr 0.05",
                 "the first 64 training images, the first 32 test images"):
        assert line in proc.stdout, proc.stdout
    # the summary over the seeds: each run's mean, sd, min and mean - 4 sd of its last epoch
    rows = re.findall(r"\| (dpcore:\S+) \| 2 \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| (-?[\d.]+) \|", proc.stdout)
    assert [r[0] for r in rows] == ["dpcore:d2l:float32", "dpcore:torch:fast"], proc.stdout
    for _, mean, sd, low, bound in rows:
        assert float(low) <= float(mean) and abs(float(mean) - 4 * float(sd) - float(bound)) < 2e-4, proc.stdout
