#!/usr/bin/env bash
# One device call on a two-GPU machine (kind nvidia-h200-x2): the NCCL
# transport tests, the PyTorch all-to-all peer under torchrun and
# lrmoe-dist-bench in the same run, a launched training smoke run, and a
# rank killed mid-run (the survivor must stop within its timeout).
# Binaries are built on the dev machine and carried in .device/:
#   cargo build --release -p lrmoe --features nccl
#   cargo build --release -p lrmoe-benches --features nccl --bin lrmoe-dist-bench
#   cargo test --release -p layer --features nccl --no-run   (tests/nccl.rs)
# then:  bash benches/dist-device.sh   (with $OUT set by the device tool)
. "$(dirname "$0")/lib.sh"
L=.device/lrmoe
gpu_info
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
echo "== NCCL transport tests (2 processes)"
timeout 300 $L launch --nproc 2 --exec .device/layer-nccl-tests -- --ignored --test-threads=1 --nocapture 2>&1 | tee "$OUT/nccl-tests.log"
echo "rc=${PIPESTATUS[0]}"
echo "== torch all_to_all_single (torchrun)"
timeout 300 python3 -m torch.distributed.run --nproc_per_node=2 benches/torch_anchors.py > "$OUT/dist-anchors.log" 2>&1
grep '^DIST ' "$OUT/dist-anchors.log" | sed 's/^DIST //' > "$OUT/dist-anchors.json"
cat "$OUT/dist-anchors.json"
echo "== lrmoe-dist-bench"
timeout 300 $L launch --nproc 2 --exec .device/lrmoe-dist-bench -- "$OUT/dist-anchors.json" 2>&1 | tee "$OUT/dist-bench.md"
if [ "${BLOCKING_TOO:-0}" = 1 ]; then
  echo "== lrmoe-dist-bench, blocking communicator"
  LRMOE_NCCL_BLOCKING=1 timeout 300 $L launch --nproc 2 --exec .device/lrmoe-dist-bench -- "$OUT/dist-anchors.json" 2>&1 | tee "$OUT/dist-bench-blocking.md"
fi
[ "${ONLY_BENCH:-0}" = 1 ] && exit 0
now() { python3 -c 'import time; print(time.time())'; }
since() { python3 -c "import time; print(f'{time.time() - $1:.2f}')"; }
echo "== launched training (smoke): in-process vs NCCL ranks, step time"
for mode in inproc nccl nccl-4threads; do
  S=$(now)
  case $mode in
    inproc) RAYON_NUM_THREADS=16 timeout 300 $L train --steps 60 --out "$OUT/run-$mode" --no-progress > "$OUT/train-$mode.log" 2>&1 ;;
    nccl) timeout 300 $L launch --nproc 2 -- train --steps 60 --out "$OUT/run-$mode" --no-progress > "$OUT/train-$mode.log" 2>&1 ;;
    nccl-4threads) RAYON_NUM_THREADS=4 timeout 300 $L launch --nproc 2 -- train --steps 60 --out "$OUT/run-$mode" --no-progress > "$OUT/train-$mode.log" 2>&1 ;;
  esac
  echo "$mode: rc=$? wall $(since $S) s; $(grep -o 'wall_s=[0-9.]*' "$OUT/train-$mode.log" | tail -1); $(tail -1 "$OUT/train-$mode.log")"
done
echo "== a rank killed mid-run (train --timeout-s 10, launcher grace 120 s)"
$L launch --nproc 2 --grace-s 120 -- train --steps 100000 --timeout-s 10 --out "$OUT/run-kill" --no-progress > "$OUT/kill.log" 2>&1 &
LP=$!
sleep 20
VICTIM=$(pgrep -P $LP | tail -1)
echo "killing pid $VICTIM"; K=$(now); kill -9 "$VICTIM"
wait $LP; RC=$?
echo "launcher rc=$RC, $(since $K) s after the kill"
grep -E "lrmoe:" "$OUT/kill.log" | tail -3
