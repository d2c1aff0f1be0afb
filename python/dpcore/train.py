"""dp.train: the training loop of *Dive into Deep Learning* 12.5 / 12.6.

Each step runs forward, backward and the SGD update in C with the GIL
released; Ctrl-C is seen between steps and stops training with
KeyboardInterrupt, leaving the model with the weights of the last whole step.
A step whose loss is not finite applies no update and raises
FloatingPointError naming the epoch, the step and the replicas.
"""
import os
import time
import warnings
from dataclasses import dataclass, field

import numpy as np

from . import _check, _core, progress as _progress
from .config import get_precision
from .data import ArrayIterator
from .models import Sequential

__all__ = ["History", "train"]


@dataclass
class History:
    """Per-epoch training record returned by :func:`train`."""

    train_loss: list = field(default_factory=list)
    train_acc: list = field(default_factory=list)
    test_acc: list = field(default_factory=list)
    epoch_seconds: list = field(default_factory=list)  # training pass only, evaluation excluded
    devices: list = field(default_factory=list)
    # dp.get_precision() when the training began ("float32", "fast" or "custom")
    precision: str = ""
    # dp.train(..., profile=True): the step timeline (dpcore.timeline.Timeline); None otherwise
    timeline: object = field(default=None, repr=False, compare=False)

    def _record(self):
        """The per-epoch lists, as a checkpoint stores them."""
        return {k: list(getattr(self, k)) for k in ("train_loss", "train_acc", "test_acc", "epoch_seconds", "devices")}

    @property
    def num_epochs(self):
        return len(self.train_loss)

    def summary(self):
        """The book's closing line, e.g. ``test acc: 0.84, 2.5 sec/epoch on ['cpu:0']``."""
        if not self.epoch_seconds:
            return "no epochs trained"
        per_epoch = sum(self.epoch_seconds) / len(self.epoch_seconds)
        acc = f"test acc: {self.test_acc[-1]:.2f}" if self.test_acc else f"train acc: {self.train_acc[-1]:.2f}"
        return f"{acc}, {per_epoch:.1f} sec/epoch on {self.devices}"

    def plot(self, ax=None):
        """Loss and accuracy curves (needs matplotlib)."""
        try:
            import matplotlib.pyplot as plt
        except ImportError as e:  # optional dependency
            raise ImportError("History.plot needs matplotlib: pip install matplotlib") from e
        if ax is None:
            _, ax = plt.subplots(figsize=(5, 3.5))
        epochs = range(1, self.num_epochs + 1)
        ax.plot(epochs, self.train_loss, label="train loss")
        ax.plot(epochs, self.train_acc, "--", label="train acc")
        if self.test_acc:
            ax.plot(epochs, self.test_acc, "-.", label="test acc")
        ax.set_xlabel("epoch")
        ax.grid(True)
        ax.legend()
        return ax


def _batches_or_none(it):
    """len(it) when the iterator knows it, else None."""
    try:
        return len(it)
    except TypeError:
        return None


def _check_iterable(name, value):
    """An iterable of batches (len() not needed), else TypeError naming the argument."""
    if isinstance(value, (np.ndarray, str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(f"{name} must be an iterable of (images, labels) batches, e.g. dp.data.from_arrays(X, y, "
                        f"batch_size), got {type(value).__name__} {_check.shown(value)}")
    return value


def _resident_by_default(net, train_iter):
    """On CUDA replicas, for a dp.data iterator whose arrays take at most a
    quarter of the smallest GPU's memory (the rest is the model's)."""
    if getattr(net, "_pipeline", None) is not None:
        return False  # a pipeline's first stage takes host batches
    if not isinstance(train_iter, ArrayIterator) or not any(d.startswith("cuda") for d in net.devices):
        return False
    gpus = _core.runtime_info()["cuda_devices"]
    return bool(gpus) and train_iter.X.nbytes + train_iter.y.nbytes <= min(g["memory_bytes"] for g in gpus) // 4


def _epoch_steps(net, train_iter, residents, lr, momentum, weight_decay):
    """One epoch's SGD steps, each yielding (run, batch): run() takes the step
    and returns (loss_sum, correct, samples); batch() the host (images,
    labels) it trains on (for check_numerics), from the rows of the resident
    dataset or the iterator's host batches."""
    if residents is not None:
        for rows in train_iter.index_batches():
            yield (lambda rows=rows: net.train_step_rows(residents, rows, lr, momentum, weight_decay) + (len(rows),),
                   lambda rows=rows: (train_iter.X[rows], train_iter.y[rows]))
        return
    # one replica: its own step; several: scatter, parallel forward/backward, all-reduce, step
    step = (net._mirrored or net._model).train_step
    for X, y in net._labelled_batches(train_iter, "train_iter"):
        yield (lambda X=X, y=y: step(X, y, lr, momentum, weight_decay) + (len(y),)), (lambda X=X, y=y: (X, y))


def _nonfinite_values(X):
    """'1 NaN value(s) at sample 17', ... for the non-finite values of a float batch (None: all finite)."""
    X = np.asarray(X)
    if X.dtype.kind != "f" or len(X) == 0:
        return None
    flat = X.reshape(len(X), -1)
    parts = []
    for name, mask in (("NaN", np.isnan(flat)), ("+inf", np.isposinf(flat)), ("-inf", np.isneginf(flat))):
        count = int(mask.sum())
        if count:
            samples = np.flatnonzero(mask.any(axis=1))
            shown = ", ".join(str(int(i)) for i in samples[:8]) + (", ..." if len(samples) > 8 else "")
            parts.append(f"{count} {name} value(s) at sample{'s' if len(samples) > 1 else ''} {shown}")
    return ", ".join(parts) or None


_WHAT = {0: "output", 1: "output's gradient", 2: "parameter gradients"}


def _diagnose(net, X, y):
    """check_numerics: the input batch's non-finite values and the first layer
    whose output or gradient stops being finite, from a diagnostic re-run of
    the failed step's batch on replica 0 alone (the step applied nothing; the
    re-run keeps the parameters, momentum and running statistics)."""
    found = _nonfinite_values(X)
    lines = [f"the input batch has {found}" if found else "the input batch is finite"]
    layer, what = net._model.find_nonfinite(X, np.ascontiguousarray(y, dtype=np.int64))
    kinds = [kind for kind, _, _ in net._model.layers()]
    if layer >= 0:
        lines.append(f"the first non-finite values: layer {layer} ({kinds[layer]})'s {_WHAT[what]}")
    elif layer == -2:
        lines.append("every layer's output is finite; the loss is not (logits too far apart)")
    else:
        lines.append("a re-run of the batch on replica 0 alone is finite everywhere")
    return "; ".join(lines)


def _data_state(train_iter):
    """What a checkpoint records of the data order (a dp.data iterator's; None otherwise)."""
    if not isinstance(train_iter, ArrayIterator):
        return {"seed": None, "batch_size": None, "num_examples": None, "epochs_started": None}
    return {"seed": train_iter.seed if train_iter.shuffle else None, "batch_size": train_iter.batch_size,
            "num_examples": train_iter.num_examples, "epochs_started": train_iter._epochs_started}


def _resume(net, path, train_iter, hyper, history, seed_drawn):
    """Restore the checkpoint at path into net, train_iter and history; the
    number of epochs it holds. Refuses a checkpoint of other hyperparameters
    or another dataset: continuing it would not be the run it was."""
    from . import checkpoint

    state = checkpoint.load_training(net, path)
    saved = state["hyper"]
    differ = [f"{k} {saved[k]!r} (now {hyper[k]!r})" for k in ("lr", "momentum", "weight_decay") if saved[k] != hyper[k]]
    if differ:
        raise ValueError(f"resume: {path} was trained with other hyperparameters: {', '.join(differ)}; pass the same "
                         "ones, or resume=False to start again")
    data = state["data"]
    if isinstance(train_iter, ArrayIterator) and data["num_examples"] is not None:
        mine = _data_state(train_iter)
        differ = [f"{k} {data[k]} (now {mine[k]})" for k in ("batch_size", "num_examples") if data[k] != mine[k]]
        if differ:
            raise ValueError(f"resume: {path} was trained on other data: {', '.join(differ)}")
        if train_iter.shuffle and data["seed"] is not None and train_iter.seed != data["seed"]:
            if not seed_drawn:  # a seed the user chose: theirs, and it is not the run's
                raise ValueError(f"resume: {path} was trained with the data order of seed {data['seed']}, "
                                 f"train_iter has seed {train_iter.seed}; pass seed={data['seed']} (or no seed) "
                                 "to continue that run")
            train_iter.seed = data["seed"]  # a seed dpcore drew for this process: the run's is the file's
            train_iter.seed_drawn = False
        # the data order of the epochs to come: the iterator's epochs as the interrupted run counted them
        train_iter._epochs_started = data["epochs_started"]
    else:
        warnings.warn("resume: train_iter is not a dp.data iterator, so its order cannot be restored: the resumed "
                      "run sees the batches it yields now (not bitwise the run that was interrupted)",
                      RuntimeWarning, stacklevel=3)
    for key, values in state["history"].items():
        getattr(history, key)[:] = values
    return state["epoch"]


def train(net, train_iter, test_iter=None, num_epochs=10, lr=0.1, momentum=0.0, weight_decay=0.0, verbose=True,
          resident=None, check_numerics=False, progress=True, plot=False, checkpoint=None, resume=False,
          profile=False):
    """Train ``net`` with minibatch SGD on the mean softmax cross-entropy.

    train_iter / test_iter: iterables of (images, labels) batches, e.g. from
    ``dp.data.load_fashion_mnist`` or ``dp.data.from_arrays``. Prints one line
    per epoch and the book's closing line when ``verbose``. Returns a History.

    resident: copy the whole training set to every replica's device once, so
    that a step moves only its samples' indices and the device gathers the
    batch (the same batches in the same order). ``None`` (default): on for
    CUDA replicas when train_iter is a ``dp.data`` iterator whose arrays take
    at most a quarter of the GPU's memory, off otherwise; ``True`` needs such
    an iterator (its arrays are what is copied).

    A step whose loss is not finite (NaN or inf on any replica) applies no
    update, on every replica and process, and raises FloatingPointError naming
    the epoch, the step and the replicas: the model keeps the weights (and
    momentum, and BatchNorm statistics) of the last finite step. The check
    reads the loss the step computes anyway: it costs nothing.
    check_numerics: then also re-run the failed batch in a diagnostic mode and
    name the first layer whose output or gradient stopped being finite and
    the input batch's non-finite values (costs a copy of every layer's
    output, only after a failure).

    progress: a tqdm bar per epoch (steps, images/s, the running loss): a
    widget in a notebook, a text bar when stderr is a terminal, nothing
    otherwise (logs keep the per-epoch lines). See :mod:`dpcore.progress`.

    plot: True draws the book's figure (train loss, train acc, test acc) in
    the notebook and updates it in place each epoch (nothing outside a
    notebook); a path writes the figure there as a PNG each epoch
    (atomically). Needs matplotlib. See :mod:`dpcore.plotting`.

    checkpoint: a path; after every epoch the weights, BatchNorm statistics,
    momentum buffers, epoch count, data order and History are written there
    atomically (a safetensors file that ``dp.models.load`` also reads),
    replacing what was there. Its directory is checked before training starts.
    resume: continue from that checkpoint when it exists (from scratch when
    it does not): the epochs it holds count toward ``num_epochs``, and with a
    ``dp.data`` iterator the run continues bitwise as the interrupted one
    would have. The hyperparameters and the dataset's size and batch size
    must be the checkpoint's.

    profile: record every replica's step timeline in C (staging, forward,
    backward, each bucket's all-reduce, waiting, the update) into
    ``history.timeline`` (:class:`dpcore.timeline.Timeline`: ``plot()``,
    ``save('trace.json')`` for Perfetto, ``summary()``).
    """
    if not isinstance(net, Sequential):
        raise TypeError(f"net must be a dpcore model (e.g. dp.models.LeNet()), got {type(net).__name__}")
    _check_iterable("train_iter", train_iter)
    if test_iter is not None:
        _check_iterable("test_iter", test_iter)
    # an empty dp.data iterator is refused now, not after an epoch of training
    for name, it in (("train_iter", train_iter), ("test_iter", test_iter)):
        if isinstance(it, ArrayIterator) and len(it) == 0:
            raise ValueError(f"{name} yields no batches ({it.num_examples} examples, batch_size {it.batch_size}"
                             f"{', drop_last=True' if it.drop_last else ''}): an epoch needs at least one")
    num_epochs = _check.integer("num_epochs", num_epochs, 0)
    lr, momentum, weight_decay = _check.sgd_arguments(lr, momentum, weight_decay)
    verbose = _check.boolean("verbose", verbose)
    check_numerics = _check.boolean("check_numerics", check_numerics)
    progress = _check.boolean("progress", progress)
    profile = _check.boolean("profile", profile)
    if profile and getattr(net, "_pipeline", None) is not None:
        raise ValueError("profile=True records the data-parallel step timeline; a PipelineStrategy or "
                         "ModelParallelStrategy model has its own reports (net.pipeline_report(), "
                         "net.model_parallel_report())")
    resume = _check.boolean("resume", resume)
    if checkpoint is not None:
        checkpoint = _check.writable_file("checkpoint", checkpoint)
    elif resume:
        raise ValueError("resume=True needs checkpoint=<path>: the file to resume from")
    live_plot = None
    if plot is not False:
        from .plotting import LivePlot

        live_plot = LivePlot(plot)
    if resident is None:
        resident = _resident_by_default(net, train_iter)
    elif not isinstance(resident, bool):
        raise TypeError(f"resident must be True, False or None, got {type(resident).__name__}")
    elif resident and not isinstance(train_iter, ArrayIterator):
        raise TypeError("resident=True needs a dp.data iterator (dp.data.from_arrays or dp.data.load_fashion_mnist), "
                        f"whose arrays are copied to the devices; got {type(train_iter).__name__}")
    # whether dpcore drew the shuffling seed (before the processes of a job agree on rank 0's)
    seed_drawn = isinstance(train_iter, ArrayIterator) and train_iter.seed_drawn
    multi = net.multi_process
    if multi:
        from . import distributed

        if isinstance(train_iter, ArrayIterator) and train_iter.seed_drawn:
            # shuffled with a seed each process drew itself: rank 0's for all,
            # so that every process walks the same global batches
            train_iter.seed = distributed.broadcast_object(train_iter.seed, 0, net._timeout,
                                                           "the shuffling seed (rank 0's)")
            train_iter.seed_drawn = False

        # every process must make the same call: a difference found now is a
        # clear error on every process, not a wait at some later step
        distributed.agree("dp.train's arguments (num_epochs, lr, momentum, weight_decay, resident, "
                          "the number of training batches, test_iter given, checkpoint given, resume)",
                          (num_epochs, float(lr), float(momentum), float(weight_decay), bool(resident),
                           _batches_or_none(train_iter), test_iter is None, checkpoint is None, resume),
                          net._timeout)
        if getattr(net._pipeline, "across_ranks", False):
            devices = list(net.devices)  # the job's ('rankQ/dev')
        else:
            per_process = distributed.allgather_object(list(net.devices), net._timeout, "dp.train's device lists")
            devices = [f"rank{q}/{d}" for q, names in enumerate(per_process) for d in names]
        verbose = verbose and distributed.rank() == 0  # one process prints
    else:
        devices = list(net.devices)
    history = History(devices=devices, precision=get_precision())
    hyper = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay}
    first_epoch = 0
    if resume and os.path.exists(checkpoint):
        first_epoch = min(_resume(net, checkpoint, train_iter, hyper, history, seed_drawn), num_epochs)
        history.devices = devices
        if verbose:
            print(f"resumed from {checkpoint} after epoch {first_epoch}", flush=True)
    show_progress = progress and (not multi or distributed.rank() == 0)
    residents = net.make_resident(train_iter.X, train_iter.y) if resident and num_epochs > first_epoch else None
    if profile:
        from . import timeline as _timeline

        with _timeline.profile(net) as recorded:
            _epochs(net, train_iter, test_iter, first_epoch, num_epochs, lr, momentum, weight_decay, residents,
                    check_numerics, show_progress, verbose, checkpoint, hyper, history, live_plot, multi)
        history.timeline = recorded.timeline
    else:
        _epochs(net, train_iter, test_iter, first_epoch, num_epochs, lr, momentum, weight_decay, residents,
                check_numerics, show_progress, verbose, checkpoint, hyper, history, live_plot, multi)
    if verbose and num_epochs:
        print(history.summary(), flush=True)
    return history


def _epochs(net, train_iter, test_iter, first_epoch, num_epochs, lr, momentum, weight_decay, residents,  # noqa: C901
            check_numerics, show_progress, verbose, checkpoint, hyper, history, live_plot, multi):
    """dp.train's epochs from first_epoch (its arguments checked)."""
    if multi:
        from . import distributed
    for epoch in range(first_epoch, num_epochs):
        loss_sum, correct, seen = 0.0, 0, 0
        bar = _progress.bar(show_progress, _batches_or_none(train_iter), f"epoch {epoch + 1}/{num_epochs}")
        start = last_shown = time.perf_counter()
        try:
            steps = _epoch_steps(net, train_iter, residents, lr, momentum, weight_decay)
            for step, (run, batch) in enumerate(steps, 1):
                try:
                    batch_loss, batch_correct, n = run()
                except FloatingPointError as e:
                    where = f"training stopped at epoch {epoch + 1}, step {step}: {e}"
                    if check_numerics:
                        where += f". check_numerics: {_diagnose(net, *batch())}"
                    else:
                        where += (f". Try a smaller learning rate (lr={lr}), or dp.train(..., check_numerics=True) "
                                  "to name the first non-finite layer and input values")
                    raise FloatingPointError(where) from None
                loss_sum += batch_loss
                correct += batch_correct
                seen += n
                bar.update(1)
                now = time.perf_counter()
                if now - last_shown >= _progress.MIN_INTERVAL_S:  # the text costs more than the bar's counter
                    bar.set_postfix_str(f"loss {loss_sum / seen:.3f}, {seen / (now - start):.0f} images/s",
                                        refresh=False)
                    last_shown = now
        finally:
            bar.close()
        seconds = time.perf_counter() - start
        if seen == 0:
            raise ValueError("train_iter yielded no samples: an epoch needs at least one batch")
        if multi:
            # the job's epoch lasts as long as its slowest process; every
            # process records the same History
            seconds = max(distributed.allgather_object(seconds, net._timeout, f"the end of epoch {epoch + 1}"))
            distributed.agree(f"the parameters after epoch {epoch + 1} (their digest)", net.digest(), net._timeout)
        history.epoch_seconds.append(seconds)
        history.train_loss.append(loss_sum / seen)
        history.train_acc.append(correct / seen)
        line = (f"epoch {epoch + 1}/{num_epochs}: loss {history.train_loss[-1]:.3f}, "
                f"train acc {history.train_acc[-1]:.3f}")
        if test_iter is not None:
            history.test_acc.append(net._evaluate(test_iter, False, "test_iter").accuracy)
            line += f", test acc {history.test_acc[-1]:.3f}"
        if verbose:
            print(f"{line}, {seconds:.1f} sec", flush=True)
        if checkpoint is not None:
            net._write(checkpoint, training={"epoch": epoch + 1, "hyper": hyper, "data": _data_state(train_iter),
                                             "history": history._record()})
        if live_plot is not None and (not multi or distributed.rank() == 0):  # one process draws
            live_plot.update(history)
