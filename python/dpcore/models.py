"""Models: sequential networks whose parameters live in one flat buffer in C.

``LeNet()`` is the network of *Dive into Deep Learning* 12.5. Parameter names
follow PyTorch's ``state_dict`` names for the equivalent ``torch.nn.Sequential``
(``'0.weight'``, ``'0.bias'``, ``'3.weight'``, ...), so weights move between the
two libraries with ``get_weights`` / ``set_weights``.
"""
import contextlib
import os
from collections import OrderedDict, namedtuple

import numpy as np

from . import _check, _core, checkpoint
from .batches import as_images, as_labels
from .devices import check_device, device_gpu, device_index, device_kind, device_threads
from .parallel import Tensor
from .strategy import (DEFAULT_BUCKET_MB, ModelParallelStrategy, PipelineStrategy, check_all_reduce_options,
                       get_strategy)

__all__ = ["Sequential", "LeNet", "ResNet18", "Metrics", "Replica", "load", "layer_kinds"]

# The layer kinds' table of the C core (csrc/layers.c): names, arguments,
# tensors and their init rules. Read here, never restated.
_LAYER_KINDS = _core.layer_kinds()
# dp.models' init= modes: those every tensor has a rule for
_INIT_MODES = tuple(dict.fromkeys(mode for kind in _LAYER_KINDS.values() for t in kind["tensors"] for mode in t[3]))
# init= of a model whose every tensor is about to be set (dp.models.load): no draw
_SKIP_INIT = object()


def layer_kinds():
    """The layer kinds a :class:`Sequential` takes: name -> dict with ``args``
    (argument names, in order), ``types``, ``defaults`` (of the optional ones),
    ``sources`` (how many leading arguments are layer indices it reads),
    ``joins`` ('sum': its output is the sum of its sources; else None),
    ``split`` (how ModelParallelStrategy splits it: 'output' channels,
    'channels' each alone, or None), ``view`` (its output is its input
    reshaped) and ``tensors``: (name, 'params' or 'state', shape as named
    extents, {init mode: rule}) in the order they are laid out and saved."""
    return _core.layer_kinds()


def _layer_spec_doc(name, info):
    """"('conv2d', out_channels, kernel, stride, padding)" for the docstring."""
    args = [a if a not in info["defaults"] else f"{a}={info['defaults'][a]!r}" for a in info["args"]]
    return "(" + ", ".join([repr(name)] + args) + (",)" if not args else ")")

Metrics = namedtuple("Metrics", ["loss", "accuracy", "num_examples"])


def _fnv1a64(a):
    """FNV-1a 64 over 8-byte words of an array's bits (the C core's digest)."""
    raw = np.ascontiguousarray(a).view(np.uint8).ravel()
    words = raw[: len(raw) // 8 * 8].view(np.uint64)
    h = 14695981039346656037
    for w in words.tolist():
        h = ((h ^ w) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    if len(raw) % 8:
        h = ((h ^ int.from_bytes(raw[len(raw) // 8 * 8:].tobytes(), "little")) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h


class Sequential:
    """A feed-forward network built from layer specs, trained by the C core.

    layers: list of tuples, each one of (see :func:`layer_kinds`)
        {layer_specs}.
    sources: optional, per layer: the index of the layer whose output it reads
        (-1: the model input; None: the previous layer). 'add' names both of its inputs.
    names: optional, per layer: the module name its parameters are saved under
        (default: the layer index, as torch.nn.Sequential names them).
    init: 'normal' draws weights from N(0, init_std) with zero biases (the book's
        LeNet); 'torch' is PyTorch's default (uniform in +-1/sqrt(fan_in) for
        weights and biases); 'd2l' is what d2l 12.6's train() makes of PyTorch's
        modules (weights N(0, init_std), biases PyTorch's). BatchNorm starts at
        gamma 1, beta 0. Each tensor's rule per mode is in :func:`layer_kinds`.
    devices: where the replicas live; default: the active strategy's devices
        (``with strategy.scope():``), else ``['cpu:0']``. threads: cores per
        replica (default: the device's share).
    sync_batchnorm: with several replicas, normalise with the statistics of the
        whole global batch (SyncBatchNorm) instead of each replica's shard.
    all_reduce, bucket_mb: how the replicas' gradients are all-reduced; default:
        the active strategy's (see :class:`dpcore.MirroredStrategy`), else
        ``'auto'`` and 25.
    """

    def __init__(self, layers, input_shape=(1, 28, 28), init_std=0.01, seed=0, threads=0, devices=None,
                 sources=None, names=None, init="normal", sync_batchnorm=False, all_reduce=None, bucket_mb=None):
        if not isinstance(layers, (list, tuple)) or not all(isinstance(spec, (list, tuple)) for spec in layers):
            raise TypeError(f"layers must be a list of layer tuples like ('dense', 10), got {_check.shown(layers)}")
        if not layers:
            raise ValueError("layers must hold at least one layer, got []")
        self._specs = [tuple(spec) for spec in layers]
        input_shape = _check.shape("input_shape", input_shape, 3)
        self._sources = None if sources is None else list(sources)
        if self._sources is not None and len(self._sources) != len(self._specs):
            raise ValueError(f"sources must have one entry per layer ({len(self._specs)}), got {len(self._sources)}")
        self._names = [str(i) for i in range(len(self._specs))] if names is None else list(names)
        if len(self._names) != len(self._specs):
            raise ValueError(f"names must have one entry per layer ({len(self._specs)}), got {len(self._names)}")
        self._check_tensor_names()
        if init is not _SKIP_INIT:
            _check.one_of("init", init, _INIT_MODES)
            init_std = _check.real("init_std", init_std, 0.0)
            seed = _check.integer("seed", seed, 0)
        threads = _check.integer("threads", threads, 0, _check.MAX_THREADS)
        sync_batchnorm = _check.boolean("sync_batchnorm", sync_batchnorm)
        strategy = get_strategy()
        self._pipeline = None
        if isinstance(strategy, (PipelineStrategy, ModelParallelStrategy)) and devices is None:
            self._build_pipeline(strategy, input_shape, threads, sync_batchnorm, init, init_std, seed)
            return
        if devices is None:
            devices = strategy.devices if strategy is not None else ["cpu:0"]
        devices = _check.device_names("devices", devices)
        if all_reduce is None:
            all_reduce = strategy.all_reduce if strategy is not None else "auto"
        if bucket_mb is None:
            bucket_mb = strategy.bucket_mb if strategy is not None else DEFAULT_BUCKET_MB
        all_reduce, bucket_mb = check_all_reduce_options(all_reduce, bucket_mb)
        devices = [check_device(d) for d in devices]
        if len(set(devices)) != len(devices):
            raise ValueError(f"devices must name each device once, got {devices}")
        # across the processes of an MPI job (MultiWorkerMirroredStrategy): the
        # seconds to wait for another process; 0 within one process
        self._timeout = strategy.timeout if strategy is not None and strategy._across else 0.0
        shares = strategy._threads if strategy is not None and strategy._threads else {}
        self._replicas = [
            _core.Model(tuple(input_shape), self._specs, threads or shares.get(d) or device_threads(d),
                        device_index(d), self._sources, device_kind(d),
                        device_gpu(d) if device_kind(d) == "cuda" else 0)
            for d in devices
        ]
        self._model = self._replicas[0]
        self.sync_batchnorm = bool(sync_batchnorm)
        self._mirrored = (_core.Mirrored(self._replicas, self.sync_batchnorm, all_reduce, int(bucket_mb * 2**20),
                                         self._timeout)
                          if len(self._replicas) > 1 or self._timeout else None)
        self._layout = self._model.param_layout()
        self._state_layout = self._model.state_layout()
        if init is not _SKIP_INIT:
            self._init_params(init, init_std, seed)
        if self._timeout:
            self._mirrored.broadcast_across()  # rank 0's parameters everywhere, checked

    def _check_tensor_names(self):
        """Every tensor's name ('<layer name>.<tensor>') unique and not one that a
        training checkpoint reserves: get_weights, set_weights and the files key
        the tensors by these names, so a repeat would silently drop one."""
        seen = {}
        for i, (spec, name) in enumerate(zip(self._specs, self._names)):
            kind = _LAYER_KINDS.get(spec[0]) if spec and isinstance(spec[0], str) else None
            for tensor in (kind["tensors"] if kind else ()):  # an unknown kind: the core refuses it
                full = f"{name}.{tensor[0]}"
                if full in seen:
                    raise ValueError(f"names: layers {seen[full]} and {i} both have a tensor named {full!r}; give "
                                     f"each layer with tensors its own name, got names={_check.shown(self._names)}")
                if full.startswith(checkpoint.MOMENTUM_PREFIX):
                    raise ValueError(f"names: layer {i}'s tensor {full!r} starts with {checkpoint.MOMENTUM_PREFIX!r}, "
                                     "which training checkpoints reserve for the momentum buffers")
                seen[full] = i

    def _build_pipeline(self, strategy, input_shape, threads, sync_batchnorm, init, init_std, seed):
        """The network cut into the stages of a PipelineStrategy (dpcore.pipeline), or
        each layer split over the devices of a ModelParallelStrategy (dpcore.tensor_parallel)."""
        if isinstance(strategy, ModelParallelStrategy):
            from .tensor_parallel import TensorParallel

            if sync_batchnorm:
                raise ValueError("sync_batchnorm has no meaning with ModelParallelStrategy: each BatchNorm channel "
                                 "already sees the whole batch")
            if strategy.across_ranks:
                from .tensor_parallel import TensorParallelRanks

                self._pipeline = TensorParallelRanks(self._specs, self._sources, input_shape, strategy.devices,
                                                     threads, strategy.replicas, strategy.timeout)
            else:
                self._pipeline = TensorParallel(self._specs, self._sources, input_shape, strategy.devices, threads,
                                                strategy.replicas)
        else:
            if sync_batchnorm:
                raise ValueError("sync_batchnorm is not available with PipelineStrategy: BatchNorm normalises each "
                                 "micro-batch with its own statistics")
            if strategy.across_ranks:
                from .pipeline_mpi import ProcessPipeline as Stages
            else:
                from .pipeline import Pipeline as Stages
            self._pipeline = Stages(self._specs, self._sources, input_shape, strategy, threads)
        # across the ranks of a job: the seconds to wait for another rank (dp.train then runs
        # as a job: one process prints, rank 0 writes checkpoints)
        self._timeout = getattr(self._pipeline, "_timeout", 0.0)
        self._replicas = [self._pipeline]
        self._model = self._pipeline
        self._mirrored = None
        self.sync_batchnorm = False
        self._layout = self._pipeline.param_layout()
        self._state_layout = self._pipeline.state_layout()
        if init is not _SKIP_INIT:
            self._init_params(init, init_std, seed)

    def pipeline_report(self):
        """Per stage of a PipelineStrategy model: its layers and device, busy and idle
        time per step, parameter and peak activation bytes, and the measured
        bubble beside (p - 1) / (m + p - 1) (:class:`dpcore.pipeline.PipelineReport`;
        ``.plot()`` draws the last step). Averaged over the steps since the
        model was built or since ``pipeline_report(reset=True)``."""
        from .pipeline import Pipeline
        from .pipeline_mpi import ProcessPipeline

        if not isinstance(self._pipeline, (Pipeline, ProcessPipeline)):
            raise ValueError("pipeline_report: this model was not built under a PipelineStrategy's scope")
        return self._pipeline.report()

    def model_parallel_report(self):
        """Parameter bytes per device of a ModelParallelStrategy model against the
        whole model's (:class:`dpcore.tensor_parallel.ModelParallelReport`)."""
        from .tensor_parallel import TensorParallel

        if not isinstance(self._pipeline, TensorParallel):
            raise ValueError("model_parallel_report: this model was not built under a ModelParallelStrategy's scope")
        return self._pipeline.report()

    def reset_pipeline_report(self):
        """Start pipeline_report's averages afresh (after warm-up steps, say)."""
        if not hasattr(self._pipeline, "reset_report"):
            raise ValueError("reset_pipeline_report: this model was not built under a PipelineStrategy's scope")
        self._pipeline.reset_report()

    def _init_params(self, init, init_std, seed):
        """Each parameter tensor by its kind's rule for this init mode, drawn
        from one generator in layout order (layer by layer, weight then bias)."""
        rng = np.random.default_rng(seed)
        flat = np.zeros(self._model.nparams, dtype=np.float32)
        fan_in = {}
        for layer, name, offset, shape in self._layout:
            size = int(np.prod(shape))
            # PyTorch's fan_in: the layer's first tensor (its weight) without its output extent
            fan_in.setdefault(layer, int(np.prod(shape[1:])))
            rule = self._tensor_rule(layer, name, init)
            if rule == "normal":
                flat[offset:offset + size] = rng.normal(0.0, init_std, size)
            elif rule == "fan_in_uniform":
                bound = 1.0 / np.sqrt(fan_in[layer])
                flat[offset:offset + size] = rng.uniform(-bound, bound, size)
            elif rule == "ones":
                flat[offset:offset + size] = 1.0
            elif rule != "zeros":
                raise AssertionError(f"layer {layer} {name}: unknown init rule {rule!r}")
        self._set_flat(flat)

    def _tensor_rule(self, layer, name, init):
        """The init rule of tensor `name` of layer `layer` under init mode `init`."""
        kind = _LAYER_KINDS[self._specs[layer][0]]
        return next(t[3][init] for t in kind["tensors"] if t[0] == name)

    def _set_flat(self, flat):
        """The same parameters on every replica (one copy each)."""
        self._set_replicas(params=flat)

    def _set_replicas(self, params=None, state=None, velocity=None):
        """The flat buffers given onto every replica. A model's replicas in one
        call of the core, all or none: another thread's step cannot slip in
        between two replicas and leave them with different weights."""
        if all(isinstance(replica, _core.Model) for replica in self._replicas):
            _core.set_replicas(self._replicas, params, state, velocity)
            return
        for replica in self._replicas:  # a pipeline's stages: its own Python objects
            for setter, flat in ((replica.set_params, params), (replica.set_state, state),
                                 (replica.set_velocity, velocity)):
                if flat is not None:
                    setter(flat)

    def _entries(self):
        """(name, buffer, offset, shape) of every parameter and running statistic,
        layer by layer (names as in PyTorch's state_dict; the order within a
        residual block can differ from the torch module's registration order)."""
        rows = [(layer, 0, f"{self._names[layer]}.{kind}", "params", offset, shape)
                for layer, kind, offset, shape in self._layout]
        rows += [(layer, 1, f"{self._names[layer]}.{kind}", "state", offset, shape)
                 for layer, kind, offset, shape in self._state_layout]
        rows.sort(key=lambda r: (r[0], r[1]))
        return [r[2:] for r in rows]

    # ---- description -------------------------------------------------------
    @property
    def input_shape(self):
        return self._model.input_shape

    @property
    def num_classes(self):
        return self._model.num_classes

    @property
    def num_params(self):
        """Number of trainable scalars (the flat buffer also holds alignment padding)."""
        return int(sum(np.prod(shape) for _, _, _, shape in self._layout))

    @property
    def devices(self):
        """The devices holding a replica, e.g. ``['cpu:0', 'cpu:1']``."""
        if self._pipeline is not None:
            return self._pipeline.devices
        return [replica.device for replica in self._replicas]

    def memory_stats(self):
        """Per replica, its device's memory arena: a dict (reserved_bytes,
        in_use_bytes, peak_in_use_bytes, chunks, blocks) on a CUDA device, None
        on a CPU device (plain host memory)."""
        return [replica.memory_stats() for replica in self._replicas]

    @property
    def all_reduce(self):
        """The all-reduce of the replicas' gradients: 'host', 'kernel' or 'nccl'
        (None for a single replica)."""
        return self._mirrored.all_reduce if self._mirrored is not None else None

    @property
    def gradient_buckets(self):
        """The gradient all-reduce's buckets, in the order the backward pass
        starts them: (begin, end, ready_layer) ranges of the flat gradient
        buffer, each started once layer ``ready_layer``'s backward is done
        (empty for a single replica)."""
        return self._mirrored.buckets if self._mirrored is not None else []

    @property
    def placement(self):
        """Where this process's replicas stand among the job's:
        {'processes', 'process', 'first', 'total', 'replicas_per_process'}
        (one process, first 0, total = its replicas, without a strategy across
        processes)."""
        if self._mirrored is not None:
            return self._mirrored.placement
        return {"processes": 1, "process": 0, "first": 0, "total": 1, "replicas_per_process": (1,)}

    @property
    def multi_process(self):
        """True for a model of MultiWorkerMirroredStrategy (replicas in several processes)
        or of a PipelineStrategy across processes (stages in several)."""
        return bool(self._timeout)

    def digest(self):
        """A 64-bit digest of the parameter and running-statistics bits (FNV-1a):
        equal on every replica of every process after every step."""
        if self._mirrored is not None:
            return self._mirrored.digest()
        return _fnv1a64(np.concatenate([self._model.get_params(), self._model.get_state()]))

    @property
    def replicas(self):
        """One :class:`Replica` per device: the pieces of chapter 12.5's training loop."""
        return [Replica(self, replica) for replica in self._replicas]

    def parameter_names(self):
        """Names of the trainable parameters (PyTorch's names)."""
        return [f"{self._names[layer]}.{kind}" for layer, kind, _, _ in self._layout]

    def summary(self):
        """A table of layers and output shapes, as a string."""
        lines = [f"{'#':>3}  {'layer':<8} {'output shape':<16} params"]
        counts = {}
        for layer, _, _, shape in self._layout:
            counts[layer] = counts.get(layer, 0) + int(np.prod(shape))
        for i, (kind, _, out) in enumerate(self._model.layers()):
            shape = (out[0],) if out[1:] == (1, 1) else out
            lines.append(f"{i:>3}  {kind:<8} {str(shape):<16} {counts.get(i, 0)}")
        lines.append(f"total parameters: {self.num_params}")
        return "\n".join(lines)

    def __repr__(self):
        return f"{type(self).__name__}(params={self.num_params}, devices={self.devices})"

    def replicas_identical(self):
        """True when every replica holds bitwise the same parameters and running
        statistics (they always should)."""
        def bits(r):
            return np.concatenate([r.get_params(), r.get_state()]).view(np.uint32)
        first = bits(self._replicas[0])
        return all(np.array_equal(first, bits(r)) for r in self._replicas[1:])

    # ---- weights -----------------------------------------------------------
    def get_weights(self):
        """An OrderedDict name -> float32 array (copies) of the parameters and the
        BatchNorm running statistics, with PyTorch's state_dict names."""
        buffers = {"params": self._model.get_params(), "state": self._model.get_state()}
        out = OrderedDict()
        for name, buffer, offset, shape in self._entries():
            size = int(np.prod(shape))
            out[name] = buffers[buffer][offset:offset + size].reshape(shape).copy()
        return out

    def set_weights(self, weights, allow_nonfinite=False):
        """Load weights from a dict name -> array (every name of get_weights, exact
        shapes; PyTorch's num_batches_tracked entries are ignored) or a list in order.
        Values are stored as float32: a value beyond float32's range is refused,
        and so is NaN or inf unless ``allow_nonfinite=True``."""
        allow_nonfinite = _check.boolean("allow_nonfinite", allow_nonfinite)
        entries = self._entries()
        names = [e[0] for e in entries]
        if not isinstance(weights, (dict, list, tuple)):
            raise TypeError(f"weights must be a dict name -> array (as get_weights returns) or a list of arrays, "
                            f"got {type(weights).__name__} {_check.shown(weights)}")
        if isinstance(weights, dict):
            given = {k: v for k, v in weights.items() if not str(k).endswith("num_batches_tracked")}
            missing = [n for n in names if n not in given]
            extra = [n for n in given if n not in names]
            if missing or extra:
                raise KeyError(f"weights do not match the model: missing {missing}, unexpected {extra}")
            values = [given[n] for n in names]
        else:
            values = list(weights)
            if len(values) != len(names):
                raise ValueError(f"weights must hold {len(names)} arrays ({', '.join(names)}), got {len(values)}")
        buffers = {"params": self._model.get_params(), "state": self._model.get_state()}
        for (name, buffer, offset, shape), value in zip(entries, values):
            a = np.asarray(value)
            if a.dtype.kind not in "fiu":
                raise TypeError(f"{name}: expected a real array, got dtype {a.dtype}")
            if tuple(a.shape) != tuple(shape):
                raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(a.shape)}")
            finite = np.isfinite(a)
            if not allow_nonfinite and not finite.all():
                raise ValueError(f"weights: {name} holds {int(a.size - finite.sum())} value(s) that are not finite; "
                                 "pass allow_nonfinite=True to load them anyway")
            big = finite & (np.abs(a.astype(np.float64)) > np.finfo(np.float32).max)
            if big.any():
                raise ValueError(f"weights: {name} holds {a[big].ravel()[0]!r}, beyond float32's range "
                                 f"(+-{np.finfo(np.float32).max:.4g})")
            buffers[buffer][offset:offset + a.size] = a.astype(np.float32).ravel()
        self._load_buffers(buffers["params"], buffers["state"])

    def _load_buffers(self, params, state):
        """Whole flat parameter and state buffers onto every replica."""
        self._set_replicas(params=params, state=state)
        if self._timeout and self._mirrored is not None:
            # collective: rank 0's weights win, so the replicas never diverge
            self._mirrored.broadcast_across()

    # ---- files ---------------------------------------------------------------
    @classmethod
    def _checkpoint_architecture(cls, input_shape, num_classes):
        """{'layers', 'input_shape', 'sources', 'names'} that a checkpoint of this
        class must hold, for its input shape and class count; None: any (a
        Sequential's layers are its own)."""
        return None

    def save(self, path):
        """Write the weights (PyTorch state_dict names) and the architecture to a
        safetensors file (format: :mod:`dpcore.checkpoint`), with a SHA-256 of each
        tensor and of the architecture. Atomic and durable: a crash leaves
        either the old file or the new one (the temporary a killed writer
        leaves is removed by the next save to this path); the file's mode is
        0666 & ~umask.

        Across the processes of a job (MultiWorkerMirroredStrategy, or a
        PipelineStrategy whose stages are on several ranks) it is collective:
        rank 0 writes (every replica holds the same bits; a pipeline's stages
        are first gathered on every rank) and the others wait until the file
        is complete."""
        self._write(_check.path("path", path))

    def _write(self, path, training=None):
        """save(path), with dp.train's training state when given (checkpoint.save)."""
        if self._timeout:
            from . import distributed

            # a model split over the ranks gathers its whole network on every rank first
            gathered = getattr(self._pipeline, "gathered", contextlib.nullcontext)
            with gathered():
                if distributed.rank() == 0:
                    # a failure here ends the job (MPI_Abort) if nothing catches it,
                    # else the others give up waiting after the timeout
                    checkpoint.save(self, path, training)
            distributed.barrier(self._timeout, f"net.save({os.fspath(path)!r}) by rank 0")
            return
        checkpoint.save(self, path, training)

    # ---- running -----------------------------------------------------------
    def _labelled_batches(self, data, what):
        """The (images, labels) batches of a dataset iterator, checked and converted."""
        if isinstance(data, np.ndarray):
            raise TypeError(f"{what} needs labels: pass an iterator of (images, labels) batches, e.g. "
                            f"dp.data.from_arrays(X, y, batch_size), not an array")
        try:
            batches = iter(data)
        except TypeError:
            if hasattr(type(data), "__iter__"):  # iterable: the TypeError is its own __iter__'s, not ours to rename
                raise
            raise TypeError(f"{what} must be an iterable of (images, labels) batches, e.g. "
                            f"dp.data.from_arrays(X, y, batch_size), got {type(data).__name__} "
                            f"{_check.shown(data)}") from None
        for batch in batches:
            if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
                raise TypeError(f"{what} must yield (images, labels) pairs, got {_check.shown(batch)}")
            X, y = batch
            X = as_images(X, self.input_shape)
            yield X, as_labels(y, len(X))

    def predict(self, X, batch_size=1024):
        """Logits (N, num_classes) as float32 for images (N, C, H, W) or (N, H, W)."""
        batch_size = _check.integer("batch_size", batch_size, 1, _check.MAX_BATCH)
        X = as_images(X, self.input_shape)
        if len(X) == 0:
            return np.zeros((0, self.num_classes), dtype=np.float32)
        return np.concatenate([self._model.predict(X[i:i + batch_size]) for i in range(0, len(X), batch_size)])

    def evaluate(self, data_iter, progress=None):
        """Mean loss and accuracy over a dataset iterator: Metrics(loss, accuracy, num_examples).
        progress: a bar as dp.train shows one (:mod:`dpcore.progress`); None:
        for a set of at least ``EVALUATE_BAR_BATCHES`` batches (when its length is known)."""
        return self._evaluate(data_iter, progress, "data_iter")

    def _evaluate(self, data_iter, progress, what):
        """evaluate, its messages naming the argument ``what`` (dp.train's test_iter)."""
        from . import progress as _progress

        try:
            batches = len(data_iter)
        except TypeError:
            batches = None
        if progress is None:
            progress = batches is not None and batches >= EVALUATE_BAR_BATCHES
        bar = _progress.bar(_check.boolean("progress", progress), batches, "evaluate", unit="batch")
        loss, correct, n = 0.0, 0, 0
        try:
            for X, y in self._labelled_batches(data_iter, what):
                batch_loss, batch_correct = (self._mirrored or self._model).evaluate(X, y)
                loss += batch_loss
                correct += batch_correct
                n += len(y)
                bar.update(1)
        finally:
            bar.close()
        if n == 0:
            raise ValueError(f"{what} yielded no samples: evaluate needs at least one")
        return Metrics(loss / n, correct / n, n)

    def make_resident(self, X, y):
        """Copy a whole dataset (images as the model takes them, int64 labels) to
        every replica's device once; :meth:`train_step_rows` then trains on
        rows of it, moving only the indices. Returns one ``_core.Resident`` per
        replica."""
        X = as_images(X, self.input_shape)
        y = as_labels(y, len(X))
        dataset = object()  # the copies' shared token: train_step_rows refuses residents of two calls
        return [_core.Resident(replica, X, y, dataset=dataset) for replica in self._replicas]

    def train_step_rows(self, residents, rows, lr, momentum=0.0, weight_decay=0.0):
        """One SGD step on rows ``rows`` (int64 indices) of the dataset made
        resident by :meth:`make_resident`. Returns (loss_sum, correct)."""
        lr, momentum, weight_decay = _check.sgd_arguments(lr, momentum, weight_decay, lr_zero=True)
        if not isinstance(residents, (list, tuple)) or not all(isinstance(r, _core.Resident) for r in residents):
            raise TypeError(f"residents must be the list net.make_resident(X, y) returned, got "
                            f"{_check.shown(residents)}")
        if len(residents) != len(self._replicas):
            raise ValueError(f"residents must hold one resident dataset per replica ({len(self._replicas)}), got "
                             f"{len(residents)}")
        rows = np.asarray(rows)
        if rows.dtype.kind not in "iu" or rows.ndim != 1:
            raise TypeError(f"rows must be a 1-d array of integer sample indices, got {rows.dtype} array of shape "
                            f"{rows.shape}")
        samples = residents[0].num_samples
        outside = np.flatnonzero((rows < 0) | (rows >= samples))
        if len(outside):
            raise ValueError(f"rows must be sample indices in [0, {samples}), got {rows[outside[0]]} at position "
                             f"{outside[0]}")
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        if self._mirrored is not None:
            return self._mirrored.train_step_rows(residents, rows, lr, momentum, weight_decay)
        return self._model.train_step_rows(residents[0], rows, lr, momentum, weight_decay)

    def train_step(self, X, y, lr, momentum=0.0, weight_decay=0.0):
        """One SGD step on a batch (mean loss). Returns (loss_sum, correct).
        A loss that is not finite on any replica raises FloatingPointError
        naming the replicas, and the step applies no update."""
        lr, momentum, weight_decay = _check.sgd_arguments(lr, momentum, weight_decay, lr_zero=True)
        X = as_images(X, self.input_shape)
        return (self._mirrored or self._model).train_step(X, as_labels(y, len(X)), lr, momentum, weight_decay)


if Sequential.__doc__:  # None under python -OO
    Sequential.__doc__ = Sequential.__doc__.replace(
        "{layer_specs}", ",\n        ".join(_layer_spec_doc(name, info) for name, info in _LAYER_KINDS.items()))


# evaluate() shows a progress bar by default from this many batches on
EVALUATE_BAR_BATCHES = 50


class LeNet(Sequential):
    """The LeNet of *Dive into Deep Learning* 12.5 for 28x28 images.

    conv 3x3 in->20, ReLU, avg-pool 2; conv 5x5 20->50, ReLU, avg-pool 2;
    flatten; dense 800->128, ReLU; dense 128->num_classes. Weights N(0, 0.01),
    biases 0 (``seed`` fixes the draw). Layer indices match
    ``torch.nn.Sequential(Conv2d, ReLU, AvgPool2d, Conv2d, ReLU, AvgPool2d,
    Flatten, Linear, ReLU, Linear)``, so the weights are named like its state_dict.
    """

    def __init__(self, num_classes=10, in_channels=1, seed=0, threads=0, devices=None, all_reduce=None,
                 bucket_mb=None):
        arch = self._architecture(_check.integer("num_classes", num_classes, 1, _check.MAX_FEATURES),
                                  _check.integer("in_channels", in_channels, 1, _check.MAX_FEATURES))
        super().__init__(arch["layers"], input_shape=arch["input_shape"], init_std=0.01, seed=seed, threads=threads,
                         devices=devices, all_reduce=all_reduce, bucket_mb=bucket_mb)

    @staticmethod
    def _architecture(num_classes, in_channels):
        layers = [
            ("conv2d", 20, 3, 1, 0), ("relu",), ("avgpool", 2, 2, 0),
            ("conv2d", 50, 5, 1, 0), ("relu",), ("avgpool", 2, 2, 0),
            ("flatten",), ("dense", 128), ("relu",), ("dense", num_classes),
        ]
        return {"layers": layers, "input_shape": (in_channels, 28, 28), "sources": None, "names": None}

    @classmethod
    def _checkpoint_architecture(cls, input_shape, num_classes):
        return cls._architecture(num_classes, input_shape[0])


class ResNet18(Sequential):
    """The ResNet-18 of *Dive into Deep Learning* 12.6 (d2l's ``resnet18``).

    conv 3x3 in->64 (stride 1, padding 1) + BatchNorm + ReLU, no max-pool; four
    stages of two residual blocks (64, 128, 256, 512 channels); a block is conv
    3x3 + BN + ReLU, conv 3x3 + BN, plus the shortcut (a 1x1 conv with stride 2
    where the shape changes, as d2l's Residual(use_1x1conv=True)), then ReLU;
    global average pooling; dense 512->num_classes. Weights named like d2l's
    torch module's state_dict (``'0.weight'``, ``'resnet_block2.0.conv3.weight'``,
    ``'fc.1.weight'``, ...). sync_batchnorm: see :class:`Sequential`.
    init: 'torch' (the default) is the module as d2l's ``resnet18`` returns it,
    PyTorch's default initialisation; 'd2l' is the chapter's training recipe,
    whose train() re-draws every conv and dense weight from N(0, 0.01)
    (examples/train_resnet.py uses it).
    """

    def __init__(self, num_classes=10, in_channels=1, seed=0, threads=0, devices=None, sync_batchnorm=False,
                 input_size=28, all_reduce=None, bucket_mb=None, init="torch"):
        arch = self._architecture(_check.integer("num_classes", num_classes, 1, _check.MAX_FEATURES),
                                  _check.integer("in_channels", in_channels, 1, _check.MAX_FEATURES),
                                  _check.integer("input_size", input_size, 1, 2**15))
        super().__init__(arch["layers"], input_shape=arch["input_shape"], seed=seed, threads=threads, devices=devices,
                         sources=arch["sources"], names=arch["names"], init=init, init_std=0.01,
                         sync_batchnorm=sync_batchnorm,
                         all_reduce=all_reduce, bucket_mb=bucket_mb)

    @staticmethod
    def _architecture(num_classes, in_channels, input_size):
        layers, sources, names = [], [], []

        def add(spec, name=None, source=None):
            layers.append(spec)
            sources.append(source)
            names.append(name if name is not None else f"_{len(layers) - 1}")
            return len(layers) - 1

        add(("conv2d", 64, 3, 1, 1), "0")
        add(("batchnorm",), "1")
        last = add(("relu",))
        channels = 64
        for stage, out_channels in enumerate((64, 128, 256, 512), start=1):
            for block in range(2):
                prefix = f"resnet_block{stage}.{block}"
                downsample = block == 0 and stage > 1
                stride = 2 if downsample else 1
                block_input = last
                add(("conv2d", out_channels, 3, stride, 1), f"{prefix}.conv1", block_input)
                add(("batchnorm",), f"{prefix}.bn1")
                add(("relu",))
                add(("conv2d", out_channels, 3, 1, 1), f"{prefix}.conv2")
                main = add(("batchnorm",), f"{prefix}.bn2")
                shortcut = block_input
                if downsample:
                    shortcut = add(("conv2d", out_channels, 1, 2, 0), f"{prefix}.conv3", block_input)
                add(("add", main, shortcut))
                last = add(("relu",))
                channels = out_channels
        add(("global_avgpool",))
        add(("flatten",))
        add(("dense", num_classes), "fc.1")
        return {"layers": layers, "input_shape": (in_channels, input_size, input_size), "sources": sources,
                "names": names}

    @classmethod
    def _checkpoint_architecture(cls, input_shape, num_classes):
        return cls._architecture(num_classes, input_shape[0], input_shape[1])


def _host(data):
    return data.numpy() if isinstance(data, Tensor) else data


class Replica:
    """One replica of a model on one device (chapter 12.5, from scratch).

        X_shards, y_shards = dp.split_batch(X, y, net.devices)
        for replica, Xs, ys in zip(net.replicas, X_shards, y_shards):
            replica.forward_backward(Xs, ys, grad_scale=1 / len(y))
        dp.all_reduce([replica.grads for replica in net.replicas])
        for replica in net.replicas:
            replica.sgd_step(lr)
    """

    def __init__(self, net, model):
        self._net = net
        self._model = model

    @property
    def device(self):
        return self._model.device

    @property
    def grads(self):
        """The flat gradient buffer on this replica's device (a Tensor sharing its memory)."""
        return self._model.grads_tensor()

    @property
    def params(self):
        """The flat parameter buffer on this replica's device (a Tensor sharing its memory)."""
        return self._model.params_tensor()

    def forward_backward(self, X, y, grad_scale):
        """Forward and backward on a shard; the replica's gradient buffer becomes
        grad_scale * (sum of the shard's per-sample gradients). Returns (loss_sum, correct)."""
        grad_scale = _check.real("grad_scale", grad_scale, float32=True)
        X = as_images(_host(X), self._net.input_shape)
        return self._model.forward_backward(X, as_labels(_host(y), len(X)), grad_scale)

    def sgd_step(self, lr, momentum=0.0, weight_decay=0.0):
        """One SGD step from this replica's gradient buffer."""
        self._model.sgd_step(*_check.sgd_arguments(lr, momentum, weight_decay, lr_zero=True))

    def __repr__(self):
        return f"Replica(device='{self.device}')"


# the classes a checkpoint may name (dpcore.checkpoint)
_CLASSES = {cls.__name__: cls for cls in (Sequential, LeNet, ResNet18)}
checkpoint.register_classes(_CLASSES, _SKIP_INIT)


def load(path, devices=None, allow_nonfinite=False):
    """A model saved with ``net.save(path)``, on ``devices`` (default: the active
    strategy's devices, else cpu:0), of the class it was saved as.

    Everything in the file is checked before it is trusted (see
    :mod:`dpcore.checkpoint`): the header, the architecture against the
    tensors' shapes and dtypes (before any model is built), the class against
    its layers, each tensor's SHA-256, and that every weight is finite unless
    ``allow_nonfinite=True``. A file that fails a check raises
    :class:`dpcore.DataError` (a ValueError) naming the file and the problem;
    a missing file raises FileNotFoundError. Files written before checksums
    (format ``dpcore-sequential-1``) still load, with every check but those."""
    return checkpoint.load(path, devices=devices, allow_nonfinite=allow_nonfinite)
