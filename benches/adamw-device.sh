#!/bin/bash
# AdamW on the device in one call (issue 31): its device tests against the
# CPU twins — in parallel threads first (several devices opened at once, as
# `cargo test` does by default), then one at a time — and the AdamW table
# of `lrmoe-gpu-bench` (the update with a bf16 and an f32 gradient, its
# access pattern alone, the gradient norm) beside PyTorch's fused AdamW
# (`benches/torch_adamw.py`) and the device copy, in the same run. Carry
# .device/ with, built on the development machine (gzipped copies, name.gz,
# are unpacked here):
#   cargo build --release -p lrmoe-benches --features cuda --bin lrmoe-gpu-bench
#     → .device/lrmoe-gpu-bench
#   cargo test -p kernels --features cuda --release --test gpu_dense --no-run
#     → .device/dense-gpu-tests (the test binary it names)
# Files: $OUT/adamw-tests-{parallel,serial}.txt (whole output),
# $OUT/adamw-anchors.json, $OUT/adamw-bench.md.
. "$(dirname "$0")/lib.sh"
for f in lrmoe-gpu-bench dense-gpu-tests; do
  [ -e .device/$f.gz ] && gunzip -kf .device/$f.gz
done
need .device/lrmoe-gpu-bench .device/dense-gpu-tests
chmod +x .device/lrmoe-gpu-bench .device/dense-gpu-tests
gpu_info
status=0
echo "== AdamW device tests, parallel threads"
timeout 180 .device/dense-gpu-tests --ignored adamw > "$OUT/adamw-tests-parallel.txt" 2>&1 || status=1
grep -E "^test |^test result" "$OUT/adamw-tests-parallel.txt"
echo "== AdamW device tests, one thread"
timeout 180 .device/dense-gpu-tests --ignored --test-threads=1 adamw > "$OUT/adamw-tests-serial.txt" 2>&1 || status=1
grep -E "^test |^test result" "$OUT/adamw-tests-serial.txt"
echo "== PyTorch's fused AdamW"
timeout 120 python3 benches/torch_adamw.py > "$OUT/adamw-anchors.json" || status=1
cat "$OUT/adamw-anchors.json"
echo "== lrmoe's AdamW table"
LRMOE_GPU_TABLES=adamw timeout 180 .device/lrmoe-gpu-bench "$OUT/adamw-anchors.json" 2>&1 | tee "$OUT/adamw-bench.md" || status=1
exit $status
