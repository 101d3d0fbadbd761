"""The device model's step by part (`LRMOE_PARTS=1 lrmoe train --device cuda`)
beside each part's device limit: the bf16 dense GEMM rate (989 TFLOP/s on an
H200 or an H100 SXM) for GEMM parts, HBM bandwidth (4.8 TB/s on an H200,
3.35 on an H100 SXM) for the others.

    python3 benches/parts.py LOG CONFIG LAYERS SEQ BATCH [SKIP] [--torch FILE] [--gpu NAME]

NAME is the GPU the log came from (`nvidia-smi --query-gpu=name`); without
it, or for a GPU not listed, the limits are an H200's, and the table says
which it used.
LOG is the run's stderr (the `parts_ms` lines); SKIP steps are dropped
(warm-up, default 5); the median of each part over the rest is printed.
FILE is benches/torch_parts.py's output for the same shapes, run in the same
call: PyTorch's time for each part (the faster of eager and compiled), and
ours ÷ PyTorch's, go beside ours.
"""

import json
import re
import sys

# Nominal dense bf16 FLOP/s and HBM bytes/s by GPU name (H100 PCIe before
# H100: the first name contained wins).
LIMITS = [("H200", 989e12, 4.8e12), ("H100 PCIe", 756e12, 2.0e12), ("H100", 989e12, 3.35e12)]
FLOPS, HBM = 989e12, 4.8e12


def device_limits(name):
    """(FLOP/s, HBM bytes/s, label) for GPU `name`; an H200's if unknown."""
    for key, flops, hbm in LIMITS:
        if key in (name or ""):
            return flops, hbm, key
    return FLOPS, HBM, "H200 (GPU not named)" if not name else f"H200 ({name} not listed)"


def limits(c, layers, n, seq, flops=FLOPS, hbm=HBM):
    d, h, kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    dh = c.get("head_dim", d // h)
    v, e, f = c["vocab_size"], c["num_experts"], c["moe_intermediate_size"]
    qd, kd = h * dh, kv * dh
    gemm = lambda flop: flop / flops * 1e3  # noqa: E731
    mem = lambda b: b / hbm * 1e3  # noqa: E731
    attn_f = 2 * n * seq * h * dh  # causal: QKᵀ and PV, half the square each
    dense_params = v * d * 2 + layers * (d * (qd + 2 * kd) + qd * d + d * e)
    expert_params = layers * e * 3 * d * f
    # AdamW reads master, m, v and the gradient and writes master, m, v and
    # the bf16 copy: 28 bytes per parameter with a bf16 gradient, 30 with
    # an f32 one (embedding, router, norms).
    adam_bytes = 28 * (dense_params + expert_params) + 2 * (v * d + layers * d * e)
    return {
        "embedding": (mem(n * d * 4 * 2), "HBM"),
        "norms": (mem(layers * 2 * n * d * (4 + 2 + 4) + n * d * 6), "HBM"),
        "qkv projections": (gemm(layers * 2 * n * d * (qd + 2 * kd)), "GEMM"),
        "attention": (gemm(layers * attn_f), "GEMM"),
        "o projection": (gemm(layers * 2 * n * qd * d), "GEMM"),
        "lm head": (gemm(2 * n * d * v), "GEMM"),
        "cross-entropy": (mem(n * v * 2 * 2), "HBM"),
        "lm head backward": (gemm(4 * n * d * v), "GEMM"),
        "norms backward": (mem(layers * 2 * n * d * 14 + n * d * 12), "HBM"),
        "o projection backward": (gemm(layers * 4 * n * qd * d), "GEMM"),
        "attention backward": (gemm(layers * 2.5 * attn_f), "GEMM"),
        "qkv projections backward": (gemm(layers * 4 * n * d * (qd + 2 * kd)), "GEMM"),
        "embedding backward": (mem(n * d * 4 * 2 + v * d * 4), "HBM"),
        "gradient norm": (mem(2 * (dense_params + expert_params) + 2 * (v * d + layers * d * e)), "HBM"),
        "adamw": (mem(adam_bytes), "HBM"),
    }


def main():
    args = sys.argv[1:]
    torch_ms = {}
    if "--torch" in args:
        i = args.index("--torch")
        for line in open(args[i + 1]):
            if line.startswith("{"):
                r = json.loads(line)
                torch_ms[r["part"]] = r["ms"]
        del args[i:i + 2]
    gpu = None
    if "--gpu" in args:
        i = args.index("--gpu")
        gpu = args[i + 1]
        del args[i:i + 2]
    flops, hbm, label = device_limits(gpu)
    log, cfg_path, layers, seq, batch = args[0:5]
    skip = int(args[5]) if len(args) > 5 else 5
    layers, seq, batch = int(layers), int(seq), int(batch)
    c = json.load(open(cfg_path))
    steps = []
    for line in open(log):
        m = re.search(r"parts_ms=(\{.*?\})(\s|$)", line)
        if m:
            steps.append(json.loads(m.group(1)))
    steps = steps[skip:]
    if not steps:
        sys.exit("no parts_ms lines (LRMOE_PARTS=1, log level info)")
    lim = limits(c, layers, seq * batch, seq, flops, hbm)
    print(f"Limits of an {label}: {flops / 1e12:.0f} TFLOP/s dense bf16, {hbm / 1e12:.2f} TB/s HBM.")
    print()
    total = 0.0
    print("| part | ours ms | PyTorch ms | device limit ms | bound | ours ÷ limit | PyTorch ÷ limit | ours ÷ PyTorch |")
    print("|---|---|---|---|---|---|---|---|")
    both_ours, both_torch = 0.0, 0.0
    for name in steps[-1]:
        vals = sorted(s.get(name, 0.0) for s in steps)
        ms = vals[len(vals) // 2]
        total += ms
        t = torch_ms.get(name)
        if t is not None:
            both_ours += ms
            both_torch += t
        ts = f"{t:.2f}" if t is not None else "—"
        ratio = f"{ms / t:.2f}" if t else "—"
        if name in lim:
            l, bound = lim[name]
            tl = f"{t / l:.2f}" if t is not None else "—"
            print(f"| {name} | {ms:.2f} | {ts} | {l:.2f} | {bound} | {ms / l:.2f} | {tl} | {ratio} |")
        else:
            print(f"| {name} | {ms:.2f} | {ts} | — | — | — | — | {ratio} |")
    for name, t in torch_ms.items():
        if name not in steps[-1]:
            print(f"| {name} (PyTorch only) | — | {t:.2f} | | | | | |")
    if torch_ms:
        print(f"| the parts both have (sum) | {both_ours:.2f} | {both_torch:.2f} | | | | | {both_ours / both_torch:.2f} |")
    print(f"| step (sum of medians) | {total:.2f} | | | | | | |")


if __name__ == "__main__":
    main()
