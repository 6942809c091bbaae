#!/usr/bin/env bash
# Installs the Debian 12 packages ckptd needs to build and test, skipping the
# ones already present. Used by deploy/quickstart.sh and tests/run.sh.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build pkgconf ccache
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler libabsl-dev
  liburing-dev librocksdb-dev prometheus-cpp-dev libgtest-dev libgmock-dev libbenchmark-dev
  libxxhash-dev nlohmann-json3-dev libsystemd-dev python3 fio
  # the Python module ckpt (pybind11, for /usr/bin/python3)
  pybind11-dev python3-dev
  # tests: PyTorch generates the optimizer golden data and runs ckpt.torch
  # (OpenBLAS keeps it fast), matplotlib draws the fidelity report, promtool
  # checks metrics and alert rules, systemd-analyze lints the unit
  python3-torch python3-numpy libopenblas0-openmp python3-matplotlib prometheus systemd
  # fuzzing (libFuzzer needs clang's runtime)
  clang-14 libclang-rt-14-dev
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install_deps: all ${#PACKAGES[@]} packages present"
  exit 0
fi
echo "install_deps: installing ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
