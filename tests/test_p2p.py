"""dp.distributed.send / recv / isend / irecv and the collectives (all_reduce, broadcast,
all_gather, reduce_scatter) across the ranks of a job (issue 33), under mpirun
(tests/mpi_p2p.py is what each of the 2 processes runs): exact bytes for every dtype, NumPy
arrays, shapes and dp.Tensors; the exchange that deadlocks when isend waits for its peer; order
on one tag with five messages in flight; a shape mismatch that is a DistributedError on both
ranks and leaves the job in step; a peer that never sends, named after the timeout; bad
arguments refused before anything moves. In one process (and a build without MPI) there is no
peer: the same calls are clear errors."""
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import dpcore as dp
from test_distributed import mpi_env, mpi_required  # noqa: F401  (the fixture: MPI needed, or skipped in DPCORE_MPI=0 builds)

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mpi_p2p.py")


def run(case, timeout=120, processes=2):
    cmd = ["mpirun", "-np", str(processes), "--oversubscribe", "--bind-to", "none", sys.executable, SCRIPT, case]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=mpi_env(), timeout=timeout)
    return proc, proc.stdout + proc.stderr


def expect(case, lines, processes=2, timeout=120):
    """Runs `case` on `processes` ranks: a clean exit and every line printed."""
    proc, text = run(case, timeout, processes)
    assert proc.returncode == 0, text
    for line in lines:
        assert line in text, text
    return text


def test_messages_arrive_exactly():
    proc, text = run("basic")
    assert proc.returncode == 0, text
    for line in ("rank 1: float32 exact True float32 (3, 4)", "rank 1: int64 exact True",
                 "rank 1: tensor Tensor cpu:0 exact True", "rank 0: echo exact True"):
        assert line in text, text


def test_isend_exchange_and_order_on_one_tag():
    expect("exchange", ["rank 0: exchange True", "rank 1: exchange True", "rank 1: in order 0 1 2 3 4"])


def test_at_most_32_operations_in_flight_per_peer_and_tag():
    expect("slots", ["rank 0: ValueError isend: 32 operations with rank 1 on tag 3 are in flight already, the most "
                     "there may be; wait() for some first", "rank 1: received in order True"])


def test_a_mismatch_is_an_error_on_both_ranks_and_the_job_goes_on():
    expect("mismatch", [
        "rank 0: DistributedError rank 0: dp.distributed.send(to rank 1, tag 0): rank 1 expects "
        "float32[3, 2] in host memory, this rank sends float32[2, 3] in host memory",
        "rank 1: DistributedError rank 1: dp.distributed.recv(from rank 0, tag 0): rank 0 sends "
        "float32[2, 3] in host memory, this rank expects float32[3, 2] in host memory",
        "rank 1: after [1.0, 1.0, 1.0, 1.0]"])


def test_a_peer_that_never_sends_is_named_after_the_timeout():
    proc, text = run("silent", timeout=60)
    # 3 s, or a little more on a loaded machine (the wait polls)
    assert re.search(r"rank 1: DistributedError rank 1 gave up after [3-9] s waiting for rank 0 in "
                     r"dp\.distributed\.recv\(from rank 0, tag 0\)", text), text
    assert proc.returncode != 0  # the job is out of step: rank 1 aborts it at exit


def test_bad_arguments_are_refused_on_the_calling_rank():
    proc, text = run("bad_calls")
    assert proc.returncode == 0, text
    for r in (0, 1):
        for line in (f"ValueError send: rank {r} is this process; a message goes to another rank",
                     "ValueError dst must be an int >= 0 and <= 1, got 5",
                     "ValueError tag must be an int >= 0 and <= 99, got 100",
                     "TypeError send: expected a NumPy array or a dp.Tensor, got list",
                     "TypeError send: arrays of float32, float64, int32, int64, uint8 only, got complex64",
                     "ValueError recv: the array must be C-contiguous and writable (it is filled in place)"):
            assert f"rank {r}: {line}" in text, text


def test_collectives_on_three_ranks():
    """all_reduce (sum and mean bitwise the rank-ordered float32 sum, max, int64 exact, a
    dp.Tensor), broadcast from rank 1, all_gather in rank order, reduce_scatter's blocks; a rank
    with another shape or op: the same DistributedError on every rank, and the job goes on."""
    proc, text = run("collectives", processes=3)
    assert proc.returncode == 0, text
    for r in range(3):
        for line in ("sum bits True", "mean bits True", "max True", "int64 sum [3000000000003, 3000000000003, "
                     "3000000000003]", "tensor sum Tensor True", "broadcast [1.0, 1.0, 1.0, 1.0]",
                     "all_gather [[0, 0], [1, 1], [2, 2]]", "after [3.0, 3.0]"):
            assert f"rank {r}: {line}" in text, text
        assert (f"rank {r}: DistributedError the processes disagree about dp.distributed.all_reduce's arguments "
                "(collective, dtype, shape, memory, op): rank 1 has ('all_reduce', 'float32', (4,), 'host', 'sum'), "
                "rank 0 has ('all_reduce', 'float32', (3,), 'host', 'sum')") in text, text
        assert f"rank {r}: DistributedError" in text and "'max'" in text, text
    blocks = {0: "[[0.0, 3.0], [6.0, 9.0]]", 1: "[[12.0, 15.0], [18.0, 21.0]]", 2: "[[24.0, 27.0], [30.0, 33.0]]"}
    for r, b in blocks.items():
        assert f"rank {r}: reduce_scatter {b}" in text, text


def test_descriptions_name_the_memory_and_refuse_one_gpu_for_two_ranks():
    """The CPU twin of tests/test_p2p_gpu.py: the descriptions alone (dist_p2p_handshake, no byte
    moves), as a GPU tensor's would be made. A GPU message against a host receiver, and two
    processes on one physical GPU (NCCL refuses two ranks on one GPU), are DistributedErrors on
    both ranks before any communicator is made; distinct GPUs, or GPUs CUDA could not name, are
    taken; the job goes on."""
    text = expect("handshake", [
        "rank 0: kinds: DistributedError rank 0: dp.distributed.send(to rank 1, tag 0): rank 1 expects "
        "float32[2, 3] in host memory, this rank sends float32[2, 3] in GPU memory (tag 0); nothing was sent",
        "rank 1: kinds: DistributedError rank 1: dp.distributed.recv(from rank 0, tag 0): rank 0 sends "
        "float32[2, 3] in GPU memory, this rank expects float32[2, 3] in host memory (tag 0); nothing was received",
        "rank 0: same gpu: DistributedError rank 0: dp.distributed.send(to rank 1, tag 0): rank 1 receives into the "
        "same physical GPU (GPU 0 there, GPU 0 here) that this rank sends from; NCCL refuses two ranks on one GPU",
        "rank 1: same gpu: DistributedError rank 1: dp.distributed.recv(from rank 0, tag 0): rank 0 sends from the "
        "same physical GPU (GPU 0 there, GPU 0 here) that this rank receives into; NCCL refuses two ranks on one GPU",
        "rank 0: two gpus: no error", "rank 1: two gpus: no error",
        "rank 0: unknown uid: no error", "rank 1: unknown uid: no error",
        "rank 1: after [1.0, 1.0, 1.0, 1.0]"])
    assert "kinds: no error" not in text and "same gpu: no error" not in text, text


@pytest.mark.parametrize("processes", [2, 3, 4])
def test_owner_computes_all_reduce_has_the_chains_bits(processes):
    """DPCORE_DIST_ALLREDUCE=owner (dp_dist_owner_allreduce_on) against the chain and against the
    rank-ordered float32 sum computed here, for lengths of 1 to 300,007 floats (fewer than the
    processes, not a whole number of segments or 65,536-float chunks): the same bits on every rank."""
    expect("owner", [f"rank {r}: owner equals chain [True, True, True, True, True, True]" for r in range(processes)],
           processes=processes, timeout=300)


def test_replicas_of_several_processes_combine_in_global_order():
    """Rank r holds r + 1 replicas (rank 1's are dp.Tensors on its two logical CPU devices):
    all_reduce of the lists gives every replica the float32 sum over the 6 in global order
    (process by process, then list order), by the chain and by the owner-computes form, and
    'mean' is that sum times 1/6."""
    expect("hierarchical", [f"rank {r}: hierarchical [True, True, True, True]" for r in range(3)], processes=3)


def test_processes_that_ask_for_different_all_reduce_forms_are_told_so():
    expect("formdiff", [
        "rank 0: DistributedError rank 0: DPCORE_DIST_ALLREDUCE differs between the processes: rank 1 runs "
        "the owner-computes form, this rank the chain",
        "rank 1: DistributedError rank 1: DPCORE_DIST_ALLREDUCE differs between the processes: rank 0 runs "
        "the chain, this rank the owner-computes form"])


@pytest.mark.any_build
def test_collectives_in_one_process_are_the_identity():
    a = np.arange(6, dtype=np.float32).reshape(3, 2)
    assert np.array_equal(dp.distributed.all_reduce(a.copy()), a)
    assert np.array_equal(dp.distributed.all_reduce(a.copy(), op="mean"), a)
    assert np.array_equal(dp.distributed.broadcast(a.copy()), a)
    assert [x.tolist() for x in dp.distributed.all_gather(a)] == [a.tolist()]
    assert np.array_equal(dp.distributed.reduce_scatter(a), a)
    with pytest.raises(TypeError, match="op='mean' needs a float array"):
        dp.distributed.all_reduce(np.zeros(2, np.int32), op="mean")
    with pytest.raises(ValueError, match="op must be"):
        dp.distributed.all_reduce(a, op="min")
    # a list: this process's replicas, combined in order
    b, c = a * 2, a * 3
    out = dp.distributed.all_reduce([a.copy(), b.copy(), c.copy()])
    assert all(np.array_equal(o, (a + b) + c) for o in out) and len(out) == 3
    mean = dp.distributed.all_reduce([a.copy(), b.copy(), c.copy()], op="mean")
    assert all(np.array_equal(m, ((a + b) + c) * np.float32(1 / 3)) for m in mean)
    with pytest.raises(ValueError, match="this process's tensors differ"):
        dp.distributed.all_reduce([a.copy(), np.zeros(2, np.float32)])
    with pytest.raises(ValueError, match="an empty list"):
        dp.distributed.all_reduce([])


@pytest.mark.any_build
def test_one_process_has_no_peer():
    """Not under mpirun (and in a build without MPI): rank 0 of 1 has nobody to talk to."""
    with pytest.raises(ValueError, match="a message goes to another rank"):
        dp.distributed.send(np.zeros(2, np.float32), 0)
    with pytest.raises(ValueError, match="src must be an int >= 0 and <= 0, got 1"):
        dp.distributed.recv((2,), 1)
    with pytest.raises(ValueError, match="a message goes to another rank"):
        dp.distributed.irecv((2,), 0)


def test_the_two_process_split_example_equals_one_process():
    """examples/two_process_split.py (make two-process-split): the tutorial's two-layer network with
    its layers on two ranks, trained 50 steps with send / recv, prints every loss and the final
    weights' digests bit for bit as the single process does, and learns."""
    example = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                           "two_process_split.py")
    one = subprocess.run([sys.executable, example], capture_output=True, text=True, env=mpi_env(), timeout=120)
    assert one.returncode == 0, one.stderr
    cmd = ["mpirun", "-np", "2", "--oversubscribe", "--bind-to", "none", sys.executable, example]
    two = subprocess.run(cmd, capture_output=True, text=True, env=mpi_env(), timeout=120)
    assert two.returncode == 0, two.stdout + two.stderr
    # mpirun forwards both ranks' output into one pipe, where two lines may meet without a newline
    lines = re.compile(r"step \d+: loss [0-9.e+-]+|layer \d digest [0-9a-f]{16}")
    assert sorted(lines.findall(one.stdout)) == sorted(lines.findall(two.stdout)), (one.stdout, two.stdout)
    assert len(lines.findall(one.stdout)) == 52, one.stdout
    losses = [float(line.split()[-1]) for line in one.stdout.splitlines() if line.startswith("step")]
    assert len(losses) == 50 and losses[-1] < 0.5 * losses[0], losses
