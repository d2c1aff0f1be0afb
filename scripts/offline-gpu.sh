#!/usr/bin/env bash
# Run `make test-gpu` and `make bench-gpu` on a GPU machine that cannot reach a
# package registry but has the CUDA toolkit (nvcc) and a Python with NumPy,
# pytest and safetensors (a PyTorch image, say: its pip wheels carry cuDNN,
# cuBLAS and NCCL).
#
#   scripts/offline-gpu.sh DEBDIR [OUTDIR]
#
# DEBDIR holds the Debian packages bootstrap.sh would install, fetched on a
# machine that can (`apt-get download libopenblas0-openmp libopenblas-openmp-dev
# libopenblas-dev libgfortran5 dataset-fashion-mnist`). They are installed with
# dpkg (libgfortran5 only when the machine has none). When the toolkit has no
# cuDNN or NCCL, a CUDA_HOME is assembled under /tmp from the toolkit and the
# Python's nvidia-* wheels, so that setup.py finds them as it would in
# /usr/local/cuda. Logs go to OUTDIR (default ./gpu-logs).
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
debs=$(cd "${1:?usage: scripts/offline-gpu.sh DEBDIR [OUTDIR]}" && pwd)
out=$(mkdir -p "${2:-$here/gpu-logs}" && cd "${2:-$here/gpu-logs}" && pwd)
py=${PYTHON:-python3}
cd "$here"

{
  echo "== machine"; nvidia-smi 2>&1 | head -15; nvcc --version | tail -2; "$py" -VV
  uname -a; nproc; cat /etc/os-release 2>/dev/null | head -2
} >"$out/machine.txt" 2>&1
cat "$out/machine.txt"

# System packages from DEBDIR.
if ! ldconfig -p | grep -q 'libgfortran.so.5'; then dpkg -i "$debs"/libgfortran5_*.deb; fi
dpkg -i --force-depends "$debs"/libopenblas0-openmp_*.deb "$debs"/libopenblas-openmp-dev_*.deb \
  "$debs"/libopenblas-dev_*.deb "$debs"/dataset-fashion-mnist_*.deb >"$out/dpkg.txt" 2>&1 || {
  echo "offline-gpu: dpkg failed"; tail -20 "$out/dpkg.txt"; }

# A CUDA_HOME with cuDNN, cuBLAS and NCCL in it.
toolkit=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
if [ -e "$toolkit/include/cudnn.h" ] && [ -e "$toolkit/include/nccl.h" ]; then
  export CUDA_HOME=$toolkit
else
  site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  home=/tmp/dpcore-cuda-home
  rm -rf "$home"; mkdir -p "$home/include" "$home/lib64"
  for e in "$toolkit"/*; do
    case $(basename "$e") in include|lib64|lib) ;; *) ln -s "$e" "$home/$(basename "$e")" ;; esac
  done
  ln -s "$toolkit"/include/* "$home/include/"
  tlib=$toolkit/lib64; [ -d "$tlib" ] || tlib=$toolkit/lib
  ln -s "$tlib"/* "$home/lib64/"
  libpath=""
  for pat in 'cudnn*.h' 'nccl*.h' 'cublas*.h'; do
    find "$site/nvidia" -path '*/include/*' -name "$pat" 2>/dev/null | while read -r f; do
      [ -e "$home/include/$(basename "$f")" ] || ln -s "$f" "$home/include/"
    done
  done
  for stem in libcudnn libnccl libcublas libcublasLt; do
    for f in $(find "$site/nvidia" -name "$stem*.so*" 2>/dev/null); do
      d=$(dirname "$f"); case ":$libpath:" in *":$d:"*) ;; *) libpath=$libpath:$d ;; esac
      [ -e "$home/lib64/$(basename "$f")" ] || ln -s "$f" "$home/lib64/"
    done
    if [ ! -e "$home/lib64/$stem.so" ]; then
      v=$(ls "$home/lib64/$stem".so.* 2>/dev/null | sort | head -1)
      [ -n "$v" ] && ln -s "$(readlink -f "$v")" "$home/lib64/$stem.so"
    fi
  done
  export CUDA_HOME=$home
  export LD_LIBRARY_PATH=${libpath#:}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
echo "offline-gpu: CUDA_HOME=$CUDA_HOME LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"

# Open MPI (multi-process training) when the machine has it; otherwise dpcore
# builds without it (DPCORE_MPI=0: bootstrap.sh then asks for no MPI package,
# and the multi-process tests say why they are skipped).
if ! command -v mpicc >/dev/null 2>&1; then
  export DPCORE_MPI=0
  echo "offline-gpu: no mpicc here: building without MPI"
fi

# A virtualenv that sees the machine's Python packages (nothing to download:
# bootstrap.sh installs no requirement, and dpcore without its dependencies).
export DPCORE_OFFLINE=1
export VENV=${VENV:-/tmp/dpcore-venv}
[ -x "$VENV/bin/python" ] || "$py" -m venv --system-site-packages "$VENV"
export PYTHONUNBUFFERED=1
status=0
timeout "${TEST_TIMEOUT:-900}" make test-gpu 2>&1 | tee "$out/test-gpu.log" || status=1
timeout "${BENCH_TIMEOUT:-900}" make bench-gpu BENCH_ARGS="${BENCH_ARGS:-}" 2>&1 | tee "$out/bench-gpu.log" || status=1
cp benchmarks/RESULTS.md "$out/RESULTS.md" 2>/dev/null
exit $status
