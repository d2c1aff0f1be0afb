"""Pipeline parallelism (the chapter's network partitioning): a network's layers
cut into stages, stage i on device i, each minibatch cut into micro-batches
that flow through the stages.

    strategy = dp.PipelineStrategy(devices=['cpu:0', 'cpu:1'], micro_batches=4, schedule='1f1b')
    with strategy.scope():
        net = dp.models.ResNet18()
    dp.train(net, train_iter, test_iter, num_epochs=10, lr=0.1)
    print(net.pipeline_report())

How it works (the C core does the arithmetic; this module only schedules it):

- Each stage is a ``_core.Model`` of a contiguous run of the network's layers
  on its own device: its parameters, gradients and momentum live there and
  nowhere else. Its flat buffers are laid out exactly as that part of the
  whole network's flat buffer, so the whole network's weights are the stages'
  buffers one after the other (get_weights, save and checkpoints see one
  network).
- A cut may fall only where no later layer reads an earlier layer than the one
  just before the cut (never inside a residual block). Without ``split=`` the
  cuts balance the stages' cost: each layer's training pass timed alone on the
  first device (balance='measured', the default), or its counted FLOPs
  (balance='flops', the same stages on every machine). Which layers share a
  stage never changes the arithmetic.
- A stage keeps one activation set per micro-batch in flight (allocated when
  first needed and kept): GPipe runs every forward pass, then every backward
  pass, so stage i holds m sets; 1F1B starts the backward pass of a
  micro-batch as soon as it can, so stage i holds at most p - i.
  ``pipeline_report()`` gives the bytes measured.
- Every micro-batch's gradient is scaled by 1 / (the whole batch), and the
  stages add the micro-batches' gradients up (``accumulate``), so a step
  applies the full-batch gradient: the same as one device within float32
  rounding, for networks without BatchNorm. BatchNorm normalises each
  micro-batch with its own statistics (as GPipe does) and updates its running
  statistics once per micro-batch.
- The stages of one pipeline run in threads (one per device; the C core runs
  without the GIL); activations travel to the next stage and gradients come
  back as host arrays: between CPU devices that is one copy; between GPUs it
  goes through host memory too (no peer-to-peer copy or NCCL send/recv yet).
- ``replicas=R``: R pipelines side by side on R * p devices, each on 1/R of
  the batch; after the backward passes each stage's gradients are all-reduced
  among its R copies (dp.all_reduce, the collective of data parallelism).
- Stages in several processes of an MPI job: :mod:`dpcore.pipeline_mpi`, the
  same stages and the same ``run_stage`` loop, the values sent over MPI.
"""
import threading
import time

import numpy as np

from . import _check, _core
from .devices import check_device, device_gpu, device_index, device_kind, device_threads

SCHEDULES = ("1f1b", "gpipe")


# ---- where the network may be cut -----------------------------------------------

_LAYER_KINDS = _core.layer_kinds()


def layer_sources(specs, sources):
    """Per layer, the layers whose outputs it reads (-1: the network input):
    the leading arguments of a kind that names its sources (the table's
    ``sources``), else its entry of ``sources``."""
    out = []
    for j, spec in enumerate(specs):
        named = _LAYER_KINDS[spec[0]]["sources"]
        if named:
            out.append([int(a) for a in spec[1:1 + named]])
        else:
            src = None if sources is None else sources[j]
            out.append([j - 1 if src is None else int(src)])
    return out


def valid_cuts(specs, sources):
    """Layer indices c (0 < c < L) where a stage may begin: every layer from c on
    reads only layers from c on, or layer c - 1 (the previous stage's output)."""
    reads = layer_sources(specs, sources)
    cuts = []
    for c in range(1, len(specs)):
        if all(s >= c - 1 for j in range(c, len(specs)) for s in reads[j]):
            cuts.append(c)
    return cuts


def layer_costs(shapes):
    """Counted training FLOPs per sample of each layer (forward, input gradient,
    weight gradient: 3x the forward multiply-adds of a layer that computes each
    output channel from the whole input through its weight, the table's split
    'output': its weight's size per output position); any other layer counts a
    few operations per value."""
    costs = []
    for kind, ins, outs, tensors in shapes:
        if _LAYER_KINDS[kind]["split"] == "output":
            costs.append(3 * 2 * int(np.prod(tensors[0])) * outs[1] * outs[2])
        else:
            costs.append(8 * int(np.prod(outs)))
    return costs


def measured_costs(specs, shapes, device, threads=0, batch=8, repeats=2):
    """Seconds per sample of each layer's training forward and backward pass,
    timed alone on `device` (a one-layer model, the fastest of `repeats` after
    a warm-up) on `batch` random samples."""
    rng = np.random.default_rng(0)
    costs = []
    for spec, (kind, ins, _, _) in zip(specs, shapes):
        # alone, a layer reads the model input in place of every source it names
        layer = (kind,) + (-1,) * _LAYER_KINDS[kind]["sources"] + tuple(spec[1 + _LAYER_KINDS[kind]["sources"]:])
        model = _core.Model(tuple(ins), [layer], threads or device_threads(device), device_index(device), [-1],
                            device_kind(device), device_gpu(device) if device_kind(device) == "cuda" else 0,
                            headless=True, input_grad=True)
        if model.nparams:
            model.set_params(rng.standard_normal(model.nparams).astype(np.float32) * 0.1)
        X = rng.standard_normal((batch,) + tuple(ins)).astype(np.float32)
        best = float("inf")
        for r in range(repeats + 1):
            t0 = time.perf_counter()
            out, _, _ = model.stage_forward(0, X, training=True)
            model.stage_backward(0, batch, np.ones_like(out), input_grad=True)
            if r:
                best = min(best, time.perf_counter() - t0)
        costs.append(best / batch)
        del model
    return costs


def balanced_split(costs, cuts, stages):
    """The stage beginnings (stages of them, the first 0) among the valid cuts
    that minimise the most expensive stage (then the sum of squares)."""
    L = len(costs)
    prefix = np.concatenate([[0], np.cumsum(costs, dtype=np.float64)])
    points = [0] + list(cuts)
    best = {}

    def solve(i, s):
        # the best cut of layers points[i]..L into s stages
        key = (i, s)
        if key in best:
            return best[key]
        begin = points[i]
        if s == 1:
            c = prefix[L] - prefix[begin]
            best[key] = ((c, c * c), [begin])
            return best[key]
        result = None
        for j in range(i + 1, len(points)):
            if len(points) - j < s - 1:
                break
            c = prefix[points[j]] - prefix[begin]
            sub = solve(j, s - 1)
            if sub[1] is None:
                continue
            cand = ((max(c, sub[0][0]), c * c + sub[0][1]), [begin] + sub[1])
            if result is None or cand[0] < result[0]:
                result = cand
        best[key] = result if result is not None else ((float("inf"), 0.0), None)
        return best[key]

    return solve(0, stages)[1]


def check_split(split, stages, cuts, nlayers):
    """split= as the stage beginnings: stages entries from 0, or stages - 1 after it."""
    if isinstance(split, (str, bytes)) or not isinstance(split, (list, tuple)):
        raise TypeError(f"split must be a list of the layer indices where stages begin, got {_check.shown(split)}")
    split = [_check.integer(f"split[{i}]", s, 0, nlayers - 1) for i, s in enumerate(split)]
    if len(split) == stages - 1 and (not split or split[0] != 0):
        split = [0] + split
    if len(split) != stages or split[0] != 0:
        raise ValueError(f"split must name where each of the {stages} stages begins (the first at layer 0), "
                         f"got {split}")
    if any(b <= a for a, b in zip(split, split[1:])):
        raise ValueError(f"split must be increasing layer indices, got {split}")
    bad = [c for c in split[1:] if c not in cuts]
    if bad:
        raise ValueError(f"split: a stage cannot begin at layer {bad[0]}: a later layer reads a layer before "
                         f"{bad[0] - 1} (a residual block would be cut); stages may begin at {cuts}")
    return split


def stage_layers(specs, sources, begin, end):
    """The layers begin..end-1 as a network of their own (sources renumbered:
    layer begin - 1 becomes the stage's input)."""
    reads = layer_sources(specs, sources)
    out_specs, out_sources = [], []
    for j in range(begin, end):
        spec = specs[j]
        named = _LAYER_KINDS[spec[0]]["sources"]
        if named:
            out_specs.append((spec[0],) + tuple(s - begin if s >= begin else -1 for s in reads[j]) +
                             tuple(spec[1 + named:]))
            out_sources.append(None)
        else:
            s = reads[j][0]
            out_specs.append(tuple(spec))
            out_sources.append(s - begin if s >= begin else -1)
    return out_specs, out_sources


def schedule(kind, stages, micro_batches):
    """Per stage, its operations in order: ('F', k) forward of micro-batch k,
    ('B', k) its backward. gpipe: every forward, then every backward (last
    micro-batch first); 1f1b: stage i runs p - i - 1 forwards, then alternates
    one forward and one backward, then the remaining backwards."""
    p, m = stages, micro_batches
    plans = []
    for i in range(p):
        if kind == "gpipe":
            plans.append([("F", k) for k in range(m)] + [("B", k) for k in reversed(range(m))])
            continue
        warm = min(p - i - 1, m)
        ops = [("F", k) for k in range(warm)]
        f, b = warm, 0
        while f < m:
            ops.append(("F", f))
            f += 1
            ops.append(("B", b))
            b += 1
        ops += [("B", k) for k in range(b, m)]
        plans.append(ops)
    return plans


def bubble_formula(stages, micro_batches):
    """The idle share of a pipeline of equal stages: (p - 1) / (m + p - 1)."""
    return (stages - 1) / (micro_batches + stages - 1)


# ---- running ----------------------------------------------------------------------

class _Abort(Exception):
    pass


class _Mailbox:
    """Values keyed by micro-batch, handed from one stage's thread to another's."""

    def __init__(self, abort):
        self._items = {}
        self._cond = threading.Condition()
        self._abort = abort

    def put(self, k, value):
        with self._cond:
            self._items[k] = value
            self._cond.notify_all()

    def get(self, k):
        with self._cond:
            while k not in self._items:
                if self._abort.is_set():
                    raise _Abort()
                self._cond.wait(0.05)
            return self._items.pop(k)


def micro_batch_work(N, replicas, micro_batches):
    """(shards, work) of a step on N samples: each pipeline's shard of the batch
    (index arrays, sizes differing by at most one) and, per pipeline, the
    micro-batches of its shard (fewer when the shard is smaller)."""
    shards = np.array_split(np.arange(N), replicas)
    work = []
    for rows in shards:
        m = min(micro_batches, len(rows))
        work.append([mb for mb in np.array_split(rows, m) if len(mb)] if m else [])
    return shards, work


def run_stage(model, ops, mbs, X, y, grad_scale, s, p, receive, send, hand_over=(False, False), abort=None):
    """Stage s of p runs its operations (schedule()'s list for it) on the
    micro-batches mbs (index arrays into X, y). receive(kind, k) returns what
    the neighbour handed over: the activations of micro-batch k ('F', from
    stage s - 1) or their gradient ('B', from stage s + 1); send(kind, k,
    value) hands this stage's on. hand_over: (forward, backward), whether the
    outputs are dp.Tensors on the stage's device (see hand_over()). Raises
    _Abort once abort is set. Returns (loss_sum, correct, [(kind, k, t0, t1)]):
    the loss and hits summed over the micro-batches in order (the last stage's;
    0.0 and 0 elsewhere) and each operation's compute time."""
    last = s == p - 1
    free_slots, slot_of, new_slot = [], {}, 0
    first_backward = True
    loss_sum, correct_sum = 0.0, 0
    timed = []
    for kind, k in ops:
        if abort is not None and abort.is_set():
            raise _Abort()
        if kind == "F":
            x = X[mbs[k]] if s == 0 else receive("F", k)
            # an activation set per micro-batch in flight: a free one, else a new one
            if free_slots:
                slot = free_slots.pop()
            else:
                slot, new_slot = new_slot, new_slot + 1
            slot_of[k] = slot
            t0 = time.perf_counter()
            out, loss, correct = model.stage_forward(slot, x, y[mbs[k]] if last else None, training=True,
                                                     grad_scale=grad_scale, output=not last, to_tensor=hand_over[0])
            t1 = time.perf_counter()
            if last:
                loss_sum += loss
                correct_sum += correct
            else:
                send("F", k, out)
        else:
            dy = None if last else receive("B", k)
            slot = slot_of.pop(k)
            t0 = time.perf_counter()
            dx = model.stage_backward(slot, len(mbs[k]), dy, input_grad=s > 0, accumulate=not first_backward,
                                      to_tensor=hand_over[1])
            t1 = time.perf_counter()
            first_backward = False
            free_slots.append(slot)
            if s > 0:
                send("B", k, dx)
        timed.append((kind, k, t0, t1))
    return loss_sum, correct_sum, timed


class PipelineReport:
    """What the steps since the model was built (or reset) spent per stage."""

    def __init__(self, pipeline):
        p = pipeline
        self.stages = p.num_stages
        self.micro_batches = p.micro_batches
        self.schedule = p.schedule_kind
        self.replicas = p.num_replicas
        stats = p.report_values()
        self.steps = stats["steps"]
        self.devices = [list(row) for row in p.stage_devices]
        self.layers = [(b, e - 1) for b, e in zip(p.split, p.split[1:] + [p.num_layers])]
        makespan = stats["makespan"]
        self.step_seconds = makespan / self.steps if self.steps else 0.0
        self.busy_seconds = [b / self.steps if self.steps else 0.0 for b in stats["busy"]]
        self.idle_seconds = [max(self.step_seconds - b, 0.0) for b in self.busy_seconds]
        total = self.step_seconds * self.stages
        self.bubble = (sum(self.idle_seconds) / total) if total > 0 else 0.0
        self.bubble_formula = bubble_formula(self.stages, self.micro_batches)
        self.activation_bytes = stats["activation_bytes"]
        self.param_bytes = stats["param_bytes"]
        self.timeline = list(stats["timeline"])

    def as_dict(self):
        keys = ("stages", "micro_batches", "schedule", "replicas", "steps", "devices", "layers", "step_seconds",
                "busy_seconds", "idle_seconds", "bubble", "bubble_formula", "activation_bytes", "param_bytes")
        return {k: getattr(self, k) for k in keys}

    def __str__(self):
        width = max([8] + [len(d) for d in self.devices[0]])  # 'rank1/cpu:0' across processes
        lines = [f"pipeline: {self.stages} stages x {self.replicas} replica(s), {self.micro_batches} micro-batches, "
                 f"{self.schedule}; {self.steps} step(s), {self.step_seconds * 1e3:.1f} ms per step",
                 f"{'stage':>5}  {'layers':<9} {'device':<{width}} {'busy ms':>8} {'idle ms':>8} {'busy':>6} "
                 f"{'params MB':>9} {'activations MB':>14}"]
        for i in range(self.stages):
            share = self.busy_seconds[i] / self.step_seconds if self.step_seconds else 0.0
            lines.append(f"{i:>5}  {'%d-%d' % self.layers[i]:<9} {self.devices[0][i]:<{width}} "
                         f"{self.busy_seconds[i] * 1e3:>8.1f} {self.idle_seconds[i] * 1e3:>8.1f} {share:>6.0%} "
                         f"{self.param_bytes[i] / 2**20:>9.2f} {self.activation_bytes[i] / 2**20:>14.2f}")
        lines.append(f"bubble: {self.bubble:.1%} measured (idle / (stages x step time)); "
                     f"(p - 1) / (m + p - 1) = {self.bubble_formula:.1%} for equal stages")
        return "\n".join(lines)

    def __repr__(self):
        return str(self)

    def plot(self, ax=None):
        """The last step as a Gantt chart: one row per stage, F and B per micro-batch."""
        import matplotlib.pyplot as plt

        if ax is None:
            _, ax = plt.subplots(figsize=(8, 0.6 + 0.5 * self.stages))
        t0 = min((op[3] for op in self.timeline), default=0.0)
        for stage, replica, kind, t_begin, t_end, k in self.timeline:
            if replica:
                continue
            ax.barh(stage, (t_end - t_begin) * 1e3, left=(t_begin - t0) * 1e3,
                    color="tab:blue" if kind == "F" else "tab:orange", edgecolor="white")
            ax.text((t_begin - t0 + (t_end - t_begin) / 2) * 1e3, stage, f"{kind}{k}", ha="center", va="center",
                    fontsize=7, color="white")
        ax.set_yticks(range(self.stages))
        ax.set_yticklabels([f"stage {i} ({self.devices[0][i]})" for i in range(self.stages)])
        ax.invert_yaxis()
        ax.set_xlabel("ms")
        ax.set_title(f"{self.schedule}, {self.micro_batches} micro-batches: bubble {self.bubble:.0%} "
                     f"(formula {self.bubble_formula:.0%})")
        return ax


class SplitModel:
    """What a network spread over several ``_core.Model`` objects (``self.models``:
    rows of them) does the same way whatever the split: momentum, memory, and
    putting the BatchNorm statistics back after a failed step."""

    def _rows(self):
        """Every row of models (all copies of the network)."""
        return self.models

    def all_models(self):
        return [m for row in self._rows() for m in row]

    def reset_velocity(self):
        for m in self.all_models():
            m.reset_velocity()

    def memory_stats(self):
        return [m.memory_stats() for m in self.all_models()]

    def _saved_state(self):
        return [[m.get_state() for m in row] for row in self._rows()]

    def _restore(self, states):
        for row, saved in zip(self._rows(), states):
            for m, st in zip(row, saved):
                m.set_state(st)


class StageBuffers:
    """What Pipeline and the pipeline across processes (dpcore.pipeline_mpi)
    share: the whole network's flat buffers over its stages (the stages'
    buffers one after the other, in one-device layout), the report's counters
    and the end of a step. A subclass
    gives _stage_models() ((stage, model) of every model it holds),
    _stage_layout(stage, 'params' or 'state') and _gather(getter, offsets),
    and sets split, stage_devices, _shapes, _param_offsets and _state_offsets."""

    @property
    def nparams(self):
        return self._param_offsets[-1]

    @property
    def device(self):
        return self.stage_devices[0][0]

    @property
    def devices(self):
        """Every stage's device, pipeline by pipeline (across processes 'rank1/cpu:0')."""
        return [d for row in self.stage_devices for d in row]

    def layers(self):
        return [(kind, ins, outs) for kind, ins, outs, _ in self._shapes]

    def reset_report(self):
        self._stats = {"steps": 0, "makespan": 0.0, "busy": [0.0] * self.num_stages}
        self._last_ops = []

    def report(self):
        """PipelineReport of the steps since the model was built or reset (across
        processes collective: every rank's times gathered)."""
        return PipelineReport(self)

    def _finish_step(self, losses, states, makespan, busy, ops_log, lr, momentum, weight_decay):
        """The end of a step whose passes (and copies' reduction) are done: the
        loss summed over the pipelines ([loss, correct] each, in order); a loss
        that is not finite puts the BatchNorm statistics back (`states`) and
        raises, else every model takes its SGD step and the report its times.
        Returns (loss_sum, correct)."""
        loss_sum = float(sum(l for l, _ in losses))
        correct = int(sum(c for _, c in losses))
        if not np.isfinite(loss_sum):
            self._restore(states)
            raise FloatingPointError(f"the loss is not finite ({loss_sum}) on a pipeline of {self.num_stages} stages; "
                                     f"the step applied no update: the parameters, momentum and BatchNorm statistics "
                                     f"are those of the last finite step")
        for m in self.all_models():
            m.sgd_step(lr, momentum, weight_decay)
        self._stats["steps"] += 1
        self._stats["makespan"] += makespan
        for st, b in enumerate(busy):
            self._stats["busy"][st] += b
        self._last_ops = sorted(ops_log, key=lambda o: o[3])
        return loss_sum, correct

    def _layout(self, which):
        rows, offsets = [], self._param_offsets if which == "params" else self._state_offsets
        for st, b in enumerate(self.split):
            rows += [(layer + b, kind, offset + offsets[st], shape)
                     for layer, kind, offset, shape in self._stage_layout(st, which)]
        return rows

    def param_layout(self):
        return self._layout("params")

    def state_layout(self):
        return self._layout("state")

    def _scatter(self, setter, flat, offsets, what):
        """The whole network's buffer `flat`: each model keeps its stage's slice."""
        flat = np.ascontiguousarray(flat, dtype=np.float32).ravel()
        if len(flat) != offsets[-1]:
            raise ValueError(f"{what} must hold {offsets[-1]} values, got {len(flat)}")
        for st, m in self._stage_models():
            getattr(m, setter)(flat[offsets[st]:offsets[st + 1]])

    def get_params(self):
        return self._gather("get_params", self._param_offsets)

    def set_params(self, flat):
        self._scatter("set_params", flat, self._param_offsets, "params")

    def get_grads(self):
        return self._gather("get_grads", self._param_offsets)

    def get_state(self):
        return self._gather("get_state", self._state_offsets)

    def set_state(self, flat):
        self._scatter("set_state", flat, self._state_offsets, "state")

    def get_velocity(self):
        return self._gather("get_velocity", self._param_offsets)

    def set_velocity(self, flat):
        self._scatter("set_velocity", flat, self._param_offsets, "velocity")


class Pipeline(StageBuffers, SplitModel):
    """The stages of a network on their devices (``_core.Model`` per stage and
    replica), with the interface Sequential uses of a replica group: it trains,
    evaluates and predicts, and shows the whole network's flat buffers."""

    def __init__(self, specs, sources, input_shape, strategy, threads=0):
        self.micro_batches = strategy.micro_batches
        self.schedule_kind = strategy.schedule
        self.num_replicas = strategy.replicas
        devices = strategy.devices
        p = len(devices) // self.num_replicas
        self.num_stages = p
        self.num_layers = len(specs)
        self.stage_devices = [devices[r * p:(r + 1) * p] for r in range(self.num_replicas)]
        if p > len(specs):
            raise ValueError(f"PipelineStrategy: {p} stages for a network of {len(specs)} layers: at most one stage "
                             f"per layer")
        shapes = _shapes(specs, sources, input_shape)  # first: the core's verdict on the network
        cuts = valid_cuts(specs, sources)
        if p - 1 > len(cuts):
            raise ValueError(f"PipelineStrategy: {p} stages, but this network can be cut only at {len(cuts)} "
                             f"layer(s) ({cuts}): at most {len(cuts) + 1} stages")
        if strategy.split is not None:
            self.split = check_split(strategy.split, p, cuts, len(specs))
        else:
            d = check_device(self.stage_devices[0][0])
            costs = (measured_costs(specs, shapes, d, threads) if strategy.balance == "measured"
                     else layer_costs(shapes))
            self.layer_costs = costs
            self.split = balanced_split(costs, cuts, p)
        bounds = list(zip(self.split, self.split[1:] + [len(specs)]))
        self.models = []
        for r in range(self.num_replicas):
            row = []
            for s, (b, e) in enumerate(bounds):
                d = check_device(self.stage_devices[r][s])
                st_specs, st_sources = stage_layers(specs, sources, b, e)
                in_shape = tuple(input_shape) if b == 0 else tuple(shapes[b - 1][2])
                row.append(_core.Model(in_shape, st_specs, threads or device_threads(d), device_index(d), st_sources,
                                       device_kind(d), device_gpu(d) if device_kind(d) == "cuda" else 0,
                                       headless=s < p - 1, input_grad=s > 0))
            self.models.append(row)
        self._hand_over = [hand_over(row) for row in self.stage_devices]
        self._shapes = shapes
        self._specs, self._sources = [tuple(t) for t in specs], sources
        # each stage's share of the whole network's flat buffers
        self._param_offsets = np.cumsum([0] + [m.nparams for m in self.models[0]]).tolist()
        self._state_offsets = np.cumsum([0] + [len(m.get_state()) for m in self.models[0]]).tolist()
        self.reset_report()

    # ---- the interface of a replica (Sequential's self._model) ----------------
    @property
    def input_shape(self):
        return self.models[0][0].input_shape

    @property
    def num_classes(self):
        return self.models[0][-1].num_classes

    def _stage_models(self):
        return [(st, m) for row in self.models for st, m in enumerate(row)]

    def _stage_layout(self, st, which):
        m = self.models[0][st]
        return m.param_layout() if which == "params" else m.state_layout()

    def _gather(self, getter, offsets):
        return np.concatenate([getattr(m, getter)() for m in self.models[0]]) if offsets[-1] else \
            np.zeros(0, np.float32)

    def replicas_identical(self):
        first = [np.concatenate([m.get_params(), m.get_state()]).view(np.uint32) for m in self.models[0]]
        return all(np.array_equal(a, np.concatenate([m.get_params(), m.get_state()]).view(np.uint32))
                   for row in self.models[1:] for a, m in zip(first, row))

    # ---- forward only ------------------------------------------------------
    def _forward(self, X, y=None):
        """Evaluation mode through the stages of the first pipeline: (logits or None, loss_sum, correct)."""
        row = self.models[0]
        h = X
        for s, m in enumerate(row):
            last = s == len(row) - 1
            h, loss, correct = m.stage_forward(0, h, y if last else None, training=False,
                                               output=not last or y is None)
        return h, loss, correct

    def evaluate(self, X, y):
        if len(y) == 0:
            return 0.0, 0
        _, loss, correct = self._forward(X, y)
        return loss, correct

    def predict(self, X):
        logits, _, _ = self._forward(X)
        return logits.reshape(len(X), -1)

    def find_nonfinite(self, X, y):
        """check_numerics: the diagnostic re-run of the whole batch on one CPU
        copy of the network (its parameters and statistics; BatchNorm over the
        whole batch, not per micro-batch)."""
        return find_nonfinite_on_cpu(self._specs, self._sources, self.input_shape, self.get_params(),
                                     self.get_state(), X, y)

    # ---- training ----------------------------------------------------------
    def report_values(self):
        """What PipelineReport shows: steps, makespan and busy seconds (sums over
        the steps), per stage its peak activation bytes (over the copies) and
        parameter bytes, and the last step's operations."""
        return {"steps": self._stats["steps"], "makespan": self._stats["makespan"], "busy": self._stats["busy"],
                "activation_bytes": [max(m.activation_bytes for m in column) for column in zip(*self.models)],
                "param_bytes": [4 * m.nparams for m in self.models[0]], "timeline": self._last_ops}

    def train_step(self, X, y, lr, momentum=0.0, weight_decay=0.0):
        """One SGD step on the batch (mean loss). Returns (loss_sum, correct)."""
        N = len(y)
        if N == 0:
            return 0.0, 0
        R, p = self.num_replicas, self.num_stages
        shards, work = micro_batch_work(N, R, self.micro_batches)
        states = self._saved_state()
        abort = threading.Event()
        errors = []
        losses = [[0.0, 0] for _ in range(R)]
        ops_log = []
        busy = [0.0] * p
        lock = threading.Lock()
        grad_scale = 1.0 / N

        def run(r, s, fwd_in, fwd_out, bwd_in, bwd_out):
            try:
                loss, correct, timed = run_stage(
                    self.models[r][s], schedule(self.schedule_kind, p, len(work[r]))[s], work[r], X, y, grad_scale,
                    s, p, lambda kind, k: (fwd_in if kind == "F" else bwd_in).get(k),
                    lambda kind, k, value: (fwd_out if kind == "F" else bwd_out).put(k, value),
                    self._hand_over[r][s], abort)
            except _Abort:
                return
            except BaseException as e:  # noqa: B902 - handed to the caller's thread
                with lock:
                    errors.append((r, s, e))
                abort.set()
                return
            with lock:
                if s == p - 1:
                    losses[r] = [loss, correct]
                ops_log.extend((s, r, kind, t0, t1, k) for kind, k, t0, t1 in timed)
                if r == 0:
                    busy[s] += sum(t1 - t0 for _, _, t0, t1 in timed)

        threads = []
        start = time.perf_counter()
        for r in range(R):
            fwd = [_Mailbox(abort) for _ in range(p)]
            bwd = [_Mailbox(abort) for _ in range(p)]
            for s in range(p):
                args = (r, s, fwd[s - 1] if s else None, fwd[s], bwd[s], bwd[s - 1] if s else None)
                threads.append(threading.Thread(target=run, args=args, name=f"dpcore-stage{s}-r{r}",
                                                daemon=True))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        makespan = time.perf_counter() - start
        if errors:
            errors.sort(key=lambda e: (e[0], e[1]))
            r, s, e = errors[0]
            self._restore(states)
            raise e
        if R > 1:
            reduce_over_copies(self.models, [len(rows) > 0 for rows in shards])
        return self._finish_step(losses, states, makespan, busy, ops_log, lr, momentum, weight_decay)


def reduce_over_copies(copies, ran):
    """Data parallelism over copies of a split network (one list of models per
    copy, in the same order): a copy that saw no samples this step adds nothing,
    each model's gradients are summed over its copies (dp.all_reduce, data
    parallelism's collective), and BatchNorm's running statistics become the
    mean over the copies that saw samples (as MirroredStrategy's replicas do)."""
    from .parallel import all_reduce

    for models, did in zip(copies, ran):
        if not did:
            for m in models:
                m.zero_grads()
    ran = [r for r, did in enumerate(ran) if did]
    for i in range(len(copies[0])):
        all_reduce([models[i].grads_tensor() for models in copies])
        if not len(copies[0][i].state_layout()):
            continue
        mean = np.mean(np.stack([copies[r][i].get_state() for r in ran]), axis=0, dtype=np.float64)
        for models in copies:
            models[i].set_state(mean.astype(np.float32))


def hand_over(devices):
    """Per stage of a pipeline over `devices`: (forward, backward), whether it
    hands its neighbour (the next stage its activations, the previous one their
    gradient) a dp.Tensor on its own device, which the neighbour's model copies
    from directly (GPU to GPU: a device-to-device or peer copy, no trip through
    the host). A host array only from a GPU to a CPU stage, which cannot read
    a GPU's memory, and nothing where there is no neighbour."""
    p = len(devices)
    kinds = [d.split(":")[0] for d in devices]  # names a strategy checked

    def tensor_to(s, t):
        return 0 <= t < p and not (kinds[s] == "cuda" and kinds[t] == "cpu")

    return [(tensor_to(s, s + 1), tensor_to(s, s - 1)) for s in range(p)]


def _shapes(specs, sources, input_shape):
    """[(kind, input shape, output shape, tensor shapes)] of every layer, by the
    C core's shape rules (nothing is allocated); a network the core refuses
    raises its error."""
    return _core.layer_shapes(tuple(input_shape), [tuple(s) for s in specs], sources)


def find_nonfinite_on_cpu(specs, sources, input_shape, params, state, X, y):
    """(layer, what) of the C core's find_nonfinite, run on a one-device CPU copy
    of a network whose layers live on several devices: the same arithmetic, and
    the devices' models are left as they are."""
    copy = _core.Model(tuple(input_shape), [tuple(s) for s in specs], 0, 0, sources, "cpu", 0)
    copy.set_params(params)
    copy.set_state(state)
    return copy.find_nonfinite(X, y)
