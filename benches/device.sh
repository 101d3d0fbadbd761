#!/usr/bin/env bash
# One device call: GPU tests against the CPU twins, the kernel benchmarks and
# the PyTorch anchors, in the same run. Binaries are built on the dev machine
# (no Rust toolchain on the GPU machine) and carried in .device/:
#   cargo build --release -p lrmoe-benches --features cuda --bin lrmoe-gpu-bench
#   cargo test -p kernels --features cuda --release --no-run   (test binary)
#   cargo test -p layer --features cuda --release --no-run     (test binary)
# then:  bash benches/device.sh   (with $OUT set by the device tool)
. "$(dirname "$0")/lib.sh"
gpu_info
echo "== device tests (kernels vs CPU twins)"
.device/kernels-gpu-tests --ignored --test-threads=1 2>&1 | tee "$OUT/tests.log"
echo "== device test (GPU layer vs CPU layer)"
.device/layer-gpu-tests --ignored 2>&1 | tee -a "$OUT/tests.log"
echo "== torch anchors"
python3 benches/torch_anchors.py 2>&1 | tee "$OUT/anchors.log"
grep '^SINGLE ' "$OUT/anchors.log" | sed 's/^SINGLE //' > "$OUT/anchors.json"
echo "== lrmoe kernels"
.device/lrmoe-gpu-bench "$OUT/anchors.json" 2>&1 | tee "$OUT/bench.md"
