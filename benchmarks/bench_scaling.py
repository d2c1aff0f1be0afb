#!/usr/bin/env python3
"""Data-parallel scaling of LeNet (or ResNet-18) training on the CPU, and the fixed cost of one step.

(a) Throughput (images/s) of LeNet training steps at the same per-replica batch B
    (default 128), each configuration in a fresh subprocess of this script
    (``dp.set_logical_devices`` is process-global and OpenMP thread pools are sticky):

        1rep-1core   1 replica on cpu:0 of set_logical_devices('cpu', 2): 1 thread, batch B
        2rep         2 replicas on cpu:0, cpu:1 (1 thread each), global batch 2B
        1rep-2core   1 replica on the whole machine (2 threads), batch 2B  (for context)
        2procs-1core two 1rep-1core processes at once, timed steps started together, their
                     images/s summed: two trainers that never synchronise, the ceiling
                     this machine puts on 2rep (for context)

    Timed with time.perf_counter around --steps (default 40) calls of
    ``net.train_step(X, y, lr)`` on batches prepared before timing (the first
    (warm-up + steps) batches of Fashion-MNIST's shuffled training set, uint8; or
    synthetic uint8 data of the same shape with --data synthetic), after --warmup
    (default 5) steps. --rounds (default 5) rounds, the configurations' order rotating
    from round to round; each configuration's best uncontended round counts, and the ratios
    within each round (runs seconds apart) are reported too. Also reported: the
    process CPU time over the timed steps / wall time ("cores busy"), which shows
    whether a configuration really had the cores it was given on this shared machine.
    Goal: 2rep >= 1.8x 1rep-1core.

    Each run also measures its floor (benchmarks/floor.py), after its timed steps and with
    its own thread count: the network's counted training FLOPs per image over the SGEMM
    rate of dpcore's BLAS on that many threads (the pair: the sum of its two one-thread
    rates). "time / floor" = floor images/s over measured images/s: 1.0 would be every
    multiply at the large-SGEMM rate.

    --model resnet18 runs part (a) on ResNet-18 (28x28 inputs, default per-replica batch 16,
    3 warm-up + 8 timed steps, 3 rounds) into a section of its own.

(b) The fixed cost of a step: tiny batches (1 and 4 samples) on 1 replica (1 thread)
    and on 2 replicas (1 thread each), in one subprocess. Per call, best of --fixed-repeats
    (default 8) loops of >= --min-seconds (default 0.05) each, measurements in rotating order:

        (i)   Python call floor: the C getter ``net._model.num_classes``
        (ii)  ``net._model.evaluate(X, y)``            forward only, 1 replica
        (iii) ``net._model.forward_backward(X, y, s)`` forward + backward, 1 replica
        (iv)  ``net._model.sgd_step(lr)``              SGD over the flat buffer (~129k floats)
        (v)   ``net._model.train_step(X, y, lr)``      (iii) + (iv) in one call
        (vi)  ``net._mirrored.train_step(X, y, lr)``   2 replicas (also its evaluate and
              forward_backward, and ``net.train_step``, the Python wrapper)
        (vii) ``_core.allreduce_benchmark(2, nparams, iters) / iters``: one all-reduce of
              the gradient buffer inside a running replica group (no fork-join)
        (viii) one fork-join of the replica threads (``dp_group_run``): ``_mirrored.evaluate``
              minus ``_model.evaluate``, both on an empty batch

    The parallel overhead of a 2-replica step is (vi) at batch n minus the work of one
    replica, i.e. 1-replica train_step at ceil(n/2) samples: what the 2 replicas add
    (GROUP_RUNS_PER_STEP fork-joins of the replica threads, the barriers and the
    all-reduce of the gradients, and the two replicas slowing each other down).

Usage (from the repository root):

    .venv/bin/python benchmarks/bench_scaling.py             # (a) and (b), print tables
    .venv/bin/python benchmarks/bench_scaling.py --write     # ... and update RESULTS.md
    .venv/bin/python benchmarks/bench_scaling.py --quick     # smoke run: 1 round of 10 steps, short loops, a
                                                             # rough floor (a 512^3 SGEMM)
    .venv/bin/python benchmarks/bench_scaling.py --model resnet18 --part a --write
    options: --part a|b|both  --batch B (per replica, default 128)  --steps S  --warmup W
             --rounds R  --min-seconds T (part b)  --data real|synthetic  --data-dir DIR
             --quiet-budget S  --results PATH

On a shared machine, before each round (and each repeat of part (b)) the script waits (at
most --quiet-budget seconds in all, default 120) until other processes use < 0.2 cores,
and every run records how many cores other processes kept busy while it was timed
("others' cores"); runs with >= 0.25 are marked contended and left out of the best-of.

Exit status: 0 on success; 2 when dpcore cannot be imported; 1 when a subprocess fails.
"""
import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_common import EXIT_DPCORE_MISSING, RESULT_MARKER, emit_result, import_dpcore_or_exit, log  # noqa: E402
from bench_lenet_cpu import command_line, default_threads, machine_info  # noqa: E402

DEFAULT_RESULTS = os.path.join(HERE, "RESULTS.md")
DEFAULT_DATA_DIR = "/usr/share/datasets/fashion-mnist"
SECTION_TITLE = "## Scaling and fixed cost (LeNet, CPU)"
RESNET_SECTION_TITLE = "## Scaling (ResNet-18, CPU)"
MODEL_NAMES = {"lenet": "LeNet", "resnet18": "ResNet-18"}
LR = 0.2
GOAL = 1.8
# name -> (logical CPU devices, replica devices, global batch in units of the per-replica batch)
CONFIGS = {
    "1rep-1core": (2, ["cpu:0"], 1),
    "2rep": (2, ["cpu:0", "cpu:1"], 2),
    "1rep-2core": (1, ["cpu:0"], 2),
}
TINY = (1, 4)
# Two independent 1rep-1core processes at once (no synchronisation at all): what this machine gives
# two single-thread trainers, the ceiling for 2rep.
PAIR = "2procs-1core"
PAIR_START_DELAY = 4.0  # seconds for both children to load data and warm up before their common start
# dp_group_run calls (wake the replica threads, wait for all) per Mirrored train_step of a model without
# BatchNorm: the whole step in one run since commit c88189b (a failing replica breaks the barrier instead
# of needing a run of its own); 2 with BatchNorm (staging apart); it was 2-3 before.
GROUP_RUNS_PER_STEP = 1


def child_env():
    """The same environment for every configuration: the thread knobs at the machine's cores
    (dpcore then sets each replica thread's OpenMP/OpenBLAS count to its device's share)."""
    # Not OPENBLAS_NUM_THREADS=1 (as bench_allreduce.py sets for itself): dpcore's OpenBLAS (the OpenMP
    # build) reads it too and would then run the dense layers' GEMMs on one thread in 1rep-2core. numpy's
    # bundled OpenBLAS gets the same value; its pool thread spins only briefly after numpy's import (perf:
    # none of its samples fall in the timed steps), since the children make no numpy BLAS calls.
    env = dict(os.environ)
    cores = str(default_threads())
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = cores
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


# ---------------------------------------------------------------------------------------------
# Children
# ---------------------------------------------------------------------------------------------

def make_batches(dp, batch, count, data, data_dir):
    """`count` batches of `batch` uint8 images (N, 1, 28, 28) and int64 labels, made before timing."""
    import numpy as np
    if data == "real":
        try:
            train_iter, _ = dp.data.load_fashion_mnist(batch, root=data_dir)
            out = []
            for X, y in train_iter:
                if len(X) == batch:
                    out.append((np.ascontiguousarray(X), np.ascontiguousarray(y, dtype=np.int64)))
                if len(out) == count:
                    return out, "Fashion-MNIST"
            log("Fashion-MNIST has fewer than %d full batches of %d; using synthetic data" % (count, batch))
        except (OSError, ValueError) as e:
            log("Fashion-MNIST not loadable (%s); using synthetic data" % e)
    rng = np.random.default_rng(0)
    return [(rng.integers(0, 256, (batch, 1, 28, 28), dtype=np.uint8),
             rng.integers(0, 10, batch).astype(np.int64)) for _ in range(count)], "synthetic"


def child_throughput(args):
    dp = import_dpcore_or_exit()
    ndev, devices, mult = CONFIGS[args.config]
    dp.set_logical_devices("cpu", ndev)
    batch = args.batch * mult
    net = (dp.models.ResNet18 if args.model == "resnet18" else dp.models.LeNet)(seed=0, devices=devices)
    threads = [r.threads for r in net._replicas]
    batches, source = make_batches(dp, batch, args.warmup + args.steps, args.data, args.data_dir)
    for X, y in batches[:args.warmup]:
        net.train_step(X, y, LR)
    from bench_allreduce import CpuWindow  # (its import sets OPENBLAS_NUM_THREADS, too late to matter here)
    if args.start_at is not None:  # 2procs: start timing together with the sibling (CLOCK_MONOTONIC is system-wide)
        time.sleep(max(0.0, args.start_at - time.monotonic()))
    timed = batches[args.warmup:]
    step_times = []
    window = CpuWindow()
    c0 = time.process_time()
    t0 = time.perf_counter()
    for X, y in timed:
        s = time.perf_counter()
        net.train_step(X, y, LR)
        step_times.append(time.perf_counter() - s)
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0
    others = window.measure()
    step_times.sort()
    import floor  # benchmarks/floor.py: this run's own thread count, after its timed steps
    fl = floor.machine_floor(net, sum(threads), quick=args.quick_floor)
    return {"config": args.config, "sgemm_gflops": fl["sgemm_gflops"], "floor_ips": fl["images_per_s"], "devices": devices, "threads": threads, "batch": batch,
            "steps": len(timed), "seconds": wall, "ips": batch * len(timed) / wall, "cores_busy": cpu / wall,
            "median_step_ms": 1e3 * step_times[len(step_times) // 2], "data": source,
            "others_cores": None if others is None else others[0],
            "replicas_identical": bool(net.replicas_identical())}


def per_call(fn, min_seconds, repeats=1):
    """Best-of-`repeats` mean seconds per call of fn() over loops of >= min_seconds."""
    iters = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        t = time.perf_counter() - t0
        if t >= min(0.02, min_seconds / 4):
            break
        iters *= 2 if t <= 0 else max(2, min(64, int(0.03 / t)))
    iters = max(1, int(math.ceil(1.1 * min_seconds * iters / t)))
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - t0) / iters)
    return best


def child_fixed(args):
    import numpy as np
    dp = import_dpcore_or_exit()
    from dpcore import _core
    dp.set_logical_devices("cpu", 2)
    net1 = dp.models.LeNet(seed=0, devices=["cpu:0"])             # 1 replica, 1 thread
    net2 = dp.models.LeNet(seed=0, devices=["cpu:0", "cpu:1"])    # 2 replicas, 1 thread each
    m1, mir = net1._model, net2._mirrored
    lr = 1e-3  # small: hundreds of thousands of steps on one tiny batch must stay finite
    rng = np.random.default_rng(0)
    sizes = sorted(set(TINY) | {(n + 1) // 2 for n in TINY})
    data = {n: (rng.integers(0, 256, (n, 1, 28, 28), dtype=np.uint8), rng.integers(0, 10, n).astype(np.int64))
            for n in sizes}
    nparams = m1.nparams

    def allreduce_once():
        allreduce_once.last = _core.allreduce_benchmark(2, nparams, allreduce_once.iters) / allreduce_once.iters
    allreduce_once.iters = 200

    X0, y0 = np.zeros((0, 1, 28, 28), np.uint8), np.zeros(0, np.int64)
    tasks = {"floor": lambda: m1.num_classes, "sgd_step 1rep": lambda: m1.sgd_step(lr),
             "evaluate 1rep n=0": lambda: m1.evaluate(X0, y0), "evaluate 2rep n=0": lambda: mir.evaluate(X0, y0)}
    for n in sizes:
        X, y = data[n]
        tasks["evaluate 1rep n=%d" % n] = (lambda X, y: lambda: m1.evaluate(X, y))(X, y)
        tasks["forward_backward 1rep n=%d" % n] = (lambda X, y, s: lambda: m1.forward_backward(X, y, s))(X, y, 1.0 / n)
        tasks["train_step 1rep n=%d" % n] = (lambda X, y: lambda: m1.train_step(X, y, lr))(X, y)
    for n in TINY:
        X, y = data[n]
        tasks["train_step 2rep n=%d" % n] = (lambda X, y: lambda: mir.train_step(X, y, lr))(X, y)
        tasks["forward_backward 2rep n=%d" % n] = (lambda X, y: lambda: mir.forward_backward(X, y))(X, y)
        tasks["evaluate 2rep n=%d" % n] = (lambda X, y: lambda: mir.evaluate(X, y))(X, y)
        tasks["net.train_step 2rep n=%d" % n] = (lambda X, y: lambda: net2.train_step(X, y, lr))(X, y)
        tasks["net.train_step 1rep n=%d" % n] = (lambda X, y: lambda: net1.train_step(X, y, lr))(X, y)

    from bench_allreduce import CpuWindow, QuietWaiter
    quiet = QuietWaiter(args.quiet_budget)
    window = CpuWindow()
    names = list(tasks)
    best = {name: math.inf for name in names}
    for r in range(args.fixed_repeats):
        quiet.wait()
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            try:
                best[name] = min(best[name], per_call(tasks[name], args.min_seconds))
            except Exception as e:  # a call this build does not support: leave it out
                log("%s: %s: %s" % (name, type(e).__name__, e))
                best[name] = math.nan
        # the all-reduce in a running group: one C loop, sized to ~min_seconds
        t = _core.allreduce_benchmark(2, nparams, 50) / 50
        iters = max(50, int(args.min_seconds / max(t, 1e-9)))
        best["allreduce k=2"] = min(best.get("allreduce k=2", math.inf),
                                    _core.allreduce_benchmark(2, nparams, iters) / iters)
    others = window.measure()
    ok = all(math.isfinite(v) for v in m1.get_params()[:1000])
    return {"us": {k: (v * 1e6 if math.isfinite(v) else None) for k, v in best.items()}, "nparams": int(nparams),
            "tiny": list(TINY),
            "params_finite": bool(ok), "replicas_identical": bool(net2.replicas_identical()),
            "others_cores": None if others is None else others[0], "waited": quiet.waited}


def run_child(args):
    result = child_throughput(args) if args.child == "throughput" else child_fixed(args)
    emit_result(result)


# ---------------------------------------------------------------------------------------------
# Parent
# ---------------------------------------------------------------------------------------------

def child_cmd(args, extra, waited=0.0):
    return [sys.executable, os.path.abspath(__file__)] + list(extra) + [
        "--model", args.model, "--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
        "--data", args.data, "--data-dir", args.data_dir, "--min-seconds", str(args.min_seconds),
        "--fixed-repeats", str(args.fixed_repeats), "--quiet-budget", str(max(0.0, args.quiet_budget - waited))] + (
        ["--quick-floor"] if args.quick else [])


def parse_result(rc, stdout, extra):
    if rc != 0:
        return None, rc
    for line in stdout.splitlines():
        if line.startswith(RESULT_MARKER):
            return json.loads(line[len(RESULT_MARKER):]), 0
    log("subprocess %s printed no result" % " ".join(extra))
    return None, 1


def spawn(args, *extra, waited=0.0):
    proc = subprocess.run(child_cmd(args, extra, waited), env=child_env(), stdout=subprocess.PIPE, text=True)
    return parse_result(proc.returncode, proc.stdout, extra)


def spawn_pair(args):
    """PAIR: two 1rep-1core children at once, their timed steps started together. Returns one result
    with their summed throughput; others' cores measured by the parent (each child would count its
    sibling as 'other')."""
    from bench_allreduce import CpuWindow
    extra = ["--child", "throughput", "--config", "1rep-1core",
             "--start-at", "%.6f" % (time.monotonic() + PAIR_START_DELAY)]
    window = CpuWindow()
    procs = [subprocess.Popen(child_cmd(args, extra), env=child_env(), stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate()[0] for p in procs]
    others = window.measure()
    res = [parse_result(p.returncode, o, extra) for p, o in zip(procs, outs)]
    for r, rc in res:
        if r is None:
            return None, rc
    a, b = res[0][0], res[1][0]
    return dict(a, config=PAIR, threads=a["threads"] + b["threads"], batch=a["batch"] + b["batch"],
                ips=a["ips"] + b["ips"], seconds=max(a["seconds"], b["seconds"]),
                sgemm_gflops=a["sgemm_gflops"] + b["sgemm_gflops"], floor_ips=a["floor_ips"] + b["floor_ips"],
                cores_busy=a["cores_busy"] + b["cores_busy"],
                median_step_ms=max(a["median_step_ms"], b["median_step_ms"]),
                others_cores=None if others is None else others[0], procs=2), 0


def run_throughput(args, quiet):
    names = list(CONFIGS) + [PAIR]
    runs = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        quiet.wait()  # once per round: a round's runs should share one quiet stretch
        for name in order:
            if name == PAIR:
                res, rc = spawn_pair(args)
            else:
                res, rc = spawn(args, "--child", "throughput", "--config", name)
            if res is None:
                log("%s subprocess failed (exit status %d)" % (name, rc))
                return None, rc
            log("  round %d %-10s %7.0f images/s  %.3f s  cores busy %.2f  others %s  median step %.1f ms" % (
                r + 1, name, res["ips"], res["seconds"], res["cores_busy"], fmt2(res["others_cores"]),
                res["median_step_ms"]))
            runs[name].append(res)
    return runs, 0


def fmt2(x):
    return "-" if x is None else "%.2f" % x


CONTENDED = 0.25  # others' cores above which a run is "contended" and left out of the best-of


def clean(run):
    return run["others_cores"] is not None and run["others_cores"] < CONTENDED


def best_run(rs):
    """The fastest uncontended run (the fastest of all when every run was contended)."""
    pool = [r for r in rs if clean(r)] or rs
    return max(pool, key=lambda r: r["ips"])


def throughput_table(runs):
    base = best_run(runs["1rep-1core"])["ips"]
    rows = ["| configuration | replicas x threads | global batch | images/s (best) | vs 1rep-1core "
            "| floor images/s (SGEMM GFLOP/s) | time / floor "
            "| cores busy (best run) | others' cores (best run) | median step ms (best run) "
            "| images/s, every round (others' cores; * = contended) |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, rs in runs.items():
        b = best_run(rs)
        layout = ("2 procs x 1" if b.get("procs") else
                  "%d x %s" % (len(b["threads"]), "/".join(map(str, b["threads"]))))
        # the floor at the best SGEMM rate any of the configuration's runs measured (a rate is only ever
        # measured too low on a shared machine)
        fl = max(rs, key=lambda r: r["sgemm_gflops"])
        rows.append("| %s | %s | %s | %.0f | %.2fx | %.0f (%.0f) | %.2fx | %.2f | %s | %.1f | %s |" % (
            name, layout, "2 x %d" % (b["batch"] // 2) if b.get("procs") else b["batch"], b["ips"], b["ips"] / base,
            fl["floor_ips"], fl["sgemm_gflops"], fl["floor_ips"] / b["ips"], b["cores_busy"], fmt2(b["others_cores"]), b["median_step_ms"],
            ", ".join("%.0f (%s)%s" % (r["ips"], fmt2(r["others_cores"]), "" if clean(r) else "*") for r in rs)))
    return "\n".join(rows)


def scaling_ratio(runs):
    best = {n: best_run(rs)["ips"] for n, rs in runs.items()}
    return best["2rep"] / best["1rep-1core"], best["1rep-2core"] / best["1rep-1core"], best["2rep"] / best["1rep-2core"]


PAIRS = (("2rep", "1rep-1core"), ("1rep-2core", "1rep-1core"), (PAIR, "1rep-1core"), ("2rep", PAIR),
         ("2rep", "1rep-2core"))


def round_ratios(runs, a, b):
    """a / b images/s within each round where both runs were uncontended (runs minutes apart
    on a shared host drift; runs seconds apart much less)."""
    return [x["ips"] / y["ips"] for x, y in zip(runs[a], runs[b]) if clean(x) and clean(y)]


def median(xs):
    xs = sorted(xs)
    return None if not xs else (xs[len(xs) // 2] if len(xs) % 2 else 0.5 * (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]))


def ratio_lines(runs):
    r2, r12, r2v = scaling_ratio(runs)
    best = {n: best_run(rs)["ips"] for n, rs in runs.items()}
    out = ["2 replicas / 1 replica on 1 core: %.3fx (best uncontended runs; goal >= %.1f: %s); "
           "1 replica on 2 cores / 1 core: %.3fx; two independent 1-core processes / one: %.3fx; "
           "2 replicas / two independent processes: %.3fx; 2 replicas / 1 replica on 2 cores: %.3fx" % (
               r2, GOAL, "met" if r2 >= GOAL else "not met", r12, best[PAIR] / best["1rep-1core"],
               best["2rep"] / best[PAIR], r2v)]
    for a, b in PAIRS:
        rr = round_ratios(runs, a, b)
        out.append("%s / %s within a round: %s (median %s)" % (
            a, b, ", ".join("%.2f" % x for x in rr) or "no uncontended round",
            "-" if not rr else "%.3f" % median(rr)))
    return out


def _sub(a, *bs):
    return None if a is None or any(b is None for b in bs) else a - sum(bs)


def fixed_rows(fx):
    """Table rows for part (b): (label, value at n=TINY[0], value at n=TINY[1]) in microseconds (None: not measured)."""
    us = fx["us"]
    g = us.get
    fork_join = _sub(g("evaluate 2rep n=0"), g("evaluate 1rep n=0"))
    rows = [("(i) Python call floor: `_model.num_classes`", g("floor"), g("floor")),
            ("(iv) `_model.sgd_step` (%d floats), 1 replica" % fx["nparams"], g("sgd_step 1rep"), g("sgd_step 1rep")),
            ("(vii) all-reduce of the gradient buffer, k=2, inside a running group",
             g("allreduce k=2"), g("allreduce k=2")),
            ("`_model.evaluate` on 0 samples, 1 replica", g("evaluate 1rep n=0"), g("evaluate 1rep n=0")),
            ("`_mirrored.evaluate` on 0 samples, 2 replicas", g("evaluate 2rep n=0"), g("evaluate 2rep n=0")),
            ("(viii) one fork-join (`dp_group_run`) = the difference of the two above", fork_join, fork_join)]
    per_n = [
        ("(ii) `_model.evaluate`, 1 replica", "evaluate 1rep n=%d", 1),
        ("(iii) `_model.forward_backward`, 1 replica", "forward_backward 1rep n=%d", 1),
        ("(v) `_model.train_step`, 1 replica", "train_step 1rep n=%d", 1),
        ("`net.train_step`, 1 replica (with the Python wrapper)", "net.train_step 1rep n=%d", 1),
        ("(vi) `_mirrored.train_step`, 2 replicas", "train_step 2rep n=%d", 1),
        ("`net.train_step`, 2 replicas (with the Python wrapper)", "net.train_step 2rep n=%d", 1),
        ("`_mirrored.forward_backward`, 2 replicas", "forward_backward 2rep n=%d", 1),
        ("`_mirrored.evaluate`, 2 replicas", "evaluate 2rep n=%d", 1),
        ("1-replica `train_step` on the shard, ceil(n/2) samples", "train_step 1rep n=%d", 2),
    ]
    for label, key, div in per_n:
        rows.append((label,) + tuple(g(key % ((n + div - 1) // div)) for n in TINY))
    over = [_sub(g("train_step 2rep n=%d" % n), g("train_step 1rep n=%d" % ((n + 1) // 2))) for n in TINY]
    rows.append(("**parallel overhead per step** = (vi) - 1-replica train_step(ceil(n/2))",) + tuple(over))
    runs = GROUP_RUNS_PER_STEP
    rows.append(("... of which %d fork-joins (%d x (viii))" % (runs, runs),) + (
        None if fork_join is None else runs * fork_join,) * 2)
    rows.append(("... of which the all-reduce (vii)", g("allreduce k=2"), g("allreduce k=2")))
    rows.append(("... rest: barrier waits, uneven shards, the replicas slowing each other",) + tuple(
        _sub(o, runs * fork_join, g("allreduce k=2")) if fork_join is not None else None for o in over))
    return rows


def fixed_table(fx):
    out = ["| per call (us) | n = %d | n = %d |" % TINY, "|---|---|---|"]
    for label, a, b in fixed_rows(fx):
        out.append("| %s | %s | %s |" % (label, "-" if a is None else "%.1f" % a, "-" if b is None else "%.1f" % b))
    return "\n".join(out)


def fmt_us(x):
    return "-" if x is None else "%.0f" % x


def section_title(args):
    return RESNET_SECTION_TITLE if args.model == "resnet18" else SECTION_TITLE


def section_text(args, runs, fx, load_before, load_after, others, wall):
    lines = [
        section_title(args),
        "",
        "- date: %s" % datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "- machine: %s" % machine_info(),
        "- load average (1 min) before / after: %s / %s (this run's own threads count too); during the run %s "
        "(shared machine: configurations alternate, best round counts; 'cores busy' = the child's CPU time / "
        "wall time over its timed steps)" % (load_before, load_after, others),
        "- %s" % (fx or (runs and runs["2rep"][0]) or {}).get("build", "dpcore ?"),
        "- command (from the repository root): `%s`; %.0f s" % (command_line(), wall),
    ]
    if runs:
        data = runs["2rep"][0]["data"]
        lines += [
            "",
            "### (a) Throughput at the same per-replica batch (%d)" % args.batch,
            "",
            "- %s, plain SGD lr %g, %s batches (uint8) prepared before timing; %d warm-up + %d timed "
            "`net.train_step(X, y, lr)` calls per run; each run a fresh subprocess (OMP_NUM_THREADS="
            "OPENBLAS_NUM_THREADS=%d in all; dpcore gives each replica thread its device's share); %d rounds, "
            "order rotating" % (MODEL_NAMES[args.model], LR, data, args.warmup, args.steps, default_threads(),
                                args.rounds),
            "- floor: the network's counted training FLOPs per image (benchmarks/floor.py) at the SGEMM rate of "
            "dpcore's BLAS with the run's own threads, measured by each run after its timed steps (the best rate of "
            "a configuration's runs counts); time / floor = floor images/s / measured images/s (best run)",
            "- 1rep-1core: `set_logical_devices('cpu', 2)`, `%s(devices=['cpu:0'])`; 2rep: the same 2 devices, "
            "both replicas; 1rep-2core: one device with both cores; 2procs-1core: two 1rep-1core processes at once "
            "(timed steps started together, images/s summed): no synchronisation at all, the machine's ceiling "
            "for 2rep" % dict(lenet="LeNet", resnet18="ResNet18")[args.model],
            "- cores busy: the child's CPU time / wall time over the timed steps; others' cores: what other "
            "processes used meanwhile (/proc/stat busy time minus the child's); before each round the parent "
            "waited for < 0.2 others' cores (budget %.0f s in all); runs with others' cores >= %.2f are "
            "contended (*) and count only when every run of a configuration was" % (args.quiet_budget, CONTENDED),
            "",
            throughput_table(runs),
            "",
        ]
        rl = ratio_lines(runs)
        lines += ["**%s**" % rl[0], ""] + ["- %s" % l for l in rl[1:]]
    if fx:
        rows = fixed_rows(fx)
        over = [r for r in rows if r[0].startswith("**parallel")][0]
        fj = [r for r in rows if r[0].startswith("(viii)")][0][1]
        lines += [
            "",
            "### (b) Fixed cost of one step (tiny batches)",
            "",
            "- `set_logical_devices('cpu', 2)`; 1 replica = `LeNet(devices=['cpu:0'])` (1 thread), 2 replicas = "
            "`LeNet(devices=['cpu:0', 'cpu:1'])`, both in one subprocess; synthetic uint8 images, int64 labels, "
            "lr 1e-3; each number: mean per call over a loop of >= %.2g s, best of %d loops in rotating order; "
            "n = 1 on 2 replicas leaves replica 1 an empty shard; other processes kept %s cores busy meanwhile "
            "on average" % (args.min_seconds, args.fixed_repeats, fmt2(fx.get("others_cores"))),
            "",
            fixed_table(fx),
            "",
            "**Parallel overhead of a 2-replica step: %s us (n=%d), %s us (n=%d)**; one fork-join of the replica "
            "threads costs %s us (a train_step makes %d), the all-reduce of %d floats %s us." % (
                fmt_us(over[1]), TINY[0], fmt_us(over[2]), TINY[1], fmt_us(fj), GROUP_RUNS_PER_STEP, fx["nparams"],
                fmt_us(fx["us"].get("allreduce k=2"))),
        ]
    lines.append("")
    return "\n".join(lines)


def run_parent(args):
    if args.quick:
        args.min_seconds, args.fixed_repeats, args.quiet_budget = 0.03, 1, 0.0
    from bench_allreduce import CpuWindow, QuietWaiter  # (sets OPENBLAS_NUM_THREADS=1 here; child_env() overrides)
    load_before = "%.2f" % os.getloadavg()[0]
    window = CpuWindow()
    quiet = QuietWaiter(args.quiet_budget)
    t0 = time.perf_counter()
    runs = fx = None
    if args.part in ("a", "both"):
        log("(a) " + MODEL_NAMES[args.model] + " throughput, per-replica batch %d, %d+%d steps, %d round(s)" % (
            args.batch, args.warmup, args.steps, args.rounds))
        runs, rc = run_throughput(args, quiet)
        if runs is None:
            return EXIT_DPCORE_MISSING if rc == EXIT_DPCORE_MISSING else 1
    if args.part in ("b", "both"):
        log("(b) fixed cost of a step, batches of %s" % ", ".join(map(str, TINY)))
        quiet.wait()
        fx, rc = spawn(args, "--child", "fixed", waited=quiet.waited)
        if fx is not None:
            quiet.waited += fx.get("waited", 0.0)
        if fx is None:
            log("fixed-cost subprocess failed (exit status %d)" % rc)
            return EXIT_DPCORE_MISSING if rc == EXIT_DPCORE_MISSING else 1
    wall = time.perf_counter() - t0
    load_after = "%.2f" % os.getloadavg()[0]
    others = window.summary() + ("; waited %.0f s for a quiet machine" % quiet.waited if quiet.waited else "")

    print()
    if runs:
        print(throughput_table(runs))
        print()
        print("\n".join(ratio_lines(runs)))
        print()
    if fx:
        print(fixed_table(fx))
        if not fx["replicas_identical"] or not fx["params_finite"]:
            print("warning: replicas identical %s, parameters finite %s" % (fx["replicas_identical"],
                                                                            fx["params_finite"]))
        print()
    print("load average before / after: %s / %s; %s; %.0f s" % (load_before, load_after, others, wall))
    if args.write:
        if args.part != "both" and args.model == "lenet":
            log("--write needs --part both (the section holds both tables)")
            return 1
        from bench_lenet_cpu import replace_section
        replace_section(args.results, section_title(args),
                        section_text(args, runs, fx, load_before, load_after, others, wall))
        print("updated %s" % args.results)
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--part", choices=("a", "b", "both"), default="both")
    ap.add_argument("--model", choices=tuple(MODEL_NAMES), default="lenet")
    ap.add_argument("--batch", type=int, default=None, help="per-replica batch (default 128; resnet18: 16)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per run (default 40; resnet18: 8)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 5; resnet18: 3)")
    ap.add_argument("--rounds", type=int, default=None, help="runs per configuration (default 5; resnet18: 3)")
    ap.add_argument("--min-seconds", type=float, default=0.05, help="part (b): seconds per loop (default 0.05)")
    ap.add_argument("--fixed-repeats", type=int, default=8, help="part (b): loops per number (default 8)")
    ap.add_argument("--data", choices=("real", "synthetic"), default="real")
    ap.add_argument("--data-dir", default=os.environ.get("DPCORE_DATA", DEFAULT_DATA_DIR))
    ap.add_argument("--quiet-budget", type=float, default=120.0,
                    help="seconds in all to wait, before each round and each loop of part (b), for other processes "
                         "to use < 0.2 cores (default 120; 0: never wait)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 round of 2+10 steps, short loops")
    ap.add_argument("--write", action="store_true", help="update the section in --results")
    ap.add_argument("--results", default=DEFAULT_RESULTS, help="default benchmarks/RESULTS.md")
    ap.add_argument("--child", choices=("throughput", "fixed"), help=argparse.SUPPRESS)
    ap.add_argument("--config", choices=tuple(CONFIGS), help=argparse.SUPPRESS)
    ap.add_argument("--start-at", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--quick-floor", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    defaults = dict(batch=16, steps=8, warmup=3, rounds=3) if args.model == "resnet18" else \
        dict(batch=128, steps=40, warmup=5, rounds=5)
    if args.quick:  # what is not given explicitly
        defaults.update(steps=10, warmup=2, rounds=1)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.model == "resnet18" and args.part != "a":
        if args.part == "b":
            ap.error("--part b (the fixed cost) is LeNet's")
        args.part = "a"
    if min(args.batch, args.steps, args.rounds, args.fixed_repeats) < 1 or args.warmup < 0 or args.min_seconds <= 0:
        ap.error("--batch, --steps, --rounds, --fixed-repeats must be >= 1, --warmup >= 0, --min-seconds > 0")
    if args.child:
        if args.child == "throughput" and not args.config:
            ap.error("--child throughput needs --config")
        run_child(args)
        return 0
    return run_parent(args)


if __name__ == "__main__":
    sys.exit(main())
