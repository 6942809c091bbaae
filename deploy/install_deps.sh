#!/usr/bin/env bash
# Installs what ckptd needs to build and test, skipping what is present:
#   1. Debian 12 packages (apt);
#   2. the project's Python environment: a virtual environment (default
#      <repo>/.venv, or $CKPT_VENV) made with Debian's /usr/bin/python3, with
#      the pinned packages of deploy/requirements.txt from PyPI (PyTorch 2.x
#      and its CUDA runtime wheels: about 6.7 GB, a few minutes to download;
#      pip's cache is $PIP_CACHE_DIR, default ~/.cache/ckpt-pip). The Python
#      module is built for this interpreter (deploy/build.sh).
# CKPT_NO_VENV=1 skips step 2 (the Python module and its tests are then
# built for /usr/bin/python3 and skipped where torch is missing).
# Used by deploy/quickstart.sh and tests/run.sh.
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)

PACKAGES=(
  build-essential cmake ninja-build pkgconf ccache
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler libabsl-dev
  liburing-dev librocksdb-dev prometheus-cpp-dev libgtest-dev libgmock-dev libbenchmark-dev
  libxxhash-dev nlohmann-json3-dev libsystemd-dev python3 fio
  # the Python module ckpt (pybind11) and the project's virtual environment
  pybind11-dev python3-dev python3-venv python3-pip
  # tests: promtool checks metrics and alert rules, systemd-analyze lints the
  # unit (PyTorch and matplotlib come from PyPI into the virtual environment)
  prometheus systemd
  # fuzzing (libFuzzer needs clang's runtime)
  clang-14 libclang-rt-14-dev
  # tests/lint: every C++ source formatted as .clang-format says
  clang-format-14
  # the remote tier: S3 over libcurl with OpenSSL (SigV4); the tests run a
  # real one-node Ceph cluster with radosgw and compare the signer with
  # botocore's
  libcurl4-openssl-dev libssl-dev
  ceph-mon ceph-osd radosgw ceph-common uuid-runtime python3-boto3
  # the peer tier's tests: nodes as network namespaces (ip, tc), their
  # certificates (openssl), metrics scraped inside a namespace (curl)
  iproute2 openssl curl
)

install_packages() {
  local missing=()
  for p in "${PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
      missing+=("$p")
    fi
  done
  if [ ${#missing[@]} -eq 0 ]; then
    echo "install_deps: all ${#PACKAGES[@]} packages present"
    return
  fi
  echo "install_deps: installing ${missing[*]}"
  local sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
}

# The virtual environment is current when it was made from these very
# requirements files (their hash is kept inside it).
install_venv() {
  local venv=${CKPT_VENV:-$top/.venv}
  local req=$top/deploy/requirements.txt
  local nodeps=$top/deploy/requirements-nodeps.txt
  local want
  want=$(cat "$req" "$nodeps" | sha256sum | cut -d' ' -f1)
  if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/.ckpt-requirements" 2>/dev/null)" = "$want" ]; then
    echo "install_deps: Python environment $venv is current"
    return
  fi
  echo "install_deps: making the Python environment $venv (deploy/requirements.txt)"
  local start=$SECONDS
  # 7.1 GB installed, and the downloaded wheels until pip is done.
  "$top/deploy/need_disk.sh" "$venv" 11 "the Python environment (PyTorch with its CUDA wheels)"
  /usr/bin/python3 -m venv "$venv"
  export PIP_CACHE_DIR=${PIP_CACHE_DIR:-$HOME/.cache/ckpt-pip}
  "$venv/bin/pip" install --quiet --disable-pip-version-check --no-input -r "$req"
  "$venv/bin/pip" install --quiet --disable-pip-version-check --no-input --no-deps -r "$nodeps"
  echo "$want" >"$venv/.ckpt-requirements"
  echo "install_deps: Python environment ready in $((SECONDS - start)) s"
}

install_packages
if [ "${CKPT_NO_VENV:-0}" != 1 ]; then install_venv; fi
