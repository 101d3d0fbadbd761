"""The PyTorch peer of `lrmoe train --device cuda --model-config ...`: the same
Qwen3-MoE model (RMSNorm, q/k/v projections without bias, per-head q/k
RMSNorm, rotate-half RoPE, causal grouped-query attention through
scaled_dot_product_attention, SwiGLU experts through torch._grouped_mm,
dropless top-k routing with renormalised gates, final norm, LM head,
cross-entropy), fused AdamW (weight decay 0.1 on matrices, betas
0.9/0.95) and global-norm clipping at 1.0, on random windows of the same
byte corpus — written as fast as plain PyTorch allows: bf16 weights for
compute, flash attention through SDPA, the experts as torch._grouped_mm
with group offsets kept on the device (no .item()/.tolist() in a one-GPU
step), fused AdamW, torch.compile around the experts with --compile.

--precision master (default; lrmoe's precision): the optimizer keeps f32
master weights and f32 moments, the step's bf16 gradients are copied into
f32 gradient buffers, and after each step the masters are copied into the
bf16 weights (torch._foreach_copy_), as Megatron-Core's mixed-precision
optimizer does. --precision bf16: weights, gradients and AdamW moments all
bf16 (the fastest PyTorch setting, with less precision than lrmoe keeps).
(bf16 autocast over f32 parameters, this script's first version, re-casts
every weight at every op and ran 4-5x slower; it is not a fair peer.)

  python3 benches/torch_qwen3_moe.py --config examples/qwen3-moe-mini.config.json \
      --seq 512 --batch 32 --steps 60 [--compile] [--precision bf16]
  torchrun --nproc_per_node=2 benches/torch_qwen3_moe.py --config ... --batch 64

Under torchrun (WORLD_SIZE > 1) the experts are sharded in contiguous
blocks of E / world and the MoE layer dispatches rows with differentiable
all_to_all_single as in benches/torch_ep_anchor.py (Megatron-Core's
all-to-all dispatcher, simplified); dense weights and the router are
replicated, their gradients all-reduced; `--batch` is the global batch,
split over the ranks; the loss is the mean over every rank's tokens and the
clip uses the global norm (replicated gradients counted once).

Prints one JSON line: tokens/s (median step of the steps after 10 warm-ups,
CUDA events), model FLOPs per token, MFU against the H200's 989 TFLOP/s
dense bf16 peak, the first and last losses.
"""
import argparse, json, math, os, time
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dnn
import torch.nn.functional as F

import qwen3_shape

ap = argparse.ArgumentParser()
ap.add_argument("--config", required=True)
ap.add_argument("--seq", type=int, default=512)
ap.add_argument("--batch", type=int, default=32)
ap.add_argument("--steps", type=int, default=60)
ap.add_argument("--layers", type=int, default=None)
ap.add_argument("--corpus", default="crates/lrmoe/data/shakespeare.txt")
ap.add_argument("--compile", action="store_true")
ap.add_argument("--precision", choices=["master", "bf16"], default="master")
a = ap.parse_args()
S = qwen3_shape.load(a.config, a.layers)
L, D, H, KV, DH = S.L, S.D, S.H, S.KV, S.DH
E, K, FF, V, EPS, THETA = S.E, S.K, S.FF, S.V, S.EPS, S.THETA
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
RANK = int(os.environ.get("RANK", "0"))
if WORLD > 1:
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", RANK)))
    dist.init_process_group("nccl")
EL = E // WORLD
dev = "cuda"
torch.manual_seed(0)


def rms(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * w).to(x.dtype)


@torch.compiler.disable
def grouped_experts(xe, gate, up, down, offs):
    """The experts' SwiGLU as three grouped GEMMs. Eager under --compile:
    torch 2.11's dynamo fails on torch._grouped_mm, so the compiled peer
    compiles everything around the experts (a graph break here)."""
    return torch._grouped_mm(F.silu(torch._grouped_mm(xe, gate, offs=offs)) * torch._grouped_mm(xe, up, offs=offs),
                             down, offs=offs)


class Block(torch.nn.Module):
    def __init__(s):
        super().__init__()
        p = lambda *shape, fan: torch.nn.Parameter(torch.empty(*shape).uniform_(-1, 1) / math.sqrt(fan))
        s.n1, s.n2 = torch.nn.Parameter(torch.ones(D)), torch.nn.Parameter(torch.ones(D))
        s.qn, s.kn = torch.nn.Parameter(torch.ones(DH)), torch.nn.Parameter(torch.ones(DH))
        s.wq, s.wk, s.wv = p(D, H * DH, fan=D), p(D, KV * DH, fan=D), p(D, KV * DH, fan=D)
        s.wo = p(H * DH, D, fan=H * DH)
        s.router = p(D, E, fan=D)
        s.gate, s.up, s.down = p(EL, D, FF, fan=D), p(EL, D, FF, fan=D), p(EL, FF, D, fan=FF)

    def forward(s, x, cos, sin):
        B, T, _ = x.shape
        a = rms(x, s.n1)
        q = (a @ s.wq).view(B, T, H, DH)
        k = (a @ s.wk).view(B, T, KV, DH)
        v = (a @ s.wv).view(B, T, KV, DH)
        q, k = rms(q, s.qn), rms(k, s.kn)

        def rope(t):
            t1, t2 = t[..., : DH // 2], t[..., DH // 2 :]
            return torch.cat([t1 * cos - t2 * sin, t2 * cos + t1 * sin], -1)

        q, k = rope(q).transpose(1, 2), rope(k).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=True, enable_gqa=True)
        x = x + o.transpose(1, 2).reshape(B, T, H * DH) @ s.wo
        m = rms(x, s.n2).reshape(B * T, D)
        p_ = (m @ s.router).float().softmax(-1)
        g, idx = p_.topk(K, dim=-1)
        g = g / g.sum(-1, keepdim=True)
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)
        per_expert = torch.bincount(flat, minlength=E)
        xs = m.index_select(0, order // K)
        dt = xs.dtype
        experts = lambda xe, offs: grouped_experts(xe, s.gate, s.up, s.down, offs)
        if WORLD == 1:
            o = experts(xs, per_expert.cumsum(0).to(torch.int32))
        else:
            send_rank = per_expert.view(WORLD, EL).sum(1)
            recv_expert = torch.empty(WORLD * EL, device=x.device, dtype=per_expert.dtype)
            dist.all_to_all_single(recv_expert, per_expert)
            recv_expert = recv_expert.view(WORLD, EL)
            ins, outs = send_rank.tolist(), recv_expert.sum(1).tolist()
            xr = dnn.all_to_all_single(torch.empty(sum(outs), D, device=x.device, dtype=dt), xs,
                                       output_split_sizes=outs, input_split_sizes=ins)
            le = torch.repeat_interleave(torch.arange(EL, device=x.device).repeat(WORLD), recv_expert.reshape(-1))
            reg = le.argsort(stable=True)
            oe = experts(xr.index_select(0, reg), recv_expert.sum(0).cumsum(0).to(torch.int32))
            back = torch.zeros_like(oe).index_copy(0, reg, oe)
            o = dnn.all_to_all_single(torch.empty(xs.shape[0], D, device=x.device, dtype=dt), back,
                                      output_split_sizes=ins, input_split_sizes=outs)
        y = o * g.reshape(-1)[order].unsqueeze(1).to(dt)
        y = torch.zeros(B * T, D, device=x.device, dtype=y.dtype).index_add_(0, order // K, y)
        return x + y.view(B, T, D)


class Model(torch.nn.Module):
    def __init__(s):
        super().__init__()
        s.emb = torch.nn.Parameter(torch.empty(V, D).uniform_(-1, 1))
        s.blocks = torch.nn.ModuleList([Block() for _ in range(L)])
        s.nf = torch.nn.Parameter(torch.ones(D))
        s.head = torch.nn.Parameter(torch.empty(D, V).uniform_(-1, 1) / math.sqrt(D))
        inv = THETA ** (-torch.arange(0, DH // 2, dtype=torch.float32) * 2 / DH)
        ang = torch.arange(a.seq, dtype=torch.float32)[:, None] * inv[None]
        s.register_buffer("cos", ang.cos()[None, :, None, :])
        s.register_buffer("sin", ang.sin()[None, :, None, :])

    def forward(s, tok, tgt):
        x = s.emb[tok]
        for b in s.blocks:
            x = b(x, s.cos, s.sin)
        logits = rms(x, s.nf) @ s.head
        # bf16 logits: the loss kernel accumulates in f32 without an f32
        # copy of the [tokens, vocab] logits.
        return F.cross_entropy(logits.view(-1, V), tgt.view(-1))


torch.manual_seed(0)
model = Model().to(dev)
torch.manual_seed(1 + RANK)  # each rank's own experts
for b in model.blocks:
    for w, fan in ((b.gate, D), (b.up, D), (b.down, FF)):
        with torch.no_grad():
            w.uniform_(-1, 1).div_(math.sqrt(fan))
# f32 masters (and f32 gradient buffers) beside the bf16 compute weights, or
# nothing beside them (all bf16).
names = [n for n, _ in model.named_parameters()]
masters = [p.detach().clone() for p in model.parameters()] if a.precision == "master" else None
model = model.to(torch.bfloat16)
params = list(model.parameters())
opt_params = masters if masters is not None else params
if masters is not None:
    for m in masters:
        m.grad = torch.zeros_like(m)
expert_params = [p for b in model.blocks for p in (b.gate, b.up, b.down)]
dense_params = [p for p in model.parameters() if all(p is not q for q in expert_params)]
decay = [q for n, q in zip(names, opt_params) if q.dim() > 1 and n != "emb"]
rest = [q for n, q in zip(names, opt_params) if not (q.dim() > 1 and n != "emb")]
opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                        lr=3e-3, betas=(0.9, 0.95), eps=1e-8, fused=True)
step_fn = torch.compile(model) if a.compile else model
data = torch.tensor(list(open(a.corpus, "rb").read()), dtype=torch.long, device=dev) % V
gen = torch.Generator(device=dev).manual_seed(1)
PER = a.batch // WORLD


def step():
    starts = torch.randint(0, data.numel() - a.seq - 1, (a.batch,), device=dev, generator=gen)[RANK * PER:(RANK + 1) * PER]
    ix = starts[:, None] + torch.arange(a.seq, device=dev)[None]
    loss = step_fn(data[ix], data[ix + 1])
    loss.backward()
    if WORLD == 1:
        if masters is not None:
            torch._foreach_copy_([m.grad for m in masters], [p.grad for p in params])
        torch.nn.utils.clip_grad_norm_(opt_params, 1.0, foreach=True)
    else:
        # The loss is the mean over every rank's tokens: dense gradients
        # averaged over ranks, experts' (which saw every rank's rows) / W.
        dense = [p.grad for p in dense_params if p.grad is not None]
        flat = torch.cat([d.reshape(-1) for d in dense])
        dist.all_reduce(flat)
        flat /= WORLD
        off = 0
        for d in dense:
            d.copy_(flat[off:off + d.numel()].view_as(d)); off += d.numel()
        ex = [p.grad for p in expert_params if p.grad is not None]
        torch._foreach_div_(ex, WORLD)
        sq = torch.stack([e.float().pow(2).sum() for e in ex]).sum()
        dist.all_reduce(sq)
        norm = (sq + flat.float().pow(2).sum()).sqrt()
        scale = torch.clamp(1.0 / (norm + 1e-6), max=1.0)
        torch._foreach_mul_(dense + ex, scale)
        if masters is not None:
            torch._foreach_copy_([m.grad for m in masters], [p.grad for p in params])
    opt.step()
    if masters is not None:
        with torch.no_grad():
            torch._foreach_copy_(params, masters)
    model.zero_grad(set_to_none=True)
    return loss


times, losses = [], []
for i in range(a.steps):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    loss = step()
    e.record()
    torch.cuda.synchronize()
    times.append(s.elapsed_time(e) / 1e3)
    if WORLD > 1:
        l = loss.detach().clone()
        dist.all_reduce(l)
        losses.append(l.item() / WORLD)
    else:
        losses.append(loss.item())
t = sorted(times[10:])[len(times[10:]) // 2]
tok = a.batch * a.seq  # over every rank
# Model FLOPs per token (forward; training = 3×): projections, router,
# the k experts' SwiGLU, LM head, and attention's QKᵀ and PV over the full
# sequence (what the lrmoe kernels compute; causal FLOPs are half).
fwd = L * 2 * (D * H * DH * 2 + D * KV * DH * 2 + D * E + K * 3 * D * FF) + 2 * D * V + L * 2 * 2 * a.seq * H * DH
flops = 3 * fwd
# Under --compile, what dynamo did (its counters; a key it does not keep
# reads 0): a peer that recompiled past its limit or broke its graph more
# than at the experts runs partly eager, and its rate says so only by
# being low.
dynamo = None
if a.compile:
    try:  # a private module: its absence must not cost the measurement
        from torch._dynamo.utils import counters
        dynamo = {"unique_graphs": counters["stats"]["unique_graphs"],
                  "graph_breaks": sum(counters["graph_break"].values()),
                  "frames_compiled": counters["frames"]["ok"], "frames_seen": counters["frames"]["total"]}
    except Exception as e:  # noqa: BLE001
        dynamo = {"unavailable": repr(e)}
if RANK == 0:
  print(json.dumps({"peer": "pytorch-" + a.precision + ("-compile" if a.compile else ""), "gpus": WORLD, "layers": L, "seq": a.seq, "batch": a.batch,
                  "step_ms": t * 1e3, "tokens_per_s": tok / t, "flops_per_token": flops,
                  "mfu": flops * tok / t / 989e12 / WORLD, "loss_first": losses[0], "loss_last": losses[-1],
                  "dynamo": dynamo}))
if WORLD > 1:
    dist.destroy_process_group()
