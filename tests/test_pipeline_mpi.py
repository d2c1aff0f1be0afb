"""PipelineStrategy across the processes of an MPI job (dpcore.pipeline_mpi, issue 33):
pytest runs mpirun (tests/mpi_pipeline.py is what each process runs; --oversubscribe,
--bind-to none on this 2-core machine).

No tolerance: the job runs the stages the one-process PipelineStrategy runs, with the
same kernels and the same sums in the same order (micro-batches in the schedule's
order, the copies' gradients ((g0 + g1) + ...) in float32), so its weights, running
statistics, momentum and losses must be the one-process pipeline's bit for bit, on
every rank. The reference is computed in rank 0 on logical CPU devices with the job's
split. Every launch prints lines that mpirun forwards into one pipe, where two lines
can meet without a newline: they are found by pattern, never by splitting lines.
"""
import os
import re
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest

import dpcore as dp
from dpcore import pipeline_mpi
from split_common import GPUS, NO_GPU
from test_distributed import mpi_env, mpi_required  # noqa: F401  (the fixture: MPI needed, or skipped in DPCORE_MPI=0 builds)

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mpi_pipeline.py")


def run(case, processes, *args, timeout=180):
    """(completed process, its output, wall seconds) of `case` on `processes` ranks."""
    cmd = ["mpirun", "-np", str(processes), "--oversubscribe", "--bind-to", "none", sys.executable, SCRIPT, case,
           *args]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=mpi_env(), timeout=timeout)
    return proc, proc.stdout + proc.stderr, time.monotonic() - start


def same_on_every_rank(text, what, ranks):
    """The CRC-32 every rank printed after `what` (e.g. 'lenet-1f1b digest'): one value, from each rank."""
    found = dict(re.findall(rf"rank (\d+): {re.escape(what)} ([0-9a-f]{{8}})", text))
    assert sorted(found) == [str(r) for r in range(ranks)], text
    assert len(set(found.values())) == 1, (what, found)
    return found["0"]


def equals_one_process(text, names, ranks):
    for name in names:
        same_on_every_rank(text, f"{name} digest", ranks)
        for r in range(ranks):
            assert f"rank {r}: {name} identical copies True" in text, text
        assert re.search(rf"rank 0: {name} split \[[0-9, ]+\] equal True", text), text


def test_two_process_pipelines_equal_one_process_and_train(tmp_path):
    """2 stages on 2 ranks, LeNet and ResNet-18, both schedules (LeNet 1f1b split by
    rank 0's measurement), and 3 stages on 2 ranks (rank 0 holds the first and the
    last), 2 steps: the one-process pipeline's bits. Then dp.train with
    a checkpoint: every rank's History, predictions, evaluation and report are the
    same; the file (written by rank 0) holds the whole network and loads in one process,
    and a run resumed from an epoch's checkpoint ends with the straight run's bits. A NaN
    weight stops every rank at the same step; check_numerics names its layer."""
    proc, text, _ = run("two", 2, str(tmp_path))
    assert proc.returncode == 0, text
    equals_one_process(text, ["lenet-1f1b", "lenet-gpipe", "lenet-interleaved", "resnet-1f1b", "resnet-gpipe"], 2)
    histories = re.findall(r"rank (\d): history (\[[^]]*\] \[[^]]*\] \[[^]]*\] \[[^]]*\])", text)
    assert len(histories) == 2 and histories[0][1] == histories[1][1], text
    assert histories[0][1].endswith("['rank0/cpu:0', 'rank1/cpu:0']"), histories
    same_on_every_rank(text, "predict", 2)
    assert re.search(r"rank 1: predict [0-9a-f]{8} \(60, 10\) evaluate Metrics\(loss=[0-9.]+, accuracy=", text), text
    for r in range(2):
        # 2 epochs of 3 steps; the last step's 2 micro-batches, F and B, on 2 stages
        assert (f"rank {r}: report steps 6 stages 2 busy True ops 8 devices [['rank0/cpu:0', 'rank1/cpu:0']]"
                in text), text
    for r in range(2):
        assert f"rank {r}: resumed equal True" in text, text
    for r in range(2):
        assert re.search(rf"rank {r}: FloatingPointError training stopped at epoch 1, step 1: .*check_numerics: the "
                         r"input batch is finite; the first non-finite values: layer 7 \(dense\)'s output", text), text
    m = re.search(r"rank 0: checkpoint weights True predictions differ by (\S+) argmax True accuracy True", text)
    assert m and float(m.group(1)) <= 1e-5, text


def test_three_process_pipelines_equal_one_process():
    proc, text, _ = run("three", 3)
    assert proc.returncode == 0, text
    equals_one_process(text, ["lenet-gpipe", "resnet-1f1b"], 3)


def test_two_pipelines_of_two_processes_equal_one_process():
    """replicas=2 on 4 ranks (stage s of copy r on rank 2r + s): each stage's gradients
    summed over its copies and ResNet's running statistics averaged, as the
    one-process replicas=2 does; the copies stay identical."""
    proc, text, _ = run("replicated", 4)
    assert proc.returncode == 0, text
    equals_one_process(text, ["lenet-1f1b", "resnet-gpipe"], 4)


def test_a_failing_stage_is_named_on_its_peer_within_the_timeout():
    """A device only rank 1 lacks: a ValueError naming rank 1 on both ranks. Rank 1
    passes another batch to a step, and to predict: a DistributedError on both ranks,
    before any stage runs. Then rank 1's stage raises in the middle of a step (timeout=5): rank 1 raises its
    error at once; rank 0, waiting for that stage's gradient, raises DistributedError
    naming rank 1 and the stage after 5 s, not a hang."""
    proc, text, seconds = run("raise", 2, timeout=120)
    for r in range(2):  # a device rank 1 does not have: refused on both ranks at once
        assert f"rank {r}: ValueError PipelineStrategy: rank 1: unknown device 'cpu:5'" in text, text
    for r in range(2):  # then a batch that differs on rank 1: refused everywhere, and the job goes on
        assert (f"rank {r}: DistributedError the processes step on different batches: rank 1 has 39 samples" in text
                and "every process must pass the same batches" in text), text
        assert f"rank {r}: DistributedError the processes predict on different batches: rank 1 has 5 samples" in text
    assert re.search(r"rank 1: RuntimeError after \d+ s: injected failure in stage 1 on rank 1", text), text
    # 5 s, or a little more on a loaded machine (the wait polls)
    assert re.search(r"rank 0: DistributedError after \d+ s: rank 0 gave up after [5-9] s waiting for rank 1 in "
                     r"pipeline stage 0 on rank 0: the gradient of micro-batch \d+ from stage 1 on rank 1", text), text
    assert proc.returncode != 0  # the job is out of step: rank 0 aborts it at exit
    assert seconds < 45, seconds


def test_a_killed_rank_ends_the_job():
    """Rank 1 dies (os._exit) in the middle of a step while rank 0 waits for it with the
    default 60 s deadline: mpirun ends the job well before it."""
    proc, text, seconds = run("kill", 2, timeout=120)
    assert proc.returncode != 0 and "no error" not in text, text
    assert seconds < 60, seconds


# ---- in one process: stages named with their rank, and the checks --------------------

@pytest.fixture
def four_cpus():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # more logical devices than cores
        dp.set_logical_devices("cpu", 4)
    yield
    dp.set_logical_devices("cpu", 1)


def _trained(devices, X, y, **kw):
    with dp.PipelineStrategy(devices=devices, micro_batches=3, split=[0, 6], **kw).scope():
        net = dp.models.LeNet()
    losses = [net.train_step(X, y, lr=0.1, momentum=0.9) for _ in range(2)]
    return net, losses


@pytest.mark.any_build
def test_stages_named_with_their_rank_in_one_process(four_cpus):
    """'rank0/cpu:0', ... in a world of one: the cross-process pipeline with every
    stage in this process (mailboxes between them), bitwise the one-process pipeline,
    one copy or two."""
    rng = np.random.default_rng(0)
    X, y = rng.random((30, 1, 28, 28), dtype=np.float32), rng.integers(0, 10, 30)
    for devices in (["cpu:0", "cpu:1"], ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]):
        replicas = len(devices) // 2
        ref, ref_losses = _trained(devices, X, y, replicas=replicas)
        net, losses = _trained([f"rank0/{d}" for d in devices], X, y, replicas=replicas)
        assert type(net._pipeline).__name__ == "ProcessPipeline" and net.devices == [f"rank0/{d}" for d in devices]
        assert losses == ref_losses
        for get in ("get_params", "get_state", "get_velocity"):
            assert np.array_equal(getattr(net._pipeline, get)().view(np.uint32),
                                  getattr(ref._pipeline, get)().view(np.uint32)), get
        assert np.array_equal(net.predict(X), ref.predict(X))
        assert net._pipeline.replicas_identical()


@pytest.mark.any_build
@pytest.mark.parametrize("devices, match", [
    (["rank0/cpu:0", "cpu:1"], "every device names its rank, as 'rank1/cpu:0'; got 'cpu:1'"),
    (["rank0/cpu:0", "rank1/cpu:0"], "'rank1/cpu:0' names rank 1, but this job has 1 process"),
    (["rank0/cpu:0", "rank0/cpu:0"], "must name each device once"),
    (["rank0/cpu:0", "rank0/cpu:9"], "unknown device 'cpu:9'"),
])
def test_bad_devices_across_processes(four_cpus, devices, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        dp.PipelineStrategy(devices=devices)


@pytest.mark.any_build
def test_strategy_across_processes_checks_its_arguments(four_cpus):
    with pytest.raises(ValueError, match="replicas=3 must divide the job's 4 devices"):
        dp.PipelineStrategy(devices=[f"rank0/cpu:{i}" for i in range(4)], replicas=3)
    with pytest.raises(ValueError, match="timeout"):
        dp.PipelineStrategy(devices=["rank0/cpu:0", "rank0/cpu:1"], timeout=0)
    s = dp.PipelineStrategy(devices=["rank0/cpu:0", "rank0/cpu:1"], timeout=5)
    assert s.across_ranks and s.num_stages == 2 and s.devices == ["rank0/cpu:0", "rank0/cpu:1"]
    assert "timeout=5" in repr(s)
    # outside mpirun, no devices: this process's devices, as before
    assert not dp.PipelineStrategy().across_ranks


def test_the_guides_multi_process_example_runs_under_mpirun(tmp_path):
    """docs/model-parallel.md's pipeline job (tests/test_docs.py runs it in one process):
    under mpirun -np 2 its stages are on ranks 0 and 1, and the file rank 0 wrote
    holds the whole network."""
    guide = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "model-parallel.md")
    blocks = [b for b in re.findall(r"```python\n(.*?)```", open(guide, encoding="utf-8").read(), re.S)
              if "mpirun -np 2 python pipeline_job.py" in b]
    assert len(blocks) == 1, blocks
    script = tmp_path / "pipeline_job.py"
    script.write_text(blocks[0])
    cmd = ["mpirun", "-np", "2", "--oversubscribe", "--bind-to", "none", sys.executable, str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=mpi_env(), timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "8 ['rank0/cpu:0', 'rank1/cpu:0']" in proc.stdout, proc.stdout


@pytest.mark.gpu
@pytest.mark.skipif(GPUS == 0, reason=NO_GPU)
def test_two_ranks_on_one_gpu_equal_one_process_on_logical_gpus():
    """The GPU twin: a 2-stage pipeline whose ranks share GPU 0 (activations and gradients
    through host memory, so no NCCL and no second GPU are needed), LeNet 1F1B and ResNet-18
    GPipe, against one process over 2 logical GPUs of GPU 0: the one-process bits."""
    proc, text, _ = run("gpu", 2)
    assert proc.returncode == 0, text
    equals_one_process(text, ["lenet-gpu", "resnet-gpu"], 2)
    for name in ("lenet-gpu", "resnet-gpu"):  # one physical GPU: NCCL would refuse, so host arrays
        assert f"rank 0: {name} by nccl [((0, 0), False)]" in text, text


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 GPUs ({GPUS} here): NCCL refuses two ranks on one GPU, and between "
                    "two GPUs a pipeline's activations and gradients go by NCCL")
def test_two_ranks_on_two_gpus_pass_gpu_tensors_by_nccl():
    """The NCCL twin: stage 0 on rank 0's GPU 0, stage 1 on rank 1's GPU 1, activations and
    gradients GPU to GPU by NCCL (no host copy), LeNet 1F1B and ResNet-18 GPipe, against one
    process over logical GPUs of GPU 0: the one-process bits (the messages move bytes
    exactly; the GPUs are of one model)."""
    proc, text, _ = run("2gpu", 2)
    assert proc.returncode == 0, text
    equals_one_process(text, ["lenet-2gpu", "resnet-2gpu"], 2)
    for name in ("lenet-2gpu", "resnet-2gpu"):
        for r in range(2):
            assert f"rank {r}: {name} by nccl [((0, 0), True)]" in text, text


def test_stage_boundaries_take_nccl_only_between_two_physical_gpus():
    """The CPU twin of the choice both ranks make from gathered facts: NCCL only where
    two ranks hold the two stages on two different physical GPUs, both known."""
    owner = [[0, 1, 1, 2], [3, 3, 4, 5]]
    uids = {(0, 0): 11, (0, 1): 22, (0, 2): 22, (0, 3): 22,  # pipeline 0: GPUs 11, 22, 22, 22
            (1, 0): 33, (1, 1): 44, (1, 3): 0}               # pipeline 1: stage 2 on a CPU, stage 3 unknown
    got = pipeline_mpi.nccl_boundaries(owner, uids)
    assert got == {(0, 0): True,    # ranks 0 and 1, GPUs 11 and 22
                   (0, 1): False,   # one rank
                   (0, 2): False,   # ranks 1 and 2 share GPU 22: NCCL refuses one GPU for two ranks
                   (1, 0): False,   # one rank (3)
                   (1, 1): False,   # to a CPU stage
                   (1, 2): False}   # from a CPU stage to an unknown GPU
    assert pipeline_mpi.nccl_boundaries([[0, 1]], {}) == {(0, 0): False}
    # here (no GPU, or no NCCL) no GPU is known: every boundary goes through the host
    assert dp._core.dist_gpu_uid(0) == 0 or GPUS > 0
    with pytest.raises(ValueError, match="gpu must be >= 0"):
        dp._core.dist_gpu_uid(-1)
    assert dp._core.dist_library()["nccl_p2p"] == bool(dp.build_info()["nccl_linked"])
