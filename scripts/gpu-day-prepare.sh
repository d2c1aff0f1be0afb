#!/usr/bin/env bash
# Before a GPU day, on a machine with Debian's registry: fetch what the GPU machine lacks and
# cannot download into .gpu/ (git-ignored; it travels with the tree when named), then print
# how to run the day.
#
#   scripts/gpu-day-prepare.sh            the .debs (OpenBLAS, its Fortran runtime, Fashion-MNIST)
#   scripts/gpu-day-prepare.sh --wheels   also NVIDIA's cuDNN / cuBLAS / NCCL wheels into the
#                                         rehearsal's cache (~/.cache/dpcore/gpu-wheels, 1.5 GB;
#                                         never carried: the GPU machine has its own)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
debs=$here/.gpu/debs
packages=(libopenblas0-openmp libopenblas-openmp-dev libgfortran5 libquadmath0 dataset-fashion-mnist)
mkdir -p "$debs"
missing=()
for p in "${packages[@]}"; do ls "$debs/${p}_"*.deb >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  [ -n "$(find /var/lib/apt/lists -maxdepth 1 -name '*Packages*' -print -quit 2>/dev/null)" ] || apt-get update -q >/dev/null
  # apt's _apt user cannot write into a root-owned folder: download as root there, quietly
  (cd "$debs" && apt-get download -q -o APT::Sandbox::User=root "${missing[@]}" >/dev/null)
fi
size=$(du -sm "$here/.gpu" | cut -f1)
tree=$(cd "$here" && git ls-files -z | du -cm --files0-from=- | tail -1 | cut -f1)
if [ $((size + tree)) -ge 64 ]; then
  echo "gpu-day-prepare: .gpu ($size MiB) and the tree ($tree MiB) exceed the 64 MiB that travels" >&2
  exit 1
fi
if [ "${1:-}" = --wheels ]; then
  cache=${GPU_DAY_WHEEL_CACHE:-$HOME/.cache/dpcore/gpu-wheels}
  if [ ! -d "$cache/nvidia" ]; then
    python3 -m pip install -q --disable-pip-version-check --no-deps --target "$cache.tmp" \
      nvidia-cudnn-cu13 nvidia-cublas nvidia-nccl-cu13
    rm -rf "$cache"; mv "$cache.tmp" "$cache"
  fi
  echo "gpu-day-prepare: NVIDIA wheels for the rehearsal in $cache"
fi
cat <<TXT
gpu-day-prepare: .gpu/ holds $(ls "$debs" | wc -l) .debs, $size MiB (the tree: $tree MiB; 64 MiB travel)
On the GPU machine, from the repository root, with .gpu carried beside the tree:
    scripts/gpu-day.sh            (OUTDIR defaults to \$OUT)
Give it 510 s (it plans for 450: build, tests by priority, benchmark, memcheck); only OUTDIR's
files come back: summary.txt, build.log, tests.log, bench.log, memcheck.log, junit.tar.gz,
RESULTS-gpu.md (and also.log with --also CMD). Rehearse it here first: scripts/gpu-day.sh --rehearse /tmp/gpu-day-out
TXT
