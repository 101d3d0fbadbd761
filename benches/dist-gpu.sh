#!/usr/bin/env bash
# One device call on a two-GPU machine (kind nvidia-h200-x2): the device
# tests of the expert math on the GPU (kernels vs CPU twins, the GPU layer,
# the layer's bf16 GPU expert backend), the NCCL tests (transport suite,
# EP = 2 vs in-process, GPU experts over NCCL vs the twins, a departed
# peer), and launched training with the experts on the CPU and on the GPUs
# side by side (same config, same steps, step time and final loss).
# Binaries built on the dev machine and carried in .device/:
#   cargo build --release -p lrmoe --features nccl
#   cargo test --release -p layer --features nccl --no-run   (gpu_layer, nccl)
#   cargo test --release -p kernels --features cuda --no-run (gpu)
set -uo pipefail
OUT=${OUT:-/tmp/lrmoe-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
L=.device/lrmoe
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
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
