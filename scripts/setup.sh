#!/usr/bin/env bash
# Installs what gpipe needs from Debian 12's packages (when missing) and
# configures and builds the project in build/. Sourced by train.sh and test.sh.
set -euo pipefail

packages=(
  build-essential cmake
  clang-format          # clang-format 14, for scripts/format.sh
  libtorch-dev          # LibTorch 1.13.1 (CPU)
  libopenblas0-openmp   # without it LibTorch uses the far slower reference BLAS
  libgloo-dev           # c10d's Gloo headers
  libgtest-dev libbenchmark-dev
  libcli11-dev nlohmann-json3-dev libfmt-dev zlib1g-dev
  dataset-fashion-mnist # /usr/share/datasets/fashion-mnist
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "installing: ${missing[*]}"
  sudo_cmd=()
  [[ $(id -u) -eq 0 ]] || sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# A unity build (CMake compiles the sources of each target in batches, one
# translation unit per batch): LibTorch's headers take most of each file's
# compile time, and are read once per batch instead of once per file. An
# edit then rebuilds its whole batch; for builds file by file, configure a
# directory of your own without it (the README's build section).
cmake -S "$root" -B "$root/build" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_UNITY_BUILD=ON
# JOBS: build parallelism (default: every core).
cmake --build "$root/build" -j "${JOBS:-$(nproc)}"
