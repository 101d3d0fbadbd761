#!/usr/bin/env bash
# One device call on a two-GPU machine (kind nvidia-h200-x2): the device
# tests of the expert math on the GPU (kernels vs CPU twins, the GPU layer,
# the layer's bf16 GPU expert backend), the NCCL tests (transport suite,
# EP = 2 vs in-process, GPU experts over NCCL vs the twins, a departed
# peer), and launched training with the experts on the CPU and on the GPUs
# side by side (same config, same steps, step time and final loss), and
# the collective stop under the launcher (a time cap, a SIGINT).
# Binaries built on the dev machine and carried in .device/:
#   cargo build --release -p lrmoe --features nccl
#   cargo test --release -p layer --features nccl --no-run   (gpu_layer, nccl)
#   cargo test --release -p kernels --features cuda --no-run (gpu)
. "$(dirname "$0")/lib.sh"
L=.device/lrmoe
gpu_info
echo "== device tests"
timeout 300 .device/kernels-gpu-tests --ignored --test-threads=1 > "$OUT/tests.log" 2>&1
echo "kernels rc=$?  $(grep 'test result' "$OUT/tests.log" | tail -1)"
timeout 300 .device/layer-gpu-tests --ignored --test-threads=1 --nocapture >> "$OUT/tests.log" 2>&1
echo "layer rc=$?  $(grep 'test result' "$OUT/tests.log" | tail -1)"
grep -E "matches the twins|panicked" "$OUT/tests.log"
echo "== NCCL tests (2 processes)"
timeout 300 $L launch --nproc 2 --exec .device/layer-nccl-tests -- --ignored --test-threads=1 --nocapture > "$OUT/nccl-tests.log" 2>&1
echo "rc=$?"; grep -E "rank [01]:|test result|panicked" "$OUT/nccl-tests.log"
echo "== launched training, experts on CPU vs on the GPUs (${STEPS:=200} steps, hot expert)"
for dev in cpu cuda; do
  S=$(date +%s.%N)
  timeout 300 $L launch --nproc 2 -- train --config benches/hot-compare.toml --steps "$STEPS" \
    --device $dev --out "$OUT/run-$dev" --no-progress > "$OUT/train-$dev.log" 2>&1
  echo "$dev: rc=$? wall $(python3 -c "import time; print(f'{time.time() - $S:.1f}')") s; $(grep -v 'eval' "$OUT/train-$dev.log" | tail -2 | tr '\n' ' ')"
done

echo "== the collective stop under the launcher (issue 11)"
# A checkpoint every step and a time cap: the ranks must stop after the same step.
printf '[run]\ncheckpoint_every = 1\n' > "$OUT/ck1.toml"
timeout 300 $L launch --nproc 2 -- train --config "$OUT/ck1.toml" --max-minutes 0.1 \
  --device cuda --out "$OUT/run-cap" --no-progress > "$OUT/train-cap.log" 2>&1
echo "time cap: rc=$? $(grep -v eval "$OUT/train-cap.log" | tail -1)"
# SIGINT to the launcher alone: forwarded once, every rank stops at the same
# step boundary, writes the checkpoint and the summary, exits 0.
$L launch --nproc 2 -- train --device cuda --steps 100000 --out "$OUT/run-sig" --no-progress \
  > "$OUT/train-sig.log" 2>&1 &
LP=$!
for _ in $(seq 600); do
  [ "$(cat "$OUT/run-sig/metrics.jsonl" 2>/dev/null | wc -l)" -ge 30 ] && break
  sleep 0.1
done
kill -INT $LP
wait $LP
echo "signal: rc=$? $(grep -v eval "$OUT/train-sig.log" | tail -1)"
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
for run in ("run-cap", "run-sig"):
    steps = [json.loads(l)["step"] for l in open(f"{out}/{run}/metrics.jsonl")]
    raw = open(f"{out}/{run}/checkpoint.safetensors", "rb").read()
    n = int.from_bytes(raw[:8], "little")
    meta = json.loads(raw[8:8 + n])["__metadata__"]
    print(f"{run}: {len(steps)} metric lines, last step {steps[-1]}, checkpoint step {meta['step']}, unique {len(set(steps)) == len(steps)}")
PY
