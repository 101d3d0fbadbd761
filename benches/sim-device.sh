#!/bin/bash
# N GPUs simulated on one (issue 30): the in-process device-to-device
# exchange against host staging (device test), the timed in-process ranks,
# the MoE layer on N simulated GPUs beside the one-GPU layer
# (`lrmoe-sim-bench`), and `lrmoe train` with N staged ranks on
# qwen3-moe-mini (same global batch) beside one rank: wall tokens/s and the
# simulated step from metrics.jsonl.
# Build here and carry .device/:
#   cargo build --release -p lrmoe --features cuda && cp target/release/lrmoe .device/
#   cargo build --release -p lrmoe-benches --features cuda --bin lrmoe-sim-bench && cp target/release/lrmoe-sim-bench .device/
#   cargo test --release -p layer --features cuda --test gpu_layer --no-run   # → .device/layer-gpu-tests
#   cargo test --release -p lrmoe --features cuda --test gpu_model --no-run   # → .device/model-gpu-tests
# RANKS (default "1 2 4 8"), STEPS (default 30), TESTS=0 to skip the tests,
# SIM_RANKS (default "2 4 8") for the layer table.
. "$(dirname "$0")/lib.sh"
need .device/lrmoe .device/lrmoe-sim-bench
gpu_info
if [ "${TESTS:-1}" = 1 ]; then
  need .device/layer-gpu-tests .device/model-gpu-tests
  time .device/layer-gpu-tests --ignored --test-threads 1 --nocapture 2>&1 | grep -E "bit for bit|timed:|test result|panicked|FAILED|^test " | tail -30
  time .device/model-gpu-tests --ignored --test-threads 1 2>&1 | grep -E "test result|panicked|FAILED|^test " | tail -12
fi
time .device/lrmoe-sim-bench ${SIM_RANKS:-2 4 8} 2>&1 | tail -12
for r in ${RANKS:-1 2 4 8}; do
  cat > /tmp/sim$r.toml <<T
steps = ${STEPS:-30}
[data]
seq_len = 512
batch_size = 32
[moe]
mode = "full"
ranks = $r
executor = "device"
[run]
eval_every = 1000
eval_batches = 1
checkpoint = false
out_dir = "/tmp/sim$r"
T
  /usr/bin/time -f "ranks $r: %e s wall" timeout 300 .device/lrmoe train --device cuda --model-config examples/qwen3-moe-mini.config.json --config /tmp/sim$r.toml --no-progress --force 2>&1 | tail -1
  python3 - "$r" <<'P'
import json, statistics, sys
r = sys.argv[1]
rows = [json.loads(l) for l in open(f"/tmp/sim{r}/metrics.jsonl")][10:]
tps = statistics.median(x["tokens_per_s"] for x in rows)
sims = [x["simulated"] for x in rows if "simulated" in x]
line = f"ranks {r}: wall tokens/s {tps:,.0f}, loss {rows[-1]['loss']:.4f}"
if sims:
    med = lambda k: statistics.median(s[k] for s in sims)
    ph = {p: statistics.median(s["phases"].get(p, 0.0) for s in sims) for p in sims[0]["phases"]}
    tokens = 32 * 512
    line += (f"; simulated step {med('step_s')*1e3:.2f} ms = {tokens/med('step_s'):,.0f} tokens/s, MoE {med('moe_s')*1e3:.2f} ms,"
             f" collectives {med('collectives_s')*1e3:.2f} ms, all ranks' work {med('work_all_ranks_s')*1e3:.2f} ms; phases ms "
             + ", ".join(f"{p} {v*1e3:.2f}" for p, v in ph.items()))
print(line)
P
done
