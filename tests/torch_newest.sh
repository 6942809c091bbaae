#!/usr/bin/env bash
# Runs the Python tests that matter most across PyTorch releases under the
# newest release on PyPI (deploy/requirements-torch-newest.txt), in a
# virtual environment of its own, .venv-torch-newest (made once per version
# of that file; about 5.4 GB with the CUDA runtime wheels, a minute or two
# to download). The Python module of BUILD (default build/) does not link
# PyTorch, so the same build serves both environments.
#
#   tests/torch_newest.sh [BUILD_DIR]
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${1:-$top/build}" && pwd)
venv=${CKPT_TORCH_NEWEST_VENV:-$top/.venv-torch-newest}
req=$top/deploy/requirements-torch-newest.txt
want=$(sha256sum "$req" | cut -d' ' -f1)
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$venv/.ckpt-requirements" 2>/dev/null)" != "$want" ]; then
  echo "torch_newest: making $venv ($req)"
  rm -rf "$venv"
  "$top/deploy/need_disk.sh" "$venv" 9 "the newest PyTorch's environment (with its CUDA wheels)"
  /usr/bin/python3 -m venv "$venv"
  PIP_CACHE_DIR=${PIP_CACHE_DIR:-$HOME/.cache/ckpt-pip} \
    "$venv/bin/pip" install --quiet --disable-pip-version-check --no-input -r "$req"
  echo "$want" >"$venv/.ckpt-requirements"
fi
echo "torch_newest: PyTorch $("$venv/bin/python" -c 'import torch; print(torch.__version__)')"
for t in test_dcp.py test_dcp_gpu_store.py test_torch_messages.py test_torch_swaps.py; do
  echo "torch_newest: $t"
  CKPT_BUILD_DIR=$build PYTHONPATH=$build/python PYTHONDONTWRITEBYTECODE=1 OMP_NUM_THREADS=1 \
    timeout 900 "$venv/bin/python" "$top/tests/python/$t" >"$build/torch-newest-${t%.py}.log" 2>&1 || {
      echo "torch_newest: $t failed under the newest PyTorch; its log:" >&2
      tail -60 "$build/torch-newest-${t%.py}.log" >&2
      exit 1
    }
done
echo "torch_newest: passed"
