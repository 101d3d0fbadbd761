"""Replay's predictions beside a measured `lrmoe train --compare` run
(issue 14): for each strategy the run trained (full → replay's fixed
ownership, replicate → replication, lrmoe → LRMoE), `lrmoe replay` reads
that run's own per-step routed loads (metrics.jsonl) under the run's
per-rank budget, and this prints, per strategy, the peak pairs per rank
(the quantity both size their token buffers by) predicted and measured,
and the micro-batches the run split its steps into. A micro-batched step
logs its first micro-batch: its loads and peak are scaled by the count.

  python3 benches/replay-vs-run.py LRMOE_BIN RUN_DIR --budget-bytes B \\
      --element-bytes 4 --ranks 2 --hidden 128 --ffn 256 [--slots 1] [--tile-trim 0.0625]

RUN_DIR is the --out of `lrmoe train --compare`; B and the element size
are what the run logged ("per-rank memory budget of one layer call").
"""
import argparse
import csv
import json
import math
import os
import subprocess

ap = argparse.ArgumentParser()
ap.add_argument("lrmoe")
ap.add_argument("run")
ap.add_argument("--budget-bytes", type=int, required=True)
ap.add_argument("--element-bytes", type=int, default=4)
ap.add_argument("--ranks", type=int, default=2)
ap.add_argument("--hidden", type=int, default=128)
ap.add_argument("--ffn", type=int, default=256)
ap.add_argument("--slots", type=int, default=1)
ap.add_argument("--buffer-fraction", type=float, default=0.6)
# The run's moe.tile_trim on the GPU executors (0 for the host executor).
ap.add_argument("--tile-trim", type=float, default=0.0)
a = ap.parse_args()

row = 2 * a.hidden * a.element_bytes  # [x | g·δ] per kept pair
print(f"budget {a.budget_bytes / 2**20:.2f} MiB per rank and layer call; row {row} B\n")
print("| strategy (run mode) | steps | measured peak pairs/rank: mean / max | replay predicted: mean / max | predicted ÷ measured (mean of steps) | measured micro-batches (mean) | replay: steps within budget | executor's buffer bytes ÷ replay's (per micro-batch) |")
print("|---|---|---|---|---|---|---|---|")
notes = []
for mode, strat in [("full", "Fixed"), ("replicate", "Replication"), ("lrmoe", "Lrmoe")]:
    m = os.path.join(a.run, mode, "metrics.jsonl")
    if not os.path.exists(m):
        continue
    rows = [json.loads(l) for l in open(m)]
    out = os.path.join(a.run, f"replay-{mode}")
    # A micro-batched step logs its first micro-batch's loads: scale them
    # to the whole step (what fixed ownership would hold without splitting).
    os.makedirs(out, exist_ok=True)
    scaled = os.path.join(out, "step-loads.jsonl")
    with open(scaled, "w") as f:
        for r in rows:
            mb = r.get("micro_batches", 1)
            for l in r["layers"]:
                l["tokens_per_expert"] = [t * mb for t in l["tokens_per_expert"]]
            f.write(json.dumps(r) + "\n")
    subprocess.run([a.lrmoe, "replay", "--lrmoe-metrics", scaled, "--ranks", str(a.ranks), "--hidden", str(a.hidden),
                    "--ffn", str(a.ffn), "--budget-mib", str(a.budget_bytes / 2**20), "--replica-slots", str(a.slots),
                    "--replica-memory-fraction", "1.0", "--element-bytes", str(a.element_bytes),
                    "--tile-trim", str(a.tile_trim), "--out", out],
                   check=True, stdout=subprocess.DEVNULL)
    pred = {int(r["step"]): r for r in csv.DictReader(open(os.path.join(out, "replay.csv"))) if r["strategy"] == strat}
    # Measured: the busiest rank's pairs in any layer; a micro-batched step
    # reports one micro-batch's, so scale by the micro-batches for the step.
    meas, ratio, fits, micro, bytes_ratio = [], [], 0, [], []
    for i, r in enumerate(rows):
        mb = r.get("micro_batches", 1)
        peak = max(l["peak_rank_pairs"] for l in r["layers"]) * mb
        p = pred.get(i)
        if p is None:
            continue
        pp = int(p["buffer_bytes"]) / row
        meas.append(peak)
        ratio.append(pp / peak if peak else float("nan"))
        fits += p["fits"] == "true"
        micro.append(mb)
        # The executor's own accounting (every backward buffer it allocates)
        # against replay's token buffers ([x | g·δ] rows) for one micro-batch.
        pb = int(p["buffer_bytes"]) / mb
        if pb:
            bytes_ratio.append(max(l["buffer_bytes"] for l in r["layers"]) / pb)
    if not meas:
        continue
    preds = [int(pred[i]["buffer_bytes"]) / row for i in range(len(rows)) if i in pred]
    dev = [r["device_mem_bytes"] for r in rows if r.get("device_mem_bytes")]
    if dev:
        notes.append(f"{mode}: device memory in use after a step, max {max(dev) / 2**20:.0f} MiB")
    print(f"| {strat} ({mode}) | {len(meas)} | {sum(meas)/len(meas):.0f} / {max(meas)} | {sum(preds)/len(preds):.0f} / {max(preds):.0f} | "
          f"{sum(ratio)/len(ratio):.3f} | {sum(micro)/len(micro):.2f} | {fits} of {len(meas)} | "
          f"{min(bytes_ratio):.2f}–{max(bytes_ratio):.2f} |")
if notes:
    print()
    print("; ".join(notes))
