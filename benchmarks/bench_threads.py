"""Environment A/B (issue 14): does pinning each replica's threads to its
cores, or OpenMP's wait policy or binding, change dpcore's CPU training speed,
and do 2 replicas on 2 cores reach 1.8x one replica on one core by the median
of rounds? The same harness times the fusion of ReLU and average pooling
against the two ops run apart (DPCORE_FUSE=0), Winograd F(3x3, 5x5) for the
20 -> 50 convolution (DPCORE_WINOGRAD_F35=1: the fast precision's form) against
the implicit GEMM (the default), and the implicit GEMM against im2col + SGEMM.

    python benchmarks/bench_threads.py [--steps 15] [--rounds 3] [--write]

Each configuration runs in fresh subprocesses (OpenMP reads its environment
once, when the library loads), the configurations alternating round by round
so that the machine's load falls on all of them alike. Per subprocess, LeNet on
Fashion-MNIST batches of 256, --steps timed train_steps after 2 warm-up steps:

- one device with every core (``set_logical_devices('cpu', 1)``);
- one replica on one core (``set_logical_devices('cpu', 2)``, cpu:0 alone);
- 2 replicas, one core each (MirroredStrategy over cpu:0 and cpu:1).

Reported: the median step time over every timed step of every round, and the
scaling 2 replicas / one replica on one core (images/s), by the medians.
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_lenet_cpu import command_line, machine_info, publish  # noqa: E402

SECTION_TITLE = ("## Environment A/B: thread placement, OpenMP wait policy and binding, ReLU + pooling fusion, "
                 "implicit GEMM (LeNet, CPU)")

CONFIGS = {
    "default: no pinning, libgomp's own wait policy (spin a while, then sleep)": {},
    "DPCORE_PIN_THREADS=1 (each replica's threads pinned to its device's cores)": {"DPCORE_PIN_THREADS": "1"},
    "OMP_WAIT_POLICY=passive": {"OMP_WAIT_POLICY": "passive"},
    "OMP_WAIT_POLICY=active": {"OMP_WAIT_POLICY": "active"},
    "OMP_PROC_BIND=close, OMP_PLACES=cores": {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"},
    "DPCORE_FUSE=0 (ReLU and average pooling as two ops, not fused)": {"DPCORE_FUSE": "0"},
    "DPCORE_WINOGRAD_F35=1 (the 20 -> 50 convolution on Winograd F(3x3, 5x5), as set_precision('fast'))":
        {"DPCORE_WINOGRAD_F35": "1"},
    "DPCORE_WINOGRAD=0 DPCORE_IMPLICIT_GEMM=0 (the 20 -> 50 convolution on im2col + SGEMM)":
        {"DPCORE_WINOGRAD": "0", "DPCORE_IMPLICIT_GEMM": "0"},
}


def child(steps):
    import dpcore as dp

    it = dp.data.load_fashion_mnist(batch_size=256)[0]
    batches = []
    for X, y in it:
        batches.append((X, y))
        if len(batches) == steps + 2:
            break

    def times(net):
        out = []
        for i, (X, y) in enumerate(batches):
            t0 = time.perf_counter()
            net.train_step(X, y, lr=0.1)
            if i >= 2:
                out.append(time.perf_counter() - t0)
        return out

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        dp.set_logical_devices("cpu", 1)
        net = dp.models.LeNet(devices=["cpu:0"])
        result = {"one device": times(net)}
        dp.set_logical_devices("cpu", 2)
        result["one replica, one core"] = times(dp.models.LeNet(devices=["cpu:0"]))
        result["2 replicas"] = times(dp.models.LeNet(devices=["cpu:0", "cpu:1"]))
    import floor  # benchmarks/floor.py: a 256-image step's floor at 2 threads (1 for one core), measured now
    cores = int(os.environ["BENCH_CORES"])  # the parent's count: under OMP_PROC_BIND this process sees one core
    result["floor"] = {threads: 256 / floor.machine_floor(net, threads, quick=steps < 3)["images_per_s"]
                       for threads in sorted({1, cores})}
    print(json.dumps(result))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--configs", default=None,
                    help="comma-separated row numbers of the table to run (1-based; default: every row)")
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.steps)
        return
    load_before = os.getloadavg()[0]
    names = list(CONFIGS)
    if args.configs:
        names = [names[int(i) - 1] for i in args.configs.split(",")]
    samples = {name: {} for name in names}
    floors = []
    for r in range(args.rounds):
        order = names if r % 2 == 0 else list(reversed(names))
        for name in order:
            env = {k: v for k, v in os.environ.items()
                   if not k.startswith(("OMP_WAIT", "OMP_PROC", "OMP_PLACES", "DPCORE_PIN", "DPCORE_FUSE", "DPCORE_WINOGRAD",
                                          "DPCORE_IMPLICIT_GEMM"))}
            env.update(CONFIGS[name])
            env["BENCH_CORES"] = str(len(os.sched_getaffinity(0)))
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--steps", str(args.steps)],
                                 env=env, capture_output=True, text=True, check=True)
            result = json.loads(out.stdout.splitlines()[-1])
            floors.append(result.pop("floor"))
            for what, ts in result.items():
                samples[name].setdefault(what, []).extend(ts)
            print(f"round {r + 1}: {name} done", flush=True)
    whats = ["one device", "one replica, one core", "2 replicas"]
    fl = {int(t): min(f[t] for f in floors) for t in floors[0]}  # every child measured the same thread counts
    many = max(fl)
    lines = [SECTION_TITLE, "",
             f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
             f"- machine: {machine_info()}; load average before / after: {load_before:.2f} / "
             f"{os.getloadavg()[0]:.2f}",
             f"- command (from the repository root): `{command_line()}`",
             f"- setup: LeNet, Fashion-MNIST batches of 256, {args.steps} timed steps per subprocess after 2 warm-up "
             f"steps, {args.rounds} rounds of fresh subprocesses (configurations alternating); median over all "
             "timed steps", "",
             f"- floor (benchmarks/floor.py): a step's counted training FLOPs at the SGEMM rate of dpcore's BLAS, "
             f"measured in every subprocess after its steps, the best (lowest) of them: {fl[many] * 1e3:.1f} ms with "
             f"{many} threads (one device, 2 replicas), {fl[1] * 1e3:.1f} ms with 1 (one replica on one core); "
             f"(x.xx) = step / floor", "",
             "| environment | one device (all cores), ms | one replica on one core, ms | 2 replicas, ms | "
             "2 replicas / one replica on one core (images/s, medians) |", "|---|---|---|---|---|"]
    for name in names:
        med = {w: statistics.median(samples[name][w]) for w in whats}
        lines.append(f"| {name} | {med['one device'] * 1e3:.1f} ({med['one device'] / fl[many]:.2f}) | "
                     f"{med['one replica, one core'] * 1e3:.1f} ({med['one replica, one core'] / fl[1]:.2f}) | "
                     f"{med['2 replicas'] * 1e3:.1f} ({med['2 replicas'] / fl[many]:.2f}) | "
                     f"{med['one replica, one core'] / med['2 replicas']:.2f}x |")
    publish(lines, SECTION_TITLE, args.write)


if __name__ == "__main__":
    main()
