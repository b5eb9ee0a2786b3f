#!/usr/bin/env bash
# Everything that needs the GPU, in one device call: the whole test suite with compiled kernels
# at realistic shapes (pytest --gpu), then the op benchmark (tigon vs eager / compile / Liger).
# Usage (device machine, repo root): OUT=/some/dir bash scripts/gpu_check.sh [benchmark args]
# (TEST_ARGS="-k ..." narrows the tests, TEST_ARGS=--exhaustive runs every combination,
# TEST_ARGS="--part 1/2" then "--part 2/2" splits the suite over two device calls (one call's 10
# minutes do not hold it on 12 workers); with pytest-timeout carried, a test running past
# TEST_TIMEOUT seconds (default 240) fails with every thread's stack instead of holding the run;
# GPU_WORKERS=n runs the tests in n processes sharing the GPU, default 12: they are mostly Triton
# compiles, which use the CPU; SKIP_TESTS=1 / SKIP_BENCH=1 skip a half.)
# Peer wheels (Liger, CCE) are installed from .whl/ when carried there (../shared/tools/gpu-wheels.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
status=0
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout_arg=""
  python3 -c "import pytest_timeout" 2>/dev/null && timeout_arg="--timeout=${TEST_TIMEOUT:-240}"
  TIGON_TEST_LOG="$OUT/gpu_test_log.tsv" python3 -m pytest $timeout_arg -q --gpu -p no:cacheprovider -n "${GPU_WORKERS:-12}" --dist worksteal --durations=15 tests \
    ${TEST_ARGS:-} 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
  status=${PIPESTATUS[0]}
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  python3 -m tigon.bench.ops --out "$OUT" "$@" 2>"$OUT/bench_progress.log" || status=1
fi
exit $status
