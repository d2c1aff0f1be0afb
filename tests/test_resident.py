"""A training set resident on the devices (dp.train(..., resident=True)).

The dataset is copied once to each replica's device and a step moves only the
indices of its samples; the device gathers the images and labels (backend
gather_rows; its GPU body dp_gather_elem is checked against the CPU backend in
tests/c/kernel_bodies.c). On CPU devices the same code path runs over host
memory, so these tests check it: the same batches in the same order, hence
the same bits, as training from host batches.
"""

import numpy as np
import pytest

import dpcore as dp


@pytest.fixture(autouse=True)
def three_cpu_devices(logical_cpus):
    logical_cpus(3)


def data(n=203, dtype=np.uint8, seed=0):
    rng = np.random.default_rng(seed)
    if dtype == np.uint8:
        X = rng.integers(0, 256, (n, 1, 28, 28), dtype=np.uint8)
    else:
        X = rng.standard_normal((n, 1, 28, 28)).astype(np.float32)
    return X, rng.integers(0, 10, n)


def same_weights(a, b):
    wa, wb = a.get_weights(), b.get_weights()
    return wa.keys() == wb.keys() and all(np.array_equal(wa[k], wb[k]) for k in wa)


@pytest.mark.parametrize("devices", [["cpu:0"], ["cpu:0", "cpu:1"], ["cpu:0", "cpu:1", "cpu:2"]])
@pytest.mark.parametrize("dtype", [np.uint8, np.float32])
def test_resident_training_is_bitwise_host_training(devices, dtype):
    X, y = data(dtype=dtype)
    nets, histories = [], []
    for resident in (False, True):
        net = dp.models.LeNet(devices=devices)
        it = dp.data.from_arrays(X, y, batch_size=64, shuffle=True, seed=5)
        histories.append(dp.train(net, it, num_epochs=2, lr=0.1, momentum=0.9, verbose=False, resident=resident))
        nets.append(net)
    assert histories[0].train_loss == histories[1].train_loss
    assert histories[0].train_acc == histories[1].train_acc
    assert same_weights(*nets)


def test_resident_batchnorm_model_matches_host_batches():
    """BatchNorm (running statistics, per-replica shards) and sync BatchNorm."""
    X, y = data(n=90, dtype=np.float32)
    X = X[:, :, :12, :12].copy()
    layers = [("conv2d", 4, 3, 1, 1), ("batchnorm",), ("relu",), ("global_avgpool",), ("flatten",), ("dense", 10)]
    for sync in (False, True):
        nets = []
        for resident in (False, True):
            net = dp.models.Sequential(layers, input_shape=(1, 12, 12), init="torch", devices=["cpu:0", "cpu:1"],
                                       sync_batchnorm=sync)
            it = dp.data.from_arrays(X, y, batch_size=32, shuffle=True, seed=1)
            dp.train(net, it, num_epochs=2, lr=0.05, verbose=False, resident=resident)
            nets.append(net)
        assert same_weights(*nets)


def test_index_batches_are_the_batches_of_iter():
    X, y = data(n=50)
    for shuffle in (False, True):
        a = dp.data.from_arrays(X, y, batch_size=16, shuffle=shuffle, seed=2)
        b = dp.data.from_arrays(X, y, batch_size=16, shuffle=shuffle, seed=2)
        for _ in range(2):  # two epochs: the shuffles advance alike
            got = list(b.index_batches())
            want = list(a)
            assert len(got) == len(want) == 4
            for rows, (Xb, yb) in zip(got, want):
                assert rows.dtype == np.int64
                np.testing.assert_array_equal(X[rows], Xb)
                np.testing.assert_array_equal(y[rows], yb)


def test_resident_dataset_describes_itself():
    X, y = data(n=20)
    net = dp.models.LeNet(devices=["cpu:0", "cpu:1"])
    residents = net.make_resident(X, y)
    assert [r.device for r in residents] == ["cpu:0", "cpu:1"]
    assert all(r.num_samples == 20 and r.nbytes == 20 * (784 + 4) for r in residents)


def test_resident_is_on_by_default_only_for_gpus():
    """None means: resident on CUDA replicas; CPU replicas read host batches."""
    X, y = data(n=64)
    net = dp.models.LeNet(devices=["cpu:0"])
    it = dp.data.from_arrays(X, y, batch_size=32)
    calls = []
    net.train_step_rows = lambda *a, **k: calls.append(a)  # would be used if resident
    dp.train(net, it, num_epochs=1, lr=0.1, verbose=False)
    assert calls == []


def test_bad_rows_are_refused():
    X, y = data(n=20)
    net = dp.models.LeNet(devices=["cpu:0", "cpu:1"])
    residents = net.make_resident(X, y)
    before = net._model.get_params()
    with pytest.raises(ValueError, match="rows must be sample indices"):
        net.train_step_rows(residents, np.array([0, 1, 20, 3]), lr=0.1)
    with pytest.raises(ValueError, match="rows must be sample indices"):
        net.train_step_rows(residents, np.array([-1, 1, 2]), lr=0.1)
    with pytest.raises(TypeError, match="int64"):
        net._mirrored.train_step_rows(residents, np.array([0.0, 1.0]), 0.1)
    with pytest.raises(ValueError, match="one resident dataset per replica"):
        net.train_step_rows(residents[:1], np.array([0, 1]), lr=0.1)
    np.testing.assert_array_equal(net._model.get_params(), before)
    # still usable
    loss, hits = net.train_step_rows(residents, np.array([0, 1, 2, 3]), lr=0.1)
    assert np.isfinite(loss) and 0 <= hits <= 4


def test_a_resident_dataset_belongs_to_its_device():
    X, y = data(n=20)
    a = dp.models.LeNet(devices=["cpu:0", "cpu:1"])
    b = dp.models.LeNet(devices=["cpu:1", "cpu:0"])
    with pytest.raises(ValueError, match="resident dataset is on cpu:0"):
        b.train_step_rows(a.make_resident(X, y), np.array([0, 1]), lr=0.1)
    with pytest.raises(TypeError, match="residents"):
        a.train_step_rows([X, X], np.array([0, 1]), lr=0.1)


def test_residents_of_two_make_resident_calls_are_refused():
    """Each replica would train on its own dataset under the same rows (a silent
    divergence from the one-device step), so a mixed list is an error, before any work."""
    X, y = data(n=20)
    X2, y2 = X[::-1].copy(), y[::-1].copy()
    net = dp.models.LeNet(devices=["cpu:0", "cpu:1"])
    first, second = net.make_resident(X, y), net.make_resident(X2, y2)
    before = net._model.get_params()
    for mixed in ([first[0], second[1]], (second[0], first[1])):
        with pytest.raises(ValueError, match="another dataset than replica 0's"):
            net.train_step_rows(mixed, np.array([0, 1, 2]), lr=0.1)
    np.testing.assert_array_equal(net._model.get_params(), before)
    # one call's list, as a copy or a tuple, is one dataset
    for same in (list(first), tuple(second)):
        loss, _ = net.train_step_rows(same, np.array([0, 1, 2]), lr=0.1)
        assert np.isfinite(loss)


def test_bad_labels_are_refused_when_made_resident():
    X, y = data(n=20)
    y[7] = 10
    with pytest.raises(ValueError, match="label 10 at index 7"):
        dp.models.LeNet().make_resident(X, y)


def test_resident_needs_an_array_iterator():
    X, y = data(n=20)
    net = dp.models.LeNet()
    with pytest.raises(TypeError, match="resident=True needs a dp.data iterator"):
        dp.train(net, [(X, y)], num_epochs=1, lr=0.1, verbose=False, resident=True)
    with pytest.raises(TypeError, match="resident must be"):
        dp.train(net, dp.data.from_arrays(X, y, 8), num_epochs=1, lr=0.1, verbose=False, resident="yes")


RUNTIME = dp._core.runtime_info()
GPUS = RUNTIME["cuda_device_count"] if dp.build_info().get("cuda_backend") else 0


@pytest.mark.gpu
@pytest.mark.skipif(GPUS == 0, reason="no usable CUDA device: " + (
    RUNTIME["cuda_why"] if dp.build_info().get("cuda_backend") else "dpcore was built without the CUDA backend"))
def test_resident_on_the_gpu_is_bitwise_host_batches():
    """On cuda:0 (deterministic cuDNN algorithms) the gathered batches train
    exactly as the batches copied from the host; resident is the default there."""
    X, y = data()
    nets = []
    for resident in (False, None):
        net = dp.models.LeNet(devices=["cuda:0"])
        dp.train(net, dp.data.from_arrays(X, y, batch_size=64, shuffle=True, seed=5), num_epochs=2, lr=0.1,
                 verbose=False, resident=resident)
        nets.append(net)
    assert same_weights(*nets)


def test_resident_by_default_needs_gpus_and_room(monkeypatch):
    """The default: resident on CUDA replicas when the arrays take at most a
    quarter of the smallest GPU's memory (checked with a stand-in GPU list)."""
    import sys
    import types

    train_module = sys.modules["dpcore.train"]  # dp.train is the function
    X, y = data(n=100)  # 78,400 + 800 bytes
    it = dp.data.from_arrays(X, y, batch_size=10)
    gpu_net, cpu_net = types.SimpleNamespace(devices=["cuda:0"]), types.SimpleNamespace(devices=["cpu:0"])

    def gpus(*memory):
        info = dict(RUNTIME, cuda_devices=[{"name": "stand-in", "memory_bytes": m, "compute_capability": (9, 0)}
                                           for m in memory])
        monkeypatch.setattr(train_module._core, "runtime_info", lambda: info)

    gpus(4 * 79_200, 10**9)
    assert train_module._resident_by_default(gpu_net, it)
    gpus(4 * 79_200 - 4, 10**9)  # the smaller GPU has too little room
    assert not train_module._resident_by_default(gpu_net, it)
    gpus(10**9)
    assert not train_module._resident_by_default(cpu_net, it)
    assert not train_module._resident_by_default(gpu_net, [(X, y)])
