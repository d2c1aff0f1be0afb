"""A float64 reference of a dpcore layer list that carries, beside every value,
a bound on how far a float32 computation of it may lie (issue 29).

The bound is a running error bound in the manner of Higham (Accuracy and
Stability of Numerical Algorithms, 2nd ed., 3.1 and 3.3): every tensor t of the
reference travels with e(t) >= 0, elementwise, such that the float32 value t^
any faithful float32 kernel computes satisfies |t^ - t| <= e(t). Each layer's
e(out) is the error of its inputs carried through it plus its own rounding:

  * a sum of n products (conv, dense, their gradients, every reduction),
    in any order and grouping (a BLAS's blocking, threads' partials, double
    accumulators: fewer roundings), rounds each term at most n times:
    gamma_n * S, S the same sum in absolute values evaluated at |t| + e(t)
    (which bounds |t^|); the inputs' errors enter linearly through |W|, exactly
    (products of two errors are kept: nothing is first order only);
  * the convolutions dpcore may run as Winograd in the default precision
    (F(2x2, 3x3) for 3x3 stride-1 pad-1, the stride-2 form for 3x3 stride-2
    pad-1) round by the transform-domain bounds of tests/test_winograd.py and
    tests/test_winograd_s2.py instead: the larger of the two bounds is taken,
    so the bound holds whichever path ran;
  * ReLU and max pooling are 1-Lipschitz forward; backward, a unit whose input
    lies within its error bound of the kink (|z| <= e(z)), or a max-pool window
    whose runner-up lies within the two errors of the maximum, may route the
    gradient either way: there the bound is |dy| + e(dy), the whole gradient;
  * BatchNorm, softmax and the loss are carried through with bounds on their
    derivatives over the whole error interval (not at the point), and each
    elementwise formula gets gamma_k of its absolute-value form, with k and
    the form chosen so that the algebraic variants kernels use are covered:
    the mean and the two-pass or one-pass variance (S of E[x^2] + mean^2),
    (x - m) s g + b or x (s g) + (b - m s g), exp and log within 2 ulp
    (CUDA's expf/logf; glibc's are within 1), 1/sqrt within 2 ulp.

gamma_n = n u / (1 - n u), u = 2^-24, is the worst case: every rounding in the
same direction. `gamma` may be swapped for Higham and Mary's probabilistic
gamma~_n(lam) = exp(lam sqrt(n) u + n u^2 / (1 - u)) - 1 (SIAM J. Sci.
Comput. 41(5), 2019, Theorem 2.4: each sum's bound holds with probability at
least 1 - 2n exp(-lam^2 (1 - u)^2 / 2) when the rounding errors are
mean-independent and zero-mean), which `prob_gamma` gives.

Usage: net = BoundNet(layers, input_shape, sources); out = net.loss_grads(P,
x, y) gives values and bounds of the logits, the loss sum, every parameter's
gradient and the running statistics; sgd_bound bounds one SGD step.
"""
import math
from collections import OrderedDict

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

U = 2.0 ** -24


def gamma(n):
    """gamma_n = n u / (1 - n u): n rounding factors (1 + d_i), |d_i| <= u, in the worst case."""
    n = np.asarray(n, np.float64)
    assert np.all(n * U < 0.01), n
    return n * U / (1 - n * U)


def prob_gamma(lam):
    """Higham and Mary's gamma~_n(lam), as a function of n."""
    def g(n):
        n = np.asarray(n, np.float64)
        return np.expm1(lam * np.sqrt(n) * U + n * U * U / (1 - U))
    return g


def prob_gamma_failure(lam, n):
    """The theorem's bound on the probability that one n-term sum exceeds gamma~_n(lam) S."""
    return 2 * n * math.exp(-lam * lam * (1 - U) ** 2 / 2)


# ---------------------------------------------------------------------------
# convolution pieces (NCHW, float64)
# ---------------------------------------------------------------------------

def conv_fwd(x, w, stride, pad):
    k = w.shape[2]
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    win = sliding_window_view(xp, (k, k), axis=(2, 3))[:, :, ::stride, ::stride]
    return np.tensordot(win, w, axes=([1, 4, 5], [1, 2, 3])).transpose(0, 3, 1, 2)


def conv_dx(x_shape, w, dy, stride, pad):
    N, C, H, W = x_shape
    k = w.shape[2]
    OH, OW = dy.shape[2:]
    dxp = np.zeros((N, C, H + 2 * pad, W + 2 * pad))
    for i in range(k):
        for j in range(k):
            dxp[:, :, i:i + stride * (OH - 1) + 1:stride, j:j + stride * (OW - 1) + 1:stride] += np.tensordot(
                dy, w[:, :, i, j], axes=([1], [0])).transpose(0, 3, 1, 2)
    return dxp[:, :, pad:pad + H, pad:pad + W]


def conv_dw(x, dy, k, stride, pad):
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    win = sliding_window_view(xp, (k, k), axis=(2, 3))[:, :, ::stride, ::stride]
    return np.tensordot(dy, win, axes=([0, 2, 3], [0, 2, 3]))


def winograd_forms(k, stride, pad):
    """The transform-domain S functions of the Winograd path dpcore may run for this convolution in
    the default precision, and their rounding counts, or None (the GEMM path only)."""
    if k != 3 or pad != 1 or stride not in (1, 2):
        return None
    if stride == 1:
        from test_winograd import flipped, winograd_abs, winograd_abs_dw
        return {"y": lambda x, w, b: winograd_abs(x, w, b),
                "dx": lambda xs, w, dy: winograd_abs(dy, flipped(w), None),
                "dw": winograd_abs_dw,
                # k of tests/test_winograd.py: C + 11, O + 11, T + 8 (T: the batch's 2x2 tiles)
                "ky": lambda C, O, T: C + 11, "kdx": lambda C, O, T: O + 11, "kdw": lambda C, O, T: T + 8,
                "tile": 2}
    from test_winograd_s2 import s2_abs, s2_abs_dx, s2_abs_dw
    return {"y": s2_abs, "dx": s2_abs_dx, "dw": s2_abs_dw,
            # k of tests/test_winograd_s2.py: C + 9, O + 11, 4 T + 6
            "ky": lambda C, O, T: C + 9, "kdx": lambda C, O, T: O + 11, "kdw": lambda C, O, T: 4 * T + 6,
            "tile": 2}


# ---------------------------------------------------------------------------
# the network
# ---------------------------------------------------------------------------

class BoundNet:
    """Float64 values and float32 error bounds of a dpcore layer list: conv2d, dense, relu,
    avgpool / maxpool (no padding for avgpool), global_avgpool, flatten, add, batchnorm; a mean
    (or scaled) softmax cross-entropy on the last layer. Parameters named as dpcore names them."""

    def __init__(self, layers, input_shape, sources=None, gam=gamma, carry="abs"):
        self.layers = [tuple(l) for l in layers]
        assert carry in ("abs", "rss")
        self.carry = carry
        srcs = list(sources) if sources is not None else [None] * len(self.layers)
        self.src = [(i - 1 if s is None else s) for i, s in enumerate(srcs)]
        self.input_shape = tuple(input_shape)
        self.gam = gam

    # -- helpers ------------------------------------------------------------
    def _lin(self, f, M, E):
        """The error E carried through the bilinear map f with coefficients M: f(|M|, E), or with
        carry='rss' the root-sum-square sqrt(f(M^2, E^2)) (errors independent across inputs)."""
        if self.carry == "abs":
            return f(np.abs(M), E)
        return np.sqrt(f(M * M, E * E))

    @staticmethod
    def _bn_args(spec):
        return (spec[1] if len(spec) > 1 else 1e-5), (spec[2] if len(spec) > 2 else 0.1)

    def _pick(self, acts, s, x):
        return x if s < 0 else acts[s]

    # -- forward --------------------------------------------------------------
    def forward(self, P, x, ex=None, training=True):
        """(logits (v, e), cache, running statistics {name: (v, e)})."""
        g = self.gam
        P = {n: np.asarray(v, np.float64) for n, v in P.items()}
        x = np.asarray(x, np.float64)
        ex = np.zeros_like(x) if ex is None else ex
        acts, cache, stats = [], {}, {}
        for i, spec in enumerate(self.layers):
            a, ea = self._pick(acts, self.src[i], (x, ex))
            kind = spec[0]
            if kind == "conv2d":
                o, k, s, p = spec[1:]
                W, b = P[f"{i}.weight"], P[f"{i}.bias"]
                A = np.abs(a) + ea
                y = conv_fwd(a, W, s, p) + b[None, :, None, None]
                S = conv_fwd(A, np.abs(W), s, p) + np.abs(b)[None, :, None, None]
                rnd = g(a.shape[1] * k * k + 1) * S
                wf = winograd_forms(k, s, p)
                if wf is not None:
                    T = len(a) * -(-y.shape[2] // wf["tile"]) * -(-y.shape[3] // wf["tile"])
                    rnd = np.maximum(rnd, g(wf["ky"](a.shape[1], o, T)) * wf["y"](A, W, b))
                e = self._lin(lambda m, t: conv_fwd(t, m, s, p), W, ea) + rnd
            elif kind == "dense":
                W, b = P[f"{i}.weight"], P[f"{i}.bias"]
                a2, ea2 = a.reshape(len(a), -1), ea.reshape(len(a), -1)
                y = (a2 @ W.T + b)[:, :, None, None]
                S = (np.abs(a2) + ea2) @ np.abs(W).T + np.abs(b)
                e = (self._lin(lambda m, t: t @ m.T, W, ea2) + g(a2.shape[1] + 1) * S)[:, :, None, None]
            elif kind == "relu":
                y, e = np.maximum(a, 0), ea
            elif kind == "flatten":
                y, e = a.reshape(len(a), -1, 1, 1), ea.reshape(len(a), -1, 1, 1)
            elif kind == "global_avgpool":
                hw = a.shape[2] * a.shape[3]
                y = a.mean(axis=(2, 3), keepdims=True)
                e = ea.mean(axis=(2, 3), keepdims=True) + g(hw + 1) * (np.abs(a) + ea).mean(axis=(2, 3), keepdims=True)
            elif kind == "avgpool":
                k, s, p = spec[1:]
                assert p == 0, "avgpool with padding: not covered"
                win = lambda t: sliding_window_view(t, (k, k), axis=(2, 3))[:, :, ::s, ::s]  # noqa: E731
                y = win(a).mean(axis=(4, 5))
                e = win(ea).mean(axis=(4, 5)) + g(k * k) * win(np.abs(a) + ea).mean(axis=(4, 5))
            elif kind == "maxpool":
                k, s, p = spec[1:]
                ap = np.pad(a, ((0, 0), (0, 0), (p, p), (p, p)), constant_values=-np.inf)
                eap = np.pad(ea, ((0, 0), (0, 0), (p, p), (p, p)))
                y = sliding_window_view(ap, (k, k), axis=(2, 3))[:, :, ::s, ::s].max(axis=(4, 5))
                e = sliding_window_view(eap, (k, k), axis=(2, 3))[:, :, ::s, ::s].max(axis=(4, 5))
            elif kind == "add":
                (p1, e1), (p2, e2) = self._pick(acts, spec[1], (x, ex)), self._pick(acts, spec[2], (x, ex))
                y = p1 + p2
                e = e1 + e2 + g(1) * (np.abs(p1) + e1 + np.abs(p2) + e2)
            elif kind == "batchnorm":
                y, e, cache[i], st = self._bn_forward(i, spec, P, a, ea, training)
                stats.update(st)
            else:
                raise ValueError(kind)
            acts.append((y, np.nan_to_num(e, nan=np.inf)))   # inf * 0 (an unbounded error, a zero weight)
        cache["acts"], cache["x"] = acts, (x, ex)
        stats = {n: (v, np.nan_to_num(e, nan=np.inf)) for n, (v, e) in stats.items()}
        y, e = acts[-1]
        return (y.reshape(len(x), -1), e.reshape(len(x), -1)), cache, stats

    def _bn_forward(self, i, spec, P, a, ea, training):
        g = self.gam
        eps, mom = self._bn_args(spec)
        ax = (0, 2, 3)
        c4 = lambda t: t[None, :, None, None]  # noqa: E731
        gm, be = P[f"{i}.weight"], P[f"{i}.bias"]
        A = np.abs(a) + ea
        M = a.size // a.shape[1]
        st = {}
        if training:
            mu = a.mean(axis=ax)
            e_mu = ea.mean(axis=ax) + g(M + 1) * A.mean(axis=ax)
            d = a - c4(mu)
            var = (d * d).mean(axis=ax)
            # carried: v(x + delta) - v(x) = 2 mean(d delta) + mean(delta^2) - mean(delta)^2;
            # rounding: S of the one-pass form (E[x^2] + mu^2) covers the two-pass one, twice for
            # the cross term of mu^'s own error; plus the square of the mean's rounding
            e_var = ((2 * np.abs(d) * ea + ea * ea).mean(axis=ax)
                     + 2 * g(M + 3) * ((A * A).mean(axis=ax) + (np.abs(mu) + e_mu) ** 2)
                     + (g(M + 1) * A.mean(axis=ax)) ** 2)
            cnt = M / (M - 1)
            if f"{i}.running_mean" not in P:    # a caller without the statistics (dp._core.Model's params)
                P = dict(P, **{f"{i}.running_mean": np.zeros_like(mu), f"{i}.running_var": np.ones_like(mu)})
            st[f"{i}.running_mean"] = ((1 - mom) * P[f"{i}.running_mean"] + mom * mu,
                                       mom * e_mu + g(5) * ((1 - mom) * np.abs(P[f"{i}.running_mean"])
                                                            + mom * (np.abs(mu) + e_mu)))
            st[f"{i}.running_var"] = ((1 - mom) * P[f"{i}.running_var"] + mom * var * cnt,
                                      mom * cnt * e_var + g(7) * ((1 - mom) * P[f"{i}.running_var"]
                                                                  + mom * cnt * (var + e_var)))
        else:
            mu, var = P[f"{i}.running_mean"], P[f"{i}.running_var"]
            e_mu, e_var = np.zeros_like(mu), np.zeros_like(var)
            d = a - c4(mu)
        ve = var + eps
        e_ve = e_var + U * eps + g(1) * (var + e_var + eps)   # eps in float32, the addition
        s = 1 / np.sqrt(ve)
        # a variance not known to within half of itself: no bound on 1/sqrt (inf, and inf downstream)
        lo = np.where(e_ve < 0.5 * ve, ve - e_ve, 0.0)
        # |d(v^-1/2)/dv| <= 0.5 lo^-1.5 over the interval; 1/sqrt (or sqrt then divide) within 2 ulp
        with np.errstate(divide="ignore"):
            e_s = 0.5 * lo ** -1.5 * e_ve + g(4) * lo ** -0.5
        ed = ea + c4(e_mu)
        xh = d * c4(s)
        cxh = np.abs(d) * c4(e_s) + c4(s) * ed + ed * c4(e_s)          # carried into xhat
        Sx = (A + c4(np.abs(mu) + e_mu)) * c4(s + e_s)                   # |x| s + |mu| s, the forms' S
        e_xh = cxh + g(3) * Sx
        y = c4(gm) * xh + c4(be)
        e = c4(np.abs(gm)) * cxh + g(6) * (c4(np.abs(gm)) * Sx + c4(np.abs(be)))
        return y, e, (xh, e_xh, s, e_s, M), st

    # -- backward -------------------------------------------------------------
    def backward(self, P, cache, dlogits, e_dlogits):
        """Gradients {name: (v, e)} of sum(dlogits * logits)."""
        g = self.gam
        P = {n: np.asarray(v, np.float64) for n, v in P.items()}
        acts = cache["acts"]
        d = [None] * len(self.layers)
        d[-1] = (dlogits.reshape(acts[-1][0].shape), e_dlogits.reshape(acts[-1][0].shape))
        G = OrderedDict()

        def give(src, dv, de):
            if src < 0:
                return
            de = np.nan_to_num(de, nan=np.inf)
            if d[src] is None:
                d[src] = (dv, de)
            else:
                ov, oe = d[src]
                d[src] = (ov + dv, oe + de + g(1) * (np.abs(ov) + oe + np.abs(dv) + de))

        for i in range(len(self.layers) - 1, -1, -1):
            if d[i] is None:
                continue
            dy, edy = d[i]
            spec, kind = self.layers[i], self.layers[i][0]
            a, ea = cache["x"] if self.src[i] < 0 else acts[self.src[i]]
            A, Dy = np.abs(a) + ea, np.abs(dy) + edy
            if kind == "conv2d":
                o, k, s, p = spec[1:]
                W = P[f"{i}.weight"]
                N, C = a.shape[:2]
                OH, OW = dy.shape[2:]
                wf = winograd_forms(k, s, p)
                T = 0 if wf is None else N * -(-OH // wf["tile"]) * -(-OW // wf["tile"])
                gw = conv_dw(a, dy, k, s, p)
                rw = g(N * OH * OW) * conv_dw(A, Dy, k, s, p)
                if wf is not None:
                    rw = np.maximum(rw, g(wf["kdw"](C, o, T)) * wf["dw"](A, Dy))
                G[f"{i}.weight"] = (gw, self._lin(lambda m, t: conv_dw(m, t, k, s, p), A, edy)
                                      + self._lin(lambda m, t: conv_dw(t, m, k, s, p), dy, ea) + rw)
                G[f"{i}.bias"] = (dy.sum(axis=(0, 2, 3)), edy.sum(axis=(0, 2, 3)) + g(N * OH * OW) * Dy.sum(axis=(0, 2, 3)))
                dx = conv_dx(a.shape, W, dy, s, p)
                rx = g(o * k * k) * conv_dx(a.shape, np.abs(W), Dy, s, p)
                if wf is not None:
                    rx = np.maximum(rx, g(wf["kdx"](C, o, T)) * wf["dx"](a.shape, W, Dy))
                edx = self._lin(lambda m, t: conv_dx(a.shape, m, t, s, p), W, edy) + rx
            elif kind == "dense":
                W = P[f"{i}.weight"]
                a2, ea2, A2 = a.reshape(len(a), -1), ea.reshape(len(a), -1), A.reshape(len(a), -1)
                dy2, edy2, Dy2 = dy.reshape(len(dy), -1), edy.reshape(len(dy), -1), Dy.reshape(len(dy), -1)
                n = len(a)
                G[f"{i}.weight"] = (dy2.T @ a2, self._lin(lambda m, t: t.T @ m, A2, edy2)
                                      + self._lin(lambda m, t: m.T @ t, dy2, ea2) + g(n) * (Dy2.T @ A2))
                G[f"{i}.bias"] = (dy2.sum(axis=0), edy2.sum(axis=0) + g(n) * Dy2.sum(axis=0))
                dx = (dy2 @ W).reshape(a.shape)
                edx = (self._lin(lambda m, t: t @ m, W, edy2) + g(W.shape[0]) * (Dy2 @ np.abs(W))).reshape(a.shape)
            elif kind == "relu":
                amb = np.abs(a) <= ea
                dx = dy * (a > 0)
                edx = np.where(amb, Dy, edy * (a > 0))
            elif kind == "flatten":
                dx, edx = dy.reshape(a.shape), edy.reshape(a.shape)
            elif kind == "global_avgpool":
                hw = a.shape[2] * a.shape[3]
                dx = np.broadcast_to(dy / hw, a.shape).copy()
                edx = np.broadcast_to((edy + g(2) * Dy) / hw, a.shape).copy()
            elif kind == "avgpool":
                k, s, _ = spec[1:]
                dx, edx = np.zeros_like(a), np.zeros_like(a)
                OH, OW = dy.shape[2:]
                for u in range(k):
                    for v in range(k):
                        sl = (slice(None), slice(None), slice(u, u + s * (OH - 1) + 1, s), slice(v, v + s * (OW - 1) + 1, s))
                        dx[sl] += dy / (k * k)
                        edx[sl] += (edy + g(2 + k * k) * Dy) / (k * k)
            elif kind == "maxpool":
                dx, edx = self._maxpool_backward(spec, a, ea, dy, edy)
            elif kind == "add":
                give(spec[1], dy, edy)
                give(spec[2], dy, edy)
                continue
            elif kind == "batchnorm":
                dx, edx = self._bn_backward(i, P, cache[i], dy, edy, G)
            else:
                raise ValueError(kind)
            give(self.src[i], dx, edx)
        return OrderedDict((n, (v, np.nan_to_num(e, nan=np.inf))) for n, (v, e) in G.items())

    def _maxpool_backward(self, spec, a, ea, dy, edy):
        g = self.gam
        k, s, p = spec[1:]
        N, C, H, W = a.shape
        OH, OW = dy.shape[2:]
        ap = np.pad(a, ((0, 0), (0, 0), (p, p), (p, p)), constant_values=-np.inf)
        eap = np.pad(ea, ((0, 0), (0, 0), (p, p), (p, p)))
        win = sliding_window_view(ap, (k, k), axis=(2, 3))[:, :, ::s, ::s].reshape(N, C, OH, OW, k * k)
        ewin = sliding_window_view(eap, (k, k), axis=(2, 3))[:, :, ::s, ::s].reshape(N, C, OH, OW, k * k)
        top = win.argmax(axis=-1)
        tv = np.take_along_axis(win, top[..., None], -1)
        te = np.take_along_axis(ewin, top[..., None], -1)
        cand = (tv - win <= te + ewin) & np.isfinite(win)                   # positions the max may be at
        sure = cand.sum(axis=-1) == 1
        Dy = np.abs(dy) + edy
        onehot = np.arange(k * k) == top[..., None]
        val = onehot * dy[..., None]
        err = np.where(sure[..., None], onehot * edy[..., None], cand * Dy[..., None])
        dxp, edxp = np.zeros(ap.shape), np.zeros(ap.shape)
        Dyp = np.zeros(ap.shape)
        for q in range(k * k):
            u, v = divmod(q, k)
            sl = (slice(None), slice(None), slice(u, u + s * (OH - 1) + 1, s), slice(v, v + s * (OW - 1) + 1, s))
            dxp[sl] += val[..., q]
            edxp[sl] += err[..., q]
            Dyp[sl] += cand[..., q] * Dy
        # the adds of overlapping windows' contributions
        edxp += g(k * k) * Dyp
        return dxp[:, :, p:p + H, p:p + W], edxp[:, :, p:p + H, p:p + W]

    def _bn_backward(self, i, P, bc, dy, edy, G):
        g = self.gam
        xh, e_xh, s, e_s, M = bc
        ax = (0, 2, 3)
        c4 = lambda t: t[None, :, None, None]  # noqa: E731
        gm = P[f"{i}.weight"]
        Dy = np.abs(dy) + edy
        Xh = np.abs(xh) + e_xh
        A = dy.sum(axis=ax)
        eA = edy.sum(axis=ax) + g(M) * Dy.sum(axis=ax)
        B = (dy * xh).sum(axis=ax)
        eB = (np.abs(dy) * e_xh + np.abs(xh) * edy + edy * e_xh).sum(axis=ax) + g(M + 1) * (Dy * Xh).sum(axis=ax)
        G[f"{i}.weight"] = (B, eB)
        G[f"{i}.bias"] = (A, eA)
        t = dy - c4(A / M) - xh * c4(B / M)
        e_t = edy + c4(eA / M) + (np.abs(xh) * c4(eB) + c4(np.abs(B)) * e_xh + e_xh * c4(eB)) / M
        T = Dy + c4((np.abs(A) + eA) / M) + Xh * c4((np.abs(B) + eB) / M)
        dx = c4(gm * s) * t
        edx = c4(np.abs(gm)) * (c4(s) * e_t + c4(e_s) * np.abs(t) + c4(e_s) * e_t) \
            + g(8) * c4(np.abs(gm) * (s + e_s)) * T
        return dx, edx

    # -- loss -----------------------------------------------------------------
    def loss_grads(self, P, x, y, scale=None, ex=None):
        with np.errstate(over="ignore", invalid="ignore"):
            return self._loss_grads(P, x, y, scale, ex)

    def _loss_grads(self, P, x, y, scale=None, ex=None):
        """Values and bounds: {'loss': (sum, e), 'logits': (v, e), 'grads': {name: (v, e)},
        'stats': {name: (v, e)}} for the gradients of scale * loss sum (default 1/N)."""
        g = self.gam
        (z, ez), cache, stats = self.forward(P, x, ex)
        N, K = z.shape
        y = np.asarray(y)
        scale = 1.0 / N if scale is None else scale
        rows = np.arange(N)
        m = z.max(axis=1, keepdims=True)
        t = z - m
        lse = m[:, 0] + np.log(np.exp(t).sum(axis=1))
        prob = np.exp(z - lse[:, None])
        D = ez.max(axis=1, keepdims=True)
        # carried: p_i(z + delta) / p_i(z) lies in [e^-2D, e^2D], D = max|delta|
        carried = prob * np.expm1(2 * D)
        # rounding at z^: z - max (u |t|), exp within 2 ulp (4u), the sum (K - 1), the division;
        # or p = exp(t - log s): u |t - log s| <= u (max|t| + log K) more
        L = np.abs(t).max(axis=1, keepdims=True) + np.log(K) + 1
        rel_p = np.expm1(2 * U * L + 8 * U) + g(K + 2)
        e_p = carried + rel_p * prob * np.exp(2 * D)
        dz = prob.copy()
        dz[rows, y] -= 1
        e_dz = abs(scale) * (e_p + g(3) * (np.abs(dz) + e_p))
        dz *= scale
        G = self.backward(P, cache, dz, e_dz)
        losses = lse - z[rows, y]
        logs = np.log(np.exp(t).sum(axis=1))
        rho = np.expm1(U * L[:, 0] + 4 * U) + g(K + 1)
        e_l = 2 * D[:, 0] + 1.01 * rho + rel_p[:, 0] + 4 * U * logs + g(2) * (np.abs(m[:, 0]) + logs + np.abs(lse)
                                                                               + np.abs(z[rows, y]))
        loss, e_loss = losses.sum(), np.nan_to_num(e_l.sum() + g(N) * (losses + e_l).sum(), nan=np.inf)
        return {"loss": (loss, e_loss), "logits": (z, ez), "grads": G, "stats": stats}

    def predict(self, P, x, ex=None):
        """Evaluation-mode logits (v, e)."""
        with np.errstate(over="ignore", invalid="ignore"):
            return self.forward(P, x, ex, training=False)[0]


def uint8_input(X):
    """What the network sees of uint8 images, x / 255 (float64), and the float32 error of forming it
    (a division, or a multiplication by fl(1/255): two roundings)."""
    x = X.astype(np.float64) / 255.0
    return x, gamma(2) * x


def sgd_bound(w0, g, e_g, lr, momentum=0.0, weight_decay=0.0, v0=None):
    """Values and bounds of one torch.optim.SGD step from float32 w0 (and velocity v0) with a
    gradient known to within e_g: v = mu v0 + g + wd w0 (v = g + wd w0 with no v0), w = w0 - lr v.
    The hyperparameters are rounded to float32 (3 more factors), each formula's operations in any
    association: gamma_k of the step in absolute values."""
    w0 = np.asarray(w0, np.float64)
    vprev = np.zeros_like(w0) if v0 is None else np.asarray(v0, np.float64)
    mu = 0.0 if v0 is None else momentum
    v = mu * vprev + g + weight_decay * w0
    Sv = mu * np.abs(vprev) + np.abs(g) + e_g + weight_decay * np.abs(w0)
    e_v = e_g + gamma(6) * Sv
    w = w0 - lr * v
    e_w = lr * e_v + gamma(4) * (np.abs(w0) + lr * (np.abs(v) + e_v))
    return (w, e_w), (v, e_v)


def excess(got, ref_e):
    """max over the elements of |got - ref| / bound (<= 1: within the bound), and the argmax's details."""
    v, e = ref_e
    got = np.asarray(got, np.float64).reshape(np.shape(v))
    with np.errstate(invalid="ignore"):
        r = np.abs(got - v) / np.maximum(e, 1e-300)
    r = np.where((np.abs(got - v) == 0) | np.isinf(e), 0.0, r)   # inf: no bound was derived there
    j = np.unravel_index(int(np.argmax(r)), r.shape) if r.size else ()
    return (float(r.max()) if r.size else 0.0), j


# ---------------------------------------------------------------------------
# a dp._core.Model against the bounds
# ---------------------------------------------------------------------------

def model_tensors(model):
    """{'<layer>.<kind>': float32 array} of a dp._core.Model's parameters and running statistics."""
    out = {}
    for flat, layout in ((model.get_params(), model.param_layout()), (model.get_state(), model.state_layout())):
        for layer, kind, off, shape in layout:
            out[f"{layer}.{kind}"] = np.array(flat[off:off + int(np.prod(shape))].reshape(shape))
    return out


def network_input(X):
    """(x, e(x)) of what the network sees: uint8 images / 255, floats as they are (exact)."""
    return uint8_input(X) if X.dtype == np.uint8 else (X.astype(np.float64), None)


def assert_within(got, ref_e, what):
    r, j = excess(got, ref_e)
    v, e = ref_e
    assert r <= 1, (f"{what}: |error| is {r:.3g}x its derived bound at {j} (got "
                    f"{np.asarray(got, np.float64).reshape(np.shape(v))[j]!r}, float64 {v[j]!r}, bound {e[j]:.3g})")
    return r


def check_forward_backward(model, layers, shape, X, y, sources=None, what=""):
    """One forward_backward (gradients of the mean loss) and a predict of `model` (any device) within
    BoundNet's bounds from the model's own parameters: the loss, every gradient, the running statistics
    and the evaluation-mode logits. Returns the largest |error| / bound seen."""
    P = model_tensors(model)
    x, ex = network_input(X)
    n = len(X)
    ref = BoundNet(layers, shape, sources)
    out = ref.loss_grads(P, x, y, scale=1.0 / n, ex=ex)
    loss, _ = model.forward_backward(X, np.asarray(y, np.int64), 1.0 / n)
    worst = [assert_within(loss, out["loss"], f"{what} loss")]
    flat = model.get_grads()
    for layer, kind, off, shp in model.param_layout():
        name = f"{layer}.{kind}"
        worst.append(assert_within(flat[off:off + int(np.prod(shp))], out["grads"][name], f"{what} gradient {name}"))
    after = model_tensors(model)
    for name, ve in out["stats"].items():
        worst.append(assert_within(after[name], ve, f"{what} {name}"))
    worst.append(assert_within(model.predict(X), ref.predict(after, x, ex), f"{what} predict"))
    return max(worst)


def check_sgd_step(model, layers, shape, X, y, lr, momentum, weight_decay, what=""):
    """One train_step of `model` from its own state within the bound of the gradient (BoundNet) carried
    through torch.optim.SGD's rule (sgd_bound): the parameters and the velocity after the step."""
    P = model_tensors(model)
    v0 = model.get_velocity().astype(np.float64)
    x, ex = network_input(X)
    out = BoundNet(layers, shape).loss_grads(P, x, y, scale=1.0 / len(X), ex=ex)
    model.train_step(X, np.asarray(y, np.int64), lr=lr, momentum=momentum, weight_decay=weight_decay)
    w1, v1 = model.get_params(), model.get_velocity()
    worst = []
    for layer, kind, off, shp in model.param_layout():
        name, sl = f"{layer}.{kind}", slice(off, off + int(np.prod(shp)))
        g, e_g = out["grads"][name]
        (w, e_w), (v, e_v) = sgd_bound(P[name], g, e_g, lr, momentum, weight_decay, v0[sl].reshape(shp))
        worst.append(assert_within(w1[sl], (w, e_w), f"{what} weights {name}"))
        worst.append(assert_within(v1[sl], (v, e_v), f"{what} velocity {name}"))
    return max(worst)
