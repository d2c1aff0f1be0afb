#!/usr/bin/env python3
"""Multi-process (MPI) data parallelism on the CPU: the gradient all-reduce across 2
processes, and LeNet training throughput of 2 processes against 2 in-process replicas.

Everything is measured in ONE run of this script, the configurations alternating in
rounds of fresh subprocesses (mpirun jobs for the multi-process side), so that the
ratios compare measurements taken seconds apart on this shared, noisy machine. The
numbers reported are medians over all timed loops (part 1) or over the rounds (part 2).

(1) All-reduce, 2 ranks, sizes 4 KiB .. 64 MiB (powers of 4; --sizes pow2 for powers of 2).
    Each mpirun job (``mpirun -np 2 --bind-to none``: Open MPI, ob1/vader shared memory with
    CMA single copies between the ranks) times, per size, in rotating order:

        chain        ``_core.dist_chain_benchmark(n, 1, iters, timeout)``: dist.c's rank-ordered
                     chain all-reduce (dp_dist_chain_allreduce), the algorithm of the gradient
                     all-reduce of MultiWorkerMirroredStrategy, in a C loop on one buffer of n
                     floats per process (the calling thread, no step around it)
        MPI_Allreduce  mpi4py ``comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)`` on float32,
                     when mpi4py is importable (skipped, and said so, otherwise)
        MPI step     the whole step path of that all-reduce: a model
                     ``Sequential([("flatten",), ("dense", 16)], input_shape=(1, 1, F))`` with
                     16 (F + 1) = n parameters under ``MultiWorkerMirroredStrategy(devices=
                     ['cpu:0'], bucket_mb=<more than the buffer>)`` (one bucket), and
                     ``net._mirrored.forward_backward`` on an EMPTY global batch: no compute,
                     each rank's backward pass zero-fills its gradient buffer, so the step is
                     allgather of the step header + fork-join of the replica thread
                     + zero-fill + hand-off to the mpi worker thread + chain all-reduce
                     + allgather of the step metrics
        zero-fill    the same model as a plain 1-replica model, ``_model.forward_backward``
                     on the empty batch (both ranks at once)

    and once per job ``_core.dist_allgather`` of 64 B and 1 KiB (the step's two exchanges).
    Without ``_core.dist_chain_benchmark`` (older builds) the chain is estimated as
    MPI step - zero-fill - the two allgathers (which still holds the fork-join and the
    worker hand-off: tens of us).

    In-process peers, in a plain subprocess alternating with the mpirun jobs:
        memcpy       ``np.copyto(dst, src)`` of the size, 1 thread
        kernel       ``_core.allreduce_benchmark(2, n, iters)``: the in-process all-reduce
                     over 2 persistent replica threads (as in bench_allreduce.py)
        in-proc step ``set_logical_devices('cpu', 2)``, the same model under
                     ``MirroredStrategy(['cpu:0', 'cpu:1'])`` (host all-reduce, 1 bucket),
                     ``_mirrored.forward_backward`` on the empty batch: the step path the
                     MPI step is compared with, like for like

    nccl-tests definitions (GB = 1e9 B): algbw = size / time, busbw = algbw * 2 (n - 1) / n;
    with n = 2 ranks busbw = algbw.

(2) LeNet training throughput (images/s), synthetic Fashion-MNIST-shaped data (uint8 1x28x28,
    int64 labels; the same seed in every process), global batch 256, plain SGD lr 0.2,
    --warmup (3) untimed + --steps (20) timed ``net.train_step`` calls per run:

        1p x 1r   one process, ``LeNet()`` on cpu:0 (one replica, both cores)
        1p x 2r   one process, ``set_logical_devices('cpu', 2)`` + ``MirroredStrategy()``
                  (2 replica threads, 1 core each)
        2p x 1r   ``mpirun -np 2 --bind-to none``, ``MultiWorkerMirroredStrategy()`` (each
                  process one replica; dpcore gives it half the cores), timed on rank 0
                  from a barrier after the warm-up

    --rounds (5) rounds, order rotating. Goal (issue 10): 2p x 1r within 10 % of 1p x 2r.

Usage (from the repository root):

    .venv/bin/python benchmarks/bench_mpi.py            # both parts, print tables (~2-3 min)
    .venv/bin/python benchmarks/bench_mpi.py --write    # ... and update its section of RESULTS.md
    .venv/bin/python benchmarks/bench_mpi.py --quick    # smoke run (~10 s): 2 sizes, 1 round each
    options: --part allreduce|lenet|both  --sizes pow4|pow2  --ar-rounds R  --loops L
             --min-seconds T  --rounds R  --steps S  --warmup W  --quiet-budget S  --results PATH

mpirun runs as root only with OMPI_ALLOW_RUN_AS_ROOT=1 and OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1:
this script sets both in its subprocesses' environment (dpcore itself never does).

Exit status: 0 on success; 2 when dpcore cannot be imported; 3 when this dpcore was built
without MPI or mpirun is missing (nothing to measure); 1 when a subprocess fails.
"""
import argparse
import datetime
import json
import math
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_common import EXIT_DPCORE_MISSING, RESULT_MARKER, emit_result, import_dpcore_or_exit, log  # noqa: E402
from bench_lenet_cpu import command_line, default_threads, machine_info, replace_section  # noqa: E402

DEFAULT_RESULTS = os.path.join(HERE, "RESULTS.md")
SECTION_TITLE = "## Multi-process (MPI) all-reduce and LeNet throughput (issue 10)"
EXIT_NO_MPI = 3
OUT = 16  # classes of the all-reduce models: parameters = OUT * (F + 1)
BATCH = 256
LR = 0.2
GOAL = 0.9  # 2 processes within 10 % of 2 in-process replicas
LENET_CONFIGS = ("1p x 1r", "1p x 2r", "2p x 1r")
CHILD_TIMEOUT = 600
CONTENDED = 0.25  # others' cores during a run above which it is "contended": left out when clean runs exist


def median(xs):
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    h = len(xs) // 2
    return xs[h] if len(xs) % 2 else 0.5 * (xs[h - 1] + xs[h])


def size_label(nbytes):
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return "%d %s" % (nbytes >> shift, unit)
    return "%d B" % nbytes


# ---------------------------------------------------------------------------------------------
# Children (run by the parent: plain subprocesses, or under mpirun)
# ---------------------------------------------------------------------------------------------

def loop_seconds(fn, iters):
    """Mean seconds per call over `iters` calls of fn()."""
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def iters_for(fn, min_seconds, probe=3):
    """Calls of fn() making a loop of about min_seconds (fn already warm)."""
    t = loop_seconds(fn, probe)
    return max(2, int(math.ceil(min_seconds / max(t, 1e-7))))


def allreduce_model(dp, nbytes, **kw):
    n = nbytes // 4
    if n % OUT or n // OUT < 2:
        raise ValueError("size %d B: need a multiple of %d floats" % (nbytes, OUT))
    F = n // OUT - 1
    net = dp.models.Sequential([("flatten",), ("dense", OUT)], input_shape=(1, 1, F), **kw)
    if net.num_params != n:
        raise RuntimeError("model of %d parameters, wanted %d" % (net.num_params, n))
    return net, F


def child_ar_mpi(args):
    """Under mpirun -np 2: per size, the MWMS empty-batch step, the zero-fill, and (when available) the C
    chain and MPI_Allreduce; per job, the small allgathers. Rank 0 prints the result."""
    import gc
    import importlib.util

    import numpy as np
    dp = import_dpcore_or_exit()
    from dpcore import _core
    D = dp.distributed
    rank, world = D.rank(), D.world_size()
    if world != 2:
        raise SystemExit("the all-reduce job must run under mpirun -np 2 (world size %d)" % world)
    sizes = args.size_list
    strategy = dp.MultiWorkerMirroredStrategy(devices=["cpu:0"], bucket_mb=2 * max(sizes) / 2 ** 20 + 1)
    chain = getattr(_core, "dist_chain_benchmark", None)  # (n, k, iters, timeout) -> seconds
    MPI = None
    if importlib.util.find_spec("mpi4py") is not None:
        from mpi4py import MPI  # after dpcore started MPI: mpi4py neither initialises nor finalises it
        import mpi4py

    def agreed(value):
        return D.broadcast_object(value, root=0)

    out = {"sizes": {}, "rank_threads": None, "chain_entry": chain is not None,
           "mpi4py": None if MPI is None else mpi4py.__version__,
           "mpi_library": _core.dist_library().get("version", "?")}
    # the step's two small exchanges
    small = {}
    for nb in (64, 1024):
        payload = bytes(nb)
        fn = (lambda p: lambda: _core.dist_allgather(p, 60.0, "the allgather benchmark"))(payload)
        for _ in range(10):
            fn()
        iters = agreed(iters_for(fn, args.min_seconds / 2))
        ts = []
        for _ in range(args.loops):
            D.barrier()
            ts.append(loop_seconds(fn, iters))
        small[nb] = ts
    out["allgather"] = {str(k): v for k, v in small.items()}

    for nbytes in sizes:
        with strategy.scope():
            net, F = allreduce_model(dp, nbytes)
        plain, _ = allreduce_model(dp, nbytes, devices=["cpu:0"], threads=1)
        buckets = net.gradient_buckets
        if out["rank_threads"] is None:
            out["rank_threads"] = [r.threads for r in net._replicas]
        X0, y0 = np.zeros((0, 1, 1, F), np.float32), np.zeros(0, np.int64)
        mir, model = net._mirrored, plain._model
        tasks = {"step": lambda: mir.forward_backward(X0, y0), "zero": lambda: model.forward_backward(X0, y0, 1.0)}
        if MPI is not None:
            buf = np.zeros(nbytes // 4, np.float32)
            comm = MPI.COMM_WORLD
            tasks["mpi_allreduce"] = lambda: comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        for fn in tasks.values():
            fn()
            fn()
        iters = agreed({name: iters_for(fn, args.min_seconds) for name, fn in tasks.items()})
        if chain is not None:
            t = chain(nbytes // 4, 1, 3, 60.0) / 3
            iters["chain"] = agreed(max(2, int(math.ceil(args.min_seconds / max(t, 1e-7)))))
        times = {name: [] for name in iters}
        names = list(iters)
        for l in range(args.loops):
            for name in names[l % len(names):] + names[:l % len(names)]:
                D.barrier()
                if name == "chain":
                    times[name].append(chain(nbytes // 4, 1, iters[name], 60.0) / iters[name])
                else:
                    times[name].append(loop_seconds(tasks[name], iters[name]))
        out["sizes"][str(nbytes)] = {"times": times, "iters": iters, "buckets": len(buckets)}
        del tasks, mir, model, net, plain
        gc.collect()
    if rank == 0:
        emit_result(out)


def child_ar_local(args):
    """One plain process: memcpy, the in-process all-reduce kernel and the 2-replica empty-batch step."""
    import gc

    import numpy as np
    dp = import_dpcore_or_exit()
    from dpcore import _core
    dp.set_logical_devices("cpu", 2)
    strategy = dp.MirroredStrategy(devices=["cpu:0", "cpu:1"], bucket_mb=2 * max(args.size_list) / 2 ** 20 + 1)
    out = {"sizes": {}}
    for nbytes in args.size_list:
        n = nbytes // 4
        with strategy.scope():
            net, F = allreduce_model(dp, nbytes)
        X0, y0 = np.zeros((0, 1, 1, F), np.float32), np.zeros(0, np.int64)
        mir = net._mirrored
        src = np.ones(n, np.float32)
        dst = np.empty(n, np.float32)
        dst.fill(2.0)
        tasks = {"memcpy": lambda: np.copyto(dst, src), "inproc_step": lambda: mir.forward_backward(X0, y0)}
        for fn in tasks.values():
            fn()
            fn()
        iters = {name: iters_for(fn, args.min_seconds) for name, fn in tasks.items()}
        t = _core.allreduce_benchmark(2, n, 3) / 3
        iters["kernel"] = max(2, int(math.ceil(args.min_seconds / max(t, 1e-7))))
        times = {name: [] for name in iters}
        names = list(iters)
        for l in range(args.loops):
            for name in names[l % len(names):] + names[:l % len(names)]:
                if name == "kernel":
                    times[name].append(_core.allreduce_benchmark(2, n, iters[name]) / iters[name])
                else:
                    times[name].append(loop_seconds(tasks[name], iters[name]))
        out["sizes"][str(nbytes)] = {"times": times, "iters": iters, "buckets": len(net.gradient_buckets),
                                     "all_reduce": net.all_reduce}
        del tasks, mir, net, src, dst
        gc.collect()
    emit_result(out)


def synthetic_batches(count, batch):
    import numpy as np
    rng = np.random.default_rng(0)  # the same batches in every process (MWMS checks it)
    return [(rng.integers(0, 256, (batch, 1, 28, 28), dtype=np.uint8), rng.integers(0, 10, batch).astype(np.int64))
            for _ in range(count)]


def child_lenet(args):
    dp = import_dpcore_or_exit()
    config = args.config
    mpi = config == "2p x 1r"
    if config == "1p x 1r":
        net = dp.models.LeNet(seed=0)
    elif config == "1p x 2r":
        dp.set_logical_devices("cpu", 2)
        with dp.MirroredStrategy().scope():
            net = dp.models.LeNet(seed=0)
    else:
        strategy = dp.MultiWorkerMirroredStrategy()
        with strategy.scope():
            net = dp.models.LeNet(seed=0)
    batches = synthetic_batches(args.warmup + args.steps, args.batch)
    for X, y in batches[:args.warmup]:
        net.train_step(X, y, LR)
    if mpi:
        dp.distributed.barrier()
    step_times = []
    c0 = time.process_time()
    t0 = time.perf_counter()
    for X, y in batches[args.warmup:]:
        s = time.perf_counter()
        net.train_step(X, y, LR)
        step_times.append(time.perf_counter() - s)
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0
    import numpy as np
    finite = bool(all(np.isfinite(w).all() for w in net.get_weights().values()))
    res = {"config": config, "devices": net.devices, "threads": [r.threads for r in net._replicas],
           "batch": args.batch, "steps": args.steps, "seconds": wall, "ips": args.batch * args.steps / wall,
           "median_step_ms": 1e3 * median(step_times), "cores_busy": cpu / wall, "finite": finite}
    if mpi:
        every = dp.distributed.allgather_object({"cores_busy": cpu / wall, "digest": net.digest(),
                                                 "threads": res["threads"], "seconds": wall})
        res["ranks"] = every
        res["cores_busy"] = sum(r["cores_busy"] for r in every)
        res["digests_agree"] = len({r["digest"] for r in every}) == 1
        if dp.distributed.rank() != 0:
            return
    import floor  # benchmarks/floor.py: the cores this configuration used, measured after its steps
    cores = sum(sum(x["threads"]) for x in res["ranks"]) if mpi else sum(res["threads"])
    res["floor_ips"] = floor.machine_floor(net, cores, quick=args.steps < 5)["images_per_s"]
    emit_result(res)


# ---------------------------------------------------------------------------------------------
# Parent
# ---------------------------------------------------------------------------------------------

def base_env(threads):
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(threads)
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONUNBUFFERED"] = "1"
    env["OMPI_ALLOW_RUN_AS_ROOT"] = "1"  # Open MPI refuses root without both; dpcore never sets them
    env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
    return env


def mpirun_prefix():
    cmd = ["mpirun", "-np", "2", "--bind-to", "none"]
    if (os.cpu_count() or 1) < 2:
        cmd.append("--oversubscribe")
    return cmd


def run_child(args, extra, mpi, threads):
    """(result dict or None, others' cores during the child, wall seconds)."""
    from bench_allreduce import CpuWindow
    cmd = (mpirun_prefix() if mpi else []) + [sys.executable, os.path.abspath(__file__)] + list(extra) + [
        "--min-seconds", repr(args.min_seconds), "--loops", str(args.loops), "--steps", str(args.steps),
        "--warmup", str(args.warmup), "--batch", str(args.batch), "--size-list",
        ",".join(map(str, args.size_list))]
    window = CpuWindow()
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=base_env(threads), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              timeout=CHILD_TIMEOUT)
    except subprocess.TimeoutExpired:
        log("%s: timed out after %d s" % (" ".join(extra), CHILD_TIMEOUT))
        return None, None, time.perf_counter() - t0
    wall = time.perf_counter() - t0
    m = window.measure()
    others = None if m is None else m[0]
    if proc.returncode != 0:
        log("%s failed (exit status %d):\n%s%s" % (" ".join(cmd), proc.returncode, proc.stdout[-3000:],
                                                    proc.stderr[-3000:]))
        if proc.returncode == EXIT_DPCORE_MISSING:
            raise SystemExit(EXIT_DPCORE_MISSING)
        return None, others, wall
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_MARKER):
            return json.loads(line[len(RESULT_MARKER):]), others, wall
    log("%s printed no result:\n%s" % (" ".join(cmd), proc.stderr[-3000:]))
    return None, others, wall


def fmt(x, spec="%.2f"):
    return "-" if x is None else spec % x


def clean(run):
    return run.get("others_cores") is not None and run["others_cores"] < CONTENDED


def clean_runs(runs):
    """The uncontended runs, or all of them when every run was contended."""
    return [r for r in runs if clean(r)] or list(runs)


def others_list(runs):
    return ", ".join("%s%s" % (fmt(r.get("others_cores")), "" if clean(r) else "*") for r in runs)


# ---- part 1 ---------------------------------------------------------------------------------

def run_allreduce(args, quiet):
    """{'mpi': [job result per round], 'local': [...], 'others': [...]}, or None on failure."""
    rounds = {"mpi": [], "local": []}
    for r in range(args.ar_rounds):
        quiet.wait()
        order = ("mpi", "local") if r % 2 == 0 else ("local", "mpi")
        for kind in order:
            res, others, wall = run_child(args, ["--child", "ar-" + kind], kind == "mpi", 1)
            if res is None:
                return None
            res["others_cores"], res["wall"] = others, wall
            rounds[kind].append(res)
            log("  round %d %-5s %.1f s, others' cores %s" % (r + 1, kind, wall, fmt(others)))
    return rounds


def pooled(jobs, nbytes, name):
    """Every loop's seconds per call of `name` at nbytes, over the uncontended rounds."""
    xs = []
    for job in clean_runs(jobs):
        xs += job["sizes"].get(str(nbytes), {}).get("times", {}).get(name, [])
    return xs


def round_ratios(mpi, local, nbytes):
    """MPI step / in-process step within each round where both jobs were uncontended."""
    out = []
    for a, b in zip(mpi, local):
        if clean(a) and clean(b):
            x = median(a["sizes"][str(nbytes)]["times"]["step"])
            y = median(b["sizes"][str(nbytes)]["times"]["inproc_step"])
            out.append(x / y)
    return out


def allreduce_rows(args, ar):
    mpi, local = ar["mpi"], ar["local"]
    ag64 = median([x for job in clean_runs(mpi) for x in job["allgather"]["64"]])
    ag1k = median([x for job in clean_runs(mpi) for x in job["allgather"]["1024"]])
    rows = []
    for nbytes in args.size_list:
        t = {name: median(pooled(mpi, nbytes, name)) for name in ("step", "zero", "chain", "mpi_allreduce")}
        t.update({name: median(pooled(local, nbytes, name)) for name in ("memcpy", "kernel", "inproc_step")})
        est = t["step"] - t["zero"] - ag64 - ag1k
        measured = t["chain"] is not None
        ar_t = t["chain"] if measured else (est if est > 0 else None)  # the all-reduce alone
        bus = (lambda x: None if not x else nbytes / x / 1e9)  # n = 2: busbw = algbw
        us = (lambda x: None if x is None else x * 1e6)
        rows.append({
            "size": nbytes, "memcpy": bus(t["memcpy"]), "kernel_us": us(t["kernel"]), "kernel_bus": bus(t["kernel"]),
            "ar_us": us(ar_t), "ar_measured": measured, "algbw": bus(ar_t), "busbw": bus(ar_t),
            "vs_memcpy": None if ar_t is None else bus(ar_t) / bus(t["memcpy"]),
            "vs_kernel": None if ar_t is None else bus(ar_t) / bus(t["kernel"]),
            "mpi_us": us(t["mpi_allreduce"]), "mpi_bus": bus(t["mpi_allreduce"]),
            "vs_mpi": None if ar_t is None or t["mpi_allreduce"] is None else t["mpi_allreduce"] / ar_t,
            "inproc_us": us(t["inproc_step"]), "step_us": us(t["step"]), "zero_us": us(t["zero"]),
            "step_vs_inproc": t["step"] / t["inproc_step"], "step_vs_inproc_rounds": round_ratios(mpi, local, nbytes),
            "est_us": us(est), "beyond_chain_us": None if not measured else us(t["step"] - t["chain"]),
        })
    return rows, ag64, ag1k


def allreduce_table(rows):
    """(1a) the all-reduce alone against its peers."""
    with_mpi = any(r["mpi_bus"] is not None for r in rows)
    name = "chain" if rows and rows[0]["ar_measured"] else "chain (est.)"
    head = ("| size | memcpy GB/s | in-proc kernel us | kernel busbw GB/s | %s us | algbw GB/s | busbw GB/s "
            "| busbw / memcpy | busbw / kernel busbw |" % name)
    sep = "|---" * 9 + "|"
    if with_mpi:
        head += " MPI_Allreduce us | MPI_Allreduce busbw GB/s | busbw / MPI_Allreduce busbw |"
        sep += "---|---|---|"
    out = [head, sep]
    for r in rows:
        line = "| %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
            size_label(r["size"]), fmt(r["memcpy"]), fmt(r["kernel_us"], "%.1f"), fmt(r["kernel_bus"]),
            fmt(r["ar_us"], "%.1f"), fmt(r["algbw"]), fmt(r["busbw"]), fmt(r["vs_memcpy"]), fmt(r["vs_kernel"]))
        if with_mpi:
            line += " %s | %s | %s |" % (fmt(r["mpi_us"], "%.1f"), fmt(r["mpi_bus"]), fmt(r["vs_mpi"]))
        out.append(line)
    return "\n".join(out)


def step_table(rows):
    """(1b) the step path: 2 processes against 2 in-process replicas, empty batches."""
    out = ["| size | in-proc step us | MPI step us | MPI step / in-proc step | zero-fill us "
           "| MPI step - zero-fill - allgathers us | MPI step - chain us |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append("| %s | %s | %s | %s | %s | %s | %s |" % (
            size_label(r["size"]), fmt(r["inproc_us"], "%.1f"), fmt(r["step_us"], "%.1f"), fmt(r["step_vs_inproc"]),
            fmt(r["zero_us"], "%.1f"), fmt(r["est_us"], "%.1f"), fmt(r["beyond_chain_us"], "%.1f")))
    return "\n".join(out)


def allreduce_summary(rows):
    big = [r for r in rows if r["size"] >= 1 << 20 and r["busbw"] is not None]
    lines = []
    name = "chain all-reduce" if rows and rows[0]["ar_measured"] else "chain all-reduce (est. from the step)"
    if big:
        lo_m = min(big, key=lambda r: r["vs_memcpy"])
        lo_k = min(big, key=lambda r: r["vs_kernel"])
        text = ("sizes >= 1 MiB: 2-process %s busbw %s GB/s; / memcpy %s (min %.2f at %s); / in-process kernel "
                "busbw %s (min %.2f at %s)" % (
                    name, ", ".join("%.2f" % r["busbw"] for r in big),
                    ", ".join("%.2f" % r["vs_memcpy"] for r in big), lo_m["vs_memcpy"], size_label(lo_m["size"]),
                    ", ".join("%.2f" % r["vs_kernel"] for r in big), lo_k["vs_kernel"], size_label(lo_k["size"])))
        if all(r["vs_mpi"] is not None for r in big):
            text += "; / MPI_Allreduce busbw %s" % ", ".join("%.2f" % r["vs_mpi"] for r in big)
        lines.append(text)
        rr = [x for r in big for x in r["step_vs_inproc_rounds"]]
        lines.append("sizes >= 1 MiB: MPI step / in-process step %s (median of the ratios within uncontended "
                     "rounds, all these sizes: %s)" % (", ".join("%.2f" % r["step_vs_inproc"] for r in big),
                                                       fmt(median(rr))))
    small = [r for r in rows if r["size"] < 1 << 20]
    if small:
        text = ("sizes < 1 MiB (latency): %s %s us" % (name, ", ".join(fmt(r["ar_us"], "%.1f") for r in small)))
        if all(r["mpi_us"] is not None for r in small):
            text += ", MPI_Allreduce %s us" % ", ".join("%.1f" % r["mpi_us"] for r in small)
        text += ", in-process kernel %s us; MPI step %s us vs in-process step %s us" % (
            ", ".join("%.1f" % r["kernel_us"] for r in small), ", ".join("%.0f" % r["step_us"] for r in small),
            ", ".join("%.0f" % r["inproc_us"] for r in small))
        lines.append(text)
    return lines


# ---- part 2 ---------------------------------------------------------------------------------

def run_lenet(args, quiet):
    runs = {c: [] for c in LENET_CONFIGS}
    for r in range(args.rounds):
        quiet.wait()
        k = r % len(LENET_CONFIGS)
        for config in LENET_CONFIGS[k:] + LENET_CONFIGS[:k]:
            res, others, wall = run_child(args, ["--child", "lenet", "--config", config], config == "2p x 1r",
                                          default_threads())
            if res is None:
                return None
            res["others_cores"] = others
            runs[config].append(res)
            log("  round %d %-8s %6.0f images/s  median step %.1f ms  cores busy %.2f  others %s" % (
                r + 1, config, res["ips"], res["median_step_ms"], res["cores_busy"], fmt(others)))
    return runs


def lenet_layout(res):
    if res["config"] == "2p x 1r":
        return "2 x 1 x %s" % "/".join(str(x["threads"][0]) for x in res["ranks"])
    return "1 x %d x %s" % (len(res["threads"]), "/".join(map(str, res["threads"])))


def lenet_table(runs):
    ref = median([r["ips"] for r in clean_runs(runs["1p x 2r"])])
    out = ["| configuration | processes x replicas x threads | global batch | images/s (median of rounds) "
           "| vs 1p x 2r | floor images/s | time / floor | median step ms (median of rounds) | cores busy (median) "
           "| images/s, every round (others' cores; * = contended) |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for config, rs in runs.items():
        cr = clean_runs(rs)
        ips = median([r["ips"] for r in cr])
        floor_ips = median([r["floor_ips"] for r in cr])
        out.append("| %s | %s | %d | %.0f | %.2fx | %.0f | %.2fx | %.1f | %.2f | %s |" % (
            config, lenet_layout(rs[0]), rs[0]["batch"], ips, ips / ref, floor_ips, floor_ips / ips,
            median([r["median_step_ms"] for r in cr]),
            median([r["cores_busy"] for r in cr]),
            ", ".join("%.0f (%s)%s" % (r["ips"], fmt(r["others_cores"]), "" if clean(r) else "*") for r in rs)))
    return "\n".join(out)


def lenet_ratios(runs):
    def within(a, b):
        """a / b images/s within each round where both runs were uncontended."""
        return [x["ips"] / y["ips"] for x, y in zip(runs[a], runs[b]) if clean(x) and clean(y)]
    med = {c: median([r["ips"] for r in clean_runs(rs)]) for c, rs in runs.items()}
    r2 = within("2p x 1r", "1p x 2r")
    head = median(r2)
    if head is None:  # no round with both runs uncontended: the medians of whatever ran
        head = med["2p x 1r"] / med["1p x 2r"]
    how = ("median of the ratios within %d uncontended round(s)" % len(r2) if r2 else
           "no round had both runs uncontended: the ratio of the medians")
    lines = ["2 processes x 1 replica / 1 process x 2 replicas: %.3f (%s; %.3f on the median images/s); "
             "goal >= %.2f (within 10 %%): %s" % (
                 head, how, med["2p x 1r"] / med["1p x 2r"], GOAL, "met" if head >= GOAL else "not met")]
    for a, b in (("2p x 1r", "1p x 2r"), ("1p x 2r", "1p x 1r"), ("2p x 1r", "1p x 1r")):
        rr = within(a, b)
        lines.append("%s / %s within an uncontended round: %s (median %s)" % (
            a, b, ", ".join("%.2f" % x for x in rr) or "none", fmt(median(rr), "%.3f")))
    agree = all(r.get("digests_agree", True) for r in runs["2p x 1r"])
    finite = all(r["finite"] for rs in runs.values() for r in rs)
    lines.append("2p x 1r: the ranks' parameter digests agree after every run: %s; parameters finite: %s" % (
        agree, finite))
    return lines, head


# ---- on paper -------------------------------------------------------------------------------

# Assumptions of the paper estimate (public figures, not measured here).
PAPER = {
    "params": 11175818,           # dpcore ResNet-18 (d2l 12.6, 10 classes); ImageNet's 1000-class head: 11.7M
    "gpus_per_host": 8, "hosts": 2,
    "nvlink_busbw": 450e9,        # B/s all-reduce busbw within an H100 host (NVLink 4: 900 GB/s bidirectional)
    "ib_per_gpu": 400e9 / 8,      # B/s: one 400 Gb/s InfiniBand NDR link per GPU, one direction
    "pessimistic_busbw": 50e9,    # B/s: a flat 16-GPU ring held to one 400 Gb/s link's speed
    "latency": 30e-6,             # s per NCCL all-reduce call across 2 hosts (order of magnitude)
    "buckets_floats": (7219216, 3956608),  # dpcore's 25 MiB bucket plan of this model (net.gradient_buckets)
    "step_times": (0.040, 0.010),  # s per step per GPU at batch 256 (assumed): ImageNet-size images / a short step
}


def paper_estimate():
    p = PAPER
    g, h = p["gpus_per_host"], p["hosts"]
    n = g * h
    S = 4 * p["params"]

    def hier(nbytes):  # reduce-scatter in the host, all-reduce of each GPU's 1/g across hosts, all-gather
        return (2 * (g - 1) / g * nbytes / p["nvlink_busbw"]
                + 2 * (h - 1) / h * (nbytes / g) / p["ib_per_gpu"] + p["latency"])

    def ring(nbytes):
        return 2 * (n - 1) / n * nbytes / p["pessimistic_busbw"] + p["latency"]

    first, last = (4 * f for f in p["buckets_floats"])
    lines = [
        "### On paper: ResNet-18 over 2 hosts x 8 GPUs with NCCL (an estimate, nothing measured)",
        "",
        "- this file holds no GPU step time (none measured yet), so the per-GPU step times below are "
        "**assumptions**, not measurements: %.0f ms per step at batch 256 per GPU (224x224 "
        "ImageNet images, mixed precision on an H100: ~%.0f images/s per GPU) and, to show the sensitivity, a "
        "short %.0f ms step (small images)" % (
            1e3 * p["step_times"][0], 256 / p["step_times"][0], 1e3 * p["step_times"][1]),
        "- gradients: %d parameters = %.1f MB fp32 (dpcore's ResNet18, 10 classes; ImageNet's 1000-class head "
        "adds 5 %%); dpcore's 25 MiB bucket plan: %.1f MB started after the backward pass of layer 50, "
        "%.1f MB at its end (layers 0..49)" % (p["params"], S / 1e6, first / 1e6, last / 1e6),
        "- assumed bandwidths (public figures, not measured): NCCL all-reduce busbw within a host %.0f GB/s "
        "(NVLink 4); between hosts one 400 Gb/s InfiniBand link per GPU (%.0f GB/s per direction); %.0f us "
        "latency per all-reduce; all-reduce time = 2(n-1)/n * bytes / busbw" % (
            p["nvlink_busbw"] / 1e9, p["ib_per_gpu"] / 1e9, p["latency"] * 1e6),
        "- hierarchical (every GPU's link between the hosts in use): reduce-scatter over NVLink, all-reduce of "
        "each GPU's 1/8 across the hosts on its own link, all-gather: %.2f ms for the whole %.1f MB; "
        "pessimistic: a flat 16-GPU ring at one link's %.0f GB/s: %.2f ms" % (
            1e3 * hier(S), S / 1e6, p["pessimistic_busbw"] / 1e9, 1e3 * ring(S)),
        "- exposed time per step: the last bucket's all-reduce (its gradients are ready only when the backward "
        "pass ends; the first bucket overlaps the rest of the backward pass, ~2/3 of the step): %.2f ms "
        "(hierarchical) / %.2f ms (pessimistic)" % (1e3 * hier(last), 1e3 * ring(last)),
        "",
        "| per-GPU step (assumed) | exposed all-reduce | scaling efficiency, 16 GPUs (overlap) "
        "| without overlap (whole buffer after backward) |",
        "|---|---|---|---|",
    ]
    for t in p["step_times"]:
        for name, fn in (("hierarchical", hier), ("pessimistic", ring)):
            lines.append("| %.0f ms | %s: %.2f ms | %.1f %% | %.1f %% |" % (
                1e3 * t, name, 1e3 * fn(last), 100 * t / (t + fn(last)), 100 * t / (t + fn(S))))
    worst = min(t / (t + ring(last)) for t in p["step_times"])
    lines += [
        "",
        "Estimate only (scaling efficiency = per-GPU step time alone / with the exposed all-reduce, the per-GPU "
        "batch fixed): the whole gradient all-reduce of ResNet-18 across 16 H100s should take %.1f-%.1f ms, "
        "and with dpcore's buckets only %.2f-%.2f ms of it is exposed, so communication alone keeps the "
        "efficiency at or above %.0f %% in every case above; what such a job really reaches is set by what "
        "this model leaves out (input pipeline, NCCL kernels slowing the compute they overlap, stragglers, "
        "BatchNorm statistics), and has to be measured." % (
            1e3 * hier(S), 1e3 * ring(S), 1e3 * hier(last), 1e3 * ring(last), math.floor(100 * worst)),
        "",
    ]
    return lines


# ---- report ---------------------------------------------------------------------------------

def section_text(args, ar_part, lenet_part, load_before, load_after, others, wall):
    lines = [
        SECTION_TITLE,
        "",
        "- date: %s" % datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "- machine: %s" % machine_info(),
        "- lscpu: %s" % (lscpu_summary() or "unavailable"),
        "- load average (1 min) before / after: %s / %s (this run's own processes count too); during the run %s "
        "(shared machine: every ratio compares measurements interleaved in the same run; numbers are medians)" % (
            load_before, load_after, others),
    ]
    build = None
    if ar_part:
        build = ar_part[0]["mpi"][0]["build"]
        mpi_lib = ar_part[0]["mpi"][0]["mpi_library"]
    elif lenet_part:
        build = lenet_part[0]["2p x 1r"][0]["build"]
        mpi_lib = None
    lines.append("- %s; %s" % (build, mpi_lib or "Open MPI"))
    lines.append("- command (from the repository root): `%s`; %.0f s; mpirun started as `%s python ...` with "
                 "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 (set by the script)" % (
                     command_line(), wall, " ".join(mpirun_prefix())))
    if ar_part:
        ar, rows, ag64, ag1k = ar_part
        mpi0 = ar["mpi"][0]
        lines += [
            "",
            "### (1) All-reduce of a gradient buffer across 2 processes (shared memory)",
            "",
            "- chain: %s" % (
                "`_core.dist_chain_benchmark(n, 1, iters, timeout)`: dist.c's rank-ordered chain "
                "(dp_dist_chain_allreduce, the gradient all-reduce of MultiWorkerMirroredStrategy) in a C loop, one "
                "buffer of n floats per process, no step around it" if mpi0["chain_entry"] else
                "not measured alone (this build has no `_core.dist_chain_benchmark`): estimated as MPI step - "
                "zero-fill - the two allgathers, which still holds the fork-join and the worker hand-off"),
            "- MPI_Allreduce: %s" % (
                "mpi4py %s `comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)`, float32, in the same jobs (Open MPI's "
                "own algorithm choice)" % mpi0["mpi4py"] if mpi0["mpi4py"] else
                "not measured: mpi4py is not importable here"),
            "- in-process peers, in a plain process alternating with the mpirun jobs: memcpy = `np.copyto`, 1 "
            "thread; kernel = `_core.allreduce_benchmark(2, n, iters)` (in-process all-reduce, 2 replica threads, "
            "no step around it)",
            "- ranks: `mpirun -np 2 --bind-to none`, Open MPI ob1/vader shared memory (CMA single copies); "
            "replica threads per rank %s (dpcore gives each unbound process half the cores)" % mpi0["rank_threads"],
            "- each number: median over %d round(s) x %d loop(s) of >= %.2g s (mean per call within a loop), the "
            "measurements of a size in rotating order; algbw = size / time, busbw = algbw * 2(n-1)/n = algbw for "
            "n = 2 ranks (nccl-tests), GB = 1e9 B" % (args.ar_rounds, args.loops, args.min_seconds),
            "- others' cores during each job (* = contended, >= %.2f: left out while uncontended jobs exist): "
            "mpirun jobs %s; in-process jobs %s" % (CONTENDED, others_list(ar["mpi"]), others_list(ar["local"])),
            "",
            allreduce_table(rows),
            "",
        ]
        summary = allreduce_summary(rows)
        lines += ["**%s**" % l for l in summary[:1]] + ["- %s" % l for l in summary[1:]]
        lines += [
            "",
            "Step path, like for like (empty global batch, so no compute): MPI step = "
            "`MultiWorkerMirroredStrategy(devices=['cpu:0'], bucket_mb=<more than the buffer>)`, model "
            "`Sequential([('flatten',), ('dense', 16)], input_shape=(1, 1, F))` with 16 (F + 1) = size / 4 "
            "parameters (1 bucket), `net._mirrored.forward_backward`; in-proc step = the same on "
            "`set_logical_devices('cpu', 2)` + `MirroredStrategy(['cpu:0', 'cpu:1'])` (host all-reduce); "
            "zero-fill = the same model as a plain 1-replica model, `_model.forward_backward` on the empty batch "
            "(the gradient buffer zeroed), both ranks at once; allgathers of 64 B and 1 KiB (the step's header and "
            "metrics exchanges) %.1f us and %.1f us" % (ag64 * 1e6, ag1k * 1e6),
            "",
            step_table(rows),
        ]
    if lenet_part:
        runs, rl = lenet_part[0], lenet_part[1]
        lines += [
            "",
            "### (2) LeNet training throughput: 2 processes vs 2 in-process replicas",
            "",
            "- LeNet, synthetic uint8 1x28x28 images and labels (the same in every process), global batch %d, "
            "SGD lr %g; %d warm-up + %d timed `net.train_step` calls per run, each run a fresh process (or "
            "mpirun job); %d round(s), order rotating; OMP_NUM_THREADS=OPENBLAS_NUM_THREADS=%d in all (dpcore "
            "gives each replica its device's share of the cores)" % (
                args.batch, LR, args.warmup, args.steps, args.rounds, default_threads()),
            "- 1p x 1r: `LeNet()` on cpu:0; 1p x 2r: `set_logical_devices('cpu', 2)` + `MirroredStrategy()`; "
            "2p x 1r: `mpirun -np 2 --bind-to none`, `MultiWorkerMirroredStrategy()`, timed on rank 0 from a "
            "barrier after the warm-up; cores busy = CPU time / wall time over the timed steps (summed over the "
            "ranks); others' cores = what other processes used during the run (/proc/stat)",
            "- floor (benchmarks/floor.py): LeNet's counted training FLOPs per image at the SGEMM rate of dpcore's "
            "BLAS on the cores the configuration used, measured by each run after its steps; time / floor = floor "
            "images/s / measured images/s",
            "",
            lenet_table(runs),
            "",
            "**%s**" % rl[0],
            "",
        ] + ["- %s" % l for l in rl[1:]]
    lines.append("")
    lines += paper_estimate()
    return "\n".join(lines)


def lscpu_summary():
    """The CPU as `lscpu` describes it (model, CPUs, cores, sockets, hypervisor, caches), or None."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10,
                              env=dict(os.environ, LC_ALL="C")).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    f = {}
    for line in text.splitlines():
        if ":" in line:
            k, v = line.split(":", 1)
            f[k.strip()] = v.strip()
    if not f:
        return None
    parts = ["%s %s" % (f.get("Architecture", "?"), f.get("Model name", "?"))]
    if "CPU family" in f:
        parts[0] += " (family %s, model %s)" % (f["CPU family"], f.get("Model", "?"))
    parts.append("%s CPU(s): %s thread(s) per core, %s core(s) per socket, %s socket(s)" % (
        f.get("CPU(s)", "?"), f.get("Thread(s) per core", "?"), f.get("Core(s) per socket", "?"),
        f.get("Socket(s)", "?")))
    if "Hypervisor vendor" in f:
        parts.append("hypervisor %s" % f["Hypervisor vendor"])
    caches = ["%s %s" % (k.split()[0], f[k]) for k in ("L1d cache", "L2 cache", "L3 cache") if k in f]
    if caches:
        parts.append(", ".join(caches))
    return "; ".join(parts)


def mpi_available():
    """(True, '') or (False, why)."""
    try:
        import dpcore as dp
    except Exception as e:
        return None, "dpcore not importable: %s: %s" % (type(e).__name__, e)
    info = dp.build_info()
    if not info.get("mpi_linked"):
        return False, "this dpcore was built without MPI (%s)" % info.get("mpi_why")
    if shutil.which("mpirun") is None:
        return False, "mpirun is not on PATH"
    return True, ""


def run_parent(args):
    ok, why = mpi_available()
    if ok is None:
        log(why)
        return EXIT_DPCORE_MISSING
    if not ok:
        log("nothing to measure: %s" % why)
        return EXIT_NO_MPI
    from bench_allreduce import CpuWindow, QuietWaiter
    load_before = "%.2f" % os.getloadavg()[0]
    window = CpuWindow()
    quiet = QuietWaiter(args.quiet_budget)
    t0 = time.perf_counter()
    ar_part = lenet_part = None
    if args.part in ("allreduce", "both"):
        log("(1) all-reduce across 2 processes vs in-process, sizes %s; %d round(s) x %d loop(s) of >= %.2g s" % (
            ", ".join(size_label(s) for s in args.size_list), args.ar_rounds, args.loops, args.min_seconds))
        ar = run_allreduce(args, quiet)
        if ar is None:
            return 1
        rows, ag64, ag1k = allreduce_rows(args, ar)
        ar_part = (ar, rows, ag64, ag1k)
    if args.part in ("lenet", "both"):
        log("(2) LeNet throughput, global batch %d, %d+%d steps, %d round(s)" % (
            args.batch, args.warmup, args.steps, args.rounds))
        runs = run_lenet(args, quiet)
        if runs is None:
            return 1
        lines, head = lenet_ratios(runs)
        lenet_part = (runs, lines, head)
    wall = time.perf_counter() - t0
    load_after = "%.2f" % os.getloadavg()[0]
    others = window.summary() + ("; waited %.0f s for a quiet machine" % quiet.waited if quiet.waited else "")

    print()
    if ar_part:
        print("(1) all-reduce, 2 ranks")
        print(allreduce_table(ar_part[1]))
        print()
        print(step_table(ar_part[1]))
        print()
        mpi0 = ar_part[0]["mpi"][0]
        print("allgather 64 B %.1f us, 1 KiB %.1f us (per call)" % (ar_part[2] * 1e6, ar_part[3] * 1e6))
        print("others' cores per job (* = contended): mpirun %s; in-process %s" % (
            others_list(ar_part[0]["mpi"]), others_list(ar_part[0]["local"])))
        if not mpi0["chain_entry"]:
            print("chain: not measured alone (no _core.dist_chain_benchmark in this build): estimated from the step")
        if not mpi0["mpi4py"]:
            print("MPI_Allreduce: not measured (mpi4py is not importable)")
        for l in allreduce_summary(ar_part[1]):
            print(l)
        print()
    if lenet_part:
        print("(2) LeNet throughput")
        print(lenet_table(lenet_part[0]))
        print()
        for l in lenet_part[1]:
            print(l)
        print()
    print("load average before / after: %s / %s; %s; %.0f s" % (load_before, load_after, others, wall))
    if args.write:
        replace_section(args.results, SECTION_TITLE,
                        section_text(args, ar_part, lenet_part, load_before, load_after, others, wall))
        print("updated %s" % args.results)
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--part", choices=("allreduce", "lenet", "both"), default="both")
    ap.add_argument("--sizes", choices=("pow4", "pow2"), default="pow4",
                    help="4 KiB .. 64 MiB in powers of 4 (default) or 2")
    ap.add_argument("--ar-rounds", type=int, default=3, help="part 1: rounds of (mpirun job, local process)")
    ap.add_argument("--loops", type=int, default=3, help="part 1: timed loops per measurement per round")
    ap.add_argument("--min-seconds", type=float, default=0.05, help="part 1: seconds per loop (default 0.05)")
    ap.add_argument("--rounds", type=int, default=5, help="part 2: rounds (default 5)")
    ap.add_argument("--steps", type=int, default=20, help="part 2: timed steps per run (default 20)")
    ap.add_argument("--warmup", type=int, default=3, help="part 2: untimed steps first (default 3)")
    ap.add_argument("--batch", type=int, default=BATCH, help="part 2: global batch (default 256)")
    ap.add_argument("--quiet-budget", type=float, default=60.0,
                    help="seconds in all to wait, before each round, for other processes to use < 0.2 cores "
                         "(default 60; 0: never wait)")
    ap.add_argument("--quick", action="store_true", help="smoke run (~20 s): 4 KiB and 1 MiB, 1 round, 3 steps")
    ap.add_argument("--write", action="store_true", help="update the section in --results")
    ap.add_argument("--results", default=DEFAULT_RESULTS, help="default benchmarks/RESULTS.md")
    ap.add_argument("--child", choices=("ar-mpi", "ar-local", "lenet"), help=argparse.SUPPRESS)
    ap.add_argument("--config", choices=LENET_CONFIGS, help=argparse.SUPPRESS)
    ap.add_argument("--size-list", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.write and args.part != "both":
        ap.error("--write needs --part both (the section holds both parts)")
    if args.quick and not args.child:
        args.ar_rounds, args.loops, args.min_seconds = 1, 1, 0.01
        args.rounds, args.steps, args.warmup, args.quiet_budget = 1, 3, 1, 0.0
    if min(args.ar_rounds, args.loops, args.rounds, args.steps, args.batch) < 1 or args.warmup < 0 \
            or args.min_seconds <= 0:
        ap.error("--ar-rounds, --loops, --rounds, --steps, --batch must be >= 1, --warmup >= 0, --min-seconds > 0")
    if args.size_list:
        args.size_list = [int(s) for s in args.size_list.split(",")]
    elif args.quick:
        args.size_list = [4 << 10, 1 << 20]
    else:
        step = 2 if args.sizes == "pow4" else 1
        args.size_list = [1 << e for e in range(12, 27, step)]
    if args.child == "ar-mpi":
        child_ar_mpi(args)
        return 0
    if args.child == "ar-local":
        child_ar_local(args)
        return 0
    if args.child == "lenet":
        if not args.config:
            ap.error("--child lenet needs --config")
        child_lenet(args)
        return 0
    return run_parent(args)


if __name__ == "__main__":
    sys.exit(main())
