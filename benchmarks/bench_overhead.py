#!/usr/bin/env python3
"""What the notebook experience costs a LeNet epoch: the progress bar and the
step timeline, against the same epoch without them, in the same process.

Configurations, one epoch each on the Fashion-MNIST training set (batch 256,
lr 0.2, 2 logical CPU devices so that the timeline has all-reduces and waits
to record), in rotating order over the rounds (the machine is shared: each
configuration's best epoch counts, and every epoch is listed):

- plain:    dp.train(..., progress=False, profile=False)
- progress: progress=True, the bar drawn as on a terminal (tqdm writing to
            stderr, which the benchmark sends to /dev/null while it times)
- profile:  profile=True (the C core records every phase of every replica)

profile=False is the default path: its instrumentation is a thread-local
load and a branch per phase, no clock read, strictly less than what
profile=True does; the profile row bounds it.

    .venv/bin/python benchmarks/bench_overhead.py [--rounds 3] [--write]
"""
import argparse
import contextlib
import datetime
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_lenet_cpu as common  # noqa: E402
from bench_common import import_dpcore_or_exit  # noqa: E402

SECTION_TITLE = "## Progress bar and timeline overhead (LeNet epoch, CPU)"
CONFIGS = ("plain", "progress", "profile")


@contextlib.contextmanager
def bar_as_on_a_terminal():
    """tqdm's text bar drawn (stderr taken for a terminal) into /dev/null."""
    from dpcore import progress

    saved_check, saved_stderr = progress._stderr_is_terminal, sys.stderr
    with open(os.devnull, "w") as sink:
        progress._stderr_is_terminal = lambda: True
        sys.stderr = sink
        try:
            yield
        finally:
            progress._stderr_is_terminal, sys.stderr = saved_check, saved_stderr


def epoch(dp, config, train_iter):
    net = dp.models.LeNet(devices=["cpu:0", "cpu:1"])
    kwargs = dict(num_epochs=1, lr=0.2, verbose=False, progress=config == "progress", profile=config == "profile")
    context = bar_as_on_a_terminal() if config == "progress" else contextlib.nullcontext()
    with context:
        history = dp.train(net, train_iter, **kwargs)
    events = len(history.timeline) if history.timeline is not None else 0
    return history.epoch_seconds[0], events


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    dp = import_dpcore_or_exit()
    dp.set_logical_devices("cpu", 2)
    train_iter, _ = dp.data.load_fashion_mnist(batch_size=256)
    load_before = os.getloadavg()[0]
    times = {c: [] for c in CONFIGS}
    events = 0
    epoch(dp, "plain", train_iter)  # warm-up: caches, buffers
    for r in range(args.rounds):
        order = CONFIGS[r % 3:] + CONFIGS[:r % 3]
        for config in order:
            seconds, n = epoch(dp, config, train_iter)
            times[config].append(seconds)
            events = max(events, n)
            common.log(f"round {r + 1} {config}: {seconds:.3f} s")
    best = {c: min(t) for c, t in times.items()}
    import floor  # benchmarks/floor.py: the epoch's counted training FLOPs at the SGEMM rate of 2 threads
    epoch_floor = 60000 / floor.machine_floor(dp.models.LeNet(), 2)["images_per_s"]
    lines = [
        SECTION_TITLE, "",
        "- date: %s" % datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "- machine: %s; load average before / after: %.2f / %.2f" % (common.machine_info(), load_before,
                                                                     os.getloadavg()[0]),
        "- command (from the repository root): `%s`" % common.command_line(),
        "- setup: LeNet, Fashion-MNIST training set (60000 images), batch 256, 2 logical CPU devices, one epoch per "
        "configuration, %d rounds in rotating order; best epoch counts (a shared machine only ever slows one "
        "down); the timeline recorded %d events per epoch" % (args.rounds, events),
        "",
        "- floor (benchmarks/floor.py): the epoch's counted training FLOPs at the SGEMM rate of dpcore's BLAS "
        "with 2 threads, measured after the epochs: %.2f s" % epoch_floor,
        "",
        "| configuration | best epoch s | best epoch / floor | every epoch, s | overhead (best / plain's best - 1) |",
        "|---|---|---|---|---|",
    ]
    for c in CONFIGS:
        lines.append("| %s | %.3f | %.2fx | %s | %+.2f%% |" % (
            c, best[c], best[c] / epoch_floor, ", ".join("%.3f" % t for t in times[c]),
            100 * (best[c] / best["plain"] - 1)))
    lines += ["", "Goals: progress=True < 1%%, profile=True < 5%% (profile=False, the default path, does strictly "
              "less than profile=True). Measured: progress %+.2f%%, profile %+.2f%%." % (
                  100 * (best["progress"] / best["plain"] - 1), 100 * (best["profile"] / best["plain"] - 1)), ""]
    common.publish(lines, SECTION_TITLE, args.write)


if __name__ == "__main__":
    main()
