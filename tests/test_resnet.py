"""BatchNorm, residual graphs and ResNet-18 (Dive into Deep Learning 12.6).

1. BatchNorm forward/backward in small dpcore networks (BatchNorm on the input,
   after strided convolutions, after a dense layer; a residual block with a
   strided 1x1 shortcut) against a float64 NumPy reference of the same network,
   in training mode (loss, every gradient, running statistics) and evaluation
   mode (predict with the running statistics); odd sizes, batch 2.  The
   reference's backward is checked against float64 central differences, and
   dpcore's gradients against finite differences of dpcore's own loss.
2. ResNet-18 with synchronized BatchNorm on 2 and 3 logical CPU devices equals
   one replica over three SGD steps.
3. Per-replica BatchNorm on 2 replicas: each shard normalised by its own
   statistics, the all-reduced gradient and the averaged running statistics equal
   the NumPy per-shard computation.
4. Running statistics are bitwise identical on every replica, in both modes,
   with uneven and empty shards; empty shards do not drag the averages; after
   each step they are those of the float64 reference from the model's own
   state before that step (one step's error, never several steps' carried).
5. (slow) ResNet-18 learns a 2,000-image Fashion-MNIST subset.
6. save / dp.models.load of ResNet-18 keeps the running statistics.

Tolerances (dpcore computes in float32, the references in float64):
  * NumPy reference vs float64 central differences (h = 1e-6): 1e-6 of the
    tensor's max |gradient| (observed <= 4e-9).
  * dpcore vs the NumPy reference, per tensor, rel = max|a - ref| / max|ref|:
    gradients GRAD_TOL = 5e-5, loss LOSS_TOL = 1e-5, logits (training or
    evaluation) LOGIT_TOL = 1e-5, running statistics STAT_TOL = 1e-5.  float32
    carries 6e-8 per operation; these networks sum at most a few hundred terms
    and BatchNorm's backward cancels (dy - mean(dy) - xhat mean(dy xhat)), which
    costs up to ~100x on a channel whose gradient nearly cancels.  Observed:
    gradients <= 1.3e-6, losses <= 9e-8, logits <= 1.2e-7, statistics <= 9e-8.
    These tolerances are statistical, as test_lenet's (its docstring says why):
    tests/test_error_bounds.py holds the same networks to the derived worst-case
    bound of tests/error_bounds.py elementwise, which is informative here except
    in 'residual' past its fourth BatchNorm (the worst case grows ~5-10x a
    convolution + BatchNorm layer, and is unbounded there).
    The biases of convolutions followed by BatchNorm have an exact gradient of
    0: theirs is compared as max|a - ref| / max|gradient of the layer's weight|.
    Every ReLU input of the reference is at least 1e-3 x its layer's max |z|
    from 0 (asserted), so float32 rounding (~1e-6 relative) cannot flip a
    unit: the comparison is not at the mercy of a kink.
  * dpcore gradients vs finite differences of dpcore's float32 loss along a
    random unit direction per tensor, h = 1e-3: |fd - g.v| <= 2e-2 ||g|| + 5e-4
    (the float32 loss is only known to ~1e-7 relative, i.e. ~1e-7 / 2h = 5e-5 in
    fd for a loss ~1, plus O(h^2) curvature; the absolute term covers the biases
    whose exact gradient is 0; observed <= 1.6e-3 ||g||, 6e-5 absolute).
  * sync BatchNorm on k replicas vs one replica: one forward/backward at three
    points of a training trajectory (the same weights each time, so differences
    never compound), within twice test_fixtures' float64-referenced ResNet-18
    bounds (triangle inequality): loss and running statistics 2e-5; gradients
    by relative L2 of the whole and of each layer (2 x 0.06) and of the norm
    (2 x 1e-3), measures that stay sound when float32 rounding flips a ReLU
    unit whose input is within rounding of 0 (a per-tensor max bound does not:
    one flipped unit moved a few entries by ~2% of their layer's largest
    gradient on one machine's BLAS kernels and not on another's).  Three SGD
    steps compared end to end are not a sound test either: one-ulp
    perturbations of the weights part two float32 runs by ~2% of the largest
    update after three steps (measured). The fixture's bounds this doubles are
    3x float32 PyTorch's worst over 8 summation orders, an estimate rather than
    a derived bound (test_fixtures' docstring), so the derived check of
    synchronized BatchNorm is test_sync_batchnorm_matches_numpy: the small
    networks on 2 replicas against the float64 reference of the whole batch,
    with every ReLU input RELU_MARGIN from 0.
  * running statistics after each of several steps (part 4): against the
    float64 reference from the model's own state before that step, never
    against a second model trained alongside (whose weights drift from the
    first's by the earlier steps' rounding carried through their gradients).
  * replicas of one model: BITWISE identical parameters and running statistics.
  * save/load: BITWISE identical weights and logits.
"""
import os
import time
import warnings
from collections import OrderedDict

import numpy as np
import pytest
from numpy.lib.stride_tricks import sliding_window_view

import dpcore as dp
from test_fixtures import TOLS as FIXTURE_TOLS

CORES = dp._core.runtime_info()["cpu_cores"]
DATA = "/usr/share/datasets/fashion-mnist"

GRAD_TOL = 5e-5
LOSS_TOL = 1e-5
LOGIT_TOL = 1e-5
STAT_TOL = 1e-5
FD_REF_TOL = 1e-6
FD_DP_REL, FD_DP_ABS = 2e-2, 5e-4
RELU_MARGIN = 1e-3


@pytest.fixture(autouse=True)
def one_device():
    """set_logical_devices is module-global: every test starts and ends with one CPU device."""
    dp.set_logical_devices("cpu", 1)
    yield
    dp.set_logical_devices("cpu", 1)


def use_devices(k):
    """k logical CPU devices (the oversubscription warning is expected when k > cores)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        dp.set_logical_devices("cpu", k)
    return [f"cpu:{i}" for i in range(k)]


def rel(a, ref):
    """max|a - ref| / max|ref|."""
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    assert a.shape == ref.shape, (a.shape, ref.shape)
    return float(np.abs(a - ref).max() / np.abs(ref).max())


def grad_rel(a, G, n):
    """rel(a, G[n]); for a parameter whose exact gradient is 0 (the bias of a layer followed by
    BatchNorm: max|G[n]| <= 1e-10 max|G[weight]|), max|a - ref| / max|gradient of the layer's weight|."""
    ref = np.asarray(G[n], np.float64)
    if n.endswith(".bias"):
        w = np.abs(G[n[:-5] + ".weight"]).max()
        if np.abs(ref).max() <= 1e-10 * w:
            return float(np.abs(np.asarray(a, np.float64) - ref).max() / w)
    return rel(a, ref)


def bits(a):
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


# ---------------------------------------------------------------------------
# a float64 NumPy reference of dpcore's Sequential graphs
# ---------------------------------------------------------------------------

class RefNet:
    """Float64 forward/backward of a dpcore layer list (conv2d, batchnorm, relu,
    add, global_avgpool, flatten, dense), parameters named like dpcore's default
    names ('<layer>.weight', '<layer>.bias', '<layer>.running_mean', ...).
    Activations are (N, C, H, W); flatten gives (N, F, 1, 1)."""

    def __init__(self, layers, input_shape, sources=None):
        self.layers = [tuple(l) for l in layers]
        self.sources = list(sources) if sources is not None else [None] * len(self.layers)
        self.src = [(i - 1 if s is None else s) for i, s in enumerate(self.sources)]
        shapes = []
        for i, spec in enumerate(self.layers):
            c, h, w = input_shape if self.src[i] < 0 else shapes[self.src[i]]
            kind = spec[0]
            if kind == "conv2d":
                o, k, s, p = spec[1:]
                shapes.append((o, (h + 2 * p - k) // s + 1, (w + 2 * p - k) // s + 1))
            elif kind == "dense":
                shapes.append((spec[1], 1, 1))
            elif kind == "flatten":
                shapes.append((c * h * w, 1, 1))
            elif kind == "global_avgpool":
                shapes.append((c, 1, 1))
            else:
                shapes.append((c, h, w))
        self.shapes = shapes
        self.input_shape = tuple(input_shape)

    def in_shape(self, i):
        return self.input_shape if self.src[i] < 0 else self.shapes[self.src[i]]

    def random_weights(self, seed):
        """float32 weights: conv/dense U(+-1.5/sqrt(fan_in)), BatchNorm gamma 1 + 0.2 N,
        beta 0.2 N, running mean 0.3 N, running var U(0.5, 2)."""
        rng = np.random.default_rng(seed)
        W = OrderedDict()
        for i, spec in enumerate(self.layers):
            c = self.in_shape(i)[0]
            if spec[0] == "conv2d":
                o, k = spec[1], spec[2]
                b = 1.5 / np.sqrt(c * k * k)
                W[f"{i}.weight"] = rng.uniform(-b, b, (o, c, k, k))
                W[f"{i}.bias"] = rng.uniform(-b, b, o)
            elif spec[0] == "dense":
                fan = int(np.prod(self.in_shape(i)))
                b = 1.5 / np.sqrt(fan)
                W[f"{i}.weight"] = rng.uniform(-b, b, (spec[1], fan))
                W[f"{i}.bias"] = rng.uniform(-b, b, spec[1])
            elif spec[0] == "batchnorm":
                W[f"{i}.weight"] = 1 + 0.2 * rng.standard_normal(c)
                W[f"{i}.bias"] = 0.2 * rng.standard_normal(c)
                W[f"{i}.running_mean"] = 0.3 * rng.standard_normal(c)
                W[f"{i}.running_var"] = rng.uniform(0.5, 2.0, c)
        return OrderedDict((n, v.astype(np.float32)) for n, v in W.items())

    @staticmethod
    def bn_args(spec):
        eps = spec[1] if len(spec) > 1 else 1e-5
        momentum = spec[2] if len(spec) > 2 else 0.1
        return eps, momentum

    def forward(self, P, x, training=True):
        """Logits (N, K), the cache, and the running statistics after this forward."""
        P = {n: np.asarray(v, np.float64) for n, v in P.items()}
        acts, cache, stats = [], {}, {}
        for i, spec in enumerate(self.layers):
            a = x if self.src[i] < 0 else acts[self.src[i]]
            kind = spec[0]
            if kind == "conv2d":
                o, k, s, p = spec[1:]
                ap = np.pad(a, ((0, 0), (0, 0), (p, p), (p, p)))
                win = sliding_window_view(ap, (k, k), axis=(2, 3))[:, :, ::s, ::s]
                y = np.tensordot(win, P[f"{i}.weight"], axes=([1, 4, 5], [1, 2, 3])).transpose(0, 3, 1, 2)
                y = y + P[f"{i}.bias"][None, :, None, None]
                cache[i] = (ap, win)
            elif kind == "dense":
                y = (a.reshape(len(a), -1) @ P[f"{i}.weight"].T + P[f"{i}.bias"])[:, :, None, None]
            elif kind == "relu":
                y = np.maximum(a, 0)
                cache[i] = a
            elif kind == "flatten":
                y = a.reshape(len(a), -1, 1, 1)
            elif kind == "global_avgpool":
                y = a.mean(axis=(2, 3), keepdims=True)
            elif kind == "add":
                y = (x if spec[1] < 0 else acts[spec[1]]) + (x if spec[2] < 0 else acts[spec[2]])
            elif kind == "batchnorm":
                eps, mom = self.bn_args(spec)
                g, b = P[f"{i}.weight"][None, :, None, None], P[f"{i}.bias"][None, :, None, None]
                if training:
                    m = a.mean(axis=(0, 2, 3))
                    v = ((a - m[None, :, None, None]) ** 2).mean(axis=(0, 2, 3))
                    cnt = a.size // a.shape[1]
                    stats[f"{i}.running_mean"] = (1 - mom) * P[f"{i}.running_mean"] + mom * m
                    stats[f"{i}.running_var"] = (1 - mom) * P[f"{i}.running_var"] + mom * v * cnt / (cnt - 1)
                else:
                    m, v = P[f"{i}.running_mean"], P[f"{i}.running_var"]
                invstd = 1 / np.sqrt(v + eps)
                xhat = (a - m[None, :, None, None]) * invstd[None, :, None, None]
                y = g * xhat + b
                cache[i] = (xhat, invstd)
            else:
                raise ValueError(kind)
            acts.append(y)
        cache["acts"] = acts
        cache["x"] = x
        return acts[-1].reshape(len(x), -1), cache, stats

    def backward(self, P, cache, dlogits):
        """Gradients of sum(dlogits * logits) (dlogits (N, K)) with respect to the parameters."""
        P = {n: np.asarray(v, np.float64) for n, v in P.items()}
        acts = cache["acts"]
        d = [None] * len(self.layers)
        d[-1] = dlogits.reshape(acts[-1].shape)
        G = {}

        def give(src, g):
            if src >= 0:
                d[src] = g if d[src] is None else d[src] + g

        for i in range(len(self.layers) - 1, -1, -1):
            dy, spec = d[i], self.layers[i]
            if dy is None:
                continue
            kind = spec[0]
            a = cache["x"] if self.src[i] < 0 else acts[self.src[i]]
            if kind == "conv2d":
                o, k, s, p = spec[1:]
                ap, win = cache[i]
                G[f"{i}.weight"] = np.tensordot(dy, win, axes=([0, 2, 3], [0, 2, 3]))
                G[f"{i}.bias"] = dy.sum(axis=(0, 2, 3))
                dap = np.zeros_like(ap)
                OH, OW = dy.shape[2:]
                w = P[f"{i}.weight"]
                for u in range(k):
                    for v in range(k):
                        dap[:, :, u:u + s * (OH - 1) + 1:s, v:v + s * (OW - 1) + 1:s] += np.tensordot(
                            dy, w[:, :, u, v], axes=([1], [0])).transpose(0, 3, 1, 2)
                dx = dap[:, :, p:p + a.shape[2], p:p + a.shape[3]]
            elif kind == "dense":
                a2 = a.reshape(len(a), -1)
                dy2 = dy.reshape(len(dy), -1)
                G[f"{i}.weight"] = dy2.T @ a2
                G[f"{i}.bias"] = dy2.sum(axis=0)
                dx = (dy2 @ P[f"{i}.weight"]).reshape(a.shape)
            elif kind == "relu":
                dx = dy * (cache[i] > 0)
            elif kind == "flatten":
                dx = dy.reshape(a.shape)
            elif kind == "global_avgpool":
                dx = np.broadcast_to(dy / (a.shape[2] * a.shape[3]), a.shape).copy()
            elif kind == "add":
                give(spec[1], dy)
                give(spec[2], dy)
                continue
            elif kind == "batchnorm":
                xhat, invstd = cache[i]
                G[f"{i}.weight"] = (dy * xhat).sum(axis=(0, 2, 3))
                G[f"{i}.bias"] = dy.sum(axis=(0, 2, 3))
                g = P[f"{i}.weight"][None, :, None, None]
                mdy = dy.mean(axis=(0, 2, 3), keepdims=True)
                mdyx = (dy * xhat).mean(axis=(0, 2, 3), keepdims=True)
                dx = g * invstd[None, :, None, None] * (dy - mdy - xhat * mdyx)
            give(self.src[i], dx)
        return G

    def relu_margin(self, cache):
        """min over ReLU layers of min|z| / max|z| (how far the nearest unit is from its kink)."""
        return min(np.abs(cache[i]).min() / np.abs(cache[i]).max()
                   for i, s in enumerate(self.layers) if s[0] == "relu")

    def loss_grads(self, P, x, y, scale=None):
        """(loss sum, grads of scale * loss sum (default 1/N), logits, running stats, cache)."""
        logits, cache, stats = self.forward(P, x)
        m = logits.max(axis=1, keepdims=True)
        lse = m[:, 0] + np.log(np.exp(logits - m).sum(axis=1))
        losses = lse - logits[np.arange(len(y)), y]
        prob = np.exp(logits - lse[:, None])
        prob[np.arange(len(y)), y] -= 1
        G = self.backward(P, cache, prob * (1 / len(y) if scale is None else scale))
        return losses.sum(), G, logits, stats, cache


def dp_grads(net, model=None):
    """A replica's gradient buffer sliced into name -> array."""
    flat = (model or net._model).get_grads()
    return {name: flat[off:off + int(np.prod(shape))].reshape(shape)
            for name, buffer, off, shape in net._entries() if buffer == "params"}


def param_names(W):
    return [n for n in W if not n.endswith(("running_mean", "running_var"))]


def stat_names(W):
    return [n for n in W if n.endswith(("running_mean", "running_var"))]


# the small networks of part 1
NETS = {
    # BatchNorm straight on a 3x5x7 input (odd sizes), pooled, dense
    "bn_input": ([("batchnorm",), ("global_avgpool",), ("flatten",), ("dense", 3)], (3, 5, 7), None),
    # two strided/padded convolutions, each followed by BatchNorm + ReLU (different channel counts)
    "conv_bn": ([("conv2d", 4, 3, 2, 1), ("batchnorm",), ("relu",), ("conv2d", 5, 3, 1, 1), ("batchnorm", 1e-3, 0.3),
                 ("relu",), ("global_avgpool",), ("flatten",), ("dense", 3)], (2, 7, 5), None),
    # BatchNorm on a dense layer's output (H = W = 1: BatchNorm1d)
    "dense_bn": ([("flatten",), ("dense", 6), ("batchnorm",), ("relu",), ("dense", 4)], (1, 3, 3), None),
    # a stem and two residual blocks as in ResNet: the first with a strided 1x1 shortcut
    "residual": ([("conv2d", 4, 3, 1, 1), ("batchnorm",), ("relu",),                                  # 0-2
                  ("conv2d", 6, 3, 2, 1), ("batchnorm",), ("relu",), ("conv2d", 6, 3, 1, 1), ("batchnorm",),  # 3-7
                  ("conv2d", 6, 1, 2, 0), ("add", 7, 8), ("relu",),                                  # 8-10
                  ("conv2d", 6, 3, 1, 1), ("batchnorm",), ("relu",), ("conv2d", 6, 3, 1, 1), ("batchnorm",),  # 11-15
                  ("add", 15, 10), ("relu",), ("global_avgpool",), ("flatten",), ("dense", 3)],       # 16-20
                 (3, 6, 5), [None, None, None, None, None, None, None, None, 2, None, None,
                             None, None, None, None, None, None, None, None, None, None]),
    # adds as a graph may hold them (model.c reads an add's gradient in place in its sources): x + x,
    # an add of an add and the model input, a layer read by two adds and a convolution, a chain of adds
    "add_graph": ([("conv2d", 2, 3, 1, 1), ("add", 0, 0), ("add", 1, -1), ("batchnorm",),          # 0-3
                   ("conv2d", 2, 3, 1, 1), ("add", 4, 2), ("add", 5, 5), ("conv2d", 3, 1, 1, 0),  # 4-7
                   ("global_avgpool",), ("flatten",), ("dense", 3)], (2, 5, 6), None),             # 8-10
}
# (net, batch, weight seed): batch 2 (the smallest BatchNorm batch with H, W > 1) and odd batches
# (the seeds are ones whose ReLU inputs all keep RELU_MARGIN from 0, see RELU_MARGIN)
CASES = [("bn_input", 2, 1), ("bn_input", 5, 2), ("conv_bn", 2, 13), ("conv_bn", 3, 24), ("dense_bn", 5, 5),
         ("dense_bn", 3, 6), ("residual", 2, 57), ("residual", 3, 278), ("add_graph", 2, 3), ("add_graph", 3, 4)]
# weight seeds of the finite-difference check of the reference (data seed + 1), ReLU inputs >= 1e-3 x max from 0
FD_SEEDS = {"bn_input": 11, "conv_bn": 18, "dense_bn": 11, "residual": 52, "add_graph": 7}


def build(name, seed, devices=None, sync_batchnorm=False):
    layers, shape, sources = NETS[name]
    ref = RefNet(layers, shape, sources)
    net = dp.models.Sequential(layers, input_shape=shape, sources=sources, devices=devices,
                               sync_batchnorm=sync_batchnorm)
    W = ref.random_weights(seed)
    assert list(net.get_weights()) == list(W)
    net.set_weights(W)
    return ref, net, W


def data(shape, n, seed, classes):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n,) + tuple(shape)).astype(np.float32) * 1.5 + 0.3, rng.integers(0, classes, n)


# ---------------------------------------------------------------------------
# 1. BatchNorm against float64 NumPy and finite differences
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(NETS))
def test_reference_backward_matches_finite_differences(name):
    ref = RefNet(*NETS[name])
    P = {n: v.astype(np.float64) for n, v in ref.random_weights(FD_SEEDS[name]).items()}
    X, y = data(ref.input_shape, 3, FD_SEEDS[name] + 1, ref.shapes[-1][0])
    x = X.astype(np.float64)
    _, G, _, _, cache = ref.loss_grads(P, x, y)
    if any(s[0] == "relu" for s in ref.layers):
        assert ref.relu_margin(cache) > 1e-3  # h = 1e-6 moves no ReLU input across 0
    rng = np.random.default_rng(0)
    h = 1e-6

    def mean_loss(Q):
        return ref.loss_grads(Q, x, y)[0] / len(y)

    for n in param_names(P):
        worst = 0.0
        for j in rng.choice(P[n].size, min(6, P[n].size), replace=False):
            plus, minus = P[n].copy(), P[n].copy()
            plus.flat[j] += h
            minus.flat[j] -= h
            fd = (mean_loss({**P, n: plus}) - mean_loss({**P, n: minus})) / (2 * h)
            worst = max(worst, abs(fd - G[n].flat[j]))
        scale = max(np.abs(G[n]).max(), np.abs(G[n[:-5] + ".weight"]).max() if n.endswith(".bias") else 0)
        assert worst <= FD_REF_TOL * scale, (name, n, worst, scale)


@pytest.mark.parametrize("name,batch,seed", CASES)
def test_batchnorm_training_matches_numpy(name, batch, seed):
    ref, net, W = build(name, seed)
    X, y = data(ref.input_shape, batch, 100 + seed, ref.shapes[-1][0])
    loss_ref, G, logits, stats, cache = ref.loss_grads(W, X.astype(np.float64), y)
    if any(s[0] == "relu" for s in ref.layers):
        assert ref.relu_margin(cache) > RELU_MARGIN, "a ReLU input is too close to 0 for a float32 comparison"
    loss_sum, correct = net._model.forward_backward(X, y, 1 / batch)
    assert abs(loss_sum - loss_ref) <= LOSS_TOL * loss_ref, (loss_sum, loss_ref)
    assert correct == int((logits.argmax(axis=1) == y).sum())
    got = dp_grads(net)
    assert set(got) == set(G)
    for n in G:
        e = grad_rel(got[n], G, n)
        assert e <= GRAD_TOL, f"{name} batch {batch}: gradient {n} rel {e:.3g}"
    Wd = net.get_weights()
    for n in stat_names(W):
        e = rel(Wd[n], stats[n])
        assert e <= STAT_TOL, f"{name} batch {batch}: {n} rel {e:.3g}"
    for n in param_names(W):
        assert np.array_equal(Wd[n], W[n])  # forward_backward takes no step


@pytest.mark.parametrize("n,shape", [(37, (8, 15, 15)), (64, (32, 7, 7)), (5, (3, 4, 4)), (1, (4, 6, 6))])
def test_batchnorm_sums_do_not_depend_on_the_thread_count(n, shape):
    """The CPU BatchNorm's sums (forward: the mean and the squared deviations;
    backward: dy and dy * xhat, here with the ReLU fused) add fixed groups of
    samples in group order, whatever the threads: the same bits on 1, 2 and 3
    threads, batches above the parallel threshold, smaller than the groups
    and of one sample (statistics over its plane)."""
    rng = np.random.default_rng(n)
    X = (rng.standard_normal((n,) + shape) * 3 + 1).astype(np.float32)
    dy = rng.standard_normal((n,) + shape).astype(np.float32)
    params = None  # gamma and beta (and the layout's padding), the same for every model
    runs = []
    for threads in (1, 2, 3):
        out = []
        for layers in ([("batchnorm",)], [("batchnorm",), ("relu",)]):
            m = dp._core.Model(shape, layers, threads=threads, headless=True, input_grad=True)
            if params is None:
                params = rng.uniform(0.5, 1.5, m.nparams).astype(np.float32)
            m.set_params(params)
            y = m.stage_forward(0, X, training=True)[0]
            dx = m.stage_backward(0, n, dy, input_grad=True)
            out += [y, dx, m.get_grads(), m.get_state()]
        runs.append(out)
    assert np.isfinite(runs[0][1]).all() and np.abs(runs[0][1]).max() > 0
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name,batch,seed", CASES)
def test_batchnorm_evaluation_uses_running_statistics(name, batch, seed):
    ref, net, W = build(name, seed)
    X, _ = data(ref.input_shape, batch, 200 + seed, ref.shapes[-1][0])
    logits = net.predict(X)
    want, _, _ = ref.forward(W, X.astype(np.float64), training=False)
    assert rel(logits, want) <= LOGIT_TOL, rel(logits, want)
    # evaluation does not touch the running statistics; a single image is fine (no batch statistics)
    assert all(np.array_equal(v, W[n]) for n, v in net.get_weights().items())
    one = net.predict(X[:1])
    assert rel(one, want[:1]) <= LOGIT_TOL
    # and it differs from training-mode normalisation (the check is not vacuous)
    train_logits, _, _ = ref.forward(W, X.astype(np.float64), training=True)
    assert rel(train_logits, want) > 100 * LOGIT_TOL
    # after training steps, evaluation uses the updated statistics
    y = np.arange(batch) % ref.shapes[-1][0]
    net.train_step(X, y, lr=0.0)
    W1 = net.get_weights()
    assert not np.array_equal(W1[stat_names(W)[0]], W[stat_names(W)[0]])
    want1, _, _ = ref.forward(W1, X.astype(np.float64), training=False)
    assert rel(net.predict(X), want1) <= LOGIT_TOL


@pytest.mark.parametrize("name", ["conv_bn", "residual"])
def test_gradients_match_finite_differences_of_dpcore_loss(name):
    ref, net, W = build(name, 21)
    X, y = data(ref.input_shape, 4, 22, ref.shapes[-1][0])
    net._model.forward_backward(X, y, 1 / 4)
    G = dp_grads(net)
    rng = np.random.default_rng(23)
    h = 1e-3

    def loss(Wx):
        net.set_weights(Wx)
        return net._model.forward_backward(X, y, 1 / 4)[0] / 4

    for n in param_names(W):
        v = rng.standard_normal(W[n].shape)
        v /= np.linalg.norm(v)
        lp = loss({**W, n: (W[n] + h * v).astype(np.float32)})
        lm = loss({**W, n: (W[n] - h * v).astype(np.float32)})
        # the float32 perturbation actually applied
        dp_, dm = (W[n] + h * v).astype(np.float32) - W[n], W[n] - (W[n] - h * v).astype(np.float32)
        fd = (lp - lm) / (h * 2)
        gv = float(np.sum(G[n] * (dp_ + dm) / 2) / h)
        assert abs(fd - gv) <= FD_DP_REL * np.linalg.norm(G[n]) + FD_DP_ABS, (name, n, fd, gv)


def test_batchnorm_needs_two_values_per_channel():
    # BatchNorm after a dense layer with one sample: one value per channel has no variance
    net = dp.models.Sequential(NETS["dense_bn"][0], input_shape=(1, 3, 3))
    X, y = data((1, 3, 3), 1, 0, 4)
    W = net.get_weights()
    with pytest.raises(ValueError, match="more than one value per channel"):
        net.train_step(X, y, lr=0.1)
    # nothing moved, and evaluation of one sample works
    assert all(np.array_equal(v, W[n]) for n, v in net.get_weights().items())
    assert net.predict(X).shape == (1, 4)


# ---------------------------------------------------------------------------
# 2. ResNet-18: synchronized BatchNorm on k devices equals one replica
# ---------------------------------------------------------------------------

def fashion_subset(n, offset=0):
    """n Fashion-MNIST training images (uint8, (n, 1, 28, 28)) and labels."""
    train_X, train_y, _, _ = dp.data._load_fashion_mnist_arrays(None)
    return np.array(train_X[offset:offset + n]), np.array(train_y[offset:offset + n])


def resnet_weights(seed, input_size=16):
    """A ResNet-18's weights with non-trivial BatchNorm parameters and running statistics."""
    W = dp.models.ResNet18(seed=seed, input_size=input_size, devices=["cpu:0"]).get_weights()
    rng = np.random.default_rng(seed)
    for n in W:
        if n.endswith("running_var"):
            W[n] = rng.uniform(0.5, 1.5, W[n].shape).astype(np.float32)
        elif n.endswith("running_mean"):
            W[n] = (0.1 * rng.standard_normal(W[n].shape)).astype(np.float32)
    return W


def resnet_gradient(net, W, X, y):
    """(loss_sum, hits), the mean-loss gradient per tensor and the running statistics after one
    training-mode forward/backward of `net` (one replica or mirrored) from the weights W."""
    net.set_weights(W)
    if net._mirrored is not None:
        result = net._mirrored.forward_backward(X, y)
        flat = net._replicas[0].get_grads()
        assert all(np.array_equal(r.get_grads(), flat) for r in net._replicas), "replicas' gradients differ"
    else:
        result = net._model.forward_backward(X, y, 1.0 / len(y))
        flat = net._model.get_grads()
    grads = OrderedDict((n, flat[o:o + int(np.prod(shape))].reshape(shape).astype(np.float64))
                        for n, (_, _, o, shape) in zip(net.parameter_names(), net._layout))
    stats = {n: w.astype(np.float64) for n, w in net.get_weights().items() if n.endswith(("running_mean", "running_var"))}
    return result, grads, stats


@pytest.mark.parametrize("k", [2, 3])
def test_resnet18_sync_batchnorm_equals_one_replica(k):
    """Synchronized BatchNorm on k replicas computes one replica's gradient and statistics, at
    three points of one replica's training trajectory (from the same weights each time, so
    differences never compound). Both are float32 computations of the same function, each
    within the bounds test_fixtures sets against PyTorch's float64 ResNet-18 (derived there
    from float32 PyTorch's own worst error over 8 summation orders), so by the triangle
    inequality they differ by at most twice those bounds: forward quantities (loss, running
    statistics) within 2 x 1e-5; the gradient, whose float32 error is dominated by ReLU units
    whose input lies within rounding of 0 (a unit one side flips moves every gradient upstream
    of it), by the fixture's flip-tolerant measures: relative L2 error of the whole gradient
    and of each layer's gradient <= 2 x 'l2', of its norm <= 2 x 'norm'. A max-norm bound per
    tensor is not sound here: a single flipped unit (seen at one of these points on one
    machine's BLAS kernels and not on another's) moves a few entries by ~2% of their layer's
    largest gradient. What the bounds still catch: statistics of one shard instead of the
    batch (tens of percent), a mean over the wrong count, a replica left out."""
    size, lr, mu, wd = 16, 0.05, 0.9, 1e-4
    grad_tol = {m: 2 * t for m, t in FIXTURE_TOLS["resnet18"]["grad"].items()}
    forward_tol = 2 * FIXTURE_TOLS["resnet18"]["loss"]["max"]
    X, y = fashion_subset(6, offset=1000)
    X = X[:, :, 6:22, 6:22].copy()  # the 16x16 centre: ResNet18(input_size=16), stage 4 at 2x2
    single = dp.models.ResNet18(input_size=size, devices=["cpu:0"])
    trajectory = dp.models.ResNet18(input_size=size, devices=["cpu:0"])
    trajectory.set_weights(resnet_weights(5, size))
    mirrored = dp.models.ResNet18(input_size=size, devices=use_devices(k), sync_batchnorm=True)
    worst = {}
    for point in range(3):
        W = trajectory.get_weights()
        (ls, cs), gs, ss = resnet_gradient(single, W, X, y)
        (lm, cm), gm, sm = resnet_gradient(mirrored, W, X, y)
        assert abs(cm - cs) <= 1, (point, cm, cs)  # a flipped unit may move one argmax
        assert abs(lm - ls) <= forward_tol * abs(ls), (point, lm, ls)
        for n in ss:
            e = rel(sm[n], ss[n])
            worst["statistics"] = max(worst.get("statistics", 0.0), e)
            assert e <= forward_tol, f"k={k} point {point}: {n} rel {e:.3g}"
        flat_m, flat_s = (np.concatenate([g[n].ravel() for n in gs]) for g in (gm, gs))
        norm = float(np.linalg.norm(flat_s))
        e = float(np.linalg.norm(flat_m - flat_s)) / norm
        worst["gradient l2"] = max(worst.get("gradient l2", 0.0), e)
        assert e <= grad_tol["l2"], f"k={k} point {point}: gradient rel L2 {e:.3g}"
        assert abs(np.linalg.norm(flat_m) - norm) <= grad_tol["norm"] * norm, (point, np.linalg.norm(flat_m), norm)
        for layer in {n.rsplit(".", 1)[0] for n in gs}:
            names = [n for n in gs if n.rsplit(".", 1)[0] == layer]
            a, b = (np.concatenate([g[n].ravel() for n in names]) for g in (gm, gs))
            e = float(np.linalg.norm(a - b) / np.linalg.norm(b))
            worst["layer l2"] = max(worst.get("layer l2", 0.0), e)
            assert e <= grad_tol["l2"], f"k={k} point {point}: layer {layer}'s gradient rel L2 {e:.3g}"
        trajectory.train_step(X, y, lr, mu, wd)
    print(f"\nk={k}: worst " + ", ".join(f"{m} {e:.2g}" for m, e in worst.items()))


# ---------------------------------------------------------------------------
# 3. per-replica BatchNorm: each shard normalised by its own statistics
# ---------------------------------------------------------------------------

def per_shard_reference(ref, W, X, y, k):
    """Loss sum, gradient of the global mean loss and averaged running statistics when each of
    k contiguous shards (dpcore's split) is normalised by its own statistics."""
    n = len(y)
    loss, G, stats, used = 0.0, None, None, 0
    for b, e in dp._core.shard_ranges(n, k):
        if e == b:
            continue
        l, g, _, s, _ = ref.loss_grads(W, X[b:e].astype(np.float64), y[b:e], scale=1 / n)
        loss += l
        G = g if G is None else {m: G[m] + g[m] for m in G}
        stats = s if stats is None else {m: stats[m] + s[m] for m in stats}
        used += 1
    return loss, G, {m: v / used for m, v in stats.items()}


@pytest.mark.parametrize("name,batch", [("conv_bn", 5), ("residual", 6), ("dense_bn", 7)])
def test_per_replica_batchnorm_normalises_each_shard(name, batch):
    use_devices(2)
    ref, net, W = build(name, 31, devices=["cpu:0", "cpu:1"])
    X, y = data(ref.input_shape, batch, 32, ref.shapes[-1][0])
    loss, correct = net._mirrored.forward_backward(X, y.astype(np.int64))
    loss_ref, G, stats = per_shard_reference(ref, W, X, y, 2)
    assert abs(loss - loss_ref) <= LOSS_TOL * loss_ref, (loss, loss_ref)
    grads = [dp_grads(net, r) for r in net._replicas]
    for n in G:
        assert np.array_equal(bits(grads[0][n]), bits(grads[1][n])), n
        e = grad_rel(grads[0][n], G, n)
        assert e <= GRAD_TOL, f"{name}: all-reduced gradient {n} rel {e:.3g}"
    Wd = net.get_weights()
    for n in stats:
        e = rel(Wd[n], stats[n])
        assert e <= STAT_TOL, f"{name}: averaged {n} rel {e:.3g}"
    assert net.replicas_identical()
    # the per-shard answer is not the global-batch one (the comparison discriminates)
    _, G_global, _, stats_global, _ = ref.loss_grads(W, X.astype(np.float64), y)
    assert max(grad_rel(G[n], G_global, n) for n in G) > 100 * GRAD_TOL
    assert max(rel(stats[n], stats_global[n]) for n in stats) > 100 * STAT_TOL


@pytest.mark.parametrize("name,batch,seed", [c for c in CASES if c[0] in ("conv_bn", "residual", "dense_bn")])
def test_sync_batchnorm_matches_numpy(name, batch, seed):
    """Synchronized BatchNorm on 2 replicas against the float64 reference of the whole batch, within
    the same one-forward/backward bounds as one replica (GRAD_TOL, LOSS_TOL, STAT_TOL) at the
    cases whose ReLU inputs keep RELU_MARGIN from 0 (asserted), so no unit can flip: the
    flip-free counterpart of the ResNet-18 comparison below."""
    use_devices(2)
    ref, net, W = build(name, seed, devices=["cpu:0", "cpu:1"], sync_batchnorm=True)
    X, y = data(ref.input_shape, batch, 100 + seed, ref.shapes[-1][0])
    loss_ref, G, _, stats, cache = ref.loss_grads(W, X.astype(np.float64), y)
    assert ref.relu_margin(cache) > RELU_MARGIN
    loss, _ = net._mirrored.forward_backward(X, y.astype(np.int64))
    assert abs(loss - loss_ref) <= LOSS_TOL * loss_ref, (loss, loss_ref)
    got = dp_grads(net)
    for n in G:
        e = grad_rel(got[n], G, n)
        assert e <= GRAD_TOL, f"{name} batch {batch}: gradient {n} rel {e:.3g}"
    Wd = net.get_weights()
    for n in stat_names(W):
        assert rel(Wd[n], stats[n]) <= STAT_TOL, n


# ---------------------------------------------------------------------------
# 4. running statistics across replicas, uneven and empty shards
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("sync", [False, True])
@pytest.mark.parametrize("k,batches", [(3, [7, 5, 8]), (4, [3, 6, 3])])
def test_running_statistics_identical_on_replicas(sync, k, batches):
    # batches of 3 on 4 replicas leave one shard empty; 7 on 3 gives shards 3, 2, 2
    name = "residual"
    devices = use_devices(k)
    ref, net, W = build(name, 41, devices=devices, sync_batchnorm=sync)
    for step, n in enumerate(batches):
        X, y = data(ref.input_shape, n, 50 + step, 3)
        before = {m: v for m, v in net.get_weights().items()}
        net.train_step(X, y, lr=0.05, momentum=0.9)
        assert net.replicas_identical(), f"replicas differ after step {step + 1} (sync={sync})"
        states = [bits(r.get_state()) for r in net._replicas]
        assert all(np.array_equal(states[0], s) for s in states[1:])
        after = net.get_weights()
        # each step's reference is computed in float64 from the model's own state before the step
        # (`before`), so that STAT_TOL, a bound on one forward pass, is compared with one step's
        # error only (a single replica trained alongside would have drifted from the mirrored
        # model's weights by the earlier steps' rounding carried through their gradients)
        if sync:
            # one normalisation over the whole batch: the statistics of one shard of all n samples
            _, _, want = per_shard_reference(ref, before, X, y, 1)
            # and not those of each replica's shard averaged (the comparison discriminates)
            _, _, split = per_shard_reference(ref, before, X, y, k)
            assert max(rel(split[m], want[m]) for m in want) > 100 * STAT_TOL
        else:
            # the mean over the replicas that had samples of their own updates
            _, _, want = per_shard_reference(ref, before, X, y, k)
            shards = [e - b for b, e in dp._core.shard_ranges(n, k)]
            if 0 in shards:
                # an empty shard keeps no statistics of its own: averaging it in (as an unchanged
                # replica) would pull the averages back towards the old values
                diluted = {m: (want[m] * (k - shards.count(0)) + before[m] * shards.count(0)) / k for m in want}
                assert max(rel(diluted[m], want[m]) for m in want) > 100 * STAT_TOL
        for m in stat_names(W):
            e = rel(after[m], want[m])
            assert e <= STAT_TOL, f"sync={sync} k={k} step {step + 1}: {m} rel {e:.3g}"


def test_per_replica_batchnorm_shard_with_one_value_per_channel_fails_cleanly():
    # BatchNorm after a dense layer, 3 samples on 2 replicas: the second shard has 1 sample,
    # hence one value per channel; the step fails with a clear error, nothing moves, nothing hangs
    use_devices(2)
    ref, net, W = build("dense_bn", 61, devices=["cpu:0", "cpu:1"])
    X, y = data(ref.input_shape, 3, 62, 4)
    with pytest.raises(ValueError, match="more than one value per channel"):
        net.train_step(X, y, lr=0.1)
    assert net.replicas_identical()
    assert all(np.array_equal(v, W[n]) for n, v in net.get_weights().items())
    # with synchronized BatchNorm the whole batch is normalised together: 3 values, fine
    ref, net, W = build("dense_bn", 61, devices=["cpu:0", "cpu:1"], sync_batchnorm=True)
    net.train_step(X, y, lr=0.1)
    assert net.replicas_identical()


# ---------------------------------------------------------------------------
# 5. ResNet-18 learns (slow)
# ---------------------------------------------------------------------------

# The short version of the book's experiment (chapter 12.6's recipe on a subset, as test_train.py
# keeps LeNet's): ResNet18(init='d2l') on one CPU device, batch 32, lr 0.05, 4 epochs over the first
# 2,000 training images, evaluation-mode accuracy on the first 1,000 test images. Where it ends
# depends on the seed (initial weights and data order) and, through the rounding of the machine's
# kernels, acts like another seed elsewhere. `benchmarks/book_resnet.py --subset 2000 --test-subset
# 1000 --batch-size 32 --lr 0.05 --epochs 4 --seeds 0 ... 9 --runs dpcore:d2l:float32` (SkylakeX
# kernels, 2026-11-28) gave SUBSET_SEEDS (seeds 0-9; the suite runs seed 0). The threshold is their
# mean less 4 sample sd, rounded down (under a normal model a run falls below it with probability
# ~3e-5); a network that does not learn stays near 0.10, and one with a broken gradient or
# BatchNorm well below the threshold.
SUBSET_SEEDS = (0.740, 0.813, 0.774, 0.754, 0.703, 0.727, 0.740, 0.706, 0.756, 0.796)  # mean 0.751, sd 0.036
SUBSET_ACCURACY = 0.60


def test_the_subset_threshold_is_the_seeds_mean_less_four_sd():
    """SUBSET_ACCURACY is derived from the recorded seeds, not chosen."""
    mean, sd = float(np.mean(SUBSET_SEEDS)), float(np.std(SUBSET_SEEDS, ddof=1))
    assert len(SUBSET_SEEDS) >= 6
    assert SUBSET_ACCURACY <= mean - 4 * sd < SUBSET_ACCURACY + 0.01, (mean, sd)


@pytest.mark.slow
def test_resnet18_short_book_experiment_on_a_subset():
    X, y = fashion_subset(2000)
    _, _, test_X, test_y = dp.data._load_fashion_mnist_arrays(None)
    Xt, yt = np.array(test_X[:1000]).reshape(-1, 1, 28, 28), np.array(test_y[:1000]).astype(np.int64)
    net = dp.models.ResNet18(seed=0, init="d2l", devices=["cpu:0"])
    train_iter = dp.data.from_arrays(X, y.astype(np.int64), batch_size=32, shuffle=True, seed=0)
    test_iter = dp.data.from_arrays(Xt, yt, batch_size=256)
    start = time.time()
    # evaluated once, after the last epoch (what the threshold is about; the test pass in evaluation
    # mode changes no weight or statistic, so the epochs train as with a test_iter)
    history = dp.train(net, train_iter, None, num_epochs=4, lr=0.05, verbose=False, progress=False)
    accuracy = net.evaluate(test_iter, progress=False).accuracy
    print(f"\nResNet-18 (d2l init), 4 epochs of 2,000 images at batch 32: training loss per epoch "
          f"{[round(a, 4) for a in history.train_loss]}, test accuracy {accuracy:.4f}, {time.time() - start:.0f} s")
    assert np.isfinite(history.train_loss).all()
    assert history.train_loss[-1] < 0.7 * history.train_loss[0], history.train_loss
    assert accuracy >= SUBSET_ACCURACY, accuracy


# ---------------------------------------------------------------------------
# 6. save / load
# ---------------------------------------------------------------------------

def test_resnet18_save_load_round_trip(tmp_path):
    net = dp.models.ResNet18(seed=3, input_size=16)
    X, y = fashion_subset(6, offset=2000)
    X = X[:, :, 6:22, 6:22].copy()
    net.train_step(X, y, lr=0.05, momentum=0.9)
    net.train_step(X, y, lr=0.05, momentum=0.9)
    W = net.get_weights()
    assert not np.allclose(W["1.running_var"], 1.0) and not np.allclose(W["1.running_mean"], 0.0)
    path = tmp_path / "resnet.safetensors"
    net.save(path)
    loaded = dp.models.load(path)
    assert isinstance(loaded, dp.models.ResNet18) and loaded.input_shape == (1, 16, 16)
    W2 = loaded.get_weights()
    assert list(W2) == list(W)
    for n in W:
        assert np.array_equal(bits(W2[n]), bits(W[n])), n
    assert np.array_equal(bits(loaded.predict(X)), bits(net.predict(X)))
    # the file uses PyTorch's names, running statistics included
    from safetensors.numpy import load_file
    stored = load_file(str(path))
    assert set(stored) == set(W) and "resnet_block4.1.bn2.running_var" in stored
