"""Winograd F(3x3, 5x5) against the paths it replaces on the CPU (issue 14;
csrc/winograd_lanes.h): the per-layer A/B behind its channel limit, and the
whole LeNet step's A/B is bench_threads.py's DPCORE_WINOGRAD_F35=1 row.

    python benchmarks/bench_winograd5.py [--rounds 5] [--reps 5] [--batch 128] [--write]

One process pinned to one core (sched_setaffinity before dpcore loads, so the
CPU device has one thread), timed by the process's CPU time as
bench_implicit_gemm.py does. For each 5x5 stride-1 geometry the arms
DPCORE_WINOGRAD_F35=0 (the implicit GEMM up to 64 output channels, im2col + SGEMM
above) and =1 (Winograd, as set_precision('fast') takes it) alternate, swapping order every round; each arm times --reps
forward calls and --reps backward calls (dx, dw, db) after a warm-up.
Reported: the median per call over the rounds, and off / on (above 1:
Winograd faster). Rows below the channel limit (DP_WL_F35_MIN_IN, 6 input
channels) are not taken by Winograd in a default build: both arms run the
same path there (the ratio shows the noise) unless the build set the limit
lower (CFLAGS=-DDP_WL_F35_MIN_IN=1), which is how the limit was chosen.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_implicit_gemm import ab_layers, ab_main  # noqa: E402

SECTION_TITLE = "## Winograd F(3x3, 5x5) A/B (CPU, one core)"
# (name, C, H, O, pad)
GEOMETRIES = [
    ("LeNet 20 -> 50 on 13x13", 20, 13, 50, 0),
    ("book LeNet 6 -> 16 on 14x14", 6, 14, 16, 0),
    ("4 -> 16 on 14x14 (below the limit)", 4, 14, 16, 0),
    ("8 -> 16 on 14x14", 8, 14, 16, 0),
    ("16 -> 32 pad 2 on 14x14", 16, 14, 32, 2),
    ("20 -> 50 pad 2 on 28x28 (batch / 4)", 20, 28, 50, 2),
    ("32 -> 64 pad 2 on 14x14", 32, 14, 64, 2),
    ("64 -> 128 pad 2 on 14x14 (batch / 4)", 64, 14, 128, 2),
]


def measure(args):
    core = sorted(os.sched_getaffinity(0))[0]
    os.sched_setaffinity(0, {core})
    os.environ["DPCORE_FFT"] = "0"  # the off arm: the implicit GEMM, as when this A/B was made (bench_fft.py: the FFT's)
    import dpcore as dp
    geometries = [(name, C, H, O, 5, 1, p) for name, C, H, O, p in GEOMETRIES]
    return core, dp.__version__, ab_layers(geometries, "DPCORE_WINOGRAD_F35", args.batch, args.rounds, args.reps)


def main(argv=None):
    ab_main(argv, __doc__.splitlines()[0], SECTION_TITLE, "DPCORE_WINOGRAD_F35", "per geometry (5x5, stride 1)",
            measure, " (Winograd's own multiplies are 4.6x fewer)",
            "off: the implicit GEMM (forward, dw; dx from 32 output channels) up to 64 output channels, "
            "im2col + SGEMM above; on: Winograd F(3x3, 5x5) (csrc/winograd_lanes.h) from 6 input channels. "
            "Rows marked below the limit run the same path in both arms in a default build.")


if __name__ == "__main__":
    main()
