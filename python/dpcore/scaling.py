"""dp.scaling_report: does a second replica pay, here, for this model?

    report = dp.scaling_report(lambda: dp.models.LeNet(), train_iter, devices=['cpu:0', 'cpu:1'])

trains a few steps on 1, 2, ... k replicas (devices[:1], devices[:2], ...),
every configuration on the same batches, and reports for each: images/s, the
speed-up over one replica, the efficiency (speed-up / replicas) and, from the
step timeline measured in C (dpcore.timeline), the share of the replicas'
time spent computing, all-reducing and waiting. It says plainly when adding
replicas does not pay, and why.

CPU devices: for each configuration the CPU is split anew into as many
logical devices as it has replicas (dp.set_logical_devices('cpu', k)), so
one replica gets every core and k replicas share them: the comparison a user
choosing between them faces. The logical CPU devices are put back as they
were afterwards.
"""
import time

import numpy as np

from . import _check, _core, timeline
from .devices import check_device, list_devices, set_logical_devices

__all__ = ["ScalingReport", "scaling_report"]

_COMPUTE = ("scatter", "forward", "backward", "update")


class ScalingReport:
    """What :func:`scaling_report` measured: ``rows`` (one dict per
    configuration), ``verdict`` (plain words), ``timelines`` (per
    configuration), a table as ``str()`` and in a notebook, and ``plot()``."""

    def __init__(self, rows, timelines, batch_size, cores):
        self.rows = rows
        self.timelines = timelines
        self.batch_size = batch_size
        self.cores = cores
        self.verdict = self._verdict()

    def _verdict(self):
        base = self.rows[0]
        lines = []
        for row in self.rows[1:]:
            k = row["replicas"]
            overhead = row["comm_share"] + row["wait_share"]
            if row["speedup"] >= 0.9 * k:
                lines.append(f"{k} replicas pay: {row['speedup']:.2f}x the images/s of one "
                             f"({100 * row['efficiency']:.0f}% efficiency).")
                continue
            verb = "do not pay" if row["speedup"] < 1.0 else "pay only partly"
            why = []
            if overhead > row["compute_share"]:
                why.append(f"communication and waiting take {100 * overhead:.0f}% of the replicas' time, more than "
                           f"their compute ({100 * row['compute_share']:.0f}%)")
            elif overhead > 0.2:
                why.append(f"communication and waiting take {100 * overhead:.0f}% of the replicas' time")
            if row["kind"] == "cpu" and k > self.cores:
                why.append(f"{k} replicas share {self.cores} core(s)")
            elif row["kind"] == "cpu":
                why.append(f"the {self.cores} core(s) are split {k} ways: each replica computes with fewer threads, "
                           f"so it only gains what one replica left idle")
            per_replica = self.batch_size // k
            if per_replica < 64:
                why.append(f"each replica's share of the batch ({per_replica} samples) is small")
            lines.append(f"{k} replicas {verb}: {row['speedup']:.2f}x the images/s of one "
                         f"({row['images_per_s']:.0f} against {base['images_per_s']:.0f})"
                         + (f", because {'; '.join(why)}." if why else "."))
        return "\n".join(lines) if lines else "one replica only: nothing to compare"

    def table(self):
        head = ("| replicas | devices | images/s | speed-up | efficiency | compute | all-reduce | waiting |\n"
                "|---|---|---|---|---|---|---|---|")
        rows = [f"| {r['replicas']} | {', '.join(r['devices'])} | {r['images_per_s']:.0f} | {r['speedup']:.2f}x | "
                f"{100 * r['efficiency']:.0f}% | {100 * r['compute_share']:.0f}% | {100 * r['comm_share']:.0f}% | "
                f"{100 * r['wait_share']:.0f}% |" for r in self.rows]
        return "\n".join([head] + rows)

    def __str__(self):
        return self.table() + "\n\n" + self.verdict

    def __repr__(self):
        return f"ScalingReport({len(self.rows)} configurations)"

    def _repr_html_(self):
        import html

        cells = "".join(
            f"<tr><td>{r['replicas']}</td><td>{html.escape(', '.join(r['devices']))}</td>"
            f"<td>{r['images_per_s']:.0f}</td><td>{r['speedup']:.2f}x</td><td>{100 * r['efficiency']:.0f}%</td>"
            f"<td>{100 * r['compute_share']:.0f}%</td><td>{100 * r['comm_share']:.0f}%</td>"
            f"<td>{100 * r['wait_share']:.0f}%</td></tr>" for r in self.rows)
        return ("<table><tr><th>replicas</th><th>devices</th><th>images/s</th><th>speed-up</th><th>efficiency</th>"
                "<th>compute</th><th>all-reduce</th><th>waiting</th></tr>" + cells + "</table><p>"
                + html.escape(self.verdict).replace("\n", "<br>") + "</p>")

    def plot(self, ax=None):
        """Images/s against replicas, beside the ideal (linear) scaling; the
        stacked shares of compute, all-reduce and waiting on a second axis.
        In a notebook, without ``ax``, the figure is also displayed."""
        try:
            from matplotlib.figure import Figure
        except ImportError as e:  # optional dependency
            raise ImportError("ScalingReport.plot needs matplotlib: pip install matplotlib") from e
        made_here = ax is None
        if made_here:
            ax = Figure(figsize=(8, 3.2)).subplots(1, 2)
        speed, shares = (ax[0], ax[1]) if isinstance(ax, (list, tuple, np.ndarray)) else (ax, None)
        k = [r["replicas"] for r in self.rows]
        ips = [r["images_per_s"] for r in self.rows]
        speed.plot(k, ips, "o-", label="measured")
        speed.plot(k, [ips[0] * i for i in k], "--", color="grey", label="ideal")
        speed.set_xlabel("replicas")
        speed.set_ylabel("images/s")
        speed.set_xticks(k)
        speed.legend()
        speed.grid(True)
        if shares is not None:
            bottom = np.zeros(len(k))
            for key, label, colour in (("compute_share", "compute", "#2ca02c"), ("comm_share", "all-reduce", "#d62728"),
                                       ("wait_share", "waiting", "#bbbbbb")):
                values = np.array([100 * r[key] for r in self.rows])
                shares.bar(k, values, bottom=bottom, label=label, color=colour)
                bottom += values
            shares.set_xlabel("replicas")
            shares.set_ylabel("% of the replicas' time")
            shares.set_xticks(k)
            shares.legend(fontsize="small")
        speed.figure.tight_layout()
        from .plotting import show_in_notebook

        show_in_notebook(speed.figure, made_here)
        return speed


def _batches(train_iter, count):
    """The first `count` (images, labels) batches of train_iter (cycled if it is shorter)."""
    out = []
    while len(out) < count:
        before = len(out)
        for batch in train_iter:
            if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
                raise TypeError(f"train_iter must yield (images, labels) pairs, got {_check.shown(batch)}")
            out.append((np.asarray(batch[0]), np.asarray(batch[1])))
            if len(out) == count:
                break
        if len(out) == before:
            raise ValueError("train_iter yielded no batches")
    return out


def scaling_report(model_fn, train_iter, devices=None, steps=10, warmup=2, lr=0.1, verbose=True, plot=None):
    """Train ``steps`` steps (after ``warmup``) on 1, 2, ... len(devices)
    replicas and report images/s, speed-up, efficiency and where the time
    goes; see the module's docstring. ``model_fn()`` builds the model; it is
    called inside ``dp.MirroredStrategy(devices[:k]).scope()``, so a model
    built without ``devices=`` lands on those replicas. ``devices``: default
    every GPU, else ``['cpu:0', 'cpu:1']``. Prints the table and the verdict
    when ``verbose``; draws the figure in a notebook when ``plot`` (default:
    in a notebook). Returns a :class:`ScalingReport`."""
    from .strategy import MirroredStrategy
    from .models import Sequential

    model_fn = _check.function("model_fn", model_fn)
    steps = _check.integer("steps", steps, 1, 10**6)
    warmup = _check.integer("warmup", warmup, 0, 10**6)
    lr = _check.real("lr", lr, 0.0, float32=True)
    verbose = _check.boolean("verbose", verbose)
    if devices is None:
        gpus = [d for d in list_devices() if d.startswith("cuda:")]
        devices = gpus or ["cpu:0", "cpu:1"]
    devices = _check.device_names("devices", devices)
    kinds = {d.split(":")[0] for d in devices}
    if len(kinds) != 1:
        raise ValueError(f"devices must be of one kind (all CPU or all GPU), got {devices}")
    kind = kinds.pop()
    cores = _core.runtime_info()["cpu_cores"]
    batches = _batches(train_iter, warmup + steps)
    batch_size = len(batches[0][1])
    cpu_before = sum(d.startswith("cpu:") for d in list_devices())
    rows, timelines = [], []
    try:
        for k in range(1, len(devices) + 1):
            if kind == "cpu":
                set_logical_devices("cpu", k)
            chosen = [check_device(d) for d in devices[:k]]
            with MirroredStrategy(chosen).scope():
                net = model_fn()
            if not isinstance(net, Sequential):
                raise TypeError(f"model_fn must return a dpcore model, got {type(net).__name__}")
            if list(net.devices) != chosen:
                raise ValueError(f"model_fn built its model on {net.devices}, not on the strategy's {chosen}: build "
                                 "it without devices= so that the strategy places it")
            for X, y in batches[:warmup]:
                net.train_step(X, y, lr)
            seconds, images = [], 0
            with timeline.profile(net) as recorded:
                for X, y in batches[warmup:]:
                    start = time.perf_counter()
                    net.train_step(X, y, lr)
                    seconds.append(time.perf_counter() - start)
                    images += len(y)
            shares = recorded.timeline.shares()
            rows.append({
                "replicas": k, "devices": chosen, "kind": kind, "images_per_s": images / sum(seconds),
                "step_seconds": seconds, "compute_share": sum(shares[p] for p in _COMPUTE),
                "comm_share": shares["allreduce"], "wait_share": shares["wait"],
            })
            timelines.append(recorded.timeline)
            del net
    finally:
        if kind == "cpu":
            set_logical_devices("cpu", max(cpu_before, 1))
    for row in rows:
        row["speedup"] = row["images_per_s"] / rows[0]["images_per_s"]
        row["efficiency"] = row["speedup"] / row["replicas"]
    report = ScalingReport(rows, timelines, batch_size, cores)
    if verbose:
        print(report, flush=True)
    from .progress import in_notebook

    if plot or (plot is None and in_notebook()):
        report.plot()  # displayed in a notebook
    return report
