#!/bin/bash
# The replica rules side by side in `lrmoe replay`'s time model (CPU, no
# GPU): for the A3B and qwen3-moe-mini expert shapes, 8 ranks (one node)
# and 16 (two nodes), the issue-30 tokens a rank (2 048 / 1 024) and
# 16 384, and six synthetic workloads, LRMoE's row with the paying rule
# and with every slot filled; with OLD=<an lrmoe binary>, also that
# binary's paying rule (a rule change against the build before it).
#
#   bash benches/replay-rules.sh                 # paying and fill
#   OLD=/tmp/old/lrmoe bash benches/replay-rules.sh
#
# The budget is what the trainer gives a rank: its owned experts, one
# replica slot and 0.6 of its mean routed rows (bf16), as in the
# simulated runs of docs/benchmarks.md. Prints a markdown table of the
# modelled forward + backward ms, the kept fraction, and the ratios.
set -euo pipefail
cd "$(dirname "$0")/.."
NEW=${NEW:-target/release/lrmoe}
[ -x "$NEW" ] || cargo build --release -p lrmoe >&2
OLD=${OLD:-}
STEPS=${STEPS:-20}

# fwd+bwd ms and kept fraction of the LRMoE row.
lrmoe_row() {
  "$@" | awk -F'|' '/^\| LRMoE/ { printf "%.3f %.3f", $8 + $9, $11 }'
}

echo "| shape | ranks | tokens a rank | workload | budget MiB |${OLD:+ previous paying: ms, kept |} paying: ms, kept | fill: ms, kept |${OLD:+ paying ÷ previous |} paying ÷ fill |"
echo "|---|---|---|---|---|${OLD:+---|}---|---|${OLD:+---|}---|"
for shape in a3b mini; do
  if [ $shape = a3b ]; then H=2048; F=768; else H=512; F=256; fi
  for R in 8 16; do
    small=$((R == 8 ? 2048 : 1024))
    for T in $small 16384; do
      B=$(python3 -c "h,f,r,t=$H,$F,$R,$T; inst=6*h*f*2; row=4*h; print(max(1,round(((128//r+1)*inst+0.6*t*8*row)/2**20)))")
      for W in "balanced" "hot-experts --zipf 0.6" "hot-experts --zipf 1.2" "hot-rank" "rotating" "bursts"; do
        # shellcheck disable=SC2086
        A="replay --synthetic $W --ranks $R --steps $STEPS --layers 2 --tokens $T --hidden $H --ffn $F --budget-mib $B --replica-slots 1 --gpus-per-node 8"
        read -r pt pk <<<"$(lrmoe_row "$NEW" $A --replica-rule paying)"
        read -r ft fk <<<"$(lrmoe_row "$NEW" $A --replica-rule fill)"
        old_cells="" old_ratio=""
        if [ -n "$OLD" ]; then
          read -r ot ok <<<"$(lrmoe_row "$OLD" $A --replica-rule paying)"
          old_cells=" $ot, $ok |"
          old_ratio=" $(python3 -c "print(f'{$pt/$ot:.3f}')") |"
        fi
        echo "| $shape | $R | $T | ${W/ --zipf / z} | $B |$old_cells $pt, $pk | $ft, $fk |$old_ratio $(python3 -c "print(f'{$pt/$ft:.3f}')") |"
      done
    done
  done
done
