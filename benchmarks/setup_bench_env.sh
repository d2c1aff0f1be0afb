#!/usr/bin/env bash
# The benchmark-only virtualenv benchmarks/.venv-bench (git-ignored): PyTorch, numpy
# and dpcore, for benchmarks/bench_lenet_cpu.py. PyTorch is a benchmark-only
# dependency: dpcore itself never needs it. Idempotent: a second run skips what is
# there and only rebuilds dpcore.
#
#   benchmarks/setup_bench_env.sh                 # venv + torch + dpcore
#   SKIP_DPCORE=1 benchmarks/setup_bench_env.sh   # venv + torch only
#   TORCH_SPEC='torch==2.x.y' PYTHON=python3.11 VENV_BENCH=/path benchmarks/setup_bench_env.sh
#
# How torch is installed: plain `pip install torch` from PyPI (the only index this
# workplace reaches; the CPU-only wheels live elsewhere). The Linux wheel (~540 MB)
# pulls ~2.5 GB of nvidia-*/cuda-*/triton wheels; the venv ends up ~5.4 GB, and it
# took ~2 minutes here (~30 MB/s). `pip install --no-deps torch` does NOT work: the
# import fails on the missing CUDA libraries (libcufile.so.0 first). On a machine
# with no GPU the CUDA build runs on the CPU (MKL + oneDNN, OpenMP threads).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
venv=${VENV_BENCH:-$here/.venv-bench}
python=${PYTHON:-python3}
torch_spec=${TORCH_SPEC:-torch==2.15.0}

# System packages dpcore builds and runs with (as scripts/bootstrap.sh installs them).
apt_packages=(libopenblas-openmp-dev dataset-fashion-mnist)
missing=()
for p in "${apt_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    echo "setup_bench_env: installing system packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
  else
    echo "setup_bench_env: missing system packages: ${missing[*]} (sudo apt-get install ${missing[*]})" >&2
    exit 1
  fi
fi

if [ ! -x "$venv/bin/python" ]; then
  echo "setup_bench_env: creating virtualenv $venv"
  "$python" -m venv "$venv"
fi
vpy="$venv/bin/python"
pip() { "$vpy" -m pip --disable-pip-version-check "$@"; }

# dpcore's build requirements (pyproject.toml), for --no-build-isolation below.
pip install -q "setuptools>=64" wheel "numpy>=1.24"

if "$vpy" -c 'import torch' >/dev/null 2>&1; then
  echo "setup_bench_env: torch already installed"
else
  echo "setup_bench_env: pip install $torch_spec (about 3 GB to download: the wheel and its nvidia-* dependencies)"
  pip install -q "$torch_spec"
fi
"$vpy" -c 'import torch; print("setup_bench_env: torch", torch.__version__, "threads", torch.get_num_threads(), "mkldnn", torch.backends.mkldnn.is_available())'

if [ "${SKIP_DPCORE:-0}" = 1 ]; then
  echo "setup_bench_env: SKIP_DPCORE=1: dpcore not installed"
  exit 0
fi
echo "setup_bench_env: building and installing dpcore into $venv"
cd "$repo"
# --force-reinstall --no-deps: always rebuild dpcore from the work tree, touch nothing else.
if ! pip install -q --no-build-isolation --force-reinstall --no-deps .; then
  echo "setup_bench_env: dpcore did not build; torch is installed (bench_lenet_cpu.py --framework torch works)" >&2
  exit 3
fi
(cd "$here" && "$vpy" -c 'import dpcore; print("setup_bench_env: dpcore", dpcore.__version__)')
