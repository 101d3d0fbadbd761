#!/usr/bin/env bash
# Time to a target validation loss on two GPUs (one process each, NCCL),
# forced hot-expert workload (benches/hot-compare.toml): full backward,
# replication only and LRMoE, in one device call. Carries .device/lrmoe
# (built with --features nccl). Usage: TARGET=2.0 MINUTES=2.5 bash benches/dist-compare.sh
# DEVICE=cuda runs each rank's expert GEMMs on its GPU (bf16 grouped kernels);
# with EXECUTOR=device (and DEVICE=cuda) the whole MoE layer runs on the GPUs
# through the device EP executor. MODES and CONFIG override the defaults.
. "$(dirname "$0")/lib.sh"
timeout 590 .device/lrmoe launch --nproc 2 -- train --config "${CONFIG:-benches/hot-compare.toml}" \
  --compare --modes "${MODES:-full,replicate,lrmoe}" --target-val-loss "${TARGET:-2.0}" \
  --max-minutes "${MINUTES:-2.5}" --device "${DEVICE:-cpu}" --executor "${EXECUTOR:-host}" \
  --out "$OUT/compare${TAG:-}" --no-progress 2>&1 | grep -vE "INFO lrmoe::train(::[a-z_]+)?: eval" | tail -20
