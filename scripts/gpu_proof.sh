#!/usr/bin/env bash
# Device calls for the committed proof (benchmarks/results/<gpu>/): `tigon env`, the timed
# `tigon bench --quick`, `tigon demo`, the op sweeps (in two parts: one device call is 10
# minutes at most), the chunked losses and the end-to-end batch sweep.
# Usage (device machine, repo root; carry .whl with liger-kernel and cut-cross-entropy):
#   OUT=/some/dir bash scripts/gpu_proof.sh quick|ops-a|ops-b|flce|train|shapes   (several: one after the other)
# Merge the op parts afterwards: python -m tigon.bench.ops --merge A B --out DIR
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh
tigon() { python3 -m tigon_cli "$@"; }
status=0
for part in "${@:-quick}"; do
case "$part" in
  quick)
    tigon env | tee "$OUT/env.txt"
    start=$(date +%s)
    tigon bench --quick --out "$OUT/bench_quick" > "$OUT/bench_quick.log" || status=1
    echo "tigon bench --quick: $(( $(date +%s) - start )) s" | tee -a "$OUT/bench_quick.log"
    tail -3 "$OUT/bench_quick.log"
    [ "${SKIP_DEMO:-0}" = 1 ] || tigon demo --out "$OUT/demo" --no-progress 2>&1 | grep -v -i warn | tee "$OUT/demo.log" || status=1
    ;;
  ops-a)
    tigon bench rms_norm layer_norm fused_add_rms_norm swiglu geglu rope swiglu_mlp --out "$OUT/ops_a" \
      > "$OUT/ops_a.log" || status=1
    tail -2 "$OUT/ops_a.log"
    ;;
  flce)  # the loss cases again, each in its own process
    python3 -m tigon.bench.ops --ops fused_linear_cross_entropy --shapes ${FLCE_SHAPES:-} --out "$OUT/ops_flce" \
      > "$OUT/ops_flce.log" || status=1
    tail -2 "$OUT/ops_flce.log"
    ;;
  ops-b)
    tigon bench cross_entropy fused_linear_cross_entropy --out "$OUT/ops_b" > "$OUT/ops_b.log" || status=1
    tail -2 "$OUT/ops_b.log"
    ;;
  train)
    timeout 170 python3 benchmarks/bench_losses.py --out "$OUT" 2>&1 | tee "$OUT/bench_losses.log" || status=1
    timeout 330 python3 benchmarks/train_hf.py --shape llama-1b --batches 8 16 32 64 --impls hf,tigon,liger \
      --steps 6 --warmup 2 --out "$OUT" 2>&1 | grep -v -i warn | tee "$OUT/train_sweep.log" || status=1
    ;;
  shapes)  # more end-to-end shapes (Qwen, Gemma, an 8B)
    timeout 140 python3 benchmarks/train_hf.py --shape qwen2.5-0.5b --batches 8 16 32 --impls hf,tigon,liger \
      --steps 6 --warmup 2 --out "$OUT" 2>&1 | grep -v -i warn | tee "$OUT/train_qwen.log" || status=1
    timeout 180 python3 benchmarks/train_hf.py --shape gemma2-2b --batches 4 8 16 --impls hf,tigon,liger \
      --steps 6 --warmup 2 --out "$OUT" 2>&1 | grep -v -i warn | tee "$OUT/train_gemma.log" || status=1
    timeout 240 python3 benchmarks/train_hf.py --shape llama-8b --batches 1 2 --impls hf,tigon \
      --steps 4 --warmup 2 --out "$OUT" 2>&1 | grep -v -i warn | tee "$OUT/train_8b.log" || status=1
    ;;
esac
done
# At most 8 files come back from a device call: everything in one archive.
(cd "$OUT" && tar czf /tmp/results.tgz . && find . -mindepth 1 -delete && mv /tmp/results.tgz results.tgz)
exit $status
