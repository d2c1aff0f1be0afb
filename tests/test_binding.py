"""The CPython binding (csrc/py_*.c over csrc/py_private.h).

- Threads: a call that runs without the GIL marks its models busy, so a
  second thread using the same model (directly, through a Mirrored, or through
  a Tensor viewing its buffers) gets RuntimeError("... in use by another
  thread") instead of racing with it; nothing crashes and the model works
  afterwards.
- all_reduce holds strong references to its tensors while it runs: a list
  emptied by another thread meanwhile cannot free their memory under it.
- A failing backend call is an exception, from the single ops and from the
  model calls alike, and leaves no model marked busy.
"""
import gc
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import dpcore as dp

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
BUSY = "in use by another thread"


def run_concurrently(*loops):
    """Runs each loop() on its own thread; returns the exceptions each raised, per loop."""
    errors = [[] for _ in loops]

    def body(i):
        try:
            loops[i](errors[i])
        except BaseException as e:  # noqa: BLE001 - reported to the test below
            errors[i].append(e)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(len(loops))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
        assert not t.is_alive(), "a thread did not finish"
    return errors


def attempt(call, errors):
    """call(); a busy refusal is recorded in errors (any other exception propagates). True on success."""
    try:
        call()
        return True
    except RuntimeError as e:
        if BUSY not in str(e):
            raise
        errors.append(e)
        return False


def assert_only_busy(errors):
    for e in errors:
        assert isinstance(e, RuntimeError) and BUSY in str(e), repr(e)


def batch(n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, 1, 28, 28), dtype=np.uint8), rng.integers(0, 10, n)


# ---- a dropped status does not build ----------------------------------------------


def test_a_dropped_status_does_not_build(tmp_path):
    """Every dp_status-returning entry (DP_MUST_CHECK: warn_unused_result) is checked: the
    extension is compiled with -Werror=unused-result (setup.py), so a call whose status
    is dropped, the binding's included, is a build error; shown here by compiling, with
    the extension's own flags, a file that drops one (and the same file using it)."""
    flags = dp.build_info()["cflags"].split()
    assert "-Werror=unused-result" in flags
    flags = [f for f in flags if f.startswith(("-std", "-W", "-D"))]
    body = textwrap.dedent("""
        #include "backend.h"
        int f(dp_device *dev, const dp_conv_geom *g, const float *x, const float *w, float *y) {
          %s
        }
    """)
    for statement, builds in (("dev->backend->conv2d_forward(dev, g, 1, x, w, NULL, y, NULL); return 0;", False),
                              ("(void)dev->backend->conv2d_forward(dev, g, 1, x, w, NULL, y, NULL); return 0;", False),
                              ("return (int)dev->backend->conv2d_forward(dev, g, 1, x, w, NULL, y, NULL);", True)):
        src = tmp_path / "drop.c"
        src.write_text(body % statement)
        out = subprocess.run(["gcc", *flags, "-I", str(CSRC), "-I", str(ROOT / "kernels"), "-c", str(src), "-o",
                              str(tmp_path / "drop.o")], capture_output=True, text=True)
        assert (out.returncode == 0) == builds, (statement, out.stderr[-2000:])
        if not builds:
            assert "unused-result" in out.stderr, out.stderr[-2000:]


# ---- (a) one model, two threads --------------------------------------------------


def test_sgd_step_marks_the_model_busy_for_other_threads():
    """sgd_step runs without the GIL: meanwhile another thread's calls on the
    model (and reads through a view of its buffers) are refused, not raced."""
    net = dp.models.Sequential([("flatten",), ("dense", 2048), ("relu",), ("dense", 10)])  # 1.6M parameters
    view = net._model.params_tensor()
    steps = 200
    done = threading.Event()

    def stepper(errors):
        try:
            for _ in range(steps):
                net._model.sgd_step(0.01, momentum=0.9)
        finally:
            done.set()

    seen = []

    def prober(errors):
        while not done.is_set():
            attempt(net._model.get_grads, seen)
            attempt(net._model.grads_tensor, seen)
            attempt(view.numpy, seen)

    errors = run_concurrently(stepper, prober)
    assert errors == [[], []], errors
    assert_only_busy(seen)
    assert seen, "no call was refused while sgd_step ran without the GIL"
    # the model is idle again and whole
    assert np.isfinite(net._model.get_params()).all()
    net._model.sgd_step(0.01)
    np.testing.assert_array_equal(view.numpy(), net._model.get_params())


def test_two_threads_training_one_model_fail_cleanly():
    """Both threads train, step and read one model until each has had 20
    calls go through: the others are refused as busy, none crashes."""
    net = dp.models.LeNet()
    X, y = batch(64)
    counts = [0, 0]
    deadline = time.monotonic() + 120

    def trainer(i):
        calls = [lambda: net.train_step(X, y, 0.05), lambda: net.replicas[0].sgd_step(0.01), net._model.get_grads,
                 lambda: net._model.predict(X[:8]), lambda: net._model.evaluate(X[:8], y[:8])]

        def loop(errors):
            k = 0
            while counts[i] < 20 and time.monotonic() < deadline:
                counts[i] += attempt(calls[k % len(calls)], errors)
                k += 1
        return loop

    errors = run_concurrently(trainer(0), trainer(1))
    for errs in errors:
        assert_only_busy(errs)
    assert counts == [20, 20]
    # usable afterwards: a step trains and nothing is left marked busy
    before = net._model.get_params()
    loss, _ = net.train_step(X, y, 0.05)
    assert np.isfinite(loss)
    assert not np.array_equal(before, net._model.get_params())


def test_mirrored_training_marks_every_replica_busy(logical_cpus):
    """While a Mirrored step runs, the replicas refuse other threads' calls,
    and so does all_reduce over views of their gradient buffers."""
    logical_cpus(2)
    net = dp.models.LeNet(devices=["cpu:0", "cpu:1"])
    X, y = batch(512)
    done = threading.Event()

    def trainer(errors):
        try:
            for _ in range(6):
                net.train_step(X, y, 0.05)
        finally:
            done.set()

    grads = [r.grads for r in net.replicas]  # views of the replicas' gradient buffers
    reduce_refused, other_refused = [], []

    def meddler(errors):
        while not done.is_set():
            attempt(lambda: dp.all_reduce(grads), reduce_refused)
            attempt(lambda: net.replicas[1].sgd_step(0.0), other_refused)
            attempt(net.replicas[1]._model.get_params, other_refused)

    errors = run_concurrently(trainer, meddler)
    assert errors == [[], []], errors
    assert_only_busy(reduce_refused + other_refused)
    assert reduce_refused, "all_reduce wrote into the replicas' buffers while their step ran"
    assert other_refused, "no replica call was refused while the mirrored step ran without the GIL"
    # lr 0 steps and all-reduces of equal gradients keep the replicas identical
    net.train_step(X, y, 0.05)
    p0, p1 = (r._model.get_params() for r in net.replicas)
    np.testing.assert_array_equal(p0, p1)


def test_init_of_a_live_object_is_refused():
    """__init__ on a live object is refused; a Mirrored or Resident cannot be
    initialized twice."""
    net = dp.models.LeNet()
    with pytest.raises(RuntimeError, match="already initialized"):
        net._model.__init__((1, 28, 28), [("flatten",), ("dense", 10)])
    X, y = batch(16)
    resident = dp._core.Resident(net._model, X, y)
    with pytest.raises(RuntimeError, match="already initialized"):
        resident.__init__(net._model, X, y)
    assert resident.num_samples == 16


@pytest.mark.parametrize("bad", [
    dict(input_shape=(1, 28, 28), layers=[("flatten",), ("dense", 10), ("no such kind",)]),
    dict(input_shape=(1, 28, 28), layers=[("conv2d", 4, 99)]),
    dict(input_shape=(0, 28, 28), layers=[("flatten",), ("dense", 10)]),
    dict(input_shape=(1, 28, 28), layers=[("flatten",), ("dense", 10)], sources=[5, None]),
])
def test_a_failed_model_init_leaves_an_object_a_retry_initializes(bad):
    """A Model whose __init__ failed after it got its device (a bad layer, input
    shape or source) is left as new: it says "not initialized" to every method
    until an __init__ succeeds, a retry is not refused as "already
    initialized", and the device reference it took is given back."""
    def cpu0_refs():
        gc.collect()
        return sum(r for n, _, _, _, _, r in dp._core.live_devices() if n == "cpu:0")

    keep = dp._core.Model((1, 28, 28), [("flatten",), ("dense", 10)])  # cpu:0 stays alive throughout
    before = cpu0_refs()
    m = dp._core.Model.__new__(dp._core.Model)
    with pytest.raises((ValueError, TypeError)):
        m.__init__(**bad)
    assert cpu0_refs() == before
    assert m.device is None and m.nparams == 0
    with pytest.raises(RuntimeError, match="Model is not initialized"):
        m.get_params()
    m.__init__((1, 28, 28), [("flatten",), ("dense", 10)])
    assert cpu0_refs() == before + 1
    X, y = batch(8)
    loss, correct = m.train_step(X, y, 0.1)
    assert np.isfinite(loss) and 0 <= correct <= 8
    assert m.get_params().shape == (m.nparams,) and m.nparams >= 28 * 28 * 10 + 10
    with pytest.raises(RuntimeError, match="already initialized"):
        m.__init__((1, 28, 28), [("flatten",), ("dense", 10)])
    del m
    assert cpu0_refs() == before
    del keep


# ---- (b) all_reduce and a list that changes meanwhile ----------------------------


def test_all_reduce_of_a_list_another_thread_empties(logical_cpus):
    """The reduction runs without the GIL; the list is emptied and refilled
    meanwhile. It reduces the tensors it was given, and only those."""
    logical_cpus(2)
    n = 1 << 20
    for _ in range(5):
        a = dp.tensor(np.full(n, 1.0, np.float32), device="cpu:0")
        b = dp.tensor(np.full(n, 2.0, np.float32), device="cpu:1")
        other = dp.tensor(np.full(n, 5.0, np.float32), device="cpu:0")
        items = [a, b]
        started = threading.Event()

        def mutate(errors):
            started.wait()
            items.clear()
            items.append(other)

        def reduce(errors):
            started.set()
            dp._core.all_reduce(items, 0)

        assert run_concurrently(reduce, mutate) == [[], []]
        np.testing.assert_array_equal(a.numpy(), np.full(n, 3.0, np.float32))
        np.testing.assert_array_equal(b.numpy(), np.full(n, 3.0, np.float32))
        np.testing.assert_array_equal(other.numpy(), np.full(n, 5.0, np.float32))


def test_all_reduce_of_a_list_subclass_whose_items_vanish(logical_cpus):
    """A list that gives up each item as it is iterated: the binding takes
    the items once, holds them, and reduces them."""
    logical_cpus(2)

    class Vanishing(list):
        def __iter__(self):
            while list.__len__(self):
                yield self.pop(0)

    a = dp.tensor(np.ones(4, np.float32), device="cpu:0")
    b = dp.tensor(np.ones(4, np.float32), device="cpu:1")
    items = Vanishing([a, b])
    dp._core.all_reduce(items, 0)
    assert len(items) == 0
    np.testing.assert_array_equal(a.numpy(), np.full(4, 2.0, np.float32))
    np.testing.assert_array_equal(b.numpy(), np.full(4, 2.0, np.float32))
    with pytest.raises(ValueError, match="at least one tensor"):
        dp._core.all_reduce(items, 0)


def test_all_reduce_survives_its_tensors_being_dropped_by_another_thread():
    """The list holds the only references to large tensors (their memory is
    unmapped when freed) and another thread empties it while the reduction
    runs: without strong references of its own the reduction would write
    into freed memory. Run in a child process so that a crash fails this test
    rather than the whole run."""
    code = textwrap.dedent("""
        import threading, warnings
        import numpy as np
        import dpcore as dp
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            dp.set_logical_devices("cpu", 2)
        n = 1 << 22  # 16 MiB per tensor: mmap'd, unmapped on free
        for _ in range(20):
            items = [dp.tensor(np.ones(n, np.float32), device=f"cpu:{i}") for i in range(2)]
            started = threading.Event()
            def drop():
                started.wait()
                items.clear()
            t = threading.Thread(target=drop)
            t.start()
            started.set()
            dp._core.all_reduce(items, 0)
            t.join()
            assert items == []
        print("all_reduce: ok")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}{proc.stderr}"
    assert "all_reduce: ok" in proc.stdout


# ---- (c) failures of the core become exceptions ------------------------------------


def test_a_failing_single_op_raises():
    """conv2d_forward whose shapes pass the binding's checks but whose im2col
    scratch (C*KH*KW x OH*OW floats, here about 1 PB) the CPU backend cannot
    allocate: the backend's DP_ERR_MEMORY, with its message, is the exception.
    (relu, the pools and sgd_update cannot fail on the CPU backend; their
    statuses are checked the same way, see the static test above.)"""
    x = np.zeros((1, 1, 1, 1), np.float32)
    w = np.zeros((1, 1, 4000, 4000), np.float32)
    with pytest.raises(MemoryError, match="cpu scratch"):
        dp._core.conv2d_forward(x, w, None, 1, 4000)
    # the ops device is still usable
    y = dp._core.conv2d_forward(np.ones((1, 1, 3, 3), np.float32), np.ones((1, 1, 2, 2), np.float32), None, 1, 0)
    np.testing.assert_array_equal(y, np.full((1, 1, 2, 2), 4.0, np.float32))


def test_a_failing_model_call_raises_and_leaves_the_model_idle():
    """A label outside [0, classes) passes the binding (int64, right shape) and
    is refused by the core while the GIL is released: ValueError with the
    core's message, and the model is not left marked busy."""
    net = dp.models.LeNet()
    X, y = batch(8)
    bad = y.copy()
    bad[3] = 10
    with pytest.raises(ValueError, match=r"label 10 at index 3 is outside \[0, 10\)"):
        net._model.train_step(X, bad, 0.1)
    with pytest.raises(ValueError, match=r"outside \[0, 10\)"):
        net._model.evaluate(X, bad)
    loss, _ = net._model.train_step(X, y, 0.1)
    assert np.isfinite(loss)
