"""Pipeline parallelism across the processes of an MPI job: stage i of pipeline r
on rank r * p + i (``dp.PipelineStrategy()`` under ``mpirun -np W``, p = W /
replicas), or wherever ``devices=['rank0/cpu:0', 'rank1/cpu:0', ...]`` puts it.

    mpirun -np 2 python train.py
    strategy = dp.PipelineStrategy(micro_batches=4, schedule='1f1b')   # 2 stages, one per process
    with strategy.scope():
        net = dp.models.LeNet()
    dp.train(net, train_iter, test_iter, num_epochs=10, lr=0.2)       # the same call on every rank

What differs from the one-process pipeline (:mod:`dpcore.pipeline`) is only
where the stages are and how their values travel; the stage models, the
schedules (the same ``run_stage`` loop) and so the arithmetic are the same, and
a job gives bitwise the weights, losses and statistics of one process running
the same stages (``PipelineStrategy(devices=['cpu:0', 'cpu:1'])``).

- Each rank builds only its stages (``_core.Model`` each, on its device); a
  rank may hold several, which then talk through in-process mailboxes.
- Activations go forward and their gradients come back as host float32 arrays
  over MPI, or, between stages on two different physical GPUs, as GPU tensors
  by NCCL (no trip through either host; two ranks sharing a GPU, which NCCL
  refuses, use host arrays). Both are dp.distributed's point-to-point messages
  on dpcore's own tags 100-255, never a user's: one tag per stage boundary and
  direction, so the k-th send of a channel pairs with its k-th receive
  whatever the threads.
  Sends are asynchronous (a blocking send of stage s could wait for stage s + 1
  while it sends its gradient back: a deadlock in 1F1B).
- Every rank passes the same batches: each step first checks (N and a CRC-32
  of the images and of the labels, gathered from every rank).
- ``replicas=R``: each stage's gradients are summed over its R copies in copy
  order, a chain of float32 additions ((g0 + g1) + g2) ... as the one-process
  all-reduce takes them, and BatchNorm's running statistics become the float64
  mean over the copies that saw samples (pipeline.reduce_over_copies).
- Reading the whole network (get_params, get_weights, save, digest, ...) is
  collective: every rank calls it, and each stage's buffers are broadcast from
  the rank holding its first copy. Writing it (set_params, set_weights, load)
  is local: every rank passes the whole network and keeps its stages' slices.
- evaluate / predict run the first pipeline; the last stage's rank broadcasts
  the result, so every rank returns the same.
- Failure: every wait has the strategy's deadline (``timeout``, default 60 s).
  A stage that raises raises on its rank; its peers give up waiting for it and
  raise DistributedError naming the rank and the stage they waited for; a rank
  that dies ends the job through mpirun.
"""
import contextlib
import threading
import time
import zlib

import numpy as np

from . import _core, distributed
from .devices import device_gpu, device_index, device_kind, device_threads
from .errors import DistributedError
from .parallel import Tensor
from .pipeline import (SplitModel, StageBuffers, _Abort, _Mailbox, _shapes, balanced_split,
                       check_split, find_nonfinite_on_cpu, hand_over, layer_costs, measured_costs, micro_batch_work,
                       run_stage, schedule, stage_layers, valid_cuts)

# dpcore's own tags (distributed.PRIVATE_TAGS): the copies' reductions, then a
# (forward, backward) pair per stage boundary, boundaries beyond the pairs
# sharing them where no two channels between the same two ranks would
TAG_REDUCE = 100
TAG_FIRST_CHANNEL = 101
CHANNEL_PAIRS = (distributed.PRIVATE_TAGS.stop - TAG_FIRST_CHANNEL) // 2
# sends of one channel in flight before the oldest is waited for (the C core allows 32)
MAX_PENDING_SENDS = 16

class _Sends:
    """The asynchronous sends of one channel: at most MAX_PENDING_SENDS in
    flight (the oldest waited for first), all waited for by finish()."""

    def __init__(self):
        self._pending = []

    def add(self, run, what):
        while len(self._pending) >= MAX_PENDING_SENDS:
            self._pending.pop(0).wait()
        self._pending.append(distributed.Work(run, what))

    def finish(self):
        while self._pending:
            self._pending.pop(0).wait()


class ProcessPipeline(StageBuffers, SplitModel):
    """The stages of a network on the processes of a job, with the interface
    Sequential uses of a replica group (see :class:`dpcore.pipeline.Pipeline`).
    ``local_models``: this rank's stages, {(pipeline, stage): _core.Model}."""

    # dp.train and net.save run it as a job; _timeout: the seconds to wait for another rank
    across_ranks = True

    def __init__(self, specs, sources, input_shape, strategy, threads=0):
        info = distributed._join()
        self.rank, self.world = info["rank"], info["world_size"]
        self._timeout = strategy.timeout
        self.micro_batches = strategy.micro_batches
        self.schedule_kind = strategy.schedule
        self.num_replicas = R = strategy.replicas
        placement = strategy._placement
        p = len(placement) // R
        self.num_stages, self.num_layers = p, len(specs)
        self.owner = [[placement[r * p + s][0] for s in range(p)] for r in range(R)]
        self.stage_devices = [[f"rank{q}/{d}" for q, d in placement[r * p:(r + 1) * p]] for r in range(R)]
        if p > len(specs):
            raise ValueError(f"PipelineStrategy: {p} stages for a network of {len(specs)} layers: at most one stage "
                             f"per layer")
        shapes = _shapes(specs, sources, input_shape)
        cuts = valid_cuts(specs, sources)
        if p - 1 > len(cuts):
            raise ValueError(f"PipelineStrategy: {p} stages, but this network can be cut only at {len(cuts)} "
                             f"layer(s) ({cuts}): at most {len(cuts) + 1} stages")
        mine = [(r, s) for r in range(R) for s in range(p) if self.owner[r][s] == self.rank]
        self._devices = {(r, s): placement[r * p + s][1] for r, s in mine}
        shared = distributed._cpu_shared_by(info["local_size"])

        def threads_of(d):
            # processes that mpirun did not bind share the cores: each its share
            return threads or max(1, device_threads(d) // shared)

        if strategy.split is not None:
            self.split = check_split(strategy.split, p, cuts, len(specs))
        elif strategy.balance == "flops":
            self.split = balanced_split(layer_costs(shapes), cuts, p)
        else:
            self.split = self._measured_split(specs, shapes, cuts, placement, mine, threads_of)
        bounds = list(zip(self.split, self.split[1:] + [len(specs)]))
        # per stage: the shape of one sample of its input and of its output
        self._in_shapes = [tuple(input_shape) if b == 0 else tuple(shapes[b - 1][2]) for b, _ in bounds]
        self._out_shapes = [tuple(shapes[e - 1][2]) for _, e in bounds]
        self.local_models, failure = {}, None
        try:
            for r, s in mine:
                d = self._devices[(r, s)]
                b, e = bounds[s]
                st_specs, st_sources = stage_layers(specs, sources, b, e)
                self.local_models[(r, s)] = _core.Model(
                    self._in_shapes[s], st_specs, threads_of(d), device_index(d), st_sources, device_kind(d),
                    device_gpu(d) if device_kind(d) == "cuda" else 0, headless=s < p - 1, input_grad=s > 0)
        except Exception as e:  # noqa: BLE001 - raised here, and named on the other ranks
            failure = e
        self.models = [list(self.local_models.values())]  # SplitModel's rows: this rank's stages
        # every stage's flat buffers, from the ranks that hold it, and the physical GPU of each stage on
        # one (or what kept a rank from building its stages)
        described = distributed.allgather_object(
            f"{type(failure).__name__}: {failure}" if failure is not None else
            ({s: (m.nparams, len(m.get_state()), m.param_layout(), m.state_layout())
              for (r, s), m in self.local_models.items()},
             {rs: _core.dist_gpu_uid(device_gpu(d)) for rs, d in self._devices.items() if device_kind(d) == "cuda"}),
            self._timeout, "the stages' buffer sizes")
        if failure is not None:
            raise failure
        for q, d in enumerate(described):
            if isinstance(d, str):
                raise DistributedError(f"PipelineStrategy: rank {q} could not build its stages: {d}")
        self._stage_buffers = [next(d[0][s] for d in described if s in d[0]) for s in range(p)]
        self._by_nccl = nccl_boundaries(self.owner, {k: v for d in described for k, v in d[1].items()})
        self._param_offsets = np.cumsum([0] + [b[0] for b in self._stage_buffers]).tolist()
        self._state_offsets = np.cumsum([0] + [b[1] for b in self._stage_buffers]).tolist()
        self._hand_over = {}
        for r, s in mine:
            row = [d.split("/", 1)[1] for d in self.stage_devices[r]]
            fwd, bwd = hand_over(row)[s]
            # a dp.Tensor to a stage of this process, or by NCCL to another GPU; else host arrays over MPI
            self._hand_over[(r, s)] = (
                fwd and s + 1 < p and (self.owner[r][s + 1] == self.rank or self._by_nccl[(r, s)]),
                bwd and s > 0 and (self.owner[r][s - 1] == self.rank or self._by_nccl[(r, s - 1)]))
        self._tags = self._channel_tags()
        self._shapes = shapes
        self._specs, self._sources = [tuple(t) for t in specs], sources
        self._input_shape = tuple(int(d) for d in input_shape)
        self._held = None
        self.reset_report()

    def _measured_split(self, specs, shapes, cuts, placement, mine, threads_of):
        """balance='measured': rank 0 times the layers (on the device of its first
        stage, else cpu:0) and every rank takes its split, or its error."""
        result = None
        if self.rank == 0:
            d = placement[mine[0][0] * self.num_stages + mine[0][1]][1] if mine else "cpu:0"
            try:
                result = ("split", balanced_split(measured_costs(specs, shapes, d, threads_of(d)), cuts,
                                                  self.num_stages))
            except Exception as e:  # noqa: BLE001 - every rank raises it, rank 0 its own
                result = ("error", f"{type(e).__name__}: {e}")
                distributed.broadcast_object(result, 0, self._timeout, "the pipeline's split (rank 0 measures)")
                raise
        kind, value = distributed.broadcast_object(result, 0, self._timeout, "the pipeline's split (rank 0 measures)")
        if kind == "error":
            raise DistributedError(f"PipelineStrategy: rank 0 could not measure the layers' cost: {value}")
        return value

    def _channel_tags(self):
        """{(pipeline, boundary s): forward tag} of every boundary between stage
        s and s + 1 on two ranks (its backward tag is the next); boundaries
        beyond CHANNEL_PAIRS share tags unless two would link the same ranks."""
        tags, used = {}, set()
        for r in range(self.num_replicas):
            for s in range(self.num_stages - 1):
                a, b = self.owner[r][s], self.owner[r][s + 1]
                if a == b:
                    continue
                tag = TAG_FIRST_CHANNEL + 2 * (len(tags) % CHANNEL_PAIRS)
                if (a, b, tag) in used or (b, a, tag) in used:
                    raise ValueError(f"PipelineStrategy: more than {CHANNEL_PAIRS} stage boundaries between "
                                     f"processes, with two of them linking ranks {a} and {b}: place the stages so "
                                     "that fewer boundaries cross processes")
                used.add((a, b, tag))
                tags[(r, s)] = tag
        return tags

    # ---- the interface of a replica (Sequential's self._model) ----------------
    @property
    def input_shape(self):
        return self._input_shape

    @property
    def num_classes(self):
        return int(np.prod(self._shapes[-1][2]))

    def _stage_models(self):
        return [(s, m) for (_, s), m in self.local_models.items()]

    def _stage_layout(self, s, which):
        return self._stage_buffers[s][2 if which == "params" else 3]

    def _gather(self, getter, offsets):
        """The whole network's buffer (collective): stage s broadcast from the rank
        of its first copy."""
        if self._held is not None:
            return self._held[getter].copy()
        out = np.empty(offsets[-1], np.float32)
        for s in range(self.num_stages):
            part = out[offsets[s]:offsets[s + 1]]
            if self.owner[0][s] == self.rank:
                part[...] = getattr(self.local_models[(0, s)], getter)()
            distributed._private_bcast(part, self.owner[0][s], self._timeout,
                                       f"{getter} of pipeline stage {s} from rank {self.owner[0][s]}")
        return out

    @contextlib.contextmanager
    def gathered(self):
        """A context in which get_params / get_state / get_velocity return the whole
        network's buffers gathered once on entry (collective), without further
        communication: for what one rank alone reads (rank 0 writing a file)."""
        self._held = {g: self._gather(g, o) for g, o in (("get_params", self._param_offsets),
                                                         ("get_state", self._state_offsets),
                                                         ("get_velocity", self._param_offsets))}
        try:
            yield self
        finally:
            self._held = None

    def replicas_identical(self):
        """True when every copy of every stage holds the bits of its first copy (collective)."""
        bits = {key: np.concatenate([m.get_params(), m.get_state()]).tobytes()
                for key, m in self.local_models.items()}
        digests = {}
        for part in distributed.allgather_object({k: zlib.crc32(b) for k, b in bits.items()}, self._timeout,
                                                 "the copies' digests"):
            digests.update(part)
        return all(digests[(r, s)] == digests[(0, s)] for r in range(self.num_replicas)
                   for s in range(self.num_stages))

    # ---- forward only ------------------------------------------------------
    def _forward(self, X, y=None):
        """Evaluation mode through the first pipeline's stages, rank by rank: on the
        last stage's rank (logits or None, loss_sum, correct), elsewhere None."""
        p, owner, me = self.num_stages, self.owner[0], self.rank
        h, result = None, None
        for s in range(p):
            if owner[s] != me:
                continue
            last = s == p - 1
            if s > 0 and owner[s - 1] != me:
                h = np.empty((len(X),) + self._in_shapes[s], np.float32)
                distributed._private_p2p(False, h, owner[s - 1], self._tags[(0, s - 1)], self._timeout,
                                         f"pipeline stage {s} on rank {me}: the activations of an evaluation from "
                                         f"stage {s - 1} on rank {owner[s - 1]}")()
            out, loss, correct = self.local_models[(0, s)].stage_forward(
                0, X if s == 0 else h, y if last else None, training=False, output=not last or y is None)
            h = out
            if last:
                result = (out, loss, correct)
            elif owner[s + 1] != me:
                distributed._private_p2p(True, _host_array(out, (len(X),) + self._out_shapes[s]), owner[s + 1],
                                         self._tags[(0, s)], self._timeout,
                                         f"pipeline stage {s} on rank {me}: the activations of an evaluation to "
                                         f"stage {s + 1} on rank {owner[s + 1]}")()
        return result

    def evaluate(self, X, y):
        self._check_batch("evaluate", X, y)
        if len(y) == 0:
            return 0.0, 0
        result = self._forward(X, y)
        loss, correct = distributed.broadcast_object(
            None if result is None else (result[1], result[2]), self.owner[0][-1], self._timeout,
            f"the evaluation's loss from the last stage on rank {self.owner[0][-1]}")
        return loss, correct

    def predict(self, X):
        self._check_batch("predict", X)
        result = self._forward(X)
        logits = (_host_array(result[0], (len(X), self.num_classes)) if result is not None
                  else np.empty((len(X), self.num_classes), np.float32))
        return distributed._private_bcast(logits, self.owner[0][-1], self._timeout,
                                          f"the logits from the last stage on rank {self.owner[0][-1]}")

    def find_nonfinite(self, X, y):
        """check_numerics: the diagnostic re-run on one CPU copy of the whole network
        (gathered: collective), as the one-process pipeline runs it."""
        return find_nonfinite_on_cpu(self._specs, self._sources, self.input_shape, self.get_params(),
                                     self.get_state(), X, y)

    # ---- training ----------------------------------------------------------
    def report_values(self):
        mine = {"makespan": self._stats["makespan"],
                "busy": {s: self._stats["busy"][s] for r, s in self.local_models if r == 0},
                "activation_bytes": {key: m.activation_bytes for key, m in self.local_models.items()},
                "timeline": self._last_ops}
        parts = distributed.allgather_object(mine, self._timeout, "the pipeline report's times")
        busy, act = [0.0] * self.num_stages, [0] * self.num_stages
        for part in parts:
            for s, b in part["busy"].items():
                busy[s] = b
            for (_, s), a in part["activation_bytes"].items():
                act[s] = max(act[s], a)
        return {"steps": self._stats["steps"], "makespan": max(part["makespan"] for part in parts), "busy": busy,
                "activation_bytes": act, "param_bytes": [4 * b[0] for b in self._stage_buffers],
                "timeline": sorted((op for part in parts for op in part["timeline"]), key=lambda o: o[3])}

    def _check_batch(self, what, X, y=None):
        """Every rank must pass the same batch to `what` (a step, evaluate,
        predict): its size and the CRC-32s of its images and labels gathered and
        compared; a DistributedError on every rank otherwise."""
        mine = (len(X), zlib.crc32(np.ascontiguousarray(X)), 0 if y is None else zlib.crc32(np.ascontiguousarray(y)))
        seen = distributed.allgather_object(mine, self._timeout, f"the start of {what} (the batch's digest)")
        for q, theirs in enumerate(seen):
            if theirs != seen[0]:
                raise DistributedError(f"the processes {what} on different batches: rank {q} has {theirs[0]} "
                                       f"samples (CRC-32 {theirs[1]:08x}, labels {theirs[2]:08x}), rank 0 "
                                       f"{seen[0][0]} ({seen[0][1]:08x}, {seen[0][2]:08x}); every process must pass "
                                       "the same batches (the same data and shuffling seed)")

    def _stage_io(self, r, s, mbs, sends):
        """(receive, send) of stage s of pipeline r for run_stage: mailboxes to
        stages of this process, dp.distributed messages to the others'."""
        owner, me = self.owner[r], self.rank
        boxes = self._boxes

        def receive(kind, k):
            t = s - 1 if kind == "F" else s + 1
            if owner[t] == me:
                return boxes[(r, t, kind)].get(k)
            shape = (len(mbs[k]),) + (self._in_shapes[s] if kind == "F" else self._out_shapes[s])
            if self._by_nccl[(r, min(s, t))]:
                into = Tensor(np.empty(shape, np.float32), self._devices[(r, s)])
            else:
                into = np.empty(shape, np.float32)
            what = (f"pipeline stage {s} on rank {me}: the {'activations' if kind == 'F' else 'gradient'} of "
                    f"micro-batch {k} from stage {t} on rank {owner[t]}")
            tag = self._tags[(r, min(s, t))] + (kind == "B")
            return distributed._private_p2p(False, into, owner[t], tag, self._timeout, what)()

        def send(kind, k, value):
            t = s + 1 if kind == "F" else s - 1
            if owner[t] == me:
                boxes[(r, s, kind)].put(k, value)
                return
            what = (f"pipeline stage {s} on rank {me}: the {'activations' if kind == 'F' else 'gradient'} of "
                    f"micro-batch {k} to stage {t} on rank {owner[t]}")
            tag = self._tags[(r, min(s, t))] + (kind == "B")
            shape = self._out_shapes[s] if kind == "F" else self._in_shapes[s]
            if not self._by_nccl[(r, min(s, t))]:
                value = _host_array(value, (len(mbs[k]),) + shape)
            sends[kind].add(distributed._private_p2p(True, value, owner[t], tag, self._timeout, what), what)
        return receive, send

    def train_step(self, X, y, lr, momentum=0.0, weight_decay=0.0):
        """One SGD step on the batch (mean loss), the same call on every rank.
        Returns (loss_sum, correct), the same on every rank."""
        self._check_batch("step", X, y)
        N = len(y)
        if N == 0:
            return 0.0, 0
        R, p = self.num_replicas, self.num_stages
        shards, work = micro_batch_work(N, R, self.micro_batches)
        states = self._saved_state()
        abort = threading.Event()
        errors, results, busy, ops_log = [], {}, [0.0] * p, []
        lock = threading.Lock()
        grad_scale = 1.0 / N
        # mailboxes from a stage to its neighbour in this process: (pipeline, sender, 'F' or 'B')
        self._boxes = {(r, s, kind): _Mailbox(abort) for r, s in self.local_models for kind in "FB"}
        start = time.perf_counter()

        def run(r, s):
            sends = {"F": _Sends(), "B": _Sends()}
            receive, send = self._stage_io(r, s, work[r], sends)
            error = None
            try:
                loss, correct, timed = run_stage(self.local_models[(r, s)],
                                                 schedule(self.schedule_kind, p, len(work[r]))[s], work[r], X, y,
                                                 grad_scale, s, p, receive, send, self._hand_over[(r, s)], abort)
            except _Abort:
                error = _Abort()
            except BaseException as e:  # noqa: B902 - handed to the caller's thread
                error = e
            for q in sends.values():
                # what this stage sent is received (or its deadline passes) before the step ends
                try:
                    q.finish()
                except BaseException as e:  # noqa: B902 - the stage's own error comes first
                    error = error or e
            with lock:
                if isinstance(error, _Abort):
                    return
                if error is not None:
                    errors.append((r, s, error))
                    abort.set()
                    return
                results[(r, s)] = (loss, correct)
                ops_log.extend((s, r, kind, t0 - start, t1 - start, k) for kind, k, t0, t1 in timed)
                if r == 0:
                    busy[s] += sum(t1 - t0 for _, _, t0, t1 in timed)

        threads = [threading.Thread(target=run, args=key, name=f"dpcore-stage{key[1]}-r{key[0]}", daemon=True)
                   for key in self.local_models]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        makespan = time.perf_counter() - start
        if errors:
            errors.sort(key=lambda e: (e[0], e[1]))
            self._restore(states)
            raise errors[0][2]
        if R > 1:
            self._reduce_copies([len(rows) > 0 for rows in shards])
        mine = {r: results[(r, s)] for r, s in results if s == p - 1}
        losses = {}
        for part in distributed.allgather_object(mine, self._timeout, "the step's losses from the last stages"):
            losses.update(part)
        losses = [losses[r] for r in range(R)]
        return self._finish_step(losses, states, makespan, busy, ops_log, lr, momentum, weight_decay)

    def _reduce_copies(self, ran):
        """pipeline.reduce_over_copies across processes, stage by stage in the same
        order on every rank (so the messages pair): the gradient summed over the
        copies in copy order, ((g0 + g1) + g2) ... in float32 (a copy that saw no
        samples adds zeros), carried from the rank of copy r to that of r + 1;
        the last copy's rank then also computes the running statistics' float64
        mean over the copies that ran, and sends both to the other copies' ranks."""
        R, me = self.num_replicas, self.rank
        for r, s in self.local_models:
            if not ran[r]:
                self.local_models[(r, s)].zero_grads()
        for s in range(self.num_stages):
            owners = [self.owner[r][s] for r in range(R)]
            if me not in owners:
                continue
            nparams, nstate = self._stage_buffers[s][0], self._stage_buffers[s][1]

            def move(array, src, dst, what):
                # the array on src's rank, now also on dst's (in place)
                if src == dst:
                    return
                if me in (src, dst):
                    distributed._private_p2p(me == src, array, dst if me == src else src, TAG_REDUCE, self._timeout,
                                             f"the sum of pipeline stage {s}'s copies: {what} from rank {src} to "
                                             f"rank {dst}")()

            total = np.empty(nparams, np.float32)
            for r in range(R):
                if r:
                    move(total, owners[r - 1], owners[r], f"the sum of copies 0..{r - 1}")
                if owners[r] == me:
                    g = self.local_models[(r, s)].get_grads()
                    total = g if r == 0 else np.add(total, g, dtype=np.float32)
            mean = None
            if nstate:
                states = np.empty((R, nstate), np.float32)
                for r in range(R):
                    if owners[r] == me:
                        states[r] = self.local_models[(r, s)].get_state()
                    move(states[r], owners[r], owners[-1], f"the running statistics of copy {r}")
                mean = np.empty(nstate, np.float32)
                if owners[-1] == me:
                    mean[...] = np.mean(states[[r for r in range(R) if ran[r]]], axis=0,
                                        dtype=np.float64).astype(np.float32)
            done = {owners[-1]}
            for q in owners[:-1]:
                if q not in done:
                    move(total, owners[-1], q, "the sum over the copies")
                    if mean is not None:
                        move(mean, owners[-1], q, "the mean running statistics")
                    done.add(q)
            for r in range(R):
                if owners[r] == me:
                    _set_grads(self.local_models[(r, s)], total)
                    if mean is not None:
                        self.local_models[(r, s)].set_state(mean)


def nccl_boundaries(owner, gpu_uids):
    """{(pipeline r, boundary s): whether stages s and s + 1 exchange GPU tensors by
    NCCL}: yes where they are on two ranks and two different physical GPUs
    (gpu_uids: {(r, s): dist_gpu_uid of the stage's GPU}, stages on GPUs only; 0
    where unknown or built without NCCL). The same on every rank, from gathered
    facts: both sides of a message must take the same path."""
    return {(r, s): (row[s] != row[s + 1] and gpu_uids.get((r, s), 0) != 0 and gpu_uids.get((r, s + 1), 0) != 0
                     and gpu_uids[(r, s)] != gpu_uids[(r, s + 1)])
            for r, row in enumerate(owner) for s in range(len(row) - 1)}


def _host_array(value, shape):
    """A stage's output (a host array, or a dp.Tensor) as a C-contiguous float32
    host array of this shape (the stages' shapes: the receiver expects it)."""
    a = value.numpy() if isinstance(value, Tensor) else value
    return np.ascontiguousarray(a, dtype=np.float32).reshape(shape)


def _set_grads(model, flat):
    """The model's gradient buffer := flat, bit for bit: written in place on a
    CPU device; elsewhere zeroed and all-reduced with flat on the host (0 + g
    is g, but for the sign of a zero)."""
    grads = model.grads_tensor()
    if grads.device.startswith("cpu"):
        grads._view()[...] = flat
        return
    from .parallel import all_reduce, tensor

    model.zero_grads()
    all_reduce([grads, tensor(flat, "cpu:0")])
