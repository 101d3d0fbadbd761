#!/usr/bin/env python3
"""Fits `cluster.call_overhead_us` to one row of the 2-GPU time-to-loss table.

Usage: sim-hot-fit.py RUN_DIR SEED — RUN_DIR is `sim-device.sh`'s `hot`
part's output (CALL_US=0): every mode's `metrics.jsonl`. The measured row
is fixed ownership's on 2 × H200 (2026-12-01, docs/benchmarks.md, "Time to
a validation loss"): its MoE-layer seconds per step. The simulated one is
the median simulated MoE-layer time of a step; the difference, spread over
the step's MoE collectives, is the fixed cost per collective call that the
links do not explain. Prints it in µs, and every mode's per-step figures.
"""
import json
import statistics
import sys

# (steps to 2.1, MoE-layer seconds) per seed, measured on 2 × H200.
MEASURED = {
    "full": {1: (450, 29.4), 2: (450, 30.0), 3: (400, 30.3)},
    "replicate": {1: (450, 16.4), 2: (400, 14.1), 3: (400, 16.2)},
    "capacity": {1: (650, 12.2), 2: (650, 10.4), 3: (700, 14.7)},
    "lrmoe": {1: (500, 9.8), 2: (450, 8.8), 3: (400, 8.5)},
}


def per_step(run_dir, mode):
    rows = [json.loads(line) for line in open(f"{run_dir}/{mode}/metrics.jsonl")]
    sims = [r["simulated"] for r in rows if "simulated" in r]
    return (
        statistics.median(s["moe_s"] for s in sims),
        statistics.median(s["moe_calls"] for s in sims),
    )


def main():
    run_dir, seed = sys.argv[1], int(sys.argv[2])
    for mode in MEASURED:
        moe, calls = per_step(run_dir, mode)
        steps, secs = MEASURED[mode][seed]
        print(
            f"{mode}: simulated {moe * 1e3:.2f} ms and {calls} MoE calls a step; "
            f"measured {secs / steps * 1e3:.2f} ms a step"
        )
    moe, calls = per_step(run_dir, "full")
    steps, secs = MEASURED["full"][seed]
    fitted = (secs / steps - moe) / calls * 1e6
    print(f"call_overhead_us {fitted:.1f}")


if __name__ == "__main__":
    main()
