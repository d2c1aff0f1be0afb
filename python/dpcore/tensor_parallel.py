"""Layerwise (tensor) parallelism: every layer's parameters split across devices.

    strategy = dp.ModelParallelStrategy(devices=['cpu:0', 'cpu:1'])
    with strategy.scope():
        net = dp.models.LeNet()           # each conv / dense layer split in two
    dp.train(net, train_iter, test_iter, num_epochs=10, lr=0.2)
    print(net.model_parallel_report())    # parameter bytes per device: 1/k

How it works (the C core computes; this module moves activations between layers):

- How each kind is split is the layer kinds' table's ``split``
  (``_core.layer_kinds()``). ``'output'`` (convolutions, dense layers): the
  output channels are split across the k devices (contiguous slices, sizes
  differ by at most one): device d holds rows a_d..b_d of the weight (and
  bias) and computes those output channels from the whole input.
  ``'channels'`` (BatchNorm, with its slice of gamma, beta and running
  statistics; ReLU; the poolings): each device runs the layer on its slice of
  the channels. Every such layer is a ``_core.Model`` of its own per device.
- Forward: the devices' slices are gathered along the channel axis into the
  whole activation (an all-gather through host memory) where a layer needs it
  whole; a channel-wise layer after a split one reads its own slice. A kind
  the table marks a join (``joins='sum'``: a residual ``add``) or a view
  (``flatten``) is done on the gathered array (a float32 sum and a reshape:
  bitwise what the C kernels do).
- Backward: a split layer's devices each get their slice of the output
  gradient and produce a partial gradient of the whole input; the partials are
  summed with ``dp.all_reduce`` (the collective of data parallelism). A
  channel-wise layer's input gradients are gathered like its outputs.
- The loss (softmax cross-entropy of the gathered logits) runs in the C core on
  the first device.
- BatchNorm is exact: a channel's statistics are those of the whole batch on
  the device that holds the channel, so the result equals one device's within
  float32 rounding for every network here, ResNet-18 included.
- ``replicas=R`` (data parallelism over copies): R copies of the split network
  on R groups of devices, each on its shard of the batch; each slice's
  gradients are all-reduced among its copies (``dp.all_reduce``) and the
  running statistics averaged, as MirroredStrategy's replicas do.
"""
import concurrent.futures
import contextlib
import struct
import threading
import zlib

import numpy as np

from . import _core
from .devices import check_device, device_gpu, device_index, device_kind, device_threads
from .pipeline import SplitModel, _shapes, find_nonfinite_on_cpu, layer_sources, reduce_over_copies

_LAYER_KINDS = _core.layer_kinds()


def _split(kind):
    """The table's split of a kind: 'output', 'channels', or 'host' (a join or a
    view, done on the gathered activations), or None: it cannot be split."""
    info = _LAYER_KINDS[kind]
    if info["split"] is not None:
        return info["split"]
    return "host" if info["joins"] == "sum" or info["view"] else None


def _model_on(dev, in_shape, layers, threads, **kw):
    """A one-layer (or head) _core.Model on device dev."""
    kind = device_kind(dev)
    return _core.Model(tuple(in_shape), layers, threads or device_threads(dev), device_index(dev), [-1], kind,
                       device_gpu(dev) if kind == "cuda" else 0, **kw)


def _bounds(channels, k):
    edges = np.cumsum([0] + [len(a) for a in np.array_split(np.arange(channels), k)])
    return [(int(a), int(b)) for a, b in zip(edges, edges[1:])]


class ModelParallelReport:
    """Parameter bytes per device against the whole model's."""

    def __init__(self, tp):
        self.devices = list(tp.devices)  # every copy's, copy after copy
        self.split = tp.k
        self.replicas = tp.num_replicas
        self.param_bytes = [4 * sum(row[d].nparams for row in rows if row) for rows in tp.groups
                            for d in range(tp.k)]
        self.model_param_bytes = 4 * tp.nparams
        self.fraction = [b / self.model_param_bytes for b in self.param_bytes]

    def as_dict(self):
        return {"devices": self.devices, "split": self.split, "replicas": self.replicas,
                "param_bytes": self.param_bytes, "model_param_bytes": self.model_param_bytes,
                "fraction": self.fraction}

    def __str__(self):
        copies = f", {self.replicas} copies (data parallel)" if self.replicas > 1 else ""
        lines = [f"layerwise split over {self.split} devices{copies}; the whole model: "
                 f"{self.model_param_bytes / 2**20:.2f} MB of parameters"]
        for d, b, f in zip(self.devices, self.param_bytes, self.fraction):
            lines.append(f"  {d:<8} {b / 2**20:8.2f} MB  {f:.3f} of the model (1/{self.split} = "
                         f"{1 / self.split:.3f})")
        return "\n".join(lines)

    __repr__ = __str__


class _Slices:
    """A tensor held as channel slices (parts: device index -> its slice along axis 1), the
    whole gathered only when something needs it (whole()): a channel-wise layer after a split
    layer reads its own slice, so ReLU, pooling and BatchNorm after a convolution move
    nothing between devices."""

    def __init__(self, parts, shape, gather):
        self.parts, self.shape, self._gather, self._whole = parts, tuple(shape), gather, None

    def whole(self):
        if self._whole is None:
            self._whole = self._gather(self.parts)
        return self._whole


def _whole(x):
    return x.whole() if isinstance(x, _Slices) else x


def _part(x, d, bounds):
    """Device d's channel slice of x (bounds: the slices' channel ranges)."""
    if isinstance(x, _Slices):
        return x.parts[d]
    a, b = bounds[d]
    return np.ascontiguousarray(x[:, a:b])


class TensorParallel(SplitModel):
    """A network whose every layer is split over devices, with the interface
    Sequential uses of a replica (see dpcore.pipeline.Pipeline)."""

    def __init__(self, specs, sources, input_shape, devices, threads=0, replicas=1):
        self.all_devices = [check_device(d) for d in devices]
        self.num_replicas = R = replicas
        self.k = k = len(self.all_devices) // R
        self.group_devices = [self.all_devices[r * k:(r + 1) * k] for r in range(R)]
        self.devices = self.all_devices
        self.specs = [tuple(s) for s in specs]
        self._sources = sources
        self._shapes = _shapes(self.specs, sources, input_shape)  # first: the core's verdict on the network
        self.reads = layer_sources(self.specs, sources)
        # the whole network's flat layout, read from the same probe's rules
        probe = _core.Model(tuple(input_shape), self.specs, 1, 0, sources, "cpu", 0)
        self._layout = probe.param_layout()
        self._state_layout = probe.state_layout()
        self._nparams = probe.nparams
        self._nstate = len(probe.get_state())
        self._num_classes = probe.num_classes
        self._input_shape = probe.input_shape
        del probe
        self.bounds = []   # per layer: the channel slice of each device ((a, b) of the output channels)
        for j, (kind, ins, outs, _) in enumerate(self._shapes):
            if _split(kind) == "host":
                self.bounds.append(None)
                continue
            if _split(kind) is None:
                raise ValueError(f"ModelParallelStrategy cannot split layer {j} ({kind})")
            channels = outs[0]
            if channels < k:
                raise ValueError(f"ModelParallelStrategy: layer {j} ({kind}) has {channels} output channel(s), "
                                 f"fewer than the {k} devices to split them over")
            self.bounds.append(_bounds(channels, k))
        # per copy of the split network (replicas > 1: data parallelism over copies): per layer one
        # _core.Model per device ([] for a layer done on the host), the loss's model on its first device,
        # and a thread pool that runs its devices at once
        self.groups, self.heads, self._pools = [], [], []
        for devs in self.group_devices:
            rows = []
            for j, (spec, (kind, ins, outs, _)) in enumerate(zip(self.specs, self._shapes)):
                if self.bounds[j] is None:
                    rows.append([])
                    continue
                row = []
                for dev, (a, b) in zip(devs, self.bounds[j]):
                    if _split(kind) == "output":
                        layer = (spec[0], b - a) + tuple(spec[2:])
                        in_shape = tuple(ins)
                    else:
                        layer = tuple(spec)
                        in_shape = (b - a,) + tuple(ins[1:])
                    row.append(_model_on(dev, in_shape, [layer], threads, headless=True,
                                         input_grad=self.reads[j] != [-1]))
                rows.append(row)
            self.groups.append(rows)
            # the loss on the copy's first device: softmax cross-entropy of the gathered logits
            self.heads.append(_model_on(devs[0], (self._num_classes, 1, 1), [("flatten",)], threads,
                                        input_grad=True))
            self._pools.append(concurrent.futures.ThreadPoolExecutor(max_workers=k, thread_name_prefix="dpcore-tp"))

    @property
    def models(self):
        """The first copy's models: per layer, one per device."""
        return self.groups[0]

    @property
    def head(self):
        return self.heads[0]

    def _rows(self):
        return [row for rows in self.groups for row in rows]

    def __del__(self):
        for pool in getattr(self, "_pools", []):
            pool.shutdown(wait=False)

    def _each(self, g, fn, items):
        """fn(d, item) for every device of copy g at once (the C core runs without the GIL)."""
        if self.k == 1:
            return [fn(0, items[0])]
        return list(self._pools[g].map(fn, range(self.k), items))

    # ---- the interface of a replica -----------------------------------------
    @property
    def input_shape(self):
        return self._input_shape

    @property
    def num_classes(self):
        return self._num_classes

    @property
    def nparams(self):
        return self._nparams

    @property
    def device(self):
        return self.devices[0]

    def layers(self):
        return [(kind, ins, outs) for kind, ins, outs, _ in self._shapes]

    def param_layout(self):
        return list(self._layout)

    def state_layout(self):
        return list(self._state_layout)

    def _pieces(self, which):
        """(layer, device, its flat slice, the whole model's slice, shape of the whole tensor, (a, b)) per tensor."""
        whole = {(layer, kind): (offset, shape)
                 for layer, kind, offset, shape in (self._layout if which == "params" else self._state_layout)}
        out = []
        for j, row in enumerate(self.models):
            for d, m in enumerate(row):
                part = m.param_layout() if which == "params" else m.state_layout()
                for _, kind, off, shape in part:
                    g_off, g_shape = whole[(j, kind)]
                    out.append((j, d, (off, off + int(np.prod(shape))), (g_off, g_off + int(np.prod(g_shape))),
                                tuple(g_shape), self.bounds[j][d]))
        return out

    def _gather(self, getter, which, n):
        flat = np.zeros(n, np.float32)
        cache = {}
        for j, d, (lo, hi), (g_lo, g_hi), shape, (a, b) in self._pieces(which):
            if (j, d) not in cache:
                cache[(j, d)] = getattr(self.models[j][d], getter)()
            flat[g_lo:g_hi].reshape(shape)[a:b] = cache[(j, d)][lo:hi].reshape((b - a,) + shape[1:])
        return flat

    def _scatter(self, setter, getter, which, flat, n, what):
        flat = np.ascontiguousarray(flat, dtype=np.float32).ravel()
        if len(flat) != n:
            raise ValueError(f"{what} must hold {n} values, got {len(flat)}")
        parts = {}
        for j, d, (lo, hi), (g_lo, g_hi), shape, (a, b) in self._pieces(which):
            buf = parts.setdefault((j, d), getattr(self.models[j][d], getter)())
            buf[lo:hi] = flat[g_lo:g_hi].reshape(shape)[a:b].ravel()
        for rows in self.groups:  # every copy the same
            for (j, d), buf in parts.items():
                getattr(rows[j][d], setter)(buf)

    def get_params(self):
        return self._gather("get_params", "params", self._nparams)

    def set_params(self, flat):
        self._scatter("set_params", "get_params", "params", flat, self._nparams, "params")

    def get_grads(self):
        return self._gather("get_grads", "params", self._nparams)

    def get_state(self):
        return self._gather("get_state", "state", self._nstate)

    def set_state(self, flat):
        self._scatter("set_state", "get_state", "state", flat, self._nstate, "state")

    def get_velocity(self):
        return self._gather("get_velocity", "params", self._nparams)

    def set_velocity(self, flat):
        self._scatter("set_velocity", "get_velocity", "params", flat, self._nparams, "velocity")

    def replicas_identical(self):
        """Every copy's parameters and running statistics bitwise those of the first."""
        def bits(rows):
            return [np.concatenate([m.get_params(), m.get_state()]).view(np.uint32) for row in rows for m in row]

        first = bits(self.groups[0])
        return all(all(np.array_equal(a, b) for a, b in zip(first, bits(rows))) for rows in self.groups[1:])

    def report(self):
        return ModelParallelReport(self)

    def find_nonfinite(self, X, y):
        """check_numerics: the diagnostic re-run on one CPU copy of the network."""
        return find_nonfinite_on_cpu(self.specs, self._sources, self._input_shape, self.get_params(),
                                     self.get_state(), X, y)

    # ---- computing ----------------------------------------------------------
    def _forward(self, X, training, g=0):
        """The gathered output of every layer (host arrays) on copy g; its devices keep what backward needs."""
        acts = {-1: X}
        N = len(X)
        for j, spec in enumerate(self.specs):
            kind = spec[0]
            src = self.reads[j][0]
            if _LAYER_KINDS[kind]["joins"] == "sum":
                acts[j] = _whole(acts[src])
                for other in self.reads[j][1:]:
                    acts[j] = acts[j] + _whole(acts[other])
            elif _LAYER_KINDS[kind]["view"]:
                acts[j] = _whole(acts[src]).reshape((N,) + tuple(self._shapes[j][2]))
            else:
                acts[j] = self._split_forward(j, acts[src], training, g)
        return acts

    def _split_forward(self, j, x, training, g):
        """Split layer j's output on copy g (_Slices), from its input x (whole, or _Slices with
        the same channel slices for a channel-wise layer)."""
        row = self.groups[g][j]
        if _split(self.specs[j][0]) == "output":
            inputs = [_whole(x)] * self.k
        else:
            inputs = [_part(x, d, self.in_bounds(j)) for d in range(self.k)]
        outs = self._each(g, lambda d, xi: row[d].stage_forward(0, xi, training=training)[0], inputs)
        return _Slices(dict(enumerate(outs)), (len(inputs[0]),) + tuple(self._shapes[j][2]),
                       lambda parts: np.concatenate([parts[d] for d in range(self.k)], axis=1))

    def in_bounds(self, j):
        """The channel slices of layer j's input (a channel-wise layer's input channels are its output's)."""
        return self.bounds[j]

    def evaluate(self, X, y):
        if len(y) == 0:
            return 0.0, 0
        logits = _whole(self._forward(X, False)[len(self.specs) - 1])
        _, loss, correct = self.head.stage_forward(0, logits, y, training=False, output=False)
        return loss, correct

    def predict(self, X):
        return _whole(self._forward(X, False)[len(self.specs) - 1]).reshape(len(X), -1)

    def train_step(self, X, y, lr, momentum=0.0, weight_decay=0.0):
        N = len(y)
        if N == 0:
            return 0.0, 0
        R = self.num_replicas
        shards = np.array_split(np.arange(N), R)
        states = self._saved_state()
        results = [None] * R
        errors = []

        def run(g):
            rows = shards[g]
            try:
                if len(rows):
                    results[g] = self._forward_backward(X[rows], y[rows], g, N)
                else:  # fewer samples than copies: reduce_over_copies zeroes its gradients
                    results[g] = (0.0, 0)
            except BaseException as e:  # noqa: B902 - raised in the caller's thread below
                errors.append((g, e))

        threads = [threading.Thread(target=run, args=(g,), name=f"dpcore-tp-copy{g}", daemon=True)
                   for g in range(1, R)]
        for t in threads:
            t.start()
        run(0)
        for t in threads:
            t.join()
        if errors:
            self._restore(states)
            raise min(errors, key=lambda e: e[0])[1]
        loss = float(sum(r[0] for r in results))
        correct = int(sum(r[1] for r in results))
        if not np.isfinite(loss):
            self._restore(states)
            raise FloatingPointError(f"the loss is not finite ({loss}) on a model split over {self.k} devices; the "
                                     f"step applied no update: the parameters, momentum and BatchNorm statistics are "
                                     f"those of the last finite step")
        if R > 1:
            reduce_over_copies([[m for row in rows for m in row] for rows in self.groups],
                               [len(r) > 0 for r in shards])
        for m in self.all_models():
            m.sgd_step(lr, momentum, weight_decay)
        return loss, correct

    def _forward_backward(self, X, y, g, total):
        """Copy g's forward and backward pass of its shard (X, y), the loss scaled by 1 / total."""
        N = len(y)
        L = len(self.specs)
        acts = self._forward(X, True, g)
        loss, correct, dlogits = self._loss(g, _whole(acts[L - 1]), y, total)
        grads = {L - 1: dlogits}
        shapes = {j: a.shape for j, a in acts.items()}
        del acts

        def deliver(src, grad):
            if src < 0:
                return
            grads[src] = _whole(grads[src]) + _whole(grad) if src in grads else grad

        for j in reversed(range(L)):
            kind = self.specs[j][0]
            dy = grads.pop(j, None)
            if dy is None:  # nothing reads this layer's output: its gradients are zero
                dy = np.zeros(shapes[j], np.float32)
            src = self.reads[j][0]
            if _LAYER_KINDS[kind]["joins"] == "sum":
                for read in self.reads[j]:
                    deliver(read, dy)
                continue
            if _LAYER_KINDS[kind]["view"]:
                deliver(src, _whole(dy).reshape(shapes[src]))
                continue
            dx = self._split_backward(j, dy, g, N, want_dx=src >= 0)
            if dx is not None:
                deliver(src, dx)
        return loss, correct

    def _loss(self, g, logits, y, total):
        """(loss, correct, its gradient of the logits) of copy g, on its first device."""
        head = self.heads[g]
        _, loss, correct = head.stage_forward(0, logits, y, training=True, grad_scale=1.0 / total, output=False)
        return loss, correct, head.stage_backward(0, len(y), None, input_grad=True)

    def _split_backward(self, j, dy, g, N, want_dx):
        """Split layer j's backward pass on copy g from its whole output gradient dy: the whole
        input gradient (None unless want_dx)."""
        from .parallel import all_reduce, tensor

        row = self.groups[g][j]
        slices = [_part(dy, d, self.bounds[j]) for d in range(self.k)]
        dxs = self._each(g, lambda d, dy_d: row[d].stage_backward(0, N, dy_d, input_grad=want_dx), slices)
        if not want_dx:
            return None
        if _split(self.specs[j][0]) != "output":
            return _Slices(dict(enumerate(dxs)), (N,) + tuple(self._shapes[j][1]),
                           lambda parts: np.concatenate([parts[d] for d in range(self.k)], axis=1))
        if self.k == 1:
            return dxs[0]
        # each device's partial gradient of the whole input, summed on every device
        parts = [tensor(part, dev) for part, dev in zip(dxs, self.group_devices[g])]
        all_reduce(parts)
        return parts[0].numpy().reshape(dxs[0].shape)


# ---- across the processes of an MPI job ---------------------------------------------

class TensorParallelRanks(TensorParallel):
    """ModelParallelStrategy over the ranks of an MPI job: slice d of every layer of copy g
    on the rank at position g * k + d of the strategy's device list ('rankQ/dev', one per
    rank), in that rank's process. Every rank runs the same script on the same batches.

    The arithmetic is the one-process TensorParallel's, in the same order: where a layer needs
    a whole activation the slices are gathered across the ranks (an all-gather of every rank's
    slice, padded to the largest), a layer split by output channels has its partial input gradients
    summed over the copy's ranks in position order (((p0 + p1) + p2) ..., float32, as
    dp.all_reduce sums in one process), the loss and its gradient are computed on every rank
    from the gathered logits (the same bits everywhere), and with replicas=R each slice's
    gradients are summed over its R copies in copy order and BatchNorm's running statistics
    averaged (float64), as reduce_over_copies does. So the job trains bitwise as one process
    with the same devices would. Every collective is the job's (dp.distributed's
    communicator): with R copies each rank receives every rank's slices, R times what its
    own copy needs, which keeps one code path for any R (fine for a few copies; a
    communicator per copy would cut it).

    Whole-network views (get_params, get_state, get_velocity, get_grads, replicas_identical,
    the report) are collective: every rank must call them together, and every rank gets the
    whole network. ``gathered()`` holds one such view for code that reads the network on
    one rank only (rank 0 writing a checkpoint)."""

    across_ranks = True

    def __init__(self, specs, sources, input_shape, devices, threads=0, replicas=1, timeout=60.0):
        from . import distributed

        info = distributed._join()
        self._rank, self._world, self._timeout = info["rank"], info["world_size"], timeout
        self.all_devices = list(devices)
        self.num_replicas = R = replicas
        self.k = k = len(self.all_devices) // R
        self.group_devices = [self.all_devices[r * k:(r + 1) * k] for r in range(R)]
        self.devices = self.all_devices
        self._ranks = [int(name.split("/", 1)[0][4:]) for name in self.all_devices]  # position -> rank
        self._pos = self._ranks.index(self._rank)
        self._g, self._d = divmod(self._pos, k)
        self.local_device = check_device(self.all_devices[self._pos].split("/", 1)[1])
        shared = distributed._cpu_shared_by(info["local_size"])
        if not threads and shared > 1 and device_kind(self.local_device) == "cpu":
            # mpirun did not bind the processes: the host's ranks share its cores
            threads = max(1, device_threads(self.local_device) // shared)
        self.specs = [tuple(s) for s in specs]
        self._sources = sources
        self._shapes = _shapes(self.specs, sources, input_shape)
        self.reads = layer_sources(self.specs, sources)
        probe = _core.Model(tuple(input_shape), self.specs, 1, 0, sources, "cpu", 0)
        self._layout, self._state_layout = probe.param_layout(), probe.state_layout()
        self._nparams, self._nstate = probe.nparams, len(probe.get_state())
        self._num_classes, self._input_shape = probe.num_classes, probe.input_shape
        # the slice layouts of every position, read off a CPU probe of each slice's layer
        self._slice_layouts = {}
        del probe
        self.bounds = []
        for j, (kind, ins, outs, _) in enumerate(self._shapes):
            if _split(kind) == "host":
                self.bounds.append(None)
                continue
            if _split(kind) is None:
                raise ValueError(f"ModelParallelStrategy cannot split layer {j} ({kind})")
            if outs[0] < k:
                raise ValueError(f"ModelParallelStrategy: layer {j} ({kind}) has {outs[0]} output channel(s), "
                                 f"fewer than the {k} ranks to split them over")
            self.bounds.append(_bounds(outs[0], k))
        # this rank's slice of every layer ([] where the layer is done on the host) and the loss
        self.mine = []
        for j, spec in enumerate(self.specs):
            self.mine.append(self._slice_model(j, self._d, self.local_device, threads) if self.bounds[j] else None)
        self.head_model = _model_on(self.local_device, (self._num_classes, 1, 1), [("flatten",)], threads,
                                    input_grad=True)
        self._snapshot = None
        self._exchanges = 0  # collectives this rank has entered on this model

    def _slice_spec(self, j, d):
        spec, (kind, ins, _, _) = self.specs[j], self._shapes[j]
        a, b = self.bounds[j][d]
        if _split(kind) == "output":
            return (spec[0], b - a) + tuple(spec[2:]), tuple(ins)
        return tuple(spec), (b - a,) + tuple(ins[1:])

    def _slice_model(self, j, d, dev, threads):
        layer, in_shape = self._slice_spec(j, d)
        return _model_on(dev, in_shape, [layer], threads, headless=True, input_grad=self.reads[j] != [-1])

    # ---- the job's collectives --------------------------------------------------
    def _exchange(self, data, what, error=None):
        """Every rank's bytes, in rank order (an all-gather on the job's communicator, each
        rank's padded to the largest). A rank whose local computation failed takes part with
        its error instead (error: the exception): every rank then raises, the others a
        DistributedError naming it, so that no rank waits in a collective the failed one
        never enters and the ranks leave the step together."""
        from . import distributed

        if error is not None:
            data = f"in {what}: {type(error).__name__}: {error}".encode()
        # each exchange numbered and named, so that ranks out of step (one left a step
        # early) are an error naming both places, never one rank's bytes read as another's
        self._exchanges += 1
        head = struct.pack("<qqqq", 1 if error is not None else 0, len(data), self._exchanges,
                           zlib.crc32(what.encode()))
        heads = [struct.unpack("<qqqq", h) for h in _core.dist_allgather(head, self._timeout, what)] \
            if self._world > 1 else [struct.unpack("<qqqq", head)]
        anyone_failed = any(h[0] for h in heads)  # a failed rank names its failure, not the exchange
        for q, (_, _, count, name) in enumerate(heads):
            if count != self._exchanges or (name != heads[self._rank][3] and not anyone_failed):
                raise distributed.DistributedError(
                    f"the ranks of a ModelParallelStrategy model are out of step: rank {q} is at its exchange "
                    f"{count}, rank {self._rank} at {self._exchanges} ({what}); every rank must make the same calls "
                    "on the model")
        width = max(h[1] for h in heads)
        parts = _core.dist_allgather(data + bytes(width - len(data)), self._timeout, what) \
            if self._world > 1 else [data]
        parts = [p[:h[1]] for p, h in zip(parts, heads)]
        failed = [q for q, h in enumerate(heads) if h[0]]
        if failed and error is None:
            q = failed[0]
            raise distributed.DistributedError(f"rank {q} of a ModelParallelStrategy model failed "
                                               f"{parts[q].decode(errors='replace')} (this rank learned it "
                                               f"in {what})")
        return parts

    def _all_gather(self, array, what):
        """Every rank's float32 array (shapes may differ between ranks by the slices' sizes),
        as a list of flat arrays in rank order."""
        return [np.frombuffer(p, np.float32)
                for p in self._exchange(np.ascontiguousarray(array, np.float32).tobytes(), what)]

    def _local(self, fn, what):
        """fn() (this rank's computation); an error is told to every rank in the next
        exchange (the one every other rank is about to enter) and raised here."""
        from . import distributed

        try:
            return fn()
        except distributed.DistributedError:
            raise
        except Exception as e:
            self._exchange(b"", what, error=e)
            raise

    def _gather_slices(self, j, local, N, which):
        """Copy g's k channel slices of layer j's output (which=2) or input gradient (which=1),
        gathered from its ranks: (N, C, ...)."""
        what = "slices" if which == 2 else "input gradient slices"
        parts = self._all_gather(local, f"the gather of layer {j}'s {what} (ModelParallelStrategy)")
        rest = tuple(self._shapes[j][which][1:])
        return np.concatenate([parts[self._ranks[self._g * self.k + d]].reshape((N, b - a) + rest)
                               for d, (a, b) in enumerate(self.bounds[j])], axis=1)

    def _sum_over_copy(self, partial, what):
        """The partial input gradients of copy g's k ranks summed in position order."""
        parts = self._all_gather(partial, what)
        out = parts[self._ranks[self._g * self.k]].copy()
        for d in range(1, self.k):
            out += parts[self._ranks[self._g * self.k + d]]
        return out.reshape(partial.shape)

    # ---- the interface of a replica -------------------------------------------------
    @property
    def models(self):
        raise AttributeError("a model split over the ranks of a job holds only this rank's slices (.mine)")

    @property
    def device(self):
        return self.local_device

    @property
    def head(self):
        """The loss, on this rank (every rank of a copy computes it from the same logits)."""
        return self.head_model

    def all_models(self):
        return [m for m in self.mine if m is not None] + [self.head_model]

    def _saved_state(self):
        return [m.get_state() for m in self.all_models()]

    def _restore(self, states):
        for m, st in zip(self.all_models(), states):
            m.set_state(st)

    def _mine_flat(self, getter):
        return np.concatenate([getattr(m, getter)() for m in self.mine if m is not None] +
                              [np.zeros(0, np.float32)])

    def _gather(self, getter, which, n=None):
        """The whole network's flat buffer (params or state layout), from copy 0's ranks."""
        if self._snapshot is not None:
            return self._snapshot[getter].copy()
        parts = self._all_gather(self._mine_flat(getter), f"the whole network's {getter[4:]} (ModelParallelStrategy)")
        whole = {(layer, kind): (off, shape)
                 for layer, kind, off, shape in (self._layout if which == "params" else self._state_layout)}
        flat = np.zeros(self._nparams if which == "params" else self._nstate, np.float32)
        for d in range(self.k):
            src, at = parts[self._ranks[d]], 0
            for j, m in enumerate(self.mine):
                if m is None:
                    continue
                for _, kind, off, shape in self._slice_part(j, d, which):
                    n = int(np.prod(shape))
                    g_off, g_shape = whole[(j, kind)]
                    a, b = self.bounds[j][d]
                    flat[g_off:g_off + int(np.prod(g_shape))].reshape(g_shape)[a:b] = \
                        src[at + off:at + off + n].reshape((b - a,) + tuple(g_shape[1:]))
                at += self._slice_size(j, d, which)
        return flat

    def _slice_probe(self, j, d):
        key = (j, d)
        if key not in self._slice_layouts:
            m = self._slice_model(j, d, "cpu:0", 1)
            self._slice_layouts[key] = (m.param_layout(), m.state_layout(), m.nparams, len(m.get_state()))
        return self._slice_layouts[key]

    def _slice_part(self, j, d, which):
        return self._slice_probe(j, d)[0 if which == "params" else 1]

    def _slice_size(self, j, d, which):
        return self._slice_probe(j, d)[2 if which == "params" else 3]

    def _scatter(self, setter, getter, which, flat, n, what):
        flat = np.ascontiguousarray(flat, dtype=np.float32).ravel()
        if len(flat) != n:
            raise ValueError(f"{what} must hold {n} values, got {len(flat)}")
        whole = {(layer, kind): (off, shape)
                 for layer, kind, off, shape in (self._layout if which == "params" else self._state_layout)}
        for j, m in enumerate(self.mine):
            if m is None:
                continue
            buf = getattr(m, getter)()
            a, b = self.bounds[j][self._d]
            for _, kind, off, shape in (m.param_layout() if which == "params" else m.state_layout()):
                g_off, g_shape = whole[(j, kind)]
                whole_tensor = flat[g_off:g_off + int(np.prod(g_shape))].reshape(g_shape)
                buf[off:off + int(np.prod(shape))] = whole_tensor[a:b].ravel()
            getattr(m, setter)(buf)
        self._snapshot = None

    @contextlib.contextmanager
    def gathered(self):
        """Collective: the whole network's buffers gathered once; inside, get_params,
        get_state, get_velocity and get_grads read them without communicating."""
        snap = {g: self._gather(g, w) for g, w in (("get_params", "params"), ("get_state", "state"),
                                                  ("get_velocity", "params"), ("get_grads", "params"))}
        self._snapshot = snap
        try:
            yield
        finally:
            self._snapshot = None

    def replicas_identical(self):
        """Every copy's slices bitwise those of copy 0's same slice (collective)."""
        mine = np.concatenate([self._mine_flat("get_params"), self._mine_flat("get_state")]).view(np.uint32)
        parts = self._all_gather(mine.view(np.float32), "the comparison of the copies (ModelParallelStrategy)")
        return all(np.array_equal(parts[self._ranks[g * self.k + d]].view(np.uint32),
                                  parts[self._ranks[d]].view(np.uint32))
                   for g in range(1, self.num_replicas) for d in range(self.k))

    def report(self):
        sizes = self._all_gather(np.array([4 * sum(m.nparams for m in self.mine if m is not None)], np.float32),
                                 "the model-parallel report")
        rep = ModelParallelReport.__new__(ModelParallelReport)
        rep.devices, rep.split, rep.replicas = list(self.all_devices), self.k, self.num_replicas
        rep.param_bytes = [int(sizes[q][0]) for q in self._ranks]
        rep.model_param_bytes = 4 * self._nparams
        rep.fraction = [b / rep.model_param_bytes for b in rep.param_bytes]
        return rep

    # ---- computing (TensorParallel's passes; these hooks are this rank's part) ----------
    def _split_forward(self, j, x, training, g):
        N = x.shape[0]
        a, b = self.bounds[j][self._d]
        x = _whole(x) if _split(self.specs[j][0]) == "output" else _part(x, self._d, self.bounds[j])
        if N:
            out = self._local(lambda: self.mine[j].stage_forward(0, x, training=training)[0],
                              f"layer {j}'s forward pass")
        else:  # a copy without samples still takes part in every exchange
            out = np.zeros((0, b - a) + tuple(self._shapes[j][2][1:]), np.float32)
        return _Slices({self._d: out}, (N,) + tuple(self._shapes[j][2]),
                       lambda parts: self._gather_slices(j, parts[self._d], N, 2))

    def train_step(self, X, y, lr, momentum=0.0, weight_decay=0.0):
        N = len(y)
        if N == 0:
            return 0.0, 0
        R = self.num_replicas
        shards = np.array_split(np.arange(N), R)
        rows = shards[self._g]
        states = self._saved_state()
        try:
            # a copy without samples (fewer than copies) runs the same exchanges on nothing
            result = self._forward_backward(X[rows], y[rows], self._g, N)
            # every copy's (loss, correct), each copy's from its first rank, added in copy order
            told = [struct.unpack("<dq", b) for b in
                    self._exchange(struct.pack("<dq", float(result[0]), int(result[1])), "the step's loss")]
        except BaseException:
            self._restore(states)
            raise
        loss = float(sum(told[self._ranks[g * self.k]][0] for g in range(R)))
        correct = int(sum(told[self._ranks[g * self.k]][1] for g in range(R)))
        if not np.isfinite(loss):
            self._restore(states)
            raise FloatingPointError(f"the loss is not finite ({loss}) on a model split over {self.k} ranks; the "
                                     f"step applied no update: the parameters, momentum and BatchNorm statistics are "
                                     f"those of the last finite step")
        if R > 1:
            self._reduce_over_copies([len(s) > 0 for s in shards])
        for m in self.all_models():
            m.sgd_step(lr, momentum, weight_decay)
        return loss, correct

    def _reduce_over_copies(self, ran):
        """reduce_over_copies across ranks: slice d's gradients summed over its copies in copy
        order (a copy without samples adds zeros), running statistics the float64 mean over the
        copies that ran."""
        models = [m for m in self.mine if m is not None]
        if not ran[self._g]:
            for m in models:
                m.zero_grads()
        grads = self._all_gather(self._mine_flat("get_grads"), "the gradients' sum over the copies")
        states = self._all_gather(self._mine_flat("get_state"), "the running statistics' mean over the copies")
        copies = [self._ranks[g * self.k + self._d] for g in range(self.num_replicas)]
        total = grads[copies[0]].copy()
        for q in copies[1:]:
            total += grads[q]
        ran_ranks = [q for g, q in enumerate(copies) if ran[g]]
        mean = np.mean(np.stack([states[q] for q in ran_ranks]), axis=0, dtype=np.float64).astype(np.float32)
        from .pipeline_mpi import _set_grads

        at = st = 0
        for m in models:
            _set_grads(m, total[at:at + m.nparams])  # in place on a CPU; on a GPU 0 + g, the same bits
            at += m.nparams
            n = len(m.get_state())
            if n:
                m.set_state(mean[st:st + n])
            st += n

    def _loss(self, g, logits, y, total):
        """Every rank of the copy computes the loss from the same gathered logits (the same bits);
        a failure is told in the exchange after the last layer's backward pass."""
        if not len(y):
            return 0.0, 0, np.zeros_like(logits)
        head = self.head_model

        def loss_and_gradient():
            _, loss, correct = head.stage_forward(0, logits, y, training=True, grad_scale=1.0 / total, output=False)
            return loss, correct, head.stage_backward(0, len(y), None, input_grad=True)
        return self._local(loss_and_gradient, "the loss")

    def _split_backward(self, j, dy, g, N, want_dx):
        kind = self.specs[j][0]
        a, b = self.bounds[j][self._d]
        dy = _part(dy, self._d, self.bounds[j])
        if N:
            dx = self._local(lambda: self.mine[j].stage_backward(0, N, dy, input_grad=want_dx),
                             f"layer {j}'s backward pass")
        else:
            ins = tuple(self._shapes[j][1])
            dx = np.zeros((0,) + (ins if _split(kind) == "output" else (b - a,) + ins[1:]), np.float32)
        if not want_dx:
            return None
        if _split(kind) == "output":
            return self._sum_over_copy(np.asarray(dx, np.float32), f"the sum of layer {j}'s input gradients")
        return _Slices({self._d: dx}, (N,) + tuple(self._shapes[j][1]),
                       lambda parts: self._gather_slices(j, parts[self._d], N, 1))
