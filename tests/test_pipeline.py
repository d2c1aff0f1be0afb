"""Pipeline parallelism (dp.PipelineStrategy, dpcore.pipeline): the stages of a
network on their own devices give the gradient of one device.

Tolerances: a pipeline step computes every layer with the same kernels as one
device, but sums each parameter gradient over micro-batches (and, with
replicas, over pipelines) in another association. Re-associating a float32 sum
of n terms moves it by at most n * u * sum|terms| (u = 2**-24); for these
gradients (n up to 257 samples x 500 products in conv2) and random-signed terms
the error is about sqrt(n) * u of the largest entry, about 2e-5 of it. We allow
1e-4 of the largest change of a tensor (and of the loss), 5x that, plus the
rounding of the float32 weights the change is read from (w - w0: a few ulps of
the largest weight). That bound is one step's: each step is taken from the one
device's state (weights and momentum, split_common.step_change), not from the
pipeline's own previous step.
"""
import os

import numpy as np
import pytest

import dpcore as dp
from split_common import GPUS, NO_GPU, RTOL, close, data, nan_weight_is_named, resnet, step_change
from dpcore import pipeline


def _pipeline_net(model_fn, devices, **kw):
    with dp.PipelineStrategy(devices=devices, **kw).scope():
        return model_fn()


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("micro_batches", [1, 2, 4, 7])
def test_lenet_pipeline_equals_one_device(logical_cpus, schedule, stages, micro_batches):
    logical_cpus(4)
    X, y = data(257)  # 257 = uneven micro-batches for every m here but 1
    ref = dp.models.LeNet(devices=["cpu:0"])
    w0 = ref.get_weights()
    want, want_losses, starts = step_change(ref, w0, X, y)
    net = _pipeline_net(dp.models.LeNet, [f"cpu:{i}" for i in range(stages)], micro_batches=micro_batches,
                        schedule=schedule)
    assert len(net._pipeline.models[0]) == stages and net.devices == [f"cpu:{i}" for i in range(stages)]
    got, losses, _ = step_change(net, w0, X, y, starts=starts)
    close(got, want, f"{stages} stages, {micro_batches} micro-batches, {schedule}", w0)
    for (l1, c1), (l2, c2) in zip(losses, want_losses):
        assert c1 == c2 and abs(l1 - l2) <= RTOL * abs(l2)


def test_stage_parameters_live_on_their_device_only(logical_cpus):
    logical_cpus(2)
    net = _pipeline_net(dp.models.LeNet, ["cpu:0", "cpu:1"], micro_batches=2)
    p = net._pipeline
    sizes = [m.nparams for m in p.models[0]]
    assert [m.device for m in p.models[0]] == ["cpu:0", "cpu:1"]
    assert sum(sizes) == p.nparams and all(s > 0 for s in sizes)
    # the whole network's flat buffer is the stages' one after the other, in one-device layout
    ref = dp.models.LeNet(devices=["cpu:0"])
    assert [(k, o, s) for _, k, o, s in ref._model.param_layout()] == [(k, o, s) for _, k, o, s in net._layout]
    np.testing.assert_array_equal(ref.get_weights()["7.weight"], net.get_weights()["7.weight"])


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("micro_batches", [1, 2, 4, 7])
def test_resnet_pipeline_gradient_is_the_sum_of_its_micro_batches(logical_cpus, stages, micro_batches):
    """BatchNorm normalises each micro-batch alone, so the reference is one
    device's gradient of each micro-batch (scaled by 1/N), summed: the full
    batch's for one micro-batch. A batch of 15: uneven micro-batches for
    m = 2, 4, 7, and at least 2 samples each (BatchNorm of the last 1x1 maps)."""
    logical_cpus(3)
    X, y = data(15, (1, 12, 12), seed=1)
    ref = resnet(devices=["cpu:0"])
    w0 = ref.get_weights()
    grads = np.zeros(ref._model.nparams, np.float64)
    for rows in np.array_split(np.arange(len(y)), micro_batches):
        ref.replicas[0].forward_backward(X[rows], y[rows], grad_scale=1.0 / len(y))
        grads += ref._model.get_grads()
    state = ref._model.get_state()  # running statistics after the micro-batches, in order
    net = _pipeline_net(resnet, [f"cpu:{i}" for i in range(stages)], micro_batches=micro_batches)
    net.set_weights(w0)
    net.train_step(X, y, lr=0.0)
    got = net._pipeline.get_grads()
    scale = np.abs(grads).max()
    assert np.abs(got - grads).max() <= RTOL * scale
    np.testing.assert_allclose(net._pipeline.get_state(), state, rtol=RTOL, atol=RTOL * np.abs(state).max())
    # no cut inside a residual block: each stage begins where the network may be cut
    cuts = pipeline.valid_cuts(net._specs, net._sources)
    assert all(c in cuts for c in net._pipeline.split[1:])


def test_data_parallel_over_pipelines_equals_one_device(logical_cpus):
    logical_cpus(4)
    X, y = data(130)
    ref = dp.models.LeNet(devices=["cpu:0"])
    w0 = ref.get_weights()
    want, _, starts = step_change(ref, w0, X, y)
    for schedule in ("1f1b", "gpipe"):
        net = _pipeline_net(dp.models.LeNet, ["cpu:0", "cpu:1", "cpu:2", "cpu:3"], micro_batches=3, replicas=2,
                            schedule=schedule)
        assert [[m.device for m in row] for row in net._pipeline.models] == [["cpu:0", "cpu:1"], ["cpu:2", "cpu:3"]]
        got, _, _ = step_change(net, w0, X, y, starts=starts)
        close(got, want, f"2 pipelines x 2 stages, {schedule}", w0)
        assert net._pipeline.replicas_identical()
        # one sample for two pipelines: the second adds nothing (not the gradient of its last step)
        net.set_weights(w0)
        net.train_step(X[:1], y[:1], lr=0.0)
        ref.set_weights(w0)
        ref.train_step(X[:1], y[:1], lr=0.0)
        want1 = ref._model.get_grads()
        assert np.abs(net._pipeline.get_grads() - want1).max() <= RTOL * np.abs(want1).max()


def test_data_parallel_over_resnet_pipelines_averages_batchnorm(logical_cpus):
    """2 pipelines x 2 stages of ResNet-18: each pipeline's shard normalised
    alone (micro-batch statistics), the gradients summed over the pipelines and
    the running statistics averaged, as MirroredStrategy does: the copies stay
    identical, and equal to two one-pipeline runs of the shards."""
    logical_cpus(4)
    X, y = data(10, (1, 12, 12), seed=4)
    net = _pipeline_net(resnet, ["cpu:0", "cpu:1", "cpu:2", "cpu:3"], micro_batches=2, replicas=2)
    w0 = net.get_weights()
    net.train_step(X, y, lr=0.0)
    assert net._pipeline.replicas_identical()
    grads, states = [], []
    for rows in (slice(0, 5), slice(5, 10)):
        one = _pipeline_net(resnet, ["cpu:0", "cpu:1"], micro_batches=2, split=net._pipeline.split)
        one.set_weights(w0)
        one.train_step(X[rows], y[rows], lr=0.0)
        grads.append(one._pipeline.get_grads().astype(np.float64))
        states.append(one._pipeline.get_state().astype(np.float64))
    want = (grads[0] + grads[1]) / 2  # each shard's mean gradient: 5 of the 10 samples
    assert np.abs(net._pipeline.get_grads() - want).max() <= RTOL * np.abs(want).max()
    state = (states[0] + states[1]) / 2
    np.testing.assert_allclose(net._pipeline.get_state(), state, rtol=RTOL, atol=RTOL * np.abs(state).max())


def test_schedules_run_every_micro_batch_once_in_order():
    for kind in pipeline.SCHEDULES:
        for p, m in [(1, 1), (2, 1), (2, 5), (3, 4), (4, 8)]:
            plans = pipeline.schedule(kind, p, m)
            for i, ops in enumerate(plans):
                assert sorted(ops) == sorted([("F", k) for k in range(m)] + [("B", k) for k in range(m)])
                assert [k for op, k in ops if op == "F"] == list(range(m))
                in_flight, most = set(), 0
                for op, k in ops:
                    (in_flight.add if op == "F" else in_flight.remove)(k)
                    most = max(most, len(in_flight))
                assert most == (m if kind == "gpipe" else min(p - i, m)), (kind, p, m, i)
    assert pipeline.schedule("1f1b", 3, 4)[0] == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1),
                                                  ("B", 2), ("B", 3)]


def test_1f1b_keeps_fewer_activations_than_gpipe(logical_cpus):
    """Measured: the bytes of the activation sets each stage allocated. One set (a
    micro-batch of 8 samples) is measured on its own, by a pipeline of one micro-batch of 8;
    GPipe then holds 8 sets on every stage, 1F1B p - i on stage i (2 and 1 here)."""
    logical_cpus(2)
    X, y = data(64)
    held = {}
    for kind, n, m in (("one set", 8, 1), ("gpipe", 64, 8), ("1f1b", 64, 8)):
        net = _pipeline_net(dp.models.LeNet, ["cpu:0", "cpu:1"], micro_batches=m,
                            schedule="gpipe" if kind == "one set" else kind)
        net.train_step(X[:n], y[:n], lr=0.1)
        held[kind] = net.pipeline_report().activation_bytes
    one = held["one set"]
    assert all(b > 0 for b in one), held
    assert held["gpipe"] == [8 * b for b in one], held
    assert held["1f1b"] == [2 * one[0], one[1]], held


def test_pipeline_report_measures_the_bubble(logical_cpus):
    logical_cpus(2)
    X, y = data(64)
    net = _pipeline_net(dp.models.LeNet, ["cpu:0", "cpu:1"], micro_batches=4)
    for _ in range(2):
        net.train_step(X, y, lr=0.1)
    r = net.pipeline_report()
    assert r.steps == 2 and r.stages == 2 and r.micro_batches == 4
    assert r.bubble_formula == pytest.approx(1 / 5)
    assert 0.0 < r.bubble < 1.0
    for busy, idle in zip(r.busy_seconds, r.idle_seconds):
        assert busy > 0 and idle >= 0 and busy + idle == pytest.approx(r.step_seconds)
    assert "bubble" in str(r) and len(r.timeline) == 2 * 2 * 4
    net.reset_pipeline_report()
    assert net.pipeline_report().steps == 0


def test_train_evaluate_save_and_load(logical_cpus, tmp_path):
    logical_cpus(2)
    X, y = data(300)
    it = dp.data.from_arrays(X, y, batch_size=64, shuffle=True, seed=0)
    net = _pipeline_net(dp.models.LeNet, ["cpu:0", "cpu:1"], micro_batches=2)
    history = dp.train(net, it, dp.data.from_arrays(X, y, batch_size=100), num_epochs=2, lr=0.5, verbose=False)
    assert len(history.train_loss) == 2 and np.isfinite(history.train_loss).all()
    path = os.path.join(tmp_path, "pipe.safetensors")
    net.save(path)
    one = dp.models.load(path, devices=["cpu:0"])
    np.testing.assert_array_equal(one.predict(X[:50]), one.predict(X[:50]))
    np.testing.assert_allclose(net.predict(X[:50]), one.predict(X[:50]), rtol=1e-5, atol=1e-5)
    assert net.evaluate(dp.data.from_arrays(X, y, batch_size=100)).accuracy == pytest.approx(
        one.evaluate(dp.data.from_arrays(X, y, batch_size=100)).accuracy)


def test_a_failing_stage_raises_and_changes_nothing(logical_cpus):
    logical_cpus(2)
    X, y = data(40)
    net = _pipeline_net(dp.models.LeNet, ["cpu:0", "cpu:1"], micro_batches=4)
    before = net.get_weights()
    bad = y.copy()
    bad[-1] = 10  # checked by the last stage, in its thread, after stage 0 has run
    with pytest.raises(ValueError, match="label 10"):
        net._pipeline.train_step(X, bad, 0.1)
    after = net.get_weights()
    assert all(np.array_equal(before[k], after[k]) for k in before)
    net.train_step(X, y, lr=0.1)  # and the pipeline still works


def test_check_numerics_names_the_layer(logical_cpus):
    logical_cpus(2)
    net = _pipeline_net(dp.models.LeNet, ["cpu:0", "cpu:1"], micro_batches=2, split=[0, 6])
    nan_weight_is_named(net, 5)  # layer 7 is in stage 1


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(devices=["cpu:0", "cpu:0"]), ValueError, "once"),
    (dict(micro_batches=0), ValueError, "micro_batches"),
    (dict(micro_batches=2.5), TypeError, "micro_batches"),
    (dict(schedule="zigzag"), ValueError, "schedule"),
    (dict(replicas=3), ValueError, "replicas"),
    (dict(split="0,3"), TypeError, "split"),
])
def test_bad_strategies(logical_cpus, kwargs, error, match):
    logical_cpus(2)
    kwargs.setdefault("devices", ["cpu:0", "cpu:1"])
    with pytest.raises(error, match=match):
        dp.PipelineStrategy(**kwargs)


def test_bad_pipelines(logical_cpus):
    logical_cpus(4)
    with dp.PipelineStrategy(devices=["cpu:0", "cpu:1", "cpu:2"]).scope():
        with pytest.raises(ValueError, match="3 stages for a network of 2 layers"):
            dp.models.Sequential([("flatten",), ("dense", 10)])
    with dp.PipelineStrategy(devices=["cpu:0", "cpu:1"], split=[0, 5]).scope():
        with pytest.raises(ValueError, match="cannot begin at layer 5"):
            dp.models.ResNet18(input_size=12)  # layer 5 is inside the first residual block
    with dp.PipelineStrategy(devices=["cpu:0", "cpu:1"], split=[0, 12]).scope():
        with pytest.raises(ValueError, match="split"):
            dp.models.LeNet()
    with dp.PipelineStrategy(devices=["cpu:0", "cpu:1"]).scope():
        with pytest.raises(ValueError, match="sync_batchnorm"):
            dp.models.ResNet18(input_size=12, sync_batchnorm=True)
        net = dp.models.LeNet()
    X, y = data(10)
    with pytest.raises(ValueError, match="pipeline_report"):
        dp.train(net, dp.data.from_arrays(X, y, batch_size=5), num_epochs=1, profile=True, verbose=False)
    with pytest.raises(ValueError, match="PipelineStrategy"):
        dp.models.LeNet(devices=["cpu:0"]).pipeline_report()


def test_split_chooses_where_stages_begin(logical_cpus):
    logical_cpus(3)
    net = _pipeline_net(dp.models.LeNet, ["cpu:0", "cpu:1", "cpu:2"], split=[0, 6, 8])
    assert net._pipeline.split == [0, 6, 8]
    assert [len(m.layers()) for m in net._pipeline.models[0]] == [6, 2, 2]
    net = _pipeline_net(dp.models.LeNet, ["cpu:0", "cpu:1", "cpu:2"], split=[6, 8])
    assert net._pipeline.split == [0, 6, 8]


def test_valid_cuts_never_split_a_residual_block():
    arch = dp.models.ResNet18._architecture(10, 1, 12)
    cuts = pipeline.valid_cuts(arch["layers"], arch["sources"])
    reads = pipeline.layer_sources(arch["layers"], arch["sources"])
    for c in range(1, len(arch["layers"])):
        crosses = any(s < c - 1 for j in range(c, len(reads)) for s in reads[j])
        assert (c in cuts) == (not crosses)
    # the block boundaries (after each block's ReLU) are cuts; 8 blocks
    assert sum(1 for c in cuts if arch["layers"][c - 1] == ("relu",) and arch["layers"][c][0] == "conv2d") >= 8


@pytest.mark.gpu
@pytest.mark.skipif(GPUS == 0, reason=NO_GPU)
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_pipeline_over_logical_gpus_matches_the_cpu(schedule):
    """The GPU path: stages on logical GPUs (each its cuDNN/cuBLAS model),
    activations and their gradients staged through host memory between them.
    CPU twin: test_lenet_pipeline_equals_one_device."""
    dp.set_logical_devices("cuda", 3)
    try:
        X, y = data(257)
        ref = dp.models.LeNet(devices=["cpu:0"])
        w0 = ref.get_weights()
        want, want_losses, starts = step_change(ref, w0, X, y)
        net = _pipeline_net(dp.models.LeNet, ["cuda:0", "cuda:1", "cuda:2"], micro_batches=4, schedule=schedule)
        got, losses, _ = step_change(net, w0, X, y, starts=starts)
        for g, wnt in zip(got, want):
            for name in wnt:  # cuDNN's algorithms: float32 sums in other orders, 10x the CPU's bound
                scale = float(np.abs(wnt[name]).max())
                assert np.abs(g[name] - wnt[name]).max() <= 10 * RTOL * scale + 1e-6, name
        assert all(abs(c1 - c2) <= 1 for (_, c1), (_, c2) in zip(losses, want_losses))  # a near tie may flip
    finally:
        dp.set_logical_devices("cuda", 1)


def test_stages_hand_over_device_tensors(logical_cpus):
    """Between stages the activations and their gradients travel as dp.Tensors
    on the sender's device, which the receiver's model copies from directly
    (the path GPUs take device to device); the same bits as host arrays."""
    logical_cpus(2)
    a = dp._core.Model((1, 28, 28), [("conv2d", 4, 3, 1, 1), ("relu",)], 1, 0, None, "cpu", 0, headless=True)
    b = dp._core.Model((4, 28, 28), [("flatten",), ("dense", 10)], 1, 1, None, "cpu", 0, input_grad=True)
    X, y = data(5)
    t, _, _ = a.stage_forward(0, X, to_tensor=True)
    h, _, _ = a.stage_forward(1, X)
    assert isinstance(t, dp.Tensor) and t.device == "cpu:0" and t.shape == (5, 4, 28, 28)
    np.testing.assert_array_equal(t.numpy(), h)
    _, loss_t, _ = b.stage_forward(0, t, y, grad_scale=0.2, output=False)
    _, loss_h, _ = b.stage_forward(1, h, y, grad_scale=0.2, output=False)
    assert loss_t == loss_h
    g = b.stage_backward(0, 5, None, input_grad=True, to_tensor=True)
    gh = b.stage_backward(1, 5, None, input_grad=True)
    assert g.device == "cpu:1"
    np.testing.assert_array_equal(g.numpy(), gh)
    assert a.stage_backward(0, 5, g) is None
    with pytest.raises(ValueError, match="samples of 3136 values, got 12 values in 4 rows"):
        b.stage_forward(0, dp.tensor(np.zeros((4, 3), np.float32), "cpu:0"))
    with pytest.raises(TypeError, match="float32 activations"):
        b.stage_forward(0, dp.tensor(np.zeros(3, np.int64), "cpu:0"))
    with pytest.raises(ValueError, match="must hold 5 samples"):
        a.stage_backward(0, 5, dp.tensor(np.zeros((4, 4, 28, 28), np.float32), "cpu:1"))
    # who hands tensors to whom: everyone, except a GPU to a CPU stage (host arrays there)
    assert pipeline.hand_over(["cpu:0", "cpu:1"]) == [(True, False), (False, True)]
    assert pipeline.hand_over(["cuda:0", "cuda:1", "cpu:0"]) == [(True, False), (False, True), (False, True)]
    assert pipeline.hand_over(["cpu:0", "cuda:0"]) == [(True, False), (False, False)]
    net = _pipeline_net(dp.models.LeNet, ["cpu:0", "cpu:1"], micro_batches=2)
    assert net._pipeline._hand_over == [[(True, False), (False, True)]]
