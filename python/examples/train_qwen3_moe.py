"""Train a small, randomly initialised Hugging Face Qwen3-MoE with and
without lrmoe's MoE layer swapped in, on the same data from the same
initial weights, and print both loss curves and their speed.

    pip install ./python transformers
    python3 python/examples/train_qwen3_moe.py --steps 200

The model comes from a `config.json` (default: `qwen3-moe-tiny.config.json`
beside this script); nothing is downloaded. The data are the bytes of the
Shakespeare corpus built into lrmoe (`crates/lrmoe/data/shakespeare.txt`,
public domain), so the vocabulary is 256.

`--device cuda` trains both in bf16 on the GPU (lrmoe built with its
`cuda` feature); the original's experts run with the fastest
`transformers` experts implementation available (`grouped_mm` where the
installed version has it; `--experts-impl` picks another). Speed is
tokens/s over the steps after `--warmup`, the GPU synchronised at both
ends. The Qwen3-30B-A3B-shaped two-layer config
(`qwen3-moe-a3b-2layer.config.json`) with `--seq 2048 --batch 8` is the
speed comparison of docs/benchmarks.md.
"""

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
CORPUS = HERE.parents[1] / "crates" / "lrmoe" / "data" / "shakespeare.txt"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(HERE / "qwen3-moe-tiny.config.json"))
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mode", default="lrmoe", help="lrmoe's [moe] mode: lrmoe, full, capacity")
    ap.add_argument("--buffer-fraction", type=float, default=0.6)
    ap.add_argument("--selection-rule", default="priority")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (bf16)")
    ap.add_argument("--experts-impl", default="auto",
                    help="the original's transformers experts implementation (auto: grouped_mm "
                         "where available)")
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of the speed")
    ap.add_argument("--json", help="write both curves here")
    args = ap.parse_args()
    try:
        import torch
        import transformers
    except ImportError as e:
        sys.exit(f"this example needs PyTorch and transformers ({e}): pip install torch transformers")
    from lrmoe.torch import replace_moe_blocks

    cfg = transformers.Qwen3MoeConfig(**{
        k: v for k, v in json.loads(Path(args.config).read_text()).items()
        if k not in ("architectures", "model_type")
    })
    torch.manual_seed(args.seed)
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    original = transformers.Qwen3MoeForCausalLM(cfg).to(dev, dtype)
    impl = args.experts_impl
    if impl == "auto":
        impl = "grouped_mm" if dev.type == "cuda" else None
    if impl and hasattr(original, "set_experts_implementation"):
        try:
            original.set_experts_implementation(impl)
        except Exception as e:  # an older transformers without it
            print(f"experts implementation {impl} unavailable ({e}); using the default")
            impl = None
    else:
        impl = None
    print(f"original experts implementation: {impl or 'the default'}")
    swapped = copy.deepcopy(original)
    n = replace_moe_blocks(swapped, mode=args.mode, buffer_fraction=args.buffer_fraction,
                           selection_rule=args.selection_rule, seed=args.seed)
    print(f"swapped {n} Qwen3MoeSparseMoeBlock(s) for lrmoe.torch.MoE "
          f"(mode {args.mode}, buffer_fraction {args.buffer_fraction})")
    data = np.frombuffer(CORPUS.read_bytes(), dtype=np.uint8).astype(np.int64)
    rng = np.random.default_rng(args.seed)
    starts = [rng.integers(0, len(data) - args.seq - 1, args.batch) for _ in range(args.steps)]
    curves = {}
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    warm = max(0, min(args.warmup, args.steps - 1))
    for name, model in (("original", original), ("lrmoe", swapped)):
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        losses, t0 = [], time.perf_counter()
        for step, s in enumerate(starts, 1):
            if step == warm + 1:
                sync()
                t0 = time.perf_counter()
            ids = torch.from_numpy(np.stack([data[i:i + args.seq] for i in s])).to(dev)
            loss = model(input_ids=ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if step % 20 == 0 or step == args.steps:
                kept = [m.last_stats.get("kept_fraction") for m in model.modules()
                        if type(m).__name__ == "MoE"]
                extra = f", kept {np.mean(kept):.3f}" if kept else ""
                print(f"{name:8s} step {step:4d} loss {np.mean(losses[-20:]):.4f}{extra}")
        sync()
        secs = time.perf_counter() - t0
        timed = args.steps - warm
        tps = timed * args.batch * args.seq / secs
        print(f"{name:8s} {secs:.1f} s, {tps:,.0f} tokens/s")
        curves[name] = {"losses": losses, "tokens_per_s": tps}
    last = {k: float(np.mean(v["losses"][-20:])) for k, v in curves.items()}
    print(f"mean loss of the last 20 steps: original {last['original']:.4f}, "
          f"lrmoe {last['lrmoe']:.4f}; speed lrmoe / original "
          f"{curves['lrmoe']['tokens_per_s'] / curves['original']['tokens_per_s']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(curves))


if __name__ == "__main__":
    main()
