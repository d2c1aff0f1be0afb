"""ReLU + average pooling run as one op (issue 14's fusion route), and
BatchNorm + ReLU.

A relu whose only reader is the avgpool right after it runs, with that pool,
as one backend op (csrc/backend.h: relu_avgpool_forward, avgpool_relu_backward;
csrc/model.c: mark_fusions): forward writes the relu's output and pools each
plane while it is in cache, backward writes the relu's input gradient straight
from the pool's output gradient. The arithmetic is the separate ops', in their
order, so the claim tested here is exact: a model built with DPCORE_FUSE=0 (every
layer on its own) and one built without it train to the same bits. Each case
also checks that the fusion did (or did not) happen, so that equality is not
the trivial one of two unfused runs.

A batchnorm whose only reader is the relu right after it (one not fused with
a pool itself) runs with it as bn_apply_relu: the relu's output is written
and the batchnorm's is not (its backward reads its input, the relu's backward
the relu's output); the same bits as the two ops apart, checked the same way.
So does an add whose only reader is the relu right after it (a residual
block's end) as add_relu: the add's output is never written (its backward
reads no output, the relu's its own). And on the CPU a direct (single-channel)
convolution whose only reader is a relu fused with a 2x2 pool runs its
backward pass from the pool's gradient (conv2d_relu_avgpool_backward): the
same bits, counted by debug_counters()['conv_relu_pool'].
"""
import numpy as np
import pytest

import dpcore as dp


def build(monkeypatch, fuse, layers, input_shape, sources=None, devices=("cpu:0",)):
    if fuse:
        monkeypatch.delenv("DPCORE_FUSE", raising=False)
    else:
        monkeypatch.setenv("DPCORE_FUSE", "0")
    net = dp.models.Sequential(layers, input_shape=input_shape, sources=sources, seed=5, init="torch",
                               devices=list(devices))
    monkeypatch.delenv("DPCORE_FUSE", raising=False)
    return net


def batch(shape, n, seed):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n,) + tuple(shape)).astype(np.float32), rng.integers(0, 10, n).astype(np.int64)


def train_both(monkeypatch, layers, input_shape, sources=None, n=37, steps=3, devices=("cpu:0",)):
    """Both models after `steps` SGD steps (momentum, weight decay) on the same batches; returns them."""
    nets = [build(monkeypatch, fuse, layers, input_shape, sources, devices) for fuse in (False, True)]
    for s in range(steps):
        X, y = batch(input_shape, n, seed=s)
        out = [net.train_step(X, y, lr=0.05, momentum=0.9, weight_decay=1e-4) for net in nets]
        assert out[0] == out[1], f"step {s}: (loss, correct) {out[0]} unfused vs {out[1]} fused"
    return nets


def assert_same_bits(nets, input_shape):
    plain, fused = nets
    wp, wf = plain.get_weights(), fused.get_weights()
    assert list(wp) == list(wf)
    for name in wp:
        np.testing.assert_array_equal(wp[name], wf[name], err_msg=name)
    X, _ = batch(input_shape, 11, seed=99)
    np.testing.assert_array_equal(plain.predict(X), fused.predict(X))


def fused_pairs(net):
    return net._model.fused_layers


LENET = [("conv2d", 6, 3, 1, 0), ("relu",), ("avgpool", 2, 2, 0), ("conv2d", 8, 5, 1, 0), ("relu",),
         ("avgpool", 2, 2, 0), ("flatten",), ("dense", 10)]


def test_lenet_shapes_fused_and_bit_identical(monkeypatch):
    # 28 -> 26 (even plane) -> 13 -> 9 (odd: the pool drops the last row and column) -> 4
    nets = train_both(monkeypatch, LENET, (1, 28, 28))
    assert fused_pairs(nets[0]) == []
    assert fused_pairs(nets[1]) == [(1, 2), (4, 5)]
    assert_same_bits(nets, (1, 28, 28))


def relu_pool_convs(run):
    """How many convolution backward passes `run()` ran straight from a fused ReLU + pool's gradient."""
    before = dp._core.debug_counters()["conv_relu_pool"]
    out = run()
    return out, dp._core.debug_counters()["conv_relu_pool"] - before


@pytest.mark.parametrize("layers, shape", [
    (LENET, (1, 28, 28)),  # the first conv (no dx): dw and db from the pool's gradient
    # a single-channel conv inside the network: its dx too, and a plane of odd size (the pool drops a row)
    ([("conv2d", 1, 3, 1, 1), ("conv2d", 5, 3, 1, 0), ("relu",), ("avgpool", 2, 2, 0), ("flatten",), ("dense", 10)],
     (2, 11, 9)),
], ids=["lenet", "inner-conv"])
def test_direct_conv_backward_from_the_pool_is_bit_identical(monkeypatch, layers, shape):
    """A direct (single-channel) convolution whose only reader is a ReLU fused with a 2x2 average
    pool runs its backward pass from the pool's output gradient (backend.h:
    conv2d_relu_avgpool_backward): its own output gradient is formed a sample at a time and never
    written. The same bits as every layer on its own, and it did run (and not unfused)."""
    (nets, runs) = relu_pool_convs(lambda: train_both(monkeypatch, layers, shape))
    assert runs == 3  # three steps of the fused model; the unfused one adds none
    assert_same_bits(nets, shape)


def test_lenet_model_is_fused():
    net = dp.models.LeNet(devices=["cpu:0"])
    assert fused_pairs(net) == [(1, 2), (4, 5)]


def test_general_window_fused_and_bit_identical(monkeypatch):
    # windows 3 at stride 2 with padding (overlapping, clipped at the border), a 7x5 plane
    layers = [("conv2d", 4, 3, 1, 1), ("relu",), ("avgpool", 3, 2, 1), ("flatten",), ("dense", 10)]
    nets = train_both(monkeypatch, layers, (2, 7, 5))
    assert fused_pairs(nets[1]) == [(1, 2)]
    assert_same_bits(nets, (2, 7, 5))


def test_relu_on_the_input_fused(monkeypatch):
    # the relu reads the model's input, whose gradient nobody needs
    layers = [("relu",), ("avgpool", 2, 2, 0), ("flatten",), ("dense", 10)]
    nets = train_both(monkeypatch, layers, (3, 6, 6))
    assert fused_pairs(nets[1]) == [(0, 1)]
    assert_same_bits(nets, (3, 6, 6))


def test_relu_with_two_readers_is_not_fused(monkeypatch):
    # the relu's output is also read by the add: its output gradient is the sum of two
    layers = [("conv2d", 4, 3, 1, 1), ("relu",), ("avgpool", 3, 1, 1), ("add", 2, 1), ("flatten",), ("dense", 10)]
    sources = [None, None, None, None, None, None]
    nets = train_both(monkeypatch, layers, (1, 6, 6), sources=sources)
    assert fused_pairs(nets[1]) == []
    assert_same_bits(nets, (1, 6, 6))


def test_maxpool_and_distant_pool_not_fused(monkeypatch):
    layers = [("conv2d", 4, 3, 1, 1), ("relu",), ("maxpool", 2, 2, 0), ("relu",), ("flatten",), ("dense", 10)]
    net = build(monkeypatch, True, layers, (1, 8, 8))
    assert fused_pairs(net) == []


def test_two_replicas_fused_and_bit_identical(monkeypatch, logical_cpus):
    logical_cpus(2)
    nets = train_both(monkeypatch, LENET, (1, 28, 28), n=64, devices=("cpu:0", "cpu:1"))
    assert fused_pairs(nets[1]) == [(1, 2), (4, 5)]
    assert_same_bits(nets, (1, 28, 28))


def test_check_numerics_same_diagnosis(monkeypatch):
    """find_nonfinite runs every layer on its own (it scans each layer's output
    gradient, which the fused backward does not write): the same diagnosis."""
    nets = [build(monkeypatch, fuse, LENET, (1, 28, 28)) for fuse in (False, True)]
    X, y = batch((1, 28, 28), 8, seed=1)
    X[3, 0, 5, 5] = np.inf
    found = [net._model.find_nonfinite(X, y) for net in nets]
    assert found[0] == found[1]
    assert found[1][0] >= 0


# a ResNet-style block: conv, batchnorm + relu (fused), conv, batchnorm, add + relu (fused; the add's
# reads keep the second batchnorm apart), then a batchnorm + relu + avgpool (the relu fused with the pool)
RESBLOCK = [("conv2d", 4, 3, 1, 1), ("batchnorm",), ("relu",), ("conv2d", 4, 3, 1, 1), ("batchnorm",),
            ("add", 4, 0), ("relu",), ("batchnorm",), ("relu",), ("avgpool", 2, 2, 0), ("flatten",), ("dense", 10)]


def test_batchnorm_relu_fused_and_bit_identical(monkeypatch):
    nets = train_both(monkeypatch, RESBLOCK, (2, 8, 6), sources=[None] * len(RESBLOCK))
    assert fused_pairs(nets[0]) == []
    assert fused_pairs(nets[1]) == [(1, 2), (5, 6), (8, 9)]
    assert_same_bits(nets, (2, 8, 6))


def test_resnet18_batchnorm_relu_and_add_relu_pairs_fused():
    net = dp.models.ResNet18(devices=["cpu:0"])
    layers = net._model.layers()
    pairs = fused_pairs(net)
    assert all(layers[j][0] == "relu" and j == i + 1 for i, j in pairs)
    assert sum(layers[i][0] == "batchnorm" for i, _ in pairs) == 9  # the stem's and each block's first
    assert sum(layers[i][0] == "add" for i, _ in pairs) == 8  # each block's end
    assert len(pairs) == 17


def test_add_with_two_readers_is_not_fused(monkeypatch):
    # the first add's output is read by the relu after it and by the second add: written, kept apart
    layers = [("conv2d", 4, 3, 1, 1), ("batchnorm",), ("add", 1, 0), ("relu",), ("add", 3, 2), ("relu",),
              ("flatten",), ("dense", 10)]
    nets = train_both(monkeypatch, layers, (1, 5, 5), sources=[None] * len(layers))
    assert fused_pairs(nets[1]) == [(4, 5)]
    assert_same_bits(nets, (1, 5, 5))


def test_batchnorm_with_two_readers_is_not_fused(monkeypatch):
    layers = [("conv2d", 4, 3, 1, 1), ("batchnorm",), ("relu",), ("add", 2, 1), ("flatten",), ("dense", 10)]
    nets = train_both(monkeypatch, layers, (1, 5, 5), sources=[None] * len(layers))
    assert fused_pairs(nets[1]) == []
    assert_same_bits(nets, (1, 5, 5))


def test_two_replicas_sync_batchnorm_relu_fused_and_bit_identical(monkeypatch, logical_cpus):
    logical_cpus(2)
    nets = []
    for fuse in (False, True):
        if fuse:
            monkeypatch.delenv("DPCORE_FUSE", raising=False)
        else:
            monkeypatch.setenv("DPCORE_FUSE", "0")
        nets.append(dp.models.Sequential(RESBLOCK, input_shape=(2, 8, 6), sources=[None] * len(RESBLOCK), seed=5,
                                         init="torch", devices=["cpu:0", "cpu:1"], sync_batchnorm=True))
        monkeypatch.delenv("DPCORE_FUSE", raising=False)
    for s in range(2):
        X, y = batch((2, 8, 6), 24, seed=s)
        assert nets[0].train_step(X, y, lr=0.05) == nets[1].train_step(X, y, lr=0.05)
    assert fused_pairs(nets[1]) == [(1, 2), (5, 6), (8, 9)]
    assert_same_bits(nets, (2, 8, 6))


def test_check_numerics_same_diagnosis_batchnorm_relu(monkeypatch):
    nets = [build(monkeypatch, fuse, RESBLOCK, (2, 8, 6), sources=[None] * len(RESBLOCK)) for fuse in (False, True)]
    X, y = batch((2, 8, 6), 8, seed=1)
    X[3, 1, 2, 2] = np.nan
    found = [net._model.find_nonfinite(X, y) for net in nets]
    assert found[0] == found[1]
    assert found[1][0] >= 0
