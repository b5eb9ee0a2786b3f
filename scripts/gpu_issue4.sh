#!/usr/bin/env bash
# Device call for issue 4's memory target: GPU tests of the tied-embedding path, the Llama-1B
# peak broken down by the allocator trace (MLP slices as given), and the HF vs tigon training run.
# Usage (device machine, repo root, carry .whl): OUT=/some/dir bash scripts/gpu_issue4.sh [tests|trace|train|all|sweep|shapes|profile|labelsync|host] [slice MiB...]
set -uo pipefail
cd "$(dirname "$0")/.."
PART=${1:-all}
shift || true
SLICE_MIB=${*:-16}
source scripts/device_env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
status=0
if [ "$PART" = tests ] || [ "$PART" = all ]; then
  timeout 260 python3 -m pytest -q --gpu -p no:cacheprovider tests/ops/test_embedding.py tests/ops/test_glu.py \
    tests/ops/test_glu_mlp.py tests/ops/test_fused_linear_cross_entropy.py tests/nn tests/integration/test_patching.py \
    2>&1 | tail -6 | tee "$OUT/gpu_tests.log" || status=1
fi
if [ "$PART" = trace ] || [ "$PART" = all ]; then
  for s in $SLICE_MIB; do
    timeout 120 python3 benchmarks/memory_peak.py --shape llama-1b --impl tigon --trace --top 30 --mlp-slice-mib "$s" 2>&1 \
      | grep -v Warning | tee "$OUT/memory_trace_tigon_slice${s}mib.log" || status=1
  done
fi
if [ "$PART" = train ] || [ "$PART" = all ]; then
  timeout 400 python3 benchmarks/train_hf.py --shape llama-1b --impls ${IMPLS:-hf,tigon} --out "$OUT" 2>&1 | grep -v Warning | tee "$OUT/train_llama-1b.log" || status=1
fi
if [ "$PART" = sweep ]; then  # the README's end-to-end tables
  timeout 330 python3 benchmarks/train_hf.py --shape llama-1b --batches 8 16 32 64 --impls hf,tigon,liger --steps 6 \
    --warmup 2 --out "$OUT" 2>&1 | grep -v -i "warn\|backend impl" | tee "$OUT/sweep_llama-1b.log" || status=1
  timeout 90 python3 benchmarks/mlp_slices.py 2>&1 | tee "$OUT/mlp_slices.log" || status=1
  timeout 150 python3 benchmarks/mlp_checkpoint.py 2>&1 | tee "$OUT/mlp_checkpoint.log" || status=1
fi
if [ "$PART" = profile ]; then
  timeout 200 python3 -m pytest -q --gpu -p no:cacheprovider tests/ops/test_embedding.py tests/ops/test_glu_mlp.py tests/nn \
    tests/integration/test_patching.py -k "not family_trains_like_hf" 2>&1 | tail -4 | tee "$OUT/gpu_tests_new.log" || status=1
  timeout 200 python3 benchmarks/profile_step.py --shape llama-1b --top 25 2>&1 | grep -v -i "warn\|backend impl" \
    | tee "$OUT/profile_llama-1b.log" || status=1
fi
if [ "$PART" = labelsync ]; then  # the deferred label check vs the old per-step sync, same machine
  timeout 60 python3 -m pytest -q --gpu -p no:cacheprovider tests/ops/test_cross_entropy.py -k deferred 2>&1 | tail -2
  for run in 1 2; do
    timeout 150 python3 benchmarks/train_hf.py --shape llama-1b --out "$OUT/deferred$run" 2>&1 | grep "batch 8\|/ hf" \
      | tee "$OUT/train_deferred$run.log"
    mkdir -p "$OUT/sync$run"
    timeout 150 python3 -c "
import contextlib, runpy, sys
import tigon.patching.forwards as fw
fw.deferred_label_checks = contextlib.nullcontext  # the label check syncs the host every step, as before
sys.argv = ['train_hf.py', '--shape', 'llama-1b', '--out', '$OUT/sync$run']
runpy.run_path('benchmarks/train_hf.py', run_name='__main__')" 2>&1 | grep "batch 8\|/ hf" | tee "$OUT/train_sync$run.log"
  done
fi
if [ "$PART" = shapes ]; then
  for shape in qwen2.5-0.5b gemma2-2b; do
    timeout 200 python3 benchmarks/train_hf.py --shape $shape --batches 8 16 --impls hf,tigon,liger --steps 6 \
      --warmup 2 --out "$OUT" 2>&1 | grep -v -i "warn\|backend impl" | tee "$OUT/sweep_$shape.log" || status=1
  done
fi
if [ "$PART" = hostbound ]; then  # GPU idle time per step (waiting on the host), HF vs tigon
  timeout 100 python3 benchmarks/host_overhead.py 2>&1 | tee "$OUT/host_overhead.log" || status=1
  timeout 300 python3 benchmarks/host_bound.py --shape llama-1b 2>&1 | grep -v -i "warn\|backend impl" | tee "$OUT/host_bound_llama-1b.log" || status=1
  timeout 200 python3 benchmarks/host_bound.py --shape qwen2.5-0.5b 2>&1 | grep -v -i "warn\|backend impl" | tee "$OUT/host_bound_qwen.log" || status=1
fi
if [ "$PART" = round ]; then  # after a host-cost change: GPU tests of the touched ops, host cost, GPU idle, the issue's run
  timeout 200 python3 -m pytest -q --gpu -p no:cacheprovider tests/ops/test_glu_mlp.py tests/ops/test_rope.py \
    tests/ops/test_rms_norm.py tests/ops/test_fused_linear_cross_entropy.py tests/ops/test_glu.py tests/nn \
    tests/integration/test_patching.py -k "not family_trains_like_hf" 2>&1 | grep -v -i "warn" | tail -25 | tee "$OUT/gpu_tests.log" || status=1
  timeout 100 python3 benchmarks/host_overhead.py 2>&1 | tee "$OUT/host_overhead.log" || status=1
  for shape in llama-1b qwen2.5-0.5b; do
    timeout 200 python3 benchmarks/host_bound.py --shape $shape 2>&1 | grep -v -i "warn\|backend impl" | tee "$OUT/host_bound_$shape.log" || status=1
  done
  timeout 200 python3 benchmarks/train_hf.py --shape llama-1b --out "$OUT" 2>&1 | grep -v Warning | tee "$OUT/train_llama-1b.log" || status=1
fi
if [ "$PART" = ab ]; then  # the issue's run, this tree's tigon vs an older one (baseline/src, carried), same machine
  timeout 150 python3 -m pytest -q --gpu -p no:cacheprovider tests/ops/test_glu_mlp.py tests/ops/test_rope.py \
    tests/ops/test_fused_linear_cross_entropy.py tests/nn tests/integration/test_patching.py \
    -k "not family_trains_like_hf" 2>&1 | grep -E "passed|failed|Error|error" | tail -25 | tee "$OUT/gpu_tests.log" || status=1
  for run in 1 2; do
    timeout 100 python3 benchmarks/train_hf.py --shape llama-1b --impls hf,tigon --out "$OUT/new$run" 2>&1 | grep "batch 8\|/ hf" | tee -a "$OUT/ab.log"
    PYTHONPATH=$PWD/baseline/src:$PYTHONPATH timeout 100 python3 benchmarks/train_hf.py --shape llama-1b --impls tigon \
      --out "$OUT/base$run" 2>&1 | grep "batch 8" | sed 's/^tigon /base  /' | tee -a "$OUT/ab.log"
  done
fi
if [ "$PART" = round2 ]; then  # GPU tests of the touched code, launch costs, the issue's run vs baseline/src, Qwen b8
  timeout 250 python3 -m pytest -q --gpu -p no:cacheprovider -x tests/ops/test_glu_mlp.py tests/ops/test_rope.py \
    tests/ops/test_rms_norm.py tests/ops/test_fused_linear_cross_entropy.py tests/nn tests/integration/test_patching.py \
    -k "not family_trains_like_hf" 2>&1 | grep -E "passed|failed|Error|error" | tail -25 | tee "$OUT/gpu_tests.log"
  timeout 60 python3 benchmarks/host_overhead.py 2>&1 | tee "$OUT/host_overhead.log" || status=1
  timeout 100 python3 benchmarks/train_hf.py --shape llama-1b --impls hf,tigon --out "$OUT/new" 2>&1 | grep "batch 8\|/ hf" | tee -a "$OUT/ab.log"
  PYTHONPATH=$PWD/baseline/src:$PYTHONPATH timeout 80 python3 benchmarks/train_hf.py --shape llama-1b --impls tigon \
    --out "$OUT/base" 2>&1 | grep "batch 8" | sed 's/^tigon /base  /' | tee -a "$OUT/ab.log"
  timeout 100 python3 benchmarks/train_hf.py --shape qwen2.5-0.5b --impls hf,tigon --out "$OUT/qwen" 2>&1 | grep "batch 8\|/ hf" | tee -a "$OUT/ab.log"
fi
if [ "$PART" = gputests ]; then  # the GPU test suite minus the per-family bf16 runs
  timeout 540 python3 -m pytest -q --gpu -p no:cacheprovider tests/ops tests/nn tests/integration/test_patching.py \
    tests/losses -k "not family_trains_like_hf" 2>&1 | grep -E "passed|failed|FAILED|Error" | tail -30 | tee "$OUT/gpu_tests.log"
fi
if [ "$PART" = round3 ]; then  # the cached launch path live: GPU op tests, launch costs, the issue's run vs baseline/src, Qwen b8
  python3 -c "import tigon.ops._common as c; print('fast launch on:', c.fast_launch_enabled() and not c._launch_hooks_set())"
  timeout 250 python3 -m pytest -q --gpu -p no:cacheprovider tests/ops tests/nn 2>&1 | grep -E "passed|failed|FAILED|Error" | tail -30 | tee "$OUT/gpu_tests.log"
  timeout 60 python3 benchmarks/host_overhead.py 2>&1 | tee "$OUT/host_overhead.log" || status=1
  timeout 100 python3 benchmarks/train_hf.py --shape llama-1b --impls hf,tigon --out "$OUT/new" 2>&1 | grep "batch 8\|/ hf" | tee -a "$OUT/ab.log"
  PYTHONPATH=$PWD/baseline/src:$PYTHONPATH timeout 80 python3 benchmarks/train_hf.py --shape llama-1b --impls tigon \
    --out "$OUT/base" 2>&1 | grep "batch 8" | sed 's/^tigon /base  /' | tee -a "$OUT/ab.log"
  timeout 100 python3 benchmarks/train_hf.py --shape qwen2.5-0.5b --impls hf,tigon --out "$OUT/qwen" 2>&1 | grep "batch 8\|/ hf" | tee -a "$OUT/ab.log"
fi
if [ "$PART" = final ]; then  # final code: the rest of the GPU tests, the issue's run with Liger alongside
  timeout 230 python3 -m pytest -q --gpu -p no:cacheprovider tests/ops/test_launch.py tests/integration/test_patching.py \
    tests/losses -k "not family_trains_like_hf" 2>&1 | grep -E "passed|failed|FAILED|Error" | tail -30 | tee "$OUT/gpu_tests.log"
  timeout 200 python3 benchmarks/train_hf.py --shape llama-1b --impls hf,tigon,liger --out "$OUT" 2>&1 | grep -v -i "warn\|backend impl" | tee "$OUT/train_llama-1b.log" || status=1
fi
if [ "$PART" = finalsweep ]; then  # final code: the README's batch sweep, and Qwen2.5-0.5B at batch 8
  timeout 380 python3 benchmarks/train_hf.py --shape llama-1b --batches 8 16 32 64 --impls hf,tigon,liger --steps 6 \
    --warmup 2 --out "$OUT" 2>&1 | grep -v -i "warn\|backend impl" | tee "$OUT/sweep_llama-1b.log" || status=1
  timeout 120 python3 benchmarks/train_hf.py --shape qwen2.5-0.5b --impls hf,tigon --out "$OUT/qwen" 2>&1 | grep "batch 8\|/ hf" | tee "$OUT/qwen_b8.log"
fi
if [ "$PART" = check ]; then  # the profiling scripts after their refactor, the deferred label check, one more issue run
  timeout 60 python3 -m pytest -q --gpu -p no:cacheprovider tests/ops/test_cross_entropy.py -k "deferred or label" 2>&1 | grep -E "passed|failed" | tee "$OUT/gpu_tests.log"
  timeout 90 python3 benchmarks/profile_step.py --shape qwen2.5-0.5b --batch 1 --seq 128 --impls tigon --cprofile 5 --no-torch-profile 2>&1 \
    | grep -v -i "warn\|backend impl" | head -12 | tee "$OUT/profile_step_check.log" || status=1
  timeout 120 python3 benchmarks/host_bound.py --shape llama-1b --repeats 3 2>&1 | grep -v -i "warn\|backend impl" | tee "$OUT/host_bound_llama-1b_final.log" || status=1
  timeout 130 python3 benchmarks/train_hf.py --shape llama-1b --out "$OUT" 2>&1 | grep "batch 8\|/ hf" | tee "$OUT/train_llama-1b.log" || status=1
fi
if [ "$PART" = families ]; then  # every family row in bf16 on the GPU against HF
  timeout 520 python3 -m pytest -v --gpu -p no:cacheprovider tests/integration/test_patching.py -k family_trains_like_hf \
    2>&1 | grep -E "PASSED|FAILED|ERROR|passed|failed|Error" > "$OUT/gpu_family_tests.log"
  grep -c PASSED "$OUT/gpu_family_tests.log"; grep -E "FAILED|ERROR|passed|failed" "$OUT/gpu_family_tests.log" | tail -30
fi
if [ "$PART" = hostprof ]; then  # cProfile of one tigon step at the issue's batch
  for shape in qwen2.5-0.5b llama-1b; do
    timeout 200 python3 benchmarks/profile_step.py --shape $shape --impls tigon --cprofile 60 --no-torch-profile 2>&1 \
      | grep -v -i "warn\|backend impl" > "$OUT/cprofile_$shape.log" || status=1
  done
  tail -c 3000 "$OUT/cprofile_llama-1b.log"
fi
if [ "$PART" = host ]; then  # where the host time of a step goes (tiny batch: wall ~ host time)
  timeout 150 python3 benchmarks/host_overhead.py --profile 2>&1 | tee "$OUT/host_overhead.log" || status=1
  timeout 200 python3 benchmarks/profile_step.py --shape llama-1b --batch 1 --seq 128 --cprofile 45 --no-torch-profile 2>&1 \
    | grep -v -i "warn\|backend impl" | tee "$OUT/host_step_llama-1b_b1.log" || status=1
  timeout 200 python3 benchmarks/train_hf.py --shape llama-1b --out "$OUT" 2>&1 | grep -v Warning | tee "$OUT/train_llama-1b.log" || status=1
fi
exit $status
