#!/bin/bash
# One GPU, several in-process ranks (`DeviceComm::Staged`): the multi-rank
# device executor and the device model at EP = 2 (and 4) against EP = 1,
# the host executor and the CPU model; then `lrmoe train --ranks 2
# --executor device --device cuda` beside the one-rank run.
# Build here and carry .device/:
#   cargo build --release -p lrmoe --features cuda && cp target/release/lrmoe .device/
#   cargo test --release -p layer --features cuda --test gpu_layer --no-run   # → .device/layer-gpu-tests
#   cargo test --release -p lrmoe --features cuda --test gpu_model --no-run   # → .device/model-gpu-tests
. "$(dirname "$0")/lib.sh"
gpu_info
time .device/layer-gpu-tests --ignored --test-threads 1 --nocapture 2>&1 | grep -E "EP = |staged.*(binding|capacity|priority)|test result|panicked|FAILED|^test " | tail -40
time .device/model-gpu-tests --ignored --test-threads 1 --nocapture 2>&1 | grep -E "rank|test result|panicked|FAILED|^test " | head -40
for r in 1 2; do
  cat > /tmp/st$r.toml <<T
steps = 60
[data]
seq_len = 256
batch_size = 16
[moe]
mode = "lrmoe"
ranks = $r
executor = "device"
[run]
eval_every = 20
eval_batches = 2
checkpoint_every = 30
out_dir = "/tmp/st$r"
T
  /usr/bin/time -f "%e s" timeout 200 .device/lrmoe train --device cuda --model-config examples/qwen3-moe-mini.config.json --layers 2 --config /tmp/st$r.toml --no-progress --force 2>&1 | tail -2
  python3 -c "
import json
rows=[json.loads(l) for l in open('/tmp/st$r/metrics.jsonl')]
print('ranks $r', 'loss@1', round(rows[0]['loss'],4), 'loss@60', round(rows[-1]['loss'],4), 'kept', [round(l['kept_fraction'],3) for l in rows[-1]['layers']], 'vals', [round(r['val_loss'],4) for r in rows if r.get('val_loss') is not None])
"
done
