#!/bin/bash
# One H200: the fused attention kernels (kernels/dense.cu flash_*) against
# their CPU twins and the device model's tests, then attention alone and
# the whole device model with the fused kernels (LRMOE_ATTENTION=fused) and
# with the materialised scores (LRMOE_ATTENTION=materialized), beside
# PyTorch's SDPA, in one call; attention alone also with the fused
# backward's dQ recomputed (LRMOE_ATTENTION_DQ=recompute). The device
# model's tests run on both paths.
# (Unset, the fused kernels run at every head width they have; at head
# widths 64 and 128 with whole 128-row tiles the forward is CUTLASS's
# FMHA, and at 128 the backward too: LRMOE_ATTENTION_FWD=mma and
# LRMOE_ATTENTION_DQ=stored give the mma.sync kernels.)
# Build here and carry .device/:
#   cargo build --release -p lrmoe --features nccl && cp target/release/lrmoe .device/
#   cargo build --release -p lrmoe-benches --features cuda --bin lrmoe-attn-bench  # → .device/
#   cargo test --release -p kernels --features cuda --test gpu_dense --no-run  # → .device/dense-tests
#   cargo test --release -p lrmoe --features cuda --test gpu_model --no-run    # → .device/model-gpu-tests
. "$(dirname "$0")/lib.sh"
gpu_info
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 300 .device/dense-tests --ignored --test-threads=1 2>&1 | grep -E "test result|panicked|off by" | head
  for a in materialized fused; do
    echo "device model tests, attention $a:"
    LRMOE_ATTENTION=$a timeout 300 .device/model-gpu-tests --ignored --test-threads 1 --nocapture 2>&1 | grep -E "resume|qwen3|classic|test result|panicked" | head -20
  done
fi
echo "== attention alone (median device ms)"
echo "fused:"; LRMOE_ATTENTION=fused timeout 120 .device/lrmoe-attn-bench 2>&1 | tail -2
echo "fused, dQ recomputed (the kernels before the stored dS):"
LRMOE_ATTENTION=fused LRMOE_ATTENTION_DQ=recompute timeout 120 .device/lrmoe-attn-bench 2>&1 | tail -2
echo "materialised:"; LRMOE_ATTENTION=materialized timeout 120 .device/lrmoe-attn-bench 2>&1 | tail -2
echo "SDPA:"; timeout 120 python3 benches/torch_attention.py 2>&1 | tail -4
mini() { # tag config layers seq batch steps
  exact_toml "$1" "$6" "$4" "$5" true
  timeout 200 .device/lrmoe train --device cuda --model-config $2 --layers $3 --config /tmp/$1.toml --no-progress --force > /tmp/$1.log 2>&1
  python3 -c "
import json
r=[json.loads(l) for l in open('/tmp/run-$1/metrics.jsonl')]
t=r[10:]
print('$1', 'tokens/s', round(sorted(x['tokens_per_s'] for x in t)[len(t)//2]), 'split', [round(sorted(x['device_ms'][i] for x in t)[len(t)//2],2) for i in range(5)], 'loss', round(r[0]['loss'],4), round(r[-1]['loss'],4))" || tail -3 /tmp/$1.log
}
echo "== whole model (lrmoe train --device cuda), median of steps 11+"
for rep in 1 2; do
  LRMOE_ATTENTION=fused mini mini-fused examples/qwen3-moe-mini.config.json 4 512 32 60
  LRMOE_ATTENTION=materialized mini mini-mat examples/qwen3-moe-mini.config.json 4 512 32 60
done
LRMOE_ATTENTION=fused mini a3b-fused examples/qwen3-30b-a3b.config.json 2 2048 8 30
LRMOE_ATTENTION=materialized mini a3b-mat examples/qwen3-30b-a3b.config.json 2 2048 8 30
