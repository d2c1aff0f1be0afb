"""What tests/test_distributed.py runs under mpirun (and, for the references,
as one plain process): ``python tests/mpi_scenarios.py SCENARIO OUT [options]``.

train: LeNet or ResNet-18 trained for a few steps on synthetic data, then
evaluated on 10,000 samples; with several processes under
MultiWorkerMirroredStrategy, in one process under MirroredStrategy over
--local logical CPU devices. Each rank writes OUT/rank{r}.npz: the digest of
its parameters after every step, the step losses, the final parameters and
running statistics, and the evaluation.

fail: a job in which rank 1 goes wrong at step 3 in the way --case says; the
test reads what the survivors print and how long they take.
"""
import argparse
import json
import os
import signal
import sys

import numpy as np

import dpcore as dp


def data(n, seed):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, 1, 28, 28), dtype=np.uint8), rng.integers(0, 10, n)


def make_model(args, strategy):
    with strategy.scope():
        if args.model == "resnet":
            return dp.models.ResNet18(num_classes=10, in_channels=1, sync_batchnorm=args.sync_bn,
                                      bucket_mb=args.bucket_mb)
        return dp.models.LeNet(bucket_mb=args.bucket_mb)


def one_thread_per_replica(local):
    """This process may use at most `local` CPUs (rank r the r-th group of them), so that
    each of its `local` logical CPU devices runs one thread, as each of the reference's
    processes x local devices does: a CPU kernel's summation order may follow its
    thread count, and the tests compare bits. On the 2-core CI machine both runs had one
    thread a replica anyway; on a 16-core one 2 x 2 would run 8 threads a replica and
    1 x 4 four."""
    allowed = sorted(os.sched_getaffinity(0))
    r = dp.distributed.rank() if dp.distributed.world_size() > 1 else 0
    mine = [allowed[(r * local + i) % len(allowed)] for i in range(min(local, len(allowed)))]
    os.sched_setaffinity(0, mine)


def strategy_for(args):
    import warnings

    if args.gpu:
        # one GPU per process under mpirun (the default), every GPU in one process
        if dp.distributed.world_size() > 1:
            return dp.MultiWorkerMirroredStrategy(timeout=args.timeout)
        return dp.MirroredStrategy()
    one_thread_per_replica(args.local)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # more logical devices than cores
        dp.set_logical_devices("cpu", args.local)
    if dp.distributed.world_size() > 1 or args.multi:
        return dp.MultiWorkerMirroredStrategy(timeout=args.timeout)
    return dp.MirroredStrategy()


def train(args):
    strategy = strategy_for(args)
    net = make_model(args, strategy)
    rank = dp.distributed.rank()
    X, y = data(args.samples, 1)
    it = dp.data.from_arrays(X, y, batch_size=args.batch, shuffle=True, seed=0)
    digests, losses, correct = [net.digest()], [], []
    for epoch in range(args.epochs):
        for Xb, yb in it:
            loss, hits = net.train_step(Xb, yb, lr=0.05, momentum=0.9)
            digests.append(net.digest())
            losses.append(loss)
            correct.append(hits)
    out = {"digests": np.array(digests, dtype=np.uint64), "losses": np.array(losses), "correct": np.array(correct)}
    if args.eval:
        Xt, yt = data(args.eval, 2)
        m = net.evaluate(dp.data.from_arrays(Xt, yt, batch_size=1000))
        out["eval"] = np.array([m.loss, m.accuracy, m.num_examples])
    if args.fit:
        history = dp.train(net, it, dp.data.from_arrays(*data(300, 3), batch_size=100), num_epochs=1, lr=0.05,
                           resident=args.resident)
        kept = {k: v for k, v in vars(history).items() if k not in ("epoch_seconds", "devices")}
        out["history"] = np.array(json.dumps(kept))
        out["history_devices"] = np.array(json.dumps(history.devices))
        out["epoch_seconds"] = np.array(history.epoch_seconds)
        out["digest_after_fit"] = np.array(net.digest(), dtype=np.uint64)
    if args.save:
        net.save(args.save)
    w = net.get_weights()
    out["weights"] = np.concatenate([v.ravel() for v in w.values()])
    out["placement"] = np.array(json.dumps(net.placement))
    out["where"] = np.array(json.dumps([dp.distributed.local_rank(), dp.distributed.local_size()]))
    np.savez(os.path.join(args.out, f"rank{rank}.npz"), **out)


def resume(args):
    """dp.train across processes: profiled, and checkpointed then resumed
    (rank 0 writes the checkpoint; every rank reads it back): the resumed run
    must end with the bits of the straight one."""
    strategy = strategy_for(args)
    rank = dp.distributed.rank()
    X, y = data(args.samples, 1)

    def batches():
        return dp.data.from_arrays(X, y, batch_size=args.batch, shuffle=True, seed=0)

    kwargs = dict(lr=0.05, momentum=0.9, verbose=False)
    straight = make_model(args, strategy)
    history = dp.train(straight, batches(), num_epochs=2, profile=True, **kwargs)
    path = os.path.join(args.out, "run.safetensors")
    dp.train(make_model(args, strategy), batches(), num_epochs=1, checkpoint=path, **kwargs)
    second = make_model(args, strategy)
    second.set_weights({k: np.zeros_like(v) for k, v in second.get_weights().items()})  # resume must restore them
    resumed = dp.train(second, batches(), num_epochs=2, checkpoint=path, resume=True, **kwargs)
    timeline = history.timeline
    np.savez(os.path.join(args.out, f"rank{rank}.npz"),
             straight=np.array(straight.digest(), dtype=np.uint64), resumed=np.array(second.digest(), dtype=np.uint64),
             losses=np.array([history.train_loss, resumed.train_loss]), timeline_rank=np.array(timeline.rank),
             timeline_replicas=np.array(sorted(set(int(r) for r in timeline.events["replica"]))),
             timeline_phases=np.array(sorted(set(int(p) for p in timeline.events["phase"]))))


def fail(args):
    """Rank 1 goes wrong at step 3 of a LeNet run (timeout args.timeout)."""
    strategy = dp.MultiWorkerMirroredStrategy(timeout=args.timeout)
    rank = dp.distributed.rank()
    if args.case == "model" and rank == 1:
        with strategy.scope():
            net = dp.models.Sequential([("conv2d", 4, 3, 1, 1), ("relu",), ("flatten",), ("dense", 10)])
    else:
        net = make_model(args, strategy)
    X, y = data(256 * 6, 1)
    it = dp.data.from_arrays(X, y, batch_size=256, shuffle=True, seed=rank if args.case == "seed" else 0)
    if args.case == "drawn":
        # each process draws its own seed; dp.train gives them rank 0's
        it = dp.data.from_arrays(X, y, batch_size=256, shuffle=True)
        dp.train(net, it, num_epochs=1, lr=0.05, verbose=False)
        print(f"rank {rank} trained with seed {it.seed} digest {net.digest()}", flush=True)
        return
    if args.case in ("two", "order"):
        # a second model across processes, made second everywhere
        other = make_model(args, strategy)
        batches = list(it)[:2]
        for Xb, yb in batches:
            first, second = (other, net) if args.case == "order" and rank == 1 else (net, other)
            first.train_step(Xb, yb, lr=0.05)
            second.train_step(Xb, yb, lr=0.05)
        print(f"rank {rank} two models {net.digest()} {other.digest()}", flush=True)
        return
    if args.case == "nan":
        # a NaN pixel in batch 3 at position 200 of 256: rank 1's shard (of 2 processes x 1 replica)
        X = X.astype(np.float32) / 255
        X[2 * 256 + 200, 0, 5, 5] = np.nan
        batches = [(X[i:i + 256], y[i:i + 256]) for i in range(0, 3 * 256, 256)]
        for Xb, yb in batches[:2]:
            net.train_step(Xb, yb, lr=0.05, momentum=0.9)
        before = net.digest()
        try:
            net.train_step(*batches[2], lr=0.05, momentum=0.9)
        except FloatingPointError as e:
            print(f"rank {rank} train_step: {e}", flush=True)
        print(f"rank {rank} unchanged {net.digest() == before}", flush=True)
        try:
            dp.train(net, dp.data.from_arrays(X[:3 * 256], y[:3 * 256], batch_size=256, shuffle=False),
                     num_epochs=1, lr=0.05, momentum=0.9, verbose=False)
        except FloatingPointError as e:
            print(f"rank {rank} dp.train: {e}", flush=True)
        net.train_step(*batches[0], lr=0.05, momentum=0.9)  # trains on, in step
        print(f"rank {rank} digest {net.digest()}", flush=True)
        return
    if args.case == "epochs":
        dp.train(net, it, num_epochs=1 + rank, lr=0.05)
    for step, (Xb, yb) in enumerate(it):
        if rank == 1 and step == 3:
            if args.case == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if args.case == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            if args.case == "raise":
                raise RuntimeError("rank 1 raises on purpose")
            if args.case == "skip":
                continue
            if args.case == "exit":
                sys.exit(0)
        if args.case == "batch" and rank == 1:
            Xb, yb = Xb[:-1], yb[:-1]
        net.train_step(Xb, yb, lr=0.05)
    print(f"rank {rank} finished", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("scenario", choices=["train", "fail", "resume"])
    p.add_argument("out")
    p.add_argument("--model", default="lenet", choices=["lenet", "resnet"])
    p.add_argument("--local", type=int, default=1)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--samples", type=int, default=200)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--eval", type=int, default=0)
    p.add_argument("--fit", action="store_true")
    p.add_argument("--resident", action="store_true", help="dp.train(resident=True): rows of datasets on the devices")
    p.add_argument("--save", default=None)
    p.add_argument("--sync-bn", action="store_true")
    p.add_argument("--bucket-mb", type=float, default=25)
    p.add_argument("--multi", action="store_true", help="MultiWorkerMirroredStrategy even in one process")
    p.add_argument("--timeout", type=float, default=60)
    p.add_argument("--case", default="")
    p.add_argument("--gpu", action="store_true", help="GPU replicas (NCCL across processes)")
    args = p.parse_args()
    if args.case == "mpi4py":
        mpi4py_first(args)
        return
    {"train": train, "fail": fail, "resume": resume}[args.scenario](args)


def mpi4py_first(args):
    """mpi4py starts MPI before dpcore: dpcore uses it as it is, trains, and
    leaves finalising to mpi4py (whose own collectives still work after)."""
    from mpi4py import MPI

    strategy = dp.MultiWorkerMirroredStrategy(timeout=args.timeout)
    net = make_model(args, strategy)
    X, y = data(128, 1)
    dp.train(net, dp.data.from_arrays(X, y, batch_size=64, seed=0), num_epochs=1, lr=0.05, verbose=False)
    digests = MPI.COMM_WORLD.allgather(net.digest())
    info = dp._core.dist_info()
    print(f"rank {MPI.COMM_WORLD.rank}: mpi4py first, initialized_here={info['initialized_here']}, "
          f"thread_level={info['thread_level']}, same digests={len(set(digests)) == 1}", flush=True)


if __name__ == "__main__":
    main()
