#!/usr/bin/env bash
# One device call on a two-GPU machine (kind nvidia-h200-x2) for the device
# EP layer with the layer's plan (issue 12): the device tests (kernels vs
# CPU twins, the GPU layer, the NCCL suite with the EP layer against the
# single-GPU layer), then the PyTorch EP peer (torch_ep_anchor.py, balanced
# and --hot 2.0) and lrmoe-dist-bench in the same run.
# Binaries built on the dev machine and carried in .device/ (stripped):
#   cargo build --release -p lrmoe --features nccl
#   cargo build --release -p lrmoe-benches --features nccl --bin lrmoe-dist-bench
#   cargo test --release -p layer --features nccl --no-run    (gpu_layer, nccl)
#   cargo test --release -p kernels --features cuda --no-run  (gpu)
. "$(dirname "$0")/lib.sh"
L=.device/lrmoe
gpu_info
echo "== device tests"
timeout 300 .device/kernels-gpu-tests --ignored --test-threads=1 > "$OUT/tests.log" 2>&1
echo "kernels rc=$? $(grep 'test result' "$OUT/tests.log" | tail -1)"
timeout 300 .device/layer-gpu-tests --ignored --test-threads=1 >> "$OUT/tests.log" 2>&1
echo "layer rc=$? $(grep 'test result' "$OUT/tests.log" | tail -1)"
timeout 300 $L launch --nproc 2 --exec .device/layer-nccl-tests -- --ignored --test-threads=1 --nocapture > "$OUT/nccl-tests.log" 2>&1
echo "nccl rc=$?"; grep -E "rank 0:|test result|panicked" "$OUT/nccl-tests.log"
echo "== PyTorch peers (same run)"
timeout 300 python3 -m torch.distributed.run --nproc_per_node=2 benches/torch_anchors.py > "$OUT/dist-anchors.log" 2>&1
grep '^DIST ' "$OUT/dist-anchors.log" | sed 's/^DIST //' > "$OUT/dist-anchors.json"
for hot in 0.0 2.0; do
  timeout 300 python3 -m torch.distributed.run --nproc_per_node=2 benches/torch_ep_anchor.py --hot $hot 2>&1 | grep '^EP ' | tee -a "$OUT/ep-anchor.log"
done
echo "== lrmoe-dist-bench"
timeout 300 $L launch --nproc 2 --exec .device/lrmoe-dist-bench -- "$OUT/dist-anchors.json" 2>&1 | tee "$OUT/dist-bench.md"
