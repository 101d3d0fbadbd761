#!/bin/bash
# Issue 31: the dense model's one-group GEMMs (LM head, projections) on
# cuBLAS (the default) against the grouped kernels
# (LRMOE_DENSE_GEMM=cutlass), alternated ROUNDS times (default 2) in one call on two A3B
# layers (seq 2048 × 8) and qwen3-moe-mini (seq 512 × 32), exact backward;
# PEERS=1 adds the compiled PyTorch peers (f32-master and all-bf16).
# First the one-group GEMM device test both ways.
# Build here and carry .device/:
#   cargo build --release -p lrmoe --features cuda && cp target/release/lrmoe .device/
#   cargo test --release -p kernels --features cuda --test gpu_dense --no-run   # → .device/dense-tests
. "$(dirname "$0")/lib.sh"
need .device/lrmoe
gpu_info
if [ -e .device/dense-tests ]; then
  for gemm in cutlass cublas; do
    LRMOE_DENSE_GEMM=$gemm .device/dense-tests --ignored --test-threads 1 --nocapture one_group 2>&1 | grep -E "dense GEMM:|test result|panicked"
  done
fi
run() { # tag gemm config layers seq batch steps
  exact_toml "$1" "$7" "$5" "$6" false
  LRMOE_DENSE_GEMM=$2 timeout 200 .device/lrmoe train --device cuda --model-config $3 --layers $4 \
    --config /tmp/$1.toml --no-progress --force > /tmp/$1.out 2> /tmp/$1.log || tail -3 /tmp/$1.log
  python3 - "$1" "$2" <<'P'
import json, sys
rows = [json.loads(l) for l in open(f'/tmp/run-{sys.argv[1]}/metrics.jsonl')][10:]
tp = sorted(r['tokens_per_s'] for r in rows)[len(rows) // 2]
sp = [sorted(r['device_ms'][i] for r in rows)[len(rows) // 2] for i in range(5)]
print(json.dumps({"run": sys.argv[1], "gemm": sys.argv[2], "tokens_per_s": round(tp),
                  "split_ms(dense_f,moe_f,dense_b,moe_b,opt)": [round(x, 2) for x in sp],
                  "loss_last": rows[-1]['loss']}))
P
}
A3B="examples/qwen3-30b-a3b.config.json 2 2048 8 25"
MINI="examples/qwen3-moe-mini.config.json 4 512 32 40"
for round in $(seq "${ROUNDS:-2}"); do
  for gemm in cutlass cublas; do
    run a3b-$gemm-$round $gemm $A3B
    run mini-$gemm-$round $gemm $MINI
  done
done
if [ -n "${PEERS:-}" ]; then
  for prec in master bf16; do
    timeout 240 python3 benches/torch_qwen3_moe.py --config examples/qwen3-30b-a3b.config.json --layers 2 \
      --seq 2048 --batch 8 --steps 25 --precision $prec --compile 2>&1 | tail -1
  done
fi
