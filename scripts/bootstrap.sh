#!/usr/bin/env bash
# Set up everything dpcore needs on a fresh Debian machine, then install dpcore
# into a virtualenv. Idempotent: a second run only rebuilds dpcore.
#
#   scripts/bootstrap.sh            # system packages (when root), .venv, pip install .
#   VENV=/path/to/venv scripts/bootstrap.sh
#   DPCORE_CUDA=0 DPCORE_MPI=0 DPCORE_SANITIZE=1 VENV=...   the build knobs of setup.py
#   DPCORE_DEPS_ONLY=1 VENV=...  the system packages, the venv and its requirements, no build
#                                 (touches nothing in the source tree: CI runs it beside tests)
#
# System packages: OpenBLAS (CBLAS, OpenMP build: the same libgomp our kernels
# use, so BLAS and dpcore never run two competing thread pools), Debian's
# Fashion-MNIST, and Open MPI (headers and mpirun: multi-process training;
# DPCORE_MPI=0 builds without it and skips it here). The CUDA toolkit is optional: found at /usr/local/cuda or via
# nvcc on PATH, it is used; otherwise dpcore builds CPU-only.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
venv=${VENV:-$here/.venv}
python=${PYTHON:-python3}

apt_packages=(libopenblas-openmp-dev dataset-fashion-mnist)
if [ "${DPCORE_MPI:-1}" != 0 ]; then apt_packages+=(libopenmpi-dev openmpi-bin); fi
missing=()
for p in "${apt_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# The venv module is a separate package for Debian's own python3.
if ! "$python" -c 'import venv, ensurepip' >/dev/null 2>&1; then missing+=(python3-venv); fi
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    echo "bootstrap: installing system packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
  else
    echo "bootstrap: missing system packages: ${missing[*]}" >&2
    echo "bootstrap: run as root, or: sudo apt-get install ${missing[*]}" >&2
    exit 1
  fi
fi

if [ ! -x "$venv/bin/python" ]; then
  echo "bootstrap: creating virtualenv $venv"
  "$python" -m venv "$venv"
fi
vpy="$venv/bin/python"
# Build and test requirements (PyTorch is a benchmark-only dependency and is
# never installed here).
# DPCORE_OFFLINE=1 (a machine without a registry): use the
# Python packages already there and install dpcore without its dependencies.
if [ "${DPCORE_OFFLINE:-0}" = 1 ]; then
  echo "bootstrap: offline: using the installed Python packages"
  nodeps=--no-deps
else
  # --no-compile: Python writes the .pyc of the modules it imports when it first imports
  # them, rather than pip compiling every module of every package now (a quarter of the time)
  "$vpy" -m pip install -q --disable-pip-version-check --no-compile -r "$here/requirements-dev.txt"
  nodeps=
fi
if [ "${DPCORE_DEPS_ONLY:-0}" = 1 ]; then
  echo "bootstrap: $venv has the requirements (DPCORE_DEPS_ONLY=1: dpcore is not built)"
  exit 0
fi
echo "bootstrap: building and installing dpcore"
"$vpy" -m pip install -q --disable-pip-version-check --no-build-isolation $nodeps "$here"
# A sanitized build (DPCORE_SANITIZE=1, make test-asan) loads only into a Python
# that has the sanitizer runtime preloaded (AddressSanitizer must come first).
preload=
if [ "${DPCORE_SANITIZE:-0}" = 1 ]; then
  preload="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)"
fi
LD_PRELOAD="$preload" ASAN_OPTIONS=detect_leaks=0 \
  "$vpy" -c 'import dpcore, json; print("bootstrap: dpcore", dpcore.__version__, json.dumps(dpcore.build_info()["summary"]))'
