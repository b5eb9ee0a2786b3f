#!/usr/bin/env bash
# Device calls that regenerate benchmarks/results/<gpu>/ (see its README): each part writes the
# folder of the same name under $OUT, as committed there.
# Usage (device machine, repo root; carry .whl with liger-kernel and cut-cross-entropy):
#   OUT=/some/dir bash scripts/gpu_proof.sh quick|demo|ops-a|ops-b|losses|train|sweep|host|shapes|
#                                            compile-check|compile-profile|compile-llama-ab|launch-check|
#                                            compile-qwen|compile-llama|
#                                            e2e-eager|e2e-compiled|e2e-class|e2e-graphs|
#                                            catalogue|moe|torchtune|tests
#   (several: one after the other; one device call runs 10 minutes at most, so ops-a and ops-b
#   are separate calls). Merge the op halves afterwards (no GPU):
#   python -m tigon.bench.ops --merge ops_a ops_b --out ops
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh
tigon() { python3 -m tigon "$@"; }
train_hf() { python3 benchmarks/train_hf.py "$@" 2>&1 | grep -v -i "warn\|backend impl"; }
status=0
for part in "${@:-quick}"; do
case "$part" in
  quick)  # the environment, and `tigon bench --quick` with its wall time
    tigon env | tee "$OUT/env.txt"
    mkdir -p "$OUT/quick"
    start=$(date +%s)
    tigon bench --quick --out "$OUT/quick" > "$OUT/quick/bench_quick.log" || status=1
    echo "tigon bench --quick: $(( $(date +%s) - start )) s" | tee -a "$OUT/quick/bench_quick.log"
    ;;
  demo)
    mkdir -p "$OUT/demo"
    tigon demo --out "$OUT/demo" --no-progress 2>&1 | grep -v -i warn | tee "$OUT/demo/demo.log" || status=1
    ;;
  ops-a)
    tigon bench rms_norm layer_norm fused_add_rms_norm swiglu geglu rope swiglu_mlp --out "$OUT/ops_a" || status=1
    ;;
  ops-b)
    tigon bench cross_entropy fused_linear_cross_entropy --out "$OUT/ops_b" || status=1
    ;;
  catalogue)  # the op catalogue of issue 21 (OPS: a subset, for one device call)
    tigon bench ${OPS:-softmax sparsemax kl_div tvd group_norm dyt poly_norm relu_squared relu_squared_mlp tiled_mlp vocab_parallel_cross_entropy} \
      --out "$OUT/catalogue" || status=1
    ;;
  moe)  # the fused MoE experts against HF's expert loop, HF's grouped_mm path and Liger's fused MoE
    mkdir -p "$OUT/moe"
    timeout ${MOE_TIMEOUT:-420} python3 benchmarks/bench_moe.py --out "$OUT/moe" 2>&1 | grep -v -i warn \
      | tee "$OUT/moe/bench_moe.log" || status=1
    ;;
  losses)
    mkdir -p "$OUT/losses"
    timeout 420 python3 benchmarks/bench_losses.py --losses dpo orpo jsd grpo --out "$OUT/losses" 2>&1 | tee "$OUT/losses/bench_losses.log" || status=1
    # tigon's DPO loss inside TRL's DPOTrainer (carry trl, datasets, dill, multiprocess in .whl)
    timeout 180 python3 examples/dpo_with_trl.py 2>&1 | grep -v -i warn | tail -20 \
      | tee "$OUT/losses/dpo_with_trl.log" || status=1
    # tigon's GRPO loss inside TRL's GRPOTrainer, side by side with TRL's own (same weights, data, seed)
    for run in "dapo" "dapo --fp32" "grpo --fp32" "cispo --fp32"; do
      timeout 120 python3 examples/grpo_with_trl.py --loss-type $run 2>&1 | grep -v -i warn | tail -9 \
        | tee -a "$OUT/losses/grpo_with_trl.log" || status=1
    done
    ;;
  train)  # Llama-3.2-1B shape at batch 8 (HF, tigon, Liger), Qwen2.5-0.5B at batch 8 (HF, tigon)
    mkdir -p "$OUT/train"
    timeout 250 train_hf --shape llama-1b --impls hf,tigon,liger --out "$OUT/train" \
      | tee "$OUT/train/train_llama-1b.log" || status=1
    timeout 150 train_hf --shape qwen2.5-0.5b --impls hf,tigon --out "$OUT/train" || status=1
    ;;
  sweep)  # the Llama-3.2-1B shape's batch sweep
    mkdir -p "$OUT/train"
    timeout 400 train_hf --shape llama-1b --batches 8 16 32 64 --impls hf,tigon,liger --steps 6 --warmup 2 \
      --out "$OUT/train" | tee "$OUT/train/train_llama-1b_batch_sweep.log" || status=1
    ;;
  host)  # host cost per op call, and GPU idle per training step
    mkdir -p "$OUT/host"
    timeout 120 python3 benchmarks/tuning/host_overhead.py 2>&1 | tee "$OUT/host/host_overhead.log" || status=1
    timeout 300 python3 benchmarks/tuning/host_bound.py --shape llama-1b --repeats 3 2>&1 \
      | grep -v -i "warn\|backend impl" | tee "$OUT/host/host_bound_llama-1b.log" || status=1
    ;;
  shapes)  # batch sweeps of more shapes (Qwen, Gemma, an 8B)
    mkdir -p "$OUT/train"
    timeout 150 train_hf --shape qwen2.5-0.5b --batches 8 16 32 --impls hf,tigon,liger --steps 6 --warmup 2 \
      --out "$OUT/train" | tee "$OUT/train/train_qwen2.5-0.5b_batch_sweep.log" || status=1
    timeout 200 train_hf --shape gemma2-2b --batches 4 8 16 --impls hf,tigon,liger --steps 6 --warmup 2 \
      --out "$OUT/train" | tee "$OUT/train/train_gemma2-2b_batch_sweep.log" || status=1
    timeout 240 train_hf --shape llama-8b --batches 1 2 --impls hf,tigon --steps 4 --warmup 2 \
      --out "$OUT/train" | tee "$OUT/train/train_llama-8b_batch_sweep.log" || status=1
    ;;
  compile-check)  # torch.compile tests on the GPU (Inductor, CUDA graphs), host cost per op call
    mkdir -p "$OUT/compile"
    timeout ${TEST_TIMEOUT:-540} python3 -m pytest -q --gpu -p no:cacheprovider tests/integration/test_compile.py \
      > "$OUT/compile/gpu_compile_tests.log" 2>&1 || status=1
    tail -5 "$OUT/compile/gpu_compile_tests.log"
    timeout 60 python3 benchmarks/tuning/host_overhead.py 2>&1 | tee "$OUT/compile/host_overhead.log" || status=1
    ;;
  compile-profile)  # where a compiled step's time goes at a small batch: HF + compile vs tigon + compile
    mkdir -p "$OUT/compile"
    timeout ${PROFILE_TIMEOUT:-300} python3 benchmarks/tuning/profile_step.py --shape qwen2.5-0.5b --batch 16 --seq 512 \
      --impls hf+compile,tigon+compile --cprofile 30 2>&1 | grep -v -i "warn\|backend impl" \
      | tee "$OUT/compile/profile_qwen_batch16_cprofile.log" || status=1
    timeout ${PROFILE_TIMEOUT:-300} python3 benchmarks/tuning/profile_step.py --shape qwen2.5-0.5b --batch 16 --seq 512 \
      --impls tigon+compile,tigon --op-host-time --no-torch-profile 2>&1 | grep -v -i "warn\|backend impl" \
      | tee "$OUT/compile/profile_op_host_time_batch16.log" || status=1
    ;;
  compile-llama-ab)  # the compiled Llama-3.2-1B step at batch 64 (how e4035e7's fp64 arguments were
    # found, results/h200/compile): kernel time and top kernels per variant (AB: triton_ops
    # on/off : MLP slice budget MiB : private APIs on/off, the last one the causal_mask patch), and
    # eager tigon for reference (EAGER=0 skips it)
    mkdir -p "$OUT/compile"
    for variant in ${AB:-1:512:1 0:512:1 1:128:1 0:128:1}; do
      IFS=: read -r ops mib private <<< "$variant"
      TIGON_TRITON_OPS=$ops TIGON_PRIVATE_APIS=$private timeout ${PROFILE_TIMEOUT:-170} python3 \
        benchmarks/tuning/profile_step.py --shape llama-1b --batch 64 --seq 512 --impls tigon+compile \
        --mlp-slice-budget-mib $mib 2>&1 | grep -v -i "warn\|backend impl" \
        | sed "s/^/TIGON_TRITON_OPS=$ops slices=${mib}MiB TIGON_PRIVATE_APIS=$private /" \
        | tee -a "$OUT/compile/profile_llama_batch64_ab.log" || status=1
    done
    if [ "${EAGER:-1}" = 1 ]; then
      timeout ${PROFILE_TIMEOUT:-170} python3 benchmarks/tuning/profile_step.py --shape llama-1b --batch 64 --seq 512 \
        --impls tigon 2>&1 | grep -v -i "warn\|backend impl" | sed "s/^/eager /" \
        | tee -a "$OUT/compile/profile_llama_batch64_ab.log" || status=1
    fi
    ;;
  launch-check)  # host cost per call before/after (scratch/baseline/src: an older commit, when carried)
    # and the cached launcher's end-to-end effect (TIGON_FAST_LAUNCH=0 / 1)
    mkdir -p "$OUT/compile"
    if [ -d scratch/baseline/src ]; then
      PYTHONPATH=$PWD/scratch/baseline/src:$PYTHONPATH timeout 60 python3 scratch/baseline/benchmarks/tuning/host_overhead.py \
        2>&1 | tee "$OUT/compile/host_overhead_baseline.log" || status=1
    fi
    for fast in 1 0; do
      TIGON_FAST_LAUNCH=$fast timeout 90 python3 benchmarks/train_hf.py --shape qwen2.5-0.5b --batch 16 --seq 512 --impls tigon --steps 20 \
        2>&1 | grep "batch 16" | sed "s/^/TIGON_FAST_LAUNCH=$fast /" | tee -a "$OUT/compile/fast_launch.log" || status=1
    done
    ;;
  compile-qwen|compile-llama)  # the batch sweep of HF, Liger and tigon, each eager and compiled
    # (IMPLS: a subset, for a shape whose sweep outlasts one device call; join the JSONs with
    # train_hf.py --merge; COMPILE_MODE=reduce-overhead: CUDA graphs. A whole-model compile takes
    # ~100-110 s at the Qwen shape on an H200, so about four compiled implementations fit a call)
    shape=$([ "$part" = compile-qwen ] && echo qwen2.5-0.5b || echo llama-1b)
    mkdir -p "$OUT/train"
    timeout ${SWEEP_TIMEOUT:-570} python3 benchmarks/train_hf.py --shape "$shape" --seq 512 \
      --batches ${BATCHES:-16 32 64 128 256 512} --impls ${IMPLS:-tigon+compile,hf+compile,tigon,liger,hf,liger+compile} \
      --isolate --warmup 2 --timed-tokens ${TIMED_TOKENS:-49152} ${COMPILE_MODE:+--compile-mode $COMPILE_MODE} \
      --out "$OUT/train" 2>&1 | grep -v -i "warn\|backend impl" \
      | tee "$OUT/train/train_${shape}_compile_sweep.log" || status=1
    ;;
  e2e-eager|e2e-compiled|e2e-graphs|e2e-class)  # issue 38's end-to-end table: its runs dealt out
    # over the machine's GPUs (run side by side, each GPU's share one after the other): eager batch
    # sweeps of both shapes, the Llama sequence sweep, the host-cost table and the GPU tests in TESTS;
    # compiled batch sweeps (HF and tigon's instance patch; e2e-class: tigon's class patch and
    # Liger); CUDA graphs (reduce-overhead) at batch 16. Join a shape's JSONs with train_hf.py --merge.
    mkdir -p "$OUT/e2e"
    llama="--shape llama-1b --batches 16 32 64 128 256 512"
    qwen="--shape qwen2.5-0.5b --batches 16 32 64 128 256 512 1024"
    graphs="--batch 16 --compile-mode reduce-overhead"
    runs=()  # "NAME|train_hf.py arguments", or "NAME|!shell command"
    case "$part" in
      e2e-eager) runs=("llama_eager|$llama --impls hf,liger,tigon-class,tigon"
                       "qwen_eager|$qwen --impls hf,liger,tigon-class,tigon"
                       "llama_seq_eager|--shape llama-1b --batch 4 --seqs 512 1024 2048 4096 8192 16384 32768 --impls hf,liger,tigon"
                       "host|!python3 -m tigon bench --host --out $OUT/e2e/host"
                       "gpu_tests|!python3 -m pytest -q --gpu -p no:cacheprovider -n 4 ${TESTS:-tests/ops/test_rope.py}") ;;
      e2e-compiled) runs=("llama_compiled|$llama --impls hf+compile,tigon+compile"
                          "qwen_compiled|$qwen --impls hf+compile,tigon+compile") ;;
      e2e-class) runs=("llama_compiled_class|$llama --impls tigon-class+compile,liger+compile"
                       "qwen_compiled_class|$qwen --impls tigon-class+compile,liger+compile") ;;
      e2e-graphs) runs=("llama_graphs|--shape llama-1b $graphs --impls hf+compile,tigon+compile"
                        "qwen_graphs|--shape qwen2.5-0.5b $graphs --impls hf+compile,tigon+compile") ;;
    esac
    n_gpus=$(nvidia-smi -L | wc -l)
    deadline=$(( $(date +%s) + ${SWEEP_TIMEOUT:-540} ))
    for ((gpu = 0; gpu < n_gpus; gpu++)); do
      (
        export CUDA_VISIBLE_DEVICES=$gpu TORCHINDUCTOR_COMPILE_THREADS=$(( $(nproc) / n_gpus ))
        for ((i = gpu; i < ${#runs[@]}; i += n_gpus)); do
          name=${runs[i]%%|*} what=${runs[i]#*|}
          left=$(( deadline - $(date +%s) ))
          [ "$left" -gt 10 ] || { echo "no time left for $name" >> "$OUT/e2e/skipped.log"; continue; }
          if [ "${what:0:1}" = "!" ]; then
            timeout "$left" bash -c "${what:1}" > "$OUT/e2e/$name.log" 2>&1
          else
            timeout "$left" python3 benchmarks/train_hf.py --isolate --seq 512 --warmup 2 \
              --timed-tokens ${TIMED_TOKENS:-49152} --out "$OUT/e2e/$name" $what > "$OUT/e2e/$name.log" 2>&1
          fi
        done
      ) &
    done
    wait
    ;;
  torchtune)  # the torchtune + torch.compile study (carry torchtune and its wheels, see its README
    # section); IMPLS: a subset (one device call runs about two), joined with train_torchtune.py --merge
    mkdir -p "$OUT/torchtune"
    timeout ${SWEEP_TIMEOUT:-560} python3 benchmarks/train_torchtune.py --isolate \
      --impls ${IMPLS:-torchtune,torchtune+compile,liger+compile,tigon+compile} \
      --batches ${BATCHES:-16 32 64 128 256 512 1024} --timed-tokens ${TIMED_TOKENS:-32768} \
      --curve-batch 128 --curve-steps 30 --lr 3e-4 ${PROFILE_BATCH:+--profile-batch $PROFILE_BATCH --profile-dir $OUT/torchtune} \
      --out "$OUT/torchtune" 2>&1 | grep -v -i "warn\|Packing" \
      | tee "$OUT/torchtune/train_torchtune.log" || status=1
    ;;
  tests)  # GPU runs of the test files or node ids in TESTS
    mkdir -p "$OUT/tests"
    timeout ${TEST_TIMEOUT:-540} python3 -m pytest -q --gpu -p no:cacheprovider $TESTS \
      > "$OUT/tests/gpu_tests.log" 2>&1 || status=1
    tail -15 "$OUT/tests/gpu_tests.log"
    ;;
  *)
    echo "unknown part: $part" >&2
    status=2
    ;;
esac
done
# At most 8 files come back from a device call: everything in one archive.
(cd "$OUT" && tar czf /tmp/results.tgz . && find . -mindepth 1 -delete && mv /tmp/results.tgz results.tgz)
exit $status
