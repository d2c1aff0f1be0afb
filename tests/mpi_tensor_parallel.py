"""What each rank of tests/test_tensor_parallel_mpi.py runs: dp.ModelParallelStrategy over the
ranks of an MPI job ('rankQ/cpu:0', one slice per rank), against the one-process strategy over
as many logical CPU devices, computed in every rank (the same arithmetic: the same slices, the
partial input gradients summed in position order). Prints one line per check, prefixed with the
rank.

    mpirun -np 2|3|4 python tests/mpi_tensor_parallel.py CASE[,CASE...] [DIR]

CASE: equal, replicas (4 ranks: 2 copies x 2), checkpoint (writes into DIR), failure, killed, gpu
(every rank's slices on GPU 0), gpu-replicas (4 ranks on GPU 0: 2 copies x 2).
"""
import os
import sys
import time
import warnings

import numpy as np

import dpcore as dp

rank, world = dp.distributed.rank(), dp.distributed.world_size()


def say(msg):
    print(f"rank {rank}: {msg}", flush=True)


def data(n, shape, seed=0):
    rng = np.random.default_rng(seed)
    return rng.random((n,) + shape, dtype=np.float32), rng.integers(0, 10, n)


# threads per part, for the job and the one-process reference alike (0: each device's
# default). A convolution's weight gradient is summed per thread, so the two must agree:
# ranks sharing a host split its cores as logical devices do, but a rank alone on its
# host (tests/test_distributed.py's two simulated hosts) would take them all.
THREADS = int(os.environ.get("DPCORE_TEST_THREADS", "0"))


def lenet():
    return dp.models.LeNet(seed=4, threads=THREADS)


def resnet():
    return dp.models.ResNet18(seed=4, input_size=12, threads=THREADS)


def one_process(model_fn, k, replicas, steps, X, y, Xt, kind="cpu"):
    """The one-process strategy over k * replicas logical devices of `kind` (GPUs: logical
    GPUs of GPU 0, as the job's ranks share it): (losses, weights, logits)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # more logical devices than cores
        dp.set_logical_devices(kind, k * replicas)
    with dp.ModelParallelStrategy(devices=[f"{kind}:{i}" for i in range(k * replicas)], replicas=replicas).scope():
        net = model_fn()
    losses = [net.train_step(X, y, lr=0.1, momentum=0.9) for _ in range(steps)]
    out = losses, net.get_weights(), net.predict(Xt)
    del net
    dp.set_logical_devices(kind, 1)
    return out


def across(model_fn, replicas, steps, X, y, Xt, **kw):
    with dp.ModelParallelStrategy(replicas=replicas, **kw).scope():
        net = model_fn()
    losses = [net.train_step(X, y, lr=0.1, momentum=0.9) for _ in range(steps)]
    return net, losses, net.get_weights(), net.predict(Xt)


def same_bits(a, b):
    bad = [n for n in a if not np.array_equal(np.asarray(a[n]).view(np.uint32), np.asarray(b[n]).view(np.uint32))]
    if bad:
        say(f"differ: {bad[:4]} {[float(np.abs(a[n] - b[n]).max()) for n in bad[:4]]}")
    return not bad and a.keys() == b.keys()


def compare(name, model_fn, shape, replicas, n=9, steps=2, kind="cpu", **kw):
    X, y = data(n, shape)
    Xt, _ = data(5, shape, seed=1)
    net, losses, weights, logits = across(model_fn, replicas, steps, X, y, Xt, **kw)
    k = world // replicas
    ref_losses, ref_weights, ref_logits = one_process(model_fn, k, replicas, steps, X, y, Xt, kind)
    say(f"{name}: losses equal {losses == ref_losses}, weights bitwise {same_bits(weights, ref_weights)}, "
        f"logits bitwise {np.array_equal(logits.view(np.uint32), ref_logits.view(np.uint32))}, "
        f"devices {net.devices}")
    return net


def main():
    for case in sys.argv[1].split(","):
        run(case)


def run(case):
    if case == "equal":
        compare("lenet", lenet, (1, 28, 28), 1)
        net = compare("resnet", resnet, (1, 12, 12), 1, n=7)
        rep = net.model_parallel_report()
        say(f"report fractions sum {sum(rep.fraction):.6f} over {len(rep.param_bytes)} ranks")
        # a rank-named device list, in another order: rank 1's slice first
        order = [f"rank{q}/cpu:0" for q in reversed(range(world))]
        compare("reversed", lenet, (1, 28, 28), 1, devices=order)
    elif case == "gpu":
        # every rank's slices on GPU 0 (host gathers, no NCCL: ranks may share a GPU), against
        # logical GPUs of GPU 0 in one process
        gpus = [f"rank{q}/cuda:0" for q in range(world)]
        compare("lenet gpu", lenet, (1, 28, 28), 1, kind="cuda", devices=gpus)
        compare("resnet gpu", resnet, (1, 12, 12), 1, n=7, kind="cuda", devices=gpus)
    elif case == "gpu-replicas":
        # 2 copies x 2 ranks, every slice on GPU 0: the copies' gradients summed on the host and
        # written back into GPU memory, against 4 logical GPUs of GPU 0 in one process
        gpus = [f"rank{q}/cuda:0" for q in range(world)]
        compare("lenet gpu x2", lenet, (1, 28, 28), 2, kind="cuda", devices=gpus)
        compare("resnet gpu x2", resnet, (1, 12, 12), 2, n=7, kind="cuda", devices=gpus)
    elif case == "replicas":
        compare("lenet x2", lenet, (1, 28, 28), 2)
        net = compare("resnet x2", resnet, (1, 12, 12), 2, n=7)
        say(f"copies identical {net._pipeline.replicas_identical()}")
        # fewer samples than copies: the copy without any adds nothing, as in one process
        compare("one sample", lenet, (1, 28, 28), 2, n=1, steps=1)
    elif case == "checkpoint":
        path = os.path.join(sys.argv[2], "split.safetensors")
        X, y = data(64, (1, 28, 28))
        with dp.ModelParallelStrategy().scope():
            net = lenet()
        train_iter = dp.data.from_arrays(X, y, batch_size=16, shuffle=True, seed=0)
        history = dp.train(net, train_iter, None, num_epochs=2, lr=0.1, checkpoint=path, verbose=False,
                           progress=False)
        logits = net.predict(X[:5])
        say(f"history devices {history.devices} losses {[round(v, 6) for v in history.train_loss]}")
        dp.distributed.barrier()
        if rank == 0:
            alone = dp.models.load(path)
            say(f"loaded in one process: logits bitwise "
                f"{np.array_equal(alone.predict(X[:5]).view(np.uint32), logits.view(np.uint32))}")
    elif case == "failure":
        X, y = data(9, (1, 28, 28))
        with dp.ModelParallelStrategy(timeout=20).scope():
            net = lenet()
        before = net.get_weights()
        tp = net._pipeline
        layer = 3  # LeNet's second convolution

        class Broken:
            def __init__(self, model):
                self.model = model

            def stage_forward(self, *a, **kw):
                raise RuntimeError("injected failure in this rank's slice")

            def __getattr__(self, name):
                return getattr(self.model, name)

        if rank == 1:
            tp.mine[layer] = Broken(tp.mine[layer])
        try:
            net.train_step(X, y, lr=0.1)
            say("no error")
        except Exception as e:  # noqa: B902 - printed for the test to read
            say(f"{type(e).__name__}: {e}")
        if rank == 1:
            tp.mine[layer] = tp.mine[layer].model
        say(f"unchanged after the failed step {same_bits(net.get_weights(), before)}")
        loss, _ = net.train_step(X, y, lr=0.1)
        say(f"the next step runs: loss finite {np.isfinite(loss)}")
    elif case == "killed":
        X, y = data(9, (1, 28, 28))
        with dp.ModelParallelStrategy(timeout=20).scope():
            net = lenet()
        net.train_step(X, y, lr=0.1)
        if rank == 1:
            os._exit(3)  # dies between two steps' gathers: rank 0 waits in the next one
        start = time.monotonic()
        try:
            net.train_step(X, y, lr=0.1)
            say("no error")
        except Exception as e:  # noqa: B902
            say(f"{type(e).__name__} after {time.monotonic() - start:.0f} s: {e}")
    else:
        raise SystemExit(f"unknown case {case}")


if __name__ == "__main__":
    main()
