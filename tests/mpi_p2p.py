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


def mismatch():
    """A receiver that expects another shape: DistributedError on both ranks, naming both
    descriptions; the job stays in step (the next message goes through)."""
    r = dist.rank()
    try:
        if r == 0:
            dist.send(np.zeros((2, 3), np.float32), 1)
        else:
            dist.recv((3, 2), 0)
        say("no error")
    except dist.DistributedError as e:
        say(f"DistributedError {e}")
    if r == 0:
        dist.send(np.ones(4, np.float32), 1)
    else:
        say(f"after {dist.recv((4,), 0).tolist()}")


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


CASES = {"basic": basic, "exchange": exchange, "mismatch": mismatch, "silent": silent, "bad_calls": bad_calls,
         "collectives": collectives, "owner": owner,
         "formdiff": formdiff, "hierarchical": hierarchical, "slots": slots}


if __name__ == "__main__":
    CASES[sys.argv[1]]()
