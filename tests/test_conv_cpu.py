"""The CPU backend's convolution on ResNet-18's geometries, against float64 NumPy.

tests/test_ops.py covers the convolution on small shapes. The CPU backend picks
its plan by size (csrc/backend_cpu.c), so these cases reach what small shapes
do not:

- narrow planes (OH*OW < 64: ResNet-18's 7x7 and 4x4 stages): several samples
  side by side in one GEMM, several groups per thread, unequal groups, and the
  cap on the im2col matrix (512 channels, 3x3, 4x4 planes);
- wide planes: one sample per GEMM, so a sample's result does not depend on the
  rest of the batch (bit for bit; the replica tests rely on it);
- dx of a stride-1 "same" convolution computed as a convolution of dy with the
  flipped filter, on real channel counts and rectangular planes, and the
  fallback (col2im) where the output is smaller than the input;
- im2col's stride phases (stride 2 with and without padding, 1x1 and 3x3);
- single-channel inputs (LeNet's and ResNet-18's first layer), convolved
  directly, and 2x2 average pooling at stride 2, both with loops of their own.

The reference is written here, independent of tests/test_ops.py: float64
windows of the padded input (sliding_window_view) contracted with einsum, and
dx scattered back window position by window position.

The bound (issue 29: derived, not read off one machine). Every output here is a
sum of n products of float32 inputs (plus the bias for y). Whatever the order
and grouping of the sum (a BLAS's blocking, dpcore's kernel's k order, groups of
samples, the threads' partials added at the end), each product passes through
one multiplication and at most n - 1 additions in any summation tree of n
terms, each rounding by (1 + d), |d| <= u = 2^-24 (a fused multiply-add rounds
once for both), so |computed - exact| <= gamma_n S, S the same sum of the
terms' absolute values (the reference run on |x|, |w|, |b|, |dy|; Higham,
Accuracy and Stability, 2nd ed., 3.1). n = C*KH*KW + 1 for y; O*KH*KW for dx
(col2im: a sum over O, then up to KH*KW columns added, O + KH*KW - 1 <= O*KH*KW;
as a convolution of dy: one sum over O*KH*KW); N*OH*OW for dw and db. The same
bound holds on OpenBLAS (any core type), dpcore's kernel, the implicit GEMM and
the direct single-channel loops (which accumulate in double: fewer roundings).
It does not hold for the Winograd paths (their transforms add inputs before
multiplying): this file runs with DPCORE_WINOGRAD=0, and each Winograd path's
file derives its own bound on the same geometries.
"""
import numpy as np
import pytest
from numpy.lib.stride_tricks import sliding_window_view

import dpcore as dp

ops = dp.ops

@pytest.fixture(autouse=True)
def gemm_paths(monkeypatch):
    """The GEMM path, the implicit GEMM and the direct loops (this file's subject and bound)."""
    monkeypatch.setenv("DPCORE_WINOGRAD", "0")
    monkeypatch.setenv("DPCORE_FFT", "0")       # the FFT (fft_lanes.h) is not a GEMM path either


def windows(x, KH, KW, stride, pad):
    """(N, C, OH, OW, KH, KW) float64 windows of the zero-padded input."""
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    return sliding_window_view(xp, (KH, KW), axis=(2, 3))[:, :, ::stride, ::stride]


def reference(x, w, b, dy, stride, pad):
    """y, dx, dw, db in float64."""
    N, C, H, W = x.shape
    KH, KW = w.shape[2:]
    w64, dy64 = w.astype(np.float64), dy.astype(np.float64)
    win = windows(x, KH, KW, stride, pad)
    y = np.einsum("nchwij,ocij->nohw", win, w64, optimize=True) + b.astype(np.float64)[None, :, None, None]
    dw = np.einsum("nchwij,nohw->ocij", win, dy64, optimize=True)
    db = dy64.sum(axis=(0, 2, 3))
    OH, OW = dy.shape[2:]
    dxp = np.zeros((N, C, H + 2 * pad, W + 2 * pad))
    for i in range(KH):
        for j in range(KW):
            dxp[:, :, i:i + stride * (OH - 1) + 1:stride, j:j + stride * (OW - 1) + 1:stride] += np.einsum(
                "nohw,oc->nchw", dy64, w64[:, :, i, j], optimize=True)
    return y, dxp[:, :, pad:pad + H, pad:pad + W], dw, db


def make(N, C, H, W, O, K, stride, pad, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((N, C, H, W)).astype(np.float32)
    w = (rng.standard_normal((O, C, K, K)) / np.sqrt(C * K * K)).astype(np.float32)
    b = rng.standard_normal(O).astype(np.float32)
    OH, OW = (H + 2 * pad - K) // stride + 1, (W + 2 * pad - K) // stride + 1
    dy = rng.standard_normal((N, O, OH, OW)).astype(np.float32)
    return x, w, b, dy


U32 = 2.0 ** -24  # float32's unit roundoff


def gamma(k):
    """gamma_k = k u / (1 - k u): the bound on k rounding factors (1 + d_i), |d_i| <= u."""
    return k * U32 / (1 - k * U32)


def assert_within_bound(got, ref, S, k, what):
    """|got - ref| <= gamma_k * S everywhere (S: the computation in absolute values)."""
    bound = gamma(k) * S
    excess = np.abs(got.astype(np.float64) - ref) - bound
    if excess.size:
        worst = np.unravel_index(np.argmax(excess), excess.shape)
        assert excess.max() <= 0, (
            f"{what}: |error| {abs(float(got[worst]) - ref[worst]):.3g} > bound {bound[worst]:.3g} at {worst}")


def assert_switch_rejects(monkeypatch, name, value, N, C, H, O, K, stride, pad):
    """name=value (not "0", "1" or unset): conv2d and conv2d_backward raise a ValueError naming it."""
    monkeypatch.setenv(name, value)
    x, w, b, dy = make(N, C, H, H, O, K, stride, pad, seed=1)
    with pytest.raises(ValueError, match=name):
        ops.conv2d(x, w, b, stride=stride, padding=pad)
    with pytest.raises(ValueError, match=name):
        ops.conv2d_backward(x, w, dy, stride=stride, padding=pad)


def assert_empty_batch(C, H, O, K, pad):
    """An empty batch: y and dx empty, dw and db zero."""
    x, w, b, dy = make(0, C, H, H, O, K, 1, pad, seed=1)
    y = ops.conv2d(x, w, b, stride=1, padding=pad)
    dx, dw, db = ops.conv2d_backward(x, w, dy, stride=1, padding=pad)
    OH = H + 2 * pad - K + 1
    assert y.shape == (0, O, OH, OH) and dx.shape == x.shape
    assert not dw.any() and not db.any()


def assert_lenet_one_and_two_replicas_agree(logical_cpus):
    """LeNet's steps on two replicas are one device's within float32 rounding, and the losses
    fall. Each step starts both from the one device's weights (issue 29: a bound is one step's;
    across steps a difference is carried on by the loss's curvature, which no float32 error model
    bounds), so the two losses are two float32 evaluations of one float64 loss, each within
    tests/test_lenet.py's LOSS_TOL of it (relative): 2 LOSS_TOL apart at most (as test_parallel)."""
    from test_lenet import LOSS_TOL
    logical_cpus(2)
    rng = np.random.default_rng(0)
    X = rng.standard_normal((64, 1, 28, 28)).astype(np.float32)
    y = rng.integers(0, 10, 64).astype(np.int32)
    one, two = dp.models.LeNet(devices=["cpu:0"], seed=3), dp.models.LeNet(devices=["cpu:0", "cpu:1"], seed=3)
    losses = []
    for _ in range(5):
        two.set_weights(one.get_weights())
        l1, l2 = float(one.train_step(X, y, lr=0.1)[0]), float(two.train_step(X, y, lr=0.1)[0])
        assert abs(l1 - l2) <= 2 * LOSS_TOL * abs(l1), (l1, l2)
        losses.append(l1)
    assert losses[-1] < losses[0]


def check(case, seed):
    N, C, H, W, O, K, stride, pad = case
    x, w, b, dy = make(N, C, H, W, O, K, stride, pad, seed)
    y = ops.conv2d(x, w, b, stride=stride, padding=pad)
    dx, dw, db = ops.conv2d_backward(x, w, dy, stride=stride, padding=pad)
    refs = reference(x, w, b, dy, stride, pad)
    assert y.shape == refs[0].shape and dx.shape == x.shape and dw.shape == w.shape and db.shape == b.shape
    assert_within_dot_bounds(case, (y, dx, dw, db), refs, reference(np.abs(x), np.abs(w), np.abs(b), np.abs(dy),
                                                                     stride, pad))


def assert_within_dot_bounds(case, got, refs, sums):
    """y, dx, dw, db within gamma_n S (the docstring's n; sums: the reference in absolute values)."""
    N, C, H, W, O, K, stride, pad = case
    OH, OW = refs[0].shape[2:]
    for a, ref, S, n, name in zip(got, refs, sums, (C * K * K + 1, O * K * K, N * OH * OW, N * OH * OW),
                                  ("forward", "dx", "dw", "db")):
        assert_within_bound(a, ref, S, max(n, 1), f"{case} {name}")


# (N, C, H, W, O, K, stride, pad)
RESNET_CASES = [
    (3, 1, 28, 28, 64, 3, 1, 1),      # stem
    (3, 64, 28, 28, 64, 3, 1, 1),     # stage 1: wide, dx as a convolution of dy
    (3, 64, 28, 28, 128, 3, 2, 1),    # into stage 2: stride-2 phases, col2im
    (3, 64, 28, 28, 128, 1, 2, 0),    # 1x1 shortcut, stride 2: one phase, one run per row
    (3, 128, 14, 14, 128, 3, 1, 1),   # stage 2
    (5, 256, 7, 7, 256, 3, 1, 1),     # stage 3: narrow (49 columns), grouped
    (5, 256, 7, 7, 512, 3, 2, 1),     # into stage 4
    (5, 256, 7, 7, 512, 1, 2, 0),
    (5, 512, 4, 4, 512, 3, 1, 1),     # stage 4: 16 columns a sample
]


@pytest.mark.parametrize("case", RESNET_CASES, ids=lambda c: "N{}C{}H{}W{}O{}K{}s{}p{}".format(*c))
def test_resnet18_geometries(case):
    check(case, seed=sum(case))


@pytest.mark.parametrize("case", [
    (50, 256, 7, 7, 16, 3, 1, 1),     # 49 columns a sample: groups of 13-17, two or more per thread
    (150, 512, 4, 4, 8, 3, 1, 1),     # 4608 x 16 per sample: the im2col matrix's cap bounds the groups
    (37, 512, 2, 2, 8, 3, 1, 1),      # 2x2 planes (ResNet-18 at 16x16 inputs), odd batch
    (9, 96, 5, 3, 12, 3, 1, 1),       # rectangular narrow planes
    (41, 64, 7, 7, 8, 3, 2, 1),       # stride 2 into 4x4, narrow
], ids=lambda c: "N{}C{}H{}W{}O{}K{}s{}p{}".format(*c))
def test_narrow_planes_grouped(case):
    check(case, seed=7 + sum(case))


@pytest.mark.parametrize("case", [
    (4, 24, 9, 13, 20, 5, 1, 2),      # 5x5 "same", rectangular: dx as a convolution of dy
    (3, 16, 12, 10, 24, 7, 1, 3),     # 7x7 "same"
    (4, 24, 9, 13, 20, 3, 1, 0),      # "valid": output smaller than the input, col2im instead
    (2, 8, 6, 6, 4, 3, 1, 2),         # output larger than the input (pad 2 with 3x3)
], ids=lambda c: "N{}C{}H{}W{}O{}K{}s{}p{}".format(*c))
def test_stride1_dx_paths(case):
    check(case, seed=11 + sum(case))


def assert_slices_match_the_batch(case, padding, slices):
    """y and dx of samples lo..hi computed alone are the bits of the whole batch's."""
    x, w, b, dy = case
    y_all = ops.conv2d(x, w, b, stride=1, padding=padding)
    dx_all = ops.conv2d_backward(x, w, dy, stride=1, padding=padding)[0]
    for lo, hi in slices:
        np.testing.assert_array_equal(ops.conv2d(x[lo:hi], w, b, stride=1, padding=padding), y_all[lo:hi])
        np.testing.assert_array_equal(ops.conv2d_backward(x[lo:hi], w, dy[lo:hi], stride=1, padding=padding)[0],
                                      dx_all[lo:hi])


def test_wide_plane_results_do_not_depend_on_the_rest_of_the_batch(monkeypatch):
    """One sample per GEMM on wide planes: a replica holding samples 3..5 of a batch computes
    them bit for bit as one device holding all six does. y is the implicit GEMM's (32 output
    channels: each output fused multiply-adds in tap order, in blocks of a constant size, per
    sample); dx ("same" padding: a convolution of dy) goes through dp_gemm, so this is a property
    of dpcore's GEMM kernel (each output the same blocked sum in k order, whatever the call's
    shape, threads or the operands' alignment), asked for here: the BLAS (DPCORE_OWN_GEMM=0) may choose its kernel and blocking by
    the call and the pointers' alignment, and promises no such bits (issue 29)."""
    if dp.build_info()["cpu_gemm"] == "the BLAS":
        pytest.skip("this build has no dpcore GEMM kernel: the property is the kernel's")
    monkeypatch.setenv("DPCORE_OWN_GEMM", "1")
    monkeypatch.setenv("DPCORE_IMPLICIT_GEMM", "1")
    assert_slices_match_the_batch(make(6, 64, 16, 16, 32, 3, 1, 1, seed=3), 1, ((0, 3), (3, 6), (4, 6), (1, 4)))


def test_results_are_repeatable_after_other_shapes():
    # The scratch memory (im2col's zero-padded planes included) holds another
    # geometry's numbers from the call before; the results must not change.
    # Guaranteed by construction: the same call twice (the same kernels, shapes,
    # threads, and operands at the same offsets in a 64-byte-aligned scratch).
    case = (5, 256, 7, 7, 16, 3, 2, 1)
    x, w, b, dy = make(*case, seed=5)
    first = ops.conv2d(x, w, b, stride=2, padding=1), ops.conv2d_backward(x, w, dy, stride=2, padding=1)
    check((3, 64, 28, 28, 16, 3, 1, 1), seed=6)
    again = ops.conv2d(x, w, b, stride=2, padding=1), ops.conv2d_backward(x, w, dy, stride=2, padding=1)
    np.testing.assert_array_equal(first[0], again[0])
    for a, c in zip(first[1], again[1]):
        np.testing.assert_array_equal(a, c)


# Single-channel inputs, stride 1, no padding: the direct convolution on the
# wide grid (forward, dw and db from the lanes, dx as a convolution of dy
# padded by K-1 with the flipped filter). Padded and stride-2 ones take
# im2col + GEMM.
@pytest.mark.parametrize("case", [
    (5, 1, 28, 28, 20, 3, 1, 0),      # LeNet's first layer
    (3, 1, 9, 13, 6, 5, 1, 2),        # 5x5 "same", rectangular: GEMM
    (4, 1, 12, 10, 7, 5, 1, 0),       # 5x5 valid, rectangular
    (2, 1, 6, 7, 3, 3, 1, 2),         # padding K-1: output larger than the input (GEMM)
    (2, 1, 5, 9, 4, 5, 1, 0),         # kernel as tall as the image: one output row
    (3, 1, 40, 3, 4, 3, 1, 0),        # narrow plane, one output column, several wide-grid blocks
    (3, 1, 11, 11, 5, 3, 2, 1),       # stride 2: the GEMM path
    (1, 1, 1, 1, 2, 1, 1, 0),         # 1x1 kernel on a 1x1 image
], ids=lambda c: "N{}C{}H{}W{}O{}K{}s{}p{}".format(*c))
def test_single_channel_direct(case):
    check(case, seed=13 + sum(case))


def test_single_channel_results_do_not_depend_on_the_rest_of_the_batch():
    # Each sample is convolved alone by dpcore's own direct loops (no BLAS, no
    # dp_gemm: backend_cpu.c's conv_direct_*), so y and dx of a sample are the
    # same bits whatever else the batch holds (and however the threads split it).
    assert_slices_match_the_batch(make(7, 1, 28, 28, 20, 3, 1, 0, seed=4), 0, ((0, 1), (3, 6), (4, 7), (1, 4)))


def ref_avg_pool_2x2(x):
    """float64 2x2 average pooling at stride 2 (odd last rows/columns dropped)."""
    N, C, H, W = x.shape
    OH, OW = H // 2, W // 2
    return x[:, :, :2 * OH, :2 * OW].astype(np.float64).reshape(N, C, OH, 2, OW, 2).mean(axis=(3, 5))


def ref_avg_pool_2x2_backward(x_shape, dy):
    dx = np.zeros(x_shape)
    OH, OW = dy.shape[2:]
    q = np.repeat(np.repeat(dy.astype(np.float64) / 4.0, 2, axis=2), 2, axis=3)
    dx[:, :, :2 * OH, :2 * OW] = q
    return dx


# 2x2 windows at stride 2 without padding: the CPU backend's own loops
# (tests/c/kernel_bodies.c checks them bit for bit against the GPU's bodies).
@pytest.mark.parametrize("shape", [(3, 20, 26, 26), (3, 50, 9, 9), (2, 3, 9, 12), (1, 2, 2, 3), (2, 1, 3, 5)])
def test_avg_pool_2x2(shape):
    rng = np.random.default_rng(sum(shape))
    x = rng.standard_normal(shape).astype(np.float32)
    OH, OW = shape[2] // 2, shape[3] // 2
    dy = rng.standard_normal(shape[:2] + (OH, OW)).astype(np.float32)
    dy[0, 0, 0, 0] = -0.0  # the body maps -0 to +0
    y = ops.avg_pool2d(x, 2, 2, 0)
    dx = ops.avg_pool2d_backward(x, dy, 2, 2, 0)
    assert y.shape == (shape[0], shape[1], OH, OW) and dx.shape == shape
    # y: 3 additions and a scaling by 1/4 (exact, or one rounding if written as a division): gamma_4 of
    # the mean of |x|; dx: dy / 4, one rounding at most (exact for normal numbers)
    assert_within_bound(y, ref_avg_pool_2x2(x), ref_avg_pool_2x2(np.abs(x)), 4, "avg_pool 2x2 forward")
    assert_within_bound(dx, ref_avg_pool_2x2_backward(shape, dy), np.abs(ref_avg_pool_2x2_backward(shape, dy)), 1,
                        "avg_pool 2x2 dx")
    assert not np.signbit(dx[0, 0, 0, 0])
