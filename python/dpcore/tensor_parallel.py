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
- Forward: after each layer the devices' slices are gathered along the channel
  axis into the whole activation (an all-gather through host memory). A kind
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
import threading

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
        for j, (spec, row) in enumerate(zip(self.specs, self.groups[g])):
            kind = spec[0]
            src = self.reads[j][0]
            if _LAYER_KINDS[kind]["joins"] == "sum":
                acts[j] = acts[src]
                for other in self.reads[j][1:]:
                    acts[j] = acts[j] + acts[other]
            elif _LAYER_KINDS[kind]["view"]:
                acts[j] = acts[src].reshape((N,) + tuple(self._shapes[j][2]))
            else:
                x = acts[src]
                if _split(kind) == "output":
                    inputs = [x] * self.k
                else:
                    inputs = [np.ascontiguousarray(x[:, a:b]) for a, b in self.in_bounds(j)]
                outs = self._each(g, lambda d, xi: row[d].stage_forward(0, xi, training=training)[0], inputs)
                acts[j] = np.concatenate(outs, axis=1)
        return acts

    def in_bounds(self, j):
        """The channel slices of layer j's input (a channel-wise layer's input channels are its output's)."""
        return self.bounds[j]

    def evaluate(self, X, y):
        if len(y) == 0:
            return 0.0, 0
        logits = self._forward(X, False)[len(self.specs) - 1]
        _, loss, correct = self.head.stage_forward(0, logits, y, training=False, output=False)
        return loss, correct

    def predict(self, X):
        return self._forward(X, False)[len(self.specs) - 1].reshape(len(X), -1)

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
        from .parallel import all_reduce, tensor

        N = len(y)
        L = len(self.specs)
        acts = self._forward(X, True, g)
        head = self.heads[g]
        _, loss, correct = head.stage_forward(0, acts[L - 1], y, training=True, grad_scale=1.0 / total, output=False)
        grads = {L - 1: head.stage_backward(0, N, None, input_grad=True)}
        shapes = {j: a.shape for j, a in acts.items()}
        del acts

        def deliver(src, grad):
            if src < 0:
                return
            grads[src] = grads[src] + grad if src in grads else grad

        for j in reversed(range(L)):
            kind = self.specs[j][0]
            row = self.groups[g][j]
            dy = grads.pop(j, None)
            if dy is None:  # nothing reads this layer's output: its gradients are zero
                dy = np.zeros(shapes[j], np.float32)
            src = self.reads[j][0]
            if _LAYER_KINDS[kind]["joins"] == "sum":
                for read in self.reads[j]:
                    deliver(read, dy)
                continue
            if _LAYER_KINDS[kind]["view"]:
                deliver(src, dy.reshape(shapes[src]))
                continue
            want_dx = src >= 0
            slices = [np.ascontiguousarray(dy[:, a:b]) for a, b in self.bounds[j]]
            dxs = self._each(g, lambda d, dy_d: row[d].stage_backward(0, N, dy_d, input_grad=want_dx), slices)
            if not want_dx:
                continue
            if _split(kind) == "output":
                if self.k == 1:
                    dx = dxs[0]
                else:
                    # each device's partial gradient of the whole input, summed on every device
                    parts = [tensor(part, dev) for part, dev in zip(dxs, self.group_devices[g])]
                    all_reduce(parts)
                    dx = parts[0].numpy().reshape(dxs[0].shape)
            else:
                dx = np.concatenate(dxs, axis=1)
            deliver(src, dx)
        return loss, correct
