#!/usr/bin/env bash
# Two "nodes" on one two-GPU host (kind nvidia-h200-x2): two launchers with
# --nnodes 2 --node-rank 0/1, one GPU each (CUDA_VISIBLE_DEVICES), NCCL's
# peer-to-peer and shared-memory transports off so ranks talk through NCCL's
# network transport (sockets on loopback) as across hosts. Runs the NCCL
# tests and a short launched training run with the experts on the GPUs.
# Binaries as for benches/dist-gpu.sh.
. "$(dirname "$0")/lib.sh"
export NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_SOCKET_IFNAME=lo NCCL_DEBUG=INFO
L=.device/lrmoe
two_nodes() { # $1: log name, rest: launcher arguments after the node flags
  local name=$1; shift
  local port=$((29000 + RANDOM % 1000))
  for node in 0 1; do
    CUDA_VISIBLE_DEVICES=$node timeout 300 $L launch --nproc 1 --nnodes 2 --node-rank $node \
      --master-addr 127.0.0.1 --master-port $port "$@" > "$OUT/$name-node$node.log" 2>&1 &
  done
  local rc=0
  for job in $(jobs -p); do wait "$job" || rc=$?; done
  echo "$name: rc=$rc; transports: $(grep -ho 'via NET/[A-Za-z]*' "$OUT/$name"-node*.log | sort | uniq -c | tr '\n' ' ')"
}
echo "== NCCL tests, two nodes"
two_nodes nccl-tests --exec .device/layer-nccl-tests -- --ignored --test-threads=1 --nocapture
grep -hE "rank [01]:|test result|panicked" "$OUT"/nccl-tests-node*.log
echo "== training, two nodes, experts on the GPUs (100 steps)"
S=$(date +%s)
two_nodes train -- train --config benches/hot-compare.toml --steps 100 --device cuda --out "$OUT/run-2nodes" --no-progress
echo "wall $(( $(date +%s) - S )) s; $(grep -h 'validation loss' "$OUT"/train-node0.log | tail -1)"
rm -f "$OUT"/run-2nodes/checkpoint*
