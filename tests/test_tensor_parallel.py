"""Layerwise (tensor) parallelism (dp.ModelParallelStrategy, dpcore.tensor_parallel):
every convolution's output channels and every dense layer's output features
split over k devices give the step of one device.

Tolerances: each device computes its output channels with the same kernels as
one device (a channel's dot products are the same sums), so the forward pass
is the same to rounding; what changes is the input gradient of a split layer,
the sum over devices of k partial sums (a re-association of a float32 sum:
at most n * u * sum|terms|, u = 2**-24; with random signs about sqrt(n) * u of
the largest entry), and the BLAS blocking of narrower matrices. As in
test_pipeline.py we allow 1e-4 of the largest change of a tensor (5x the
sqrt(n) * u estimate for n = 257 x 500) plus a few ulps of the weights the
change is read from, for each step taken from the one device's state (weights
and momentum: split_common.step_change), since the bound is one step's. BatchNorm is exact here (each channel sees the whole batch
on its device), so ResNet-18 is held to the same bound, measured on the whole
gradient vector: a tensor whose gradient is ~0 (a convolution bias before a
BatchNorm) has no relative precision of its own.
"""
import os

import numpy as np
import pytest

import dpcore as dp
from split_common import GPUS, NO_GPU, RTOL, close, data, nan_weight_is_named, resnet, step_change
from dpcore import tensor_parallel


def _split_net(model_fn, devices, **kw):
    with dp.ModelParallelStrategy(devices=devices, **kw).scope():
        return model_fn()


@pytest.mark.parametrize("k", [2, 3])
def test_lenet_split_equals_one_device(logical_cpus, k):
    logical_cpus(k)
    X, y = data(257)
    ref = dp.models.LeNet(devices=["cpu:0"])
    w0 = ref.get_weights()
    want, want_losses, starts = step_change(ref, w0, X, y)
    net = _split_net(dp.models.LeNet, [f"cpu:{i}" for i in range(k)])
    got, losses, _ = step_change(net, w0, X, y, starts=starts)
    close(got, want, f"LeNet over {k} devices", w0)
    for (l1, c1), (l2, c2) in zip(losses, want_losses):
        assert c1 == c2 and abs(l1 - l2) <= RTOL * abs(l2)
    Xt, yt = data(50, seed=3)
    np.testing.assert_allclose(net.predict(Xt), ref.predict(Xt), rtol=RTOL, atol=RTOL * np.abs(ref.predict(Xt)).max())


@pytest.mark.parametrize("k", [2, 3])
def test_resnet_split_gradient_and_batchnorm_equal_one_device(logical_cpus, k):
    logical_cpus(k)
    X, y = data(7, (1, 12, 12), seed=1)
    ref = resnet(devices=["cpu:0"])
    w0 = ref.get_weights()
    loss_ref, _ = ref.replicas[0].forward_backward(X, y, grad_scale=1.0 / len(y))
    want = ref._model.get_grads().astype(np.float64)
    state = ref._model.get_state()
    net = _split_net(resnet, [f"cpu:{i}" for i in range(k)])
    net.set_weights(w0)
    loss, _ = net.train_step(X, y, lr=0.0)
    got = net._pipeline.get_grads()
    assert abs(loss - loss_ref) <= RTOL * abs(loss_ref)
    assert np.abs(got - want).max() <= RTOL * np.abs(want).max()
    # the running statistics of every channel: one device's, from the same whole batch
    np.testing.assert_allclose(net._pipeline.get_state(), state, rtol=RTOL, atol=RTOL * np.abs(state).max())


def test_data_parallel_over_split_copies_equals_one_device(logical_cpus):
    """2 copies x 2 devices: LeNet's step is one device's; ResNet-18's gradient is
    the mean of its shards' (BatchNorm per copy, as MirroredStrategy without
    sync_batchnorm) and the running statistics their mean; the copies stay
    identical; a copy without samples adds nothing."""
    logical_cpus(4)
    devices = ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
    X, y = data(130)
    ref = dp.models.LeNet(devices=["cpu:0"])
    w0 = ref.get_weights()
    want, _, starts = step_change(ref, w0, X, y)
    net = _split_net(dp.models.LeNet, devices, replicas=2)
    tp = net._pipeline
    assert tp.group_devices == [["cpu:0", "cpu:1"], ["cpu:2", "cpu:3"]] and net.devices == devices
    assert [m.device for m in tp.groups[1][0]] == ["cpu:2", "cpu:3"]
    got, _, _ = step_change(net, w0, X, y, starts=starts)
    close(got, want, "2 copies x 2 devices", w0)
    assert tp.replicas_identical()
    report = net.model_parallel_report()
    assert report.replicas == 2 and report.split == 2 and len(report.param_bytes) == 4
    net.set_weights(w0)
    net.train_step(X[:1], y[:1], lr=0.0)  # one sample: the second copy adds nothing
    ref.set_weights(w0)
    ref.train_step(X[:1], y[:1], lr=0.0)
    g1 = ref._model.get_grads()
    assert np.abs(tp.get_grads() - g1).max() <= RTOL * np.abs(g1).max()

    Xr, yr = data(10, (1, 12, 12), seed=5)
    net = _split_net(resnet, devices, replicas=2)
    w0 = net.get_weights()
    net.train_step(Xr, yr, lr=0.0)
    assert net._pipeline.replicas_identical()
    one = resnet(devices=["cpu:0"])
    fresh = one._model.get_state()  # the running statistics before any step
    grads, states = [], []
    for rows in (slice(0, 5), slice(5, 10)):
        one.set_weights(w0)
        one._model.set_state(fresh)
        one.replicas[0].forward_backward(Xr[rows], yr[rows], grad_scale=1.0 / 10)
        grads.append(one._model.get_grads().astype(np.float64))
        states.append(one._model.get_state().astype(np.float64))
    want = grads[0] + grads[1]
    assert np.abs(net._pipeline.get_grads() - want).max() <= RTOL * np.abs(want).max()
    state = (states[0] + states[1]) / 2
    np.testing.assert_allclose(net._pipeline.get_state(), state, rtol=RTOL, atol=RTOL * np.abs(state).max())


def test_each_device_holds_its_slice_of_every_weight(logical_cpus):
    """Parameter memory per device, counted from the C core's models on each
    device: 1/k of the model's, within one output channel per layer."""
    logical_cpus(3)
    ref = resnet(devices=["cpu:0"])
    for k in (2, 3):
        net = _split_net(resnet, [f"cpu:{i}" for i in range(k)])
        tp = net._pipeline
        report = net.model_parallel_report()
        assert report.devices == [f"cpu:{i}" for i in range(k)]
        assert report.model_param_bytes == 4 * ref._model.nparams
        # the C core starts every tensor on a 64-byte boundary: the slices hold the
        # model's values exactly, and at most 64 bytes of padding more per tensor slice
        layout = ref._model.param_layout()
        values = 4 * sum(int(np.prod(shape)) for _, _, _, shape in layout)
        sliced = [4 * sum(int(np.prod(shape)) for row in tp.models if row for _, _, _, shape in row[d].param_layout())
                  for d in range(k)]
        assert sum(sliced) == values
        assert 0 <= sum(report.param_bytes) - report.model_param_bytes <= 64 * k * len(layout)
        # the most one device can hold beyond 1/k: one output channel's weights per split layer, and padding
        slack = 4 * sum(int(np.prod(shape[1:])) for _, _, _, shape in layout) + 64 * len(layout)
        for d, b in enumerate(report.param_bytes):
            held = 4 * sum(row[d].nparams for row in tp.models if row)
            assert held == b and b >= sliced[d]
            assert abs(b - report.model_param_bytes / k) <= slack
            assert all(row[d].device == f"cpu:{d}" for row in tp.models if row)
        assert f"1/{k}" in str(report)
        # every weight is the concatenation of its slices, in the layout of one device
        net.set_weights(ref.get_weights())
        w = net.get_weights()
        assert all(np.array_equal(w[n], v) for n, v in ref.get_weights().items())
        for j, row in enumerate(tp.models):
            if row and tp.specs[j][0] == "conv2d":
                widths = [m.layers()[0][2][0] for m in row]
                assert sum(widths) == tp._shapes[j][2][0] and max(widths) - min(widths) <= 1


def test_train_evaluate_save_and_load(logical_cpus, tmp_path):
    logical_cpus(2)
    X, y = data(300)
    net = _split_net(dp.models.LeNet, ["cpu:0", "cpu:1"])
    it = dp.data.from_arrays(X, y, batch_size=64, shuffle=True, seed=0)
    history = dp.train(net, it, dp.data.from_arrays(X, y, batch_size=100), num_epochs=2, lr=0.5, momentum=0.5,
                       verbose=False)
    assert len(history.train_loss) == 2 and np.isfinite(history.train_loss).all()
    path = os.path.join(tmp_path, "split.safetensors")
    net.save(path)
    one = dp.models.load(path, devices=["cpu:0"])
    np.testing.assert_allclose(net.predict(X[:50]), one.predict(X[:50]), rtol=1e-5, atol=1e-5)
    test = dp.data.from_arrays(X, y, batch_size=100)
    assert net.evaluate(test).accuracy == pytest.approx(one.evaluate(test).accuracy, abs=1 / 300)
    # and back: a one-device checkpoint loads into a split model
    again = _split_net(dp.models.LeNet, ["cpu:0", "cpu:1"])
    again.set_weights(one.get_weights())
    np.testing.assert_allclose(again.predict(X[:50]), one.predict(X[:50]), rtol=1e-5, atol=1e-5)


def test_a_failing_step_raises_and_changes_nothing(logical_cpus):
    logical_cpus(2)
    X, y = data(40, (1, 12, 12))
    net = _split_net(resnet, ["cpu:0", "cpu:1"])
    before = net.get_weights()
    state = net._pipeline.get_state()
    bad = y.copy()
    bad[-1] = 10  # checked by the loss, after every layer ran forward on both devices
    with pytest.raises(ValueError, match="label 10"):
        net._pipeline.train_step(X, bad, 0.1)
    after = net.get_weights()
    assert all(np.array_equal(before[k], after[k]) for k in before)
    np.testing.assert_array_equal(net._pipeline.get_state(), state)
    Xn = X.copy()
    Xn[0, 0, 0, 0] = np.inf
    with pytest.raises(FloatingPointError, match="not finite"):
        net._pipeline.train_step(Xn, y, 0.1)
    after = net.get_weights()
    assert all(np.array_equal(before[k], after[k]) for k in before)
    np.testing.assert_array_equal(net._pipeline.get_state(), state)
    net.train_step(X, y, lr=0.1)  # and the model still trains


def test_check_numerics_names_the_layer(logical_cpus):
    """A NaN weight in one device's slice of layer 7: the step raises, applies
    nothing, and check_numerics' re-run (on a one-device CPU copy) names the layer."""
    logical_cpus(2)
    net = _split_net(dp.models.LeNet, ["cpu:0", "cpu:1"])
    nan_weight_is_named(net, 100)  # row 100 of 128: cpu:1's slice (rows 64..127)
    assert np.isnan(net._pipeline.models[7][1].get_params()).any()
    assert not np.isnan(net._pipeline.models[7][0].get_params()).any()


def test_bad_configurations(logical_cpus):
    logical_cpus(4)
    with pytest.raises(ValueError, match="once"):
        dp.ModelParallelStrategy(devices=["cpu:0", "cpu:0"])
    with pytest.raises(ValueError, match="cpu:9"):
        dp.ModelParallelStrategy(devices=["cpu:0", "cpu:9"])
    with pytest.raises(ValueError, match="replicas=3 must divide the 4 devices"):
        dp.ModelParallelStrategy(devices=["cpu:0", "cpu:1", "cpu:2", "cpu:3"], replicas=3)
    with pytest.raises(TypeError, match="replicas"):
        dp.ModelParallelStrategy(devices=["cpu:0", "cpu:1"], replicas=1.5)
    # a layer with fewer output channels than devices cannot be split over them
    with dp.ModelParallelStrategy(devices=["cpu:0", "cpu:1", "cpu:2"]).scope():
        with pytest.raises(ValueError, match="2 output channel.* fewer than the 3 devices"):
            dp.models.Sequential([("conv2d", 2, 3, 1, 1), ("flatten",), ("dense", 10)], input_shape=(1, 8, 8))
        with pytest.raises(ValueError, match="sync_batchnorm"):
            resnet(sync_batchnorm=True)
        net = dp.models.LeNet()
    X, y = data(10)
    with pytest.raises(ValueError, match="model_parallel_report"):
        dp.train(net, dp.data.from_arrays(X, y, batch_size=5), num_epochs=1, profile=True, verbose=False)
    with pytest.raises(ValueError, match="ModelParallelStrategy"):
        dp.models.LeNet(devices=["cpu:0"]).model_parallel_report()
    with pytest.raises(ValueError, match="PipelineStrategy"):
        net.pipeline_report()
    with pytest.raises(ValueError, match="params must hold"):
        net._pipeline.set_params(np.zeros(3, np.float32))


def test_bounds_split_channels_evenly():
    for channels in (1, 2, 6, 7, 16, 512):
        for k in range(1, min(channels, 5) + 1):
            b = tensor_parallel._bounds(channels, k)
            assert b[0][0] == 0 and b[-1][1] == channels and len(b) == k
            assert all(hi0 == lo1 for (_, hi0), (lo1, _) in zip(b, b[1:]))
            widths = [hi - lo for lo, hi in b]
            assert max(widths) - min(widths) <= 1 and min(widths) >= 1


@pytest.mark.gpu
@pytest.mark.skipif(GPUS == 0, reason=NO_GPU)
@pytest.mark.parametrize("k", [2, 3])
def test_split_over_logical_gpus_matches_the_cpu(k):
    """The GPU path: each slice a cuDNN/cuBLAS layer on its logical GPU, partial
    input gradients summed by dp.all_reduce over the GPUs. CPU twin:
    testresnet_split_gradient_and_batchnorm_equal_one_device."""
    dp.set_logical_devices("cuda", k)
    try:
        X, y = data(16, (1, 12, 12), seed=2)
        ref = resnet(devices=["cpu:0"])
        loss_ref, _ = ref.replicas[0].forward_backward(X, y, grad_scale=1.0 / len(y))
        want = ref._model.get_grads()
        net = _split_net(resnet, [f"cuda:{i}" for i in range(k)])
        net.set_weights(ref.get_weights())
        loss, _ = net.train_step(X, y, lr=0.0)
        got = net._pipeline.get_grads()
        assert abs(loss - loss_ref) <= 1e-3 * abs(loss_ref)   # cuDNN's algorithms and TF32 off: float32 sums
        assert np.abs(got - want).max() <= 1e-3 * np.abs(want).max()
    finally:
        dp.set_logical_devices("cuda", 1)
