#!/usr/bin/env bash
# Device call for the end-to-end numbers (issues 4 and 6): GPU tests of the MLP and the losses,
# the Llama-1B training comparison, its memory breakdown, and the chunked-loss benchmark.
# Usage (device machine, repo root; carry .whl with liger-kernel and, for TRL, trl / datasets /
# dill / multiprocess): OUT=/some/dir bash scripts/gpu_train_and_losses.sh [train|losses|all]
set -uo pipefail
cd "$(dirname "$0")/.."
PART=${1:-all}
source scripts/device_env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
status=0
if [ "$PART" = train ] || [ "$PART" = all ]; then
  timeout 120 python3 -m pytest -q --gpu -p no:cacheprovider tests/ops/test_glu.py 2>&1 | tail -3 || status=1
  timeout 240 python3 benchmarks/train_hf.py --shape llama-1b --out "$OUT" 2>&1 | grep -v Warning | tee "$OUT/train_llama-1b.log" || status=1
  timeout 120 python3 benchmarks/memory_peak.py --shape llama-1b --impl tigon 2>&1 | tee "$OUT/memory_peak_tigon.log" || status=1
fi
if [ "$PART" = losses ] || [ "$PART" = all ]; then
  timeout 300 python3 benchmarks/bench_losses.py --out "$OUT" 2>&1 | tee "$OUT/bench_losses.log" || status=1
  timeout 300 python3 -m pytest -q --gpu -p no:cacheprovider tests/losses tests/ops/test_linear_token_logps.py tests/ops/test_jsd.py 2>&1 | tail -5 | tee "$OUT/gpu_loss_tests.log" || status=1
  timeout 180 python3 examples/dpo_with_trl.py 2>&1 | grep -v -i warn | tail -20 | tee "$OUT/dpo_with_trl.log" || status=1
fi
exit $status
