"""The step timeline: where each replica's time goes, measured in C.

``dp.train(..., profile=True)`` (or ``with dp.profile(net) as p: ...``)
records, per replica and per step, the time of staging its shard
("scatter"), the forward pass, the backward pass, each gradient bucket's
all-reduce, waiting for the other replicas ("wait") and the SGD update. The
C core takes the times (CLOCK_MONOTONIC; on a CUDA device after
synchronizing the replica's stream at each phase's end, see csrc/trace.h);
with profiling off the instrumented places read no clock.

Events nest: a bucket's all-reduce runs inside the backward pass that made
its gradients ready, a barrier wait inside an all-reduce. A step's top-level
events (scatter, forward, backward, the last wait, update) add up to the
replica's step.

    history = dp.train(net, train_iter, num_epochs=1, profile=True)
    history.timeline.plot(steps=3)          # a Gantt chart, one row per replica
    history.timeline.save('trace.json')     # Perfetto / chrome://tracing
    print(history.timeline.summary())       # the share of each phase
"""
import contextlib
import json
import os

import numpy as np

from . import _check

__all__ = ["PHASES", "Timeline", "profile"]

#: the phases, in the C core's numbering (csrc/trace.h)
PHASES = ("step", "scatter", "forward", "backward", "allreduce", "wait", "update")
_COLOURS = {"scatter": "#8c564b", "forward": "#1f77b4", "backward": "#2ca02c", "allreduce": "#d62728",
            "wait": "#bbbbbb", "update": "#9467bd"}
_EVENT_DTYPE = np.dtype([("replica", np.int32), ("phase", np.int32), ("bucket", np.int32), ("bytes", np.int64),
                         ("step", np.int64), ("t0", np.int64), ("t1", np.int64)])


class Timeline:
    """Events of a profiled run: a structured array with fields replica, phase
    (an index into :data:`PHASES`), bucket (-1: not a gradient bucket), bytes,
    step (counted per model from 1), t0, t1 (nanoseconds, CLOCK_MONOTONIC)."""

    def __init__(self, events, devices, dropped=0, rank=0):
        self.events = np.sort(np.asarray(events, dtype=_EVENT_DTYPE), order=("t0", "replica"))
        self.devices = list(devices)
        self.dropped = int(dropped)
        self.rank = int(rank)

    def __len__(self):
        return len(self.events)

    def __repr__(self):
        return (f"Timeline({len(self.events)} events, {len(self.steps())} steps, replicas {self.devices}"
                + (f", {self.dropped} dropped" if self.dropped else "") + ")")

    def steps(self):
        """The step numbers recorded, in order."""
        return sorted(set(int(s) for s in self.events["step"]))

    def _of(self, replica=None, step=None, phase=None):
        mask = np.ones(len(self.events), bool)
        if replica is not None:
            mask &= self.events["replica"] == replica
        if step is not None:
            mask &= self.events["step"] == step
        if phase is not None:
            mask &= self.events["phase"] == PHASES.index(phase)
        return self.events[mask]

    @staticmethod
    def _top_level(events):
        """The events of one replica's step that no other event (but the step's) contains."""
        events = events[events["phase"] != 0]
        order = np.lexsort((-events["t1"], events["t0"]))
        top, end = [], -1
        for e in events[order]:
            if e["t0"] >= end:
                top.append(e)
                end = e["t1"]
            elif e["t1"] > end:  # overlapping, not nested: counted from where the last one ended
                top.append(e)
                end = e["t1"]
        return np.array(top, dtype=_EVENT_DTYPE)

    def step_times(self):
        """{(replica, step): (span_ns, top_level_sum_ns)}: the span of the
        replica's events of that step (first start to last end) and the sum of
        its top-level phases."""
        out = {}
        for replica in sorted(set(int(r) for r in self.events["replica"])):
            for step in self.steps():
                events = self._of(replica, step)
                if not len(events):
                    continue
                top = self._top_level(events)
                span = int(events["t1"].max() - events["t0"].min())
                out[(replica, step)] = (span, int((top["t1"] - top["t0"]).sum()) if len(top) else 0)
        return out

    def phase_seconds(self, exclusive=True):
        """{phase: seconds} summed over replicas and steps. exclusive: a phase's
        own time, without the events nested in it (the all-reduces inside the
        backward pass, the waits inside the all-reduces)."""
        totals = {p: 0.0 for p in PHASES[1:]}
        events = self.events[self.events["phase"] != 0]
        for replica in sorted(set(int(r) for r in events["replica"])):
            mine = events[events["replica"] == replica]
            mine = mine[np.lexsort((-mine["t1"], mine["t0"]))]
            own = (mine["t1"] - mine["t0"]).astype(np.int64)
            if exclusive:  # each event's time less its direct children's
                stack = []
                for i, e in enumerate(mine):
                    while stack and e["t0"] >= mine[stack[-1]]["t1"]:
                        stack.pop()
                    if stack:
                        own[stack[-1]] -= e["t1"] - e["t0"]
                    stack.append(i)
            for phase, seconds in zip(mine["phase"], own):
                totals[PHASES[phase]] += max(int(seconds), 0) / 1e9
        return totals

    def shares(self):
        """{phase: fraction of the replicas' time}: compute (scatter, forward,
        backward, update), communication (allreduce) and waiting, each
        exclusive of what nests in it."""
        seconds = self.phase_seconds()
        total = sum(seconds.values()) or 1.0
        return {p: s / total for p, s in seconds.items()}

    def summary(self):
        """A few lines: steps, replicas, each phase's share."""
        shares = self.shares()
        spans = [span for span, _ in self.step_times().values()]
        lines = [f"{len(self.steps())} steps on {len(self.devices)} replica(s) {self.devices}, "
                 f"median step {np.median(spans) / 1e6 if spans else 0:.2f} ms"]
        lines += [f"  {p:9s} {100 * shares[p]:5.1f}%" for p in PHASES[1:]]
        return "\n".join(lines)

    # ---- Chrome trace ------------------------------------------------------------------

    def chrome_trace(self):
        """The Trace Event Format's JSON object (complete events, microseconds):
        process = this MPI rank, thread = replica; Perfetto and
        chrome://tracing open it."""
        t_zero = int(self.events["t0"].min()) if len(self.events) else 0
        trace = [{"ph": "M", "name": "process_name", "pid": self.rank, "tid": 0,
                  "args": {"name": f"dpcore rank {self.rank}"}}]
        for replica, device in enumerate(self.devices):
            trace.append({"ph": "M", "name": "thread_name", "pid": self.rank, "tid": replica,
                          "args": {"name": f"replica {replica} ({device})"}})
        for e in self.events:
            args = {"step": int(e["step"])}
            if e["bucket"] >= 0:
                args["bucket"] = int(e["bucket"])
            if e["bytes"]:
                args["bytes"] = int(e["bytes"])
            trace.append({"ph": "X", "name": PHASES[e["phase"]], "cat": "dpcore", "pid": self.rank,
                          "tid": int(e["replica"]), "ts": (int(e["t0"]) - t_zero) / 1e3,
                          "dur": (int(e["t1"]) - int(e["t0"])) / 1e3, "args": args})
        return {"traceEvents": trace, "displayTimeUnit": "ms",
                "otherData": {"producer": "dpcore", "dropped_events": self.dropped}}

    def save(self, path):
        """Write the Chrome trace (JSON) to path, atomically."""
        from .checkpoint import atomic_write

        path = _check.writable_file("path", path)
        atomic_write(path, [json.dumps(self.chrome_trace()).encode("utf-8")])
        return path

    # ---- Gantt chart ---------------------------------------------------------------------

    def plot(self, steps=3, ax=None, first=None):
        """A Gantt chart of ``steps`` consecutive steps (from ``first``, default
        the last ones recorded), one row per replica, a colour per phase;
        nested events (all-reduces, waits) drawn as thinner bars on top.
        Returns the matplotlib Axes; in a notebook, without ``ax``, the
        chart is also displayed."""
        steps = _check.integer("steps", steps, 1)
        try:
            from matplotlib.figure import Figure
            from matplotlib.patches import Patch
        except ImportError as e:  # optional dependency
            raise ImportError("Timeline.plot needs matplotlib: pip install matplotlib") from e
        recorded = self.steps()
        if not recorded:
            raise ValueError("the timeline holds no steps")
        start = recorded.index(first) if first in recorded else max(0, len(recorded) - steps)
        chosen = recorded[start:start + steps]
        events = self.events[np.isin(self.events["step"], chosen) & (self.events["phase"] != 0)]
        made_here = ax is None
        if made_here:
            ax = Figure(figsize=(9, 1.2 + 0.6 * len(self.devices))).add_subplot(1, 1, 1)
        t_zero = events["t0"].min()
        for replica in range(len(self.devices)):
            mine = events[events["replica"] == replica]
            top = {tuple(e) for e in self._top_level(mine)}
            for e in mine:
                nested = tuple(e) not in top
                height = 0.35 if nested else 0.7
                ax.barh(replica + (0.0 if not nested else 0.0), (e["t1"] - e["t0"]) / 1e6,
                        left=(e["t0"] - t_zero) / 1e6, height=height, color=_COLOURS[PHASES[e["phase"]]],
                        edgecolor="none")
        ax.set_yticks(range(len(self.devices)))
        ax.set_yticklabels([f"replica {i} ({d})" for i, d in enumerate(self.devices)])
        ax.invert_yaxis()
        ax.set_xlabel("ms")
        ax.set_title(f"steps {chosen[0]}..{chosen[-1]}")
        ax.legend(handles=[Patch(color=c, label=p) for p, c in _COLOURS.items()], ncol=6, fontsize="small",
                  loc="upper center", bbox_to_anchor=(0.5, -0.35 if len(self.devices) < 3 else -0.2), frameon=False)
        ax.figure.tight_layout()
        from .plotting import show_in_notebook

        show_in_notebook(ax.figure, made_here)
        return ax


def collect(net, rank=0):
    """The events the replicas of ``net`` recorded since the last collect (taken from the core)."""
    rows, dropped = [], 0
    for replica, model in enumerate(net._replicas):
        events, lost = model.take_trace()
        dropped += lost
        if len(events):
            block = np.zeros(len(events), dtype=_EVENT_DTYPE)
            block["replica"] = replica
            for i, name in enumerate(("phase", "bucket", "bytes", "step", "t0", "t1")):
                block[name] = events[:, i]
            rows.append(block)
    events = np.concatenate(rows) if rows else np.zeros(0, dtype=_EVENT_DTYPE)
    return Timeline(events, net.devices, dropped, rank)


def set_profiling(net, on):
    for model in net._replicas:
        model.set_profiling(bool(on))


class _Profile:
    timeline = None


@contextlib.contextmanager
def profile(net):
    """Record ``net``'s step timeline inside the block (training steps of any
    kind: dp.train, net.train_step); ``.timeline`` holds it afterwards.

        with dp.profile(net) as p:
            dp.train(net, train_iter, num_epochs=1)
        p.timeline.save('trace.json')
    """
    from .models import Sequential

    if not isinstance(net, Sequential):
        raise TypeError(f"net must be a dpcore model, got {type(net).__name__}")
    result = _Profile()
    collect(net)  # what an earlier profile left is not this block's
    set_profiling(net, True)
    try:
        yield result
    finally:
        set_profiling(net, False)
        result.timeline = collect(net, _rank(net))


def _rank(net):
    if not net.multi_process:
        return 0
    from . import distributed

    return distributed.rank()

