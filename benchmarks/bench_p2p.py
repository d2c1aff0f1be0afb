#!/usr/bin/env python3
"""Point to point across 2 processes (issue 33): dp.distributed.send / recv against MPI's
own MPI_Send / MPI_Recv (mpi4py) in the same run, 4 B to 64 MiB.

    .venv/bin/python benchmarks/bench_p2p.py [--sizes 4 64 1024 ...] [--rounds 5]

One mpirun job of 2 ranks (``--bind-to none``). Per size a ping-pong: rank 0 sends, rank 1
receives and sends back; the two forms alternate in rounds, each round timing enough round
trips to take ~20 ms (at least 3), and each form reports the median over rounds of the
one-way time (half a round trip). dpcore's message is its descriptor and answer (the
receiver checks dtype and shape before any byte moves) and then the payload, so its
latency is that of about three MPI messages; at large sizes both move the payload once.
Prints one-way microseconds, bandwidth (bytes / one-way time) and dpcore / MPI.
"""
import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, sys, time
import numpy as np
import dpcore as dp
from mpi4py import MPI
sizes, rounds = json.loads(sys.argv[1]), int(sys.argv[2])
comm = MPI.COMM_WORLD
rank = comm.rank
assert dp.distributed.world_size() == comm.size == 2
dist = dp.distributed


def trips(form, buf, n):
    if form == "mpi":
        for _ in range(n):
            if rank == 0:
                comm.Send(buf, dest=1, tag=7)
                comm.Recv(buf, source=1, tag=7)
            else:
                comm.Recv(buf, source=0, tag=7)
                comm.Send(buf, dest=0, tag=7)
    else:
        for _ in range(n):
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)


out = {}
for size in sizes:
    buf = np.zeros(max(size // 4, 1), np.float32)
    # round trips per round: enough for ~20 ms of the slower form, agreed by both ranks
    comm.Barrier()
    t0 = time.perf_counter()
    trips("dpcore", buf, 3)
    n = comm.bcast(max(3, int(0.02 / max((time.perf_counter() - t0) / 3, 1e-7))), root=0)
    times = {"dpcore": [], "mpi": []}
    for _ in range(rounds):
        for form in ("dpcore", "mpi"):
            comm.Barrier()
            t0 = time.perf_counter()
            trips(form, buf, n)
            times[form].append((time.perf_counter() - t0) / n / 2)
    out[size] = {f: float(np.median(v)) for f, v in times.items()}
if rank == 0:
    print("RESULT " + json.dumps(out), flush=True)
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[4 ** k for k in range(1, 14)], help="bytes")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = ["mpirun", "-np", "2", "--bind-to", "none", sys.executable, "-c", CHILD, json.dumps(args.sizes),
           str(args.rounds)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        sys.stderr.write(proc.stdout + proc.stderr)
        return 1
    res = json.loads(line[7:])
    print("| bytes | dpcore one-way us | MPI one-way us | dpcore GB/s | MPI GB/s | dpcore / MPI |")
    print("|---|---|---|---|---|---|")
    for size in args.sizes:
        d, m = res[str(size)]["dpcore"], res[str(size)]["mpi"]
        print(f"| {size} | {d * 1e6:.1f} | {m * 1e6:.1f} | {size / d / 1e9:.3f} | {size / m / 1e9:.3f} | "
              f"{d / m:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
