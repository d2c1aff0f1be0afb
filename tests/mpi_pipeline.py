"""What tests/test_pipeline_mpi.py runs under mpirun: ``python tests/mpi_pipeline.py CASE [DIR]``.
Each rank prints ``rank R: <line>`` results the test reads.

The one-process references run in rank 0 after the job, on logical CPU devices
(one per stage of the job), with the job's split: the same stages, so the same
arithmetic, and the job must give their bits."""
import os
import sys
import time
import warnings
import zlib

import numpy as np

import dpcore as dp
from dpcore import distributed as dist, pipeline

RANK = dist.rank()
WORLD = dist.world_size()


def say(text):
    print(f"rank {RANK}: {text}", flush=True)


def data(n, shape=(1, 28, 28), seed=0):
    rng = np.random.default_rng(seed)
    return rng.random((n,) + shape, dtype=np.float32), rng.integers(0, 10, n)


# threads per part, for the job and the one-process reference alike (0: each device's
# default). A convolution's weight gradient is summed per thread, so the two must agree:
# ranks sharing a host split its cores as logical devices do, but a rank alone on its
# host (tests/test_distributed.py's two simulated hosts) would take them all.
THREADS = int(os.environ.get("DPCORE_TEST_THREADS", "0"))


def lenet():
    return dp.models.LeNet(threads=THREADS)


def resnet():
    return dp.models.ResNet18(input_size=12, threads=THREADS)


# name -> (model, samples, input shape, strategy arguments); replicas come from the case
CONFIGS = {
    "lenet-1f1b": (lenet, 25, (1, 28, 28), dict(schedule="1f1b", micro_batches=3)),  # measured by rank 0
    "lenet-gpipe": (lenet, 26, (1, 28, 28), dict(schedule="gpipe", micro_batches=4, balance="flops")),
    # 3 stages on 2 ranks, rank 0 holding the first and the last: channels both ways between
    # the two ranks, and a stage that hands over to a stage of its own process
    "lenet-interleaved": (lenet, 25, (1, 28, 28), dict(schedule="1f1b", micro_batches=4, balance="flops",
                                                       devices=["rank0/cpu:0", "rank1/cpu:0", "rank0/cpu:1"])),
    "resnet-1f1b": (resnet, 12, (1, 12, 12), dict(schedule="1f1b", micro_batches=2, balance="flops")),
    # stages that begin at evenly spaced block boundaries: BatchNorm in every stage
    "resnet-gpipe": (resnet, 12, (1, 12, 12), dict(schedule="gpipe", micro_batches=3, split="spread")),
    # the GPU twins: both ranks' stages on GPU 0 (host hand-over: ranks may share a GPU),
    # against logical GPUs of GPU 0 in one process
    "lenet-gpu": (lenet, 26, (1, 28, 28), dict(schedule="1f1b", micro_batches=4, balance="flops",
                                               devices=["rank0/cuda:0", "rank1/cuda:0"])),
    "resnet-gpu": (resnet, 12, (1, 12, 12), dict(schedule="gpipe", micro_batches=3, balance="flops",
                                                 devices=["rank0/cuda:0", "rank1/cuda:0"])),
    # two physical GPUs: activations and gradients by NCCL from GPU to GPU
    "lenet-2gpu": (lenet, 26, (1, 28, 28), dict(schedule="1f1b", micro_batches=4, balance="flops",
                                                devices=["rank0/cuda:0", "rank1/cuda:1"])),
    "resnet-2gpu": (resnet, 12, (1, 12, 12), dict(schedule="gpipe", micro_batches=3, balance="flops",
                                                  devices=["rank0/cuda:0", "rank1/cuda:1"])),
}


def kind_of(kw):
    """The kind of device a configuration's stages run on ('cuda' or 'cpu')."""
    return "cuda" if any("cuda" in d for d in kw.get("devices", [])) else "cpu"


def spread(stages):
    arch = dp.models.ResNet18._architecture(10, 1, 12)
    cuts = pipeline.valid_cuts(arch["layers"], arch["sources"])
    return [0] + [cuts[len(cuts) * i // stages] for i in range(1, stages)]


def steps(net, X, y, n=2):
    return [net.train_step(X, y, lr=0.1, momentum=0.9) for _ in range(n)]


def whole(net):
    """The whole network's parameter, statistics and momentum bits (collective in a job)."""
    m = net._model
    return np.concatenate([m.get_params(), m.get_state(), m.get_velocity()]).view(np.uint32)


def equal(names, replicas=1):
    """Each configuration trained 2 steps by the job; every rank prints a digest of
    its losses and whole-network bits, rank 0 whether they are the one-process
    pipeline's on the same stages (computed afterwards)."""
    if RANK == 0:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # more logical devices than cores
            for kind in {kind_of(CONFIGS[name][3]) for name in names}:
                dp.set_logical_devices(kind, max(WORLD, 3))  # one per stage of the references
    jobs = {}
    for name in names:
        model, n, shape, kw = CONFIGS[name]
        X, y = data(n, shape)
        if kw.get("split") == "spread":
            kw = dict(kw, split=spread(WORLD // replicas))
        with dp.PipelineStrategy(replicas=replicas, timeout=30, **kw).scope():
            net = model()
        assert net.devices == kw.get("devices", [f"rank{q}/cpu:0" for q in range(WORLD)]), net.devices
        losses = steps(net, X, y)
        bits = whole(net)
        say(f"{name} digest {zlib.crc32(bits.tobytes() + repr(losses).encode()):08x}")
        say(f"{name} identical copies {net._pipeline.replicas_identical()}")
        say(f"{name} by nccl {sorted(net._pipeline._by_nccl.items())}")
        jobs[name] = (net._pipeline.split, len(net.devices), losses, bits)
    if RANK != 0:
        return
    for name in names:
        model, n, shape, kw = CONFIGS[name]
        X, y = data(n, shape)
        split, devices, losses, bits = jobs[name]
        with dp.PipelineStrategy(replicas=replicas, **dict(kw, split=split, devices=[
                f"{kind_of(kw)}:{i}" for i in range(devices)])).scope():
            ref = model()
        ref_losses = steps(ref, X, y)
        say(f"{name} split {split} equal {ref_losses == losses and np.array_equal(whole(ref), bits)}")


def two():
    equal(["lenet-1f1b", "lenet-gpipe", "lenet-interleaved", "resnet-1f1b", "resnet-gpipe"])
    train(sys.argv[2])


def three():
    equal(["lenet-gpipe", "resnet-1f1b"])


def replicated():
    equal(["lenet-1f1b", "resnet-gpipe"], replicas=2)


def train(folder):
    """dp.train with a checkpoint: the same History on every rank, rank 0 writes the
    whole network, which loads in one process; evaluate, predict and the report; a
    run resumed from a checkpoint ends with the straight run's bits."""
    X, y = data(60, seed=3)
    it = dp.data.from_arrays(X, y, batch_size=20, shuffle=True, seed=0)
    test = dp.data.from_arrays(X, y, batch_size=25)
    with dp.PipelineStrategy(micro_batches=2, balance="flops", timeout=30).scope():
        net = dp.models.LeNet()
    path = os.path.join(folder, "pipe.safetensors")
    h = dp.train(net, it, test, num_epochs=2, lr=0.2, momentum=0.9, verbose=False, checkpoint=path)
    say(f"history {h.train_loss} {h.train_acc} {h.test_acc} {h.devices}")
    pred = net.predict(X)
    metrics = net.evaluate(test)
    weights = net.get_weights()
    say(f"predict {zlib.crc32(pred.tobytes()):08x} {pred.shape} evaluate {metrics}")
    r = net.pipeline_report()
    say(f"report steps {r.steps} stages {r.stages} busy {all(b > 0 for b in r.busy_seconds)} "
        f"ops {len(r.timeline)} devices {r.devices}")
    # resumed: 1 epoch checkpointed, then a fresh net resumes it to 2: the straight run's bits
    half = os.path.join(folder, "half.safetensors")
    for epochs in (1, 2):
        with dp.PipelineStrategy(micro_batches=2, balance="flops", timeout=30).scope():
            again = dp.models.LeNet(seed=0 if epochs == 1 else 5)  # the resumed one from other weights
        it = dp.data.from_arrays(X, y, batch_size=20, shuffle=True, seed=0)
        dp.train(again, it, test, num_epochs=epochs, lr=0.2, momentum=0.9, verbose=False, checkpoint=half,
                 resume=epochs == 2)
    say(f"resumed equal {np.array_equal(whole(again), whole(net))}")
    # a NaN weight in stage 1 (set on every rank): every rank stops at the same step, and
    # check_numerics names the layer from a re-run of the gathered network
    w = net.get_weights()
    w["7.weight"][3, 17] = np.nan
    net.set_weights(w, allow_nonfinite=True)
    try:
        dp.train(net, it, num_epochs=1, lr=0.2, verbose=False, check_numerics=True)
    except FloatingPointError as e:
        say(f"FloatingPointError {e}")
    dist.barrier(30)
    if RANK == 0:
        one = dp.models.load(path, devices=["cpu:0"])
        loaded = one.get_weights()
        same = list(loaded) == list(weights) and all(np.array_equal(loaded[k], weights[k]) for k in weights)
        got = one.predict(X)
        say(f"checkpoint weights {same} predictions differ by {float(np.abs(got - pred).max()):.1e} "
            f"argmax {bool((got.argmax(1) == pred.argmax(1)).all())} "
            f"accuracy {one.evaluate(test).accuracy == metrics.accuracy}")


class FailingStage:
    """A stage model whose forward pass of micro-batch `at` fails: raises, or kills the process."""

    def __init__(self, model, at, kill):
        self._model, self._at, self._kill, self._calls = model, at, kill, 0

    def __getattr__(self, name):
        return getattr(self._model, name)

    def stage_forward(self, *args, **kw):
        if self._calls == self._at:
            if self._kill:
                os._exit(7)
            raise RuntimeError(f"injected failure in stage 1 on rank {RANK}")
        self._calls += 1
        return self._model.stage_forward(*args, **kw)


def failure(kill):
    X, y = data(40)
    try:  # a device rank 1 does not have: an error on every rank, not a wait for rank 1
        dp.PipelineStrategy(devices=["rank0/cpu:0", "rank1/cpu:5"], timeout=5)
    except ValueError as e:
        say(f"ValueError {e}")
    with dp.PipelineStrategy(micro_batches=4, split=[0, 6], timeout=60 if kill else 5).scope():
        net = dp.models.LeNet()
    net.train_step(X, y, lr=0.1)  # a step that goes through
    try:  # a rank with another batch: refused on every rank before anything moves, and the job goes on
        net.train_step(X[:39] if RANK == 1 else X, y[:39] if RANK == 1 else y, lr=0.1)
    except dist.DistributedError as e:
        say(f"DistributedError {e}")
    try:
        net.predict(X[:5] if RANK == 0 else X[5:10])
    except dist.DistributedError as e:
        say(f"DistributedError {e}")
    net.train_step(X, y, lr=0.1)
    if RANK == 1:
        net._pipeline.local_models[(0, 1)] = FailingStage(net._pipeline.local_models[(0, 1)], 1, kill)
    start = time.monotonic()
    try:
        net.train_step(X, y, lr=0.1)
        say("no error")
    except Exception as e:  # noqa: BLE001 - printed for the test
        say(f"{type(e).__name__} after {time.monotonic() - start:.0f} s: {e}")


CASES = {"two": two, "three": three, "replicated": replicated, "hosts": lambda: equal(["lenet-gpipe", "resnet-1f1b"]),
         "gpu": lambda: equal(["lenet-gpu", "resnet-gpu"]), "2gpu": lambda: equal(["lenet-2gpu", "resnet-2gpu"]),
         "raise": lambda: failure(False),
         "kill": lambda: failure(True)}

if __name__ == "__main__":
    CASES[sys.argv[1]]()
