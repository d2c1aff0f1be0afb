"""Absurd shapes are a ValueError that names the layer and the argument or
size at fault, never an OverflowError, a MemoryError after a huge allocation,
a wrong shape from a wrapped int, or a crash.

The core computes every layer shape in 64 bits and rejects any size its
kernels cannot index with an int (values per sample, weights) where the layer
is added (csrc/shapes.c, csrc/layers.c), so none of these models allocates
anything. The binding parses every size argument (layer arguments, the
model's input shape, the single ops' stride / padding / kernel) in 64 bits
and leaves the range to those checks, which name the argument.
"""
import numpy as np
import pytest

import dpcore as dp

INT_MAX = 2**31 - 1


# ---- models: rejected where the layer is added, naming it ---------------------------


def test_conv_padding_that_overflows_int_is_a_value_error():
    # 28 + 2 * 2**30 overflows an int; the output would be (2**31 + 26)**2 per channel
    with pytest.raises(ValueError, match=r"conv2d \(layer 0\): the output .* more than the largest supported"):
        dp.models.Sequential([("conv2d", 1, 3, 1, 2**30), ("flatten",), ("dense", 10)])


def test_conv_output_over_int_max_values_per_sample_is_a_value_error():
    # the most channels there may be (dp._check.MAX_FEATURES), on a 256x256 input: 2**32 values per sample
    with pytest.raises(ValueError, match=r"conv2d \(layer 0\): the output \(65536, 256, 256\)"):
        dp.models.Sequential([("conv2d", 65536, 1, 1, 0), ("flatten",), ("dense", 10)], input_shape=(1, 256, 256))


def test_conv_weights_over_int_max_are_a_value_error():
    # a (65536, 1, 1) output, but 65536 * 64 * 28 * 28 weights
    with pytest.raises(ValueError, match=r"conv2d \(layer 0\): 3288334336 weights"):
        dp.models.Sequential([("conv2d", 65536, 28, 1, 0), ("flatten",), ("dense", 10)], input_shape=(64, 28, 28))


def test_dense_weights_over_int_max_are_a_value_error():
    with pytest.raises(ValueError, match=r"dense \(layer 1\): 274877906944 weights \(65536 x 4194304\)"):
        dp.models.Sequential([("flatten",), ("dense", 65536)], input_shape=(1, 2048, 2048))


@pytest.mark.parametrize("spec, match", [
    (("conv2d", 65537, 3, 1, 0), r"conv2d \(layer 0\): out_channels must be at most 65536, got 65537"),
    (("dense", 65537), r"dense \(layer 1\): out_features must be at most 65536, got 65537"),
])
def test_layer_widths_beyond_the_documented_limit(spec, match):
    layers = [spec, ("flatten",), ("dense", 10)] if spec[0] == "conv2d" else [("flatten",), spec]
    with pytest.raises(ValueError, match=match):
        dp.models.Sequential(layers)
    with pytest.raises(ValueError, match=match):  # the core's own check, without Python's in front
        dp._core.Model((1, 28, 28), layers)


def test_model_input_over_int_max_values_is_a_value_error():
    with pytest.raises(ValueError, match=r"model input: the input \(1, 1048576, 1048576\)"):
        dp.models.Sequential([("flatten",), ("dense", 10)], input_shape=(1, 2**20, 2**20))


def test_pool_padding_is_checked_without_overflow():
    # 2 * padding overflows an int; the rule is padding <= kernel / 2
    with pytest.raises(ValueError, match=r"avg_pool2d \(layer 0\): padding 1073741824 must be at most half"):
        dp.models.Sequential([("avgpool", 2**30, 1, 2**30), ("flatten",), ("dense", 10)])


def test_pool_that_grows_past_int_max_is_a_value_error():
    # 46340**2 values fit an int, 46341**2 do not; rejected before anything is allocated
    with pytest.raises(ValueError, match=r"max_pool2d \(layer 0\): the output \(1, 46341, 46341\)"):
        dp.models.Sequential([("maxpool", 2, 1, 1), ("flatten",), ("dense", 10)], input_shape=(1, 46340, 46340))


def test_lenet_with_absurd_sizes():
    with pytest.raises(ValueError, match="in_channels must be an int >= 1 and <= 65536, got 1073741824"):
        dp.models.LeNet(in_channels=2**30)
    with pytest.raises(ValueError, match="num_classes must be an int >= 1 and <= 65536, got 1073741824"):
        dp.models.LeNet(num_classes=2**30)
    with pytest.raises(ValueError, match=r"model input: channels must be at most 65536"):
        dp._core.Model((2**30, 28, 28), [("flatten",), ("dense", 10)])


def test_largest_accepted_shapes_still_build():
    """The checks reject sizes, not large arguments: a stride of INT_MAX builds."""
    net = dp.models.Sequential([("conv2d", 1, 3, INT_MAX, 0), ("flatten",), ("dense", 10)], input_shape=(1, 3, 3))
    assert net.num_classes == 10


def test_conv_padding_2_31_names_the_argument():
    with pytest.raises(ValueError, match=r"conv2d \(layer 0\): padding 2147483648 is larger than"):
        dp.models.Sequential([("conv2d", 1, 3, 1, 2**31), ("flatten",), ("dense", 10)])


@pytest.mark.parametrize("spec, match", [
    (("conv2d", 1, 3, 1, 2**70), r"conv2d \(layer 0\): padding 1180591620717411303424 is out of range"),
    (("conv2d", -2**70, 3, 1, 0), r"conv2d \(layer 0\): out_channels -1180591620717411303424 is out of range"),
    (("maxpool", 2, 2**64, 0), r"max_pool2d \(layer 0\): stride 18446744073709551616 is out of range"),
    (("dense", 2**62), r"dense \(layer 0\): out_features must be at most 65536, got 4611686018427387904"),
    (("batchnorm", 10**400), r"batchnorm \(layer 0\): eps 1000.* is out of range"),
    (("add", -1, 2**40), r"add \(layer 0\): layer_b 1099511627776 is not an existing layer"),
])
def test_layer_arguments_beyond_any_size_name_the_argument(spec, match):
    with pytest.raises(ValueError, match=match):
        dp.models.Sequential([spec, ("flatten",), ("dense", 10)])


def test_model_input_dimension_over_int_max_is_a_value_error():
    with pytest.raises(ValueError, match=r"input_shape\[1\] must be an int >= 1 and <= 2147483647, got 2147483648"):
        dp.models.Sequential([("flatten",), ("dense", 10)], input_shape=(1, 2**31, 1))
    # the binding's own checks, without Python's in front
    with pytest.raises(ValueError, match="model input: height 2147483648 is larger than"):
        dp._core.Model((1, 2**31, 1), [("flatten",), ("dense", 10)])
    with pytest.raises(ValueError, match="model input: width 1267650600228229401496703205376 is out of range"):
        dp._core.Model((1, 1, 2**100), [("flatten",), ("dense", 10)])


def test_a_source_beyond_64_bits_is_a_value_error():
    with pytest.raises(ValueError, match=r"sources\[1\]: layer 18446744073709551616 is out of range"):
        dp.models.Sequential([("flatten",), ("dense", 10)], sources=[None, 2**64])
    # 2**32 wrapped to layer 0 when the binding cut it to an int
    with pytest.raises(ValueError, match="source 4294967296 is not an existing layer"):
        dp.models.Sequential([("flatten",), ("dense", 10)], sources=[None, 2**32])


# ---- single ops ------------------------------------------------------------------------

X = np.ones((1, 1, 8, 8), np.float32)
W = np.ones((2, 1, 3, 3), np.float32)


def test_single_ops_accept_the_largest_int_stride():
    assert dp.ops.conv2d(X, W, stride=INT_MAX).shape == (1, 2, 1, 1)
    assert dp.ops.max_pool2d(X, 2, stride=INT_MAX).shape == (1, 1, 1, 1)


@pytest.mark.parametrize("op, match", [
    pytest.param(lambda: dp.ops.conv2d(X, W, stride=2**40), "stride must be an int >= 1 and <= 2147483647",
                 id="ops.conv2d-stride-2**40"),
    pytest.param(lambda: dp.ops.avg_pool2d(X, 2**40), "kernel_size must be an int >= 1 and <= 2147483647",
                 id="ops.avg_pool2d-kernel-2**40"),
    pytest.param(lambda: dp.ops.max_pool2d_backward(X, X, 2, padding=2**80), "padding must be an int >= 0",
                 id="ops.max_pool2d_backward-padding-2**80"),
    # the binding's own checks (dp._core), without Python's in front
    pytest.param(lambda: dp._core.conv2d_forward(X, W, None, 2**40, 0), "conv2d: stride 1099511627776 is larger than",
                 id="conv2d-stride-2**40"),
    pytest.param(lambda: dp._core.conv2d_forward(X, W, None, 1, 2**31), "conv2d: padding 2147483648 is larger than",
                 id="conv2d-padding-2**31"),
    # H + 2 * padding overflowed an int here once; the output is what is too large
    pytest.param(lambda: dp.ops.conv2d(X, W, padding=2**30), r"conv2d: the output \(2, 2147483654, 2147483654\)",
                 id="conv2d-padding-2**30"),
    pytest.param(lambda: dp._core.avg_pool2d_forward(X, 2**40, 2**40, 0),
                 "avg_pool2d: kernel 1099511627776 is larger than", id="avg_pool2d-kernel-2**40"),
    pytest.param(lambda: dp._core.max_pool2d_forward(X, 2, 2**40, 0), "max_pool2d: stride 1099511627776 is larger than",
                 id="max_pool2d-stride-2**40"),
    pytest.param(lambda: dp._core.max_pool2d_backward(X, X, 2, 2, 2**80), "max_pool2d: padding .* is out of range",
                 id="max_pool2d_backward-padding-2**80"),
    pytest.param(lambda: dp._core.conv2d_backward(X, W, np.ones((1, 2, 6, 6), np.float32), -2**70, 0),
                 "conv2d: stride .* is out of range", id="conv2d_backward-stride--2**70"),
])
def test_single_op_sizes_over_int_max_are_value_errors(op, match):
    with pytest.raises(ValueError, match=match):
        op()
