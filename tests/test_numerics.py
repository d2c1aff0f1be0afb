"""Fail fast on numerics (issue 11).

1. NaN and +-inf propagate through every op as they do in PyTorch: the
   expected values below are written from PyTorch's semantics (relu keeps NaN;
   threshold_backward is ``y <= 0 ? 0 : dy``; max-pool's ``val > max ||
   isnan(val)`` makes NaN win, the last NaN of a window taking the gradient;
   log_softmax of a row with NaN or +inf is NaN; argmax counts NaN as the
   maximum) and, for the finite entries, from float64 NumPy.
2. A training step whose loss is not finite raises FloatingPointError at that
   step, naming epoch, step and replica, and applies no update: parameters,
   momentum and BatchNorm statistics bitwise those before it, on 1 and 2
   replicas, host batches and resident rows.

The finite entries are checked against float64 within derived bounds (issue 29;
tests/test_ops.py's docstring derives each): |computed - exact| <= gamma_n S,
S the computation on absolute values, u = 2^-24: 3x3 average pooling n = 9 + 1
(nine terms, the rounded 1/9 and the product), dense y n = 6 + 1, conv2d
without bias n = 9 C (run with DPCORE_WINOGRAD=0: C <= 3 takes no Winograd form
anyway, F(2x2, 3x3) needs 64 channels); softmax cross-entropy's dlogits and row
losses within test_ops.xent_bounds (expf/logf within 1 ulp; a -inf logit's p is
0 exactly); SGD's w within gamma_7 (|w| + lr (mu |v| + |g| + wd |w|)). (Before:
one TOL = 1e-5 relative to |ref| + a term scale, read off one machine.)
"""
import re

import numpy as np
import pytest

import dpcore as dp
from test_conv_cpu import assert_within_bound
from test_lenet import as_unit64, random_weights, ref_forward, to64, xent
from test_ops import assert_within, sgd_bounds, xent_bounds
from test_train import synthetic

NAN, INF = np.nan, np.inf
FLT_MAX = float(np.finfo(np.float32).max)
def nan_mask(a):
    return np.isnan(np.asarray(a))


# ---------------------------------------------------------------------------
# ops
# ---------------------------------------------------------------------------

def test_relu_keeps_nan_and_infinities():
    x = np.array([NAN, -INF, INF, -1.0, -0.0, 0.0, 2.5], np.float32)
    y = dp.ops.relu(x)
    assert np.isnan(y[0])
    assert np.array_equal(y[1:], [0.0, INF, 0.0, 0.0, 0.0, 2.5])


def test_relu_backward_is_pytorch_threshold_backward():
    # dx = (y <= 0) ? 0 : dy: a NaN output passes dy, a NaN dy passes where y > 0
    y = np.array([NAN, 0.0, 1.0, 2.0, 0.0, 3.0], np.float32)
    dy = np.array([5.0, 5.0, NAN, INF, NAN, -INF], np.float32)
    dx = dp.ops.relu_backward(y, dy)
    assert np.array_equal(nan_mask(dx), [False, False, True, False, False, False])
    assert np.array_equal(dx[[0, 1, 3, 4, 5]], [5.0, 0.0, INF, 0.0, -INF])


def test_max_pool_nan_wins_and_takes_the_gradient():
    x = np.arange(32, dtype=np.float32).reshape(1, 2, 4, 4)
    x[0, 0, 0, 1] = NAN                      # window (0, 0): one NaN
    x[0, 0, 2, 2] = NAN                      # window (1, 1): two NaNs, the last one wins
    x[0, 0, 3, 3] = NAN
    x[0, 1, 0:2, 0:2] = -INF                 # a window of -inf only: -inf, its first position
    x[0, 1, 0, 2] = INF                      # +inf wins its window
    y = dp.ops.max_pool2d(x, 2)
    ref = x.astype(np.float64).reshape(1, 2, 2, 2, 2, 2).max(axis=(3, 5))  # NumPy's max propagates NaN too
    assert np.array_equal(nan_mask(y), nan_mask(ref))
    assert np.array_equal(y[~nan_mask(y)], ref[~nan_mask(ref)])
    assert y[0, 1, 0, 0] == -INF and y[0, 1, 0, 1] == INF

    dy = np.arange(1, 9, dtype=np.float32).reshape(1, 2, 2, 2)
    dx = dp.ops.max_pool2d_backward(x, dy, 2)
    expect = np.zeros_like(x)
    for c in range(2):
        for oh in range(2):
            for ow in range(2):
                win = x[0, c, 2 * oh:2 * oh + 2, 2 * ow:2 * ow + 2].ravel()
                nans = np.flatnonzero(np.isnan(win))
                # PyTorch: `val > maxval || isnan(val)` over the window in order, from -inf
                at = nans[-1] if len(nans) else (int(np.argmax(win)) if np.any(win > -INF) else 0)
                expect[0, c, 2 * oh + at // 2, 2 * ow + at % 2] += dy[0, c, oh, ow]
    assert np.array_equal(dx, expect)


def test_avg_pool_propagates_nan_and_inf():
    x = np.ones((1, 1, 4, 6), np.float32)
    x[0, 0, 0, 0] = NAN                      # window (0, 0): NaN
    x[0, 0, 0, 2] = INF                      # window (0, 1): +inf
    x[0, 0, 2, 4], x[0, 0, 3, 5] = INF, -INF  # window (1, 2): inf - inf = NaN
    y = dp.ops.avg_pool2d(x, 2)
    assert np.isnan(y[0, 0, 0, 0]) and y[0, 0, 0, 1] == INF and np.isnan(y[0, 0, 1, 2])
    assert np.array_equal(y[0, 0, [0, 1, 1], [2, 0, 1]], [1.0, 1.0, 1.0])
    # 3x3 windows at stride 1 with padding (the general loop, not the 2x2 one)
    y3 = dp.ops.avg_pool2d(x, 3, stride=1, padding=1)
    pad = np.pad(x[0, 0].astype(np.float64), 1)
    with np.errstate(invalid="ignore"):
        ref = np.array([[pad[i:i + 3, j:j + 3].sum() / 9 for j in range(6)] for i in range(4)])
        S = np.array([[np.abs(pad[i:i + 3, j:j + 3]).sum() / 9 for j in range(6)] for i in range(4)])
    assert np.array_equal(nan_mask(y3[0, 0]), nan_mask(ref))
    fin = np.isfinite(ref)
    assert np.array_equal(np.isinf(y3[0, 0]), np.isinf(ref))
    assert_within_bound(y3[0, 0][fin], ref[fin], S[fin], 9 + 1, "3x3 avg_pool, finite entries")
    # backward: a NaN gradient reaches exactly the inputs of its window
    dy = np.ones((1, 1, 2, 3), np.float32)
    dy[0, 0, 1, 1] = NAN
    dx = dp.ops.avg_pool2d_backward(x, dy, 2)
    expect = np.zeros((4, 6), bool)
    expect[2:4, 2:4] = True
    assert np.array_equal(nan_mask(dx[0, 0]), expect)
    assert np.all(dx[0, 0][~expect] == 0.25)


def test_softmax_cross_entropy_nan_and_inf_rows():
    logits = np.array([
        [1.0, 2.0, 0.5],      # finite
        [1.0, NAN, 3.0],      # NaN: the row is NaN; argmax is the NaN (1) = label: counted
        [INF, 0.0, 1.0],      # +inf: inf - inf, the row is NaN (log_softmax gives NaN)
        [1.0, -INF, 2.0],     # -inf on another class: finite, its probability 0
        [1.0, -INF, 2.0],     # -inf on the label: loss +inf, gradient finite
        [NAN, 5.0, 9.0],      # NaN first: argmax 0 != label 2
    ], np.float32)
    labels = np.array([1, 1, 0, 2, 1, 2])
    loss, correct, d = dp.ops.softmax_cross_entropy(logits, labels, reduction="sum")
    assert np.isnan(loss)
    # hits: rows 0 (argmax 1), 1 (the NaN at 1), 2 (the +inf at 0), 3 (argmax 2); not 4 (2 != 1) nor 5 (the NaN at 0)
    assert correct == 4
    L = logits.astype(np.float64)
    for r in (1, 2, 5):
        assert np.all(np.isnan(d[r]))
    for r in (0, 3, 4):
        with np.errstate(divide="ignore"):
            m = np.max(L[r])
            p = np.exp(L[r] - m) / np.exp(L[r] - m).sum()
        grad = p - np.eye(3)[labels[r]]
        assert np.all(np.isfinite(d[r]))
        assert_within(d[r], grad, xent_bounds(logits[r:r + 1], labels[r:r + 1], 1.0)[0][0], f"dlogits row {r}")
    assert d[3, 1] == 0.0
    # per row: the finite ones as float64, +inf where the label's probability is 0
    for r, want in ((0, None), (3, None), (4, INF)):
        lr, _, _ = dp.ops.softmax_cross_entropy(logits[r:r + 1], labels[r:r + 1], reduction="sum")
        if want is None:
            m = np.max(L[r])
            with np.errstate(divide="ignore"):
                ref = m + np.log(np.exp(L[r] - m).sum()) - L[r, labels[r]]
            assert abs(lr - ref) <= xent_bounds(logits[r:r + 1], labels[r:r + 1], 1.0)[1], (r, lr, ref)
        else:
            assert lr == want
    for r in (1, 2, 5):
        lr, _, _ = dp.ops.softmax_cross_entropy(logits[r:r + 1], labels[r:r + 1])
        assert np.isnan(lr)


def test_dense_propagates_nan_row_and_column():
    rng = np.random.default_rng(0)
    x, w, b = (rng.standard_normal(s).astype(np.float32) for s in ((4, 6), (5, 6), (5,)))
    x[1, 2] = NAN
    w[3, 0] = NAN
    y = dp.ops.dense(x, w, b)
    nan = np.zeros((4, 5), bool)
    nan[1, :] = True
    nan[:, 3] = True
    assert np.array_equal(nan_mask(y), nan)
    ref = x.astype(np.float64) @ w.astype(np.float64).T + b
    S = np.abs(np.nan_to_num(x).astype(np.float64)) @ np.abs(np.nan_to_num(w).astype(np.float64)).T + np.abs(b)
    assert_within_bound(y[~nan], ref[~nan], S[~nan], 6 + 1, "dense, finite entries")
    x, w = np.nan_to_num(x), np.nan_to_num(w)
    dy = rng.standard_normal((4, 5)).astype(np.float32)
    dy[0, 1] = NAN
    dx, dw, db = dp.ops.dense_backward(x, w, dy)
    assert np.array_equal(nan_mask(dx), np.arange(4)[:, None] == np.zeros((1, 6)))  # row 0 only
    assert np.array_equal(nan_mask(dw), np.arange(5)[:, None] == np.ones((1, 6)))   # row 1 only
    assert np.array_equal(nan_mask(db), np.arange(5) == 1)


@pytest.mark.parametrize("C", [1, 3])  # 1: the direct single-channel path; 3: im2col + GEMM
def test_conv2d_nan_reaches_exactly_its_receptive_field(C, monkeypatch):
    monkeypatch.setenv("DPCORE_WINOGRAD", "0")  # the bound below is the GEMM paths' (none would take it anyway)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, C, 7, 7)).astype(np.float32)
    w = rng.standard_normal((4, C, 3, 3)).astype(np.float32)
    x[1, C - 1, 2, 5] = NAN
    for pad in (0, 1):
        y = dp.ops.conv2d(x, w, stride=1, padding=pad)
        OH = 7 + 2 * pad - 2
        ih = np.arange(OH)[:, None] - pad
        iw = np.arange(OH)[None, :] - pad
        hit = (ih <= 2) & (2 <= ih + 2) & (iw <= 5) & (5 <= iw + 2)  # the window covers (2, 5)
        expect = np.zeros(y.shape, bool)
        expect[1, :] = hit
        assert np.array_equal(nan_mask(y), expect), pad
        # the others as float64 (the NaN pixel cannot reach them)
        xp = np.pad(np.nan_to_num(x).astype(np.float64), ((0, 0), (0, 0), (pad, pad), (pad, pad)))
        win = np.lib.stride_tricks.sliding_window_view(xp, (3, 3), axis=(2, 3))
        ref = np.einsum("ncijkl,ockl->noij", win, w.astype(np.float64))
        S = np.einsum("ncijkl,ockl->noij", np.abs(win), np.abs(w.astype(np.float64)))
        assert_within_bound(y[~expect], ref[~expect], S[~expect], 9 * C, f"conv2d pad {pad}, finite entries")
    # a NaN weight: with padding 1 every output uses every tap (padding as zeros: 0 * NaN = NaN, as in PyTorch)
    w2 = w.copy()
    w2[2, 0, 0, 0] = NAN
    y = dp.ops.conv2d(np.nan_to_num(x), w2, stride=1, padding=1)
    assert np.array_equal(nan_mask(y).any(axis=(0, 2, 3)), np.arange(4) == 2) and np.all(np.isnan(y[:, 2]))
    # backward: a NaN gradient at one output reaches its window's inputs, its filter's weights and bias
    dy = rng.standard_normal((2, 4, 5, 5)).astype(np.float32)
    dy[0, 1, 3, 0] = NAN
    dx, dw, db = dp.ops.conv2d_backward(np.nan_to_num(x), w, dy, stride=1, padding=0)
    expect = np.zeros(dx.shape, bool)
    expect[0, :, 3:6, 0:3] = True
    assert np.array_equal(nan_mask(dx), expect)
    assert np.array_equal(nan_mask(dw).all(axis=(1, 2, 3)), np.arange(4) == 1)
    assert not nan_mask(dw)[np.arange(4) != 1].any()
    assert np.array_equal(nan_mask(db), np.arange(4) == 1)


def test_sgd_update_propagates_nan():
    w = np.array([1.0, 2.0, 3.0], np.float32)
    v = np.zeros(3, np.float32)
    g = np.array([NAN, 1.0, INF], np.float32)
    w_bound = sgd_bounds(w[1:2], g[1:2], v[1:2], 0.1, 0.9, 0.0)[0]
    dp.ops.sgd_update(w, g, v, 0.1, momentum=0.9)
    assert np.isnan(w[0]) and np.isnan(v[0]) and w[2] == -INF and v[2] == INF
    assert_within(w[1:2], [2.0 - 0.1], w_bound, "sgd, the finite entry")
    assert v[1] == 1.0


# ---------------------------------------------------------------------------
# training: the step whose loss is not finite raises and applies nothing
# ---------------------------------------------------------------------------

def devices(k):
    return [f"cpu:{i}" for i in range(k)]


def weights_bits(net):
    return {n: a.view(np.uint32).copy() for n, a in net.get_weights().items()}


def same_bits(a, b):
    return a.keys() == b.keys() and all(np.array_equal(a[n], b[n]) for n in a)


def float_batches(n=96, seed=0):
    X, y = synthetic(n, seed)
    return (X / np.float32(255)).astype(np.float32), y


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("resident", [False, True])
def test_nan_pixel_raises_at_its_step_and_applies_nothing(k, resident, logical_cpus):
    """A NaN pixel in sample 50 (batch 2 of 32, position 18: replica 1's shard
    of 2): step 2 of epoch 1 raises, names replica and device; the weights are
    those after step 1, and momentum too: the next finite step gives the bits
    of a twin that never saw the bad batch."""
    logical_cpus(k)
    X, y = float_batches()
    X[50, 0, 10, 10] = NAN
    net, twin = (dp.models.LeNet(devices=devices(k)) for _ in range(2))
    twin.train_step(X[:32], y[:32], 0.1, momentum=0.9)
    after_first = weights_bits(twin)
    it = dp.data.from_arrays(X, y, batch_size=32, shuffle=False)
    replica = "replica 1 (cpu:1" if k == 2 else "replica 0 (cpu:0)"
    with pytest.raises(FloatingPointError, match=r"epoch 1, step 2: the loss is not finite \(nan\) on " +
                       re.escape(replica)) as e:
        dp.train(net, it, num_epochs=1, lr=0.1, momentum=0.9, verbose=False, resident=resident)
    assert "check_numerics=True" in str(e.value)
    assert same_bits(weights_bits(net), after_first) and net.replicas_identical()
    # momentum untouched: the same finite step on both gives the same bits
    for m in (net, twin):
        m.train_step(X[64:96], y[64:96], 0.1, momentum=0.9)
    assert same_bits(weights_bits(net), weights_bits(twin))

    with pytest.raises(FloatingPointError) as e:
        dp.train(net, it, num_epochs=1, lr=0.1, momentum=0.9, verbose=False, resident=resident,
                 check_numerics=True)
    msg = str(e.value)
    assert "epoch 1, step 2:" in msg
    assert "the input batch has 1 NaN value(s) at sample 18" in msg
    assert "layer 0 (conv2d)'s output" in msg


@pytest.mark.parametrize("k", [1, 2])
def test_nan_weight_raises_at_the_first_step(k, logical_cpus):
    logical_cpus(k)
    X, y = float_batches(64)
    net = dp.models.LeNet(devices=devices(k))
    w = net.get_weights()
    w["7.weight"][5, 17] = NAN
    net.set_weights(w, allow_nonfinite=True)
    before = weights_bits(net)
    it = dp.data.from_arrays(X, y, batch_size=32, shuffle=False)
    with pytest.raises(FloatingPointError, match=r"epoch 1, step 1: .*replicas? 0 \(cpu:0") as e:
        dp.train(net, it, num_epochs=2, lr=0.1, verbose=False, check_numerics=True)
    msg = str(e.value)
    assert "the input batch is finite" in msg and "layer 7 (dense)'s output" in msg
    if k == 2:
        assert "replicas 0 (cpu:0, loss nan), 1 (cpu:1, loss nan)" in msg
    assert same_bits(weights_bits(net), before) and net.replicas_identical()


def test_overflow_from_a_finite_input_names_the_layer():
    """A finite input of 3e38 overflows the first convolution (weights 1): check_numerics says the
    input batch is finite (no NaN or inf in it) and names layer 0."""
    X, y = float_batches(32)
    X[3] = 3e38
    net = dp.models.LeNet()
    w = net.get_weights()
    w["0.weight"][:] = 1.0  # nine taps of 3e38: beyond FLT_MAX
    net.set_weights(w)
    with pytest.raises(FloatingPointError, match="epoch 1, step 1") as e:
        dp.train(net, dp.data.from_arrays(X, y, batch_size=32), num_epochs=1, lr=0.1, verbose=False,
                 check_numerics=True)
    assert "the input batch is finite" in str(e.value) and "layer 0 (conv2d)'s output" in str(e.value)


def reference_peak(weights, X, y):
    """The largest magnitude of every intermediate value, the logits and the loss sum of LeNet's
    forward pass in float64 (test_lenet's reference): beyond FLT_MAX float32 cannot hold it."""
    logits, c = ref_forward(to64(weights), as_unit64(X))
    with np.errstate(all="ignore"):
        losses, _ = xent(logits, y)
    return max([float(np.abs(v).max()) for v in c.values()] + [float(np.abs(logits).max()), float(losses.sum())])


@pytest.mark.parametrize("k", [1, 2])
def test_lr_1e6_raises_at_the_step_where_float32_overflows(k, logical_cpus):
    """lr=1e6 with momentum: a first run of net.train_step (outside dp.train) finds the step
    that raises; the float64 reference confirms it independently from the weights before each
    step (every value far inside float32's range before it, far beyond it there); dp.train on a
    twin raises at exactly that step, epoch and step counted, with the weights before it."""
    logical_cpus(k)
    X, y = synthetic(64)
    init = random_weights(1)
    first = dp.models.LeNet(devices=devices(k))
    first.set_weights(init)
    before, failed = [], None
    for s in range(6):
        before.append(first.get_weights())
        xb, yb = X[32 * (s % 2):32 * (s % 2) + 32], y[32 * (s % 2):32 * (s % 2) + 32]  # dp.train's order below
        try:
            loss, _ = first.train_step(xb, yb, 1e6, momentum=0.9)
            assert np.isfinite(loss)
        except FloatingPointError as e:
            assert re.search(r"on replicas? \d", str(e)) and "cpu:" in str(e)
            failed = s
            break
    assert failed is not None and failed >= 1, "lr=1e6 no longer diverges here: choose another setting"
    for s in range(failed + 1):
        b = 32 * (s % 2)
        peak = reference_peak(before[s], X[b:b + 32], y[b:b + 32]) / FLT_MAX
        assert (peak > 1e3) if s == failed else (peak < 1e-3), (s, peak)

    net = dp.models.LeNet(devices=devices(k))
    net.set_weights(init)
    it = dp.data.from_arrays(X[:64], y[:64], batch_size=32, shuffle=False)  # 2 steps per epoch
    epoch, step = failed // 2 + 1, failed % 2 + 1
    with pytest.raises(FloatingPointError, match=f"epoch {epoch}, step {step}: the loss is not finite"):
        dp.train(net, it, num_epochs=3, lr=1e6, momentum=0.9, verbose=False)
    assert same_bits(weights_bits(net), {n: a.view(np.uint32) for n, a in before[failed].items()})


@pytest.mark.parametrize("k", [1, 2])
def test_batchnorm_nan_leaves_running_statistics_unchanged(k, logical_cpus):
    """BatchNorm propagates a NaN sample to the whole batch (its mean is NaN, as in PyTorch); the
    step raises and the running statistics, like the parameters, keep their bits (with 2
    replicas: each normalises its shard, the statistics are averaged, then put back)."""
    logical_cpus(k)
    layers = [("batchnorm",), ("flatten",), ("dense", 10)]
    net = dp.models.Sequential(layers, input_shape=(1, 4, 4), init_std=0.1, devices=devices(k))
    rng = np.random.default_rng(0)
    X = rng.random((16, 1, 4, 4)).astype(np.float32)
    y = rng.integers(0, 10, 16)
    net.train_step(X, y, 0.1, momentum=0.9)
    before = weights_bits(net)
    assert any("running" in n for n in before)
    X[5, 0, 1, 1] = NAN
    with pytest.raises(FloatingPointError, match=r"replica 0 \(cpu:0"):
        net.train_step(X, y, 0.1, momentum=0.9)
    assert same_bits(weights_bits(net), before) and net.replicas_identical()
    with pytest.raises(FloatingPointError) as e:
        dp.train(net, dp.data.from_arrays(X, y, batch_size=16), num_epochs=1, lr=0.1, verbose=False,
                 check_numerics=True)
    assert "at sample 5" in str(e.value) and "layer 0 (batchnorm)'s output" in str(e.value)
    assert same_bits(weights_bits(net), before)  # the diagnosis changed nothing either


def test_check_numerics_must_be_a_bool():
    X, y = float_batches(32)
    with pytest.raises(TypeError, match="check_numerics"):
        dp.train(dp.models.LeNet(), dp.data.from_arrays(X, y, batch_size=32), num_epochs=1, check_numerics=1)
