#!/bin/bash
# The replica rules side by side in `lrmoe replay`'s time model (CPU, no
# GPU): for the A3B and qwen3-moe-mini expert shapes, 8 ranks (one node)
# and 16 (two nodes), the issue-30 tokens a rank (2 048 / 1 024) and
# 16 384, and six synthetic workloads, LRMoE's row with the paying rule
# without the token rows (`paying-compute`, the rule before session 43),
# with them (`paying`, the default) and with every slot filled (`fill`).
#
#   bash benches/replay-rules.sh
#   TRACE=runs/x/metrics.jsonl TRACE_TOKENS=16384 bash benches/replay-rules.sh
#
# With TRACE (a qwen3-moe-mini run's metrics.jsonl, TRACE_TOKENS tokens a
# step), its routed loads replace the synthetic workloads: the mini shape
# at 8 and 16 ranks, the step's tokens split over them.
#
# The budget is what the trainer gives a rank: its owned experts, one
# replica slot and 0.6 of its mean routed rows (bf16), as in the
# simulated runs of docs/benchmarks.md, with the trainer's replica memory
# (all of it) and its reserved slots (an empty slot holds no rows:
# --slots-reserved; RESERVED=0 lets it hold rows). Prints a markdown
# table of the modelled forward + backward ms, the kept fraction, and the
# ratios.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release/lrmoe}
[ -x "$BIN" ] || cargo build --release -p lrmoe >&2
STEPS=${STEPS:-20}
reserve=--slots-reserved
[ "${RESERVED:-1}" = 0 ] && reserve=

# fwd+bwd ms and kept fraction of the LRMoE row.
lrmoe_row() {
  "$@" | awk -F'|' '/^\| LRMoE/ { printf "%.3f %.3f", $8 + $9, $11 }'
}
ratio() { python3 -c "print(f'{$1 / $2:.3f}')"; }

echo "| shape | ranks | tokens a rank | workload | budget MiB | paying-compute: ms, kept | paying: ms, kept | fill: ms, kept | paying ÷ paying-compute | paying ÷ fill |"
echo "|---|---|---|---|---|---|---|---|---|---|"
shapes="a3b mini"
[ -n "${TRACE:-}" ] && shapes=mini
for shape in $shapes; do
  if [ $shape = a3b ]; then H=2048; F=768; else H=512; F=256; fi
  for R in 8 16; do
    small=$((R == 8 ? 2048 : 1024))
    sizes="$small 16384"
    [ -n "${TRACE:-}" ] && sizes=$((${TRACE_TOKENS:-16384} / R))
    for T in $sizes; do
      B=$(python3 -c "h,f,r,t=$H,$F,$R,$T; inst=6*h*f*2; row=4*h; print(max(1,round(((128//r+1)*inst+0.6*t*8*row)/2**20)))")
      workloads=("balanced" "hot-experts --zipf 0.6" "hot-experts --zipf 1.2" "hot-rank" "rotating" "bursts")
      [ -n "${TRACE:-}" ] && workloads=("trace")
      for W in "${workloads[@]}"; do
        if [ "$W" = trace ]; then
          src="--lrmoe-metrics $TRACE"
        else
          src="--synthetic $W --steps $STEPS --layers 2 --tokens $T"
        fi
        A="replay $src --ranks $R --hidden $H --ffn $F --budget-mib $B --replica-slots 1 --replica-memory-fraction 1 --gpus-per-node 8 $reserve"
        # shellcheck disable=SC2086 # $A is the argument list
        read -r ct ck <<<"$(lrmoe_row "$BIN" $A --replica-rule paying-compute)"
        # shellcheck disable=SC2086
        read -r pt pk <<<"$(lrmoe_row "$BIN" $A --replica-rule paying)"
        # shellcheck disable=SC2086
        read -r ft fk <<<"$(lrmoe_row "$BIN" $A --replica-rule fill)"
        echo "| $shape | $R | $T | ${W/ --zipf / z} | $B | $ct, $ck | $pt, $pk | $ft, $fk | $(ratio "$pt" "$ct") | $(ratio "$pt" "$ft") |"
      done
    done
  done
done
