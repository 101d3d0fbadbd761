#!/usr/bin/env bash
# Which pairs to keep (issue 14, item 3): steps to a target validation loss
# for each selection rule at budgets that keep ~60 / 80 / 95% of the pairs,
# three seeds each, on the CPU (steps do not depend on the device). Runs the
# jobs in parallel on a many-core machine (e.g. the device machine's CPUs):
#   cargo build --release -p lrmoe   (carried as .device/lrmoe)
#   JOBS=16 TARGET=2.0 bash benches/selection-study.sh
# Rules: top_q (the paper), random_q, proportional (1/π reweighted),
# priority (threshold-reweighted), and top_q with surplus-only quotas
# (`moe.surplus_only`: only ranks above their fair share are trimmed); the
# exact backward (mode full) is the reference. Default model, in-process
# ranks, evaluation every 25 steps.
OUT=${OUT:-/tmp/lrmoe-out}
. "$(dirname "$0")/lib.sh"
L=${LRMOE:-.device/lrmoe}
need "$L"
mkdir -p "$OUT/study"
printf '[run]\neval_every = 25\neval_batches = 8\ncheckpoint_every = 0\n' > "$OUT/study/eval25.toml"
jobs() {
  for seed in ${SEEDS:-0 1 2}; do
    echo "full - 1.0 $seed"
    for b in ${BUDGETS:-0.6 0.8 0.95}; do
      for rule in top_q random_q proportional priority surplus; do
        echo "lrmoe $rule $b $seed"
      done
    done
  done
}
run_one() {
  local mode=$1 rule=$2 b=$3 seed=$4
  local name="$mode-$rule-$b-$seed"
  local extra=()
  case $rule in
    surplus) printf '[run]\neval_every = 25\neval_batches = 8\ncheckpoint_every = 0\n[moe]\nsurplus_only = true\n' > "$OUT/study/$name.toml"
             extra=(--config "$OUT/study/$name.toml" --selection-rule top_q) ;;
    -) extra=(--config "$OUT/study/eval25.toml") ;;
    *) extra=(--config "$OUT/study/eval25.toml" --selection-rule "$rule") ;;
  esac
  RAYON_NUM_THREADS=${THREADS:-2} timeout "${JOB_S:-560}" "$L" train "${extra[@]}" --mode "$mode" \
    --buffer-fraction "$b" --seed "$seed" --steps "${MAX_STEPS:-2500}" --target-val-loss "${TARGET:-2.0}" \
    --out "$OUT/study/$name" --force --no-progress > "$OUT/study/$name.log" 2>&1
  python3 - "$OUT/study/$name" "$mode" "$rule" "$b" "$seed" "$(tail -1 "$OUT/study/$name.log")" <<'PY'
import json, sys
d, mode, rule, b, seed, summary = sys.argv[1:7]
try:
    rows = [json.loads(l) for l in open(f"{d}/metrics.jsonl")]
except OSError:
    rows = []
reached = "target validation loss reached" in summary
kept = [l["kept_fraction"] for r in rows for l in r["layers"]]
last = rows[-1] if rows else {"step": 0, "moe_s": 0.0, "wall_s": 0.0}
print(f"{mode},{rule},{b},{seed},{int(reached)},{last['step']},{last['moe_s']:.2f},{last['wall_s']:.2f},{sum(kept)/max(len(kept),1):.3f}")
PY
}
export -f run_one
export OUT L
echo "mode,rule,budget,seed,reached,steps,moe_s,wall_s,kept" > "$OUT/study/results.csv"
jobs | xargs -P "${JOBS:-16}" -L 1 bash -c 'run_one $0 $1 $2 $3' >> "$OUT/study/results.csv"
python3 - "$OUT/study/results.csv" <<'PY'
import csv, statistics as st, sys
rows = list(csv.DictReader(open(sys.argv[1])))
full = [int(r["steps"]) for r in rows if r["mode"] == "full" and r["reached"] == "1"]
fm = st.mean(full) if full else float("nan")
full_moe = [float(r["moe_s"]) for r in rows if r["mode"] == "full" and r["reached"] == "1"]
print(f"exact backward: steps to target {', '.join(map(str, full))} (mean {fm:.0f}); MoE-layer s {', '.join(f'{x:.1f}' for x in full_moe)}")
print("| budget | rule | reached | steps to target (seeds) | mean steps / exact | mean kept | mean MoE-layer s / exact |")
print("|---|---|---|---|---|---|---|")
for b in sorted({r["budget"] for r in rows if r["mode"] == "lrmoe"}):
    for rule in ["top_q", "random_q", "proportional", "priority", "surplus"]:
        sel = [r for r in rows if r["mode"] == "lrmoe" and r["budget"] == b and r["rule"] == rule]
        if not sel: continue
        ok = [r for r in sel if r["reached"] == "1"]
        steps = [int(r["steps"]) for r in sel]
        ms = st.mean([int(r["steps"]) for r in ok]) / fm if ok else float("nan")
        mm = st.mean([float(r["moe_s"]) for r in ok]) / st.mean(full_moe) if ok and full_moe else float("nan")
        kept = st.mean(float(r["kept"]) for r in sel)
        print(f"| {b} | {rule} | {len(ok)}/{len(sel)} | {', '.join(map(str, steps))} | {ms:.2f} | {kept:.3f} | {mm:.2f} |")
PY
