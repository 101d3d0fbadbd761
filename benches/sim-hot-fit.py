#!/usr/bin/env python3
"""Fits `cluster.call_overhead_us` to one row of the 2-GPU time-to-loss table.

Usage: sim-hot-fit.py RUN_DIR SEED [CALL_US] — RUN_DIR is `sim-device.sh`'s
`hot` part's output: every mode's `metrics.jsonl`. The measured rows are
the table's on 2 × H200 (2026-12-01, docs/benchmarks.md, "Time to a
validation loss"). Without CALL_US (a run with `call_overhead_us = 0`):
fits the fixed cost per MoE collective call that the links do not explain,
from fixed ownership's MoE-layer seconds per step measured and simulated,
and prints every mode's simulated MoE-layer seconds to the target with and
without it beside the measured ones. With CALL_US (a run that had it): the
figures as simulated.
"""
import json
import statistics
import sys

TARGET = 2.1
# (steps to 2.1, MoE-layer seconds) per seed, measured on 2 × H200.
MEASURED = {
    "full": {1: (450, 29.4), 2: (450, 30.0), 3: (400, 30.3)},
    "replicate": {1: (450, 16.4), 2: (400, 14.1), 3: (400, 16.2)},
    "capacity": {1: (650, 12.2), 2: (650, 10.4), 3: (700, 14.7)},
    "lrmoe": {1: (500, 9.8), 2: (450, 8.8), 3: (400, 8.5)},
}


def to_target(run_dir, mode):
    """(steps, simulated MoE s, MoE calls) to the first evaluation at or
    below the target, and the median simulated MoE s and calls a step."""
    rows = [json.loads(line) for line in open(f"{run_dir}/{mode}/metrics.jsonl")]
    rows = [r for r in rows if "simulated" in r]
    moe = calls = 0.0
    reached = None
    for r in rows:
        moe += r["simulated"]["moe_s"]
        calls += r["simulated"]["moe_calls"]
        v = r.get("val_loss")
        if v is not None and v <= TARGET:
            reached = (r["step"], moe, calls)
            break
    med = (
        statistics.median(r["simulated"]["moe_s"] for r in rows),
        statistics.median(r["simulated"]["moe_calls"] for r in rows),
    )
    return reached, med


def main():
    run_dir, seed = sys.argv[1], int(sys.argv[2])
    given = float(sys.argv[3]) if len(sys.argv) > 3 else None
    res = {m: to_target(run_dir, m) for m in MEASURED}
    if given is None:
        (_, (moe, calls)) = res["full"]
        steps, secs = MEASURED["full"][seed]
        c = (secs / steps - moe) / calls
    else:
        c = 0.0
    print("| mode | steps (sim. / measured) | MoE calls a step | simulated MoE s | + fitted cost | measured MoE s | ratio |")
    print("|---|---|---|---|---|---|---|")
    for m, (reached, (moe, calls)) in res.items():
        steps, secs = MEASURED[m][seed]
        if reached is None:
            print(f"| {m} | not reached / {steps} | {calls:.0f} | — | — | {secs} | — |")
            continue
        st, sim, n = reached
        pred = sim + c * n
        print(f"| {m} | {st} / {steps} | {calls:.0f} | {sim:.2f} | {pred:.2f} | {secs} | {pred / secs:.2f} |")
    if given is None:
        print(f"call_overhead_us {c * 1e6:.1f}")


if __name__ == "__main__":
    main()
