#!/bin/bash
# One H200: the device-resident model's tests (TESTS=1), then lrmoe training
# qwen3-moe-mini and two layers of the Qwen3-30B-A3B shape (exact backward,
# r = 1, the same work as PyTorch's dropless layer) beside the PyTorch peer
# (benches/torch_qwen3_moe.py) in both precisions — lrmoe's (bf16 compute,
# f32 master weights and moments) and all-bf16 — eager and compiled, in the
# same call: tokens/s, MFU and lrmoe's step split. SHAPES picks the shapes
# (default "mini a3b2"; one call each keeps a call under 10 minutes).
# The A3B run also writes its final checkpoint (22 GB: f32 weights and
# moments) and times it against dd copying the same file with an fsync.
# Build here and carry .device/:
#   cargo build --release -p lrmoe --features cuda && cp target/release/lrmoe .device/
#   cargo test --release -p lrmoe --features cuda --test gpu_model --no-run  # → .device/model-gpu-tests
#   cargo test --release -p kernels --features cuda --test gpu_dense --no-run  # → .device/dense-tests
. "$(dirname "$0")/lib.sh"
gpu_info
if [ "${TESTS:-0}" = 1 ]; then
  .device/dense-tests --ignored --test-threads 1 2>&1 | grep -E "test result|panicked"
  .device/model-gpu-tests --ignored --test-threads 1 --nocapture 2>&1 | grep -E "resume|qwen3|classic|test result|panicked"
fi
run() { # name config layers seq batch steps checkpoint(0/1)
  exact_toml "$1" "$6" "$4" "$5" "$( [ "$7" = 1 ] && echo true || echo false )"
  LRMOE_LOG=info,lrmoe::train=debug timeout 400 .device/lrmoe train --device cuda --model-config $2 --layers $3 \
    --config /tmp/$1.toml --no-progress --force > /tmp/$1.out 2> /tmp/$1.log
  tail -1 /tmp/$1.out
  grep -E "checkpoint size|checkpoint written" /tmp/$1.log | sed -E 's/^.*(checkpoint)/\1/'
  python3 - $1 $2 $3 $4 $5 <<'P'
import json, sys
name, cfgp, L, seq, batch = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
c = json.load(open(cfgp)); D,H,KV=c["hidden_size"],c["num_attention_heads"],c["num_key_value_heads"]; DH=c.get("head_dim",D//H)
E,K,FF,V=c["num_experts"],c["num_experts_per_tok"],c["moe_intermediate_size"],c["vocab_size"]
fwd = L*2*(D*H*DH*2 + D*KV*DH*2 + D*E + K*3*D*FF) + 2*D*V + L*2*2*seq*H*DH
rows=[json.loads(l) for l in open(f'/tmp/run-{name}/metrics.jsonl')][10:]
tp=sorted(r['tokens_per_s'] for r in rows)[len(rows)//2]
sp=[sorted(r['device_ms'][i] for r in rows)[len(rows)//2] for i in range(5)]
print(json.dumps({"ours": name, "tokens_per_s": tp, "mfu": 3*fwd*tp/989e12, "split_ms(dense_f,moe_f,dense_b,moe_b,opt)": [round(x,2) for x in sp], "loss_first": rows[0]['loss'], "loss_last": rows[-1]['loss']}))
P
  for prec in master bf16; do
    for comp in "" --compile; do
      timeout 300 python3 benches/torch_qwen3_moe.py --config $2 --layers $3 --seq $4 --batch $5 --steps $6 \
        --precision $prec $comp 2>&1 | tail -1
    done
  done
  if [ "$7" = 1 ] && [ -f /tmp/run-$1/checkpoint.safetensors ]; then
    sync; sleep 3
    cat /tmp/run-$1/checkpoint.safetensors > /dev/null
    dd if=/tmp/run-$1/checkpoint.safetensors of=/tmp/dd.bin bs=64M conv=fsync 2>&1 | tail -1
    rm -f /tmp/dd.bin /tmp/run-$1/checkpoint.safetensors
  fi
}
for shape in ${SHAPES:-mini a3b2}; do
  case $shape in
    mini) run mini examples/qwen3-moe-mini.config.json 4 512 32 60 0 ;;
    a3b2) run a3b2 examples/qwen3-30b-a3b.config.json 2 2048 8 30 1 ;;
  esac
done
