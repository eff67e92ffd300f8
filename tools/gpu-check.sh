#!/usr/bin/env bash
# One-shot GPU check (make gpu-check): run from the repository root on a CUDA machine that has
# python3 with torch (CUDA), numpy, pytest and prometheus-client; no network needed.
#   bash tools/gpu-check.sh                 # results in $OUT (default /tmp/gpu-check)
#   bash tools/gpu-check.sh --cpu-dry-run   # anywhere: only what needs no CUDA
# Wheels in .whl/ (pure-Python extras the machine may lack: pytest-timeout, prometheus-client)
# are installed into /tmp/site first (GPU_CHECK_SITE to change it). Exit status is
# tools/gpu_check.py's: 0 passed, 1 a check failed, 3 out of time.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
SITE="${GPU_CHECK_SITE:-/tmp/site}"
shopt -s nullglob
wheels=(.whl/*.whl)
if ((${#wheels[@]})); then
  mkdir -p "$SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "${wheels[@]}" \
    || echo "gpu-check: warning: installing .whl/*.whl into $SITE failed; going on without" >&2
fi
export PYTHONPATH="$SITE:$PWD/engine:$PWD/operator:$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" tools/gpu_check.py --out "${OUT:-/tmp/gpu-check}" "$@"
