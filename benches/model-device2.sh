#!/bin/bash
# Two H200s (nvidia-h200-x2): the device-resident model on launched ranks —
# experts sharded, dense weights replicated, gradients summed over NCCL.
# Build here and carry .device/ (NCCL from the driver machine's PyPI wheel
# as in benches/dist-replicas.sh):
#   cargo build --release -p lrmoe --features nccl && cp target/release/lrmoe .device/lrmoe
#   cargo test --release -p lrmoe --features nccl --test nccl_model --no-run  # → .device/model-nccl-tests
. "$(dirname "$0")/lib.sh"
gpu_info
.device/lrmoe launch --nproc 2 --exec .device/model-nccl-tests -- --ignored --test-threads=1 --nocapture 2>&1 | grep -E "rank|test result|panicked"
cat > /tmp/m2.toml <<'T'
steps = 60
[data]
seq_len = 512
batch_size = 64
[moe]
mode = "full"
executor = "device"
[run]
eval_every = 1000
eval_batches = 1
checkpoint_every = 0
out_dir = "/tmp/run-mini2"
T
timeout 250 .device/lrmoe launch --nproc 2 -- train --device cuda --model-config examples/qwen3-moe-mini.config.json \
  --config /tmp/m2.toml --no-progress --force 2>&1 | tail -2
python3 -c "
import json
r=[json.loads(l) for l in open('/tmp/run-mini2/metrics.jsonl')][10:]
print('2 GPUs: median tokens/s', sorted(x['tokens_per_s'] for x in r)[len(r)//2], 'split', [sorted(x['device_ms'][i] for x in r)[len(r)//2] for i in range(5)])"
# The PyTorch peer, expert parallel over the same two GPUs, same global batch.
timeout 250 torchrun --nproc_per_node=2 benches/torch_qwen3_moe.py --config examples/qwen3-moe-mini.config.json \
  --seq 512 --batch 64 --steps 60 2>&1 | grep peer
