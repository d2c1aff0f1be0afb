"""dp.train's notebook experience outside a notebook: the progress bar (a
terminal gets one, a pipe does not), the live figure written to a file, and
resumable checkpoints: an interrupted run resumed ends with bitwise the
weights of the run that was not interrupted. (tests/test_notebooks.py runs the
notebooks in a real Jupyter kernel: the widget and the inline figure.)"""
import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import textwrap

import numpy as np
import pytest

import dpcore as dp
from dpcore import plotting
from dpcore.data import ArrayIterator


def data(n=320, seed=0):
    rng = np.random.default_rng(seed)
    return rng.random((n, 1, 28, 28), dtype=np.float32), rng.integers(0, 10, n)


def weights_equal(a, b):
    wa, wb = a.get_weights(), b.get_weights()
    return wa.keys() == wb.keys() and all(np.array_equal(wa[k].view(np.uint32), wb[k].view(np.uint32)) for k in wa)


# ---- progress ---------------------------------------------------------------------------------

SCRIPT = textwrap.dedent("""
    import numpy as np, dpcore as dp
    rng = np.random.default_rng(0)
    X, y = rng.random((96, 1, 28, 28), dtype=np.float32), rng.integers(0, 10, 96)
    it = dp.data.from_arrays(X, y, batch_size=32)
    dp.train(dp.models.LeNet(), it, it, num_epochs=2, lr=0.1, progress={progress})
""")


def run_with_stderr_on_a_terminal(code):
    """(exit status, what the process wrote to its terminal stderr, its stdout)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a new pty is 0 columns wide
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=slave, close_fds=True)
    os.close(slave)
    chunks = []
    while True:
        ready, _, _ = select.select([master], [], [], 120)
        if not ready:
            proc.kill()
            break
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the child closed its end
            break
        if not chunk:
            break
        chunks.append(chunk)
    out = proc.stdout.read().decode()
    status = proc.wait(timeout=120)
    os.close(master)
    return status, b"".join(chunks).decode(errors="replace"), out


def test_a_terminal_gets_a_bar_per_epoch():
    status, terminal, out = run_with_stderr_on_a_terminal(SCRIPT.format(progress=True))
    assert status == 0, terminal + out
    for epoch in (1, 2):
        assert f"epoch {epoch}/2" in terminal, terminal
    assert "3/3" in terminal, terminal  # the bar reached the epoch's 3 steps
    assert "\r" in terminal  # redrawn in place
    # the per-epoch lines and the book's closing line stay, on stdout
    assert "epoch 2/2: loss" in out and "sec/epoch on ['cpu:0']" in out, out


def test_progress_false_shows_no_bar_on_a_terminal():
    status, terminal, out = run_with_stderr_on_a_terminal(SCRIPT.format(progress=False))
    assert status == 0, terminal + out
    assert "epoch 1/2" not in terminal, terminal
    assert "epoch 2/2: loss" in out


def test_a_pipe_gets_no_bar():
    proc = subprocess.run([sys.executable, "-c", SCRIPT.format(progress=True)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "epoch 1/2" not in proc.stderr and "it/s" not in proc.stderr, proc.stderr
    assert "epoch 2/2: loss" in proc.stdout


def test_the_bar_counts_steps_and_shows_loss_and_speed(monkeypatch):
    """The bar dp.train drives, recorded: one update per step, closed each epoch,
    its text naming the running loss and images/s."""
    from dpcore import progress

    bars = []

    class Recorder:
        def __init__(self, enabled, total, desc, unit="step"):
            self.enabled, self.total, self.desc, self.n, self.texts, self.closed = enabled, total, desc, 0, [], False
            bars.append(self)

        def update(self, n=1):
            self.n += n

        def set_postfix_str(self, text, refresh=True):
            self.texts.append(text)

        def close(self):
            self.closed = True

    monkeypatch.setattr(progress, "bar", Recorder)
    monkeypatch.setattr(progress, "MIN_INTERVAL_S", 0.0)
    X, y = data(100)
    dp.train(dp.models.LeNet(), dp.data.from_arrays(X, y, batch_size=32), num_epochs=2, verbose=False)
    assert [(b.desc, b.total, b.n, b.closed, b.enabled) for b in bars] == [
        ("epoch 1/2", 4, 4, True, True), ("epoch 2/2", 4, 4, True, True)]
    assert all("loss " in t and "images/s" in t for t in bars[0].texts) and bars[0].texts


def test_evaluate_shows_a_bar_for_a_large_set_only(monkeypatch):
    from dpcore import models, progress

    shown = []
    real_bar = progress.bar
    monkeypatch.setattr(progress, "bar", lambda enabled, *a, **k: shown.append(enabled) or real_bar(False, *a, **k))
    X, y = data(64)
    net = dp.models.LeNet()
    net.evaluate(dp.data.from_arrays(X, y, batch_size=1))  # 64 batches
    net.evaluate(dp.data.from_arrays(X, y, batch_size=32))  # 2 batches
    net.evaluate(dp.data.from_arrays(X, y, batch_size=32), progress=True)
    assert models.EVALUATE_BAR_BATCHES <= 64
    assert shown == [True, False, True]


# ---- the live figure ------------------------------------------------------------------------------

def test_plot_to_a_file_writes_the_books_figure_each_epoch(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is a test requirement (requirements-dev.txt)")
    X, y = data(64)
    it = dp.data.from_arrays(X, y, batch_size=32)
    path = tmp_path / "curves.png"
    history = dp.train(dp.models.LeNet(), it, it, num_epochs=2, lr=0.1, verbose=False, plot=str(path))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in os.listdir(tmp_path) if p != "curves.png"], os.listdir(tmp_path)  # no temporaries left
    figure = plotting.draw(history)
    lines = figure.axes[0].get_lines()
    assert [line.get_label() for line in lines] == ["train loss", "train acc", "test acc"]
    np.testing.assert_array_equal(lines[0].get_ydata(), history.train_loss)
    np.testing.assert_array_equal(lines[2].get_ydata(), history.test_acc)


def test_plot_true_outside_a_notebook_draws_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    X, y = data(32)
    dp.train(dp.models.LeNet(), dp.data.from_arrays(X, y, batch_size=32), num_epochs=1, verbose=False, plot=True)
    assert os.listdir(tmp_path) == []


def test_plot_refuses_what_is_neither_a_flag_nor_a_path():
    X, y = data(32)
    with pytest.raises(TypeError, match="plot must be True, False or a path"):
        dp.train(dp.models.LeNet(), dp.data.from_arrays(X, y, batch_size=32), num_epochs=1, plot=3)


# ---- resumable training ------------------------------------------------------------------------------

class Interrupted(Exception):
    pass


class InterruptingIterator(ArrayIterator):
    """An ArrayIterator that raises in epoch `at_epoch` (1-based) before batch `at_batch`."""

    def __init__(self, *args, at_epoch, at_batch, **kwargs):
        super().__init__(*args, **kwargs)
        self.at_epoch, self.at_batch = at_epoch, at_batch

    def __iter__(self):
        batches = super().__iter__()
        epoch = self._epochs_started
        for i, batch in enumerate(batches):
            if epoch == self.at_epoch and i == self.at_batch:
                raise Interrupted(f"epoch {epoch}, batch {i}")
            yield batch


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_an_interrupted_run_resumed_equals_the_uninterrupted_one_bitwise(tmp_path, replicas, momentum):
    dp.set_logical_devices("cpu", replicas)
    try:
        devices = [f"cpu:{i}" for i in range(replicas)]
        X, y = data()
        Xt, yt = data(64, seed=1)
        kwargs = dict(num_epochs=4, lr=0.05, momentum=momentum, weight_decay=1e-4, verbose=False)

        straight = dp.models.LeNet(devices=devices)
        expected = dp.train(straight, dp.data.from_arrays(X, y, 64, shuffle=True, seed=7),
                            dp.data.from_arrays(Xt, yt, 64), **kwargs)

        path = tmp_path / "run.safetensors"
        first = dp.models.LeNet(devices=devices)
        with pytest.raises(Interrupted):
            dp.train(first, InterruptingIterator(X, y, 64, shuffle=True, seed=7, at_epoch=3, at_batch=2),
                     dp.data.from_arrays(Xt, yt, 64), checkpoint=path, **kwargs)

        # a new process would start from a fresh model and a fresh iterator
        second = dp.models.LeNet(devices=devices, seed=123)
        resumed = dp.train(second, dp.data.from_arrays(X, y, 64, shuffle=True, seed=7),
                           dp.data.from_arrays(Xt, yt, 64), checkpoint=path, resume=True, **kwargs)
        assert weights_equal(straight, second)
        for r in second._replicas:
            np.testing.assert_array_equal(r.get_velocity().view(np.uint32),
                                          straight._model.get_velocity().view(np.uint32))
        assert resumed.train_loss == expected.train_loss and resumed.test_acc == expected.test_acc
        assert resumed.num_epochs == 4
        assert second.replicas_identical()
    finally:
        dp.set_logical_devices("cpu", 1)


def test_resume_without_a_checkpoint_starts_fresh_and_a_finished_run_trains_no_more(tmp_path, capsys):
    X, y = data(128)
    path = tmp_path / "run.safetensors"
    net = dp.models.LeNet()
    first = dp.train(net, dp.data.from_arrays(X, y, 64, shuffle=True, seed=1), num_epochs=2, lr=0.1,
                     checkpoint=path, resume=True, verbose=False)
    assert first.num_epochs == 2 and path.exists()
    again = dp.models.LeNet(seed=5)
    history = dp.train(again, dp.data.from_arrays(X, y, 64, shuffle=True, seed=1), num_epochs=2, lr=0.1,
                       checkpoint=path, resume=True)
    assert history.train_loss == first.train_loss
    assert weights_equal(net, again)
    assert "resumed from" in capsys.readouterr().out


def test_a_training_checkpoint_is_a_model_file_too(tmp_path):
    X, y = data(64)
    path = tmp_path / "run.safetensors"
    net = dp.models.LeNet()
    dp.train(net, dp.data.from_arrays(X, y, 32), num_epochs=1, lr=0.1, momentum=0.9, checkpoint=path, verbose=False)
    loaded = dp.models.load(path)
    assert type(loaded) is dp.models.LeNet and weights_equal(net, loaded)
    safetensors = pytest.importorskip("safetensors.numpy")
    tensors = safetensors.load_file(str(path))
    assert set(tensors) == set(net.get_weights()) | {"__momentum__." + k for k in net.get_weights()}


def test_resume_refuses_other_hyperparameters_data_or_model(tmp_path):
    X, y = data(64)
    path = tmp_path / "run.safetensors"
    it = dp.data.from_arrays(X, y, 32)
    dp.train(dp.models.LeNet(), it, num_epochs=1, lr=0.1, checkpoint=path, verbose=False)
    with pytest.raises(ValueError, match=r"other hyperparameters: lr 0.1 \(now 0.2\)"):
        dp.train(dp.models.LeNet(), it, num_epochs=2, lr=0.2, checkpoint=path, resume=True, verbose=False)
    with pytest.raises(ValueError, match=r"other data: batch_size 32 \(now 16\)"):
        dp.train(dp.models.LeNet(), dp.data.from_arrays(X, y, 16), num_epochs=2, lr=0.1, checkpoint=path,
                 resume=True, verbose=False)
    with pytest.raises(dp.DataError, match="another model"):
        dp.train(dp.models.LeNet(num_classes=5), it, num_epochs=2, lr=0.1, checkpoint=path, resume=True,
                 verbose=False)
    shuffled = tmp_path / "shuffled.safetensors"
    dp.train(dp.models.LeNet(), dp.data.from_arrays(X, y, 32, shuffle=True, seed=1), num_epochs=1, lr=0.1,
             checkpoint=shuffled, verbose=False)
    plain = tmp_path / "plain.safetensors"
    dp.models.LeNet().save(plain)
    with pytest.raises(dp.DataError, match="not a training checkpoint"):
        dp.train(dp.models.LeNet(), it, num_epochs=2, lr=0.1, checkpoint=plain, resume=True, verbose=False)
    with pytest.raises(ValueError, match="trained with the data order of seed 1, train_iter has seed 2"):
        dp.train(dp.models.LeNet(), dp.data.from_arrays(X, y, 32, shuffle=True, seed=2), num_epochs=2, lr=0.1,
                 checkpoint=shuffled, resume=True, verbose=False)
    drawn = dp.data.from_arrays(X, y, 32, shuffle=True)  # a seed dpcore drew: the file's is taken
    dp.train(dp.models.LeNet(), drawn, num_epochs=2, lr=0.1, checkpoint=shuffled, resume=True, verbose=False)
    assert drawn.seed == 1
    with pytest.raises(ValueError, match="resume=True needs checkpoint"):
        dp.train(dp.models.LeNet(), it, num_epochs=1, resume=True)


def test_a_damaged_training_state_is_refused(tmp_path):
    X, y = data(64)
    path = tmp_path / "run.safetensors"
    it = dp.data.from_arrays(X, y, 32)
    dp.train(dp.models.LeNet(), it, num_epochs=1, lr=0.1, momentum=0.9, checkpoint=path, verbose=False)
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    header = raw[8:8 + n]
    at = header.find(b'\\"epoch\\":1')
    assert at > 0, bytes(header[:400])
    damaged = bytearray(raw)
    damaged[8 + at + 9] = ord("2")  # epoch 1 -> 2: the state's digest no longer matches
    path.write_bytes(bytes(damaged))
    with pytest.raises(dp.DataError, match="the training state is damaged"):
        dp.train(dp.models.LeNet(), it, num_epochs=2, lr=0.1, momentum=0.9, checkpoint=path, resume=True)
    # and a flipped byte in a momentum tensor
    damaged = bytearray(raw)
    damaged[-3] ^= 0x40
    path.write_bytes(bytes(damaged))
    with pytest.raises(dp.DataError, match="is damaged"):
        dp.train(dp.models.LeNet(), it, num_epochs=2, lr=0.1, momentum=0.9, checkpoint=path, resume=True)
