#!/usr/bin/env python3
"""The all-reduce across processes (issue 33): dist.c's rank-ordered chain against its
owner-computes form (the same bits) and MPI_Allreduce (mpi4py, float32 sum: not rank-ordered),
for 2, 4 and 8 processes on this machine.

    benchmarks/bench_dist_allreduce.py [--procs 2 4 8] [--sizes 1024 262144 4194304] [--iters 20]

One mpirun job per process count (``--oversubscribe --bind-to none``: with more processes than
cores the ranks take turns, so latency is what shows); in each, per size, the three forms
alternate in rounds and each reports its median seconds per call over the rounds (the slowest
rank's). Prints a table: seconds per call and each form's time as a multiple of MPI_Allreduce's.
"""
import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, os, sys, time
import numpy as np
import dpcore as dp
from mpi4py import MPI
sizes, iters = json.loads(sys.argv[1]), int(sys.argv[2])
comm = MPI.COMM_WORLD
assert dp.distributed.world_size() == comm.size  # dpcore joins the job (mpi4py started MPI)
out = {}
for n in sizes:
    x = np.zeros(n, np.float32)
    times = {"chain": [], "owner": [], "mpi": []}
    for rnd in range(5):
        for form in ("chain", "owner", "mpi"):
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                if form == "mpi":
                    comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)
                else:
                    dp._core.dist_allreduce_sum([x], 1.0, 60.0, "bench", [1] * comm.size if form == "owner" else None)
            t = (time.perf_counter() - t0) / iters
            times[form].append(comm.allreduce(t, op=MPI.MAX))
    out[n] = {f: float(np.median(v)) for f, v in times.items()}
if comm.rank == 0:
    print(json.dumps(out))
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 262144, 4194304], help="floats")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    print(f"{'procs':>5} {'floats':>9} {'chain s':>10} {'owner s':>10} {'MPI s':>10} {'chain/MPI':>9} "
          f"{'owner/MPI':>9} {'owner/chain':>11}", flush=True)
    for P in args.procs:
        cmd = ["mpirun", "-np", str(P), "--oversubscribe", "--bind-to", "none", sys.executable, "-c", CHILD,
               json.dumps(args.sizes), str(args.iters)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            sys.exit(proc.stdout + proc.stderr)
        res = json.loads(proc.stdout.strip().splitlines()[-1])
        for n in args.sizes:
            t = res[str(n)]
            print(f"{P:>5} {n:>9} {t['chain']:>10.3g} {t['owner']:>10.3g} {t['mpi']:>10.3g} "
                  f"{t['chain'] / t['mpi']:>9.2f} {t['owner'] / t['mpi']:>9.2f} {t['owner'] / t['chain']:>11.2f}",
                  flush=True)


if __name__ == "__main__":
    main()
