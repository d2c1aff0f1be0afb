"""Inputs and call sequences a hostile user might try, each once answered with
a hang, silent garbage or an obscure error, now with a clear exception.

A call that could hang or crash runs in a subprocess with a deadline, so that a
regression fails its test instead of stopping pytest.
"""
import hashlib
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import dpcore as dp
from dpcore import checkpoint, ops

SUBPROCESS_TIMEOUT_S = 60


def run_python(code, timeout=SUBPROCESS_TIMEOUT_S, **env):
    """code run by this Python in a fresh process (the dpcore on this sys.path); its CompletedProcess."""
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), OMP_NUM_THREADS="1", **env)
    try:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                              env=environment)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the call did not return within {timeout} s (a hang):\n{code}")


def small_batch(n=4):
    X = np.random.default_rng(0).random((n, 1, 28, 28), dtype=np.float32)
    return X, np.arange(n, dtype=np.int64) % 10


# ---- reading a checkpoint from something that is not a regular file ------------------------------

@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_loading_a_fifo_is_refused_instead_of_blocking(tmp_path):
    """open() of a FIFO blocks until a writer comes: load, read and dp.train's resume waited forever."""
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    code = f"""
import numpy as np, dpcore as dp
from dpcore import checkpoint
path = {str(fifo)!r}
for call in (lambda: dp.models.load(path), lambda: checkpoint.read(path),
             lambda: dp.train(dp.models.LeNet(), dp.data.from_arrays(np.zeros((2, 1, 28, 28), np.float32), [0, 1], 2),
                              num_epochs=1, verbose=False, checkpoint=path, resume=True)):
    try:
        call()
        print("no error")
    except dp.DataError as e:
        print("DataError:", e)
"""
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 3 and all(line.startswith("DataError:") and "not a regular file" in line
                                   for line in lines), proc.stdout


def test_loading_a_device_or_directory_names_what_it_is(tmp_path):
    if os.path.exists("/dev/zero"):
        with pytest.raises(dp.DataError, match="not a regular file"):
            dp.models.load("/dev/zero")
    with pytest.raises(IsADirectoryError):
        dp.models.load(tmp_path)
    with pytest.raises(FileNotFoundError):
        dp.models.load(tmp_path / "absent.safetensors")


# ---- saving --------------------------------------------------------------------------------------

def test_save_to_a_long_multibyte_name(tmp_path):
    """A valid 255-byte name of 4-byte characters: the temporary's name was cut in characters, not
    bytes, and came out over NAME_MAX (ENAMETOOLONG) though the target's name fits."""
    name = tmp_path / ("\U0001F600" * 63 + ".st")
    assert len(name.name.encode()) == 255
    net = dp.models.LeNet(seed=1)
    net.save(name)
    assert np.array_equal(dp.models.load(name).get_weights()["0.weight"], net.get_weights()["0.weight"])
    assert os.listdir(tmp_path) == [name.name]  # no temporary left
    net.save(name)  # again, over the file (and its stale-temporary sweep, by the same prefix)
    assert os.listdir(tmp_path) == [name.name]


# ---- names, layer kinds ----------------------------------------------------------------------------

def test_repeated_tensor_names_are_refused_where_the_model_is_built():
    """names=['a', 'b', 'b'] gave two dense layers the tensor 'b.weight': get_weights silently
    returned one of them and set_weights(get_weights()) failed."""
    with pytest.raises(ValueError, match=r"layers 1 and 2 both have a tensor named 'b\.weight'"):
        dp.models.Sequential([("flatten",), ("dense", 10), ("dense", 10)], names=["a", "b", "b"])
    # layers without tensors may share a name; each tensor is then still named once
    net = dp.models.Sequential([("flatten",), ("dense", 10), ("relu",)], names=["x", "a", "x"])
    assert list(net.get_weights()) == ["a.weight", "a.bias"]


def test_a_name_in_the_momentum_namespace_is_refused():
    """A training checkpoint names the momentum buffers '__momentum__.<tensor>': a model tensor of that
    prefix made dp.train's first checkpoint fail, after its first epoch."""
    with pytest.raises(ValueError, match="__momentum__"):
        dp.models.Sequential([("flatten",), ("dense", 10)], names=["a", "__momentum__.b"])


def test_a_layer_kind_with_a_nul_character_is_unknown():
    """The core compared C strings, so 'conv2d\\x00zz' was a conv2d to it and unknown to the Python layer
    (a KeyError while drawing the weights)."""
    with pytest.raises(ValueError, match="unknown layer kind"):
        dp.models.Sequential([("conv2d\x00zz", 4, 3, 1, 0), ("flatten",), ("dense", 10)])
    with pytest.raises(ValueError, match="unknown layer kind"):
        dp._core.layer_shapes((1, 28, 28), [("relu\x00",), ("flatten",), ("dense", 10)], None)
    assert dp._core.layer_shapes((1, 28, 28), [("relu",), ("flatten",), ("dense", 10)], None)


# ---- single ops ------------------------------------------------------------------------------------

def test_sgd_update_refuses_a_gradient_of_another_shape():
    """The core sees flat buffers: g of shape (3, 2) for w of shape (2, 3) updated w with the wrong
    elements."""
    w, v = np.zeros((2, 3), np.float32), np.zeros((2, 3), np.float32)
    g = np.arange(6, dtype=np.float32).reshape(3, 2)
    with pytest.raises(ValueError, match="same shape"):
        ops.sgd_update(w, g, v, lr=1.0)
    assert not w.any() and not v.any()
    ops.sgd_update(w, g.T.copy(), v, lr=1.0)
    np.testing.assert_array_equal(w, -g.T)


def test_a_bad_timeout_message_shows_the_value():
    """PyErr_Format has no %g: the message read 'got %g'."""
    with pytest.raises(ValueError) as caught:
        dp._core.dist_barrier(-1.5, "x")
    assert "%g" not in str(caught.value) and "-1.5" in str(caught.value)


# ---- the environment ------------------------------------------------------------------------------

def test_a_malformed_fusion_switch_is_an_error(monkeypatch):
    """DPCORE_FUSE=off left fusion on, silently (only "0" turned it off); the other switches refuse
    anything but "0" and "1"."""
    monkeypatch.setenv("DPCORE_FUSE", "off")
    with pytest.raises(ValueError, match="DPCORE_FUSE"):
        dp.models.LeNet()
    monkeypatch.setenv("DPCORE_FUSE", "0")
    assert dp.models.LeNet()._model.fused_layers == []
    monkeypatch.setenv("DPCORE_FUSE", "")
    assert dp.models.LeNet()._model.fused_layers != []


def test_a_malformed_pinning_switch_is_an_error(monkeypatch, logical_cpus):
    """DPCORE_PIN_THREADS=yes left the replicas unpinned, silently (only "1" pinned them)."""
    logical_cpus(2)
    monkeypatch.setenv("DPCORE_PIN_THREADS", "yes")
    with pytest.raises(ValueError, match="DPCORE_PIN_THREADS"):
        dp.models.LeNet(devices=["cpu:0", "cpu:1"])
    monkeypatch.setenv("DPCORE_PIN_THREADS", "0")
    X, y = small_batch()
    assert dp.models.LeNet(devices=["cpu:0", "cpu:1"]).train_step(X, y, lr=0.1)[0] > 0


@pytest.mark.parametrize("name, value", [("DPCORE_OWN_GEMM", "2"), ("DPCORE_IMPLICIT_GEMM", "on"),
                                         ("DPCORE_WINOGRAD_S2", "true"), ("DPCORE_HUGE_PAGES", " 1")])
def test_a_malformed_switch_is_an_error_where_the_model_is_built(monkeypatch, name, value):
    """Each switch was read only where its path is considered: LeNet, whose layers never ask for
    the GEMM kernel, trained with DPCORE_OWN_GEMM=2 unnoticed. Every switch is checked when a
    model is built."""
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        dp.models.LeNet()
    monkeypatch.setenv(name, "0")
    X, y = small_batch()
    assert dp.models.LeNet().train_step(X, y, lr=0.1)[0] > 0


def test_a_malformed_cache_size_is_an_error_where_the_model_is_built(monkeypatch):
    """DPCORE_L2_BYTES that is not a size in [128K, 64M] was passed over silently for sysfs's
    value; "99999999999999999999M" also shifted a saturated strtoll (undefined behaviour)."""
    for value in ("garbage", "2G", "99999999999999999999M", "-1M", "64K", "3 M"):
        monkeypatch.setenv("DPCORE_L2_BYTES", value)
        with pytest.raises(ValueError, match="DPCORE_L2_BYTES"):
            dp.models.LeNet()
    for value in ("2M", "1048576", "512k", ""):
        monkeypatch.setenv("DPCORE_L2_BYTES", value)
        dp.models.LeNet()


# ---- data ------------------------------------------------------------------------------------------

def test_from_arrays_takes_big_endian_floats():
    """'>f4' is float32: it was refused as 'X must have dtype uint8 or float32 ...; got >f4'
    (while net.predict took it)."""
    X, y = small_batch()
    for dtype in (">f4", ">f8", ">f2"):
        it = dp.data.from_arrays(X.astype(dtype), y, batch_size=2)
        assert it.dtype == np.float32 and it.X.dtype.isnative
        np.testing.assert_array_equal(it.X, X.astype(dtype).astype(np.float32))


# ---- a training checkpoint whose data state is half missing -----------------------------------------

def _rewrite_training_state(path, edit):
    """Rewrite the training state of a checkpoint with edit(state), its digest recomputed (what a
    consistent but foreign writer could produce)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    meta = header["__metadata__"]
    state = json.loads(meta["dpcore_training"])
    edit(state)
    text = json.dumps(state, separators=(",", ":"))
    meta["dpcore_training"] = text
    meta["dpcore_training_sha256"] = hashlib.sha256(text.encode()).hexdigest()
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(len(head).to_bytes(8, "little") + head + raw[8 + n:])


def test_a_training_state_with_part_of_the_data_order_is_refused(tmp_path):
    """data {'epochs_started': null} beside a batch size and a count: resume set the iterator's
    epoch counter to None, and the next epoch died in a TypeError."""
    X, y = small_batch(8)
    path = tmp_path / "run.safetensors"
    dp.train(dp.models.LeNet(), dp.data.from_arrays(X, y, 4, shuffle=True, seed=1), num_epochs=1, lr=0.1,
             verbose=False, progress=False, checkpoint=path)
    _rewrite_training_state(path, lambda s: s["data"].__setitem__("epochs_started", None))
    with pytest.raises(dp.DataError, match="training state is damaged"):
        dp.train(dp.models.LeNet(), dp.data.from_arrays(X, y, 4, shuffle=True, seed=1), num_epochs=2, lr=0.1,
                 verbose=False, progress=False, checkpoint=path, resume=True)
    _rewrite_training_state(path, lambda s: s["data"].update(epochs_started=1, batch_size=0))
    with pytest.raises(dp.DataError, match="training state is damaged"):
        checkpoint.load_training(dp.models.LeNet(), path)
    # every field null (an iterator of another kind) still loads
    _rewrite_training_state(path, lambda s: s.__setitem__("data", dict.fromkeys(s["data"])))
    assert checkpoint.load_training(dp.models.LeNet(), path)["epoch"] == 1


# ---- threads -----------------------------------------------------------------------------------------

def test_set_weights_is_all_or_none_across_replicas(logical_cpus):
    """set_weights copied onto the replicas one call at a time: with replica 1 busy in another thread,
    replica 0 took the new weights, replica 1 refused, and the model trained on with replicas that
    differ. Now it is refused before any replica changes."""
    logical_cpus(2)
    net = dp.models.LeNet(devices=["cpu:0", "cpu:1"], seed=2)
    before = net.get_weights()
    new = {k: v + 1.0 for k, v in before.items()}
    busy = net._replicas[1]
    X = np.random.default_rng(1).random((4096, 1, 28, 28), dtype=np.float32)
    y = np.arange(len(X), dtype=np.int64) % 10
    # replica 1 alone, lr 0 (its weights stay), long enough to be seen busy
    worker = threading.Thread(target=lambda: busy.train_step(X, y, 0.0))
    worker.start()
    try:
        deadline = time.monotonic() + 30
        seen_busy = False
        while not seen_busy and worker.is_alive() and time.monotonic() < deadline:
            try:
                busy.get_state()
            except RuntimeError:
                seen_busy = True
        if not seen_busy:
            pytest.skip("the other thread's step ended before it could be seen running")
        with pytest.raises(RuntimeError, match="in use by another thread"):
            net.set_weights(new)
    finally:
        worker.join()
    assert net.replicas_identical()
    for name, w in net.get_weights().items():
        np.testing.assert_array_equal(w, before[name], err_msg=name)
    net.set_weights(new)  # idle now: every replica takes them
    assert net.replicas_identical()
    np.testing.assert_array_equal(net.get_weights()["0.weight"], new["0.weight"])


def test_set_replicas_checks_everything_before_copying():
    net = dp.models.LeNet(seed=4)
    before = net._model.get_params()
    ones = np.ones(net._model.nparams, np.float32)
    with pytest.raises(ValueError, match="velocity must have"):
        dp._core.set_replicas([net._model], ones, None, np.zeros(3, np.float32))
    with pytest.raises(TypeError, match="not a Model"):
        dp._core.set_replicas([net._model, 5], ones, None)
    np.testing.assert_array_equal(net._model.get_params(), before)


# ---- labels, empty sets, misnamed arguments ------------------------------------------------------

def test_a_uint64_label_beyond_int64_is_named_as_given():
    """uint64 2**63 + 5 was converted to int64 first and refused as -9223372036854775803."""
    net = dp.models.LeNet()
    X, _ = small_batch()
    y = np.array([0, 1, 2, 2**63 + 5], dtype=np.uint64)
    for call in (lambda: net.train_step(X, y, lr=0.1), lambda: net.evaluate([(X, y)]),
                 lambda: ops.softmax_cross_entropy(np.zeros((4, 10), np.float32), y)):
        with pytest.raises(ValueError) as caught:
            call()
        assert str(2**63 + 5) in str(caught.value) and "-9223372036854775803" not in str(caught.value)
    assert net.train_step(X, np.array([0, 1, 2, 3], dtype=np.uint64), lr=0.1)[0] > 0


def test_dp_train_names_an_empty_test_iter_before_training():
    """An empty test set was found after the first epoch's training, and the message named
    evaluate's data_iter, not dp.train's test_iter."""
    X, y = small_batch()
    net = dp.models.LeNet()
    before = net.get_weights()["0.weight"].copy()
    with pytest.raises(ValueError, match="test_iter"):
        dp.train(net, dp.data.from_arrays(X, y, 2), dp.data.from_arrays(X[:0], y[:0], 2), num_epochs=1,
                 verbose=False, progress=False)
    np.testing.assert_array_equal(net.get_weights()["0.weight"], before)  # refused before any step
    with pytest.raises(ValueError, match="train_iter"):
        dp.train(net, dp.data.from_arrays(X[:3], y[:3], 4, drop_last=True), num_epochs=1, verbose=False)
    with pytest.raises(ValueError, match="test_iter yielded no samples"):  # an empty set of another kind
        dp.train(net, dp.data.from_arrays(X, y, 2), [], num_epochs=1, verbose=False, progress=False)


def test_a_type_error_inside_a_users_iterator_is_not_renamed():
    """A TypeError raised by an iterable's own __iter__ was reported as 'data_iter must be an iterable'."""
    class Broken:
        def __iter__(self):
            raise TypeError("my own bug")

    with pytest.raises(TypeError, match="my own bug"):
        dp.models.LeNet().evaluate(Broken())
    with pytest.raises(TypeError, match="data_iter must be an iterable"):
        dp.models.LeNet().evaluate(5)


def test_save_over_a_directory_names_it_and_leaves_nothing(tmp_path):
    target = tmp_path / "model.safetensors"
    target.mkdir()
    (target / "inside").write_bytes(b"kept")
    with pytest.raises(IsADirectoryError) as caught:
        dp.models.LeNet().save(target)
    assert str(target) in str(caught.value) and ".tmp" not in str(caught.value)
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"] and (target / "inside").read_bytes() == b"kept"


def test_dp_tensor_refuses_a_uint64_beyond_int64():
    """Integers become int64 tensors: uint64 2**63 became -2**63, silently."""
    with pytest.raises(ValueError, match=str(2**63)):
        dp.tensor(np.array([1, 2**63], dtype=np.uint64))
    t = dp.tensor(np.array([1, 2**63 - 1], dtype=np.uint64))
    assert t.numpy().dtype == np.int64 and t.numpy()[1] == 2**63 - 1
