#!/usr/bin/env bash
# The GPU day in one command, on a bare GPU machine (docs/gpu-day.md):
#
#   scripts/gpu-day.sh [OUTDIR]              build, GPU tests by priority, benchmark, memcheck
#   scripts/gpu-day.sh --rehearse [OUTDIR]   the same on a CPU machine, up to the device
#
# Everything comes back under OUTDIR ($OUT, else ./gpu-day-out): summary.txt first. Needs the
# .debs of scripts/gpu-day-prepare.sh in .gpu/debs (carried with the tree). The Python is
# python3 on PATH (the image's, with numpy, pytest and NVIDIA's wheels) or GPU_DAY_PYTHON.
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
py=${GPU_DAY_PYTHON:-$(command -v python3)}
exec "$py" "$here/scripts/gpu_day.py" --python "$py" "$@"
