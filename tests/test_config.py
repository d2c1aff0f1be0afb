"""dp.set_deterministic / dp.set_allow_tf32: process-wide settings of the CUDA
backend (python/dpcore/config.py, dp_cuda_set_defaults in csrc/backend_cuda.c).

Here, on any machine: the defaults, the round trip through the C core, the
argument checks, and that the settings leave CPU training bitwise unchanged
(the CPU backend is deterministic and never uses TF32). What they do on a GPU
is checked in tests/test_gpu.py.
"""
import itertools
import subprocess
import sys

import numpy as np
import pytest

import dpcore as dp


@pytest.fixture(autouse=True)
def default_settings():
    """Every test starts from, and leaves behind, the documented defaults."""
    dp.set_deterministic(True)
    dp.set_allow_tf32(False)
    yield
    dp.set_deterministic(True)
    dp.set_allow_tf32(False)


def test_defaults():
    # a fresh interpreter, so that no other test's settings can leak in
    code = "import dpcore as dp; print(dp.get_deterministic(), dp.get_allow_tf32())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "False"]


def test_round_trip_and_independence():
    for deterministic, tf32 in itertools.product([True, False], repeat=2):
        dp.set_deterministic(deterministic)
        dp.set_allow_tf32(tf32)
        assert dp.get_deterministic() is deterministic
        assert dp.get_allow_tf32() is tf32
        assert dp._core.get_cuda_options() == (deterministic, tf32)
    dp.set_allow_tf32(True)
    dp.set_deterministic()  # flag defaults to True
    assert dp.get_deterministic() is True and dp.get_allow_tf32() is True


@pytest.mark.parametrize("bad", [1, 0, None, "yes", 1.0, np.int64(1), [True]])
def test_only_bools_are_accepted(bad):
    with pytest.raises(TypeError, match="must be True or False"):
        dp.set_deterministic(bad)
    with pytest.raises(TypeError, match="must be True or False"):
        dp.set_allow_tf32(bad)
    assert dp.get_deterministic() is True and dp.get_allow_tf32() is False  # unchanged


def test_exported_from_the_package():
    for name in ("set_deterministic", "get_deterministic", "set_allow_tf32", "get_allow_tf32"):
        assert name in dp.__all__ and callable(getattr(dp, name))


def synthetic(n=64, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(n, 1, 28, 28), dtype=np.uint8), rng.integers(0, 10, n)


def train_lenet():
    net = dp.models.LeNet(seed=5, devices=["cpu:0"])
    X, y = synthetic()
    losses = [net.train_step(X[i:i + 32], y[i:i + 32], lr=0.1, momentum=0.9)[0] for i in (0, 32, 0)]
    return losses, net._model.get_grads(), net._model.get_params()


def test_cpu_training_is_bitwise_the_same_under_every_setting():
    """The GPU switches leave the CPU's arithmetic alone. They share one settings word with
    the CPU's fast convolutions (dp.set_precision, csrc/backend_cuda.c): a set_deterministic /
    set_allow_tf32 that touched that bit would put LeNet's 5x5 layer on F(3x3, 5x5) and
    change these bits (tests/test_precision.py checks that the bit itself does)."""
    ref_losses, ref_grads, ref_params = train_lenet()
    for deterministic, tf32 in itertools.product([True, False], repeat=2):
        dp.set_deterministic(deterministic)
        dp.set_allow_tf32(tf32)
        losses, grads, params = train_lenet()
        assert losses == ref_losses
        np.testing.assert_array_equal(grads, ref_grads)
        np.testing.assert_array_equal(params, ref_params)


def test_a_model_made_before_a_change_keeps_training_the_same():
    """The settings reach existing devices too; a CPU device has nothing to change."""
    ref_losses, ref_grads, _ = train_lenet()
    net = dp.models.LeNet(seed=5, devices=["cpu:0"])
    X, y = synthetic()
    losses = [net.train_step(X[0:32], y[0:32], lr=0.1, momentum=0.9)[0]]
    dp.set_allow_tf32(True)
    dp.set_deterministic(False)
    losses += [net.train_step(X[i:i + 32], y[i:i + 32], lr=0.1, momentum=0.9)[0] for i in (32, 0)]
    assert losses == ref_losses
    np.testing.assert_array_equal(net._model.get_grads(), ref_grads)
