#!/bin/bash
# One H200: the device model's dense parts (issue 31) beside PyTorch's, in
# the same call. lrmoe trains two layers of the Qwen3-30B-A3B shape (8 ×
# 2048 tokens, exact backward) with `LRMOE_PARTS=1` (CUDA events at every
# part boundary); benches/torch_parts.py then times each dense part the way
# plain PyTorch does it at the same shapes, eager and compiled, in the
# precision of lrmoe (f32 masters and moments) and all bf16; parts.py prints
# the table: ours, PyTorch's, the device limit, and the ratios.
# SHAPE=mini runs qwen3-moe-mini (4 layers, 32 × 512) instead.
# WORKSPACES="0 32" then runs lrmoe's parts again with each cuBLAS workspace
# (`LRMOE_CUBLAS_WORKSPACE_MIB`, MiB; 0 is cuBLAS's own default), alternated
# twice, and prints the GEMM parts of each (the A/B of issue 31's
# projections: PyTorch gives cuBLAS 32 MiB on Hopper).
# Files: $OUT/parts-SHAPE.log (lrmoe's stderr), torch-parts-SHAPE-*.jsonl,
# parts-SHAPE.md (the table).
# Build here and carry .device/:
#   cargo build --release -p lrmoe --features cuda && cp target/release/lrmoe .device/
. "$(dirname "$0")/lib.sh"
need .device/lrmoe
gpu_info
case ${SHAPE:-a3b2} in
  a3b2) cfg=examples/qwen3-30b-a3b.config.json layers=2 seq=2048 batch=8 steps=${STEPS:-20} ;;
  mini) cfg=examples/qwen3-moe-mini.config.json layers=4 seq=512 batch=32 steps=${STEPS:-40} ;;
  *) echo "SHAPE is a3b2 or mini"; exit 2 ;;
esac
tag=parts-${SHAPE:-a3b2}
exact_toml "$tag" "$steps" "$seq" "$batch" false
# lrmoe's step by part: the run's last line to stdout, its stderr (the
# `parts_ms` lines) to $1.
parts_run() {
  LRMOE_PARTS=1 LRMOE_LOG=info timeout 300 .device/lrmoe train --device cuda --model-config $cfg --layers $layers \
    --config /tmp/$tag.toml --no-progress --force 2> "$1" | tail -1
}
parts_run "$OUT/$tag.log"
for prec in master bf16; do
  timeout 300 python3 benches/torch_parts.py --config $cfg --layers $layers --seq $seq --batch $batch \
    --precision $prec > "$OUT/torch-$tag-$prec.jsonl" 2> /tmp/torch-$tag-$prec.err
  cat "$OUT/torch-$tag-$prec.jsonl"; tail -3 /tmp/torch-$tag-$prec.err
done
python3 benches/parts.py "$OUT/$tag.log" $cfg $layers $seq $batch 5 --torch "$OUT/torch-$tag-master.jsonl" --gpu "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" | tee "$OUT/$tag.md"
for round in 1 2; do
  for ws in ${WORKSPACES:-}; do
    LRMOE_CUBLAS_WORKSPACE_MIB=$ws parts_run "$OUT/$tag-ws$ws-$round.log" > /dev/null
    echo "== cuBLAS workspace $ws MiB, round $round"
    python3 benches/parts.py "$OUT/$tag-ws$ws-$round.log" $cfg $layers $seq $batch 5 --gpu "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" | grep -E "projection|lm head|step"
  done
done
