#!/usr/bin/env bash
# Everything that needs the GPU, in one device call: the whole test suite with compiled kernels
# at realistic shapes (pytest --gpu), then the op benchmark (tigon vs eager / compile / Liger).
# Usage (device machine, repo root): OUT=/some/dir bash scripts/gpu_check.sh [benchmark args]
# Peer wheels (Liger) are installed from .whl/ when carried there (../shared/tools/gpu-wheels.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/liger_kernel-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/liger_kernel-*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
status=0
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  python3 -m pytest -q --gpu -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
  status=${PIPESTATUS[0]}
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  python3 -m tigon.bench.ops --out "$OUT" "$@" 2>"$OUT/bench_progress.log" || status=1
fi
exit $status
