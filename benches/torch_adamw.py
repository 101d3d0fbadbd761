"""The peer of `LRMOE_GPU_TABLES=adamw lrmoe-gpu-bench`: PyTorch's fused
AdamW (`torch.optim.AdamW(fused=True)`) over one f32 parameter of 2**28
elements with an f32 gradient (28 bytes a parameter: p, m, v read and
written, g read). Median device ms of 10 steps after 3 (CUDA events). Prints
one JSON object, `{"adamw_ms": ..., "adamw_GBps": ...}`, to hand to the
bench as its anchors file.

  python3 benches/torch_adamw.py > /tmp/adamw.json
"""
import json

import torch

n = 1 << 28
p = torch.nn.Parameter(torch.zeros(n, device="cuda"))
p.grad = torch.full((n,), 1e-3, device="cuda")
opt = torch.optim.AdamW([p], lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
ts = []
for i in range(13):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    opt.step()
    b.record()
    torch.cuda.synchronize()
    if i >= 3:
        ts.append(a.elapsed_time(b))
ms = sorted(ts)[len(ts) // 2]
print(json.dumps({"adamw_ms": ms, "adamw_GBps": 28 * n / (ms * 1e-3) / 1e9}))
