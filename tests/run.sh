#!/usr/bin/env bash
# Installs what is missing, builds ckptd, and runs every test that is not
# labelled slow or gpu: first in the default build (CUDA used when the toolkit
# is present), then again in a build with -DCKPT_WITH_CUDA=OFF.
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
cd "$top"
export CCACHE_DIR=${CCACHE_DIR:-$HOME/.cache/ckpt-ccache}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
"$top/deploy/install_deps.sh"

echo "== build (CUDA auto-detected)"
"$top/deploy/build.sh" "$top/build"
echo "== tests (default build)"
(cd "$top/build" && ctest -LE 'slow|gpu' --output-on-failure --timeout 900 -j2)

echo "== build without CUDA"
"$top/deploy/build.sh" "$top/build-nocuda" -DCKPT_WITH_CUDA=OFF
echo "== tests (no-CUDA build)"
(cd "$top/build-nocuda" && ctest -LE 'slow|gpu' --output-on-failure --timeout 900 -j2)
