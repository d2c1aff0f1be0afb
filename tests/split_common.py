"""What tests/test_pipeline.py and tests/test_tensor_parallel.py share: the data,
the step-change comparison with one device and its tolerance (derived in each
file's docstring), and whether a GPU is here."""
import numpy as np

import dpcore as dp

RTOL = 1e-4
RUNTIME = dp._core.runtime_info()
GPUS = RUNTIME["cuda_device_count"] if dp.build_info().get("cuda_backend") else 0
NO_GPU = "no usable CUDA device: " + (RUNTIME["cuda_why"] if dp.build_info().get("cuda_backend")
                                      else "dpcore was built without the CUDA backend")


def data(n, shape=(1, 28, 28), classes=10, seed=0):
    rng = np.random.default_rng(seed)
    return rng.random((n,) + shape, dtype=np.float32), rng.integers(0, classes, n)


def close(got, want, what, w0, rtol=RTOL):
    """Each step's change of each tensor within rtol of its largest entry, plus 4 ulps of the
    float32 weights the change is read from (w - w0). got and want: step_change's lists."""
    assert len(got) == len(want)
    for step, (g, wnt) in enumerate(zip(got, want), 1):
        for name in wnt:
            scale = float(np.abs(wnt[name]).max())
            ulps = 4 * float(np.spacing(np.float32(np.abs(w0[name]).max() + scale)))
            err = float(np.abs(g[name] - wnt[name]).max())
            assert err <= rtol * scale + ulps, \
                f"{what}, step {step}: {name} differs by {err:.3g} (largest entry {scale:.3g})"


def step_change(net, w0, X, y, steps=2, starts=None):
    """Each of `steps` SGD steps (momentum 0.9), as (changes, losses, starts): changes[i] the
    weights' change in step i, losses[i] its (loss, correct), starts[i] the (weights, velocity) it
    started from. Without starts the net runs its own steps from w0 (zero momentum); with the
    reference's starts, each step begins from the reference's state, so that the two differ by one
    step's rounding only: the bound (each file's docstring) is derived for one step, and across
    steps a difference is carried on by the loss's curvature, which no float32 model bounds."""
    changes, losses, seen = [], [], []
    net.set_weights(w0)
    net._model.set_velocity(np.zeros(net._model.nparams, np.float32))
    for i in range(steps):
        if starts is not None:
            net.set_weights(starts[i][0])
            net._model.set_velocity(starts[i][1])
        before = net.get_weights()
        seen.append((before, net._model.get_velocity()))
        losses.append(net.train_step(X, y, lr=0.1, momentum=0.9))
        w = net.get_weights()
        changes.append({k: w[k] - before[k] for k in w})
    return changes, losses, seen


def resnet(**kw):
    return dp.models.ResNet18(num_classes=10, input_size=12, **kw)


def nan_weight_is_named(net, row):
    """A NaN in row `row` of layer 7's weight (LeNet's first dense layer): dp.train
    raises at step 1, applies nothing, and check_numerics names the layer."""
    X, y = data(64)
    w = net.get_weights()
    w["7.weight"][row, 17] = np.nan
    net.set_weights(w, allow_nonfinite=True)
    before = net.get_weights()
    try:
        dp.train(net, dp.data.from_arrays(X, y, batch_size=32), num_epochs=1, lr=0.1, verbose=False,
                 check_numerics=True)
    except FloatingPointError as e:
        msg = str(e)
    else:
        raise AssertionError("a NaN weight trained without an error")
    assert "epoch 1, step 1" in msg and "the input batch is finite" in msg and "layer 7 (dense)'s output" in msg, msg
    after = net.get_weights()
    assert all(np.array_equal(before[k], after[k], equal_nan=True) for k in before)
