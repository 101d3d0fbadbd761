#!/usr/bin/env bash
# Issue 14 at scale: qwen3-moe-mini trained on two H200s (nvidia-h200-x2),
# the whole model on the GPUs, experts sharded over the two ranks, every
# strategy under one per-GPU memory budget (`--fit-budget`): fixed ownership
# and replication micro-batch to fit it, capacity dropping at the budget's
# factor, LRMoE's controller. Same global batch as the one-GPU table
# (32 sequences × 512 tokens: 16 per rank). One device call per seed list.
#   cargo build --release -p lrmoe --features nccl && cp target/release/lrmoe .device/
# Usage: SEEDS="0 1" TARGET=1.45 STEPS=900 bash benches/mini-compare2.sh
# Then, on the CPU: `python3 benches/replay-vs-run.py lrmoe RUN --budget-bytes B
# --element-bytes 2 --hidden 512 --ffn 256 --tile-trim 0.0625` (the GPU
# executors trim quotas to whole GEMM tiles, `moe.tile_trim`) puts replay's
# predicted buffers beside the measured ones (docs/benchmarks.md).
. "$(dirname "$0")/lib.sh"
for seed in ${SEEDS:-0 1}; do
  S=$(date +%s)
  timeout "${LIMIT:-280}" .device/lrmoe launch --nproc 2 -- train --device cuda --executor device \
    --model-config examples/qwen3-moe-mini.config.json --config examples/qwen3-moe-mini.toml \
    --steps "${STEPS:-900}" --seed "$seed" --compare --modes "${MODES:-full,replicate,lrmoe,capacity}" \
    --fit-budget --target-val-loss "${TARGET:-1.45}" --out "$OUT/mini2-s$seed" --no-progress \
    > "$OUT/mini2-s$seed.log" 2>&1
  echo "seed $seed: rc=$? $(( $(date +%s) - S )) s"
  grep -E "^\||^Target" "$OUT/mini2-s$seed.log"
  grep -iE "error|panicked" "$OUT/mini2-s$seed.log" | head -3
done
