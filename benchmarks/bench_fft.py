"""The FFT convolution against the path it replaces on the CPU (issue 31;
csrc/fft_lanes.h): per layer, DPCORE_FFT=0 (the implicit GEMM) against =1 (the
16x16 FFT, the default precision's form for these layers); the whole LeNet
epoch is bench_lenet_cpu.py's.

    python benchmarks/bench_fft.py [--rounds 5] [--reps 5] [--batch 128] [--write]

One process pinned to one core (sched_setaffinity before dpcore loads, so the
CPU device has one thread), timed by the process's CPU time, the arms
alternating, as bench_implicit_gemm.py and bench_winograd5.py do. The inputs
are standard normal (signed, unlike ReLU's outputs): more outputs land near
zero than in training, so the forward arm includes more of the direct
recomputation of those (fft_lanes.c: fl_forward) than LeNet's training does.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_implicit_gemm import ab_layers, ab_main  # noqa: E402

SECTION_TITLE = "## FFT convolution A/B (CPU, one core)"
# (name, C, H, O, K, pad)
GEOMETRIES = [
    ("LeNet 20 -> 50 on 13x13", 20, 13, 50, 5, 0),
    ("book LeNet 6 -> 16 on 14x14", 6, 14, 16, 5, 0),
    ("8 -> 16 on 14x14", 8, 14, 16, 5, 0),
    ("32 -> 64 pad 2 on 12x12", 32, 12, 64, 5, 2),
    ("16 -> 32 7x7 pad 1 on 14x14", 16, 14, 32, 7, 1),
]


def measure(args):
    core = sorted(os.sched_getaffinity(0))[0]
    os.sched_setaffinity(0, {core})
    import dpcore as dp
    geometries = [(name, C, H, O, K, 1, p) for name, C, H, O, K, p in GEOMETRIES]
    return core, dp.__version__, ab_layers(geometries, "DPCORE_FFT", args.batch, args.rounds, args.reps)


def main(argv=None):
    ab_main(argv, __doc__.splitlines()[0], SECTION_TITLE, "DPCORE_FFT", "per geometry (stride 1)",
            measure, " (the FFT's own multiplies: 576 a (sample, o, c) against OH*OW*K*K)",
            "off: the implicit GEMM (csrc/implicit_gemm.h) up to 64 output channels; on: the 16x16 FFT "
            "(csrc/fft_lanes.h) with its direct recomputation of the outputs near zero.")


if __name__ == "__main__":
    main()
