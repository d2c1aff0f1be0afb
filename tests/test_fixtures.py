"""LeNet and ResNet-18 against PyTorch, through committed fixtures (tests/fixtures/).

tests/fixtures/make_fixtures.py recorded, with PyTorch in float64 from float32
initial weights and the first 8 Fashion-MNIST training images, in training mode:
the mean cross-entropy loss, the logits, every parameter gradient, the BatchNorm
running statistics after that forward, the evaluation-mode logits with the
initial running statistics, and, from the initial weights again, the losses, the
updates w3 - w0, the running statistics and the evaluation-mode logits after
three torch.optim.SGD(lr=0.05, momentum=0.9, weight_decay=1e-4) steps on the
batch.  The initial weights are regenerated here by the fixture script's NumPy
code and checked against SHA-256 digests it stored.  PyTorch is not needed.

Error measures (make_fixtures.tensor_errors): 'max' = max|a - ref| / max|ref|,
'l2' = ||a - ref|| / ||ref||; ResNet-18 tensors over 65536 entries are stored
as 4096 samples, 8 sign projections and the L2 norm: 'max' over the samples,
'l2' = max |projection difference| / ||ref||, and 'norm' = relative norm error.

Tolerances.  The same computation in float32 PyTorch (8 runs: the batch in
order and in 7 random orders, i.e. other summation orders) shows how far any
float32 implementation lands from the float64 reference; its worst error per
category is in the fixture ("torch_float32_error"), and
test_tolerances_cover_pytorch_float32 checks every tolerance is at least
TOL_MARGIN x that worst case.

  * LeNet is well conditioned: float32 PyTorch is within 3.4e-6 (gradients),
    9.3e-6 (3-step updates), 1.6e-7 (logits), 1.1e-7 (losses): the tolerances
    are test_lenet's (gradients 5e-5, updates 1e-4, logits and losses 1e-5).
  * ResNet-18, forward quantities (loss, evaluation logits, running statistics
    after one forward): float32 PyTorch within 3.4e-7 -> tolerance 1e-5.
  * ResNet-18 gradients: float32 PyTorch is only within 6.2e-2 (max), 1.9e-2
    (l2) and 2.7e-4 (norm).  The cause is not accumulated rounding but ReLU
    units whose pre-activation lies within float32 noise (~1e-5 in the deep
    layers) of 0: about two of the ~3M units flip in a float32 forward, and a
    flipped unit changes every gradient upstream of it by ~1e-2 (with 8 images
    one unit is a sizeable part of a channel's sum).  Which units flip depends
    on the summation order, so dpcore (another order) flips others.  The
    tolerances are 3x PyTorch's worst: max 0.2, l2 0.06, norm 1e-3.  The
    biases of convolutions followed by BatchNorm have an exact gradient of 0;
    they are checked as max|g| <= 3e-4 max|gradient of the layer's weight|
    (PyTorch: 2.5e-5).  The tight, flip-free check of the same backward pass
    (BatchNorm, residual adds, strided 1x1 shortcuts) is tests/test_resnet.py's
    float64 NumPy comparison of small networks.
  * What these tolerances are, and are not (issue 29's audit): the float32
    spread over 8 summation orders is an estimate read from 8 samples, not a
    bound that every float32-faithful kernel set meets. Where a tolerance sits
    far above it (LeNet, 10x and more; ResNet-18's forward quantities, 30x) an
    order outside the 8 would have to be an order of magnitude worse than any
    of them; ResNet-18's gradient tolerances (3x, set by ReLU flips that no
    rounding model bounds) are the thin ones: a kernel set that flips more
    units than PyTorch did in 8 orders can exceed them without a bug.
  * Three SGD steps: dpcore's trajectory is NOT compared with the fixture's
    three-step values (losses3, update3, after3). After step 1 the two differ
    by step 1's error carried through the later gradients by the loss's
    curvature (for ResNet-18 by flipped units: float32 PyTorch itself lands
    4.6e-1 (max) and 7.8e-1 (l2) from float64 in the updates), which no float32
    error model bounds: a tolerance there is read off runs, not derived.
    Instead each of the three steps is checked from dpcore's own state before
    it against torch.optim.SGD's rule on the gradient dpcore computed in that
    step (v' = mu v + g + wd w, w' = w - lr v'), elementwise within the few
    float32 roundings the rule takes (derived in
    test_three_sgd_steps_follow_pytorchs_rule): a wrong sign, a missing
    momentum or weight-decay term, a factor 2 fail it by orders of magnitude.
    That the rule is PyTorch's is checked in float64 on LeNet: the fixture's
    three steps equal test_lenet's float64 reference run for three steps
    (test_lenet_fixture_trajectory_is_the_reference_rule, 1e-8, no ReLU input
    within 1e-9 of its layer's largest from 0).

On the GPU.  The same two comparisons run on 'cuda:0' (marked ``gpu``, skipped
with the reason where no CUDA device is usable, as in tests/test_gpu.py) with
the same tolerances, TF32 off and deterministic cuDNN algorithms: they are set
by float32 PyTorch's own spread over summation orders, which cuDNN / cuBLAS
are one more of.

Observed for dpcore (CPU backend, 2 threads):
LeNet gradients 1.7e-6, updates 9.3e-6, logits 2.2e-7; ResNet-18 loss 7.5e-8,
evaluation logits 3.2e-7, running statistics 1.1e-7, gradients 6.2e-2 (max),
1.7e-2 (l2), 1.1e-4 (norm), zero-gradient biases 3.7e-5 -- float32 PyTorch's level.
"""
import importlib.util
import json
import os

import numpy as np
import pytest

import dpcore as dp

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "fixtures")

_spec = importlib.util.spec_from_file_location("make_fixtures", os.path.join(FIXTURES, "make_fixtures.py"))
mf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mf)  # NumPy only at import time; torch is imported inside its main()

TOL_MARGIN = 2.0  # every tolerance >= 2x the worst float32-PyTorch error of its category (they are ~3x)

# category -> measure -> tolerance
TOLS = {
    "lenet": {
        "loss": {"max": 1e-5, "l2": 1e-5},
        "eval_logits": {"max": 1e-5, "l2": 1e-5},
        "grad": {"max": 5e-5, "l2": 5e-5},
    },
    "resnet18": {
        "loss": {"max": 1e-5, "l2": 1e-5},
        "eval_logits": {"max": 1e-5, "l2": 1e-5},
        "stats1": {"max": 1e-5, "l2": 1e-5},
        "grad": {"max": 0.2, "l2": 0.06, "norm": 1e-3},
        "zero_grad": {"abs": 3e-4},
    },
}

# the fixture's three-step categories: float32 PyTorch's spread is recorded for them, but dpcore's
# three-step trajectory is not compared with them (see test_three_sgd_steps_follow_pytorchs_rule)
THREE_STEP = {"losses3", "update3", "after3", "after3/eval_logits"}

# ---------------------------------------------------------------------------
# loading and comparing
# ---------------------------------------------------------------------------

class Fixture:
    def __init__(self, model):
        from safetensors import safe_open

        path = os.path.join(FIXTURES, f"{model}.safetensors")
        with safe_open(path, framework="np") as f:
            self.meta = f.metadata()
            self.t = {k: f.get_tensor(k) for k in f.keys()}
        assert self.meta["format"] == mf.FORMAT, self.meta["format"]
        self.model = model
        self.names = {n: tuple(s) for n, s in json.loads(self.meta["names"])}
        self.large = json.loads(self.meta["large"])
        self.zero = json.loads(self.meta["zero_grad"])
        self.torch_errors = json.loads(self.meta["torch_float32_error"])
        self.params = [n for n in self.names if not n.endswith(("running_mean", "running_var"))]
        self.buffers = [n for n in self.names if n.endswith(("running_mean", "running_var"))]
        self.lr, self.momentum, self.wd = (float(self.meta[k]) for k in ("lr", "momentum", "weight_decay"))
        self.steps = int(self.meta["steps"])
        self._plans = {}

    def plan(self, name):
        if name not in self.large:
            return None
        if name not in self._plans:
            idx, signs = mf.sample_plan(name, int(np.prod(self.names[name])))
            assert np.array_equal(idx, self.t[f"idx/{name}"]), f"{name}: regenerated sample indices differ"
            self._plans[name] = (idx, signs)
        return self._plans[name]

    def errors(self, key, a):
        name = key.split("/", 1)[1] if key.count("/") and not key.endswith("eval_logits") else None
        return mf.tensor_errors(np.asarray(a, np.float64), key, self.t, self.plan(name) if name else None)

    def initial_weights(self):
        init = mf.initial_weights(self.names)
        digests = json.loads(self.meta["init_sha256"])
        bad = [n for n, v in init.items() if mf.digest(v) != digests[n]]
        assert not bad, f"regenerated initial weights differ from the fixture's: {bad[:5]}"
        return init


class Report:
    """Collects (key, measure, error, tolerance); asserts at the end with every failure listed."""

    def __init__(self, fixture):
        self.fx = fixture
        self.rows = []

    def check(self, key, a, category=None):
        category = category or key.split("/")[0]
        tols = TOLS[self.fx.model][category]
        for measure, e in self.fx.errors(key, a).items():
            self.rows.append((key, measure, e, tols[measure]))

    def add(self, key, measure, e, category):
        self.rows.append((key, measure, e, TOLS[self.fx.model][category][measure]))

    def worst(self, prefix):
        rows = [r for r in self.rows if r[0].startswith(prefix)]
        return {m: max(r[2] for r in rows if r[1] == m) for m in {r[1] for r in rows}}

    def finish(self):
        bad = [r for r in self.rows if not r[2] <= r[3]]
        assert not bad, "\n".join(f"{k} {m}: {e:.3g} > tolerance {t:g}" for k, m, e, t in
                                  sorted(bad, key=lambda r: -r[2] / r[3])[:25]) + f"\n({len(bad)} failures)"


def grads_by_name(net):
    """net._model.get_grads() sliced into name -> array with the names of get_weights."""
    flat = net._model.get_grads()
    return {name: flat[off:off + int(np.prod(shape))].reshape(shape)
            for name, buffer, off, shape in net._entries() if buffer == "params"}


def make_net(model, device="cpu:0"):
    return dp.models.LeNet(devices=[device]) if model == "lenet" else dp.models.ResNet18(devices=[device])


_RUNTIME = dp._core.runtime_info()
_GPUS = _RUNTIME["cuda_device_count"] if dp.build_info().get("cuda_backend") else 0
_NO_GPU = ("no usable CUDA device: " + (_RUNTIME["cuda_why"] if dp.build_info().get("cuda_backend")
                                        else "dpcore was built without the CUDA backend"))
# every comparison with PyTorch runs on the CPU and, where one is usable, on the GPU
DEVICES = ["cpu:0", pytest.param("cuda:0", marks=[pytest.mark.gpu, pytest.mark.skipif(_GPUS == 0, reason=_NO_GPU)])]


@pytest.fixture
def device(request):
    """The device under test; on a GPU with TF32 off and deterministic cuDNN
    algorithms (the defaults, set explicitly), restored afterwards."""
    if request.param.startswith("cuda"):
        dp.set_deterministic(True)
        dp.set_allow_tf32(False)
        yield request.param
        dp.set_deterministic(True)
        dp.set_allow_tf32(False)
    else:
        yield request.param


@pytest.fixture(autouse=True)
def one_device():
    dp.set_logical_devices("cpu", 1)
    yield
    dp.set_logical_devices("cpu", 1)


@pytest.fixture(scope="module", params=["lenet", "resnet18"])
def fx(request):
    return Fixture(request.param)


# ---------------------------------------------------------------------------
# the fixtures themselves
# ---------------------------------------------------------------------------

def test_fixture_contents(fx):
    # the 8 images are the first 8 of the training set, as the model sees them
    X, y = fx.t["input"], fx.t["labels"]
    assert X.shape == (8, 1, 28, 28) and X.dtype == np.float32 and y.shape == (8,) and y.dtype == np.int64
    assert np.array_equal(X, (fx.t["input_u8"].astype(np.float32) / np.float32(255)).astype(np.float32))
    if os.path.exists(os.path.join(mf.DATA, "train-images-idx3-ubyte.gz")):
        X_u8, y_data = mf.fashion_mnist_batch()
        assert np.array_equal(X_u8, fx.t["input_u8"]) and np.array_equal(y_data, y)
    # dpcore's names and shapes are PyTorch's state_dict's (num_batches_tracked aside); for ResNet-18 the
    # order differs (dpcore lists a block's tensors in layer order, PyTorch conv1, conv2, conv3, bn1, bn2)
    W = make_net(fx.model).get_weights()
    assert set(W) == set(fx.names)
    assert {n: w.shape for n, w in W.items()} == fx.names
    # the initial weights regenerate bit for bit (LeNet's are also stored in full)
    init = fx.initial_weights()
    for n in fx.names:
        if f"init/{n}" in fx.t:
            assert np.array_equal(fx.t[f"init/{n}"], init[n]), n
    # every recorded tensor is there, large ones as summaries with their indices
    for n in fx.params:
        for kind in ("grad", "update3"):
            key = f"{kind}/{n}"
            assert (key in fx.t) != (n in fx.large and all(f"{key}@{s}" in fx.t for s in ("samples", "proj", "norm")))
    for n in fx.buffers:
        assert fx.t[f"stats1/{n}"].shape == fx.names[n] and fx.t[f"after3/{n}"].shape == fx.names[n]
    assert fx.t["losses3"].shape == (fx.steps,)
    assert (fx.lr, fx.momentum, fx.wd, fx.steps) == (0.05, 0.9, 1e-4, 3)
    if fx.model == "resnet18":
        assert len(fx.large) == 13 and all(np.prod(fx.names[n]) > 65536 for n in fx.large)
        assert os.path.getsize(os.path.join(FIXTURES, "resnet18.safetensors")) < 5.5e6


def test_tolerances_cover_pytorch_float32(fx):
    """Each tolerance is at least TOL_MARGIN x the worst error float32 PyTorch itself made."""
    worst = {}
    for key, errs in fx.torch_errors.items():
        name = key.split("/", 1)[1] if "/" in key and not key.endswith("eval_logits") else None
        cat = "zero_grad" if key.startswith("grad/") and name in fx.zero else (
            key if key.endswith("eval_logits") or "/" not in key else key.split("/")[0])
        for m, v in errs.items():
            worst[(cat, m)] = max(worst.get((cat, m), 0.0), v)
    tols = TOLS[fx.model]
    for (cat, m), v in worst.items():
        if cat == "logits":
            continue  # training-mode logits: dpcore does not return them (the loss and correct count are compared)
        if cat in THREE_STEP:
            continue  # three-step values: not compared with dpcore's trajectory (test_three_sgd_steps_follow_...)
        assert tols[cat][m] >= TOL_MARGIN * v, f"{fx.model} {cat} {m}: tolerance {tols[cat][m]:g} < " \
                                               f"{TOL_MARGIN} x float32 PyTorch's {v:.3g}"


# ---------------------------------------------------------------------------
# dpcore against the fixtures
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_forward_backward_matches_pytorch(fx, device):
    X, y = fx.t["input"], fx.t["labels"]
    net = make_net(fx.model, device)
    net.set_weights(fx.initial_weights())
    rep = Report(fx)
    # evaluation mode first (predict uses the running statistics, which forward_backward updates)
    rep.check("eval_logits", net.predict(X))
    loss_sum, correct = net._model.forward_backward(X, y, 1 / len(y))
    rep.add("loss", "max", abs(loss_sum / len(y) - fx.t["loss"][0]) / fx.t["loss"][0], "loss")
    logits = fx.t["logits"]
    top2 = np.sort(logits, axis=1)[:, -2:]
    assert (top2[:, 1] - top2[:, 0]).min() > 1e-4  # no near tie: the count of correct predictions is exact
    assert correct == int((logits.argmax(axis=1) == y).sum())
    G = grads_by_name(net)
    assert set(G) == set(fx.params)
    for n in fx.params:
        if n in fx.zero:
            # exact gradient 0 (a bias before BatchNorm): float32 noise relative to the layer's weight gradient
            w = f"grad/{n[:-5]}.weight"
            scale = (np.abs(fx.t[w]).max() if w in fx.t else np.abs(fx.t[w + "@samples"]).max())
            rep.add(f"grad/{n}", "abs", float(np.abs(G[n]).max() / scale), "zero_grad")
        else:
            rep.check(f"grad/{n}", G[n])
    W = net.get_weights()
    for n in fx.buffers:
        rep.check(f"stats1/{n}", W[n])
    print(f"\n{fx.model} on {device}, forward/backward vs float64 PyTorch: " +
          ", ".join(f"{p} {' '.join(f'{m}={e:.2g}' for m, e in sorted(rep.worst(p).items()))}"
                    for p in ("eval_logits", "loss", "grad/", "stats1/") if any(r[0].startswith(p) for r in rep.rows)))
    rep.finish()


U = 2.0 ** -24  # float32's unit roundoff
TINY = float(np.finfo(np.float32).tiny)  # what a result flushed to zero (FTZ) loses, at most


def velocity_by_name(net):
    flat = net._model.get_velocity()
    return {name: flat[off:off + int(np.prod(shape))].reshape(shape)
            for name, buffer, off, shape in net._entries() if buffer == "params"}


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_three_sgd_steps_follow_pytorchs_rule(fx, device):
    """Each of three steps on the fixture's batch, from dpcore's own state before it, is
    torch.optim.SGD's rule applied to the gradient dpcore computed in that step (get_grads after
    train_step): v' = mu v + (g + wd w) (v' = g + wd w on the first step: dpcore's momentum starts
    at 0), w' = w - lr v'. In float32 from float32 w, g, v and lr, mu, wd as float32, that is at
    most four roundings for v' and two for w', so elementwise
        |v' - (mu v + g + wd w)| <= 4.01 u (|mu v| + |g| + |wd w|),
        |w' - (w - lr v')|       <= 2.01 u (|w| + |lr v'|)               (u = 2^-24),
    (plus FLT_MIN per rounding, for a subnormal result flushed to zero), whatever the order or
    contraction (FMA) of the operations: a bound derived for one step and
    checked on one step, that any kernel set meets. The gradient itself is compared with
    PyTorch's at the fixture's weights by test_forward_backward_matches_pytorch; the fixture's
    three-step values (losses3, update3, after3) are not compared with dpcore's trajectory, whose
    distance from float64 after step 1 is step 1's error carried through later gradients by the
    loss's curvature (for ResNet-18 also the ReLU units that flip), which no float32 error model
    bounds; for LeNet, test_lenet_fixture_trajectory_is_the_reference_rule checks that they are
    this rule in float64."""
    X, y = fx.t["input"], fx.t["labels"]
    net = make_net(fx.model, device)
    net.set_weights(fx.initial_weights())
    lr, mu, wd = (float(np.float32(a)) for a in (fx.lr, fx.momentum, fx.wd))
    worst = {"v": 0.0, "w": 0.0}
    for step in range(1, fx.steps + 1):
        W0 = net.get_weights()
        w0 = {n: W0[n].astype(np.float64) for n in fx.params}
        v0 = {n: a.astype(np.float64) for n, a in velocity_by_name(net).items()}
        if step == 1:
            assert not any(v.any() for v in v0.values())  # PyTorch's first step: v = g + wd w
        loss_sum, _ = net.train_step(X, y, lr=fx.lr, momentum=fx.momentum, weight_decay=fx.wd)
        assert np.isfinite(loss_sum)
        g = {n: a.astype(np.float64) for n, a in grads_by_name(net).items()}
        v1 = {n: a.astype(np.float64) for n, a in velocity_by_name(net).items()}
        W1 = net.get_weights()
        for n in fx.params:
            want_v = mu * v0[n] + (g[n] + wd * w0[n])
            bound_v = 4.01 * U * (np.abs(mu * v0[n]) + np.abs(g[n]) + np.abs(wd * w0[n])) + 4 * TINY
            ev = np.abs(v1[n] - want_v)
            assert (ev <= bound_v).all(), f"step {step}: momentum of {n} off by {ev.max():.3g}"
            want_w = w0[n] - lr * v1[n]
            bound_w = 2.01 * U * (np.abs(w0[n]) + np.abs(lr * v1[n])) + 2 * TINY
            ew = np.abs(W1[n].astype(np.float64) - want_w)
            assert (ew <= bound_w).all(), f"step {step}: weights {n} off by {ew.max():.3g}"
            worst["v"] = max(worst["v"], float((ev / np.maximum(bound_v, 1e-300)).max()))
            worst["w"] = max(worst["w"], float((ew / np.maximum(bound_w, 1e-300)).max()))
        assert any(not np.array_equal(W1[n], w0[n]) for n in fx.params)  # the step moved the weights
    print(f"\n{fx.model} on {device}: largest error / bound over {fx.steps} steps: momentum {worst['v']:.2f}, "
          f"weights {worst['w']:.2f}")


def test_lenet_fixture_trajectory_is_the_reference_rule():
    """The fixture's float64 PyTorch three steps (losses3, update3) are test_lenet's float64
    NumPy LeNet and ref_sgd (the rule test_three_sgd_steps_follow_pytorchs_rule checks dpcore
    against) run for three steps from the same weights: torch.optim.SGD's first-step momentum
    and its weight decay are that rule. Two float64 computations in different summation orders
    differ by ~n 2^-53 ~ 1e-12 relative (sums of up to ~20k terms); carried through three steps
    that stays far below the 1e-8 used here as long as no ReLU unit flips, and none can: every
    ReLU input of the reference at each of the three points is asserted to be at least 1e-9 of
    its layer's largest from 0, a million times float64's error there."""
    from test_lenet import as_unit64, ref_forward, ref_loss_grads, ref_sgd, to64

    fx = Fixture("lenet")
    x, y = as_unit64(fx.t["input"]), fx.t["labels"]
    P0 = to64(fx.initial_weights())
    P, V, losses = P0, None, []
    for _ in range(fx.steps):
        _, cache = ref_forward(P, x)
        for z in ("z0", "z3", "z7"):
            assert np.abs(cache[z]).min() >= 1e-9 * np.abs(cache[z]).max(), z
        loss, G, _ = ref_loss_grads(P, x, y)
        losses.append(loss)
        P, V = ref_sgd(P, G, V, fx.lr, fx.momentum, fx.wd)
    assert np.abs(np.array(losses) - fx.t["losses3"]).max() <= 1e-8 * np.abs(fx.t["losses3"]).max()
    for n in fx.params:
        e = np.abs((P[n] - P0[n]) - fx.t[f"update3/{n}"]).max() / np.abs(fx.t[f"update3/{n}"]).max()
        assert e <= 1e-8, f"update3/{n}: {e:.3g}"
