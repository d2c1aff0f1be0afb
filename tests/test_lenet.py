"""Tests of the whole LeNet: training steps, gradients, predict, evaluate, errors, learning.

The reference is a float64 NumPy LeNet written here (conv 3x3 1->20, ReLU,
avg-pool 2; conv 5x5 20->50, ReLU, avg-pool 2; flatten; dense 800->128, ReLU;
dense 128->10; mean softmax cross-entropy), vectorised with
sliding_window_view + tensordot, in PyTorch's parameter layouts.  Its
backward pass is itself checked against float64 finite differences
(test_reference_backward_matches_finite_differences).

Error metrics and tolerances (dpcore computes in float32, the reference in float64):
  * gradients: rel(a, ref) = max|a - ref| / max|ref| per tensor  <= GRAD_TOL = 5e-5
    (float32 through four layers with sums of up to ~20k terms; a ReLU unit whose
    pre-activation lies within float32 rounding of 0 may legitimately flip);
  * weight updates: rel(w1 - w0, w1_ref - w0) <= STEP_TOL = 1e-4 (the gradient error
    plus the float32 rounding of w1 itself, ulp(w) / |lr v| ~ 1e-6 here);
    updated weights themselves: max|w1 - w1_ref| / max(1, max|w1_ref|) <= W_TOL = 1e-6;
  * losses: relative LOSS_TOL = 1e-5; logits: max|a - ref| / max(1, max|ref|) <= LOGIT_TOL = 1e-5.
These are bounds on ONE step from a state both sides share.  The two-step test
therefore computes step 2's reference from dpcore's own float32 state after step 1
(its weights and momentum, as float64), not from the float64 trajectory: after
step 2 the float64 trajectory differs from dpcore's by step 1's error carried
through step 2's gradient (the loss's curvature, a ReLU unit that flips), which
no float32 error model bounds (issue 29).
Observed on the CPU backend (2 threads): gradients <= 4e-6, updates <= 6e-6,
weights <= 1.5e-7, logits <= 5e-7 -- the tolerances leave a margin of >= 7x.
What the one-step tolerances rest on (issue 29): not a derived bound. Carried
through the four layers, the worst-case error bound (tests/error_bounds.py; every
value of one step is held to it in tests/test_error_bounds.py) is informative
for the last two layers only (0.3-0.9 of the largest gradient) and ~100-500x the
first layer's largest gradient; Higham and Mary's probabilistic bound with errors
carried as root-sum-squares still gives ~1e-3. The measured errors are ~3e-7:
float32 sums grow their error like ~sqrt(n) u of partial sums far smaller than
the sum of magnitudes, which no per-operation model with S bounds. GRAD_TOL and
kin are therefore statistical: 15x the spread float32 PyTorch shows over 8
summation orders (gradients within 3.4e-6, tests/test_fixtures.py); a kernel set
(OpenBLAS's SkylakeX or Haswell kernels, dpcore's GEMM, Winograd or not) is
another summation order of the same sums.
"""
from collections import OrderedDict

import numpy as np
import pytest
from numpy.lib.stride_tricks import sliding_window_view

import dpcore as dp

NAMES = ["0.weight", "0.bias", "3.weight", "3.bias", "7.weight", "7.bias", "9.weight", "9.bias"]
SHAPES = {"0.weight": (20, 1, 3, 3), "0.bias": (20,), "3.weight": (50, 20, 5, 5), "3.bias": (50,),
          "7.weight": (128, 800), "7.bias": (128,), "9.weight": (10, 128), "9.bias": (10,)}

GRAD_TOL = 5e-5
STEP_TOL = 1e-4
W_TOL = 1e-6
LOSS_TOL = 1e-5
LOGIT_TOL = 1e-5


# ---------------------------------------------------------------------------
# helpers and the float64 reference
# ---------------------------------------------------------------------------

def rel(a, ref):
    """max|a - ref| / max|ref|."""
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    assert a.shape == ref.shape, (a.shape, ref.shape)
    return float(np.abs(a - ref).max() / np.abs(ref).max())


def err(a, ref):
    """max|a - ref| / max(1, max|ref|)."""
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    assert a.shape == ref.shape, (a.shape, ref.shape)
    return float(np.abs(a - ref).max() / max(1.0, float(np.abs(ref).max())))


def random_weights(seed, std=0.1):
    """float32 N(0, std^2) for every tensor (biases too): larger than the 0.01 init so gradients are not tiny."""
    rng = np.random.default_rng(seed)
    return OrderedDict((n, (rng.standard_normal(SHAPES[n]) * std).astype(np.float32)) for n in NAMES)


def random_batch(seed, n=16, dtype=np.float32):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 10, size=n)
    if dtype == np.uint8:
        return rng.integers(0, 256, size=(n, 1, 28, 28)).astype(np.uint8), y
    return rng.random((n, 1, 28, 28)).astype(dtype), y


def as_unit64(X):
    """What the network sees, in float64: uint8 / 255, floats as they are."""
    return X.astype(np.float64) / 255.0 if X.dtype == np.uint8 else X.astype(np.float64)


def conv_fwd(x, w, b):
    """Valid, stride 1: y[n,o,i,j] = b[o] + sum_{c,ki,kj} x[n,c,i+ki,j+kj] w[o,c,ki,kj]."""
    k = w.shape[2]
    win = sliding_window_view(x, (k, k), axis=(2, 3))  # (N, C, OH, OW, k, k)
    y = np.tensordot(win, w, axes=([1, 4, 5], [1, 2, 3]))  # (N, OH, OW, O)
    return y.transpose(0, 3, 1, 2) + b[None, :, None, None]


def conv_bwd(x, w, dy, need_dx=True):
    k = w.shape[2]
    win = sliding_window_view(x, (k, k), axis=(2, 3))
    dw = np.tensordot(dy, win, axes=([0, 2, 3], [0, 2, 3]))  # (O, C, k, k)
    db = dy.sum(axis=(0, 2, 3))
    if not need_dx:
        return None, dw, db
    OH, OW = dy.shape[2:]
    dx = np.zeros_like(x)
    for i in range(k):
        for j in range(k):
            dx[:, :, i:i + OH, j:j + OW] += np.tensordot(dy, w[:, :, i, j], axes=([1], [0])).transpose(0, 3, 1, 2)
    return dx, dw, db


def pool_fwd(x):
    """2x2 average pooling, stride 2; an odd last row/column is dropped."""
    N, C, H, W = x.shape
    OH, OW = H // 2, W // 2
    return x[:, :, :2 * OH, :2 * OW].reshape(N, C, OH, 2, OW, 2).mean(axis=(3, 5))


def pool_bwd(x_shape, dy):
    dx = np.zeros(x_shape)
    OH, OW = dy.shape[2:]
    dx[:, :, :2 * OH, :2 * OW] = np.repeat(np.repeat(dy, 2, axis=2), 2, axis=3) / 4.0
    return dx


def ref_forward(P, x):
    """Logits and the intermediate values; P maps names to float64 arrays."""
    c = {"x": x}
    c["z0"] = conv_fwd(x, P["0.weight"], P["0.bias"])          # (N, 20, 26, 26)
    c["a1"] = np.maximum(c["z0"], 0)
    c["p2"] = pool_fwd(c["a1"])                                 # (N, 20, 13, 13)
    c["z3"] = conv_fwd(c["p2"], P["3.weight"], P["3.bias"])     # (N, 50, 9, 9)
    c["a4"] = np.maximum(c["z3"], 0)
    c["p5"] = pool_fwd(c["a4"])                                 # (N, 50, 4, 4)
    c["f6"] = c["p5"].reshape(len(x), -1)                       # (N, 800), PyTorch's flatten order
    c["z7"] = c["f6"] @ P["7.weight"].T + P["7.bias"]           # (N, 128)
    c["a8"] = np.maximum(c["z7"], 0)
    logits = c["a8"] @ P["9.weight"].T + P["9.bias"]            # (N, 10)
    return logits, c


def xent(logits, y):
    """Per-sample losses and softmax probabilities, stable."""
    m = logits.max(axis=1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(logits - m).sum(axis=1))
    return lse - logits[np.arange(len(y)), y], np.exp(logits - lse[:, None])


def ref_loss_grads(P, x, y):
    """(mean loss, grads of the mean loss as an OrderedDict, logits)."""
    N = len(y)
    logits, c = ref_forward(P, x)
    losses, prob = xent(logits, y)
    d = prob.copy()
    d[np.arange(N), y] -= 1.0
    d /= N
    g = OrderedDict()
    g["9.weight"], g["9.bias"] = d.T @ c["a8"], d.sum(axis=0)
    da8 = d @ P["9.weight"]
    dz7 = da8 * (c["z7"] > 0)
    g["7.weight"], g["7.bias"] = dz7.T @ c["f6"], dz7.sum(axis=0)
    dp5 = (dz7 @ P["7.weight"]).reshape(c["p5"].shape)
    dz3 = pool_bwd(c["a4"].shape, dp5) * (c["z3"] > 0)
    dp2, g["3.weight"], g["3.bias"] = conv_bwd(c["p2"], P["3.weight"], dz3)
    dz0 = pool_bwd(c["a1"].shape, dp2) * (c["z0"] > 0)
    _, g["0.weight"], g["0.bias"] = conv_bwd(x, P["0.weight"], dz0, need_dx=False)
    return losses.mean(), OrderedDict((n, g[n]) for n in NAMES), logits


def ref_sgd(P, G, V, lr, mu, wd):
    """torch.optim.SGD: g' = g + wd w; v = mu v + g' (v = g' on the first step: V is None); w -= lr v."""
    newP, newV = OrderedDict(), OrderedDict()
    for n in NAMES:
        gp = G[n] + wd * P[n]
        newV[n] = gp if V is None else mu * V[n] + gp
        newP[n] = P[n] - lr * newV[n]
    return newP, newV


def to64(weights):
    return OrderedDict((n, np.asarray(weights[n], np.float64)) for n in NAMES)


def grads_by_name(net):
    """net._model.get_grads() sliced by param_layout() into name -> array."""
    flat = net._model.get_grads()
    out = OrderedDict()
    for layer, kind, offset, shape in net._model.param_layout():
        size = int(np.prod(shape))
        out[f"{layer}.{kind}"] = flat[offset:offset + size].reshape(shape)
    return out


def velocity_by_name(net):
    """net._model.get_velocity() sliced like grads_by_name, as float64."""
    flat = net._model.get_velocity()
    out = OrderedDict()
    for layer, kind, offset, shape in net._model.param_layout():
        out[f"{layer}.{kind}"] = np.asarray(flat[offset:offset + int(np.prod(shape))].reshape(shape), np.float64)
    return out


def make_net(wseed=1):
    net = dp.models.LeNet(seed=0)
    net.set_weights(random_weights(wseed))
    return net


# ---------------------------------------------------------------------------
# the reference itself
# ---------------------------------------------------------------------------

def test_reference_backward_matches_finite_differences():
    # float64 central differences (h = 1e-6) of the float64 mean loss; the analytic float64
    # gradient must agree to 1e-6 relative to the tensor's max |gradient|.
    P = to64(random_weights(3))
    X, y = random_batch(4, n=3)
    x = as_unit64(X)
    _, G, _ = ref_loss_grads(P, x, y)
    rng = np.random.default_rng(0)
    h = 1e-6
    for n in NAMES:
        idx = [np.unravel_index(int(i), P[n].shape) for i in rng.choice(P[n].size, size=4, replace=False)]
        for i in idx:
            old = P[n][i]
            P[n][i] = old + h
            fp = xent(ref_forward(P, x)[0], y)[0].mean()
            P[n][i] = old - h
            fm = xent(ref_forward(P, x)[0], y)[0].mean()
            P[n][i] = old
            fd = (fp - fm) / (2 * h)
            assert abs(fd - G[n][i]) <= 1e-6 * np.abs(G[n]).max(), (n, i, fd, G[n][i])


# ---------------------------------------------------------------------------
# train_step / get_grads / forward_backward against the reference
# ---------------------------------------------------------------------------

def test_param_layout_and_names():
    net = dp.models.LeNet(seed=0)
    layout = net._model.param_layout()
    assert [f"{l}.{k}" for l, k, _, _ in layout] == NAMES
    assert [tuple(s) for _, _, _, s in layout] == [SHAPES[n] for n in NAMES]
    assert net.parameter_names() == NAMES
    assert net.num_params == sum(int(np.prod(s)) for s in SHAPES.values())
    w = net.get_weights()
    assert list(w) == NAMES and all(w[n].shape == SHAPES[n] and w[n].dtype == np.float32 for n in NAMES)
    # the book's init: weights N(0, 0.01), biases 0
    assert all(not w[n].any() for n in NAMES if n.endswith("bias"))
    assert 0.005 < np.std(w["3.weight"]) < 0.02


@pytest.mark.parametrize("dtype", [np.float32, np.uint8], ids=["float32", "uint8"])
def test_two_sgd_steps_match_float64_reference(dtype):
    lr, mu, wd = 0.1, 0.9, 1e-3
    W0 = random_weights(1)
    net = dp.models.LeNet(seed=0)
    net.set_weights(W0)
    X1, y1 = random_batch(10, n=16, dtype=dtype)
    X2, y2 = random_batch(11, n=16, dtype=dtype)

    # step 1
    P0 = to64(W0)
    loss1, G1, logits1 = ref_loss_grads(P0, as_unit64(X1), y1)
    P1, V1 = ref_sgd(P0, G1, None, lr, mu, wd)
    loss_sum, correct = net.train_step(X1, y1, lr=lr, momentum=mu, weight_decay=wd)
    assert abs(loss_sum / 16 - loss1) <= LOSS_TOL * abs(loss1), (loss_sum / 16, loss1)
    assert correct == int((logits1.argmax(axis=1) == y1).sum())
    g = grads_by_name(net)
    for n in NAMES:
        assert rel(g[n], G1[n]) <= GRAD_TOL, f"step 1 gradient {n}: rel error {rel(g[n], G1[n]):.3g}"
    W1 = net.get_weights()
    for n in NAMES:
        assert err(W1[n], P1[n]) <= W_TOL, f"step 1 weights {n}: error {err(W1[n], P1[n]):.3g}"
        e = rel(W1[n].astype(np.float64) - P0[n], P1[n] - P0[n])
        assert e <= STEP_TOL, f"step 1 update of {n}: rel error {e:.3g}"

    # step 2: momentum (v = mu v + g'), its reference from dpcore's own state after step 1 (weights
    # and momentum), so that the comparison is one step's: the bounds above are derived for one step
    P1 = to64(W1)
    V1dp = velocity_by_name(net)
    for n in NAMES:
        # v1 = fl(g1 + wd w0): the gradient's error (GRAD_TOL) and two roundings (2 x 2^-24 relative)
        bound = GRAD_TOL * np.abs(G1[n]).max() + 2 ** -23 * (np.abs(G1[n]).max() + wd * np.abs(P0[n]).max())
        assert np.abs(V1dp[n] - V1[n]).max() <= bound, f"step 1 momentum of {n}"
    V1 = V1dp
    loss2, G2, logits2 = ref_loss_grads(P1, as_unit64(X2), y2)
    P2, _ = ref_sgd(P1, G2, V1, lr, mu, wd)
    loss_sum, correct = net.train_step(X2, y2, lr=lr, momentum=mu, weight_decay=wd)
    assert abs(loss_sum / 16 - loss2) <= LOSS_TOL * abs(loss2), (loss_sum / 16, loss2)
    assert correct == int((logits2.argmax(axis=1) == y2).sum())
    g = grads_by_name(net)
    for n in NAMES:
        assert rel(g[n], G2[n]) <= GRAD_TOL, f"step 2 gradient {n}: rel error {rel(g[n], G2[n]):.3g}"
    W2 = net.get_weights()
    for n in NAMES:
        assert err(W2[n], P2[n]) <= W_TOL, f"step 2 weights {n}: error {err(W2[n], P2[n]):.3g}"
        e = rel(W2[n].astype(np.float64) - P1[n], P2[n] - P1[n])
        assert e <= STEP_TOL, f"step 2 update of {n}: rel error {e:.3g}"


def test_forward_backward_writes_scaled_sum_of_gradients():
    W0 = random_weights(2)
    net = dp.models.LeNet(seed=0)
    net.set_weights(W0)
    X, y = random_batch(20, n=12)
    loss, G, logits = ref_loss_grads(to64(W0), as_unit64(X), y)
    for scale in (0.5, 1.0):
        loss_sum, correct = net._model.forward_backward(X, y.astype(np.int64), scale)
        assert abs(loss_sum - 12 * loss) <= LOSS_TOL * 12 * loss
        assert correct == int((logits.argmax(axis=1) == y).sum())
        g = grads_by_name(net)
        for n in NAMES:
            # G is the gradient of the mean: the sum of per-sample gradients is 12 G
            assert rel(g[n], scale * 12 * G[n]) <= GRAD_TOL, f"{n} with grad_scale {scale}"
    # forward_backward does not touch the weights
    for n, w in net.get_weights().items():
        np.testing.assert_array_equal(w, W0[n])


def test_train_step_momentum_zero_and_no_decay():
    W0 = random_weights(5)
    net = dp.models.LeNet(seed=0)
    net.set_weights(W0)
    X, y = random_batch(30, n=8)
    P0 = to64(W0)
    _, G, _ = ref_loss_grads(P0, as_unit64(X), y)
    net.train_step(X, y, lr=0.5)
    W1 = net.get_weights()
    for n in NAMES:
        assert rel(W1[n].astype(np.float64) - P0[n], -0.5 * G[n]) <= STEP_TOL, n


# ---------------------------------------------------------------------------
# predict
# ---------------------------------------------------------------------------

def test_predict_matches_reference():
    W = random_weights(6)
    net = dp.models.LeNet(seed=0)
    net.set_weights(W)
    X, _ = random_batch(40, n=33)
    out = net.predict(X)
    ref, _ = ref_forward(to64(W), as_unit64(X))
    assert out.shape == (33, 10) and out.dtype == np.float32
    assert err(out, ref) <= LOGIT_TOL, err(out, ref)
    # batch of one, and (N, 28, 28) without the channel axis
    one = net.predict(X[:1])
    assert one.shape == (1, 10) and one.dtype == np.float32
    assert err(one, ref[:1]) <= LOGIT_TOL
    r3 = net.predict(X[:, 0])
    assert r3.shape == (33, 10)
    assert err(r3, ref) <= LOGIT_TOL
    # predict's batching (batch_size smaller than N) gives the same numbers
    assert err(net.predict(X, batch_size=5), ref) <= LOGIT_TOL
    # uint8 images are scaled by 1/255
    Xu, _ = random_batch(41, n=4, dtype=np.uint8)
    assert err(net.predict(Xu), ref_forward(to64(W), as_unit64(Xu))[0]) <= LOGIT_TOL
    # empty
    assert net.predict(np.zeros((0, 1, 28, 28), np.float32)).shape == (0, 10)


BAD_IMAGES = [
    ("wrong width", np.zeros((2, 1, 28, 27), np.float32), ValueError, r"images must have shape \(N, 1, 28, 28\)"),
    ("wrong channels", np.zeros((2, 3, 28, 28), np.float32), ValueError, r"images must have shape \(N, 1, 28, 28\)"),
    ("rank 2", np.zeros((28, 28), np.float32), ValueError, r"images must have shape \(N, 1, 28, 28\)"),
    ("rank 5", np.zeros((1, 1, 1, 28, 28), np.float32), ValueError, r"images must have shape \(N, 1, 28, 28\)"),
    ("bool", np.zeros((2, 1, 28, 28), bool), TypeError, r"uint8 or floating point.*bool"),
    ("complex", np.zeros((2, 1, 28, 28), np.complex64), TypeError, r"uint8 or floating point.*complex"),
    ("object", np.zeros((2, 1, 28, 28), object), TypeError, r"uint8 or floating point.*object"),
    ("int32", np.zeros((2, 1, 28, 28), np.int32), TypeError, r"integer images must be uint8"),
    ("uint16", np.zeros((2, 1, 28, 28), np.uint16), TypeError, r"integer images must be uint8"),
]


@pytest.mark.parametrize("name,X,exc,msg", BAD_IMAGES, ids=[b[0] for b in BAD_IMAGES])
def test_predict_bad_images(name, X, exc, msg):
    net = dp.models.LeNet(seed=0)
    with pytest.raises(exc, match=msg):
        net.predict(X)
    with pytest.raises(exc, match=msg):
        net.train_step(X, np.zeros(len(X), np.int64), lr=0.1)


# ---------------------------------------------------------------------------
# weights, labels, conversions
# ---------------------------------------------------------------------------

def test_get_set_weights_round_trip():
    net = dp.models.LeNet(seed=0)
    W = random_weights(7)
    net.set_weights(W)
    got = net.get_weights()
    assert list(got) == NAMES
    for n in NAMES:
        np.testing.assert_array_equal(got[n], W[n])
    # copies, not views
    got["0.weight"][...] = 123.0
    np.testing.assert_array_equal(net.get_weights()["0.weight"], W["0.weight"])
    # a list in order, and float64 values (converted)
    W2 = random_weights(8)
    net.set_weights([W2[n].astype(np.float64) for n in NAMES])
    for n, w in net.get_weights().items():
        np.testing.assert_array_equal(w, W2[n])
    # a second model loads the first one's weights and predicts the same
    other = dp.models.LeNet(seed=5)
    other.set_weights(net.get_weights())
    X, _ = random_batch(9, n=3)
    np.testing.assert_array_equal(other.predict(X), net.predict(X))


def test_set_weights_errors_leave_weights_unchanged():
    net = dp.models.LeNet(seed=0)
    before = net.get_weights()
    W = random_weights(7)
    missing = OrderedDict((n, W[n]) for n in NAMES if n != "9.bias")
    with pytest.raises(KeyError, match=r"missing.*9\.bias"):
        net.set_weights(missing)
    extra = OrderedDict(W)
    extra["10.weight"] = np.zeros(3, np.float32)
    with pytest.raises(KeyError, match=r"10\.weight"):
        net.set_weights(extra)
    bad = OrderedDict(W)
    bad["3.weight"] = np.zeros((50, 20, 3, 3), np.float32)
    with pytest.raises(ValueError, match=r"3\.weight.*\(50, 20, 5, 5\)"):
        net.set_weights(bad)
    bad = OrderedDict(W)
    bad["7.weight"] = bad["7.weight"].T
    with pytest.raises(ValueError, match=r"7\.weight.*\(128, 800\)"):
        net.set_weights(bad)
    with pytest.raises(ValueError, match="must hold 8 arrays"):
        net.set_weights([W[n] for n in NAMES[:-1]])
    bad = OrderedDict(W)
    bad["0.bias"] = np.zeros(20, complex)
    with pytest.raises(TypeError, match=r"0\.bias"):
        net.set_weights(bad)
    for n, w in net.get_weights().items():
        np.testing.assert_array_equal(w, before[n], err_msg=f"{n} changed by a failed set_weights")


@pytest.mark.parametrize("label", [10, -1, 11, 1000])
def test_train_step_label_out_of_range(label):
    net = make_net()
    before = net.get_weights()
    X, y = random_batch(12, n=4)
    y[2] = label
    with pytest.raises(ValueError, match=rf"label {label}\b"):
        net.train_step(X, y, lr=0.1)
    for n, w in net.get_weights().items():
        np.testing.assert_array_equal(w, before[n], err_msg=f"{n} changed by a failed train_step")


def test_train_step_bad_labels():
    net = make_net()
    X, y = random_batch(12, n=4)
    with pytest.raises(TypeError, match="labels must be integers"):
        net.train_step(X, y.astype(np.float32), lr=0.1)
    with pytest.raises(ValueError, match=r"labels must have shape \(4,\)"):
        net.train_step(X, y[:3], lr=0.1)
    with pytest.raises(ValueError, match=r"labels must have shape \(4,\)"):
        net.train_step(X, y.reshape(2, 2), lr=0.1)


def test_train_step_converts_float64_images_and_int32_labels():
    X, y = random_batch(13, n=8)
    a, b, c = make_net(), make_net(), make_net()
    ra = a.train_step(X, y.astype(np.int64), lr=0.1, momentum=0.9)
    rb = b.train_step(X.astype(np.float64), y.astype(np.int64), lr=0.1, momentum=0.9)  # exact in float32
    rc = c.train_step(X, y.astype(np.int32), lr=0.1, momentum=0.9)
    assert ra == rb == rc
    wa, wb, wc = a.get_weights(), b.get_weights(), c.get_weights()
    for n in NAMES:
        np.testing.assert_array_equal(wb[n], wa[n])
        np.testing.assert_array_equal(wc[n], wa[n])


def test_determinism_same_seed_same_weights():
    batches = [random_batch(50 + i, n=16) for i in range(3)]
    nets = [dp.models.LeNet(seed=42), dp.models.LeNet(seed=42)]
    results = [[net.train_step(X, y, lr=0.2, momentum=0.9, weight_decay=1e-4) for X, y in batches] for net in nets]
    assert results[0] == results[1]
    w0, w1 = nets[0].get_weights(), nets[1].get_weights()
    for n in NAMES:
        assert np.array_equal(w0[n], w1[n]), f"{n} differs between two runs with the same seed"
    # and the seed matters
    other = dp.models.LeNet(seed=43).get_weights()
    assert not np.array_equal(other["0.weight"], dp.models.LeNet(seed=42).get_weights()["0.weight"])


# ---------------------------------------------------------------------------
# evaluate
# ---------------------------------------------------------------------------

def test_evaluate_matches_predict():
    net = make_net(wseed=14)
    X, y = random_batch(15, n=50)
    # the batches evaluate runs (7 samples each, in order): the same forward on the same inputs, hence
    # the same logits; predict's default batch (all 50) runs other GEMM shapes, whose rounding could
    # move an argmax that is nearly tied (nothing makes per-sample logits independent of the batch)
    logits = net.predict(X, batch_size=7)
    y[::2] = logits[::2].argmax(axis=1)  # about half right
    m = net.evaluate(dp.data.from_arrays(X, y, batch_size=7))
    assert m.num_examples == 50
    assert m.accuracy == float((logits.argmax(axis=1) == y).sum()) / 50
    losses, _ = xent(logits.astype(np.float64), y)
    assert abs(m.loss - losses.mean()) <= LOSS_TOL * losses.mean(), (m.loss, losses.mean())


# ---------------------------------------------------------------------------
# learning
# ---------------------------------------------------------------------------

def block_dataset(n, seed):
    """The class decides which 7x7 block (of the 4x4 grid of blocks) is bright; dim noise elsewhere."""
    rng = np.random.default_rng(seed)
    y = rng.permutation(np.arange(n) % 10)
    X = (rng.random((n, 1, 28, 28)) * 0.3).astype(np.float32)
    for i, c in enumerate(y):
        r, q = divmod(int(c), 4)
        X[i, 0, 7 * r:7 * r + 7, 7 * q:7 * q + 7] = 1.0
    return X, y


def he_weights(seed):
    """He-normal weights (std sqrt(2 / fan_in)), zero biases."""
    rng = np.random.default_rng(seed)
    return OrderedDict((n, np.zeros(SHAPES[n], np.float32) if n.endswith("bias") else
                        (rng.standard_normal(SHAPES[n]) * np.sqrt(2.0 / np.prod(SHAPES[n][1:]))).astype(np.float32))
                       for n in NAMES)


def test_lenet_learns_block_dataset():
    # He init: with the book's N(0, 0.01) init the signal through four layers is so small that 24 steps
    # do not move the loss off log(10) = 2.303 -- the float64 reference does exactly the same -- so the
    # learning test starts from a scale-preserving init.  8 steps of 64 per epoch, 3 epochs (~3 s).
    X, y = block_dataset(512, seed=0)
    it = dp.data.from_arrays(X, y, batch_size=64, shuffle=True, seed=0)
    net = dp.models.LeNet(seed=0)
    net.set_weights(he_weights(0))
    hist = dp.train(net, it, None, num_epochs=3, lr=0.3, verbose=False)
    assert hist.num_epochs == 3 and all(np.isfinite(hist.train_loss))
    assert hist.train_acc[-1] > 0.9, f"train accuracy per epoch {hist.train_acc}, loss {hist.train_loss}"
    Xt, yt = block_dataset(200, seed=1)
    assert net.evaluate(dp.data.from_arrays(Xt, yt, batch_size=100)).accuracy > 0.9


def test_predict_needs_the_activations_of_64_samples_at_most():
    """predict runs a batch in pieces of 64 samples (csrc/model.c, DP_PREDICT_PIECE): a 300-image
    predict of a fresh model allocates no more activation memory than a 64-image one, and its
    logits are the 64-image calls' bit for bit (the piece is a constant, not the model's history)."""
    X, _ = random_batch(42, n=300)
    big, small = make_net(), make_net()
    out = big.predict(X)
    small.predict(X[:64])
    assert big._model.activation_bytes == small._model.activation_bytes > 0
    np.testing.assert_array_equal(out, np.concatenate([small.predict(X[i:i + 64]) for i in range(0, 300, 64)]))
    # after training at a larger batch, predict still cuts at 64: the same bits
    big.train_step(*random_batch(43, n=128), lr=0.0)
    np.testing.assert_array_equal(big.predict(X), out)
