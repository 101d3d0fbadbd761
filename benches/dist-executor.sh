#!/usr/bin/env bash
# One device call on a two-GPU machine (kind nvidia-h200-x2): launched
# training with the MoE layers through the host executor (expert GEMMs on
# the GPUs) and through the device EP executor, same config, seed and
# steps: validation losses side by side, step time. Binary built here and
# carried in .device/:  cargo build --release -p lrmoe --features nccl
. "$(dirname "$0")/lib.sh"
L=.device/lrmoe
STEPS=${STEPS:-300}
printf '[moe]\nreplica_slots_per_rank = 0\n[run]\neval_every = 100\n' > "$OUT/norep.toml"
for mode in ${MODES:-full lrmoe}; do
  for ex in host device; do
    S=$(date +%s.%N)
    timeout 400 $L launch --nproc 2 -- train --config "$OUT/norep.toml" --mode $mode --device cuda \
      --executor $ex --steps "$STEPS" --out "$OUT/run-$mode-$ex" --no-progress > "$OUT/train-$mode-$ex.log" 2>&1
    echo "$mode/$ex: rc=$? wall $(python3 -c "import time; print(f'{time.time() - $S:.1f}')") s; $(grep -o 'step=[0-9]* val_loss=[0-9.]*' "$OUT/train-$mode-$ex.log" | tr '\n' ' ')| $(grep -v eval "$OUT/train-$mode-$ex.log" | tail -1)"
  done
done
python3 - "$OUT" "${MODES:-full lrmoe}" <<'PY'
import json, sys
out = sys.argv[1]
for run in [f"{m}-{e}" for m in (sys.argv[2] if len(sys.argv) > 2 else "full lrmoe").split() for e in ("host", "device")]:
    rows = [json.loads(l) for l in open(f"{out}/run-{run}/metrics.jsonl")]
    moe = rows[-1]["moe_s"]; wall = rows[-1]["wall_s"]
    kept = sum(l["kept_fraction"] for r in rows for l in r["layers"]) / sum(len(r["layers"]) for r in rows)
    print(f"{run}: steps {len(rows)}, train wall {wall:.1f} s, MoE-layer time {moe:.1f} s, mean kept fraction {kept:.3f}")
PY
