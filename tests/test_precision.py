"""dp.set_precision / dp.get_precision (python/dpcore/config.py): the process-wide
choice between float32-faithful arithmetic ("float32", the default) and the
faster forms of larger rounding error ("fast").

What "float32" promises, and how it is checked here. On the CPU the only form
outside it is Winograd F(3x3, 5x5) (LeNet's 20 -> 50 layer): its forward
error is ~5x, its gradients' 13-16x float32 GEMM's (benchmarks/winograd_error.py,
benchmarks/RESULTS.md). In LeNet trained from the book's initialisation, a 5x
larger forward error flips ReLU units whose pre-activation lies within it of 0,
and each flip moves the weights by far more than rounding: after three SGD
steps the weights' distance to float64 was ~100x the GEMM path's. The default
runs that layer by FFT (csrc/fft_lanes.h: a unitary transform, float32 GEMM's
error per pass, tests/test_fft.py). So the checks are (1) that the default
runs no F(3x3, 5x5) pass and "fast" does (debug_counters: what the switch
switches, not a difference in rounding), and (2) that LeNet's three book steps
in the default precision (the FFT on the 5x5 layer) land within 2x of the
float32 GEMM path's distance to a float64 NumPy reference (tests/test_lenet.py's,
itself checked against finite differences); the fast precision's distance is
printed beside it, not asserted (how many units flip is the data's accident).

On a GPU the precision sets TF32 and cuDNN's non-deterministic algorithms
(tests/test_gpu.py checks what those do); here, the settings' round trip.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

import dpcore as dp
import test_lenet as tl


@pytest.fixture(autouse=True)
def default_precision(monkeypatch):
    """Every test starts from, and leaves behind, the documented defaults, with
    the A/B switches of the convolution forms unset."""
    for name in ("DPCORE_WINOGRAD", "DPCORE_WINOGRAD_F35", "DPCORE_WINOGRAD_F43", "DPCORE_IMPLICIT_GEMM", "DPCORE_FFT"):
        monkeypatch.delenv(name, raising=False)
    dp.set_precision("float32")
    yield
    dp.set_precision("float32")


def f35_passes():
    return dp._core.debug_counters()["winograd_f35"]


def test_the_default_in_a_fresh_interpreter():
    code = ("import dpcore as dp; print(dp.get_precision(), dp.get_deterministic(), dp.get_allow_tf32(), "
            "dp.build_info()['precision'], dp.build_info()['summary']['precision'])")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DPCORE_WINOGRAD")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.split() == ["float32", "True", "False", "float32", "float32"]


def test_round_trip_and_what_it_sets():
    dp.set_precision("fast")
    assert dp.get_precision() == "fast" and dp.build_info()["precision"] == "fast"
    assert dp.get_deterministic() is False and dp.get_allow_tf32() is True and dp._core.get_fast_convolutions()
    dp.set_precision("float32")
    assert dp.get_precision() == "float32"
    assert dp.get_deterministic() is True and dp.get_allow_tf32() is False and not dp._core.get_fast_convolutions()
    # one GPU switch changed alone: neither precision any more
    dp.set_allow_tf32(True)
    assert dp.get_precision() == "custom" and dp.build_info()["summary"]["precision"] == "custom"
    dp.set_precision("fast")
    dp.set_deterministic(True)
    assert dp.get_precision() == "custom" and dp._core.get_fast_convolutions()


@pytest.mark.parametrize("bad,exc", [("exact", ValueError), ("FAST", ValueError), ("", ValueError),
                                     (None, TypeError), (1, TypeError), (b"fast", TypeError)])
def test_bad_values_are_refused_and_change_nothing(bad, exc):
    dp.set_precision("fast")
    with pytest.raises(exc, match="precision must be one of"):
        dp.set_precision(bad)
    assert dp.get_precision() == "fast"


def test_exported_from_the_package():
    for name in ("set_precision", "get_precision"):
        assert name in dp.__all__ and callable(getattr(dp, name))


def lenet_conv2(n=16, seed=0):
    rng = np.random.default_rng(seed)
    x = np.maximum(rng.standard_normal((n, 20, 13, 13)), 0).astype(np.float32)
    w = (rng.standard_normal((50, 20, 5, 5)) * 0.06).astype(np.float32)
    dy = rng.standard_normal((n, 50, 9, 9)).astype(np.float32)
    return x, w, dy


def test_the_precision_switches_the_5x5_form(monkeypatch):
    """dp.ops on LeNet's 20 -> 50 layer: no F(3x3, 5x5) pass by default, one per call in
    the fast precision; DPCORE_WINOGRAD_F35 overrides the precision either way
    (A/B work), DPCORE_WINOGRAD=0 turns every Winograd form off."""
    x, w, dy = lenet_conv2()

    def passes(**env):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        before = f35_passes()
        dp.ops.conv2d(x, w)
        dp.ops.conv2d_backward(x, w, dy)
        for k in env:
            monkeypatch.delenv(k)
        return f35_passes() - before

    assert passes() == 0
    assert passes(DPCORE_WINOGRAD_F35="1") == 2
    dp.set_precision("fast")
    assert passes() == 2
    assert passes(DPCORE_WINOGRAD_F35="0") == 0
    assert passes(DPCORE_WINOGRAD="0") == 0
    monkeypatch.setenv("DPCORE_WINOGRAD_F35", "yes")
    with pytest.raises(ValueError, match="DPCORE_WINOGRAD_F35"):
        dp.ops.conv2d(x, w)


def test_a_strategy_takes_a_change_at_its_next_step(logical_cpus):
    """Two replicas: steps in the default precision run no F(3x3, 5x5) pass; after
    set_precision('fast') between steps the next step runs them (the step's warm-up
    sizes the larger scratch first: no 'would grow inside a training step' error),
    and back again; the History of dp.train records the precision in force."""
    logical_cpus(2)
    X, y = tl.random_batch(3, n=64)
    with dp.MirroredStrategy(["cpu:0", "cpu:1"]).scope():
        net = dp.models.LeNet(seed=0)
    before = f35_passes()
    net.train_step(X, y, lr=0.05)
    assert f35_passes() == before
    dp.set_precision("fast")
    net.train_step(X, y, lr=0.05)
    # forward and backward on each replica, in the step's warm-up (a new precision is a new
    # warm-up key: csrc/mirrored.c) and in the step
    assert f35_passes() - before == 2 * 2 * 2
    dp.set_precision("float32")
    mid = f35_passes()
    net.train_step(X, y, lr=0.05)
    assert f35_passes() == mid
    it = dp.data.from_arrays(X, y, batch_size=32)
    h = dp.train(net, it, num_epochs=1, lr=0.05, verbose=False)
    assert h.precision == "float32"
    dp.set_precision("fast")
    h = dp.train(net, it, num_epochs=1, lr=0.05, verbose=False)
    assert h.precision == "fast" and f35_passes() > mid


def book_steps(steps=3, n=97, lr=0.1, mu=0.9, wd=1e-3):
    """LeNet from the book's initialisation (dp.models.LeNet(seed=0): N(0, 0.01)), `steps`
    SGD steps on synthetic uint8 images with labels a function of them: dpcore's weights and
    logits, and the float64 reference's, from the same float32 start."""
    rng = np.random.default_rng(5)
    net = dp.models.LeNet(seed=0)
    W0 = net.get_weights()
    P, V = tl.to64(W0), None
    for _ in range(steps):
        X = (rng.random((n, 1, 28, 28)) ** 3 * 255).astype(np.uint8)
        y = (X.reshape(n, -1).astype(np.int64).sum(axis=1) // 97) % 10
        _, G, _ = tl.ref_loss_grads(P, tl.as_unit64(X), y)
        P, V = tl.ref_sgd(P, G, V, lr, mu, wd)
        net.train_step(X, y, lr=lr, momentum=mu, weight_decay=wd)
    Xt = (rng.random((64, 1, 28, 28)) ** 3 * 255).astype(np.uint8)
    W = net.get_weights()
    moved = np.sqrt(sum(((P[k] - W0[k].astype(np.float64)) ** 2).sum() for k in tl.NAMES))
    dist = np.sqrt(sum(((W[k].astype(np.float64) - P[k]) ** 2).sum() for k in tl.NAMES)) / moved
    ref_logits, _ = tl.ref_forward(P, tl.as_unit64(Xt))
    logits = float(np.abs(net.predict(Xt) - ref_logits).max() / np.abs(ref_logits).max())
    return dist, logits


def test_default_lenet_is_as_close_to_float64_as_the_gemm_path(monkeypatch):
    """The weights after three book steps, ||w - w64|| / ||w64 - w0|| over every tensor,
    and the evaluation logits' max relative error: the default (the FFT on the 5x5 layer)
    within 2x of the float32 GEMM path's (DPCORE_WINOGRAD=0 DPCORE_FFT=0), which itself
    stays a float32 distance from float64 (below 1e-4: the one-step gradient bound of
    tests/test_lenet.py, GRAD_TOL 5e-5, over the ~1e-1 relative movement of three steps,
    with room for a ReLU unit that flips)."""
    before, fft_before = f35_passes(), dp._core.debug_counters()["fft"]
    default = book_steps()
    assert f35_passes() == before and dp._core.debug_counters()["fft"] > fft_before
    monkeypatch.setenv("DPCORE_WINOGRAD", "0")
    monkeypatch.setenv("DPCORE_FFT", "0")
    fft_before = dp._core.debug_counters()["fft"]
    gemm = book_steps()
    assert dp._core.debug_counters()["fft"] == fft_before
    monkeypatch.delenv("DPCORE_WINOGRAD")
    monkeypatch.delenv("DPCORE_FFT")
    dp.set_precision("fast")
    fast = book_steps()
    print(f"\nLeNet, 3 book steps, distance to float64 (weights, logits): default {default[0]:.2g}, "
          f"{default[1]:.2g}; GEMM path {gemm[0]:.2g}, {gemm[1]:.2g}; fast {fast[0]:.2g}, {fast[1]:.2g}")
    assert gemm[0] < 1e-4 and gemm[1] < 1e-4, gemm
    assert default[0] <= 2 * gemm[0] and default[1] <= 2 * gemm[1], (default, gemm)


def test_resnet18_on_the_cpu_is_the_same_arithmetic_in_both_precisions():
    """ResNet-18 has no 5x5 layer, so on the CPU the fast precision runs the same forms as
    the default: two SGD steps and the evaluation logits are bitwise equal (and no
    F(3x3, 5x5) pass runs). benchmarks/RESULTS.md's book run records the fast precision's
    epochs on the CPU as the default's on this ground: a change to what "fast" switches
    on the CPU fails here first."""
    rng = np.random.default_rng(5)
    X = rng.integers(0, 256, (6, 1, 16, 16), dtype=np.uint8)
    y = rng.integers(0, 10, 6)
    runs = {}
    for precision in ("float32", "fast"):
        dp.set_precision(precision)
        before = f35_passes()
        net = dp.models.ResNet18(seed=2, input_size=16, init="d2l", devices=["cpu:0"])
        losses = [net.train_step(X, y, lr=0.1, momentum=0.9)[0] for _ in range(2)]
        runs[precision] = (losses, np.concatenate([w.ravel() for w in net.get_weights().values()]).view(np.uint32), net.predict(X).view(np.uint32))
        assert f35_passes() == before
    assert runs["float32"][0] == runs["fast"][0]
    assert np.array_equal(runs["float32"][1], runs["fast"][1])
    assert np.array_equal(runs["float32"][2], runs["fast"][2])
