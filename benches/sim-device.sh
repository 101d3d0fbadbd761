#!/bin/bash
# N GPUs simulated on one (issue 30), in parts (PARTS, default
# "tests layer train"):
#   tests   the in-process device-to-device exchanges and sums against host
#           staging, bit for bit, timed and untimed; the model tests;
#   layer   the MoE layer on N simulated GPUs beside the one-GPU layer
#           (`lrmoe-sim-bench`, SIM_RANKS, default "2 4 8");
#   train   `lrmoe train` with N staged ranks (RANKS, default "1 2 4 8")
#           on MODEL (mini: qwen3-moe-mini, 32 × 512 tokens; a3b2: two
#           layers of the Qwen3-30B-A3B shape, 8 × 2048), same global batch
#           at every N: wall tokens/s and the simulated step
#           (metrics.jsonl's `simulated`);
#   compare `lrmoe train --compare` on CMP_MODEL (mini, default: 32 × 512
#           tokens a step, evaluations every 25 steps; a3b2: two layers of
#           the Qwen3-30B-A3B shape, 32 × 512 — four sequences per rank at
#           8 ranks, so fixed ownership can micro-batch — evaluations every
#           10 steps) with CMP_RANKS (default 8) staged ranks under one
#           budget (`--fit-budget`): MODES (default full, replicate, lrmoe,
#           capacity) to TARGET (default 1.9; 2.4 for a3b2) within CMP_STEPS
#           (default 300) or CMP_MIN minutes (default 1.6) each, the
#           simulated times beside the measured ones; SKEW sets
#           `moe.zipf_skew` (default 0), BIAS `moe.expert_bias_rate` (the
#           loss-free balancing bias; default 0), RULE `moe.selection_rule`
#           (default priority; top_q is the paper's), SEED the seed,
#           MOE_EXTRA more lines of the [moe] section (for example
#           "replica_slots_per_rank = 0"; "budget_forward = false" binds
#           the budget to the backward alone, as every comparison before
#           session 52 did — since then it holds the forward's rows too,
#           and LRMoE splits its steps as fixed ownership does).
#           NEAR_EVERY evaluates every that many steps as well once
#           the last evaluation is within NEAR_MARGIN (default 0.1) of
#           the target (`run.eval_near_every`; default 0: off), so the
#           steps to the target are read on a finer grid.
#           CMP_MODEL=a3b2v is the A3B shape with a 128-symbol
#           vocabulary (16 ranks' replicated dense state fits one GPU);
#           CMP_SEQ × CMP_BATCH (default 512 × 32) the tokens a step,
#           EVERY the evaluation interval, FIT=0 runs each mode without
#           the budget (fixed ownership unbatched: the memory it needs),
#           TAG names the run's files ($OUT/cmpTAG, cmpTAG.log),
#           CMP_TIMEOUT the seconds the whole comparison may take
#           (default 590: one device call; lower it to fit two in one).
#           Modes that do not fit one call run in parts (MODES=full,symi
#           in one, lrmoe,lrmoe-top-q,capacity in the next, the same
#           settings and seed) and join with `lrmoe redraw --input
#           A/compare.json --input B/compare.json --out DIR`; a mode
#           run again (its first run cut off) replaces the earlier run
#           with `redraw --rerun`. The A3B 8-rank table of five modes:
#           MODES=full,symi,lrmoe,capacity,lrmoe-top-q CMP_MIN=1.1
#           CMP_TIMEOUT=288, two settings a call (~4.7 min each).
#           Each mode's simulated time a step by phase, the host
#           seconds of the same pieces, and the median of the host probe
#           (a fixed host workload timed each step), go to phases.json beside
#           compare.json (and its largest phases to the log).
#           CMP_KEEP=plots keeps only compare.json, phases.json and
#           compare-simulated.svg of a comparison's files (a device call
#           returns at most 8 files).
#           The A3B-shape table of docs/benchmarks.md:
#           PARTS=compare CMP_MODEL=a3b2 SKEW=0.3 SEED=0 CMP_MIN=1.2 \
#             MODES=full,symi,lrmoe,capacity bash benches/sim-device.sh
#   hot     the 2-GPU time-to-loss table of docs/benchmarks.md ("Time to a
#           validation loss", measured on 2 × H200 on 2026-12-01 with the
#           budget binding the backward alone: BUDGET_FORWARD=false repeats
#           that; the default, true, holds LRMoE's forward too) simulated
#           with 2 staged ranks, the same command: benches/hot-compare.toml,
#           all four modes to 2.1, `--fit-budget`, seed SEED (default 1);
#           CALL_US sets `cluster.call_overhead_us`, LAYER_US
#           `cluster.layer_call_overhead_us` (default 0 both); files in
#           $OUT/hotTAG; HOT_TIMEOUT the seconds the run may take
#           (default 590). `python3 benches/sim-hot-fit.py $OUT/hotTAG SEED`
#           fits either cost to fixed ownership's measured row and says
#           whether each ranks the modes as the GPUs did.
# Build here and carry .device/:
#   cargo build --release -p lrmoe --features cuda && cp target/release/lrmoe .device/
#   cargo build --release -p lrmoe-benches --features cuda --bin lrmoe-sim-bench && cp target/release/lrmoe-sim-bench .device/
#   cargo test --release -p layer --features cuda --test gpu_layer --no-run   # → .device/layer-gpu-tests
#   cargo test --release -p lrmoe --features cuda --test gpu_model --no-run   # → .device/model-gpu-tests
. "$(dirname "$0")/lib.sh"
need .device/lrmoe
gpu_info
part() { case " ${PARTS:-tests layer train} " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
if part tests; then
  need .device/layer-gpu-tests .device/model-gpu-tests
  time .device/layer-gpu-tests --ignored --test-threads 1 --nocapture 2>&1 | grep -E "bit for bit|timed:|test result|panicked|FAILED|^test " | tail -30
  time .device/model-gpu-tests --ignored --test-threads 1 2>&1 | grep -E "test result|panicked|FAILED|^test " | tail -12
fi
if part layer; then
  need .device/lrmoe-sim-bench
  time .device/lrmoe-sim-bench ${SIM_RANKS:-2 4 8} 2>&1 | tail -12
fi
if part train; then
  case ${MODEL:-mini} in
    mini) cfgj=examples/qwen3-moe-mini.config.json; layers=4; seq=512; batch=32 ;;
    a3b2) cfgj=examples/qwen3-30b-a3b.config.json; layers=2; seq=2048; batch=8 ;;
  esac
  for r in ${RANKS:-1 2 4 8}; do
    cat > /tmp/sim$r.toml <<T
steps = ${STEPS:-30}
[data]
seq_len = $seq
batch_size = $batch
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
    /usr/bin/time -f "ranks $r: %e s wall" timeout 300 .device/lrmoe train --device cuda --model-config $cfgj --layers $layers \
      --config /tmp/sim$r.toml --no-progress --force 2>&1 | tail -1
    python3 - "$r" "$((seq * batch))" <<'P'
import json, statistics, sys
r, tokens = sys.argv[1], int(sys.argv[2])
rows = [json.loads(l) for l in open(f"/tmp/sim{r}/metrics.jsonl")][5:]
tps = statistics.median(x["tokens_per_s"] for x in rows)
sims = [x["simulated"] for x in rows if "simulated" in x]
line = f"ranks {r}: wall tokens/s {tps:,.0f}, loss {rows[-1]['loss']:.4f}"
if sims:
    med = lambda k: statistics.median(s[k] for s in sims)
    ph = {p: statistics.median(s["phases"].get(p, 0.0) for s in sims) for p in sims[0]["phases"]}
    line += (f"; simulated step {med('step_s')*1e3:.2f} ms = {tokens/med('step_s'):,.0f} tokens/s, MoE {med('moe_s')*1e3:.2f} ms,"
             f" collectives {med('collectives_s')*1e3:.2f} ms, all ranks' work {med('work_all_ranks_s')*1e3:.2f} ms; phases ms "
             + ", ".join(f"{p} {v*1e3:.2f}" for p, v in ph.items()))
    held = [max(s.get("held_bytes") or [0]) for s in sims]
    if max(held) > 0:
        line += f"; most one rank held at once {max(held) / 2**20:,.0f} MiB"
print(line)
P
  done
fi
if part compare; then
  case ${CMP_MODEL:-mini} in
    mini) cmpj="examples/qwen3-moe-mini.config.json"; every=25; evals=2; target=${TARGET:-1.9} ;;
    a3b2) cmpj="examples/qwen3-30b-a3b.config.json --layers 2"; every=10; evals=1; target=${TARGET:-2.4} ;;
    a3b2v) # the same with a 128-symbol vocabulary (the corpus has 65): the
      # MoE layers are the A3B shape's, the replicated embedding and head
      # 2 × 128 × 2048 instead of 2 × 151 936 × 2048, so that 16 ranks' dense
      # copies fit one GPU
      python3 -c 'import json,sys; c=json.load(open(sys.argv[1])); c["vocab_size"]=128; json.dump(c,open("/tmp/a3b-v128.json","w"))' \
        examples/qwen3-30b-a3b.config.json
      cmpj="/tmp/a3b-v128.json --layers 2"; every=10; evals=1; target=${TARGET:-2.4} ;;
  esac
  every=${EVERY:-$every}
  fit=--fit-budget
  [ "${FIT:-1}" = 0 ] && fit=
  cat > /tmp/cmp.toml <<T
[data]
seq_len = ${CMP_SEQ:-512}
batch_size = ${CMP_BATCH:-32}
[moe]
zipf_skew = ${SKEW:-0.0}
expert_bias_rate = ${BIAS:-0.0}
selection_rule = "${RULE:-priority}"
${MOE_EXTRA:-}
[run]
eval_every = $every
eval_batches = $evals
eval_near_every = ${NEAR_EVERY:-0}
eval_near_margin = ${NEAR_MARGIN:-0.1}
checkpoint = false
T
  # A whole-comparison limit below the modes' own caps cuts the last mode
  # off before its target, and its run is lost (session 46 lost three so).
  python3 - "${MODES:-full,replicate,lrmoe,capacity}" "${CMP_MIN:-1.6}" "${CMP_TIMEOUT:-590}" <<'P'
import sys
modes, cap, limit = len(sys.argv[1].split(",")), float(sys.argv[2]), float(sys.argv[3])
if limit < modes * cap * 60:
    print(f"warning: CMP_TIMEOUT={limit:.0f} s is less than {modes} modes × CMP_MIN {cap} min "
          f"({modes * cap * 60:.0f} s): the last mode may be cut off before its target")
P
  # shellcheck disable=SC2086 # $cmpj carries the config and its layer count
  time timeout ${CMP_TIMEOUT:-590} .device/lrmoe train --device cuda --executor device --ranks ${CMP_RANKS:-8} \
    --model-config $cmpj --config /tmp/cmp.toml --steps ${CMP_STEPS:-300} \
    --seed ${SEED:-0} --compare --modes ${MODES:-full,replicate,lrmoe,capacity} $fit \
    --target-val-loss $target --max-minutes ${CMP_MIN:-1.6} --out "$OUT/cmp${TAG:-}" --no-progress > "$OUT/cmp${TAG:-}.log" 2>&1
  echo "compare: rc=$?"
  # Each mode's simulated seconds a step by phase (medians over its steps
  # after the fifth, from metrics.jsonl): phases.json, and the largest
  # phases in the log, so that a comparison says where a mode's time went.
  python3 - "$OUT/cmp${TAG:-}" <<'P'
import json, os, sys
d = sys.argv[1]; out = {}
for mode in sorted(os.listdir(d)):
    p = os.path.join(d, mode, "metrics.jsonl")
    if not os.path.exists(p):
        continue
    rows = [json.loads(l) for l in open(p)]
    sims = [r["simulated"] for r in rows[5:] if r.get("simulated")]
    if not sims:
        continue
    med = lambda xs: sorted(xs)[len(xs) // 2]
    names = sorted({k for s in sims for k in s.get("phases", {})})
    out[mode] = {"steps": len(sims), "step_s": med([s["step_s"] for s in sims]), "moe_s": med([s["moe_s"] for s in sims]),
                 "phases": {k: med([s.get("phases", {}).get(k, 0.0) for s in sims]) for k in names},
                 "host_phases": {k: med([s.get("host_phases", {}).get(k, 0.0) for s in sims]) for k in names}}
    # What the overlaps saved (cluster.overlap): the step and the MoE
    # layers without them are these plus step_s and moe_s.
    if any("moe_overlap_saved_s" in s for s in sims):
        out[mode]["overlap_saved_s"] = med([s.get("overlap_saved_s", 0.0) for s in sims])
        out[mode]["moe_overlap_saved_s"] = med([s.get("moe_overlap_saved_s", 0.0) for s in sims])
        out[mode]["moe_s_without_overlap"] = med([s["moe_s"] + s.get("moe_overlap_saved_s", 0.0) for s in sims])
    probes = [s["host_probe_s"] for s in sims if s.get("host_probe_s")]
    if probes:
        out[mode]["host_probe_s"] = med(probes)
    # Replicas placed per layer call (the controller's, on every rank).
    reps = [l.get("replicas", 0) for r in rows[5:] for l in r.get("layers", [])]
    if reps:
        out[mode]["replicas_per_call"] = sum(reps) / len(reps)
    top = sorted(out[mode]["phases"].items(), key=lambda kv: -kv[1])[:10]
    host = out[mode]["host_phases"]
    probe = f", host probe {out[mode]['host_probe_s'] * 1e3:.3f} ms" if probes else ""
    if reps:
        probe += f", {out[mode]['replicas_per_call']:.2f} replicas a layer call"
    if "moe_overlap_saved_s" in out[mode]:
        probe += f", overlaps saved {out[mode]['moe_overlap_saved_s'] * 1e3:.2f} ms of the MoE layers'"
    print(f"phases {mode}: step {out[mode]['step_s'] * 1e3:.2f} ms, MoE {out[mode]['moe_s'] * 1e3:.2f} ms{probe}; "
          + "; ".join(f"{k} {v * 1e3:.2f} (host {host.get(k, 0.0) * 1e3:.2f})" for k, v in top))
json.dump(out, open(os.path.join(d, "phases.json"), "w"), indent=1)
P
  if [ "${CMP_KEEP:-all}" = plots ]; then
    # Only compare.json, phases.json and the simulated plot come back (a
    # device call returns at most 8 files; the table is in the log).
    find "$OUT/cmp${TAG:-}" -type f ! -name compare.json ! -name phases.json ! -name compare-simulated.svg -delete
    find "$OUT/cmp${TAG:-}" -type d -empty -delete
  fi
  grep -E "^\||^Target|^Simulated" "$OUT/cmp${TAG:-}.log"
  grep -iE "error|panicked" "$OUT/cmp${TAG:-}.log" | head -3
fi
if part hot; then
  { cat benches/hot-compare.toml; printf '[cluster]\ncall_overhead_us = %s\nlayer_call_overhead_us = %s\n' "${CALL_US:-0}" "${LAYER_US:-0}"; } > /tmp/hot.toml
  time timeout ${HOT_TIMEOUT:-590} .device/lrmoe train --config /tmp/hot.toml --compare --modes full,replicate,capacity,lrmoe \
    --target-val-loss 2.1 --fit-budget --budget-forward "${BUDGET_FORWARD:-true}" --seed "${SEED:-1}" --device cuda --executor device \
    --out "$OUT/hot${TAG:-}" --no-progress > "$OUT/hot${TAG:-}.log" 2>&1
  echo "hot: rc=$?"
  grep -E "^\|" "$OUT/hot${TAG:-}.log"
  grep -iE "error|panicked" "$OUT/hot${TAG:-}.log" | head -3
fi
