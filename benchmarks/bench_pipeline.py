"""Pipeline parallelism on the CPU: a 2-stage pipeline on 2 logical CPU
devices (one core each) against one device with both cores, in the same run.

    python benchmarks/bench_pipeline.py [--steps 20] [--rounds 3] [--resnet-steps 2] [--write]

For LeNet (Fashion-MNIST batches of 256) and ResNet-18 (batch 64, fewer steps):
one device with every core, 2 data-parallel replicas (MirroredStrategy, the
peer that needs no cut), then PipelineStrategy with 2 stages for m = 1, 2, 4, 8
micro-batches and both schedules. Per configuration: images/s (best round of
--rounds), the ratio to one device, the measured bubble (idle / (stages x step
time), from net.pipeline_report()) beside (p - 1) / (m + p - 1), each stage's
share of the busy time, and the activation bytes each stage allocated (1F1B
keeps at most p - i micro-batches' activations, GPipe m). Then the layerwise
split (ModelParallelStrategy) over the same 2 devices: images/s and parameter
bytes per device. With --write the table goes to benchmarks/RESULTS.md.
"""
import argparse
import datetime
import os
import sys
import time
import warnings

import numpy as np

import dpcore as dp
from dpcore import pipeline

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import floor  # noqa: E402
from bench_lenet_cpu import command_line, machine_info, publish  # noqa: E402

SECTION_TITLE = "## Pipeline parallelism, CPU (2 stages on 2 cores vs one device)"


def batches(model, batch, steps):
    it = dp.data.load_fashion_mnist(batch_size=batch)[0]
    out = []
    for X, y in it:
        out.append((X, y))
        if len(out) == steps:
            break
    return out


def time_steps(net, data, rounds, lr):
    """Images/s of the best round (each round: every batch once), after one warm-up step."""
    net.train_step(*data[0], lr=lr)
    if isinstance(getattr(net, "_pipeline", None), pipeline.Pipeline):
        net.reset_pipeline_report()
    best = 0.0
    for _ in range(rounds):
        t0 = time.perf_counter()
        for X, y in data:
            net.train_step(X, y, lr=lr)
        best = max(best, sum(len(y) for _, y in data) / (time.perf_counter() - t0))
    return best


def run(model_name, make, batch, steps, rounds, micro_batches, lr):
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        dp.set_logical_devices("cpu", 1)
    data = batches(model_name, batch, steps)
    one_net = make(["cpu:0"])
    one = time_steps(one_net, data, rounds, lr)
    # the floor (benchmarks/floor.py): the network's counted training FLOPs at the SGEMM rate of the
    # machine's cores, measured now
    fl = floor.machine_floor(one_net, len(os.sched_getaffinity(0)), quick=steps < 3)["images_per_s"]
    rows.append((model_name, "one device, 2 cores", "-", "-", one, 1.0, None, None, None, None))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        dp.set_logical_devices("cpu", 2)
    mirrored = time_steps(make(["cpu:0", "cpu:1"]), data, rounds, lr)
    rows.append((model_name, "2 replicas (MirroredStrategy)", "-", "-", mirrored, mirrored / one, None, None, None,
                 None))
    for schedule in ("1f1b", "gpipe"):
        for m in micro_batches:
            with dp.PipelineStrategy(devices=["cpu:0", "cpu:1"], micro_batches=m, schedule=schedule).scope():
                net = make(None)
            rate = time_steps(net, data, rounds, lr)
            r = net.pipeline_report()
            shares = "/".join(f"{b / sum(r.busy_seconds):.0%}" for b in r.busy_seconds)
            acts = "/".join(f"{a / 2**20:.1f}" for a in r.activation_bytes)
            rows.append((model_name, f"pipeline, split {net._pipeline.split}", schedule, m, rate, rate / one, r.bubble,
                         r.bubble_formula, shares, acts))
            print(f"{model_name} {schedule} m={m}: {rate:.0f} img/s, bubble {r.bubble:.1%} "
                  f"(formula {r.bubble_formula:.1%})", flush=True)
    with dp.ModelParallelStrategy(devices=["cpu:0", "cpu:1"]).scope():
        net = make(None)
    rate = time_steps(net, data, rounds, lr)
    r = net.model_parallel_report()
    layerwise = (model_name, rate, rate / one, r.model_param_bytes, r.param_bytes, r.fraction, fl / rate)
    print(f"{model_name} layerwise over 2: {rate:.0f} img/s, parameter fractions {r.fraction}", flush=True)
    return [row + (fl / row[4],) for row in rows], layerwise, fl


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20, help="LeNet steps of batch 256 per round (default 20)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per configuration; the best counts (default 3)")
    ap.add_argument("--resnet-steps", type=int, default=2, help="ResNet-18 steps of batch 64 per round (0: skip)")
    ap.add_argument("--micro-batches", default="1,2,4,8")
    ap.add_argument("--write", action="store_true", help="put the table into benchmarks/RESULTS.md")
    args = ap.parse_args(argv)
    ms = [int(m) for m in args.micro_batches.split(",")]
    load_before = os.getloadavg()[0]
    rows, lw, fl = run("LeNet", lambda d: dp.models.LeNet(devices=d), 256, args.steps, args.rounds, ms, 0.2)
    layerwise = [lw]
    floors = [("LeNet", fl)]
    if args.resnet_steps:
        more, lw, fl = run("ResNet-18", lambda d: dp.models.ResNet18(devices=d), 64, args.resnet_steps,
                       max(1, args.rounds - 1), ms, 0.05)
        rows += more
        layerwise.append(lw)
        floors.append(("ResNet-18", fl))
    load_after = os.getloadavg()[0]
    lines = [SECTION_TITLE, "",
             f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
             f"- machine: {machine_info()}; load average before / after: {load_before:.2f} / {load_after:.2f}",
             f"- command (from the repository root): `{command_line()}`",
             f"- setup: Fashion-MNIST batches (LeNet: {args.steps} of 256, ResNet-18: {args.resnet_steps} of 64 per "
             f"round), best of {args.rounds} rounds after a warm-up step; one device = `set_logical_devices('cpu', 1)`"
             f" (both cores), pipelines and replicas on 2 logical devices of one core each; stages balanced by "
             f"measured layer time (the default); bubble = idle / (stages x step time) from `net.pipeline_report()`",
             "",
             "- floor (benchmarks/floor.py): the network's counted training FLOPs per image at the SGEMM rate of "
             "dpcore's BLAS on the machine's cores, measured after the one-device run: "
             + ", ".join(f"{name} {ips:.0f} images/s" for name, ips in floors) + "; time / floor = floor images/s / "
             "measured images/s", "",
             "| model | configuration | schedule | m | images/s | vs one device | time / floor | bubble measured "
             "| (p-1)/(m+p-1) | busy share per stage | activations MB per stage |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, conf, sched, m, rate, ratio, bubble, formula, shares, acts, vs_floor in rows:
        lines.append(f"| {name} | {conf} | {sched} | {m} | {rate:.0f} | {ratio:.2f}x | {vs_floor:.2f}x | "
                     f"{'-' if bubble is None else f'{bubble:.1%}'} | {'-' if formula is None else f'{formula:.1%}'} | "
                     f"{shares or '-'} | {acts or '-'} |")
    lines += ["", "Layerwise split (`ModelParallelStrategy`) over the same 2 logical devices, against the same one "
              "device: parameter bytes per device counted from the C core's models on each (with the 64-byte "
              "alignment of every tensor slice).", "",
              "| model | images/s | vs one device | time / floor | parameters, whole model | parameters per device "
              "| fraction |",
              "|---|---|---|---|---|---|---|"]
    for name, rate, ratio, whole, per, frac, vs_floor in layerwise:
        lines.append(f"| {name} | {rate:.0f} | {ratio:.2f}x | {vs_floor:.2f}x | {whole / 2**20:.2f} MB | "
                     f"{' / '.join(f'{b / 2**20:.2f}' for b in per)} MB | {' / '.join(f'{f:.3f}' for f in frac)} |")
    publish(lines, SECTION_TITLE, args.write)


if __name__ == "__main__":
    main()
