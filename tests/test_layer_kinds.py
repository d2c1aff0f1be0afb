"""The layer kinds' table (csrc/layers.c), as the binding and dp.models read
it: layer tuples parsed and refused by its argument names, tensors laid out
and named by it, parameters initialised by its rules exactly as the per-kind
code it replaced did."""
from collections import OrderedDict

import numpy as np
import pytest

import dpcore as dp
from dpcore import _core

KINDS = dp.models.layer_kinds()


def test_every_kind_is_described():
    assert list(KINDS) == ["conv2d", "dense", "relu", "avgpool", "maxpool", "flatten", "batchnorm", "add",
                           "global_avgpool"]
    for name, info in KINDS.items():
        assert len(info["types"]) == len(info["args"])
        assert set(info["defaults"]) <= set(info["args"])
        for tensor, buffer, dims, init in info["tensors"]:
            assert buffer in ("params", "state") and dims
            assert set(init) == {"normal", "torch", "d2l"}
            assert set(init.values()) <= {"zeros", "ones", "normal", "fan_in_uniform"}
        # the docstring of Sequential is written from the table
        assert repr(name) in dp.models.Sequential.__doc__
    assert KINDS["batchnorm"]["defaults"] == {"eps": 1e-5, "momentum": 0.1}
    assert KINDS["add"]["sources"] == 2


def test_layouts_are_shaped_by_the_table():
    net = dp.models.Sequential([("conv2d", 4, 3, 2, 1), ("batchnorm",), ("relu",), ("maxpool", 2, 2, 0),
                                ("flatten",), ("dense", 5)], input_shape=(3, 9, 9))
    params = [(layer, name, shape) for layer, name, _, shape in net._model.param_layout()]
    assert params == [(0, "weight", (4, 3, 3, 3)), (0, "bias", (4,)), (1, "weight", (4,)), (1, "bias", (4,)),
                      (5, "weight", (5, 16)), (5, "bias", (5,))]
    state = [(layer, name, offset, shape) for layer, name, offset, shape in net._model.state_layout()]
    assert state == [(1, "running_mean", 0, (4,)), (1, "running_var", 4, (4,))]
    w = net.get_weights()
    np.testing.assert_array_equal(w["1.running_mean"], 0.0)
    np.testing.assert_array_equal(w["1.running_var"], 1.0)


def reference_init(net, init, init_std, seed):
    """The initialisation as dp.models wrote it per kind before the table."""
    rng = np.random.default_rng(seed)
    out, fan_in = OrderedDict(), {}
    for layer, kind, offset, shape in net._model.param_layout():
        size = int(np.prod(shape))
        name = f"{net._names[layer]}.{kind}"
        if net._specs[layer][0] == "batchnorm":
            out[name] = np.full(size, 1.0 if kind == "weight" else 0.0, np.float32)
            continue
        if kind == "weight":
            fan_in[layer] = int(np.prod(shape[1:]))
        if init == "normal":
            values = rng.normal(0.0, init_std, size) if kind == "weight" else np.zeros(size)
        elif init == "d2l" and kind == "weight":  # d2l 12.6's train(): weights re-drawn, biases PyTorch's
            values = rng.normal(0.0, init_std, size)
        else:
            bound = 1.0 / np.sqrt(fan_in[layer])
            values = rng.uniform(-bound, bound, size)
        out[name] = values.astype(np.float32)
    return out


@pytest.mark.parametrize("seed", [0, 3])
@pytest.mark.parametrize("make, init, std", [
    (lambda seed: dp.models.LeNet(seed=seed), "normal", 0.01),
    (lambda seed: dp.models.ResNet18(seed=seed), "torch", None),
    (lambda seed: dp.models.ResNet18(seed=seed, init="d2l"), "d2l", 0.01),
    (lambda seed: dp.models.Sequential([("conv2d", 4, 3, 1, 1), ("batchnorm", 1e-3, 0.2), ("relu",),
                                        ("avgpool", 2, 2, 0), ("flatten",), ("dense", 5)],
                                       seed=seed, init_std=0.5), "normal", 0.5),
], ids=["lenet", "resnet18", "resnet18-d2l", "sequential-bn-normal"])
def test_init_rules_reproduce_the_per_kind_code_bitwise(make, init, std, seed):
    net = make(seed)
    expected = reference_init(net, init, std, seed)
    got = net.get_weights()
    for name, value in expected.items():
        assert np.array_equal(got[name].ravel().view(np.uint32), value.view(np.uint32)), name


@pytest.mark.parametrize("spec, exc, match", [
    (("conv2d", 4, 3, 1), ValueError, r"conv2d \(layer 0\): takes 4 arguments \(out_channels, kernel, stride, "
                                      r"padding\), got 3"),
    (("relu", 1), ValueError, r"relu \(layer 0\): takes no arguments, got 1"),
    (("batchnorm", 1e-5, 0.1, 0), ValueError, r"batchnorm \(layer 0\): takes 0 to 2 arguments \(eps, momentum\)"),
    (("maxpool", 2, 2.0, 0), TypeError, r"max_pool2d \(layer 0\): stride must be an integer, got float"),
    (("batchnorm", "x"), TypeError, r"batchnorm \(layer 0\): eps must be a real number, got str"),
    (("dense", 0), ValueError, r"dense \(layer 0\): out_features must be >= 1, got 0"),
    (("conv3d", 1), ValueError, r"unknown layer kind 'conv3d'"),
])
def test_layer_tuples_are_refused_by_argument_name(spec, exc, match):
    with pytest.raises(exc, match=match):
        dp.models.Sequential([spec, ("flatten",), ("dense", 10)])


def test_numpy_integers_are_integers_and_bools_are_not():
    net = dp.models.Sequential([("conv2d", np.int64(2), np.int32(3), np.uint8(1), 0), ("flatten",), ("dense", 3)])
    assert net._model.param_layout()[0][3] == (2, 1, 3, 3)
    # stride=True is a mistake, not a 1 (issue 11: bool is refused where a number is expected)
    with pytest.raises(TypeError, match=r"conv2d \(layer 0\): stride must be an integer, got bool"):
        dp.models.Sequential([("conv2d", 2, 3, True, 0), ("flatten",), ("dense", 3)])
    with pytest.raises(TypeError, match=r"batchnorm \(layer 0\): eps must be a real number, got bool"):
        dp.models.Sequential([("batchnorm", True), ("flatten",), ("dense", 3)])


def test_layer_kinds_is_a_fresh_copy():
    kinds = _core.layer_kinds()
    kinds["conv2d"]["defaults"]["padding"] = 0
    assert _core.layer_kinds()["conv2d"]["defaults"] == {}
