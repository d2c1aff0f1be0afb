"""Tests of dpcore.ops: every layer op, forward and backward, against float64 NumPy.

Each op is checked three ways:

1. dpcore's float32 forward against an independent float64 NumPy reference
   written here (sliding windows + einsum / strided slices / direct loops;
   nothing is copied from the C code's im2col);
2. dpcore's float32 backward against the float64 reference backward, on whole
   tensors;
3. dpcore's float32 backward against central finite differences in float64 of
   the float64 reference *forward* (loss = sum(y * r) for a fixed random r), at
   sampled coordinates.  This also validates the reference backward that the
   LeNet tests rely on.

Inputs are drawn as float32 and widened to float64 for the references, so the
reference sees exactly the numbers dpcore sees.

The bounds (issue 29: derived, not read off one machine; u = 2^-24, gamma_n =
n u / (1 - n u)). Each result is a sum of products of float32 inputs; in any
order and grouping of the sum each term meets at most n rounding factors
(1 + d), |d| <= u, so |computed - exact| <= gamma_n S elementwise, S the same
computation on the inputs' (and coefficients') absolute values in float64
(tests/test_conv_cpu.py's docstring; its gamma and assert_within_bound are
used here). This holds on OpenBLAS (any core type), dpcore's GEMM kernel, the
implicit GEMM and the direct loops, whatever the summation order:
  conv2d   y: n = C*KH*KW + 1 (C*KH*KW without bias); dx: O*KH*KW; dw, db:
           N*OH*OW (as tests/test_conv_cpu.py). The Winograd forms are not
           covered by this S: the conv tests run with DPCORE_WINOGRAD=0 (only
           LeNet's 5x5 layer, C = 20, could take one here: F(3x3, 5x5) under
           DPCORE_WINOGRAD_F35=1 or set_precision('fast')).
  dense    y = x w^T + b (the BLAS, b in C with beta = 1): n = I + 1 (I without
           bias); dx: O; dw, db: N.
  avg pool a window's sum (k*k - 1 additions) times the float32 constant
           1/(k*k) (rounded itself for k = 3, 5: one factor) and its product
           (one): y: n = k*k + 1; dx sums the dy of at most ceil(k/s)^2
           windows and scales them likewise: n = ceil(k/s)^2 + 1.
  max pool y exact (a max); dx sums the dy of at most ceil(k/s)^2 windows:
           n = ceil(k/s)^2 - 1 (0: exact). relu: exact.
  softmax cross-entropy (one row, p_j = e_j / s, e_j = exp(t_j), t_j = l_j - m
           <= 0, s = sum e_j >= 1): fl(t_j) = t_j (1 + d) moves e_j by a factor
           exp(u |t_j|), which is at most u |t_j| e_j <= u / e in absolute terms;
           expf and logf err by at most 1 ulp (2u relative; glibc's table of
           known maximum errors); s's K - 1 additions: gamma_{K-1}. So
           |s^ / s - 1| <= gamma_{K+1} + K u / e, and p_j^ = e_j^ * fl(1 / s^)
           (two roundings) errs by p_j (gamma_{K+5} + K u / e + u |t_j|); then
           p - onehot, the float32 scale (1/N rounded) and its product: gamma_3
           |d_j|. Subnormal e_j: 2^-148 more (xent_bounds).
           The row loss log(s) - t_label: |log s^ - log s| <= gamma_{K+1} + K u / e,
           logf's ulp, the rounding of t_label and of the difference:
           gamma_2 (log s + |t_label| + loss) more; the rows are added in double.
  SGD      w' = w - lr (mu v + g + wd w), lr, mu, wd rounded to float32 (one
           factor each where used): the wd w path meets 7 factors, so
           |w'^ - w'| <= gamma_7 (|w| + lr (mu |v| + |g| + wd |w|)); v' = mu v +
           g + wd w: gamma_4 (mu |v| + |g| + wd |w|). Each step is checked
           against the float64 step from the float32 state before it.
Finite differences (fd_check), in float64 on the float64 reference forward f:
  every f here is linear along one coordinate over [x - h, x + h] (conv, dense
  and avg pool are multilinear; relu with h < min |x|; max pool with h below
  half the gap between values: no window changes its winner), so the
  truncation error (h^2 / 6) f''' is 0 and h may be large: h = 1 for the
  multilinear ops, a power of two below the kink distance otherwise. What
  remains is float64 rounding: f(x +- h) computed as a tree of its T leaf
  products (each at most 2 multiplications and T - 1 additions) errs by at
  most gamma64_{T+1} S_f (S_f: f on absolute values, at each point); x +- h is
  rounded (u64 (|x| + h)) and f(x+h) - f(x-h) rounds once (the division by the
  power of two 2h is exact), which moves the quotient by at most
  4 u64 S_g (|x| + h) / h (S_g >= |gradient|). The float32 gradient may differ
  from the quotient by its own bound (above) plus that. For softmax cross-
  entropy (smooth: h = 2^-13) the truncation is at most scale h^2 / 6 *
  max |p (1 - p)(1 - 2p)| = scale h^2 / (36 sqrt 3), and the float64 loss
  errs by the row bound above with u64 and 4 ulp for NumPy's exp and log (a
  generous allowance: the term is ~1e-12, far below the float32 bound).
(Before issue 29: TOL_ELEM 1e-6, TOL_SHORT 1e-5, TOL_LONG 5e-5 on
max|a - ref| / max(1, max|ref|), read off one machine: dropped.)
"""
import math
import subprocess
import sys
import textwrap
import zlib

import numpy as np
import pytest
from numpy.lib.stride_tricks import sliding_window_view

import dpcore as dp
from test_conv_cpu import U32, assert_within_bound, gamma

ops = dp.ops

U64 = 2.0 ** -53  # float64's unit roundoff


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------

def gamma64(k):
    return k * U64 / (1 - k * U64)


@pytest.fixture
def no_winograd(monkeypatch):
    """The GEMM paths, the implicit GEMM and the direct loops: the conv bounds' subject."""
    monkeypatch.setenv("DPCORE_WINOGRAD", "0")
    monkeypatch.setenv("DPCORE_FFT", "0")       # the FFT (fft_lanes.h) is not a GEMM path either


def abs64(*arrays):
    return [None if a is None else np.abs(np.asarray(a, dtype=np.float64)) for a in arrays]


def seed_of(name):
    """A fixed seed from a test id (str hash() is salted per process; crc32 is not)."""
    return zlib.crc32(name.encode())


def rand32(rng, *shape, scale=1.0):
    """float32 N(0, scale^2) array."""
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def f64(a):
    return np.asarray(a, dtype=np.float64)


def sample_indices(rng, shape, k):
    """Up to k distinct multi-indices into an array of this shape (all of them if it is small)."""
    size = int(np.prod(shape))
    flat = np.arange(size) if size <= k else rng.choice(size, size=k, replace=False)
    return [np.unravel_index(int(i), shape) for i in flat]


def fd_check(f, f_err, arrays, grads, bounds, rng, h, what, k=8, truncation=0.0):
    """Central differences of the float64 scalar function f() w.r.t. entries of the float64
    arrays (mutated in place and restored) against dpcore's float32 gradients grads[name],
    within the gradient's own bound plus the quotient's error (the docstring):
        bound32[i] + (f_err(x+h) + f_err(x-h)) / 2h + 4 u64 S_g[i] (|x| + h) / h + truncation,
    bounds[name] = (bound32, S_g), f_err() the bound on f's float64 rounding at the current
    point (for a sum of T leaf products: gamma64_{T+1} times f on absolute values)."""
    for name, arr in arrays.items():
        g = np.asarray(grads[name], dtype=np.float64)
        bound32, Sg = bounds[name]
        for i in sample_indices(rng, arr.shape, k):
            old = arr[i]
            arr[i] = old + h
            fp, ep = f(), f_err()
            arr[i] = old - h
            fm, em = f(), f_err()
            arr[i] = old
            fd = (fp - fm) / (2 * h)
            allowed = bound32[i] + (ep + em) / (2 * h) + 4 * U64 * Sg[i] * (abs(old) + h) / h + truncation
            assert abs(g[i] - fd) <= allowed, (f"{what}: d/d{name}{tuple(map(int, i))}: analytic {g[i]!r} vs "
                                              f"finite differences {fd!r}: |error| {abs(g[i] - fd):.3g} > {allowed:.3g}")


def assert_within(got, ref, bound, what):
    """|got - ref| <= bound elementwise (bound: a derived bound of its own, not gamma_n S)."""
    assert_within_bound(got, ref, f64(bound) / gamma(1), 1, what)


def tree_err(fabs, T):
    """f_err for a float64 f that is a sum of T leaf products: gamma64_{T+1} * f on absolute values."""
    return lambda: gamma64(T + 1) * fabs()


# ---------------------------------------------------------------------------
# float64 references
# ---------------------------------------------------------------------------

def ref_conv2d(x, w, b, stride, pad):
    """y[n,o,i,j] = b[o] + sum_{c,ki,kj} xpad[n,c,i*s+ki,j*s+kj] w[o,c,ki,kj]."""
    KH, KW = w.shape[2:]
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    win = sliding_window_view(xp, (KH, KW), axis=(2, 3))[:, :, ::stride, ::stride]  # (N,C,OH,OW,KH,KW)
    y = np.einsum("nchwij,ocij->nohw", win, w, optimize=True)
    if b is not None:
        y = y + b[None, :, None, None]
    return y


def ref_conv2d_backward(x, w, dy, stride, pad):
    N, C, H, W = x.shape
    KH, KW = w.shape[2:]
    OH, OW = dy.shape[2:]
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    win = sliding_window_view(xp, (KH, KW), axis=(2, 3))[:, :, ::stride, ::stride]
    dw = np.einsum("nchwij,nohw->ocij", win, dy, optimize=True)
    db = dy.sum(axis=(0, 2, 3))
    dxp = np.zeros_like(xp)
    for i in range(KH):
        for j in range(KW):
            dxp[:, :, i:i + stride * (OH - 1) + 1:stride, j:j + stride * (OW - 1) + 1:stride] += \
                np.einsum("nohw,oc->nchw", dy, w[:, :, i, j], optimize=True)
    return dxp[:, :, pad:pad + H, pad:pad + W], dw, db


def loop_conv2d(x, w, b, stride, pad):
    """Direct loops (tiny shapes only): cross-checks ref_conv2d itself."""
    N, C, H, W = x.shape
    O, _, KH, KW = w.shape
    OH, OW = (H + 2 * pad - KH) // stride + 1, (W + 2 * pad - KW) // stride + 1
    y = np.zeros((N, O, OH, OW))
    for n in range(N):
        for o in range(O):
            for i in range(OH):
                for j in range(OW):
                    s = b[o]
                    for c in range(C):
                        for ki in range(KH):
                            for kj in range(KW):
                                h, v = i * stride - pad + ki, j * stride - pad + kj
                                if 0 <= h < H and 0 <= v < W:
                                    s += x[n, c, h, v] * w[o, c, ki, kj]
                    y[n, o, i, j] = s
    return y


def pool_out(n, k, s, p):
    return (n + 2 * p - k) // s + 1


def windows_per_input(k, s):
    """The most windows (k x k at stride s) one input lies in: ceil(k/s)^2."""
    return (-(-k // s)) ** 2


def ref_avg_pool(x, k, s, p):
    """count_include_pad=True: window sum over the zero-padded input / k^2."""
    OH, OW = pool_out(x.shape[2], k, s, p), pool_out(x.shape[3], k, s, p)
    xp = np.pad(x, ((0, 0), (0, 0), (p, p), (p, p)))
    y = np.zeros(x.shape[:2] + (OH, OW))
    for i in range(k):
        for j in range(k):
            y += xp[:, :, i:i + s * (OH - 1) + 1:s, j:j + s * (OW - 1) + 1:s]
    return y / (k * k)


def ref_avg_pool_backward(x, dy, k, s, p):
    H, W = x.shape[2:]
    OH, OW = dy.shape[2:]
    dxp = np.zeros(x.shape[:2] + (H + 2 * p, W + 2 * p))
    for i in range(k):
        for j in range(k):
            dxp[:, :, i:i + s * (OH - 1) + 1:s, j:j + s * (OW - 1) + 1:s] += dy / (k * k)
    return dxp[:, :, p:p + H, p:p + W]


def ref_max_pool_arg(x, k, s, p):
    """(y, rows, cols) with the winner's padded coordinates; first maximum (row-major in the window) wins."""
    xp = np.pad(x, ((0, 0), (0, 0), (p, p), (p, p)), constant_values=-np.inf)
    win = sliding_window_view(xp, (k, k), axis=(2, 3))[:, :, ::s, ::s]  # (N,C,OH,OW,k,k)
    flat = win.reshape(win.shape[:4] + (k * k,))
    am = flat.argmax(axis=-1)
    y = np.take_along_axis(flat, am[..., None], axis=-1)[..., 0]
    OH, OW = y.shape[2:]
    rows = np.arange(OH)[None, None, :, None] * s + am // k
    cols = np.arange(OW)[None, None, None, :] * s + am % k
    return y, rows, cols


def ref_max_pool(x, k, s, p):
    return ref_max_pool_arg(x, k, s, p)[0]


def ref_max_pool_backward(x, dy, k, s, p):
    _, rows, cols = ref_max_pool_arg(x, k, s, p)
    N, C, H, W = x.shape
    dxp = np.zeros((N, C, H + 2 * p, W + 2 * p))
    n = np.arange(N)[:, None, None, None]
    c = np.arange(C)[None, :, None, None]
    np.add.at(dxp, (np.broadcast_to(n, dy.shape), np.broadcast_to(c, dy.shape), rows, cols), dy)
    return dxp[:, :, p:p + H, p:p + W]


def ref_xent(logits, labels):
    """Per-row losses and d(sum of losses)/dlogits, stable (log-sum-exp)."""
    m = logits.max(axis=1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(logits - m).sum(axis=1))
    rows = np.arange(len(labels))
    loss = lse - logits[rows, labels]
    d = np.exp(logits - lse[:, None])
    d[rows, labels] -= 1.0
    return loss, d


def ref_sgd(w, g, v, lr, mu, wd):
    """torch.optim.SGD (dampening 0, no Nesterov): g' = g + wd w; v = mu v + g'; w -= lr v."""
    g2 = g + wd * w
    if mu != 0:
        v = mu * v + g2
        step = v
    else:
        step = g2
    return w - lr * step, v


def xent_bounds(logits, labels, scale, u=U32, ulps=1):
    """The docstring's bounds for softmax cross-entropy computed in unit roundoff u with exp and
    log within `ulps` ulp: (elementwise bound on dlogits = scale (p - onehot), bound on the loss =
    scale * the sum of the rows, p, onehot), from the float64 logits (finite rows, or -inf
    entries; a row with NaN or +inf is not bounded)."""
    L = f64(logits)
    N, K = L.shape
    m = L.max(axis=1, keepdims=True)
    t = L - m                                           # <= 0; -inf for a -inf logit
    e = np.exp(t)
    s = e.sum(axis=1, keepdims=True)
    p = e / s
    onehot = np.zeros_like(L)
    onehot[np.arange(N), labels] = 1.0
    up = np.where(p > 0, np.abs(np.where(p > 0, t, 0.0)) * p, 0.0)   # u |t_j| p_j, 0 where p_j = 0
    E = 2 * ulps                                         # exp, log: relative error in units of u
    g = lambda k: k * u / (1 - k * u)                    # noqa: E731
    d_bound = scale * (p * (g(K + 1 + 2 * E) + K * u / math.e) + u * up + g(3) * np.abs(p - onehot)
                       + 2.0 ** -148)
    lse = np.log(s[:, 0])
    t_label = np.abs(t[np.arange(N), labels])
    rows = lse + t_label
    loss_bound = scale * (np.sum(g(K + E) + K * u / math.e + g(E) * (lse + t_label + rows))
                          + gamma64(N + 1) * rows.sum())
    return d_bound, loss_bound, p, onehot


def sgd_bounds(w, g, v, lr, mu, wd):
    """The docstring's bounds on one float32 step from (w, g, v): (for w', for v')."""
    aw, ag, av = abs64(w, g, v)
    mv = mu * av if mu else 0.0
    return gamma(7) * (aw + lr * (mv + ag + wd * aw)), gamma(4) * (mv + ag + wd * aw)


# ---------------------------------------------------------------------------
# conv2d
# ---------------------------------------------------------------------------

# (N, C, H, W, O, K, stride, pad); K may be (KH, KW)
CONV_CASES = [
    (1, 1, 7, 7, 1, 3, 1, 0),          # batch 1, odd size
    (1, 3, 13, 13, 4, 3, 2, 1),        # stride 2, pad 1
    (2, 3, 7, 7, 5, 5, 1, 2),          # kernel 5, pad 2 ("same")
    (3, 2, 13, 9, 4, 3, 3, 1),         # rectangular input, stride 3
    (5, 4, 9, 11, 3, 1, 1, 0),         # kernel 1 (pointwise path), odd batch
    (2, 4, 9, 11, 3, 1, 2, 0),         # kernel 1, stride 2 (not pointwise)
    (2, 4, 7, 7, 3, 1, 1, 1),          # kernel 1 with padding
    (3, 5, 8, 8, 6, 5, 2, 2),          # kernel 5, stride 2, pad 2
    (2, 3, 10, 7, 4, 4, 3, 2),         # even kernel, stride 3, pad 2
    (1, 2, 5, 5, 3, 5, 1, 0),          # kernel == input: 1x1 output
    (2, 2, 3, 3, 2, 5, 1, 1),          # kernel larger than the input but not the padded input
    (1, 2, 5, 5, 2, 3, 1, 3),          # pad 3 with kernel 3: corner windows are all padding
    (2, 3, 8, 10, 4, (2, 4), 1, 1),    # rectangular kernel
    (3, 2, 6, 6, 3, (3, 1), 2, 1),     # rectangular kernel, stride 2
    (7, 3, 12, 12, 5, 3, 1, 1),        # batch > threads, odd
    (256, 1, 28, 28, 20, 3, 1, 0),     # LeNet conv 1
    (256, 20, 13, 13, 50, 5, 1, 0),    # LeNet conv 2
]


def conv_id(case):
    return "N{}C{}H{}W{}O{}K{}s{}p{}".format(*[("x".join(map(str, v)) if isinstance(v, tuple) else v) for v in case])


def make_conv(case, seed):
    N, C, H, W, O, K, s, p = case
    KH, KW = K if isinstance(K, tuple) else (K, K)
    rng = np.random.default_rng(seed)
    x = rand32(rng, N, C, H, W)
    w = rand32(rng, O, C, KH, KW, scale=1.0 / np.sqrt(C * KH * KW))
    b = rand32(rng, O)
    OH, OW = (H + 2 * p - KH) // s + 1, (W + 2 * p - KW) // s + 1
    dy = rand32(rng, N, O, OH, OW)
    return rng, x, w, b, dy, s, p


def conv_terms(case):
    """n of the docstring: (taps = C*KH*KW, dx's O*KH*KW, dw's and db's N*OH*OW)."""
    N, C, H, W, O, K, s, p = case
    KH, KW = K if isinstance(K, tuple) else (K, K)
    OH, OW = (H + 2 * p - KH) // s + 1, (W + 2 * p - KW) // s + 1
    return C * KH * KW, O * KH * KW, N * OH * OW


@pytest.mark.usefixtures("no_winograd")
@pytest.mark.parametrize("case", CONV_CASES, ids=conv_id)
def test_conv2d_forward_backward(case):
    rng, x, w, b, dy, s, p = make_conv(case, seed=seed_of(conv_id(case)))
    taps, n_dx, n_dw = conv_terms(case)
    X, Wt, B, R = f64(x), f64(w), f64(b), f64(dy)
    aX, aW, aB, aR = abs64(x, w, b, dy)
    y = ops.conv2d(x, w, b, stride=s, padding=p)
    y_ref = ref_conv2d(X, Wt, B, s, p)
    assert y.dtype == np.float32 and y.shape == y_ref.shape
    assert_within_bound(y, y_ref, ref_conv2d(aX, aW, aB, s, p), taps + 1, f"conv2d forward {case}")
    # without bias
    assert_within_bound(ops.conv2d(x, w, None, stride=s, padding=p), ref_conv2d(X, Wt, None, s, p),
                        ref_conv2d(aX, aW, None, s, p), taps, f"conv2d forward (no bias) {case}")

    dx, dw, db = ops.conv2d_backward(x, w, dy, stride=s, padding=p)
    assert dx.shape == x.shape and dw.shape == w.shape and db.shape == b.shape
    assert dx.dtype == dw.dtype == db.dtype == np.float32
    for got, ref, S, n, name in zip((dx, dw, db), ref_conv2d_backward(X, Wt, R, s, p),
                                    ref_conv2d_backward(aX, aW, aR, s, p), (n_dx, n_dw, n_dw), ("dx", "dw", "db")):
        assert_within_bound(got, ref, S, n, f"conv2d {name} {case}")


@pytest.mark.usefixtures("no_winograd")
@pytest.mark.parametrize("case", [c for c in CONV_CASES if c[0] < 256], ids=conv_id)
def test_conv2d_backward_finite_differences(case):
    # FD of sum(ref_conv2d(x, w, b) * dy) in float64 (linear in each entry: no truncation error, h = 1)
    # vs dpcore's gradients; T = N*O*OH*OW*(taps + 1) leaf products
    rng, x, w, b, dy, s, p = make_conv(case, seed=1 + seed_of(conv_id(case)))
    taps, n_dx, n_dw = conv_terms(case)
    dx, dw, db = ops.conv2d_backward(x, w, dy, stride=s, padding=p)
    X, Wt, B, R = f64(x), f64(w), f64(b), f64(dy)
    aR = np.abs(R)
    Sx, Sw, Sb = ref_conv2d_backward(*abs64(x, w, dy), s, p)
    f_err = tree_err(lambda: float((ref_conv2d(np.abs(X), np.abs(Wt), np.abs(B), s, p) * aR).sum()),
                     dy.size * (taps + 1))
    fd_check(lambda: float((ref_conv2d(X, Wt, B, s, p) * R).sum()), f_err, {"x": X, "w": Wt, "b": B},
             {"x": dx, "w": dw, "b": db},
             {"x": (gamma(n_dx) * Sx, Sx), "w": (gamma(n_dw) * Sw, Sw), "b": (gamma(n_dw) * Sb, Sb)},
             rng, h=1.0, what=f"conv2d {case}", k=10)


def test_conv_reference_matches_direct_loops():
    # The einsum reference itself against six nested loops, incl. stride and padding.
    rng = np.random.default_rng(5)
    for (N, C, H, W, O, KH, KW, s, p) in [(2, 2, 5, 6, 3, 3, 2, 2, 1), (1, 3, 7, 5, 2, 3, 3, 3, 2)]:
        x, w, b = rng.standard_normal((N, C, H, W)), rng.standard_normal((O, C, KH, KW)), rng.standard_normal(O)
        np.testing.assert_allclose(ref_conv2d(x, w, b, s, p), loop_conv2d(x, w, b, s, p), rtol=1e-12, atol=1e-12)


def test_conv2d_noncontiguous_and_float64_inputs_are_converted():
    rng, x, w, b, dy, s, p = make_conv((2, 3, 9, 9, 4, 3, 2, 1), seed=11)
    y = ops.conv2d(x, w, b, stride=s, padding=p)
    xt = np.ascontiguousarray(x.transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2)  # same values, Fortran-ish strides
    assert not xt.flags.c_contiguous
    np.testing.assert_array_equal(ops.conv2d(xt, w, b, stride=s, padding=p), y)
    np.testing.assert_array_equal(ops.conv2d(f64(x), f64(w), f64(b), stride=s, padding=p), y)


def test_conv2d_empty_batch():
    rng = np.random.default_rng(3)
    w, b = rand32(rng, 4, 3, 3, 3), rand32(rng, 4)
    # a non-empty call first, so the scratch memory holds stale numbers
    ops.conv2d_backward(rand32(rng, 5, 3, 7, 7), w, rand32(rng, 5, 4, 3, 3), stride=2, padding=0)
    x = np.zeros((0, 3, 7, 7), np.float32)
    y = ops.conv2d(x, w, b, stride=2, padding=0)
    assert y.shape == (0, 4, 3, 3) and y.dtype == np.float32
    dx, dw, db = ops.conv2d_backward(x, w, np.zeros((0, 4, 3, 3), np.float32), stride=2, padding=0)
    assert dx.shape == (0, 3, 7, 7)
    assert dw.shape == (4, 3, 3, 3) and db.shape == (4,)
    assert not dw.any() and not db.any(), "empty batch must give zero dw, db"


# ---------------------------------------------------------------------------
# dense
# ---------------------------------------------------------------------------

DENSE_CASES = [(1, 1, 1), (1, 7, 3), (5, 13, 4), (3, 1, 9), (16, 800, 128), (16, 128, 10), (257, 33, 17)]


@pytest.mark.parametrize("N,I,O", DENSE_CASES)
def test_dense_forward_backward(N, I, O):
    rng = np.random.default_rng(100 + N * 1000 + I * 10 + O)
    x, w, b = rand32(rng, N, I), rand32(rng, O, I, scale=1 / np.sqrt(I)), rand32(rng, O)
    dy = rand32(rng, N, O)
    X, Wt, B, R = f64(x), f64(w), f64(b), f64(dy)
    aX, aW, aB, aR = abs64(x, w, b, dy)
    y = ops.dense(x, w, b)
    assert y.dtype == np.float32 and y.shape == (N, O)
    assert_within_bound(y, np.einsum("ni,oi->no", X, Wt) + B, np.einsum("ni,oi->no", aX, aW) + aB, I + 1,
                        f"dense forward {(N, I, O)}")
    assert_within_bound(ops.dense(x, w), np.einsum("ni,oi->no", X, Wt), np.einsum("ni,oi->no", aX, aW), I,
                        f"dense forward (no bias) {(N, I, O)}")
    dx, dw, db = ops.dense_backward(x, w, dy)
    assert dx.shape == x.shape and dw.shape == w.shape and db.shape == (O,)
    Sx, Sw, Sb = np.einsum("no,oi->ni", aR, aW), np.einsum("no,ni->oi", aR, aX), aR.sum(axis=0)
    assert_within_bound(dx, np.einsum("no,oi->ni", R, Wt), Sx, O, f"dense dx {(N, I, O)}")
    assert_within_bound(dw, np.einsum("no,ni->oi", R, X), Sw, N, f"dense dw {(N, I, O)}")
    assert_within_bound(db, R.sum(axis=0), Sb, N, f"dense db {(N, I, O)}")
    # FD of sum(dense(x) * dy) in float64 (linear in each entry: no truncation error, h = 1) vs dpcore's
    # gradients; T = N*O*(I + 1) leaf products (the loss as one un-BLASed einsum: multithreaded BLAS on
    # tiny products is slow on a busy 2-core box)
    f_err = tree_err(lambda: float(np.einsum("ni,oi,no->", np.abs(X), np.abs(Wt), aR) + (np.abs(B) * Sb).sum()),
                     N * O * (I + 1))
    fd_check(lambda: float(np.einsum("ni,oi,no->", X, Wt, R) + (B * R.sum(axis=0)).sum()), f_err,
             {"x": X, "w": Wt, "b": B}, {"x": dx, "w": dw, "b": db},
             {"x": (gamma(O) * Sx, Sx), "w": (gamma(N) * Sw, Sw), "b": (gamma(N) * Sb, Sb)},
             rng, h=1.0, what=f"dense {(N, I, O)}")


def test_dense_empty_batch():
    rng = np.random.default_rng(4)
    w, b = rand32(rng, 3, 5), rand32(rng, 3)
    ops.dense_backward(rand32(rng, 4, 5), w, rand32(rng, 4, 3))
    x = np.zeros((0, 5), np.float32)
    y = ops.dense(x, w, b)
    assert y.shape == (0, 3) and y.dtype == np.float32
    dx, dw, db = ops.dense_backward(x, w, np.zeros((0, 3), np.float32))
    assert dx.shape == (0, 5) and dw.shape == (3, 5) and db.shape == (3,)
    assert not dw.any() and not db.any(), "empty batch must give zero dw, db"


# ---------------------------------------------------------------------------
# relu
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(1,), (4, 10), (2, 3, 5, 7), (1, 1, 1, 1)])
def test_relu_forward_backward(shape):
    rng = np.random.default_rng(len(shape) * 7 + int(np.prod(shape)))
    x = rand32(rng, *shape)
    x[np.abs(x) < 1e-2] = 0.5  # keep away from the kink for the finite differences
    dy = rand32(rng, *shape)
    y = ops.relu(x)
    assert y.shape == x.shape and y.dtype == np.float32
    np.testing.assert_array_equal(y, np.maximum(x, 0))  # exact: no arithmetic
    dx = ops.relu_backward(y, dy)
    np.testing.assert_array_equal(dx, np.where(x > 0, dy, 0))
    X, R = f64(x), f64(dy)
    # FD in float64 with h = 2^-10 < min |x|: linear over [x - h, x + h] (no truncation error); dx exact
    aR = np.abs(R)
    fd_check(lambda: float((np.maximum(X, 0) * R).sum()), tree_err(lambda: float((np.abs(X) * aR).sum()), x.size),
             {"x": X}, {"x": dx}, {"x": (np.zeros(shape), aR)}, rng, h=2.0 ** -10, what=f"relu {shape}", k=20)


def test_relu_keeps_the_shape_of_a_0d_array():
    # element-wise: the output has the input's shape, () included (like np.maximum)
    y = ops.relu(np.array(-3.0, np.float32))
    assert y.shape == () and y == 0
    assert ops.relu_backward(np.array(2.0, np.float32), np.array(5.0, np.float32)).shape == ()


def test_relu_at_zero_and_empty():
    x = np.array([-1.0, -0.0, 0.0, 2.0], np.float32)
    y = ops.relu(x)
    np.testing.assert_array_equal(y, [0, 0, 0, 2])
    # the forward output is 0 at x == 0: the gradient there is 0 (PyTorch's choice)
    np.testing.assert_array_equal(ops.relu_backward(y, np.ones(4, np.float32)), [0, 0, 0, 1])
    e = np.zeros((0, 3), np.float32)
    assert ops.relu(e).shape == (0, 3)
    assert ops.relu_backward(e, e).shape == (0, 3)


# ---------------------------------------------------------------------------
# pooling
# ---------------------------------------------------------------------------

# (N, C, H, W, k, stride, pad)
POOL_CASES = [
    (1, 1, 1, 1, 1, 1, 0),
    (1, 1, 4, 4, 2, 2, 0),
    (2, 3, 7, 7, 2, 2, 0),      # odd: 7x7 -> 3x3, last row/col dropped
    (2, 3, 13, 13, 3, 2, 1),    # overlapping windows with padding
    (1, 2, 7, 9, 3, 2, 1),      # rectangular
    (3, 2, 8, 8, 3, 3, 1),
    (2, 2, 6, 7, 2, 3, 0),      # stride > kernel: some inputs in no window
    (1, 1, 5, 5, 5, 1, 2),      # k 5, pad 2: 5x5 output
    (1, 2, 9, 9, 4, 1, 2),      # even kernel, pad = k/2
    (2, 4, 26, 26, 2, 2, 0),    # LeNet pool 1
    (3, 50, 9, 9, 2, 2, 0),     # LeNet pool 2 (9 -> 4)
]


def pool_id(case):
    return "N{}C{}H{}W{}k{}s{}p{}".format(*case)


def distinct_values(rng, shape, gap=0.01):
    """float32 values, pairwise at least `gap` apart (no ties, max-pool FD safe)."""
    n = int(np.prod(shape))
    v = (rng.permutation(n) - n / 2) * gap
    return v.reshape(shape).astype(np.float32)


@pytest.mark.parametrize("case", POOL_CASES, ids=pool_id)
def test_avg_pool2d(case):
    N, C, H, W, k, s, p = case
    rng = np.random.default_rng(seed_of(pool_id(case)))
    x = rand32(rng, N, C, H, W)
    OH, OW = pool_out(H, k, s, p), pool_out(W, k, s, p)
    dy = rand32(rng, N, C, OH, OW)
    X, R = f64(x), f64(dy)
    aX, aR = abs64(x, dy)
    y = ops.avg_pool2d(x, k, s, p)
    assert y.shape == (N, C, OH, OW) and y.dtype == np.float32
    assert_within_bound(y, ref_avg_pool(X, k, s, p), ref_avg_pool(aX, k, s, p), k * k + 1,
                        f"avg_pool2d forward {case}")
    dx = ops.avg_pool2d_backward(x, dy, k, s, p)
    assert dx.shape == x.shape and dx.dtype == np.float32
    Sx, n_dx = ref_avg_pool_backward(aX, aR, k, s, p), windows_per_input(k, s) + 1
    assert_within_bound(dx, ref_avg_pool_backward(X, R, k, s, p), Sx, n_dx, f"avg_pool2d dx {case}")
    # linear: no truncation error, h = 1; T = N*C*OH*OW*k*k leaf terms
    fd_check(lambda: float((ref_avg_pool(X, k, s, p) * R).sum()),
             tree_err(lambda: float((ref_avg_pool(np.abs(X), k, s, p) * aR).sum()), dy.size * k * k),
             {"x": X}, {"x": dx}, {"x": (gamma(n_dx) * Sx, Sx)}, rng, h=1.0, what=f"avg_pool2d {case}", k=20)


@pytest.mark.parametrize("case", POOL_CASES, ids=pool_id)
def test_max_pool2d(case):
    N, C, H, W, k, s, p = case
    rng = np.random.default_rng(1 + seed_of(pool_id(case)))
    x = distinct_values(rng, (N, C, H, W))
    OH, OW = pool_out(H, k, s, p), pool_out(W, k, s, p)
    dy = rand32(rng, N, C, OH, OW)
    y = ops.max_pool2d(x, k, s, p)
    assert y.shape == (N, C, OH, OW) and y.dtype == np.float32
    np.testing.assert_array_equal(y, ref_max_pool(f64(x), k, s, p))  # a max is exact
    dx = ops.max_pool2d_backward(x, dy, k, s, p)
    assert dx.shape == x.shape and dx.dtype == np.float32
    X, R = f64(x), f64(dy)
    aR = np.abs(R)
    Sx, n_dx = ref_max_pool_backward(X, aR, k, s, p), windows_per_input(k, s) - 1
    assert_within_bound(dx, ref_max_pool_backward(X, R, k, s, p), Sx, n_dx, f"max_pool2d dx {case}")
    # no ties, gaps >= 0.01 > 2h: no winner changes within +-h, linear there: no truncation error
    fd_check(lambda: float((ref_max_pool(X, k, s, p) * R).sum()),
             tree_err(lambda: float((np.abs(ref_max_pool(X, k, s, p)) * aR).sum()), dy.size),
             {"x": X}, {"x": dx}, {"x": (gamma(n_dx) * Sx, Sx)}, rng, h=2.0 ** -13, what=f"max_pool2d {case}",
             k=20)


@pytest.mark.parametrize("case", [(2, 3, 13, 13, 3, 2, 1), (2, 2, 8, 8, 2, 2, 0), (1, 3, 9, 7, 3, 1, 1)],
                         ids=pool_id)
def test_max_pool2d_ties_first_max_wins(case):
    # small integers: many ties; the reference's argmax takes the first maximum in row-major window order
    N, C, H, W, k, s, p = case
    rng = np.random.default_rng(7)
    x = rng.integers(0, 3, size=(N, C, H, W)).astype(np.float32)
    OH, OW = pool_out(H, k, s, p), pool_out(W, k, s, p)
    dy = rand32(rng, N, C, OH, OW)
    np.testing.assert_array_equal(ops.max_pool2d(x, k, s, p), ref_max_pool(f64(x), k, s, p))
    assert_within_bound(ops.max_pool2d_backward(x, dy, k, s, p), ref_max_pool_backward(f64(x), f64(dy), k, s, p),
                        ref_max_pool_backward(f64(x), np.abs(f64(dy)), k, s, p), windows_per_input(k, s) - 1,
                        f"max_pool2d dx with ties {case}")


def test_max_pool2d_tie_explicit():
    x = np.array([[[[1, 5], [5, 2]]]], np.float32)
    dx = ops.max_pool2d_backward(x, np.array([[[[3.0]]]], np.float32), 2, 2, 0)
    np.testing.assert_array_equal(dx, [[[[0, 3], [0, 0]]]])
    dx = ops.max_pool2d_backward(np.zeros((1, 1, 2, 2), np.float32), np.ones((1, 1, 1, 1), np.float32), 2, 2, 0)
    np.testing.assert_array_equal(dx, [[[[1, 0], [0, 0]]]])


def test_max_pool2d_negative_inputs_with_padding():
    # padding must never win, even when every real input is negative
    x = -np.arange(1, 10, dtype=np.float32).reshape(1, 1, 3, 3) - 100
    y = ops.max_pool2d(x, 3, 1, 1)
    np.testing.assert_array_equal(y, ref_max_pool(f64(x), 3, 1, 1))
    assert (y < -100).all()


def test_max_pool2d_nan_propagates():
    x = np.zeros((1, 1, 4, 4), np.float32)
    x[0, 0, 1, 1] = np.nan
    y = ops.max_pool2d(x, 2, 2, 0)
    assert np.isnan(y[0, 0, 0, 0]) and not np.isnan(y[0, 0, 1:, :]).any() and not np.isnan(y[0, 0, :, 1:]).any()


@pytest.mark.parametrize("pool", ["avg", "max"])
def test_pool_odd_size_drops_last_row_and_column(pool):
    rng = np.random.default_rng(9)
    x = distinct_values(rng, (2, 3, 7, 7))
    dy = rand32(rng, 2, 3, 3, 3)
    fwd, bwd = (ops.avg_pool2d, ops.avg_pool2d_backward) if pool == "avg" else (ops.max_pool2d, ops.max_pool2d_backward)
    y = fwd(x, 2, 2, 0)
    assert y.shape == (2, 3, 3, 3)
    # the last row / column never enters: changing it changes nothing
    x2 = x.copy()
    x2[:, :, 6, :] = 1e6
    x2[:, :, :, 6] = 1e6
    np.testing.assert_array_equal(fwd(x2, 2, 2, 0), y)
    dx = bwd(x, dy, 2, 2, 0)
    assert not dx[:, :, 6, :].any() and not dx[:, :, :, 6].any(), "the dropped row/column must get zero gradient"
    assert dx[:, :, :6, :6].any()


def test_pool_empty_batch():
    x = np.zeros((0, 2, 7, 7), np.float32)
    dy = np.zeros((0, 2, 3, 3), np.float32)
    for fwd, bwd in ((ops.avg_pool2d, ops.avg_pool2d_backward), (ops.max_pool2d, ops.max_pool2d_backward)):
        assert fwd(x, 3, 2, 1).shape == (0, 2, 4, 4)
        assert bwd(x, np.zeros((0, 2, 4, 4), np.float32), 3, 2, 1).shape == (0, 2, 7, 7)
        assert bwd(x, dy, 2, 2, 0).shape == (0, 2, 7, 7)


# ---------------------------------------------------------------------------
# softmax cross-entropy
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("N,K", [(1, 1), (1, 10), (7, 3), (64, 10), (5, 1000)])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_softmax_cross_entropy(N, K, reduction):
    rng = np.random.default_rng(N * 31 + K)
    logits = rand32(rng, N, K, scale=3.0)
    labels = rng.integers(0, K, size=N)
    labels[::2] = np.argmax(logits[::2], axis=1)  # about half the rows correct
    loss, correct, d = ops.softmax_cross_entropy(logits, labels, reduction)
    rows, d_ref = ref_xent(f64(logits), labels)
    scale = 1.0 / N if reduction == "mean" else 1.0
    loss_ref = rows.sum() * scale
    d_bound, loss_bound, p, onehot = xent_bounds(logits, labels, scale)
    assert abs(loss - loss_ref) <= loss_bound, (loss, loss_ref, loss_bound)
    assert correct == int((np.argmax(logits, axis=1) == labels).sum())
    assert d.shape == (N, K) and d.dtype == np.float32
    assert_within(d, d_ref * scale, d_bound, f"dlogits {(N, K, reduction)}")
    # FD of the float64 loss (smooth, h = 2^-13: truncation <= scale h^2 / (36 sqrt 3)) vs dpcore's dlogits;
    # the float64 loss's rounding: xent_bounds in u64 with 4 ulp exp and log, and ref_xent's m + log(s)
    L = f64(logits)

    def f_err():
        return (xent_bounds(L, labels, scale, u=U64, ulps=4)[1]
                + scale * gamma64(2) * float(np.abs(L).max(axis=1).sum() + np.abs(L[np.arange(N), labels]).sum()))
    fd_check(lambda: float(ref_xent(L, labels)[0].sum() * scale), f_err, {"logits": L}, {"logits": d},
             {"logits": (d_bound, scale * (p + onehot))}, rng, h=2.0 ** -13,
             what=f"softmax_cross_entropy {(N, K, reduction)}", k=12,
             truncation=scale * 2.0 ** -26 / (36 * math.sqrt(3)))


def test_softmax_cross_entropy_large_logits_are_stable():
    logits = np.array([[1000, -1000, 0, 500],
                       [1000, -1000, 0, 500],
                       [-1000, -1000, -1000, -1000],
                       [1000, 1000, 1000, 1000],
                       [3e4, -3e4, 1e4, 0]], np.float32)
    labels = np.array([0, 1, 2, 3, 2])
    for reduction in ("sum", "mean"):
        loss, correct, d = ops.softmax_cross_entropy(logits, labels, reduction)
        rows, d_ref = ref_xent(f64(logits), labels)
        scale = 1.0 if reduction == "sum" else 1.0 / len(labels)
        assert np.isfinite(loss) and np.isfinite(d).all(), (loss, d)
        d_bound, loss_bound = xent_bounds(logits, labels, scale)[:2]
        assert abs(loss - rows.sum() * scale) <= loss_bound, (loss, rows.sum() * scale, loss_bound)
        assert_within(d, d_ref * scale, d_bound, f"dlogits, large logits ({reduction})")
        # rows 0 (label is the max), 3 (all tie: first max is 0, label 3 -> wrong)
        assert correct == 1
    np.testing.assert_allclose(rows, [0.0, 2000.0, np.log(4), np.log(4), 2e4], rtol=1e-12, atol=1e-12)


def test_softmax_cross_entropy_ties_first_max_wins():
    logits = np.zeros((3, 4), np.float32)
    _, correct, _ = ops.softmax_cross_entropy(logits, np.array([0, 1, 3]), "sum")
    assert correct == 1  # argmax of a tie is the first class, like np.argmax


def test_softmax_cross_entropy_int32_labels():
    rng = np.random.default_rng(2)
    logits = rand32(rng, 6, 5)
    labels = rng.integers(0, 5, 6)
    a = ops.softmax_cross_entropy(logits, labels.astype(np.int64), "mean")
    b = ops.softmax_cross_entropy(logits, labels.astype(np.int32), "mean")
    assert a[0] == b[0] and a[1] == b[1]
    np.testing.assert_array_equal(a[2], b[2])


# ---------------------------------------------------------------------------
# SGD update
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("lr,mu,wd", [(0.1, 0.9, 1e-3), (0.5, 0.0, 0.0), (0.05, 0.0, 1e-2), (0.2, 0.5, 0.0),
                                      (0.01, 0.99, 5e-4)])
def test_sgd_update_matches_torch_semantics(lr, mu, wd):
    rng = np.random.default_rng(int(lr * 1000 + mu * 100 + wd * 1e4))
    n = 1000
    w = rand32(rng, n)
    v = np.zeros(n, np.float32) if mu else rand32(rng, n)  # with mu == 0, v must not be touched
    v_before = v.copy()
    for step in range(4):
        g = rand32(rng, n)
        # issue 29: each step against the float64 step from the float32 state before it (a bound is
        # one step's: the float64 trajectory drifts from the float32 one by every earlier step's
        # rounding); the bounds: the docstring's SGD
        W, V = ref_sgd(f64(w), f64(g), f64(v), lr, mu, wd)
        w_bound, v_bound = sgd_bounds(w, g, v, lr, mu, wd)
        ops.sgd_update(w, g, v, lr, mu, wd)
        assert_within(w, W, w_bound, f"sgd w after step {step + 1}")
        if mu:
            assert_within(v, V, v_bound, f"sgd v after step {step + 1}")
    if not mu:
        np.testing.assert_array_equal(v, v_before)


def test_sgd_update_first_step_is_gradient_plus_decay():
    # torch: on the first step the buffer is g' itself (v starts at zero here)
    w = np.array([1.0, -2.0, 0.5], np.float32)
    g = np.array([0.1, 0.2, -0.3], np.float32)
    v = np.zeros(3, np.float32)
    w_bound, v_bound = sgd_bounds(w, g, v, 0.1, 0.9, 0.01)
    W, g64 = f64(w), f64(g)
    ops.sgd_update(w, g, v, 0.1, 0.9, 0.01)
    gp = g64 + 0.01 * W
    assert_within(v, gp, v_bound, "sgd v, first step")
    assert_within(w, W - 0.1 * gp, w_bound, "sgd w, first step")


def test_sgd_update_non_native_byte_order():
    # A big-endian float32 array is still "float32" to NumPy's type number: sgd_update refuses it
    # (TypeError naming the requirement) and never writes native-order bytes into it.
    w, g, v = np.ones(4, ">f4"), np.ones(4, ">f4"), np.zeros(4, ">f4")
    with pytest.raises(TypeError, match="native float32"):
        ops.sgd_update(w, g, v, 0.1, 0.9, 0.0)
    np.testing.assert_array_equal(w, 1.0)
    np.testing.assert_array_equal(v, 0.0)


def test_sgd_update_2d_array_in_place():
    rng = np.random.default_rng(1)
    w, g, v = rand32(rng, 4, 5), rand32(rng, 4, 5), np.zeros((4, 5), np.float32)
    W = f64(w)
    w_bound = sgd_bounds(w, g, v, 0.1, 0.9, 0.0)[0]
    wid = id(w)
    ops.sgd_update(w, g, v, 0.1, 0.9, 0.0)
    assert id(w) == wid
    assert_within(w, W - 0.1 * f64(g), w_bound, "sgd 2-D")


# ---------------------------------------------------------------------------
# bad input: ValueError / TypeError, never a crash
# ---------------------------------------------------------------------------

def _z(*shape, dtype=np.float32):
    return np.zeros(shape, dtype)


BAD_CALLS = [
    # conv2d
    ("conv x rank 3", ValueError, lambda: ops.conv2d(_z(1, 7, 7), _z(2, 1, 3, 3))),
    ("conv x rank 5", ValueError, lambda: ops.conv2d(_z(1, 1, 1, 7, 7), _z(2, 1, 3, 3))),
    ("conv w rank 3", ValueError, lambda: ops.conv2d(_z(1, 1, 7, 7), _z(1, 3, 3))),
    ("conv channel mismatch", ValueError, lambda: ops.conv2d(_z(1, 3, 7, 7), _z(2, 2, 3, 3))),
    ("conv kernel > input", ValueError, lambda: ops.conv2d(_z(1, 1, 4, 4), _z(1, 1, 5, 5))),
    ("conv kernel > padded input", ValueError, lambda: ops.conv2d(_z(1, 1, 4, 4), _z(1, 1, 7, 7), padding=1)),
    ("conv kernel wider than input", ValueError, lambda: ops.conv2d(_z(1, 1, 8, 4), _z(1, 1, 3, 5))),
    ("conv negative padding", ValueError, lambda: ops.conv2d(_z(1, 1, 7, 7), _z(1, 1, 3, 3), padding=-1)),
    ("conv stride 0", ValueError, lambda: ops.conv2d(_z(1, 1, 7, 7), _z(1, 1, 3, 3), stride=0)),
    ("conv stride -2", ValueError, lambda: ops.conv2d(_z(1, 1, 7, 7), _z(1, 1, 3, 3), stride=-2)),
    ("conv float stride", TypeError, lambda: ops.conv2d(_z(1, 1, 7, 7), _z(1, 1, 3, 3), stride=1.5)),
    ("conv zero out channels", ValueError, lambda: ops.conv2d(_z(1, 1, 7, 7), _z(0, 1, 3, 3))),
    ("conv bias shape", ValueError, lambda: ops.conv2d(_z(1, 1, 7, 7), _z(2, 1, 3, 3), _z(3))),
    ("conv bias rank", ValueError, lambda: ops.conv2d(_z(1, 1, 7, 7), _z(2, 1, 3, 3), _z(2, 1))),
    ("conv object dtype", TypeError,
     lambda: ops.conv2d(np.empty((1, 1, 7, 7), object), _z(1, 1, 3, 3))),
    ("conv bool dtype", TypeError, lambda: ops.conv2d(_z(1, 1, 7, 7, dtype=bool), _z(1, 1, 3, 3))),
    ("conv complex dtype", TypeError, lambda: ops.conv2d(_z(1, 1, 7, 7), _z(1, 1, 3, 3, dtype=np.complex64))),
    ("conv str dtype", TypeError, lambda: ops.conv2d(np.full((1, 1, 7, 7), "a"), _z(1, 1, 3, 3))),
    ("conv_backward dy shape", ValueError,
     lambda: ops.conv2d_backward(_z(1, 1, 7, 7), _z(2, 1, 3, 3), _z(1, 2, 4, 5))),
    ("conv_backward dy rank", ValueError,
     lambda: ops.conv2d_backward(_z(1, 1, 7, 7), _z(2, 1, 3, 3), _z(2, 5, 5))),
    ("conv_backward dy batch", ValueError,
     lambda: ops.conv2d_backward(_z(2, 1, 7, 7), _z(2, 1, 3, 3), _z(1, 2, 5, 5))),
    ("conv_backward dy complex", TypeError,
     lambda: ops.conv2d_backward(_z(1, 1, 7, 7), _z(2, 1, 3, 3), _z(1, 2, 5, 5, dtype=complex))),
    ("conv_backward channel mismatch", ValueError,
     lambda: ops.conv2d_backward(_z(1, 2, 7, 7), _z(2, 1, 3, 3), _z(1, 2, 5, 5))),
    # dense
    ("dense x rank 1", ValueError, lambda: ops.dense(_z(5), _z(3, 5))),
    ("dense x rank 3", ValueError, lambda: ops.dense(_z(2, 5, 1), _z(3, 5))),
    ("dense w rank 1", ValueError, lambda: ops.dense(_z(2, 5), _z(5))),
    ("dense feature mismatch", ValueError, lambda: ops.dense(_z(2, 5), _z(3, 4))),
    ("dense bias shape", ValueError, lambda: ops.dense(_z(2, 5), _z(3, 5), _z(4))),
    ("dense complex", TypeError, lambda: ops.dense(_z(2, 5, dtype=complex), _z(3, 5))),
    ("dense object", TypeError, lambda: ops.dense(_z(2, 5), np.empty((3, 5), object))),
    ("dense bool", TypeError, lambda: ops.dense(_z(2, 5), _z(3, 5), _z(3, dtype=bool))),
    ("dense_backward dy shape", ValueError, lambda: ops.dense_backward(_z(2, 5), _z(3, 5), _z(2, 4))),
    ("dense_backward dy rank", ValueError, lambda: ops.dense_backward(_z(2, 5), _z(3, 5), _z(6))),
    ("dense_backward feature mismatch", ValueError, lambda: ops.dense_backward(_z(2, 5), _z(3, 4), _z(2, 3))),
    # relu
    ("relu object", TypeError, lambda: ops.relu(np.empty(3, object))),
    ("relu bool", TypeError, lambda: ops.relu(np.ones(3, bool))),
    ("relu complex", TypeError, lambda: ops.relu(np.ones(3, complex))),
    ("relu_backward shape mismatch", ValueError, lambda: ops.relu_backward(_z(2, 3), _z(3, 2))),
    ("relu_backward rank mismatch", ValueError, lambda: ops.relu_backward(_z(2, 3), _z(6))),
    # pooling
    ("avgpool rank 3", ValueError, lambda: ops.avg_pool2d(_z(1, 7, 7), 2)),
    ("maxpool rank 2", ValueError, lambda: ops.max_pool2d(_z(7, 7), 2)),
    ("avgpool kernel > input", ValueError, lambda: ops.avg_pool2d(_z(1, 1, 3, 3), 4)),
    ("maxpool kernel > input (rect)", ValueError, lambda: ops.max_pool2d(_z(1, 1, 8, 3), 4)),
    ("avgpool negative padding", ValueError, lambda: ops.avg_pool2d(_z(1, 1, 7, 7), 2, 2, -1)),
    ("maxpool padding > k/2", ValueError, lambda: ops.max_pool2d(_z(1, 1, 7, 7), 2, 2, 2)),
    ("avgpool kernel 0", ValueError, lambda: ops.avg_pool2d(_z(1, 1, 7, 7), 0, 1)),
    ("maxpool kernel -1", ValueError, lambda: ops.max_pool2d(_z(1, 1, 7, 7), -1, 1)),
    ("avgpool stride -1", ValueError, lambda: ops.avg_pool2d(_z(1, 1, 7, 7), 2, -1)),
    ("avgpool stride 0", ValueError, lambda: ops.avg_pool2d(_z(1, 1, 7, 7), 2, 0)),
    ("maxpool stride 0", ValueError, lambda: ops.max_pool2d(_z(1, 1, 7, 7), 2, 0)),
    ("avgpool float kernel", TypeError, lambda: ops.avg_pool2d(_z(1, 1, 7, 7), 2.5)),
    ("maxpool complex", TypeError, lambda: ops.max_pool2d(_z(1, 1, 7, 7, dtype=complex), 2)),
    ("avgpool bool", TypeError, lambda: ops.avg_pool2d(_z(1, 1, 7, 7, dtype=bool), 2)),
    ("maxpool object", TypeError, lambda: ops.max_pool2d(np.empty((1, 1, 4, 4), object), 2)),
    ("avgpool_backward dy shape", ValueError, lambda: ops.avg_pool2d_backward(_z(1, 1, 7, 7), _z(1, 1, 4, 4), 2)),
    ("maxpool_backward dy shape", ValueError, lambda: ops.max_pool2d_backward(_z(1, 1, 7, 7), _z(1, 2, 3, 3), 2)),
    ("maxpool_backward dy rank", ValueError, lambda: ops.max_pool2d_backward(_z(1, 1, 7, 7), _z(1, 3, 3), 2)),
    ("avgpool_backward dy object", TypeError,
     lambda: ops.avg_pool2d_backward(_z(1, 1, 7, 7), np.empty((1, 1, 3, 3), object), 2)),
    # softmax cross-entropy
    ("xent label 10", ValueError, lambda: ops.softmax_cross_entropy(_z(2, 10), np.array([0, 10]))),
    ("xent label -1", ValueError, lambda: ops.softmax_cross_entropy(_z(2, 10), np.array([-1, 0]))),
    ("xent float labels", TypeError, lambda: ops.softmax_cross_entropy(_z(2, 10), np.array([0.0, 1.0]))),
    ("xent bool labels", TypeError, lambda: ops.softmax_cross_entropy(_z(2, 10), np.array([True, False]))),
    ("xent labels length", ValueError, lambda: ops.softmax_cross_entropy(_z(2, 10), np.array([0, 1, 2]))),
    ("xent labels rank 2", ValueError, lambda: ops.softmax_cross_entropy(_z(2, 10), np.array([[0, 1]]))),
    ("xent logits rank 1", ValueError, lambda: ops.softmax_cross_entropy(_z(10), np.array([0]))),
    ("xent logits rank 3", ValueError, lambda: ops.softmax_cross_entropy(_z(2, 10, 1), np.array([0, 1]))),
    ("xent zero classes", ValueError, lambda: ops.softmax_cross_entropy(_z(2, 0), np.array([0, 0]))),
    ("xent reduction", ValueError, lambda: ops.softmax_cross_entropy(_z(2, 10), np.array([0, 1]), "none")),
    ("xent complex logits", TypeError,
     lambda: ops.softmax_cross_entropy(_z(2, 10, dtype=complex), np.array([0, 1]))),
    # SGD
    ("sgd float64 w", TypeError, lambda: ops.sgd_update(_z(4, dtype=np.float64), _z(4), _z(4), 0.1, 0.9, 0.0)),
    ("sgd list g", TypeError, lambda: ops.sgd_update(_z(4), [0.0] * 4, _z(4), 0.1, 0.9, 0.0)),
    ("sgd non-contiguous w", TypeError, lambda: ops.sgd_update(_z(8)[::2], _z(4), _z(4), 0.1, 0.9, 0.0)),
    ("sgd read-only w", TypeError,
     lambda: ops.sgd_update(np.broadcast_to(np.float32(0), (4,)), _z(4), _z(4), 0.1, 0.9, 0.0)),
    ("sgd size mismatch g", ValueError, lambda: ops.sgd_update(_z(4), _z(5), _z(4), 0.1, 0.9, 0.0)),
    ("sgd size mismatch v", ValueError, lambda: ops.sgd_update(_z(4), _z(4), _z(3), 0.1, 0.9, 0.0)),
]


@pytest.mark.parametrize("name,exc,call", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_input_raises(name, exc, call):
    with pytest.raises(exc):
        call()


def test_bad_sgd_input_leaves_arrays_untouched():
    w, g, v = np.ones(4, np.float32), np.ones(4, np.float32), np.ones(4, np.float32)
    with pytest.raises(ValueError):
        ops.sgd_update(w, g, np.ones(3, np.float32), 0.1, 0.9, 0.0)
    np.testing.assert_array_equal(w, 1.0)
    np.testing.assert_array_equal(v, 1.0)


ZERO_CHANNEL_SCRIPT = textwrap.dedent("""
    import numpy as np
    import dpcore as dp
    x = np.zeros((2, 0, 5, 5), np.float32)
    w = np.zeros((3, 0, 3, 3), np.float32)
    b = np.array([1.0, 2.0, 3.0], np.float32)
    for call in (lambda: dp.ops.conv2d(x, w, b),
                 lambda: dp.ops.conv2d_backward(x, w, np.ones((2, 3, 3, 3), np.float32))):
        try:
            call()
            print("NOT-RAISED", flush=True)
        except ValueError as e:
            print("RAISED-OK" if "channels must be >= 1, got 0" in str(e) else "WRONG-MESSAGE", e, flush=True)
""")


def test_conv2d_zero_input_channels_does_not_crash():
    # x (N, 0, H, W) with w (O, 0, KH, KW): a ValueError naming the channels, forward and backward,
    # never a crash. Run in a child process so that a crash fails this test instead of killing the
    # session.
    r = subprocess.run([sys.executable, "-c", ZERO_CHANNEL_SCRIPT], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"conv2d with zero input channels killed the process (rc {r.returncode}): " \
                              f"{r.stdout[-500:]}{r.stderr[-500:]}"
    assert r.stdout.count("RAISED-OK") == 2 and "NOT-RAISED" not in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("call", [
    lambda big: dp.ops.dense(big, np.zeros((0, 2**31), np.float32)),
    lambda big: dp.ops.dense_backward(big, np.zeros((0, 2**31), np.float32), np.zeros((0, 0), np.float32)),
    lambda big: dp.ops.softmax_cross_entropy(big, np.zeros(0, np.int64)),
], ids=["dense", "dense_backward", "softmax_cross_entropy"])
def test_an_extent_past_int_is_refused_not_wrapped(call):
    """An empty batch of 2**31 features (no memory at all) passes NumPy; the backends take the
    feature and class counts as int, where 2**31 would wrap negative: refused by name instead
    (issue 32)."""
    with pytest.raises(ValueError, match=r"2147483648 is more than dpcore takes \(at most 2147483647\)"):
        call(np.zeros((0, 2**31), np.float32))
