#!/usr/bin/env bash
# One device call on a two-GPU machine (kind nvidia-h200-x2) for the device
# EP executor with the whole plan (issue 12): replicas executed on the
# GPUs, the forward's pairs and the backward's kept pairs split over the
# instances by `redistribute`, the hot workload as a router logit bias.
#   1. device tests: kernels vs CPU twins (incl. the biased logits), the
#      GPU layer, the NCCL suite (EP layer with 0/1/2 replica slots per rank
#      against the single-GPU layer, random and hot routers, r = 1 … 0);
#   2. the PyTorch EP peer, balanced and --hot 2.0, in the same call;
#   3. lrmoe-dist-bench (random-router table, hot table under one budget);
#   4. launched training through the device executor on the hot workload
#      (benches/hot-compare.toml) with modes full / replicate / lrmoe.
# Binaries built on the dev machine and carried in .device/ (stripped):
#   cargo build --release -p lrmoe --features nccl
#   cargo build --release -p lrmoe-benches --features nccl --bin lrmoe-dist-bench
#   cargo test --release -p layer --features nccl --no-run    (gpu_layer, nccl)
#   cargo test --release -p kernels --features cuda --no-run  (gpu)
. "$(dirname "$0")/lib.sh"
L=.device/lrmoe
gpu_info
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  echo "== device tests"
  if [ "${ONE_GPU_TESTS:-1}" = 1 ]; then  # 0: only the NCCL suite (the one-GPU suites ran elsewhere)
    timeout 300 .device/kernels-gpu-tests --ignored --test-threads=1 > "$OUT/tests.log" 2>&1
    echo "kernels rc=$? $(grep 'test result' "$OUT/tests.log" | tail -1)"
    timeout 300 .device/layer-gpu-tests --ignored --test-threads=1 >> "$OUT/tests.log" 2>&1
    echo "layer rc=$? $(grep 'test result' "$OUT/tests.log" | tail -1)"
    grep -E "panicked|FAILED" "$OUT/tests.log" | head -5
  fi
  timeout 300 $L launch --nproc 2 --exec .device/layer-nccl-tests -- --ignored --test-threads=1 --nocapture > "$OUT/nccl-tests.log" 2>&1
  echo "nccl rc=$?"; grep -E "rank 0: device EP|test result|panicked" "$OUT/nccl-tests.log" | cut -c1-260
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  echo "== PyTorch EP peer (same run)"
  for hot in 0.0 2.0; do
    timeout 300 python3 -m torch.distributed.run --nproc_per_node=2 benches/torch_ep_anchor.py --hot $hot 2>&1 | grep '^EP ' | tee -a "$OUT/ep-anchor.log"
  done
  echo "== lrmoe-dist-bench"
  timeout 300 $L launch --nproc 2 --exec .device/lrmoe-dist-bench 2>&1 | grep -v "^\s*$" | grep -E "^\||^Expert|^Hot|rror" | tee "$OUT/dist-bench.md"
fi
if [ "${SKIP_TRAIN:-0}" != 1 ]; then
  echo "== launched training through the device executor, hot workload (${STEPS:=300} steps)"
  for mode in ${MODES:-full replicate lrmoe}; do
    S=$(date +%s.%N)
    timeout 300 $L launch --nproc 2 -- train --config benches/hot-compare.toml --mode $mode --device cuda \
      --executor device --steps "$STEPS" --out "$OUT/run-$mode" --no-progress > "$OUT/train-$mode.log" 2>&1
    echo "$mode: rc=$? wall $(python3 -c "import time; print(f'{time.time() - $S:.1f}')") s; $(grep -o 'step=[0-9]* val_loss=[0-9.]*' "$OUT/train-$mode.log" | tail -3 | tr '\n' ' ')| $(grep -v eval "$OUT/train-$mode.log" | tail -1)"
  done
  python3 - "$OUT" "${MODES:-full replicate lrmoe}" <<'PY'
import json, sys
out = sys.argv[1]
for m in sys.argv[2].split():
    try:
        rows = [json.loads(l) for l in open(f"{out}/run-{m}/metrics.jsonl")]
    except OSError:
        continue
    moe = rows[-1]["moe_s"]; wall = rows[-1]["wall_s"]
    kept = sum(l["kept_fraction"] for r in rows for l in r["layers"]) / sum(len(r["layers"]) for r in rows)
    print(f"{m}: steps {len(rows)}, train wall {wall:.1f} s, MoE-layer time {moe:.1f} s, mean kept fraction {kept:.3f}")
PY
fi
