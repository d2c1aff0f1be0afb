"""Winograd F(2x2, 3x3) against im2col + GEMM for ResNet-18's 3x3 stride-1
convolutions on the CPU (issue 14; csrc/winograd.h): the A/B that picks
DPCORE_WINOGRAD's default.

    python benchmarks/bench_winograd.py [--rounds 3] [--steps 5] [--layer-reps 7] [--batch 32] [--write]

Every measurement runs in a fresh subprocess with DPCORE_WINOGRAD=0 (GEMM) or
=1 (Winograd), the two alternating and swapping order every round, with the
threads one CPU device gets (all usable cores):

(a) each ResNet-18 3x3 stride-1 pad-1 geometry (64x28x28, 128x14x14,
    256x7x7, 512x4x4; as many input as output channels) at --batch samples,
    through dp.ops: the forward pass (y = conv + bias) and the backward pass
    (dx, dw, db; Winograd computes all three but db, a plain sum), each
    timed --layer-reps times after a warm-up;
(b) a whole ResNet-18 train_step (dp.models.ResNet18 on cpu:0, 28x28
    single-channel images, --batch samples, random pixels and labels), --steps
    timed steps after two warm-up steps.

Reported: the median of every timed call of each arm over all rounds, and the
ratio GEMM / Winograd (above 1: Winograd faster); for the whole step also each
round's ratio (its two subprocesses ran back to back) and their median. The
machine is shared: medians over alternating subprocesses, not best-of, decide.
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_lenet_cpu import command_line, default_threads, log, machine_info, publish, thread_env  # noqa: E402

SECTION_TITLE = "## Winograd F(2x2, 3x3) A/B (ResNet-18, CPU)"
# (channels in = out, plane side): ResNet-18's 3x3 stride-1 convolutions at 28x28 inputs
GEOMETRIES = [(64, 28), (128, 14), (256, 7), (512, 4)]
ARMS = {"0": "GEMM", "1": "Winograd"}
WARMUP_STEPS = 2


def child(args):
    import numpy as np
    import dpcore as dp
    rng = np.random.default_rng(0)
    N = args.batch
    layers = {}
    for C, H in GEOMETRIES:
        x = rng.standard_normal((N, C, H, H)).astype(np.float32)
        w = (rng.standard_normal((C, C, 3, 3)) / np.sqrt(9 * C)).astype(np.float32)
        b = rng.standard_normal(C).astype(np.float32)
        dy = rng.standard_normal((N, C, H, H)).astype(np.float32)
        dp.ops.conv2d(x, w, b, stride=1, padding=1)
        dp.ops.conv2d_backward(x, w, dy, stride=1, padding=1)
        fwd, bwd = [], []
        for _ in range(args.layer_reps):
            t0 = time.perf_counter()
            dp.ops.conv2d(x, w, b, stride=1, padding=1)
            t1 = time.perf_counter()
            dp.ops.conv2d_backward(x, w, dy, stride=1, padding=1)
            t2 = time.perf_counter()
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
        layers[f"{C}x{H}x{H}"] = {"forward": fwd, "backward": bwd}
    net = dp.models.ResNet18(devices=["cpu:0"])
    X = rng.random((N,) + tuple(net._model.input_shape), dtype=np.float32)
    y = rng.integers(0, net._model.num_classes, N)
    steps = []
    for i in range(WARMUP_STEPS + args.steps):
        t0 = time.perf_counter()
        net.train_step(X, y, lr=0.01)
        if i >= WARMUP_STEPS:
            steps.append(time.perf_counter() - t0)
    print(json.dumps({"arm": os.environ.get("DPCORE_WINOGRAD"), "layers": layers, "steps": steps,
                      "version": dp.__version__}))


def spawn(arm, args):
    env = thread_env(args.threads)
    env["DPCORE_WINOGRAD"] = arm
    # the GEMM arm's 64-channel layers on im2col + SGEMM, as before the implicit GEMM (which would
    # take them with Winograd off): the A/B stays Winograd against the GEMM path
    env["DPCORE_IMPLICIT_GEMM"] = "0"
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--batch", str(args.batch), "--steps",
           str(args.steps), "--layer-reps", str(args.layer_reps)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"the DPCORE_WINOGRAD={arm} subprocess failed:\n{out.stdout}{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="subprocesses per arm (default 3)")
    ap.add_argument("--steps", type=int, default=5, help="timed train_steps per subprocess (default 5)")
    ap.add_argument("--layer-reps", type=int, default=7, help="timed calls per layer and subprocess (default 7)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=default_threads())
    ap.add_argument("--write", action="store_true", help="put the section into benchmarks/RESULTS.md")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args)
    load_before = os.getloadavg()[0]
    runs = {arm: [] for arm in ARMS}
    for r in range(args.rounds):
        for arm in (("0", "1") if r % 2 == 0 else ("1", "0")):
            run = spawn(arm, args)
            runs[arm].append(run)
            log(f"round {r + 1} {ARMS[arm]}: median step {statistics.median(run['steps']):.3f} s")

    def median(arm, pick):
        return statistics.median(t for run in runs[arm] for t in pick(run))

    step = {arm: median(arm, lambda run: run["steps"]) for arm in ARMS}
    ratio = step["0"] / step["1"]
    round_ratios = [statistics.median(g["steps"]) / statistics.median(w["steps"]) for g, w in zip(runs["0"], runs["1"])]
    lines = [SECTION_TITLE, "",
             f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
             f"- machine: {machine_info()}; load average before / after: {load_before:.2f} / "
             f"{os.getloadavg()[0]:.2f}",
             f"- dpcore {runs['0'][0]['version']}, {args.threads} threads; command (from the repository root): "
             f"`{command_line()}`",
             f"- {args.rounds} fresh subprocesses per arm, DPCORE_WINOGRAD=0 (im2col + GEMM) and =1 (Winograd "
             "F(2x2, 3x3), csrc/winograd.c) alternating; medians of every timed call; ratio = GEMM / Winograd "
             "(above 1: Winograd faster). Backward = dx + dw + db (Winograd computes all three but db, a plain sum).",
             "",
             f"| layer (C = O, batch {args.batch}) | pass | GEMM ms | Winograd ms | GEMM / Winograd |",
             "|---|---|---|---|---|"]
    for C, H in GEOMETRIES:
        key = f"{C}x{H}x{H}"
        for p in ("forward", "backward"):
            g, w = (median(arm, lambda run: run["layers"][key][p]) for arm in ("0", "1"))
            lines.append(f"| {key} | {p} | {g * 1e3:.2f} | {w * 1e3:.2f} | {g / w:.2f}x |")
    lines += ["",
              f"- whole ResNet-18 train_step (28x28, batch {args.batch}, cpu:0), median of "
              f"{args.rounds} x {args.steps} steps: GEMM {step['0'] * 1e3:.1f} ms, Winograd {step['1'] * 1e3:.1f} ms: "
              f"**GEMM / Winograd {ratio:.2f}x**",
              "- per round (median step, ms): "
              + "; ".join(f"{ARMS[arm]} " + ", ".join(f"{statistics.median(run['steps']) * 1e3:.0f}"
                                                       for run in runs[arm]) for arm in ARMS)
              + "; GEMM / Winograd per round: " + ", ".join(f"{r:.2f}x" for r in round_ratios)
              + f" (median {statistics.median(round_ratios):.2f}x)", ""]
    publish(lines, SECTION_TITLE, args.write)


if __name__ == "__main__":
    main()
