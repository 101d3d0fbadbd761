#!/bin/bash
# The final checkpoint's write speed against the disk's, in one run (issue
# 28): `lrmoe train` writes the checkpoint of a model with SIZE_M million
# parameters (default ~100 M: 1.2 GB of weights and AdamW moments) after one
# step, its debug log gives the write time; `dd` then writes the same number
# of bytes to the same folder with an fsync at the end, as the checkpoint
# writer does. Runs on the CPU; needs only a release build:
#   cargo build --release -p lrmoe
#   bash benches/checkpoint-speed.sh [folder on the disk to measure]
set -eu
L=${LRMOE:-target/release/lrmoe}
DIR=${1:-$(mktemp -d)}
mkdir -p "$DIR"
cat > "$DIR/ckpt.toml" <<T
steps = 1
[model]
d_model = 512
n_layers = 2
n_heads = 8
ffn = 1024
n_experts = 32
top_k = 2
[data]
seq_len = 16
batch_size = 2
[moe]
ranks = 1
mode = "full"
[run]
eval_every = 1
eval_batches = 1
out_dir = "$DIR/run"
T
LRMOE_LOG=lrmoe=debug $L train --config "$DIR/ckpt.toml" --no-progress --force 2> "$DIR/log" >/dev/null
line=$(grep "checkpoint written" "$DIR/log" | tail -1)
bytes=$(stat -c %s "$DIR/run/checkpoint.safetensors")
secs=$(echo "$line" | sed -E 's/.*seconds=([0-9.e-]+).*/\1/')
sync
dd_out=$( { dd if=/dev/zero of="$DIR/dd.bin" bs=16M count=$(( (bytes + 16777215) / 16777216 )) conv=fsync 2>&1; } | tail -1)
dd_secs=$(echo "$dd_out" | sed -E 's/.*copied, ([0-9.]+) s.*/\1/')
rm -f "$DIR/dd.bin"
python3 - "$bytes" "$secs" "$dd_secs" <<'P'
import sys
b, s, d = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
mib = b / 2**20
print("| what | MiB | seconds | MiB/s | ratio to dd |")
print("|---|---|---|---|---|")
print(f"| lrmoe checkpoint (streamed, fsync) | {mib:.0f} | {s:.2f} | {mib/s:.0f} | {d/s:.2f} |")
print(f"| dd, same bytes, conv=fsync | {mib:.0f} | {d:.2f} | {mib/d:.0f} | 1.00 |")
P
