"""Layerwise (tensor) parallelism: every layer's parameters split across devices.

    strategy = dp.ModelParallelStrategy(devices=['cpu:0', 'cpu:1'])
    with strategy.scope():
        net = dp.models.LeNet()           # each conv / dense layer split in two
    dp.train(net, train_iter, test_iter, num_epochs=10, lr=0.2)
    print(net.model_parallel_report())    # parameter bytes per device: 1/k

How it works (the C core computes; this module moves activations between layers):

- Each convolution's output channels and each dense layer's output features
  are split across the k devices (contiguous slices, sizes differ by at most
  one): device d holds rows a_d..b_d of the weight (and bias) and computes
  those output channels from the whole input. The layers that act on each
  channel alone (BatchNorm, with its slice of gamma, beta and running
  statistics; ReLU; the poolings) run on each device on its slice of the
  channels. Every layer is a ``_core.Model`` of its own per device.
- Forward: after each layer the devices' slices are gathered along the channel
  axis into the whole activation (an all-gather through host memory). A
  residual ``add`` and ``flatten`` are done on the gathered array (a float32
  add and a reshape: bitwise what the C kernels do).
- Backward: a split layer's devices each get their slice of the output
  gradient and produce a partial gradient of the whole input; the partials are
  summed with ``dp.all_reduce`` (the collective of data parallelism). A
  channel-wise layer's input gradients are gathered like its outputs.
- The loss (softmax cross-entropy of the gathered logits) runs in the C core on
  the first device.
- BatchNorm is exact: a channel's statistics are those of the whole batch on
  the device that holds the channel, so the result equals one device's within
  float32 rounding for every network here, ResNet-18 included.
"""
import concurrent.futures

import numpy as np

from . import _core
from .devices import check_device, device_gpu, device_index, device_kind, device_threads
from .pipeline import SplitModel, _shapes, find_nonfinite_on_cpu, layer_sources

SPLIT_OUT = ("conv2d", "dense")           # output channels / features split
CHANNELWISE = ("batchnorm", "relu", "avgpool", "maxpool", "global_avgpool")   # each device its channel slice
ON_HOST = ("add", "flatten")              # on the gathered activations


def _bounds(channels, k):
    edges = np.cumsum([0] + [len(a) for a in np.array_split(np.arange(channels), k)])
    return [(int(a), int(b)) for a, b in zip(edges, edges[1:])]


class ModelParallelReport:
    """Parameter bytes per device against the whole model's."""

    def __init__(self, tp):
        self.devices = list(tp.devices)
        self.param_bytes = [4 * sum(row[d].nparams for row in tp.models if row) for d in range(tp.k)]
        self.model_param_bytes = 4 * tp.nparams
        self.fraction = [b / self.model_param_bytes for b in self.param_bytes]

    def as_dict(self):
        return {"devices": self.devices, "param_bytes": self.param_bytes,
                "model_param_bytes": self.model_param_bytes, "fraction": self.fraction}

    def __str__(self):
        lines = [f"layerwise split over {len(self.devices)} devices; the whole model: "
                 f"{self.model_param_bytes / 2**20:.2f} MB of parameters"]
        for d, b, f in zip(self.devices, self.param_bytes, self.fraction):
            lines.append(f"  {d:<8} {b / 2**20:8.2f} MB  {f:.3f} of the model (1/{len(self.devices)} = "
                         f"{1 / len(self.devices):.3f})")
        return "\n".join(lines)

    __repr__ = __str__


class TensorParallel(SplitModel):
    """A network whose every layer is split over devices, with the interface
    Sequential uses of a replica (see dpcore.pipeline.Pipeline)."""

    def __init__(self, specs, sources, input_shape, devices, threads=0):
        self.devices = [check_device(d) for d in devices]
        self.k = k = len(self.devices)
        self.specs = [tuple(s) for s in specs]
        self._sources = sources
        self.reads = layer_sources(self.specs, sources)
        self._shapes = _shapes(self.specs, sources, input_shape)
        # the whole network's flat layout, read from the same probe's rules
        probe = _core.Model(tuple(input_shape), self.specs, 1, 0, sources, "cpu", 0)
        self._layout = probe.param_layout()
        self._state_layout = probe.state_layout()
        self._nparams = probe.nparams
        self._nstate = len(probe.get_state())
        self._num_classes = probe.num_classes
        self._input_shape = probe.input_shape
        del probe
        self.models = []   # per layer: one _core.Model per device ([] for a layer done on the host)
        self.bounds = []   # per layer: the channel slice of each device ((a, b) of the output channels)
        for j, (spec, (kind, ins, outs)) in enumerate(zip(self.specs, self._shapes)):
            if kind in ON_HOST:
                self.models.append([])
                self.bounds.append(None)
                continue
            if kind not in SPLIT_OUT + CHANNELWISE:
                raise ValueError(f"ModelParallelStrategy cannot split layer {j} ({kind})")
            channels = outs[0]
            if channels < k:
                raise ValueError(f"ModelParallelStrategy: layer {j} ({kind}) has {channels} output channel(s), "
                                 f"fewer than the {k} devices to split them over")
            bounds = _bounds(channels, k)
            row = []
            for d, (a, b) in enumerate(bounds):
                if kind in SPLIT_OUT:
                    layer = (spec[0], b - a) + tuple(spec[2:])
                    in_shape = tuple(ins)
                else:
                    layer = tuple(spec)
                    in_shape = (b - a,) + tuple(ins[1:])
                dev = self.devices[d]
                row.append(_core.Model(in_shape, [layer], threads or device_threads(dev), device_index(dev), [-1],
                                       device_kind(dev), device_gpu(dev) if device_kind(dev) == "cuda" else 0,
                                       headless=True, input_grad=self.reads[j] != [-1]))
            self.models.append(row)
            self.bounds.append(bounds)
        # the loss on the first device: softmax cross-entropy of the gathered logits
        d0 = self.devices[0]
        self.head = _core.Model((self._num_classes, 1, 1), [("flatten",)], threads or device_threads(d0),
                                device_index(d0), [-1], device_kind(d0),
                                device_gpu(d0) if device_kind(d0) == "cuda" else 0, input_grad=True)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=k, thread_name_prefix="dpcore-tp")

    def __del__(self):
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=False)

    def _each(self, fn, items):
        """fn(d, item) for every device at once (the C core runs without the GIL)."""
        if self.k == 1:
            return [fn(0, items[0])]
        return list(self._pool.map(fn, range(self.k), items))

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
        return [tuple(s) for s in self._shapes]

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
        for (j, d), buf in parts.items():
            getattr(self.models[j][d], setter)(buf)

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
        return True  # one copy of every parameter

    def report(self):
        return ModelParallelReport(self)

    def find_nonfinite(self, X, y):
        """check_numerics: the diagnostic re-run on one CPU copy of the network."""
        return find_nonfinite_on_cpu(self.specs, self._sources, self._input_shape, self.get_params(),
                                     self.get_state(), X, y)

    # ---- computing ----------------------------------------------------------
    def _forward(self, X, training):
        """The gathered output of every layer (host arrays); the devices keep what backward needs."""
        acts = {-1: X}
        N = len(X)
        for j, (spec, row) in enumerate(zip(self.specs, self.models)):
            kind = spec[0]
            src = self.reads[j][0]
            if kind == "add":
                acts[j] = acts[self.reads[j][0]] + acts[self.reads[j][1]]
            elif kind == "flatten":
                acts[j] = acts[src].reshape(N, -1, 1, 1)
            else:
                x = acts[src]
                if kind in SPLIT_OUT:
                    inputs = [x] * self.k
                else:
                    inputs = [np.ascontiguousarray(x[:, a:b]) for a, b in self.in_bounds(j)]
                outs = self._each(lambda d, xi: row[d].stage_forward(0, xi, training=training)[0], inputs)
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
        states = self._saved_state()
        try:
            loss, correct = self._forward_backward(X, y)
        except BaseException:
            self._restore(states)
            raise
        if not np.isfinite(loss):
            self._restore(states)
            raise FloatingPointError(f"the loss is not finite ({loss}) on a model split over {self.k} devices; the "
                                     f"step applied no update: the parameters, momentum and BatchNorm statistics are "
                                     f"those of the last finite step")
        for m in self.all_models():
            m.sgd_step(lr, momentum, weight_decay)
        return loss, correct

    def _forward_backward(self, X, y):
        from .parallel import all_reduce, tensor

        N = len(y)
        L = len(self.specs)
        acts = self._forward(X, True)
        _, loss, correct = self.head.stage_forward(0, acts[L - 1], y, training=True, grad_scale=1.0 / N,
                                                   output=False)
        grads = {L - 1: self.head.stage_backward(0, N, None, input_grad=True)}
        shapes = {j: a.shape for j, a in acts.items()}
        del acts

        def deliver(src, g):
            if src < 0:
                return
            grads[src] = grads[src] + g if src in grads else g

        for j in reversed(range(L)):
            kind = self.specs[j][0]
            row = self.models[j]
            dy = grads.pop(j, None)
            if dy is None:  # nothing reads this layer's output: its gradients are zero
                dy = np.zeros(shapes[j], np.float32)
            src = self.reads[j][0]
            if kind == "add":
                deliver(self.reads[j][0], dy)
                deliver(self.reads[j][1], dy)
                continue
            if kind == "flatten":
                deliver(src, dy.reshape(shapes[src]))
                continue
            want_dx = src >= 0
            slices = [np.ascontiguousarray(dy[:, a:b]) for a, b in self.bounds[j]]
            dxs = self._each(lambda d, g: row[d].stage_backward(0, N, g, input_grad=want_dx), slices)
            if not want_dx:
                continue
            if kind in SPLIT_OUT:
                if self.k == 1:
                    dx = dxs[0]
                else:
                    # each device's partial gradient of the whole input, summed on every device
                    parts = [tensor(g, dev) for g, dev in zip(dxs, self.devices)]
                    all_reduce(parts)
                    dx = parts[0].numpy().reshape(dxs[0].shape)
            else:
                dx = np.concatenate(dxs, axis=1)
            deliver(src, dx)
        return loss, correct
