"""Winograd F(2x2, 3x3) (csrc/winograd.h) and F(4x4, 3x3) (csrc/winograd_lanes.h)
against im2col + GEMM for ResNet-18's 3x3 stride-1 convolutions on the CPU
(issue 14): the A/B that picks DPCORE_WINOGRAD's and DPCORE_WINOGRAD_F43's
defaults.

    python benchmarks/bench_winograd.py [--rounds 3] [--steps 5] [--layer-reps 7] [--batch 32] [--write]

Every measurement runs in a fresh subprocess with DPCORE_WINOGRAD=0 (GEMM),
=1 with DPCORE_WINOGRAD_F43=0 (F(2x2, 3x3)) or both =1 (F(4x4, 3x3)), the
three in turn, the order rotating every round, with the threads one CPU
device gets (all usable cores):

(a) each ResNet-18 3x3 stride-1 pad-1 geometry (64x28x28, 128x14x14,
    256x7x7, 512x4x4; as many input as output channels) at --batch samples,
    through dp.ops: the forward pass (y = conv + bias) and the backward pass
    (dx, dw, db; Winograd computes all three but db, a plain sum), each
    timed --layer-reps times after a warm-up;
(b) a whole ResNet-18 train_step (dp.models.ResNet18 on cpu:0, 28x28
    single-channel images, --batch samples, random pixels and labels), --steps
    timed steps after two warm-up steps.

Reported: the median of every timed call of each arm over all rounds, and the
ratios GEMM / each Winograd and F(2x2) / F(4x4) (above 1: the second faster);
for the whole step also each round's ratios (its subprocesses ran back to
back) and their median. The machine is shared: medians over alternating
subprocesses, not best-of, decide.
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
from bench_lenet_cpu import child_json, command_line, default_threads, log, machine_info, publish  # noqa: E402
from bench_lenet_cpu import thread_env  # noqa: E402

SECTION_TITLE = "## Winograd A/B: F(2x2, 3x3) and F(4x4, 3x3) against GEMM (ResNet-18, CPU)"
# (channels in = out, plane side): ResNet-18's 3x3 stride-1 convolutions at 28x28 inputs
GEOMETRIES = [(64, 28), (128, 14), (256, 7), (512, 4)]
ARMS = {"gemm": "GEMM", "f23": "F(2x2, 3x3)", "f43": "F(4x4, 3x3)"}
ARM_ENV = {"gemm": {"DPCORE_WINOGRAD": "0"}, "f23": {"DPCORE_WINOGRAD": "1", "DPCORE_WINOGRAD_F43": "0"},
           "f43": {"DPCORE_WINOGRAD": "1", "DPCORE_WINOGRAD_F43": "1"}}
WARMUP_STEPS = 2


def resnet18_steps(batch, steps, rng):
    """Seconds of each of `steps` timed ResNet-18 train_steps (dp.models.ResNet18 on cpu:0, 28x28
    single-channel random images and labels, `batch` samples) after WARMUP_STEPS warm-up steps."""
    import numpy as np
    import dpcore as dp
    net = dp.models.ResNet18(devices=["cpu:0"])
    X = rng.random((batch,) + tuple(net._model.input_shape), dtype=np.float32)
    y = rng.integers(0, net._model.num_classes, batch)
    times = []
    for i in range(WARMUP_STEPS + steps):
        t0 = time.perf_counter()
        net.train_step(X, y, lr=0.01)
        if i >= WARMUP_STEPS:
            times.append(time.perf_counter() - t0)
    return times


def conv_layer_times(N, C, H, O, stride, reps, rng):
    """{"forward": [...], "backward": [...]} seconds of `reps` timed dp.ops calls (after a warm-up) of a
    3x3 pad-1 convolution C -> O on H x H planes at `stride`, on random data (drawn x, w, b, dy in turn)."""
    import numpy as np
    import dpcore as dp
    x = rng.standard_normal((N, C, H, H)).astype(np.float32)
    w = (rng.standard_normal((O, C, 3, 3)) / np.sqrt(9 * C)).astype(np.float32)
    b = rng.standard_normal(O).astype(np.float32)
    OH = (H - 1) // stride + 1
    dy = rng.standard_normal((N, O, OH, OH)).astype(np.float32)
    dp.ops.conv2d(x, w, b, stride=stride, padding=1)
    dp.ops.conv2d_backward(x, w, dy, stride=stride, padding=1)
    fwd, bwd = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        dp.ops.conv2d(x, w, b, stride=stride, padding=1)
        t1 = time.perf_counter()
        dp.ops.conv2d_backward(x, w, dy, stride=stride, padding=1)
        t2 = time.perf_counter()
        fwd.append(t1 - t0)
        bwd.append(t2 - t1)
    return {"forward": fwd, "backward": bwd}


def child(args):
    import numpy as np
    import dpcore as dp
    rng = np.random.default_rng(0)
    layers = {f"{C}x{H}x{H}": conv_layer_times(args.batch, C, H, C, 1, args.layer_reps, rng) for C, H in GEOMETRIES}
    steps = resnet18_steps(args.batch, args.steps, rng)
    print(json.dumps({"arm": [os.environ.get(k) for k in ("DPCORE_WINOGRAD", "DPCORE_WINOGRAD_F43")],
                      "layers": layers, "steps": steps,
                      "version": dp.__version__}))


def spawn(arm, args):
    # the GEMM arm's 64-channel layers on im2col + SGEMM, as before the implicit GEMM (which would
    # take them with Winograd off): the A/B stays Winograd against the GEMM path
    return ab_spawn(os.path.abspath(__file__), dict(ARM_ENV[arm], DPCORE_IMPLICIT_GEMM="0"), ARMS[arm], args)


def ab_spawn(script, arm_env, label, args):
    """The result of a fresh `script --child` (this one or bench_winograd_s2.py) with args' batch,
    steps and layer reps, in thread_env(args.threads) updated with arm_env."""
    env = thread_env(args.threads)
    env.update(arm_env)
    cmd = [sys.executable, script, "--child", "--batch", str(args.batch), "--steps",
           str(args.steps), "--layer-reps", str(args.layer_reps)]
    return child_json(cmd, env, label)


def ab_args(doc, argv):
    """The A/B scripts' options (this one's and bench_winograd_s2.py's)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="subprocesses per arm (default 3)")
    ap.add_argument("--steps", type=int, default=5, help="timed train_steps per subprocess (default 5)")
    ap.add_argument("--layer-reps", type=int, default=7, help="timed calls per layer and subprocess (default 7)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=default_threads())
    ap.add_argument("--write", action="store_true", help="put the section into benchmarks/RESULTS.md")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def ab_main(doc, argv, child, spawn, arms, pairs, keys, title, about, columns, digits):
    """The A/B scripts' main (this one's and bench_winograd_s2.py's): with --child, child(args); else
    ab_rounds of spawn over the arms, and ab_report's section (columns: its header row, with {batch}
    for --batch) printed, and with --write put into RESULTS.md."""
    args = ab_args(doc, argv)
    if args.child:
        return child(args)
    args.load_before = os.getloadavg()[0]
    runs = ab_rounds(args, arms, spawn)
    lines = ab_report(args, arms, runs, pairs, keys, title, about, columns.format(batch=args.batch), digits)
    publish(lines, title, args.write)


def ab_rounds(args, arms, spawn):
    """{arm: [each round's child result]}: every arm once a round, the order rotating."""
    runs = {arm: [] for arm in arms}
    order = list(arms)
    for r in range(args.rounds):
        k = r % len(order)
        for arm in order[k:] + order[:k]:
            run = spawn(arm, args)
            runs[arm].append(run)
            log(f"round {r + 1} {arms[arm]}: median step {statistics.median(run['steps']):.3f} s")
    return runs


def ab_report(args, arms, runs, pairs, keys, title, about, columns, digits=2):
    """The section's lines: its header (date, machine, command, `about`), the table
    (`columns`: its header row; a row per layer key and pass: each arm's median ms,
    then the pairs' ratios), and the whole step's medians, per round and their ratios."""
    def median(arm, pick):
        return statistics.median(t for run in runs[arm] for t in pick(run))

    def round_ratios(a, b):
        return [statistics.median(x["steps"]) / statistics.median(y["steps"]) for x, y in zip(runs[a], runs[b])]

    step = {arm: median(arm, lambda run: run["steps"]) for arm in arms}
    first = next(iter(arms))
    lines = [title, "",
             f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
             f"- machine: {machine_info()}; load average before / after: {args.load_before:.2f} / "
             f"{os.getloadavg()[0]:.2f}",
             f"- dpcore {runs[first][0]['version']}, {args.threads} threads; command (from the repository root): "
             f"`{command_line()}`",
             f"- {args.rounds} fresh subprocesses per arm: {about}", "", columns,
             "|" + "---|" * (2 + len(arms) + len(pairs))]
    for key in keys:
        for p in ("forward", "backward"):
            t = {arm: median(arm, lambda run: run["layers"][key][p]) for arm in arms}
            lines.append(f"| {key} | {p} | " + " | ".join(f"{t[a] * 1e3:.2f}" for a in arms) + " | "
                         + " | ".join(f"{t[a] / t[b]:.2f}x" for a, b in pairs) + " |")
    lines += ["",
              f"- whole ResNet-18 train_step (28x28, batch {args.batch}, cpu:0), median of "
              f"{args.rounds} x {args.steps} steps: " + ", ".join(f"{arms[a]} {step[a] * 1e3:.1f} ms" for a in arms)
              + ": " + ", ".join(f"**{arms[a]} / {arms[b]} {step[a] / step[b]:.{digits}f}x**" for a, b in pairs),
              "- per round (median step, ms): "
              + "; ".join(f"{arms[arm]} " + ", ".join(f"{statistics.median(run['steps']) * 1e3:.{digits - 1}f}"
                                                       for run in runs[arm]) for arm in arms)
              + "; per round: " + "; ".join(
                  f"{arms[a]} / {arms[b]} " + ", ".join(f"{r:.{digits}f}x" for r in round_ratios(a, b))
                  + f" (median {statistics.median(round_ratios(a, b)):.{digits}f}x)" for a, b in pairs), ""]
    return lines


def main(argv=None):
    return ab_main(
        __doc__, argv, child, spawn, ARMS, [("gemm", "f23"), ("gemm", "f43"), ("f23", "f43")],
        [f"{C}x{H}x{H}" for C, H in GEOMETRIES], SECTION_TITLE,
        "DPCORE_WINOGRAD=0 (im2col + GEMM), F(2x2, 3x3) (csrc/winograd.c; DPCORE_WINOGRAD_F43=0) and F(4x4, 3x3) "
        "(csrc/winograd_lanes.c), in rotating order; medians of every timed call; each ratio is the first arm's "
        "time over the second's (above 1: the second faster). Backward = dx + dw + db.",
        "| layer (C = O, batch {batch}) | pass | GEMM ms | F(2x2, 3x3) ms | F(4x4, 3x3) ms | "
        "GEMM / F(2x2) | GEMM / F(4x4) | F(2x2) / F(4x4) |", digits=2)


if __name__ == "__main__":
    main()
