#!/usr/bin/env python3
"""In-process all-reduce bus bandwidth of dpcore on the CPU, beside memcpy bandwidth.

For each buffer size (4 KiB .. 64 MiB of float32) and k = 2 and 4 replica threads,
``dpcore._core.allreduce_benchmark(k, n_floats, iters)`` runs `iters` in-place SUM
all-reduces of k buffers of n floats on k persistent replica threads (one group run;
its timing excludes thread start-up and the first touch of the buffers). Reported,
with nccl-tests' definitions (their doc/PERFORMANCE.md; GB = 1e9 bytes):

    time   = seconds per all-reduce
    algbw  = S / time                      (S = buffer size in bytes)
    busbw  = algbw * 2 (k - 1) / k

Beside it, in the same run and interleaved with it, memcpy bandwidth (bytes copied per
second = S / time per copy) for the same sizes:

    memcpy 1T: libc memcpy(dst, src, S) called through ctypes in a Python loop
               (not numpy: np.copyto adds ~1 us of dispatch per call);
    memcpy 2T: two Python threads, each calling libc memcpy on its half of the buffer
               in its own loop (ctypes releases the GIL during the call); aggregate
               bytes / wall time between a common start and both threads finishing.

Both memcpy loops pay a ctypes call per copy (~0.2-0.5 us; the table's header notes
the measured floor), and the 2-thread loop also pays GIL hand-overs, so below ~256 KiB
the memcpy columns are call-overhead bound (too low) and the ratios too high; from
1 MiB up the overhead is < 1-2 % of a copy. The all-reduce loop runs in C (no Python
per iteration).

Ratios: busbw / memcpy 1T and busbw / memcpy 2T (the project's goal: >= 0.8 from
1 MiB up). Traffic bound, for reading the ratios: an in-place all-reduce of k buffers
must read k*S and write k*S bytes, i.e. the traffic of k memcpys of S. With all cores
copying at their aggregate memcpy bandwidth B2 (memcpy 2T) it cannot take less than
k*S/B2, so busbw <= B2/k * 2(k-1)/k: busbw / memcpy 2T <= 0.5 at k = 2 and <= 0.375 at
k = 4. Against memcpy 1T the bound is B2 / (2 B1) at k = 2, which is 1.0 when two
cores copy twice as fast as one and less when one core already saturates memory.
The last column, "traffic eff.", is k*S/time / memcpy 2T: the fraction of that bound
reached (1.0 = the all-reduce moves its bytes as fast as two memcpy threads). The
bound is tight while the buffers fit in the caches; beyond them memcpy also reads
every destination line before writing it (write-allocate) while the all-reduce writes
lines it has just read, so there up to ~1.5 is possible, and sizes near the 32 MiB L3
depend on what else (other VMs included) uses it.
k = 4 on a 2-core machine runs 4 threads on 2 cores (oversubscribed): its barriers
spin and yield, so it measures the degraded case, not 4 real devices.

Each measurement is sized to take >= --min-seconds (default 0.2 s) after a short
calibration, repeated --repeats times (default 3) in rotating order of the four
measurements, and the best (shortest) is kept. Before each round the script waits (at
most --quiet-budget seconds in all, default 60) until other processes use < 0.2 cores;
the section records how busy other processes kept the machine during the run.

Usage (from the repository root):

    .venv/bin/python benchmarks/bench_allreduce.py            # print the table
    .venv/bin/python benchmarks/bench_allreduce.py --write    # ... and update RESULTS.md
    .venv/bin/python benchmarks/bench_allreduce.py --quick    # smoke run: 3 sizes, 1 repeat, 0.05 s
    options: --sizes pow2|pow4 (default pow2: 4 KiB, 8 KiB, ... 64 MiB)  --ks 2,4
             --repeats R  --min-seconds T  --quiet-budget S  --results PATH

Exit status: 0 on success, 2 when dpcore cannot be imported.
"""
import os

# numpy's bundled OpenBLAS starts a pool of worker threads (one per core) when numpy is
# imported, and after any BLAS call those threads busy-wait for more work. On a 2-core
# machine a spinning pool thread steals a core from the replica or memcpy threads being
# timed. This script makes no BLAS calls, but one thread means no pool at all. It has to
# be set before numpy is imported (OpenBLAS reads it once, at load time). dpcore's own
# (system, OpenMP) OpenBLAS reads it too; the all-reduce does not use BLAS.
os.environ["OPENBLAS_NUM_THREADS"] = "1"

import argparse  # noqa: E402
import ctypes  # noqa: E402
import ctypes.util  # noqa: E402
import datetime  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_common import EXIT_DPCORE_MISSING, build_string, import_dpcore, log  # noqa: E402
from bench_lenet_cpu import command_line, machine_info, replace_section  # noqa: E402

DEFAULT_RESULTS = os.path.join(HERE, "RESULTS.md")
SECTION_TITLE = "## All-reduce bus bandwidth (in-process, CPU)"
GOAL = 0.8
GOAL_FROM = 1 << 20


def import_core(tries=6, wait=5.0):
    """dpcore._core, retried: the package may be being reinstalled while we start."""
    dp, err = import_dpcore(tries, wait)
    return (dp._core, None) if dp is not None else (None, err)


class CpuWindow:
    """CPU accounting over a run, from /proc/stat and os.times(): how many cores other processes kept
    busy on average (machine busy time minus this process's and its children's), and the steal time
    the hypervisor reports (cores' worth of time this VM wanted but the host gave to others)."""

    def __init__(self):
        self.start = self._snap()

    @staticmethod
    def _snap():
        try:
            with open("/proc/stat") as f:
                vals = [int(v) for v in f.readline().split()[1:9]]
        except (OSError, ValueError):
            vals = None
        t = os.times()
        return vals, t.user + t.system + t.children_user + t.children_system, time.monotonic()

    def measure(self):
        """(cores kept busy by other processes, cores of steal) on average since the start; None if unknown."""
        (a, own_a, t_a), (b, own_b, t_b) = self.start, self._snap()
        if a is None or b is None or t_b <= t_a:
            return None
        hz = os.sysconf("SC_CLK_TCK")
        d = [y - x for x, y in zip(a, b)]
        idle, steal = d[3] + d[4], d[7]
        busy = (sum(d) - idle - steal) / hz
        wall = t_b - t_a
        return max(0.0, busy - (own_b - own_a)) / wall, steal / hz / wall

    def summary(self):
        m = self.measure()
        if m is None:
            return "others' CPU: unknown"
        return "other processes kept %.2f cores busy on average, steal %.2f cores" % m


class QuietWaiter:
    """Before a measurement, wait (within a total budget of seconds) until other processes use less than
    `threshold` cores over a 1 s window: a shared machine's other work would otherwise decide the numbers."""

    def __init__(self, budget, threshold=0.2):
        self.budget, self.threshold, self.waited = budget, threshold, 0.0

    def wait(self):
        while self.budget - self.waited > 0:
            w = CpuWindow()
            time.sleep(1.0)
            m = w.measure()
            if m is None or m[0] < self.threshold:
                return
            self.waited += 1.0


def size_label(nbytes):
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return "%d %s" % (nbytes >> shift, unit)
    return "%d B" % nbytes


# ---------------------------------------------------------------------------------------------
# memcpy through ctypes
# ---------------------------------------------------------------------------------------------

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None)  # CDLL calls release the GIL
_memcpy = _libc.memcpy
_memcpy.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_memcpy.restype = ctypes.c_void_p


def aligned_buffer(nbytes, align=4096):
    """A page-aligned uint8 array of nbytes, every page touched (non-zero, so no shared zero page)."""
    raw = np.empty(nbytes + align, dtype=np.uint8)
    off = (-raw.ctypes.data) % align
    buf = raw[off:off + nbytes]
    buf.fill(1)
    return buf


class MemcpyBench:
    """src and dst of one size; 1- and 2-thread memcpy loops over them."""

    def __init__(self, nbytes):
        self.nbytes = nbytes
        self.src = aligned_buffer(nbytes)
        self.dst = aligned_buffer(nbytes)
        half = (nbytes // 2) & ~63  # the split on a cache-line boundary
        s, d = self.src.ctypes.data, self.dst.ctypes.data
        self.parts = [(ctypes.c_void_p(d), ctypes.c_void_p(s), ctypes.c_size_t(half)),
                      (ctypes.c_void_p(d + half), ctypes.c_void_p(s + half), ctypes.c_size_t(nbytes - half))]
        self.whole = (ctypes.c_void_p(d), ctypes.c_void_p(s), ctypes.c_size_t(nbytes))

    def one_thread(self, iters):
        f, (d, s, n) = _memcpy, self.whole
        f(d, s, n)  # warm
        t0 = time.perf_counter()
        for _ in range(iters):
            f(d, s, n)
        return time.perf_counter() - t0

    def two_threads(self, iters):
        start = threading.Barrier(3)

        def loop(d, s, n):
            f = _memcpy
            f(d, s, n)  # warm
            start.wait()
            for _ in range(iters):
                f(d, s, n)

        threads = [threading.Thread(target=loop, args=p) for p in self.parts]
        for t in threads:
            t.start()
        start.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join()
        return time.perf_counter() - t0


def call_floor(iters=200000):
    """Seconds per ctypes memcpy call of 0 bytes: the loop overhead inside the memcpy columns."""
    d = s = ctypes.c_void_p(aligned_buffer(64).ctypes.data)
    n = ctypes.c_size_t(0)
    best = math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(iters):
            _memcpy(d, s, n)
        best = min(best, time.perf_counter() - t0)
    return best / iters


# ---------------------------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------------------------

def calibrate(fn, min_seconds):
    """Iterations making fn(iters) last about min_seconds (fn returns seconds)."""
    iters = 1
    while True:
        t = fn(iters)
        if t >= min(0.02, min_seconds / 4) or iters >= 1 << 26:
            break
        iters = iters * 2 if t <= 0 else max(iters * 2, min(iters * 64, int(iters * 0.03 / t)))
    per = t / iters
    return max(1, int(math.ceil(1.1 * min_seconds / per))) if per > 0 else iters


def measure_size(core, nbytes, ks, repeats, min_seconds, quiet):
    """{name: best seconds per operation} for one size; names 'cp1', 'cp2', 'k2', 'k4', ..."""
    n_floats = nbytes // 4
    mc = MemcpyBench(nbytes)
    kinds = {"cp1": mc.one_thread, "cp2": mc.two_threads}
    for k in ks:
        kinds["k%d" % k] = (lambda k: lambda iters: core.allreduce_benchmark(k, n_floats, iters))(k)
    iters = {name: calibrate(fn, min_seconds) for name, fn in kinds.items()}
    best = {name: math.inf for name in kinds}
    names = list(kinds)
    for r in range(repeats):
        order = names[r % len(names):] + names[:r % len(names)]  # rotate: spread the noise
        quiet.wait()
        for name in order:
            best[name] = min(best[name], kinds[name](iters[name]) / iters[name])
    return best, iters


def row_stats(nbytes, k, t, cp1, cp2):
    algbw = nbytes / t
    busbw = algbw * 2 * (k - 1) / k
    return {"size": nbytes, "k": k, "us": t * 1e6, "algbw": algbw / 1e9, "busbw": busbw / 1e9,
            "cp1": cp1 / 1e9, "cp2": cp2 / 1e9, "r1": busbw / cp1, "r2": busbw / cp2,
            "eff": k * nbytes / t / cp2}


HEADER = ("| size | k | time/all-reduce (us) | algbw GB/s | busbw GB/s | memcpy 1T GB/s | memcpy 2T GB/s "
          "| busbw / memcpy 1T | busbw / memcpy 2T | traffic eff. |")


def table(rows):
    out = [HEADER, "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append("| %s | %d | %.1f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f |" % (
            size_label(r["size"]), r["k"], r["us"], r["algbw"], r["busbw"], r["cp1"], r["cp2"], r["r1"], r["r2"],
            r["eff"]))
    return "\n".join(out)


def goal_lines(rows, ks):
    lines = []
    for k in ks:
        big = [r for r in rows if r["k"] == k and r["size"] >= GOAL_FROM]
        if not big:
            continue
        lo1 = min(big, key=lambda r: r["r1"])
        lo2 = min(big, key=lambda r: r["r2"])
        lines.append(
            "k = %d, sizes >= %s: busbw / memcpy 1T min %.2f (at %s), busbw / memcpy 2T min %.2f (at %s); "
            "goal >= %.1f: %s vs 1-thread memcpy, %s vs 2-thread memcpy" % (
                k, size_label(GOAL_FROM), lo1["r1"], size_label(lo1["size"]), lo2["r2"], size_label(lo2["size"]),
                GOAL, "met" if lo1["r1"] >= GOAL else "not met", "met" if lo2["r2"] >= GOAL else "not met"))
    return lines


def section_text(args, core, rows, floor, load_before, load_after, others, wall):
    lines = [
        SECTION_TITLE,
        "",
        "- date: %s" % datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "- machine: %s" % machine_info(),
        "- load average (1 min) before / after: %s / %s (this run's own threads count too); during the run %s "
        "(shared machine: the ratios compare measurements interleaved in the same run)" % (
            load_before, load_after, others),
        "- %s" % build_string(sys.modules["dpcore"]),
        "- command (from the repository root): `%s` (OPENBLAS_NUM_THREADS=1, set by the script); "
        "%.0f s" % (command_line(), wall),
        "- all-reduce: `dpcore._core.allreduce_benchmark(k, n, iters)`, in-place SUM of k float32 buffers on k "
        "persistent replica threads, one thread per replica; timing excludes thread start-up and first touch",
        "- memcpy 1T: libc memcpy via ctypes in a Python loop; memcpy 2T: two Python threads, each memcpy-ing half "
        "(ctypes releases the GIL); ctypes call floor %.2f us/call, so memcpy columns below ~256 KiB are "
        "overhead-bound (and the ratios there too high)" % (floor * 1e6),
        "- each number: best of %d runs of >= %.2g s each, the %d measurements of a size in rotating order; "
        "algbw = S/time, busbw = algbw * 2(k-1)/k (nccl-tests), GB = 1e9 B" % (
            args.repeats, args.min_seconds, 2 + len(args.ks)),
        "- traffic eff. = k*S/time / memcpy 2T: an in-place all-reduce reads and writes k*S bytes (k memcpys), "
        "so 1.0 is the memory-traffic bound while the buffers fit in cache, where busbw / memcpy 2T = 0.5 (k=2) "
        "or 0.375 (k=4); beyond the caches memcpy pays write-allocate reads the all-reduce does not, so up to "
        "~1.5 is possible, and sizes near the 32 MiB L3 vary with what else uses it; "
        "k = 4 runs 4 threads on %d cores" % (os.cpu_count() or 0),
        "",
        table(rows),
        "",
    ]
    lines += ["**%s**" % l for l in goal_lines(rows, args.ks)]
    lines.append("")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--sizes", choices=("pow2", "pow4"), default="pow2",
                    help="4 KiB .. 64 MiB in powers of 2 (default) or 4")
    ap.add_argument("--ks", default="2,4", help="replica counts, comma-separated (default 2,4)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per measurement, best kept (default 3)")
    ap.add_argument("--min-seconds", type=float, default=0.2, help="seconds per run (default 0.2)")
    ap.add_argument("--quiet-budget", type=float, default=60.0,
                    help="seconds in all to wait, before each round of a size, for other processes to use "
                         "< 0.2 cores (default 60; 0: never wait)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 4 KiB, 1 MiB, 16 MiB; 1 repeat of 0.05 s")
    ap.add_argument("--write", action="store_true", help="update the section in --results")
    ap.add_argument("--results", default=DEFAULT_RESULTS, help="default benchmarks/RESULTS.md")
    args = ap.parse_args(argv)
    try:
        args.ks = [int(k) for k in args.ks.split(",") if k.strip()]
    except ValueError:
        ap.error("--ks: comma-separated integers, e.g. 2,4")
    if not args.ks or any(not 2 <= k <= 64 for k in args.ks):
        ap.error("--ks: each k between 2 and 64")
    if args.quick:
        sizes = [4 << 10, 1 << 20, 16 << 20]
        args.repeats, args.min_seconds, args.quiet_budget = 1, 0.05, 0.0
    else:
        step = 1 if args.sizes == "pow2" else 2
        sizes = [1 << e for e in range(12, 27, step)]
    if args.repeats < 1 or args.min_seconds <= 0:
        ap.error("--repeats >= 1 and --min-seconds > 0")

    core, err = import_core()
    if core is None:
        log("dpcore not importable: %s" % err)
        return EXIT_DPCORE_MISSING

    load_before = "%.2f" % os.getloadavg()[0]
    window = CpuWindow()
    quiet = QuietWaiter(args.quiet_budget)
    t_start = time.perf_counter()
    floor = call_floor()
    log("all-reduce k = %s vs memcpy; %d sizes; best of %d x >= %.2g s; ctypes call floor %.2f us" % (
        ",".join(map(str, args.ks)), len(sizes), args.repeats, args.min_seconds, floor * 1e6))
    rows = []
    for nbytes in sizes:
        best, iters = measure_size(core, nbytes, args.ks, args.repeats, args.min_seconds, quiet)
        cp1, cp2 = nbytes / best["cp1"], nbytes / best["cp2"]
        for k in args.ks:
            rows.append(row_stats(nbytes, k, best["k%d" % k], cp1, cp2))
        log("  %-7s memcpy 1T %6.2f GB/s  2T %6.2f GB/s  %s" % (
            size_label(nbytes), cp1 / 1e9, cp2 / 1e9, "  ".join(
                "k=%d busbw %6.2f GB/s" % (r["k"], r["busbw"]) for r in rows[-len(args.ks):])))
    wall = time.perf_counter() - t_start
    load_after = "%.2f" % os.getloadavg()[0]
    others = window.summary() + ("; waited %.0f s for a quiet machine" % quiet.waited if quiet.waited else "")

    rows.sort(key=lambda r: (r["k"], r["size"]))
    print()
    print(table(rows))
    print()
    for l in goal_lines(rows, args.ks):
        print(l)
    print("ctypes memcpy call floor %.2f us; load average before / after: %s / %s; %s; %.0f s" % (
        floor * 1e6, load_before, load_after, others, wall))
    if args.write:
        replace_section(args.results, SECTION_TITLE,
                        section_text(args, core, rows, floor, load_before, load_after, others, wall))
        print("updated %s" % args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
