"""Multi-process data parallelism on MPI (csrc/dist.c, the mpi all-reduce of
csrc/comm.c, MultiWorkerMirroredStrategy, dp.distributed, dp.launch).

pytest runs mpirun itself (tests/mpi_scenarios.py is what each process runs),
with --oversubscribe (3 processes x 2 replicas on this 2-core machine) and
--bind-to none. No tolerance is involved anywhere: across processes the
reduction is rank-ordered, so P processes x L replicas must give bitwise the
digests, weights, losses and evaluation of one process with P x L replicas,
after every step; a digest (FNV-1a of the parameter and statistics bits) that
differs in one bit fails.

The failure tests each run under a hard timeout of their own and assert that
the survivors end within 60 s with a message naming the lost rank.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

import dpcore as dp

HERE = os.path.dirname(os.path.abspath(__file__))
SCENARIOS = os.path.join(HERE, "mpi_scenarios.py")
BUILT = dp.build_info().get("mpi_linked", False)

DISABLED = "DPCORE_MPI=0" in str(dp.build_info().get("mpi_why"))


@pytest.fixture(autouse=True)
def mpi_required(request):
    """Every test here needs MPI and mpirun, except those marked no_mpi_build:
    skipped (with the reason) in a build made with DPCORE_MPI=0 on purpose, a
    failure in a build that should have found MPI (the set-up is broken)."""
    if "any_build" in request.keywords:
        return
    if "no_mpi_build" in request.keywords:
        if not DISABLED:
            pytest.skip("for a build made with DPCORE_MPI=0 (make test-cpu-only); this one has MPI")
        return
    if DISABLED:
        pytest.skip("built with DPCORE_MPI=0: no multi-process training in this build")
    if not BUILT or shutil.which("mpirun") is None:
        pytest.fail("dpcore was built without MPI or mpirun is missing (scripts/bootstrap.sh installs Open MPI): "
                    + str(dp.build_info().get("mpi_why")))


def mpi_env():
    # Open MPI refuses root without both; the tests run as root in CI
    return dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONUNBUFFERED="1")


def mpirun(np_, args, timeout=180, env=None):
    cmd = ["mpirun", "-np", str(np_), "--oversubscribe", "--bind-to", "none", sys.executable, SCENARIOS] + args
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(mpi_env(), **(env or {})), timeout=timeout)
    return proc, time.monotonic() - start


def single(args, timeout=180):
    proc = subprocess.run([sys.executable, SCENARIOS] + args, capture_output=True, text=True, env=mpi_env(),
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def results(out, ranks):
    return [dict(np.load(os.path.join(out, f"rank{r}.npz"))) for r in range(ranks)]


def run_pair(tmp_path, processes, local, extra, env=None):
    """The job (processes x local replicas) and its one-process reference
    (processes * local replicas); returns (job results per rank, reference)."""
    job, ref = tmp_path / "job", tmp_path / "ref"
    job.mkdir()
    ref.mkdir()
    proc, _ = mpirun(processes, ["train", str(job), "--local", str(local)] + extra, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    single(["train", str(ref), "--local", str(processes * local)] + extra)
    return results(job, processes), results(ref, 1)[0]


def assert_same_bits(job, ref):
    for r, res in enumerate(job):
        assert res["digests"].tolist() == ref["digests"].tolist(), f"rank {r}: digests differ from one process's"
        assert np.array_equal(res["weights"].view(np.uint32), ref["weights"].view(np.uint32)), f"rank {r}"
        assert np.array_equal(res["losses"], ref["losses"]), f"rank {r}: step losses"
        assert np.array_equal(res["correct"], ref["correct"]), f"rank {r}"
        for key in ("eval", "history", "digest_after_fit"):
            if key in ref:
                assert np.array_equal(res[key], ref[key]), f"rank {r}: {key}"
    if "history" in ref:
        # every rank's History is the same, the time and the devices included
        for key in ("history_devices", "epoch_seconds"):
            assert all(np.array_equal(res[key], job[0][key]) for res in job), key


@pytest.mark.parametrize("processes,local,batch,form", [(2, 1, 64, "chain"), (2, 2, 64, "chain"),
                                                        (3, 2, 257, "chain"), (3, 2, 257, "owner")])
def test_lenet_bitwise_equal_to_one_process(tmp_path, processes, local, batch, form):
    """Digests after every step, final weights, step losses and hits, the
    evaluation of 10,000 samples (each counted once) and a dp.train epoch's
    History equal one process with processes x local replicas, bit for bit, on
    every rank. 3 x 2 with batch 257: shards of 43 and 42 over six replicas,
    and a last batch of 100 samples; there also with the owner-computes all-reduce
    across the processes (DPCORE_DIST_ALLREDUCE=owner), whose additions are the chain's."""
    samples = 2 * batch + 100
    job, ref = run_pair(tmp_path, processes, local, ["--batch", str(batch), "--samples", str(samples),
                                                      "--eval", "10000", "--fit", "--bucket-mb", "0.5"],
                        env={"DPCORE_DIST_ALLREDUCE": form})
    steps = -(-samples // batch)  # the last batch holds the remainder
    assert len(ref["digests"]) == steps + 1  # the initial parameters and every step's
    assert len(set(ref["digests"].tolist())) == steps + 1  # every step changed the weights
    assert_same_bits(job, ref)
    assert job[0]["eval"][2] == 10000
    placement = [json.loads(str(r["placement"])) for r in job]
    assert [p["first"] for p in placement] == [local * q for q in range(processes)]
    assert all(p["total"] == processes * local for p in placement)


def test_profiled_and_resumed_training_across_processes(tmp_path):
    """2 processes x 2 replicas: dp.train(profile=True) records each process's
    replicas under its rank; a run checkpointed after epoch 1 (rank 0 writes)
    and resumed from zeroed weights ends with the straight run's bits on every
    rank."""
    proc, _ = mpirun(2, ["resume", str(tmp_path), "--local", "2", "--samples", "256", "--batch", "64"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ranks = results(tmp_path, 2)
    for r, res in enumerate(ranks):
        assert int(res["straight"]) == int(res["resumed"]) == int(ranks[0]["straight"]), f"rank {r}"
        assert np.array_equal(res["losses"][0], res["losses"][1]), f"rank {r}: the History"
        assert int(res["timeline_rank"]) == r and res["timeline_replicas"].tolist() == [0, 1]
        assert res["timeline_phases"].tolist() == list(range(7)), res["timeline_phases"]


def test_resident_datasets_bitwise_equal_to_one_process(tmp_path):
    """dp.train(resident=True): every process holds the dataset on its devices
    and a step moves rows; the same bits as one process's resident run."""
    job, ref = run_pair(tmp_path, 2, 1, ["--batch", "50", "--samples", "120", "--fit", "--resident"])
    assert_same_bits(job, ref)


def test_resnet18_sync_batchnorm_bitwise_equal_to_one_process(tmp_path):
    """ResNet-18 with synchronized BatchNorm (statistics all-reduced across the
    processes), 2 processes x 2 replicas against 1 x 4: the same bits after
    each of two steps, running statistics included (in the digests)."""
    job, ref = run_pair(tmp_path, 2, 2, ["--model", "resnet", "--sync-bn", "--batch", "12", "--samples", "24",
                                          "--bucket-mb", "8"])
    assert_same_bits(job, ref)


def test_resnet18_per_replica_batchnorm_bitwise_equal_to_one_process(tmp_path):
    """Per-replica BatchNorm: the running statistics averaged over the job's
    replicas that had samples (an uneven batch of 10 over 4 replicas)."""
    job, ref = run_pair(tmp_path, 2, 1, ["--model", "resnet", "--batch", "10", "--samples", "10"])
    assert_same_bits(job, ref)


def on_two_hosts(tmp_path, args, timeout=180, env=()):
    """mpirun -np 2 of `python args...` on two simulated Open MPI nodes: a hostfile names this
    host and 'nodeb'; mpirun's remote launcher (plm_rsh_agent, ssh on a real cluster) is a
    script that starts the command here in a UTS namespace whose host name is the node's, and
    the processes talk over TCP only (btl tcp,self), as across hosts."""
    if subprocess.run(["unshare", "--uts", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs `unshare --uts` (root or CAP_SYS_ADMIN) to give the second node its own host name")
    agent = tmp_path / "fake_ssh"
    agent.write_text('#!/bin/sh\n# "ssh HOST CMD...": CMD here, in a UTS namespace named HOST\n'
                     'host=$1; shift\nexec unshare --uts sh -c "hostname $host; exec $*"\n')
    agent.chmod(0o755)
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost slots=1\nnodeb slots=1\n")
    cmd = ["mpirun", "-np", "2", "--hostfile", str(hosts), "--mca", "plm_rsh_agent", str(agent), "--mca", "btl",
           "tcp,self", "--bind-to", "none"] + [a for kv in env for a in ("-x", kv)] + [sys.executable] + \
        [str(a) for a in args]
    return subprocess.run(cmd, capture_output=True, text=True, env=mpi_env(), timeout=timeout)


def test_model_parallel_strategies_on_two_simulated_hosts(tmp_path):
    """A 2-stage pipeline (LeNet, GPipe; ResNet-18, 1F1B) and a layerwise split (LeNet, ResNet-18),
    one part per host, over TCP: the one-process strategy's bits (tests/test_pipeline_mpi.py and
    tests/test_tensor_parallel_mpi.py run the same cases on one host). One thread per part in
    the job and in the reference alike: alone on its host a rank would take both cores, and a
    convolution's weight gradient is summed per thread."""
    from test_pipeline_mpi import SCRIPT as PIPELINE, equals_one_process
    from test_tensor_parallel_mpi import SCRIPT as LAYERWISE, equal_lines

    threads = ["DPCORE_TEST_THREADS=1"]
    proc = on_two_hosts(tmp_path, [PIPELINE, "hosts"], env=threads)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    equals_one_process(proc.stdout + proc.stderr, ["lenet-gpipe", "resnet-1f1b"], 2)
    proc = on_two_hosts(tmp_path, [LAYERWISE, "equal"], env=threads)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    equal_lines(proc.stdout + proc.stderr, ["lenet", "resnet", "reversed"], 2)


def test_two_hosts_simulated_on_this_machine(tmp_path):
    """Two Open MPI nodes on one machine: a hostfile names this host and
    'nodeb'; mpirun's remote launcher (plm_rsh_agent, ssh on a real cluster)
    is a script that starts the command here in a UTS namespace whose host
    name is the node's, and the processes talk over TCP only (btl tcp,self),
    as across hosts. Each process is then alone on its "host" (local_rank 0 of
    1), and 2 hosts x 2 replicas train bitwise as one process with 4."""
    job, ref = tmp_path / "job", tmp_path / "ref"
    job.mkdir()
    ref.mkdir()
    extra = ["--local", "2", "--batch", "64", "--samples", "228", "--eval", "1000"]
    proc = on_two_hosts(tmp_path, [SCENARIOS, "train", str(job)] + extra)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    single(["train", str(ref), "--local", "4"] + extra[2:])
    out = results(job, 2)
    assert_same_bits(out, results(ref, 1)[0])
    assert [json.loads(str(r["placement"]))["first"] for r in out] == [0, 2]
    assert [json.loads(str(r["where"])) for r in out] == [[0, 1], [0, 1]]  # each alone on its host


def test_only_rank_0_prints_and_writes_a_checkpoint_one_process_loads(tmp_path):
    """dp.train's lines come from rank 0 alone; net.save by 2 processes writes
    one file (rank 0's), which a single process loads with every process's
    weights and trains on."""
    out, ckpt = tmp_path / "job", tmp_path / "net.safetensors"
    out.mkdir()
    proc, _ = mpirun(2, ["train", str(out), "--fit", "--save", str(ckpt)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("epoch 1/1") == 1, proc.stdout
    assert "on ['rank0/cpu:0', 'rank1/cpu:0']" in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job", "net.safetensors"]  # no temp file left
    loaded = dp.models.load(ckpt)
    flat = np.concatenate([v.ravel() for v in loaded.get_weights().values()])
    for res in results(out, 2):
        assert np.array_equal(flat.view(np.uint32), res["weights"].view(np.uint32))
    X = np.zeros((8, 1, 28, 28), np.float32)
    loss, _ = loaded.train_step(X, np.arange(8) % 10, lr=0.1)
    assert np.isfinite(loss)


def test_the_main_job_runs_under_mpirun():
    """`make train-mpi`'s command for one epoch: examples/train_lenet.py on the
    real Fashion-MNIST in 2 processes, one line per epoch and the book's
    closing line, printed once."""
    script = os.path.join(os.path.dirname(HERE), "examples", "train_lenet.py")
    cmd = ["mpirun", "-np", "2", "--oversubscribe", "--bind-to", "none", sys.executable, script, "--epochs", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=mpi_env(), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("epoch 1/1: loss") == 1, proc.stdout
    assert "2 replica(s) in 2 process(es)" in proc.stdout
    assert proc.stdout.count("test acc:") == 1 and "on ['rank0/cpu:0', 'rank1/cpu:0']" in proc.stdout


# ---- failure never hangs -----------------------------------------------------------


def run_failure(case, timeout=5, processes=2):
    proc, seconds = mpirun(processes, ["fail", "/tmp", "--case", case, "--timeout", str(timeout)], timeout=120)
    return proc, seconds, proc.stdout + proc.stderr


def test_a_nonfinite_loss_is_the_same_verdict_on_every_rank():
    """A NaN pixel in rank 1's shard: both ranks raise FloatingPointError at that step, both name
    global replica 1 (rank 0 by its rank, rank 1 by its device), neither applies the step (the
    loss flag rides with the chain all-reduce), and both train on in step afterwards."""
    proc, _, text = run_failure("nan", timeout=60)
    assert proc.returncode == 0, text
    assert "rank 0 train_step: the loss is not finite (nan) on replica 1 (rank 1, loss nan)" in text, text
    assert "rank 1 train_step: the loss is not finite (nan) on replica 1 (cpu:0, loss nan)" in text, text
    assert "rank 0 unchanged True" in text and "rank 1 unchanged True" in text, text
    for r in (0, 1):
        assert f"rank {r} dp.train: training stopped at epoch 1, step 3: the loss is not finite" in text, text
    digests = set(re.findall(r"rank \d digest (\d+)", text))
    assert len(digests) == 1, text


def test_a_killed_rank_ends_the_job():
    proc, seconds, text = run_failure("kill")
    assert proc.returncode != 0
    assert seconds < 60
    assert "rank 1" in text and "signal 9" in text, text


def test_a_rank_that_raises_aborts_the_job_with_its_traceback():
    proc, seconds, text = run_failure("raise", timeout=60)
    assert proc.returncode != 0
    assert seconds < 30  # MPI_Abort, not the 60 s deadline
    assert "rank 1 raises on purpose" in text and "rank 1 of 2 failed; aborting the job" in text, text
    assert "rank 0 finished" not in text


def test_a_stopped_rank_is_named_after_the_timeout():
    """SIGSTOP: alive but silent. The survivor gives up after timeout=5 s,
    naming rank 1 and the step, and its exception aborts the job."""
    proc, seconds, text = run_failure("stop", timeout=5)
    assert proc.returncode != 0
    assert seconds < 60
    # 5 s, or a little more on a loaded machine (the wait polls)
    assert re.search(r"rank 0 gave up after [5-9] s waiting for rank 1", text) and "call 3" in text, text


@pytest.mark.parametrize("case,message", [
    ("skip", "rank 1's labels (or rows) differ from rank 0's"),
    ("batch", "rank 1 has 255 samples, rank 0 256"),
    ("seed", "the same shuffling seed"),
    ("model", "the processes disagree about the model: rank 1 has a parameter count of"),
    ("epochs", "the processes disagree about dp.train's arguments"),
    ("order", "rank 1 is stepping its model #1, rank 0 its model #0"),
])
def test_bad_use_is_a_clear_error_on_every_rank(case, message):
    """A rank that skips a batch, passes a smaller batch or another shuffle, builds
    another model or trains for another number of epochs: every rank raises
    DistributedError with the same message, no hang."""
    proc, seconds, text = run_failure(case, timeout=30)
    assert proc.returncode != 0
    assert seconds < 30
    assert message in text, text
    assert "DistributedError" in text


def test_two_models_across_processes_keep_their_messages_apart():
    """Two models of one job, stepped alternately: each comm has its own MPI
    communicator, so their chains never meet; both end the same on both ranks."""
    proc, _, text = run_failure("two", timeout=30)
    assert proc.returncode == 0, text
    found = dict(re.findall(r"rank (\d) two models (\d+ \d+)", proc.stdout))
    assert sorted(found) == ["0", "1"] and found["0"] == found["1"], proc.stdout


def test_coexists_with_mpi4py_that_started_mpi_first():
    """mpi4py (a test requirement) initialises MPI at import: dpcore joins that
    MPI, trains, and does not finalise what it did not start; the job ends
    cleanly, mpi4py finalising."""
    proc, _, text = run_failure("mpi4py", timeout=30)
    assert proc.returncode == 0, text
    assert proc.stdout.count("mpi4py first, initialized_here=False, thread_level=3, same digests=True") == 2, text


def test_a_drawn_shuffling_seed_is_rank_0s_on_every_rank():
    """from_arrays(shuffle=True) without a seed draws one per process; dp.train
    gives every process rank 0's, so they walk the same batches."""
    proc, _, text = run_failure("drawn", timeout=30)
    assert proc.returncode == 0, text
    # mpirun may interleave the two processes' lines
    found = dict(re.findall(r"rank (\d) trained with seed (\d+ digest \d+)", proc.stdout))
    assert sorted(found) == ["0", "1"], proc.stdout
    assert found["0"] == found["1"]  # the same seed and the same digest


def test_a_rank_that_ends_early_is_named_by_the_others():
    """Rank 1 exits (cleanly) in the middle of training: rank 0's next step
    waits for it until the timeout, then names it."""
    proc, seconds, text = run_failure("exit", timeout=5)
    assert proc.returncode != 0
    assert seconds < 60
    assert "waiting for rank 1" in text, text


# ---- GPUs (make test-gpu) ---------------------------------------------------------------------

GPUS = dp._core.runtime_info()["cuda_device_count"] if dp.build_info().get("cuda_backend") else 0
NO_GPU = "no usable CUDA device: " + dp._core.runtime_info()["cuda_why"]


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 GPUs ({GPUS} here): NCCL refuses two ranks on one GPU, and across "
                                     "processes GPU replicas are reduced by NCCL")
def test_two_processes_on_two_gpus_match_one_process_with_both(tmp_path):
    """One GPU per process (cuda:local_rank), one NCCL communicator over both
    processes from an id broadcast over MPI, against one process driving both
    GPUs: the same bits (two addends sum the same in either order; cuDNN in
    its deterministic mode)."""
    job, ref = tmp_path / "job", tmp_path / "ref"
    job.mkdir()
    ref.mkdir()
    extra = ["--gpu", "--batch", "64", "--samples", "228", "--eval", "1000"]
    proc, _ = mpirun(2, ["train", str(job)] + extra)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    single(["train", str(ref)] + extra)
    assert_same_bits(results(job, 2), results(ref, 1)[0])


@pytest.mark.gpu
@pytest.mark.skipif(GPUS == 0, reason=NO_GPU)
def test_more_processes_than_gpus_is_a_clear_error():
    """GPUs + 1 processes on this host: every rank says that the processes
    share the GPUs and what to do, instead of NCCL failing on a duplicate GPU."""
    script = "import dpcore as dp\ndp.MultiWorkerMirroredStrategy(timeout=60)\n"
    proc = subprocess.run(["mpirun", "-np", str(GPUS + 1), "--oversubscribe", sys.executable, "-c", script],
                          capture_output=True, text=True, env=mpi_env(), timeout=180)
    assert proc.returncode != 0
    assert f"share {GPUS} GPU(s)" in proc.stderr, proc.stderr


# ---- one process ------------------------------------------------------------------------


@pytest.mark.no_mpi_build
def test_a_build_without_mpi_refuses_to_run_under_mpirun():
    """Under mpirun, every process of a build without MPI would be a world of
    one and train alone: each raises DistributedError saying why instead."""
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun is not installed here (the main build's bootstrap installs it)")
    script = "import dpcore as dp\ndp.MultiWorkerMirroredStrategy()\n"
    proc = subprocess.run(["mpirun", "-np", "2", "--oversubscribe", sys.executable, "-c", script],
                          capture_output=True, text=True, env=mpi_env(), timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.count("dpcore was built without MPI") == 2, proc.stderr
    assert dp.distributed.world_size() == 1  # not under mpirun: a world of one, as always


@pytest.mark.any_build
def test_a_process_not_started_by_mpirun_is_a_world_of_one():
    """Here (pytest, no mpirun): rank 0 of 1, MPI never started, and
    MultiWorkerMirroredStrategy trains as MirroredStrategy would, bitwise."""
    script = ("import dpcore as dp, numpy as np\n"
              "d = dp.distributed\n"
              "print(d.rank(), d.world_size(), d.local_rank(), d.local_size(), d.is_initialized())\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_"))}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True).stdout
    assert out.split() == ["0", "1", "0", "1", "False"]


@pytest.mark.any_build
def test_multi_worker_strategy_in_one_process_matches_mirrored(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    single(["train", str(a), "--local", "2", "--multi"])
    single(["train", str(b), "--local", "2"])
    assert_same_bits(results(a, 1), results(b, 1)[0])


@pytest.mark.any_build
def test_bad_arguments_are_clear():
    with pytest.raises(ValueError, match="timeout must be a finite number > 0"):
        dp.MultiWorkerMirroredStrategy(timeout=0)
    with pytest.raises(TypeError, match="timeout must be a finite number"):
        dp.MultiWorkerMirroredStrategy(timeout="60")
    with pytest.raises(ValueError, match="all_reduce must be one of"):
        dp.MultiWorkerMirroredStrategy(all_reduce="tcp")
    with pytest.raises(ValueError, match="'mpi' is for replicas in several processes"):
        dp.models.LeNet(devices=["cpu:0", "cpu:1"] if len(dp.list_devices()) > 1 else None, all_reduce="mpi") \
            if False else dp._core.Mirrored([dp.models.LeNet()._model, _second_model()], all_reduce="mpi")
    with pytest.raises(ValueError, match="root must be an int >= 0"):
        dp.distributed.broadcast_object(1, root=1)


def _second_model():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        dp.set_logical_devices("cpu", 2)
    try:
        return dp.models.LeNet(devices=["cpu:1"])._model
    finally:
        dp.set_logical_devices("cpu", 1)


def test_build_info_names_the_mpi_library():
    info = dp.build_info()
    assert info["mpi_linked"] is True
    assert "Open MPI" in info["mpi_library"]
    assert info["mpi_cuda_aware"] in (-1, 0, 1)


# ---- dp.launch ------------------------------------------------------------------------------


def test_launch_runs_a_notebook_function_and_returns_rank_0s_result():
    """A function made here (a closure, as a notebook cell makes them), pickled
    by value: 2 processes train together and rank 0's History comes back."""
    os.environ.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    scale = 3

    def work(n):
        import numpy as np

        import dpcore as dp

        strategy = dp.MultiWorkerMirroredStrategy(timeout=30)
        with strategy.scope():
            net = dp.models.LeNet()
        rng = np.random.default_rng(0)
        X, y = rng.random((n, 1, 28, 28), dtype=np.float32), rng.integers(0, 10, n)
        h = dp.train(net, dp.data.from_arrays(X, y, batch_size=32, seed=0), num_epochs=1, lr=0.1, verbose=False)
        return {"rank": dp.distributed.rank(), "world": dp.distributed.world_size(), "scaled": scale * n,
                "history": h}

    out = dp.launch(work, num_processes=2, args=(64,), timeout=120)
    assert out["rank"] == 0 and out["world"] == 2 and out["scaled"] == 192
    assert out["history"].devices == ["rank0/cpu:0", "rank1/cpu:0"]


def test_launch_raises_the_failing_ranks_traceback():
    os.environ.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")

    def work():
        import dpcore as dp

        if dp.distributed.rank() == 1:
            raise ValueError("only rank 1 fails")
        dp.distributed.barrier(timeout=60)

    start = time.monotonic()
    with pytest.raises(dp.DistributedError, match="rank 1 raised an exception(.|\n)*only rank 1 fails"):
        dp.launch(work, num_processes=2, timeout=120)
    assert time.monotonic() - start < 60


@pytest.mark.any_build
def test_launch_checks_its_arguments():
    with pytest.raises(TypeError, match="fn must be callable"):
        dp.launch(3)
    with pytest.raises(ValueError, match="num_processes must be an int >= 1"):
        dp.launch(print, num_processes=0)
    with pytest.raises(TypeError, match="args must be a tuple"):
        dp.launch(print, args=5)
    with pytest.raises(dp.DistributedError, match="needs 'no-such-mpirun' on PATH"):
        dp.launch(print, mpirun="no-such-mpirun")
