"""The device registry (csrc/device.h): one refcounted device per name, shared
by every model and tensor on it; the logical-device configuration and the core
shares; tensors as allocations on their device; one call at a time per device.

GPU-only behaviour is marked ``gpu`` and skipped, with the reason, where no CUDA
device is usable (as tests/test_gpu.py): tensors round-trip through GPU memory,
replica.grads on CUDA replicas, and the chapter 12.5 loop on two logical GPUs
equals net.train_step.

Numerics: bitwise equality is asserted only where dpcore runs the same kernels
in the same order on the same thread count (a model and its twin on one
device; two models stepped one after the other or at once under the device's
step lock; the chapter 12.5 loop, whose replicas run the shards, the
rank-ordered all-reduce and the SGD kernel that net.train_step runs). A model
on another thread count is compared with the float64 reference (test_lenet's
STEP_TOL for one step), not with the other model's bits.
"""
import gc
import threading

import numpy as np
import pytest

import dpcore as dp
from test_lenet import NAMES, STEP_TOL, as_unit64, random_weights, ref_loss_grads, rel, to64

RUNTIME = dp._core.runtime_info()
CORES = RUNTIME["cpu_cores"]
GPUS = RUNTIME["cuda_device_count"] if dp.build_info().get("cuda_backend") else 0
gpu_only = pytest.mark.skipif(GPUS == 0, reason="no usable CUDA device: " + (
    RUNTIME["cuda_why"] if dp.build_info().get("cuda_backend") else "dpcore was built without the CUDA backend"))


@pytest.fixture(autouse=True)
def one_cpu_device():
    dp.set_logical_devices("cpu", 1)
    yield
    dp.set_logical_devices("cpu", 1)


def live(name=None):
    """[(name, threads, references)] of the registry's live devices (named `name`)."""
    gc.collect()
    return sorted((n, threads, refs) for n, _, _, _, threads, refs in dp._core.live_devices()
                  if name is None or n == name)


def refs(name, threads=None):
    return sum(r for n, t, r in live(name) if threads is None or t == threads)


def batch(n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.random((n, 1, 28, 28)).astype(np.float32), rng.integers(0, 10, n).astype(np.int64)


def bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


def share(index, k):
    """Today's rule: cores // k each, the first cores % k one more, at least one."""
    return max(1, CORES // k + (1 if index < CORES % k else 0))


# ---- the registry: made once, shared, released ---------------------------------------------------

def test_models_and_tensors_on_a_device_share_it_and_release_it():
    before = refs("cpu:0")
    a = dp.models.LeNet()
    b = dp.models.Sequential([("flatten",), ("dense", 10)])
    tensors = [dp.tensor(np.ones((2, 3)), "cpu:0"), dp.tensor(np.arange(4), "cpu:0")]
    grads = a.replicas[0].grads  # a view: holds the model, which holds the device
    entries = live("cpu:0")
    assert len(entries) == 1, entries  # one device, whatever holds it
    assert refs("cpu:0") == before + 4  # two models, two tensors
    assert entries[0][1] == CORES == a._model.threads == b._model.threads
    del a, b, tensors
    assert refs("cpu:0") == before + 1  # the view keeps its model, and so the device
    assert grads.numpy().shape == (grads.shape[0],)
    del grads
    assert refs("cpu:0") == before
    if before == 0:
        assert live("cpu:0") == []


def test_a_failed_tensor_or_model_leaves_no_reference():
    before = live()
    with pytest.raises(ValueError, match="unknown device"):
        dp._core.Tensor(np.ones(3, np.float32), "cpu:7")
    with pytest.raises(ValueError, match="unknown device"):
        dp._core.Tensor(np.ones(3, np.float32), "tpu:0")
    with pytest.raises(ValueError, match="cpu:0 .. cpu:0"):
        dp._core.Model((1, 28, 28), [("flatten",), ("dense", 10)], 0, 3)
    with pytest.raises(ValueError):
        dp._core.Model((1, 28, 28), [("flatten",), ("dense", 0)])
    assert live() == before


def test_an_explicit_thread_count_is_a_device_of_its_own():
    if CORES < 2:
        pytest.skip("needs two cores: one thread is every core's share here")
    shared = dp.models.LeNet()
    narrow = dp.models.LeNet(threads=1)
    assert (shared._model.threads, narrow._model.threads) == (CORES, 1)
    assert refs("cpu:0", 1) >= 1 and refs("cpu:0", CORES) >= 1
    X, y = batch(8)
    shared.train_step(X, y, lr=0.1)
    narrow.train_step(X, y, lr=0.1)


# ---- logical devices: the mapping and the core shares --------------------------------------------

def test_core_shares_follow_todays_rule(logical_cpus):
    for k in sorted({1, 2, 3, CORES, CORES + 1, 64}):
        logical_cpus(k)
        listing = dp._core.list_devices()
        assert [d[0] for d in listing] == [f"cpu:{i}" for i in range(k)] == dp.list_devices()[:k]
        assert [d[1:4] for d in listing[:k]] == [("cpu", i, -1) for i in range(k)]
        assert [d[4] for d in listing[:k]] == [share(i, k) for i in range(k)]
        assert [dp.devices.device_threads(f"cpu:{i}") for i in range(k)] == [share(i, k) for i in range(k)]
        if k <= CORES:
            assert sum(d[4] for d in listing[:k]) == CORES


def test_devices_made_before_set_logical_devices_keep_working(logical_cpus):
    """Old devices stay alive (with their cores) until released; new gets follow the new mapping."""
    old = dp.models.LeNet(seed=3)
    old_tensor = dp.tensor(np.full(5, 2.0), "cpu:0")
    logical_cpus(2)
    new = dp.models.LeNet(seed=3)
    assert old._model.threads == CORES and new._model.threads == share(0, 2)
    assert old_tensor.device == "cpu:0" and np.array_equal(old_tensor.numpy(), np.full(5, 2.0, np.float32))
    entries = live("cpu:0")
    assert {t for _, t, _ in entries} == {CORES, share(0, 2)}
    # an explicit count of every core asks for what the old device is: shared
    twin = dp.models.LeNet(seed=3, threads=CORES)
    assert len(live("cpu:0")) == len(entries)
    X, y = batch(16)
    W0 = random_weights(1)  # test_lenet's weights, at which its float64-referenced bounds are stated
    for net in (old, new, twin):
        net.set_weights(W0)
        net.train_step(X, y, lr=0.1)
    # bits are reproducible for a given thread count (backend_cpu.c): old and twin run the same
    # kernels on the same thread count
    assert np.array_equal(bits(old._model.get_params()), bits(twin._model.get_params()))
    # another thread count may split the sums otherwise (nothing makes those bits equal): each
    # model's one step against the float64 reference, within test_lenet's STEP_TOL
    _, G, _ = ref_loss_grads(to64(W0), as_unit64(X), y)
    for net in (old, new):
        W1 = net.get_weights()
        for n in NAMES:
            e = rel(W1[n].astype(np.float64) - W0[n], -0.1 * G[n])
            assert e <= STEP_TOL, f"{net._model.threads} threads: the update of {n} is off by {e:.3g}"
    # back to one device: a get of cpu:0 shares the old device again
    logical_cpus(1)
    before = refs("cpu:0", CORES)
    again = dp.models.LeNet()
    assert refs("cpu:0", CORES) == before + 1
    del old, old_tensor, new, twin, again


def test_set_logical_devices_refuses_and_changes_nothing():
    before = dp._core.list_devices()
    for count in (0, 65, 2**70, -(2**70)):
        with pytest.raises(ValueError, match="<= 64"):
            dp.set_logical_devices("cpu", count)
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        dp._core.set_logical_devices("tpu", 2)
    if GPUS == 0:
        with pytest.raises(ValueError, match="usable CUDA device"):
            dp.set_logical_devices("cuda", 2)
    assert dp._core.list_devices() == before


def test_a_model_on_a_logical_gpu_names_the_mapping_s_gpu():
    # checked before any GPU is touched: works on any machine
    with pytest.raises(ValueError, match="cuda:0 is logical GPU 0 of physical GPU 0"):
        dp._core.Model((1, 28, 28), [("flatten",), ("dense", 10)], device_kind="cuda", gpu=1)


# ---- tensors --------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", ["cpu:0", "cpu:1"])
def test_tensors_round_trip(device, logical_cpus):
    logical_cpus(2)
    rng = np.random.default_rng(0)
    for a in (rng.standard_normal((3, 4)).astype(np.float32), rng.integers(-5, 5, (2, 2, 2)),
              rng.integers(0, 256, (4, 1, 2, 2), dtype=np.uint8), np.zeros((0, 3), np.float32),
              np.array([7.5], np.float32)):
        t = dp.tensor(a, device)
        assert t.device == device and t.shape == np.shape(a)
        out = t.numpy()
        assert out.dtype == (np.asarray(a).dtype if np.asarray(a).dtype != np.int64 else np.int64)
        np.testing.assert_array_equal(out, a)
        out[...] = 0  # a copy: the tensor is unchanged
        np.testing.assert_array_equal(t.numpy(), a)
        view = t._view()  # CPU tensors have a host view of their memory
        if view.size:
            view.flat[0] = 1
            assert t.numpy().flat[0] == 1
    copy = dp.tensor(t, "cpu:0")
    assert copy.device == "cpu:0" and copy.numpy().tolist() == [1.0]  # the view's write


def test_scatter_broadcast_gather_keep_working(logical_cpus):
    logical_cpus(2)
    parts = dp.scatter(np.arange(20).reshape(4, 5), ["cpu:0", "cpu:1"])
    assert [p.device for p in parts] == ["cpu:0", "cpu:1"]
    np.testing.assert_array_equal(dp.gather(parts, "cpu:1").numpy(), np.arange(20).reshape(4, 5))
    copies = dp.broadcast(np.ones(3, np.float32), ["cpu:1", "cpu:0"])
    dp.all_reduce(copies)
    assert all(np.array_equal(c.numpy(), np.full(3, 2.0, np.float32)) for c in copies)


# ---- one step at a time per device ----------------------------------------------------------------

def test_two_models_on_one_device_step_from_two_threads_as_sequentially():
    """Two models on cpu:0 share its scratch; stepping them from two threads at
    once gives the bits they give one after the other (the device's step lock)."""
    def pair():
        return dp.models.LeNet(seed=1), dp.models.LeNet(seed=2)

    batches = [batch(32, seed) for seed in range(6)]

    def train(net, offset):
        for X, y in batches[offset::2]:
            net.train_step(X, y, lr=0.1)

    seq = pair()
    train(seq[0], 0)
    train(seq[1], 1)
    par = pair()
    assert len(live("cpu:0")) == 1
    errors = []

    def run(net, offset):
        try:
            train(net, offset)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(net, i)) for i, net in enumerate(par)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for s, p in zip(seq, par):
        assert np.array_equal(bits(s._model.get_params()), bits(p._model.get_params()))


# ---- the chapter 12.5 loop ------------------------------------------------------------------------

def chapter_loop_equals_train_step(devices):
    """docs/data-parallel.md's chapter 12.5 train_batch on `devices` against net.train_step."""
    X, y = batch(64, seed=5)
    loop = dp.models.LeNet(seed=0, devices=devices)
    whole = dp.models.LeNet(seed=0, devices=devices)
    for step in range(2):
        X_shards, y_shards = dp.split_batch(X, y, loop.devices)
        for replica, Xs, ys in zip(loop.replicas, X_shards, y_shards):
            replica.forward_backward(Xs, ys, grad_scale=1 / len(y))
        dp.all_reduce([replica.grads for replica in loop.replicas])
        for replica in loop.replicas:
            replica.sgd_step(0.2)
        whole.train_step(X, y, lr=0.2)
    for a, b in zip(loop.replicas, whole._replicas):
        np.testing.assert_array_equal(bits(a.params.numpy()), bits(b.get_params()))


def test_chapter_12_5_loop_on_cpu_devices(logical_cpus):
    logical_cpus(2)
    chapter_loop_equals_train_step(["cpu:0", "cpu:1"])


@pytest.mark.gpu
@gpu_only
def test_tensor_round_trips_through_gpu_memory():
    a = np.random.default_rng(0).standard_normal((64, 33)).astype(np.float32)
    before = refs("cuda:0")
    t = dp.tensor(a, "cuda:0")
    assert t.device == "cuda:0" and refs("cuda:0") == before + 1
    np.testing.assert_array_equal(t.numpy(), a)
    with pytest.raises(ValueError, match="CPU devices only"):
        t._view()  # device memory: no host view
    np.testing.assert_array_equal(dp.tensor(t, "cpu:0").numpy(), a)
    labels = dp.tensor(np.arange(10), "cuda:0")
    np.testing.assert_array_equal(labels.numpy(), np.arange(10))
    del t, labels
    assert refs("cuda:0") == before


@pytest.mark.gpu
@gpu_only
def test_replica_grads_on_cuda_replicas():
    net = dp.models.LeNet(devices=["cuda:0"])
    X, y = batch(32)
    replica = net.replicas[0]
    replica.forward_backward(X, y, grad_scale=1 / len(y))
    grads = replica.grads
    assert grads.device == "cuda:0"
    np.testing.assert_array_equal(grads.numpy(), net._model.get_grads())
    np.testing.assert_array_equal(replica.params.numpy(), net._model.get_params())


@pytest.mark.gpu
@gpu_only
def test_chapter_12_5_loop_on_logical_gpus():
    dp.set_logical_devices("cuda", 2)
    try:
        chapter_loop_equals_train_step(["cuda:0", "cuda:1"])
    finally:
        dp.set_logical_devices("cuda", 1)
