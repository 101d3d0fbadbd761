#!/bin/bash
# The final checkpoint's write speed against the disk's, in one run (issue
# 28): `lrmoe train` writes the checkpoint of a ~100 M-parameter model
# (1.2 GB of weights and AdamW moments) after one step, its debug log gives
# the write time; `dd` then copies the checkpoint (from the page cache) to
# the same folder with an fsync at the end, as the checkpoint writer does.
# ROUNDS (default 3) alternate the two. Runs on the CPU; needs only a
# release build:
#   cargo build --release -p lrmoe
#   ROUNDS=3 bash benches/checkpoint-speed.sh [folder on the disk to measure]
# The library-level A/B (the old serialise-then-write against the streamed
# writer and a raw write, same tensors, same run):
#   cargo run --release -p lrmoe --example checkpoint_write -- DIR 1024 6
DIR=${1:-$(mktemp -d)}
mkdir -p "$DIR" && DIR=$(cd "$DIR" && pwd)
. "$(dirname "$0")/lib.sh"
set -e
L=${LRMOE:-target/release/lrmoe}
need "$L"
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
rm -f "$DIR/rounds"
for round in $(seq "${ROUNDS:-3}"); do
  # Freed blocks of an earlier run slow the next writes for a while: start
  # from an empty folder on a settled disk, and let it settle before dd too.
  rm -rf "$DIR/run" "$DIR/dd.bin"; sync; sleep 3
  LRMOE_LOG=lrmoe=debug $L train --config "$DIR/ckpt.toml" --no-progress --force 2> "$DIR/log" >/dev/null
  line=$(grep "checkpoint written" "$DIR/log" | tail -1)
  bytes=$(stat -c %s "$DIR/run/checkpoint.safetensors")
  secs=$(echo "$line" | sed -E 's/.*seconds=([0-9.e-]+).*/\1/')
  sync; sleep 3
  cat "$DIR/run/checkpoint.safetensors" > /dev/null  # in the page cache: dd then measures the writes
  dd_out=$( { dd if="$DIR/run/checkpoint.safetensors" of="$DIR/dd.bin" bs=16M conv=fsync 2>&1; } | tail -1)
  dd_secs=$(echo "$dd_out" | sed -E 's/.*copied, ([0-9.]+) s.*/\1/')
  rm -f "$DIR/dd.bin"
  echo "$bytes $secs $dd_secs" >> "$DIR/rounds"
done
python3 - "$DIR/rounds" <<'P'
import sys
print("| round | MiB | lrmoe s | lrmoe MiB/s | dd s | dd MiB/s | lrmoe speed / dd speed |")
print("|---|---|---|---|---|---|---|")
for i, line in enumerate(open(sys.argv[1]), 1):
    b, s, d = line.split()
    mib, s, d = int(b) / 2**20, float(s), float(d)
    print(f"| {i} | {mib:.0f} | {s:.2f} | {mib/s:.0f} | {d:.2f} | {mib/d:.0f} | {d/s:.2f} |")
P
