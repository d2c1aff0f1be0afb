"""The implicit-GEMM convolution against im2col + SGEMM on the CPU (issue 14;
csrc/implicit_gemm.h): the per-layer A/B behind DPCORE_IMPLICIT_GEMM's default
and the channel limits it takes.

    python benchmarks/bench_implicit_gemm.py [--rounds 5] [--reps 5] [--batch 128] [--write]

One process pinned to one core (sched_setaffinity before dpcore loads, so the
CPU device has one thread): on this shared machine the wall time of a call
swings by 1.5x from minute to minute while the CPU time the process gets
counts only the time it ran. For each geometry, the arms DPCORE_IMPLICIT_GEMM=0
(im2col + SGEMM, or Winograd's and the one-channel paths where those take the
layer: Winograd is switched off here) and =1 alternate, swapping order every
round; each arm times --reps forward calls and --reps backward calls (dx, dw,
db) after a warm-up, by the process's CPU time (time.process_time). Reported:
the median per call over the rounds, and the ratio off / on (above 1: the
implicit GEMM faster). The C side reads the switch at every call.
"""
import argparse
import datetime
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_lenet_cpu import command_line, machine_info, publish  # noqa: E402

SECTION_TITLE = "## Implicit GEMM A/B (CPU, one core)"
# (name, C, H, O, K, stride, pad): LeNet's and the book's layers, and the kinds the limits were chosen on
GEOMETRIES = [
    ("LeNet 20 -> 50, 5x5 on 13x13", 20, 13, 50, 5, 1, 0),
    ("book LeNet 6 -> 16, 5x5 on 14x14", 6, 14, 16, 5, 1, 0),
    ("20 -> 32, 5x5 on 13x13", 20, 13, 32, 5, 1, 0),
    ("32 -> 32, 3x3 pad 1 on 14x14", 32, 14, 32, 3, 1, 1),
    ("64 -> 64, 3x3 pad 1 on 28x28 (batch / 4)", 64, 28, 64, 3, 1, 1),
    ("64 -> 128, 3x3 stride 2 on 28x28 (batch / 4; > 64 channels: not taken)", 64, 28, 128, 3, 2, 1),
]


def ab_layers(geometries, switch, batch, rounds, reps):
    """The per-layer A/B of this script and bench_winograd5.py, in this process (pinned
    to one core by the caller): per (name, C, H, O, K, stride, pad) geometry the arms
    switch=0 and =1 alternate, each timing reps forward and reps backward calls after a
    warm-up by the process's CPU time; rows of (name, N, forward FLOPs, {arm: (median
    forward s, median backward s)})."""
    import numpy as np
    import dpcore as dp
    rng = np.random.default_rng(0)
    rows = []
    for name, C, H, O, K, s, p in geometries:
        N = max(1, batch // 4) if "batch / 4" in name else batch
        x = rng.standard_normal((N, C, H, H)).astype(np.float32)
        w = (rng.standard_normal((O, C, K, K)) / np.sqrt(C * K * K)).astype(np.float32)
        b = rng.standard_normal(O).astype(np.float32)
        OH = (H + 2 * p - K) // s + 1
        dy = rng.standard_normal((N, O, OH, OH)).astype(np.float32)
        times = {"0": ([], []), "1": ([], [])}
        for r in range(rounds):
            for arm in (("0", "1") if r % 2 == 0 else ("1", "0")):
                os.environ[switch] = arm
                dp.ops.conv2d(x, w, b, stride=s, padding=p)
                dp.ops.conv2d_backward(x, w, dy, stride=s, padding=p)
                t0 = time.process_time()
                for _ in range(reps):
                    dp.ops.conv2d(x, w, b, stride=s, padding=p)
                t1 = time.process_time()
                for _ in range(reps):
                    dp.ops.conv2d_backward(x, w, dy, stride=s, padding=p)
                t2 = time.process_time()
                times[arm][0].append((t1 - t0) / reps)
                times[arm][1].append((t2 - t1) / reps)
        med = {arm: (statistics.median(f), statistics.median(bw)) for arm, (f, bw) in times.items()}
        rows.append((name, N, 2.0 * N * O * C * K * K * OH * OH, med))
        print(f"  {name}: forward {med['0'][0] * 1e3:.2f} -> {med['1'][0] * 1e3:.2f} ms, "
              f"backward {med['0'][1] * 1e3:.2f} -> {med['1'][1] * 1e3:.2f} ms", file=sys.stderr, flush=True)
    return rows


def ab_table(rows):
    """The table of ab_layers' rows: each arm's median per call, off / on, forward GFLOP/s."""
    lines = ["| geometry | batch | forward off ms | forward on ms | forward off / on | forward GFLOP/s off / on "
             "| backward off ms | backward on ms | backward off / on |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, N, flops, med in rows:
        (f0, b0), (f1, b1) = med["0"], med["1"]
        lines.append(f"| {name} | {N} | {f0 * 1e3:.2f} | {f1 * 1e3:.2f} | {f0 / f1:.2f}x | "
                     f"{flops / f0 / 1e9:.0f} / {flops / f1 / 1e9:.0f} | {b0 * 1e3:.2f} | {b1 * 1e3:.2f} | "
                     f"{b0 / b1:.2f}x |")
    return lines


def measure(args):
    core = sorted(os.sched_getaffinity(0))[0]
    os.sched_setaffinity(0, {core})
    os.environ["DPCORE_WINOGRAD"] = "0"
    import dpcore as dp
    return core, dp.__version__, ab_layers(GEOMETRIES, "DPCORE_IMPLICIT_GEMM", args.batch, args.rounds, args.reps)


def ab_main(argv, description, section_title, switch, per_geometry, measure, gflops_note, notes):
    """The command line and section of this script and bench_winograd5.py: --rounds, --reps, --batch
    and --write; measure(args) -> (core, dpcore version, ab_layers' rows); the section (printed, and
    with --write put into RESULTS.md) says how the arms of `switch` ran, per_geometry (what stands
    before "the arms") and gflops_note (after the GFLOP/s definition) in its words, then
    ab_table's rows, then the notes."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--write", action="store_true", help="replace the section in benchmarks/RESULTS.md")
    args = ap.parse_args(argv)
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    core, version, rows = measure(args)
    lines = [section_title, "",
             f"- date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
             f"- machine: {machine_info()}; load average before / after: {load_before:.2f} / {os.getloadavg()[0]:.2f}",
             f"- dpcore {version}; command (from the repository root): `{command_line()}`; "
             f"{time.perf_counter() - started:.0f} s",
             f"- one process pinned to core {core} (one thread); {per_geometry} the arms "
             f"{switch}=0 and =1 alternate over {args.rounds} rounds, {args.reps} forward and "
             f"{args.reps} backward calls (dx, dw, db) each after a warm-up, timed by the process's CPU time; "
             "median per call over the rounds; GFLOP/s = the forward pass's 2*N*O*C*KH*KW*OH*OW per second"
             + gflops_note,
             ""] + ab_table(rows)
    lines += ["", notes]
    publish(lines, section_title, args.write)


def main(argv=None):
    ab_main(argv, __doc__.splitlines()[0], SECTION_TITLE, "DPCORE_IMPLICIT_GEMM", "DPCORE_WINOGRAD=0; per geometry",
            measure, "",
            "off: im2col + SGEMM (dx as a convolution of dy for \"same\" padding, col2im otherwise); "
            "on: the implicit GEMM's forward and dw, and its dx from 32 output channels where the GEMM path "
            "would not take dx as a convolution of dy (csrc/implicit_gemm.h); the last row is a layer it does "
            "not take (both arms the GEMM path: the ratio shows the noise).")


if __name__ == "__main__":
    main()
