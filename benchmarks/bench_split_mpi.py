#!/usr/bin/env python3
"""The model-parallel strategies across processes (issue 33) against the same strategy in one
process, on the same cores: a 2-stage PipelineStrategy and a 2-way ModelParallelStrategy, each
once in one process over 2 logical CPU devices (one core each) and once under
``mpirun -np 2`` (one rank each, ``cpu:0``, the ranks sharing the 2 cores as the devices do).

    .venv/bin/python benchmarks/bench_split_mpi.py [--steps 10] [--rounds 3] [--batch 256]

LeNet on Fashion-MNIST batches. Per configuration: images/s over --steps steps (the best of
--rounds rounds, after a warm-up step) and the multi-process run as a multiple of the
one-process one's time; the two give the same bits (tests/test_pipeline_mpi.py,
tests/test_tensor_parallel_mpi.py), so the ratio is the cost of moving activations and
gradients between processes over MPI instead of handing them over in memory.
"""
import argparse
import json
import os
import subprocess
import sys
import time
import warnings

CHILD = r"""
import json, sys, time, warnings
import numpy as np
import dpcore as dp
kind, steps, rounds, batch, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
if mode == "one":
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        dp.set_logical_devices("cpu", 2)
    devices = ["cpu:0", "cpu:1"]
else:
    devices = None  # under mpirun: one part per rank
strategy = (dp.PipelineStrategy(devices=devices, micro_batches=4, balance="flops") if kind == "pipeline"
            else dp.ModelParallelStrategy(devices=devices))
with strategy.scope():
    net = dp.models.LeNet(seed=0)
X, y = next(iter(dp.data.load_fashion_mnist(batch_size=batch)[0]))
net.train_step(X, y, lr=0.1)  # warm-up
best = float("inf")
for _ in range(rounds):
    t0 = time.perf_counter()
    for _ in range(steps):
        net.train_step(X, y, lr=0.1)
    best = min(best, time.perf_counter() - t0)
if dp.distributed.rank() == 0:
    print("RESULT " + json.dumps({"images_per_s": steps * batch / best}), flush=True)
"""


def measure(kind, mode, args):
    cmd = [sys.executable, "-c", CHILD, kind, str(args.steps), str(args.rounds), str(args.batch), mode]
    if mode == "mpi":
        cmd = ["mpirun", "-np", "2", "--oversubscribe", "--bind-to", "none"] + cmd
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        sys.stderr.write(proc.stdout + proc.stderr)
        raise SystemExit(f"{kind} {mode}: failed")
    return json.loads(line[7:])["images_per_s"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=256)
    args = ap.parse_args()
    print(f"LeNet, batch {args.batch}, best of {args.rounds} rounds of {args.steps} steps; {time.ctime()}")
    print("| strategy | one process, 2 logical devices (images/s) | 2 processes (images/s) | "
          "2 processes' time / one process's |")
    print("|---|---|---|---|")
    for kind, name in (("pipeline", "PipelineStrategy, 2 stages, 4 micro-batches (1F1B)"),
                       ("layerwise", "ModelParallelStrategy, 2 slices")):
        one, two = measure(kind, "one", args), measure(kind, "mpi", args)
        print(f"| {name} | {one:.0f} | {two:.0f} | {one / two:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    with warnings.catch_warnings():
        sys.exit(main())
