"""dp.ModelParallelStrategy over the ranks of an MPI job (issue 33): one slice of every layer
per rank ('rankQ/cpu:0'), launched with mpirun (tests/mpi_tensor_parallel.py is what each rank
runs). Held to the one-process strategy over as many logical CPU devices, computed in every
rank: the same slices with the same kernels and thread counts, the partial input gradients
summed in position order as dp.all_reduce sums them, so losses, weights and logits are
bitwise equal -- for LeNet and ResNet-18, over 2 and 3 ranks, with replicas=2 over 4 ranks
(also with a copy that gets no sample), and with the device list in another order (the GPU
twin: both ranks on GPU 0 against logical GPUs, skipped without a GPU). Also: a
checkpoint written by the job loads in one process with the same logits; a failure in one
rank's slice is that error on its rank and a DistributedError naming it on the others, the
step undone everywhere and the next step running; a rank that dies ends the job."""
import os
import re
import subprocess
import sys
import time

import pytest

from split_common import GPUS, NO_GPU
from test_distributed import mpi_env, mpi_required  # noqa: F401  (the fixture: MPI needed, or skipped in DPCORE_MPI=0 builds)

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mpi_tensor_parallel.py")


def run(cases, processes, *args, timeout=240):
    cmd = ["mpirun", "-np", str(processes), "--oversubscribe", "--bind-to", "none", sys.executable, SCRIPT,
           ",".join(cases)] + list(args)
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=mpi_env(), timeout=timeout)
    return proc, proc.stdout + proc.stderr, time.monotonic() - start


def equal_lines(text, names, processes):
    """Every rank's line for each compared case says equal, bitwise. mpirun may glue two
    ranks' lines: matched by pattern, not by line."""
    for name in names:
        for q in range(processes):
            pat = (rf"rank {q}: {re.escape(name)}: losses equal True, weights bitwise True, logits bitwise True, "
                   rf"devices \[")
            assert re.search(pat, text), f"rank {q}, {name}:\n{text}"


def test_two_ranks_equal_one_process_and_a_failure_is_everyones_error(tmp_path):
    proc, text, _ = run(["equal", "checkpoint", "failure"], 2, str(tmp_path))
    assert proc.returncode == 0, text
    equal_lines(text, ["lenet", "resnet", "reversed"], 2)
    assert "devices ['rank1/cpu:0', 'rank0/cpu:0']" in text, text
    assert re.search(r"rank 0: report fractions sum 1\.0000\d+ over 2 ranks", text), text
    # dp.train across the ranks: one History everywhere, the job's devices; rank 0's checkpoint
    for q in range(2):
        assert re.search(rf"rank {q}: history devices \['rank0/cpu:0', 'rank1/cpu:0'\] losses \[", text), text
    assert "rank 0: loaded in one process: logits bitwise True" in text, text
    assert "rank 1: RuntimeError: injected failure in this rank's slice" in text, text
    # rank 0 learns of it at its next exchange (the slices are gathered only where a layer needs them whole)
    assert re.search(r"rank 0: DistributedError: rank 1 of a ModelParallelStrategy model failed in layer 3's forward "
                     r"pass: RuntimeError: injected failure in this rank's slice \(this rank learned it in the gather "
                     r"of layer \d+'s slices", text), text
    for q in range(2):
        assert f"rank {q}: unchanged after the failed step True" in text, text
        assert f"rank {q}: the next step runs: loss finite True" in text, text


def test_three_ranks_equal_one_process():
    proc, text, _ = run(["equal"], 3)
    assert proc.returncode == 0, text
    equal_lines(text, ["lenet", "resnet", "reversed"], 3)


def test_two_copies_of_two_ranks_equal_one_process():
    proc, text, _ = run(["replicas"], 4)
    assert proc.returncode == 0, text
    equal_lines(text, ["lenet x2", "resnet x2", "one sample"], 4)
    for q in range(4):
        assert f"rank {q}: copies identical True" in text, text


def test_a_rank_that_dies_ends_the_job_within_a_minute():
    proc, text, seconds = run(["killed"], 2, timeout=120)
    assert proc.returncode != 0, text
    assert seconds < 60, (seconds, text)


@pytest.mark.gpu
@pytest.mark.skipif(GPUS == 0, reason=NO_GPU)
def test_two_ranks_on_one_gpu_equal_one_process_on_logical_gpus():
    """The GPU twin: 2 ranks whose slices share GPU 0 (the gathers go through host memory, so
    no NCCL is needed and the ranks may share a GPU) against one process over 2 logical GPUs
    of GPU 0: the same kernels on the same GPU, bitwise (cuDNN's deterministic algorithms,
    the default precision)."""
    proc, text, _ = run(["gpu"], 2)
    assert proc.returncode == 0, text
    equal_lines(text, ["lenet gpu", "resnet gpu"], 2)


@pytest.mark.gpu
@pytest.mark.skipif(GPUS == 0, reason=NO_GPU)
def test_two_copies_of_two_ranks_on_one_gpu_equal_one_process_on_logical_gpus():
    """The GPU twin of replicas=2 across processes: 4 ranks on GPU 0, each copy's gradients
    summed over the copies on the host in copy order and written back into GPU memory (0 + g),
    against one process over 4 logical GPUs of GPU 0: bitwise."""
    proc, text, _ = run(["gpu-replicas"], 4)
    assert proc.returncode == 0, text
    equal_lines(text, ["lenet gpu x2", "resnet gpu x2"], 4)
