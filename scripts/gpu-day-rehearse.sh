#!/usr/bin/env bash
# The GPU day rehearsed on a CPU machine in the GPU machine's layout (CI runs it:
# tests/test_gpu_day.py): a Python inside a venv made from another venv, with numpy 2.x and
# pytest installed there and nothing of dpcore's installed system-wide for it; the .debs
# unpacked into a prefix; cuDNN / cuBLAS / NCCL from NVIDIA's wheels when the rehearsal's cache
# has them (scripts/gpu-day-prepare.sh --wheels), else the toolkit's, with that reason in the
# summary; the build for one arch, the "is the CUDA backend built" check, every GPU test
# collected; built without MPI, as there (no mpicc). It stops at the first step that needs a device.
#
#   scripts/gpu-day-rehearse.sh [BASE_PYTHON] [OUTDIR]
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
base=${1:-python3}
ver=$("$base" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
root=${GPU_DAY_REHEARSAL_ROOT:-/tmp/dpcore-rehearsal}/py$ver
out=${2:-$root/out}
"$here/scripts/gpu-day-prepare.sh" >/dev/null
if [ ! -x "$root/inner/bin/python" ]; then
  rm -rf "$root"; mkdir -p "$root"
  "$base" -m venv "$root/outer"
  "$root/outer/bin/python" -m venv "$root/inner"   # a venv made from a venv, as on the GPU image
  "$root/inner/bin/python" -m pip install -q --disable-pip-version-check \
    "numpy>=2" pytest pytest-timeout setuptools wheel safetensors cloudpickle tqdm
fi
cache=${GPU_DAY_WHEEL_CACHE:-$HOME/.cache/dpcore/gpu-wheels}
wheels=()
if [ -d "$cache/nvidia" ]; then
  wheels=(--wheel-site "$cache")
else
  echo "gpu-day-rehearse: no NVIDIA wheels in $cache (scripts/gpu-day-prepare.sh --wheels):" \
       "cuDNN / cuBLAS / NCCL come from the toolkit in this rehearsal"
fi
DPCORE_MPI=0 GPU_DAY_PYTHON="$root/inner/bin/python" exec "$here/scripts/gpu-day.sh" --rehearse --arch "${GPU_DAY_ARCH:-90}" \
  --work "$root/work" "${wheels[@]}" "$out"
