"""The peer of `lrmoe-attn-bench`: causal grouped-query attention through
PyTorch's fused `scaled_dot_product_attention` (the flash backend on
H100/H200), bf16, forward and forward + backward, at the shapes of
qwen3-moe-mini and Qwen3-30B-A3B; and the same attention materialised
(QKᵀ, softmax, PV in three ops, as lrmoe computes it). Median device ms of
10 runs after 3 warm-ups (CUDA events). One JSON line per shape and form.

  python3 benches/torch_attention.py
"""
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

dev = "cuda"
SHAPES = [("qwen3-moe-mini", 32, 512, 8, 2, 64), ("qwen3-30b-a3b", 8, 2048, 32, 4, 128)]


def timed(fn):
    ts = []
    for i in range(13):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        if i >= 3:
            ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]


def materialised(q, k, v):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=dev).tril()
    return s.masked_fill(~mask, float("-inf")).softmax(-1) @ v


for name, b, t, h, kv, d in SHAPES:
    q = torch.randn(b, h, t, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, kv, t, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, kv, t, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn(b, h, t, d, device=dev, dtype=torch.bfloat16)
    forms = {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        "materialised": lambda: materialised(q, k, v),
    }
    for form, f in forms.items():
        with torch.no_grad():
            fwd = timed(f)
        both = timed(lambda: f().backward(do))
        print(json.dumps({"peer": f"pytorch-{form}", "shape": name, "fwd_ms": fwd, "fwd_bwd_ms": both}))
    # SDPA pinned to each fused backend (the default above picks one);
    # cuDNN's is what lrmoe's `LRMOE_ATTENTION_DQ=cudnn` backward runs.
    for label, backend in [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)]:
        try:
            with sdpa_kernel(backend):
                f = forms["sdpa"]
                with torch.no_grad():
                    fwd = timed(f)
                both = timed(lambda: f().backward(do))
            print(json.dumps({"peer": f"pytorch-sdpa-{label}", "shape": name, "fwd_ms": fwd, "fwd_bwd_ms": both}))
        except RuntimeError as e:
            print(json.dumps({"peer": f"pytorch-sdpa-{label}", "shape": name, "error": str(e).splitlines()[0]}))
