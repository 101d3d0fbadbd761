"""PyTorch's column of the dense parts table (`benches/parts.py --torch`):
each dense part of one training step of the Qwen3-MoE model in
benches/torch_qwen3_moe.py, timed on its own at the same shapes, as fast as
plain PyTorch does it — eager, and under torch.compile where compiling can
fuse anything (norms, RoPE, cross-entropy) — so that lrmoe's parts
(`LRMOE_PARTS=1 lrmoe train --device cuda`) stand beside PyTorch's.

  python3 benches/torch_parts.py --config examples/qwen3-30b-a3b.config.json \
      --layers 2 --seq 2048 --batch 8 [--no-compile] > torch-parts.jsonl

The parts carry lrmoe's names and cover the same work (per step, summed
over the layers):

  embedding / embedding backward   the lookup; the table's gradient
  norms / norms backward           the 2 L + 1 RMSNorms (gains' gradients,
                                   and the residual gradient's add)
  qkv projections (backward)       q, k, v GEMMs and the q/k head norms
                                   (also one fused [wq|wk|wv] GEMM)
  attention (backward)             RoPE, layouts, causal GQA through SDPA
  o projection (backward)          the o GEMM and the residual add
  lm head / lm head backward       the logits GEMM; its two gradient GEMMs
  cross-entropy                    loss and the logits' gradient (bf16)
  gradient norm                    the global norm and the clip (master:
                                   with the bf16 → f32 gradient copy)
  adamw                            fused AdamW over every parameter (1.87 B
                                   at the A3B shape; master: f32 masters and
                                   moments, then the copy to the bf16
                                   weights, as the peer's step does)

Where lrmoe's precision differs it is said in the line: the peer keeps
the residual stream in bf16 where lrmoe keeps it in f32, so the peer's
norms, embedding and residual adds move fewer bytes. Each part: CUDA events
around L calls (one per layer, each with its own tensors), median of 10
after 3 warm-ups. One JSON line per part: the part, eager ms, compiled ms
(null where compiling does not apply or failed, with the reason), and
"ms", the faster.
"""
import argparse
import json
import math

import torch
import torch.nn.functional as F

import qwen3_shape

ap = argparse.ArgumentParser()
ap.add_argument("--config", required=True)
ap.add_argument("--layers", type=int, default=None)
ap.add_argument("--seq", type=int, default=2048)
ap.add_argument("--batch", type=int, default=8)
ap.add_argument("--no-compile", action="store_true")
ap.add_argument("--precision", choices=["master", "bf16"], default="master")
a = ap.parse_args()
S = qwen3_shape.load(a.config, a.layers)
L, D, H, KV, DH, E, FF, V, EPS, THETA = S.L, S.D, S.H, S.KV, S.DH, S.E, S.FF, S.V, S.EPS, S.THETA
B, T = a.batch, a.seq
N = B * T
dev, bf = "cuda", torch.bfloat16
torch.manual_seed(0)


def timed(fn, reps=10, warm=3, setup=None):
    """Median ms of fn(); with setup, fn(setup()) and setup's work untimed
    (a backward's forward: each backward gets a fresh graph, so compiled
    graphs are never run backward twice)."""
    ts = []
    for i in range(reps + warm):
        state = setup() if setup else None
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn(state) if setup else fn()
        e.record()
        torch.cuda.synchronize()
        if i >= warm:
            ts.append(s.elapsed_time(e))
    return sorted(ts)[len(ts) // 2]


def rnd(*shape, grad=False, scale=1.0):
    t = (torch.randn(*shape, device=dev) * scale).to(bf)
    return t.requires_grad_(grad)


def rms(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * w).to(x.dtype)


inv = THETA ** (-torch.arange(0, DH // 2, dtype=torch.float32, device=dev) * 2 / DH)
ang = torch.arange(T, dtype=torch.float32, device=dev)[:, None] * inv[None]
# bf16 as the peer's (its model.to(bfloat16) casts the buffers too)
COS, SIN = ang.cos()[None, :, None, :].to(bf), ang.sin()[None, :, None, :].to(bf)


def rope(t):
    t1, t2 = t[..., : DH // 2], t[..., DH // 2:]
    return torch.cat([t1 * COS - t2 * SIN, t2 * COS + t1 * SIN], -1)


def attention(q, k, v):
    q, k = rope(q).transpose(1, 2), rope(k).transpose(1, 2)
    o = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=True, enable_gqa=True)
    return o.transpose(1, 2).reshape(N, H * DH)


def qkv(x, wq, wk, wv, qn, kn):
    q = rms((x @ wq).view(B, T, H, DH), qn)
    k = rms((x @ wk).view(B, T, KV, DH), kn)
    return q, k, (x @ wv).view(B, T, KV, DH)


def qkv_fused(x, w, qn, kn):
    q, k, v = (x @ w).split([H * DH, KV * DH, KV * DH], -1)
    return rms(q.reshape(B, T, H, DH), qn), rms(k.reshape(B, T, KV, DH), kn), v.reshape(B, T, KV, DH)


def out_proj(x, o, wo):
    return x + o @ wo


def xent(logits, tgt):
    return F.cross_entropy(logits, tgt)


def compiled(f):
    return torch.compile(f, dynamic=False)


def report(part, eager, comp=None, why=None, note=None):
    ms = min(x for x in (eager, comp) if x is not None)
    line = {"part": part, "eager_ms": eager, "compiled_ms": comp, "ms": ms, "precision": a.precision}
    if why:
        line["compile"] = why
    if note:
        line["note"] = note
    print(json.dumps(line), flush=True)


def both(part, make, note=None):
    """make(compiled) → (fn, setup): one step's calls of part, eager or
    compiled, as timed() takes them."""
    fn, setup = make(False)
    eager = timed(fn, setup=setup)
    comp, why = None, None
    if not a.no_compile:
        try:
            fn, setup = make(True)
            comp = timed(fn, setup=setup)
        except Exception as e:  # a compile failure is reported, not fatal
            why = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    report(part, eager, comp, why, note)


def grads_of(out, ins, dout):
    return torch.autograd.grad(out, ins, dout)


# ---- embedding -------------------------------------------------------------
tok = torch.randint(0, V, (N,), device=dev)
table = rnd(V, D, grad=True)
report("embedding", timed(lambda: F.embedding(tok, table)), note="bf16 rows (lrmoe writes f32)")
d_emb = rnd(N, D)
report("embedding backward", timed(lambda o: grads_of(o, table, d_emb), setup=lambda: F.embedding(tok, table)),
       note="bf16 table gradient")
del table, d_emb

# ---- norms -------------------------------------------------------------------
n_norms = 2 * L + 1
xs = [rnd(N, D, grad=True) for _ in range(n_norms)]
gs = [torch.ones(D, device=dev, dtype=bf, requires_grad=True) for _ in range(n_norms)]
dys = [rnd(N, D) for _ in range(n_norms)]
dres = [rnd(N, D) for _ in range(n_norms)]


def norms_fwd(comp):
    f = compiled(rms) if comp else rms
    return lambda: [f(x, w) for x, w in zip(xs, gs)], None


def norms_bwd(comp):
    f = compiled(rms) if comp else rms

    def run(outs):
        for o, x, w, dy, r in zip(outs, xs, gs, dys, dres):
            gx, _ = grads_of(o, (x, w), dy)
            r.add_(gx)  # the residual stream's gradient gathers both paths

    return run, lambda: [f(x, w) for x, w in zip(xs, gs)]


both("norms", norms_fwd, note="bf16 residual stream (lrmoe: f32)")
both("norms backward", norms_bwd, note="bf16 residual stream (lrmoe: f32)")
del xs, gs, dys, dres

# ---- attention block -----------------------------------------------------------
sc = 1 / math.sqrt(D)
lay = []
for _ in range(L):
    lay.append({
        "x": rnd(N, D, grad=True), "res": rnd(N, D),
        "wq": rnd(D, H * DH, grad=True, scale=sc), "wk": rnd(D, KV * DH, grad=True, scale=sc),
        "wv": rnd(D, KV * DH, grad=True, scale=sc), "wo": rnd(H * DH, D, grad=True, scale=1 / math.sqrt(H * DH)),
        "qn": torch.ones(DH, device=dev, dtype=bf, requires_grad=True),
        "kn": torch.ones(DH, device=dev, dtype=bf, requires_grad=True),
    })
for p in lay:
    p["wqkv"] = torch.cat([p["wq"], p["wk"], p["wv"]], 1).detach().requires_grad_(True)


def qkv_ins(p, fused):
    return (p["x"], p["wqkv"], p["qn"], p["kn"]) if fused else (p["x"], p["wq"], p["wk"], p["wv"], p["qn"], p["kn"])


def qkv_fwd(comp, fused=False):
    g = qkv_fused if fused else qkv
    f = compiled(g) if comp else g
    return lambda: [f(*qkv_ins(p, fused)) for p in lay], None


def qkv_bwd(comp, fused=False):
    g = qkv_fused if fused else qkv
    f = compiled(g) if comp else g
    with torch.no_grad():
        douts = [tuple(torch.randn_like(t) for t in qkv(*qkv_ins(p, False))) for p in lay]

    def run(outs):
        for o, p, d in zip(outs, lay, douts):
            grads_of(o, qkv_ins(p, fused), d)

    return run, lambda: [f(*qkv_ins(p, fused)) for p in lay]


both("qkv projections", qkv_fwd, note="three GEMMs and the head norms")
both("qkv projections backward", qkv_bwd, note="three GEMMs and the head norms")
both("qkv projections (one [wq|wk|wv] GEMM)", lambda comp: qkv_fwd(comp, True))
both("qkv projections backward (one [wq|wk|wv] GEMM)", lambda comp: qkv_bwd(comp, True))

with torch.no_grad():
    for p in lay:
        q, k, v = qkv(p["x"], p["wq"], p["wk"], p["wv"], p["qn"], p["kn"])
        p["q"], p["k"], p["v"] = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        p["o"] = rnd(N, H * DH, grad=True)
        p["do"] = rnd(N, H * DH)
        p["dx"] = rnd(N, D)


def attn_fwd(comp):
    f = compiled(attention) if comp else attention
    return lambda: [f(p["q"], p["k"], p["v"]) for p in lay], None


def attn_bwd(comp):
    f = compiled(attention) if comp else attention
    return (lambda outs: [grads_of(o, (p["q"], p["k"], p["v"]), p["do"]) for o, p in zip(outs, lay)],
            lambda: [f(p["q"], p["k"], p["v"]) for p in lay])


both("attention", attn_fwd, note="RoPE, layouts and SDPA (its default backend)")
both("attention backward", attn_bwd, note="RoPE, layouts and SDPA (its default backend)")


def o_fwd(comp):
    f = compiled(out_proj) if comp else out_proj
    return lambda: [f(p["res"], p["o"], p["wo"]) for p in lay], None


def o_bwd(comp):
    f = compiled(out_proj) if comp else out_proj
    return (lambda outs: [grads_of(o, (p["o"], p["wo"]), p["dx"]) for o, p in zip(outs, lay)],
            lambda: [f(p["res"], p["o"], p["wo"]) for p in lay])


both("o projection", o_fwd, note="the GEMM and the residual add (bf16 stream)")
both("o projection backward", o_bwd)
del lay

# ---- LM head and cross-entropy ---------------------------------------------------
hf = rnd(N, D, grad=True)
head = rnd(D, V, grad=True, scale=1 / math.sqrt(D))
report("lm head", timed(lambda: hf @ head))
dl = rnd(N, V, scale=1e-4)
report("lm head backward", timed(lambda lg: grads_of(lg, (hf, head), dl), setup=lambda: hf @ head))
with torch.no_grad():
    leaf = (hf @ head).requires_grad_(True)
del dl, hf, head
tgt = torch.randint(0, V, (N,), device=dev)


def xent_step(comp):
    f = compiled(xent) if comp else xent
    return lambda: torch.autograd.grad(f(leaf, tgt), leaf), None


both("cross-entropy", xent_step, note="bf16 logits in, bf16 gradient out")
del leaf

# ---- gradient norm and AdamW ---------------------------------------------------------
shapes = [(V, D), (D, V), (D,)]
for _ in range(L):
    shapes += [(D,), (D,), (DH,), (DH,), (D, H * DH), (D, KV * DH), (D, KV * DH), (H * DH, D), (D, E),
               (E, D, FF), (E, D, FF), (E, FF, D)]
n_params = sum(math.prod(s) for s in shapes)
weights = [torch.zeros(s, device=dev, dtype=bf) for s in shapes]
bgrads = [torch.randn(s, device=dev, dtype=torch.float32).mul_(1e-3).to(bf) for s in shapes]
if a.precision == "master":
    masters = [w.float().requires_grad_(True) for w in weights]
    for m, g in zip(masters, bgrads):
        m.grad = g.float()

    def gnorm():
        torch._foreach_copy_([m.grad for m in masters], bgrads)
        torch.nn.utils.clip_grad_norm_(masters, 1.0, foreach=True)

    opt = torch.optim.AdamW(masters, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)

    def adam():
        opt.step()
        with torch.no_grad():
            torch._foreach_copy_(weights, masters)
else:
    for w, g in zip(weights, bgrads):
        w.requires_grad_(True)
        w.grad = g

    def gnorm():
        torch.nn.utils.clip_grad_norm_(weights, 1.0, foreach=True)

    opt = torch.optim.AdamW(weights, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)

    def adam():
        opt.step()

report("gradient norm", timed(gnorm), note=f"{n_params / 1e9:.3f} B parameters")
report("adamw", timed(adam), note=f"{n_params / 1e9:.3f} B parameters, fused")
