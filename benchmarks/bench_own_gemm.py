"""dpcore's own AVX-512 GEMM kernel (csrc/small_gemm.h) against OpenBLAS for the
CPU convolutions' GEMMs (issue 14): the A/B behind DPCORE_OWN_GEMM's default.

    python benchmarks/bench_own_gemm.py [--rounds 3] [--reps 5] [--batch 32] [--steps 5] [--write]

(a) Per layer, one process pinned to one core (bench_implicit_gemm.py's
    ab_layers: the arms DPCORE_OWN_GEMM=0 and =1 alternate, each timed by the
    process's CPU time): ResNet-18's 3x3 stride-1 layers (Winograd F(2x2, 3x3)'s
    products), its stride-2 3x3 and 1x1 layers (im2col + GEMM), with OpenBLAS's
    kernels as the environment chose them.
(b) The whole ResNet-18 train_step (28x28, --batch, cpu:0, all usable cores),
    fresh subprocesses in rotating order: dpcore's kernel; OpenBLAS with the
    environment's OPENBLAS_CORETYPE (on this project's workplace Haswell: AVX2);
    and OpenBLAS with the variable removed (dpcore then names the CPU's best
    kernels, python/dpcore/_blas_kernels.py: SkylakeX where the CPU has
    AVX-512) - the fair peer on an AVX-512 machine.
Reported: medians; ratios above 1 mean dpcore's kernel is faster.

Needs a build whose compiler targeted AVX-512 (build_info()['cpu_gemm']);
elsewhere both arms are the BLAS and the script says so.
"""
import argparse
import datetime
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_implicit_gemm import ab_layers, ab_table  # noqa: E402
from bench_winograd import resnet18_steps  # noqa: E402
from bench_lenet_cpu import child_json, command_line, default_threads, log, machine_info, publish  # noqa: E402
from bench_lenet_cpu import thread_env  # noqa: E402

SECTION_TITLE = "## dpcore's AVX-512 GEMM kernel A/B (CPU)"
# (name, C, H, O, K, stride, pad)
GEOMETRIES = [
    ("64 -> 64, 3x3 on 28x28 (Winograd F(2x2, 3x3))", 64, 28, 64, 3, 1, 1),
    ("128 -> 128, 3x3 on 14x14 (Winograd)", 128, 14, 128, 3, 1, 1),
    ("256 -> 256, 3x3 on 7x7 (Winograd)", 256, 7, 256, 3, 1, 1),
    ("512 -> 512, 3x3 on 4x4 (Winograd)", 512, 4, 512, 3, 1, 1),
    ("64 -> 128, 3x3 stride 2 on 28x28 (im2col)", 64, 28, 128, 3, 2, 1),
    ("256 -> 512, 3x3 stride 2 on 7x7 (im2col)", 256, 7, 512, 3, 2, 1),
    ("64 -> 128, 1x1 stride 2 on 28x28 (im2col)", 64, 28, 128, 1, 2, 0),
]
ARMS = {"own": "dpcore's kernel", "blas": "OpenBLAS (environment's kernels)",
        "blas_auto": "OpenBLAS (OPENBLAS_CORETYPE removed: dpcore's choice)"}


def layers_child(args):
    core = sorted(os.sched_getaffinity(0))[0]
    os.sched_setaffinity(0, {core})
    import dpcore as dp
    rows = ab_layers(GEOMETRIES, "DPCORE_OWN_GEMM", args.batch, args.rounds, args.reps)
    print(json.dumps({"core": core, "rows": rows, "cpu_gemm": dp.build_info()["cpu_gemm"],
                      "blas": dp.build_info()["blas_config"]}))


def step_child(args):
    import numpy as np
    import dpcore as dp
    steps = resnet18_steps(args.batch, args.steps, np.random.default_rng(0))
    print(json.dumps({"steps": steps, "blas": dp.build_info()["blas_config"], "version": dp.__version__}))


def spawn(mode, arm, args):
    env = thread_env(args.threads) if mode == "step" else dict(os.environ)
    env["DPCORE_OWN_GEMM"] = "1" if arm == "own" else "0"
    if arm == "blas_auto":
        env.pop("OPENBLAS_CORETYPE", None)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--batch", str(args.batch), "--steps",
           str(args.steps), "--rounds", str(args.rounds), "--reps", str(args.reps)]
    return child_json(cmd, env, f"{mode} ({arm})")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="alternations per layer, subprocesses per step arm")
    ap.add_argument("--reps", type=int, default=5, help="timed calls per layer, arm and round")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5, help="timed train_steps per subprocess")
    ap.add_argument("--threads", type=int, default=default_threads())
    ap.add_argument("--write", action="store_true", help="replace the section in benchmarks/RESULTS.md")
    ap.add_argument("--child", choices=["layers", "step"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child == "layers":
        return layers_child(args)
    if args.child == "step":
        return step_child(args)
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    layers = spawn("layers", "own", args)
    if layers["cpu_gemm"] == "the BLAS":
        log(f"this build has no dpcore GEMM kernel ({layers['cpu_gemm']}): both arms are the BLAS")
    runs = {arm: [] for arm in ARMS}
    order = list(ARMS)
    for r in range(args.rounds):
        for arm in order[r % 3:] + order[:r % 3]:
            run = spawn("step", arm, args)
            runs[arm].append(run)
            log(f"round {r + 1} {ARMS[arm]}: median step {statistics.median(run['steps']) * 1e3:.1f} ms")
    step = {arm: statistics.median(t for run in runs[arm] for t in run["steps"]) for arm in ARMS}
    lines = [SECTION_TITLE, "",
             f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
             f"- machine: {machine_info()}; load average before / after: {load_before:.2f} / "
             f"{os.getloadavg()[0]:.2f}",
             f"- dpcore {runs['own'][0]['version']} ({layers['cpu_gemm']}); command (from the repository root): "
             f"`{command_line()}`; {time.perf_counter() - started:.0f} s",
             f"- (a) one process pinned to core {layers['core']} (one thread), OpenBLAS as the environment chose "
             f"it ({layers['blas']}); per layer the arms DPCORE_OWN_GEMM=0 (off: OpenBLAS) and =1 (on) alternate "
             f"over {args.rounds} rounds, {args.reps} forward and {args.reps} backward calls (dx, dw, db) each "
             "after a warm-up, timed by the process's CPU time; median per call; GFLOP/s = the forward pass's "
             "direct-convolution FLOPs per second (Winograd's layers multiply fewer)",
             ""] + ab_table(layers["rows"])
    lines += ["",
              f"- (b) whole ResNet-18 train_step (28x28, batch {args.batch}, cpu:0, {args.threads} threads), "
              f"{args.rounds} fresh subprocesses per arm in rotating order, median of every timed step: "
              + ", ".join(f"{ARMS[a]} {step[a] * 1e3:.1f} ms" for a in ARMS)
              + f": **OpenBLAS (environment's) / dpcore's {step['blas'] / step['own']:.2f}x**, "
              f"**OpenBLAS (dpcore's choice) / dpcore's {step['blas_auto'] / step['own']:.2f}x**",
              "- the BLAS each step arm loaded: " + "; ".join(f"{ARMS[a]}: {runs[a][0]['blas']}" for a in ARMS),
              "- per round (median step, ms): " + "; ".join(
                  f"{ARMS[a]} " + ", ".join(f"{statistics.median(run['steps']) * 1e3:.0f}" for run in runs[a])
                  for a in ARMS), ""]
    publish(lines, SECTION_TITLE, args.write)


if __name__ == "__main__":
    main()
