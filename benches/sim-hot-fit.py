#!/usr/bin/env python3
"""Fits a fixed executor cost to one row of the 2-GPU time-to-loss table.

Usage: sim-hot-fit.py RUN_DIR SEED [CALL_US [LAYER_US]] — RUN_DIR is
`sim-device.sh`'s `hot` part's output: every mode's `metrics.jsonl`. The
measured rows are the table's on 2 × H200 (2026-12-01, docs/benchmarks.md,
"Time to a validation loss").

Without CALL_US (a run with both costs 0) it fits, to fixed ownership's
MoE-layer seconds per step measured and simulated, each of two fixed costs
the ranks' timed work and the links do not explain:
  * per collective call (`cluster.call_overhead_us`), and
  * per MoE-layer call, each forward and each backward of each micro-batch
    (`cluster.layer_call_overhead_us`),
and prints every mode's simulated MoE-layer seconds to the target without
a fixed cost and with each fitted one, beside the measured, and whether
each model ranks the modes as the measurement did. Fixed ownership's row of
SEED is the fit; the other modes, and the other seeds' rows, are held out.
With CALL_US and LAYER_US (a run that had them): the figures as simulated.
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


def layer_calls(r):
    """MoE-layer calls of a step, forward and backward counted apart."""
    s = r["simulated"]
    each_way = s.get("moe_layer_calls") or r["micro_batches"] * len(r["layers"])
    return 2 * each_way


def to_target(run_dir, mode):
    """(steps, simulated MoE s, collective calls, layer calls) to the first
    evaluation at or below the target, and the median simulated MoE s,
    collective calls and layer calls a step."""
    rows = [json.loads(line) for line in open(f"{run_dir}/{mode}/metrics.jsonl")]
    rows = [r for r in rows if "simulated" in r]
    moe = calls = layers = 0.0
    reached = None
    for r in rows:
        moe += r["simulated"]["moe_s"]
        calls += r["simulated"]["moe_calls"]
        layers += layer_calls(r)
        v = r.get("val_loss")
        if v is not None and v <= TARGET:
            reached = (r["step"], moe, calls, layers)
            break
    med = (
        statistics.median(r["simulated"]["moe_s"] for r in rows),
        statistics.median(r["simulated"]["moe_calls"] for r in rows),
        statistics.median(layer_calls(r) for r in rows),
    )
    return reached, med


def order(values):
    return [m for m, _ in sorted(values.items(), key=lambda kv: kv[1])]


def main():
    run_dir, seed = sys.argv[1], int(sys.argv[2])
    given = len(sys.argv) > 3
    res = {m: to_target(run_dir, m) for m in MEASURED}
    if given:
        c_call = c_layer = 0.0
    else:
        (_, (moe, calls, layers)) = res["full"]
        steps, secs = MEASURED["full"][seed]
        c_call = (secs / steps - moe) / calls
        c_layer = (secs / steps - moe) / layers
    print("| mode | steps (sim. / measured) | collectives, MoE-layer calls a step | simulated MoE s | + a cost per collective | + a cost per MoE-layer call | measured MoE s |")
    print("|---|---|---|---|---|---|---|")
    sims, per_call, per_layer, meas = {}, {}, {}, {}
    for m, (reached, (_, calls, layers)) in res.items():
        steps, secs = MEASURED[m][seed]
        meas[m] = secs
        if reached is None:
            print(f"| {m} | not reached / {steps} | {calls:.0f}, {layers:.0f} | — | — | — | {secs} |")
            continue
        st, sim, n, nl = reached
        sims[m], per_call[m], per_layer[m] = sim, sim + c_call * n, sim + c_layer * nl
        print(f"| {m} | {st} / {steps} | {calls:.0f}, {layers:.0f} | {sim:.2f} | {per_call[m]:.2f} ({per_call[m] / secs:.2f}) "
              f"| {per_layer[m]:.2f} ({per_layer[m] / secs:.2f}) | {secs} |")
    print(f"measured order: {' < '.join(order(meas))}")
    for name, v in [("as simulated", sims), ("+ per collective", per_call), ("+ per MoE-layer call", per_layer)]:
        if len(v) == len(meas):
            o = order(v)
            print(f"{name}: {' < '.join(o)} ({'same' if o == order(meas) else 'differs'})")
    if not given:
        print(f"fitted: call_overhead_us {c_call * 1e6:.1f}, or layer_call_overhead_us {c_layer * 1e6:.1f}")


if __name__ == "__main__":
    main()
