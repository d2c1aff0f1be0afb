"""The stride-2 Winograd (csrc/winograd_s2.h) against im2col + GEMM for ResNet-18's
3x3 stride-2 convolutions on the CPU, and transparent huge pages for the CPU
backend's large buffers (issue 14): the A/Bs that pick DPCORE_WINOGRAD_S2's and
DPCORE_HUGE_PAGES's defaults.

    python benchmarks/bench_winograd_s2.py [--rounds 3] [--steps 5] [--layer-reps 7] [--batch 32] [--write]

Every measurement runs in a fresh subprocess, the arms in turn, the order
rotating every round, with the threads one CPU device gets (all usable cores):
DPCORE_WINOGRAD_S2=0 (im2col + GEMM), =1 (the stride-2 Winograd), and =1 with
DPCORE_HUGE_PAGES=0 (no huge pages asked for). Each subprocess times

(a) ResNet-18's three 3x3 stride-2 pad-1 geometries at 28x28 inputs (64 -> 128
    on 28x28, 128 -> 256 on 14x14, 256 -> 512 on 7x7) at --batch samples,
    through dp.ops: the forward pass (y = conv + bias) and the backward pass
    (dx, dw, db), each --layer-reps times after a warm-up (the 14x14 layer is
    not the path's: its 4x4 tiles cover 8x8 outputs for 7x7, and the rule
    keeps it on the GEMM path, so its row shows the noise);
(b) a whole ResNet-18 train_step (dp.models.ResNet18 on cpu:0, 28x28
    single-channel images, --batch samples), --steps timed steps after two
    warm-up steps.

Reported: the median of every timed call of each arm over all rounds, and the
ratios (above 1: the second arm faster); for the whole step each round's ratio
too and their median.
"""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_winograd import ab_main, ab_spawn, conv_layer_times, resnet18_steps  # noqa: E402

SECTION_TITLE = "## Stride-2 Winograd and huge pages A/B (ResNet-18, CPU)"
# (channels in, plane side, channels out): ResNet-18's 3x3 stride-2 convolutions at 28x28 inputs
GEOMETRIES = [(64, 28, 128), (128, 14, 256), (256, 7, 512)]
ARMS = {"gemm": "GEMM", "s2": "stride-2 Winograd", "s2_small": "stride-2 Winograd, no huge pages"}
ARM_ENV = {"gemm": {"DPCORE_WINOGRAD_S2": "0"}, "s2": {"DPCORE_WINOGRAD_S2": "1", "DPCORE_HUGE_PAGES": "1"},
           "s2_small": {"DPCORE_WINOGRAD_S2": "1", "DPCORE_HUGE_PAGES": "0"}}


def child(args):
    import numpy as np
    import dpcore as dp
    rng = np.random.default_rng(0)
    layers = {f"{C}x{H}x{H} -> {O}": conv_layer_times(args.batch, C, H, O, 2, args.layer_reps, rng)
              for C, H, O in GEOMETRIES}
    steps = resnet18_steps(args.batch, args.steps, rng)
    print(json.dumps({"layers": layers, "steps": steps, "version": dp.__version__}))


def spawn(arm, args):
    return ab_spawn(os.path.abspath(__file__), ARM_ENV[arm], ARMS[arm], args)


def main(argv=None):
    return ab_main(
        __doc__, argv, child, spawn, ARMS, [("gemm", "s2"), ("s2_small", "s2")],
        [f"{C}x{H}x{H} -> {O}" for C, H, O in GEOMETRIES], SECTION_TITLE,
        "DPCORE_WINOGRAD_S2=0 (im2col + GEMM), =1 (csrc/winograd_s2.c), and =1 with DPCORE_HUGE_PAGES=0, in "
        "rotating order; medians of every timed call; each ratio is the first arm's time over the second's (above "
        "1: the second faster). Backward = dx + dw + db.",
        "| layer (batch {batch}) | pass | GEMM ms | stride-2 Winograd ms | no huge pages ms | "
        "GEMM / Winograd | no huge pages / huge pages |", digits=3)


if __name__ == "__main__":
    main()
