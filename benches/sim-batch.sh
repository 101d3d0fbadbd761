#!/bin/bash
# Several `sim-device.sh` comparisons in one device call (issue 30), one
# setting a line of $RUNS:
#
#   TAG MODEL RANKS SEED SKEW BIAS BUFFER CMP_MIN CMP_TIMEOUT
#
# e.g. RUNS=$'a16sb0 a3b2v 16 0 0.3 0.01 2.5 1.4 280\na8s0 a3b2v 8 0 0.3 0.0 1.5 1.2 190'
# (MODEL as sim-device.sh's CMP_MODEL; BUFFER is `moe.buffer_fraction`,
# the budget holding the forward as by default). MODES (default
# full,symi,lrmoe), NEAR_EVERY (default 2) and NEAR_MARGIN (default 0.1;
# 0.2 where the loss falls fast near the target, as the A3B shape's does
# at 8 ranks) apply to every line. Each comparison keeps its plot,
# compare.json and phases.json (CMP_KEEP=plots); after each line every
# file so far is packed into $OUT/sim-batch.tgz, so a call cut off by its
# time limit still returns the finished settings (a device call returns
# at most 8 files). Carry .device/lrmoe (see sim-device.sh's header;
# gzipped as .device/lrmoe.gz is unpacked here).
. "$(dirname "$0")/lib.sh"
[ -e .device/lrmoe.gz ] && [ ! -e .device/lrmoe ] && gunzip -k .device/lrmoe.gz
need .device/lrmoe
chmod +x .device/lrmoe
[ -n "${RUNS:-}" ] || { echo "RUNS is empty: one setting a line (see the header)"; exit 2; }
top=$OUT
mkdir -p "$top/sim-batch"
while read -r tag model ranks seed skew bias buf cmin ctime; do
  [ -z "${tag:-}" ] && continue
  if [ -z "${ctime:-}" ]; then
    echo "$tag: a line needs 9 fields (TAG MODEL RANKS SEED SKEW BIAS BUFFER CMP_MIN CMP_TIMEOUT)"
    exit 2
  fi
  echo "== $tag $(date +%T)"
  OUT=$top/sim-batch PARTS=compare CMP_MODEL=$model CMP_RANKS=$ranks NEAR_EVERY=${NEAR_EVERY:-2} \
    NEAR_MARGIN=${NEAR_MARGIN:-0.1} CMP_KEEP=plots MODES=${MODES:-full,symi,lrmoe} CMP_MIN=$cmin \
    CMP_TIMEOUT=$ctime SEED=$seed SKEW=$skew BIAS=$bias \
    MOE_EXTRA=$'budget_forward = true\nbuffer_fraction = '"$buf" TAG=$tag \
    bash benches/sim-device.sh 2>&1 | tail -25
  (cd "$top" && tar czf sim-batch.tgz sim-batch)
done <<< "$RUNS"
rm -rf "$top/sim-batch"
