"""The gradient all-reduce of mirrored models (csrc/comm.c, csrc/mirrored.c).

On the CPU this checks what the GPU kinds share with the host kind: the bucket
plan, the backward hook that starts each bucket as soon as its layers are done,
the one-fork-join step, and that a replica failing in the middle of a step
makes its peers give up instead of hanging. The arithmetic of the logical-GPU
kernel (dp_allreduce_elem) is checked bit for bit against the CPU all-reduce in
tests/c/kernel_bodies.c; the GPU kinds themselves are at the end (marked gpu).

Numerics: bucketed and whole-buffer all-reduces are compared BITWISE, which
dpcore guarantees: each replica runs the same kernels on the same shard in both
models, and collective.c sums every element in rank order ((p0 + p1) + p2 ...)
whichever bucket holds it, storing the one sum to every replica. Models whose
replicas run other shapes (k replicas against one, GPUs against the CPU) are
compared with the float64 reference instead, within test_lenet's GRAD_TOL.
"""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import dpcore as dp
from test_lenet import GRAD_TOL, NAMES, as_unit64, grads_by_name, random_weights, ref_loss_grads, rel, to64

SMALL_RESNET = dict(
    layers=[("conv2d", 8, 3, 1, 1), ("batchnorm",), ("relu",),
            ("conv2d", 8, 3, 1, 1), ("batchnorm",), ("add", 4, 2), ("relu",),
            ("conv2d", 16, 3, 2, 1), ("batchnorm",), ("relu",),
            ("conv2d", 16, 1, 2, 0), ("add", 9, 10), ("global_avgpool",), ("flatten",), ("dense", 10)],
    sources=[None, None, None, None, None, None, None, None, None, None, 6, None, None, None, None],
    input_shape=(1, 12, 12),
)


@pytest.fixture(autouse=True)
def four_cpu_devices(logical_cpus):
    logical_cpus(4)


def batch(shape, n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n,) + tuple(shape)).astype(np.float32), rng.integers(0, 10, n).astype(np.int64)


def small_resnet(k, **kw):
    return dp.models.Sequential(SMALL_RESNET["layers"], input_shape=SMALL_RESNET["input_shape"],
                                sources=SMALL_RESNET["sources"], init="torch",
                                devices=[f"cpu:{r}" for r in range(k)], **kw)


# ---- the bucket plan ----------------------------------------------------------


@pytest.mark.parametrize("bucket_mb", [0, 1e-4, 0.01, 0.05, 1, 25])
def test_buckets_tile_the_gradient_buffer_in_backward_order(bucket_mb):
    net = dp.models.ResNet18(devices=["cpu:0", "cpu:1"], bucket_mb=bucket_mb)
    buckets = net.gradient_buckets
    nparams = net._model.nparams
    layout = net._layout  # (layer, kind, offset, shape)
    first_offset = {}
    for layer, _, offset, _ in layout:
        first_offset.setdefault(layer, offset)
    # contiguous, from the end of the buffer to its start
    assert buckets[0][1] == nparams and buckets[-1][0] == 0
    for (b0, e0, r0), (b1, e1, r1) in zip(buckets, buckets[1:]):
        assert e1 == b0 and r1 < r0
    floats = bucket_mb * 2**20 / 4
    for i, (begin, end, ready) in enumerate(buckets):
        # a bucket starts where its ready layer's parameters start, and holds
        # only layers at or after it (done before it in the backward pass)
        assert begin == (0 if i == len(buckets) - 1 else first_offset[ready])
        inside = {layer for layer, _, offset, _ in layout if begin <= offset < end}
        assert inside and min(inside) == ready
        if i < len(buckets) - 1 and bucket_mb > 0:
            assert end - begin >= floats
    if bucket_mb == 0:
        assert len(buckets) == 1
    if bucket_mb == 1e-4:  # smaller than any layer: one bucket per layer with parameters
        assert len(buckets) == len(first_offset)
    if bucket_mb == 25:  # ResNet-18's 44.7 MB: two buckets
        assert len(buckets) == 2


def test_single_replica_has_no_collective():
    net = dp.models.LeNet(devices=["cpu:0"])
    assert net.all_reduce is None and net.gradient_buckets == []


@pytest.mark.parametrize("bad, error", [("fast", ValueError), (3, TypeError)])
def test_bad_all_reduce_is_refused(bad, error):
    with pytest.raises(error, match="all_reduce"):
        dp.MirroredStrategy(devices=["cpu:0", "cpu:1"], all_reduce=bad)
    with pytest.raises(error, match="all_reduce"):
        dp.models.LeNet(devices=["cpu:0", "cpu:1"], all_reduce=bad)


@pytest.mark.parametrize("bad, error", [(-1, ValueError), (float("nan"), ValueError), ("25", TypeError),
                                        (True, TypeError)])
def test_bad_bucket_size_is_refused(bad, error):
    with pytest.raises(error, match="bucket_mb"):
        dp.MirroredStrategy(devices=["cpu:0", "cpu:1"], bucket_mb=bad)


@pytest.mark.parametrize("kind", ["kernel", "nccl"])
def test_gpu_all_reduce_on_cpu_replicas_is_refused(kind):
    with pytest.raises((ValueError, dp.DpcoreError), match=kind):
        dp.models.LeNet(devices=["cpu:0", "cpu:1"], all_reduce=kind)


def test_strategy_options_reach_its_models():
    strategy = dp.MirroredStrategy(devices=["cpu:0", "cpu:1"], all_reduce="host", bucket_mb=0.05)
    with strategy.scope():
        net = dp.models.LeNet()
    assert net.all_reduce == "host" and len(net.gradient_buckets) == 3
    assert "bucket_mb=0.05" in repr(strategy)


# ---- buckets change nothing but the timing -----------------------------------------


def train_steps(net, shape, steps=3, n=24, **kw):
    losses = []
    for s in range(steps):
        X, y = batch(shape, n, seed=s)
        losses.append(net.train_step(X, y, lr=0.05, momentum=0.9, **kw))
    return losses


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("sync_batchnorm", [False, True])
def test_bucketed_all_reduce_is_bitwise_the_whole_buffer_all_reduce(k, sync_batchnorm):
    """Every element is summed over the replicas in rank order whichever bucket
    holds it, so many small buckets started during the backward pass give the
    same bits as one all-reduce after it: parameters, momentum-driven steps,
    running statistics and losses."""
    one = small_resnet(k, bucket_mb=0, sync_batchnorm=sync_batchnorm)
    many = small_resnet(k, bucket_mb=1e-5, sync_batchnorm=sync_batchnorm)
    assert len(one.gradient_buckets) == 1 and len(many.gradient_buckets) == 8  # one per layer with parameters
    shape = SMALL_RESNET["input_shape"]
    assert train_steps(one, shape) == train_steps(many, shape)
    w1, w2 = one.get_weights(), many.get_weights()
    assert w1.keys() == w2.keys()
    for name in w1:
        np.testing.assert_array_equal(w1[name], w2[name], err_msg=name)
    for r in range(k):
        np.testing.assert_array_equal(one._replicas[r].get_params(), many._replicas[r].get_params())
        np.testing.assert_array_equal(one._replicas[r].get_grads(), many._replicas[r].get_grads())


def test_bucketed_lenet_matches_one_replica():
    """The mean gradient of the global batch: k replicas with buckets against one replica. The
    shards (17, 17, 16 samples) run other GEMM shapes than the batch of 50 and their sum is
    taken in another order, so nothing makes the bits equal: both are compared with the float64
    reference per tensor within test_lenet's GRAD_TOL (so they differ by at most 2 GRAD_TOL of
    the tensor's largest gradient), and every replica holds the same bits (collective.c stores
    one rank-ordered sum to every buffer)."""
    W0 = random_weights(1)
    single = dp.models.LeNet(devices=["cpu:0"])
    multi = dp.models.LeNet(devices=["cpu:0", "cpu:1", "cpu:2"], bucket_mb=0.001)
    single.set_weights(W0)
    multi.set_weights(W0)
    assert len(multi.gradient_buckets) == 4
    X, y = batch((1, 28, 28), 50)
    single.train_step(X, y, lr=0.0)
    multi.train_step(X, y, lr=0.0)
    flats = [r.get_grads() for r in multi._replicas]
    assert all(np.array_equal(f.view(np.uint32), flats[0].view(np.uint32)) for f in flats[1:])
    _, G, _ = ref_loss_grads(to64(W0), as_unit64(X), y)
    for net in (single, multi):
        g = grads_by_name(net)
        for n in NAMES:
            e = rel(g[n], G[n])
            assert e <= GRAD_TOL, f"{len(net.devices)} replica(s): gradient {n} rel {e:.3g}"


# ---- a replica that fails mid-step --------------------------------------------------

FAILING_STEP = textwrap.dedent("""
    import os
    import numpy as np
    import dpcore as dp
    dp.set_logical_devices("cpu", 3)
    net = dp.models.LeNet(devices=["cpu:0", "cpu:1", "cpu:2"], bucket_mb=0.01)
    before = [r.get_params() for r in net._replicas]
    rng = np.random.default_rng(0)
    X = rng.standard_normal((30, 1, 28, 28)).astype(np.float32)
    y = rng.integers(0, 10, 30).astype(np.int64)
    assert os.environ["DPCORE_TEST_FAIL_REPLICA"] == "2"
    try:
        net._mirrored.train_step(X, y, 0.1)
    except RuntimeError as e:
        assert "replica 2: the failure planted" in str(e), e
        assert "aborted" not in str(e), e  # the cause is reported, not a peer's giving up
    else:
        raise SystemExit("no error")
    # the peers gave up at their first bucket, before any step: nothing changed
    for b, r in zip(before, net._replicas):
        np.testing.assert_array_equal(b, r.get_params())
    # and the group works again
    del os.environ["DPCORE_TEST_FAIL_REPLICA"]
    loss, hits = net._mirrored.train_step(X, y, 0.1)
    assert np.isfinite(loss)
    after = [r.get_params() for r in net._replicas]
    assert all(np.array_equal(after[0], a) for a in after) and not np.array_equal(after[0], before[0])
    print("recovered")
""")


def test_a_failing_replica_never_hangs_its_peers():
    """Replica 2 fails inside the step (DPCORE_TEST_FAIL_REPLICA, a switch for tests: the batch
    checks refuse bad input before any replica starts, so a planted failure is how a test reaches
    this path); replicas 0 and 1 run their forward and backward passes and would wait for it at the
    first gradient bucket forever but for the broken barrier. Run in a subprocess with a timeout,
    so that a hang fails the test instead of the suite."""
    proc = subprocess.run([sys.executable, "-c", FAILING_STEP], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, DPCORE_TEST_FAIL_REPLICA="2"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "recovered" in proc.stdout


def test_a_bad_planted_replica_index_is_refused():
    code = ("import dpcore as dp, numpy as np; dp.set_logical_devices('cpu', 2); "
            "net = dp.models.LeNet(devices=['cpu:0', 'cpu:1']); "
            "net.train_step(np.zeros((4, 1, 28, 28), np.float32), np.zeros(4, np.int64), lr=0.1)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, DPCORE_TEST_FAIL_REPLICA="5"))
    assert proc.returncode != 0 and "DPCORE_TEST_FAIL_REPLICA=5: expected a replica index in [0, 2)" in proc.stderr


# ---- dp.all_reduce: one kept group per device set -------------------------------------


def test_repeated_all_reduce_reuses_one_thread_group():
    """dp.all_reduce goes through a group kept for its device set (mirrored.c):
    1000 calls make at most one group of replica threads, not 1000, and every
    call still gives the rank-ordered sum / mean."""
    devices = ["cpu:0", "cpu:1", "cpu:2"]
    rng = np.random.default_rng(3)
    base = [rng.standard_normal(1000).astype(np.float32) for _ in devices]
    ts = [dp.tensor(b, device=d) for b, d in zip(base, devices)]
    dp.all_reduce(ts, op="mean")  # the group for these devices exists from here on
    before = dp._core.debug_counters()["groups_created"]
    for _ in range(1000):
        dp.all_reduce(ts, op="mean")  # the mean of equal tensors: bounded, every replica the same bits
    assert dp._core.debug_counters()["groups_created"] == before
    assert all(np.array_equal(t.numpy().view(np.uint32), ts[0].numpy().view(np.uint32)) for t in ts)
    fresh = [dp.tensor(b, device=d) for b, d in zip(base, devices)]
    dp.all_reduce(fresh)
    total = (base[0] + base[1]) + base[2]
    for t in fresh:
        np.testing.assert_array_equal(t.numpy().view(np.uint32), total.view(np.uint32))
    assert dp._core.debug_counters()["groups_created"] == before


def test_all_reduce_from_several_threads_on_one_device_set():
    """Calls on the same device set from several Python threads take turns on
    its kept group: each reduces its own tensors, exactly."""
    import threading

    devices = ["cpu:0", "cpu:1"]
    errors = []

    def worker(seed):
        try:
            for i in range(100):
                a = np.full(257, float(seed + i), np.float32)
                b = np.full(257, float(2 * seed + i), np.float32)
                ts = [dp.tensor(a, device=devices[0]), dp.tensor(b, device=devices[1])]
                dp.all_reduce(ts)
                for t in ts:
                    np.testing.assert_array_equal(t.numpy(), a + b)
        except Exception as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in (1, 1000, 5000)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_all_reduce_over_more_device_sets_than_are_kept():
    """More device sets than groups are kept (8): the least recently used is
    replaced, and every call is still exact."""
    for rep in range(2):
        for pair in range(4):
            for other in range(4):
                if other == pair:
                    continue
                devices = [f"cpu:{pair}", f"cpu:{other}"]
                ts = [dp.tensor(np.full(5, 1.0 + pair, np.float32), device=devices[0]),
                      dp.tensor(np.full(5, 10.0 * other, np.float32), device=devices[1])]
                dp.all_reduce(ts)
                for t in ts:
                    np.testing.assert_array_equal(t.numpy(), np.full(5, 1.0 + pair + 10.0 * other, np.float32))


# ---- on GPUs (skipped with the reason where none is usable) ---------------------------

RUNTIME = dp._core.runtime_info()
GPUS = RUNTIME["cuda_device_count"] if dp.build_info().get("cuda_backend") else 0
NO_GPU = "no usable CUDA device: " + (RUNTIME["cuda_why"] if dp.build_info().get("cuda_backend")
                                      else "dpcore was built without the CUDA backend")


def logical_gpus(k):
    dp.set_logical_devices("cuda", k)
    return [f"cuda:{r}" for r in range(k)]


@pytest.fixture
def restore_gpus():
    yield
    if GPUS:
        dp.set_logical_devices("cuda", 1)


@pytest.mark.gpu
@pytest.mark.skipif(GPUS == 0, reason=NO_GPU)
def test_nccl_refuses_logical_gpus_of_one_gpu(restore_gpus):
    devices = logical_gpus(2)
    if not dp.build_info().get("nccl_linked"):
        pytest.skip("dpcore was built without NCCL")
    with pytest.raises(ValueError, match="same physical GPU"):
        dp.models.LeNet(devices=devices, all_reduce="nccl")


@pytest.mark.gpu
@pytest.mark.skipif(GPUS == 0, reason=NO_GPU)
@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("sync_batchnorm", [False, True])
def test_logical_gpus_bucketed_equals_whole_buffer(restore_gpus, k, sync_batchnorm):
    """The kernel kind over logical GPUs: buckets overlapping the backward pass
    (a second stream, events) give the bits of one all-reduce after it."""
    devices = logical_gpus(k)
    kw = dict(layers=SMALL_RESNET["layers"], input_shape=SMALL_RESNET["input_shape"],
              sources=SMALL_RESNET["sources"], init="torch", devices=devices, sync_batchnorm=sync_batchnorm)
    one = dp.models.Sequential(bucket_mb=0, **kw)
    many = dp.models.Sequential(bucket_mb=1e-5, **kw)
    assert one.all_reduce == many.all_reduce == "kernel"
    shape = SMALL_RESNET["input_shape"]
    assert train_steps(one, shape) == train_steps(many, shape)
    for r in range(k):
        np.testing.assert_array_equal(one._replicas[r].get_params(), many._replicas[r].get_params())


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 2, reason="NCCL needs two physical GPUs (%d usable)" % GPUS)
def test_nccl_across_gpus_matches_the_cpu():
    """cuDNN / cuBLAS and NCCL against the CPU's kernels: nothing makes their bits equal, so both
    are compared with the float64 reference per tensor within test_lenet's GRAD_TOL."""
    W0 = random_weights(1)
    net = dp.models.LeNet(devices=["cuda:0", "cuda:1"], bucket_mb=0.01)
    assert net.all_reduce == "nccl"
    cpu = dp.models.LeNet(devices=["cpu:0", "cpu:1"])
    X, y = batch((1, 28, 28), 64)
    _, G, _ = ref_loss_grads(to64(W0), as_unit64(X), y)
    for model in (net, cpu):
        model.set_weights(W0)
        model.train_step(X, y, lr=0.0)
        for r in model._replicas:
            flat = r.get_grads()
            for layer, kind, off, shape in r.param_layout():
                n = f"{layer}.{kind}"
                e = rel(flat[off:off + int(np.prod(shape))].reshape(shape), G[n])
                assert e <= GRAD_TOL, f"{model.devices}: gradient {n} rel {e:.3g}"


def test_cpu_replicas_have_no_device_arena():
    assert dp.models.LeNet(devices=["cpu:0", "cpu:1"]).memory_stats() == [None, None]
