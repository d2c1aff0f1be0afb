"""What tests/test_p2p.py runs under mpirun: ``python tests/mpi_p2p.py CASE`` on 2 ranks.
Each rank prints ``rank R: <line>`` results the test reads."""
import sys

import numpy as np

import dpcore as dp
from dpcore import distributed as dist


def say(text):
    print(f"rank {dist.rank()}: {text}", flush=True)


def basic():
    r = dist.rank()
    a = np.arange(12, dtype=np.float32).reshape(3, 4) * 0.1
    if r == 0:
        dist.send(a, 1)
        dist.send(np.arange(5, dtype=np.int64) * 10**12, 1, tag=7)
        dist.send(dp.tensor(a + 1, "cpu:0"), 1)
        back = dist.recv(np.empty((3, 4), np.float32), 1)
        say(f"echo exact {np.array_equal(back, a * 2)}")
    else:
        got = dist.recv((3, 4), 0)
        say(f"float32 exact {np.array_equal(got, a)} {got.dtype} {got.shape}")
        ints = dist.recv((5,), 0, tag=7, dtype="int64")
        say(f"int64 exact {np.array_equal(ints, np.arange(5, dtype=np.int64) * 10**12)}")
        t = dist.recv(dp.tensor(np.zeros((3, 4), np.float32), "cpu:0"), 0)
        say(f"tensor {type(t).__name__} {t.device} exact {np.array_equal(t.numpy(), a + 1)}")
        dist.send(got * 2, 0)


def exchange():
    """Both ranks isend then recv from each other (deadlocks if isend waited for its peer), then
    five messages on one tag arrive in order, posted as five isends at once."""
    r, other = dist.rank(), 1 - dist.rank()
    mine = np.full((1000, 100), r, np.float32)
    w = dist.isend(mine, other)
    theirs = dist.recv((1000, 100), other)
    w.wait()
    say(f"exchange {bool((theirs == other).all())}")
    if r == 0:
        works = [dist.isend(np.full(3, k, np.float64), 1, tag=5) for k in range(5)]
        for w in works:
            w.wait()
    else:
        works = [dist.irecv((3,), 0, tag=5, dtype="float64") for _ in range(5)]
        say("in order " + " ".join(str(int(w.wait()[0])) for w in works))


def outcome(call, label=""):
    """Says the DistributedError call() raised, or "no error"."""
    try:
        call()
        say(f"{label}no error")
    except dist.DistributedError as e:
        say(f"{label}DistributedError {e}")


def refused_then_in_step(send, receive):
    """Rank 0 calls send(), rank 1 receive(), each saying its outcome; then a host message from 0
    to 1 shows whether the job is still in step."""
    outcome(send if dist.rank() == 0 else receive)
    in_step()


def in_step():
    if dist.rank() == 0:
        dist.send(np.ones(4, np.float32), 1)
    else:
        say(f"after {dist.recv((4,), 0).tolist()}")


def mismatch():
    """A receiver that expects another shape: DistributedError on both ranks, naming both
    descriptions; the job stays in step (the next message goes through)."""
    refused_then_in_step(lambda: dist.send(np.zeros((2, 3), np.float32), 1), lambda: dist.recv((3, 2), 0))


def silent():
    """Rank 1 waits for a message rank 0 never sends: named after the timeout."""
    if dist.rank() == 1:
        try:
            dist.recv((2,), 0, timeout=3)
        except dist.DistributedError as e:
            say(f"DistributedError {e}")
    else:
        say("not sending")
    dist.barrier(timeout=30) if dist.rank() == 0 else None


def bad_calls():
    for call in (lambda: dist.send(np.zeros(2, np.float32), dist.rank()),
                 lambda: dist.send(np.zeros(2, np.float32), 5),
                 lambda: dist.send(np.zeros(2, np.float32), 1 - dist.rank(), tag=100),
                 lambda: dist.send([1, 2], 1 - dist.rank()),
                 lambda: dist.send(np.zeros(2, np.complex64), 1 - dist.rank()),
                 lambda: dist.recv(np.zeros(4, np.float32)[::2], 1 - dist.rank())):
        try:
            call()
            say("no error")
        except (ValueError, TypeError) as e:
            say(f"{type(e).__name__} {e}")




def collectives():
    r, P = dist.rank(), dist.world_size()
    rng = np.random.default_rng(r)
    mine = rng.standard_normal((5, 7)).astype(np.float32)
    allv = [np.random.default_rng(q).standard_normal((5, 7)).astype(np.float32) for q in range(P)]
    want = allv[0].copy()
    for a in allv[1:]:
        want = want + a                                     # rank order, float32
    s = dist.all_reduce(mine.copy())
    say(f"sum bits {np.array_equal(s, want)}")
    m = dist.all_reduce(mine.copy(), op="mean")
    say(f"mean bits {np.array_equal(m, want * np.float32(1 / P))}")
    mx = dist.all_reduce(mine.copy(), op="max")
    say(f"max {np.array_equal(mx, np.maximum.reduce(allv))}")
    ints = dist.all_reduce(np.full(3, 10**12 + r, np.int64))
    say(f"int64 sum {ints.tolist()}")
    t = dist.all_reduce(dp.tensor(mine, "cpu:0"))
    say(f"tensor sum {type(t).__name__} {np.array_equal(t.numpy(), want)}")
    b = dist.broadcast(np.full(4, r, np.float64), src=1)
    say(f"broadcast {b.tolist()}")
    g = dist.all_gather(np.full(2, r, np.int32))
    say(f"all_gather {[x.tolist() for x in g]}")
    rs = dist.reduce_scatter(np.arange(4 * P, dtype=np.float32).reshape(2 * P, 2))
    say(f"reduce_scatter {rs.tolist()}")
    try:
        dist.all_reduce(np.zeros(3 + r, np.float32))
        say("no error")
    except dist.DistributedError as e:
        say(f"DistributedError {e}")
    try:
        dist.all_reduce(np.zeros(3, np.float32), op="max" if r else "sum")
        say("no error")
    except dist.DistributedError as e:
        say(f"DistributedError {e}")
    say(f"after {dist.all_reduce(np.ones(2, np.float32)).tolist()}")


def owner():
    """The owner-computes all-reduce against the chain: the same bits, for sizes that do not
    split evenly into the processes' segments and chunks (and smaller than the process count)."""
    import os

    r, P = dist.rank(), dist.world_size()
    same = []
    for n in (1, 2, 5, 1000, 65536 * 2 + 17, 300007):
        x = np.random.default_rng(100 * r + n).standard_normal(n).astype(np.float32) * (10.0 ** (r % 3))
        os.environ["DPCORE_DIST_ALLREDUCE"] = "chain"
        a = dist.all_reduce(x.copy(), op="mean")
        os.environ["DPCORE_DIST_ALLREDUCE"] = "owner"
        b = dist.all_reduce(x.copy(), op="mean")
        want = np.random.default_rng(n).standard_normal(n).astype(np.float32)
        for q in range(1, P):
            want = want + np.random.default_rng(100 * q + n).standard_normal(n).astype(np.float32) * \
                np.float32(10.0 ** (q % 3))
        same.append(bool(np.array_equal(a, b) and np.array_equal(b, want * np.float32(1 / P))))
    say(f"owner equals chain {same}")


def formdiff():
    """Ranks that ask for different all-reduce forms: a DistributedError when the model is made."""
    import os

    os.environ["DPCORE_DIST_ALLREDUCE"] = "owner" if dist.rank() == 1 else "chain"
    try:
        with dp.MultiWorkerMirroredStrategy(devices=["cpu:0"], timeout=30).scope():
            dp.models.LeNet()
        say("no error")
    except dist.DistributedError as e:
        say(f"DistributedError {e}")


def hierarchical():
    """Each rank holds another number of replicas (rank r: r + 1 of them, dp.Tensors on its
    logical CPU devices for rank 1): every replica gets the float32 sum over the job's replicas
    in global order, by the chain and by the owner-computes form, and the mean divides by 6."""
    import os
    import warnings

    r, P = dist.rank(), dist.world_size()
    def rep(q, i):
        return np.random.default_rng(10 * q + i).standard_normal(1000).astype(np.float32) * np.float32(3.0 ** i)
    want = rep(0, 0)
    for q in range(P):
        for i in range(q + 1):
            if (q, i) != (0, 0):
                want = want + rep(q, i)
    ok = []
    for form in ("chain", "owner"):
        os.environ["DPCORE_DIST_ALLREDUCE"] = form
        if r == 1:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dp.set_logical_devices("cpu", 2)
            mine = [dp.tensor(rep(r, i), f"cpu:{i}") for i in range(r + 1)]
            out = [t.numpy() for t in dist.all_reduce(mine)]
        else:
            out = dist.all_reduce([rep(r, i) for i in range(r + 1)])
        ok.append(all(np.array_equal(o, want) for o in out) and len(out) == r + 1)
        mean = dist.all_reduce([rep(r, i) for i in range(r + 1)], op="mean")
        ok.append(all(np.array_equal(m, want * np.float32(1 / 6)) for m in mean))
    say(f"hierarchical {ok}")


def slots():
    """32 isends in flight to one rank on one tag are the most: the 33rd is refused (their MPI tags
    would repeat and messages could pair wrongly); once they are done, sending goes on, in order."""
    if dist.rank() == 0:
        works = [dist.isend(np.full(2, k, np.float32), 1, tag=3) for k in range(32)]
        try:
            dist.isend(np.zeros(2, np.float32), 1, tag=3)
            say("no error")
        except ValueError as e:
            say(f"ValueError {e}")
        dist.send(np.ones(1, np.float32), 1, tag=4)  # only now may rank 1 start receiving
        for w in works:
            w.wait()
        dist.send(np.full(2, 99, np.float32), 1, tag=3)
    else:
        dist.recv((1,), 0, tag=4)
        got = [int(dist.recv((2,), 0, tag=3)[0]) for _ in range(33)]
        say(f"received in order {got == list(range(32)) + [99]}")


def handshake():
    """The descriptions alone (no byte moves; no GPU needed): a GPU message against a host
    receiver, two processes on one physical GPU (equal gpu_uid), two distinct GPUs (taken); each
    refusal a DistributedError on both ranks, and the job goes on."""
    from dpcore import _core

    r, other = dist.rank(), 1 - dist.rank()
    # (sender's (device, gpu, uid), receiver's (device, gpu, uid))
    for label, send_side, recv_side in (("kinds", (1, 0, 111), (0, 0, 0)),
                                        ("same gpu", (1, 0, 222), (1, 0, 222)),
                                        ("two gpus", (1, 0, 333), (1, 1, 444)),
                                        ("unknown uid", (1, 0, 0), (1, 0, 0))):
        is_send = r == 0
        device, gpu, uid = send_side if is_send else recv_side
        seq = _core.dist_p2p_seq(is_send, other, 0)
        what = f"dp.distributed.{'send(to' if is_send else 'recv(from'} rank {other}, tag 0)"
        outcome(lambda: _core.dist_p2p_handshake(is_send, 0, (2, 3), device, gpu, uid, other, 0, seq, 30.0, what),
                f"{label}: ")
    in_step()


def _gpu():
    """This rank's GPU device: cuda:local_rank when there are GPUs enough, else cuda:0."""
    gpus = dp._core.runtime_info()["cuda_device_count"]
    return f"cuda:{dist.local_rank() % max(gpus, 1)}"


def gpu_host_mismatch():
    """A tensor on a GPU sent to a rank that receives into host memory: DistributedError on both
    ranks naming both memories, before NCCL is touched; then a host message goes through."""
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    refused_then_in_step(lambda: dist.send(dp.tensor(a, "cuda:0"), 1), lambda: dist.recv((2, 3), 0))


def gpu_same_gpu():
    """Both ranks on the one GPU (cuda:0): NCCL refuses two ranks on one GPU, so the receiver
    refuses the message first, a DistributedError on both ranks; the job goes on."""
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    refused_then_in_step(lambda: dist.send(dp.tensor(a, "cuda:0"), 1),
                         lambda: dist.recv(dp.tensor(np.zeros((2, 3), np.float32), "cuda:0"), 0))


def gpu_collectives():
    """The collectives on GPU tensors (through host copies): the rank-ordered float32 sum's bits,
    a Tensor on the same device back; broadcast and all_gather; a GPU tensor on one rank and a host
    array on the other: the same DistributedError on both."""
    r, P = dist.rank(), dist.world_size()
    dev = _gpu()
    allv = [np.random.default_rng(q).standard_normal((5, 7)).astype(np.float32) for q in range(P)]
    want = allv[0].copy()
    for a in allv[1:]:
        want = want + a
    s = dist.all_reduce(dp.tensor(allv[r], dev))
    say(f"gpu sum {type(s).__name__} {s.device == dev} bits {np.array_equal(s.numpy(), want)}")
    m = dist.all_reduce(dp.tensor(allv[r], dev), op="mean")
    say(f"gpu mean bits {np.array_equal(m.numpy(), want * np.float32(1 / P))}")
    b = dist.broadcast(dp.tensor(np.full(4, r, np.float32), dev), src=1)
    say(f"gpu broadcast {b.device == dev} {b.numpy().tolist()}")
    g = dist.all_gather(dp.tensor(np.full(2, r, np.int64), dev))
    say(f"gpu all_gather {[x.numpy().tolist() for x in g]}")
    try:
        dist.all_reduce(dp.tensor(allv[r], dev) if r == 0 else allv[r].copy())
        say("no error")
    except dist.DistributedError as e:
        say(f"DistributedError {e}")
    say(f"after {dist.all_reduce(np.ones(2, np.float32)).tolist()}")


def gpu_p2p():
    """Rank r on its own GPU (cuda:local_rank): exact bytes of every tensor dtype, both directions
    at once with isend (one communicator, its messages numbered by the lower rank), five messages
    on one tag in order, two tags received in the other order than sent (irecv), a tensor of
    64 MiB, an empty one."""
    r, other = dist.rank(), 1 - dist.rank()
    dev = _gpu()
    f = np.arange(12, dtype=np.float32).reshape(3, 4) * 0.1
    i = np.arange(5, dtype=np.int64) * 10**12
    u = np.arange(200, dtype=np.uint8)
    if r == 0:
        for a in (f, i, u):
            dist.send(dp.tensor(a, dev), 1)
    else:
        for a in (f, i, u):
            t = dist.recv(dp.tensor(np.zeros_like(a), dev), 0)
            say(f"gpu {a.dtype} exact {type(t).__name__} {t.device == dev} {np.array_equal(t.numpy(), a)}")
    mine = dp.tensor(np.full((1000, 100), r, np.float32), dev)
    w = dist.isend(mine, other)
    theirs = dist.recv(dp.tensor(np.zeros((1000, 100), np.float32), dev), other)
    w.wait()
    say(f"gpu exchange {bool((theirs.numpy() == other).all())}")
    if r == 0:
        works = [dist.isend(dp.tensor(np.full(3, k, np.float32), dev), 1, tag=5) for k in range(5)]
        works += [dist.isend(dp.tensor(np.full(2, 7, np.float32), dev), 1, tag=6),
                  dist.isend(dp.tensor(np.full(2, 8, np.float32), dev), 1, tag=7)]
        for w in works:
            w.wait()
    else:
        works = [dist.irecv(dp.tensor(np.zeros(3, np.float32), dev), 0, tag=5) for _ in range(5)]
        late = dist.irecv(dp.tensor(np.zeros(2, np.float32), dev), 0, tag=7)
        early = dist.irecv(dp.tensor(np.zeros(2, np.float32), dev), 0, tag=6)
        say("gpu in order " + " ".join(str(int(w.wait().numpy()[0])) for w in works))
        say(f"gpu two tags {int(early.wait().numpy()[0])} {int(late.wait().numpy()[0])}")
    big = np.random.default_rng(3).standard_normal(16 << 20).astype(np.float32)
    if r == 0:
        dist.send(dp.tensor(big, dev), 1)
        dist.send(dp.tensor(np.zeros((0, 3), np.float32), dev), 1)
    else:
        say(f"gpu 64 MiB exact {np.array_equal(dist.recv(dp.tensor(np.zeros_like(big), dev), 0).numpy(), big)}")
        say(f"gpu empty {dist.recv(dp.tensor(np.zeros((0, 3), np.float32), dev), 0).shape}")


CASES = {"basic": basic, "exchange": exchange, "mismatch": mismatch, "silent": silent, "bad_calls": bad_calls,
         "collectives": collectives, "owner": owner,
         "formdiff": formdiff, "hierarchical": hierarchical, "slots": slots,
         "handshake": handshake, "gpu_host_mismatch": gpu_host_mismatch, "gpu_same_gpu": gpu_same_gpu,
         "gpu_collectives": gpu_collectives, "gpu_p2p": gpu_p2p}


if __name__ == "__main__":
    CASES[sys.argv[1]]()
