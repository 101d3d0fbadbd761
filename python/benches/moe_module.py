"""lrmoe.torch.MoE on CUDA beside the plain PyTorch MoE block, in one process.

    python3 python/benches/moe_module.py                 # speed (JSON on the RESULT line)
    python3 python/benches/moe_module.py --memory        # backward peak memory

Shape: Qwen3-30B-A3B experts (128 experts, hidden 2048, moe ffn 768, top-8),
16 384 tokens, bf16, random router (the same weights for every contender).
The peer is a dropless PyTorch block as a PyTorch expert writes it: router
GEMM, softmax, top-k, a stable sort by expert, one ``torch._grouped_mm`` for
gate and up together and one for down, group offsets on the device, a
weighted ``index_add_`` combine; autograd backward. Eager and, with
``--compile``, ``torch.compile``d.

Rows of the speed table (median of ``--reps`` after 3 warm-ups, CUDA events):
the peer; ``lrmoe.torch.MoE`` at ``mode="full"`` (r = 1, the exact
gradient; its default keeps the forward's projections, as the peer's
autograd does), the same recomputing them (``keep_projections=False``), and
at ``mode="lrmoe"``, buffer fraction 0.6; and the native
layer called directly (``_lrmoe.DeviceLayer`` forward + backward on the same
tensors, no autograd and no DLPack): the module's time over it is the
Python boundary's cost, measured two ways: each call timed alone after a
device synchronisation (every microsecond of Python before the first kernel
shows), and five calls back to back between two events (as a training loop
runs them).

``--memory`` re-runs itself under ``PYTORCH_CUDA_ALLOC_CONF=
backend:cudaMallocAsync`` (torch then allocates from the pool the layer
uses, so ``torch.cuda.max_memory_allocated`` sees the layer's buffers) and
reports the most bytes the backward holds above what was allocated when it
started, exact and at 0.6.
"""
import argparse
import json
import os
import subprocess
import sys


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--compile", action="store_true", help="also time the torch.compile'd peer")
    ap.add_argument("--memory", action="store_true", help="backward peak memory instead")
    ap.add_argument("--profile", action="store_true",
                    help="also print the CUDA kernels of the module's and the native layer's calls")
    ap.add_argument("--gaps", action="store_true",
                    help="also print where the GPU idles in the module's and the native layer's "
                         "calls (torch.profiler's CPU and CUDA timelines)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args()


def main():
    args = parse()
    if args.memory and not args.child:
        env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="backend:cudaMallocAsync")
        sys.exit(subprocess.call([sys.executable, __file__, "--child"] + sys.argv[1:], env=env))
    import torch
    import torch.nn.functional as F

    from lrmoe.torch import MoE, cuda_available

    if not (torch.cuda.is_available() and cuda_available()):
        sys.exit("needs a CUDA device and lrmoe built with its cuda feature")
    E, H, Fd, k, T = args.experts, args.hidden, args.ffn, args.top_k, args.tokens
    dev = torch.device("cuda")
    torch.manual_seed(0)
    moe = MoE(H, Fd, E, k, True, dtype=torch.bfloat16, device=dev, mode="full")
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(T, H, device=dev, dtype=torch.bfloat16)

    # The peer's parameters: the same values, gate and up side by side.
    wr = moe.router.detach().clone().requires_grad_()
    wgu = torch.cat([moe.w_gate.detach(), moe.w_up.detach()], dim=2).contiguous().requires_grad_()
    wd = moe.w_down.detach().clone().requires_grad_()

    def peer(xin):
        logits = F.linear(xin, wr)
        p = logits.float().softmax(-1)
        g, idx = p.topk(k, dim=-1)
        g = g / g.sum(-1, keepdim=True)
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)
        offs = torch.bincount(flat, minlength=E).cumsum(0).to(torch.int32)
        tok = order // k
        xs = xin.index_select(0, tok)
        a, b = torch._grouped_mm(xs, wgu, offs=offs).chunk(2, dim=-1)
        o = torch._grouped_mm(F.silu(a) * b, wd, offs=offs)
        o = o * g.reshape(-1)[order].unsqueeze(1).to(o.dtype)
        return torch.zeros_like(xin).index_add_(0, tok, o)

    def timed_together(fns, calls=1, rounds=None, warm=True):
        """Median ms per call of each of ``fns``, timed in turn within each
        round (so that a slow stretch of the GPU falls on all of them):
        ``calls`` calls in a row between two events with no host wait
        between them (``calls`` > 1: as a training loop runs, the host
        prepares a call while the GPU finishes the previous one)."""
        if warm:
            for fn in fns:
                for _ in range(3):
                    fn()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ts = [[] for _ in fns]
        for _ in range(rounds or args.reps):
            for i, fn in enumerate(fns):
                s.record()
                for _ in range(calls):
                    fn()
                e.record()
                torch.cuda.synchronize()
                ts[i].append(s.elapsed_time(e) / calls)
        return [sorted(t)[len(t) // 2] for t in ts]

    def timed(fn):
        return timed_together([fn])[0]

    def fb(model):
        def run():
            xi = x.detach().requires_grad_()
            model(xi).backward(dy)
            # Every contender's gradients dropped (none accumulates a
            # gradient into the last call's: that would time an extra add).
            for p in (wr, wgu, wd, xi, *getattr(model, "parameters", list)()):
                p.grad = None
        return run

    if args.memory:
        out = {}
        # Both recompute the projections of the rows they keep (the exact
        # module's default keeps them from the forward instead, which this
        # measure of the backward alone would not see).
        for name, settings in (("exact", {"mode": "full", "keep_projections": False}),
                               ("lrmoe_0.6", {"mode": "lrmoe", "buffer_fraction": 0.6})):
            m = MoE(H, Fd, E, k, True, dtype=torch.bfloat16, device=dev, **settings)
            with torch.no_grad():
                for a, b in zip(m.parameters(), moe.parameters()):
                    a.copy_(b)
            for _ in range(2):  # the second call's figures
                xi = x.detach().requires_grad_()
                y = m(xi)
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                y.backward(dy)
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated() - base
                kept = m.last_stats["kept_fraction"]
                del xi, y
                m.zero_grad(set_to_none=True)
            out[name] = {"backward_peak_bytes": peak, "kept_fraction": kept}
        # What every backward returns whatever it keeps: the weights'
        # gradients (bf16 experts, f32 router) and dX (bf16).
        grads = 3 * E * H * Fd * 2 + H * E * 4 + T * H * 2
        out["gradient_outputs_bytes"] = grads
        ex, lr = out["exact"]["backward_peak_bytes"], out["lrmoe_0.6"]["backward_peak_bytes"]
        out["peak_reduction"] = 1 - lr / ex
        out["peak_reduction_beyond_gradients"] = 1 - (lr - grads) / (ex - grads)
        out["rows_dropped"] = 1 - out["lrmoe_0.6"]["kept_fraction"]
        out["alloc_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
        print("RESULT " + json.dumps(out))
        return

    rows = {"peer_eager_ms": timed(fb(peer))}
    if args.compile:
        try:
            rows["peer_compiled_ms"] = timed(fb(torch.compile(peer)))
        except Exception as ex:  # report, do not hide
            rows["peer_compiled_error"] = str(ex)[:200]
    rows["lrmoe_full_ms"] = timed(fb(moe))
    lr = MoE(H, Fd, E, k, True, dtype=torch.bfloat16, device=dev, mode="lrmoe",
             buffer_fraction=0.6)
    with torch.no_grad():
        for a, b in zip(lr.parameters(), moe.parameters()):
            a.copy_(b)
    rows["lrmoe_0.6_ms"] = timed(fb(lr))
    rows["lrmoe_0.6_kept"] = lr.last_stats["kept_fraction"]
    # The exact backward recomputing the projections (less memory, two
    # grouped GEMMs more), as the planned backward does for its kept rows.
    rc = MoE(H, Fd, E, k, True, dtype=torch.bfloat16, device=dev, mode="full",
             keep_projections=False)
    with torch.no_grad():
        for a, b in zip(rc.parameters(), moe.parameters()):
            a.copy_(b)
    rows["lrmoe_full_recompute_ms"] = timed(fb(rc))

    native = moe._device_layer(dev)
    w16 = (moe.router.detach().t().contiguous(), moe.w_gate.detach(), moe.w_up.detach(),
           moe.w_down.detach())
    ptrs = tuple(t.data_ptr() for t in w16)
    stream = torch.cuda.current_stream().cuda_stream

    def direct():
        y, saved = native.forward(ptrs, x.data_ptr(), T, stream, None)
        parts, _ = native.backward(ptrs, saved, dy.data_ptr(), stream)
        del y, parts

    # The module and the native layer alternated: the Python boundary's cost.
    mod_ms, nat_ms = timed_together([fb(moe), direct])
    rows["module_full_alternated_ms"], rows["native_full_ms"] = mod_ms, nat_ms
    # The same, calls back to back: the Python before a call's first kernel
    # runs while the GPU finishes the previous call.
    b2b = timed_together([fb(moe), direct], calls=5, rounds=max(3, args.reps // 2), warm=False)
    rows["module_full_back_to_back_ms"], rows["native_full_back_to_back_ms"] = b2b
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        for name, fn in (("module", fb(moe)), ("native", direct)):
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    fn()
                torch.cuda.synchronize()
            ev = sorted(prof.key_averages(), key=lambda a: -getattr(a, "device_time_total", 0))
            total = sum(getattr(a, "device_time_total", 0) for a in ev) / 3e3
            top = ", ".join(f"{a.key[:32]} x{a.count // 3} {a.device_time_total / 3e3:.3f}"
                            for a in ev[:12])
            print(f"PROFILE {name}: {total:.3f} ms of kernels per call; {top}")
    if args.gaps:
        for name, fn in (("module", fb(moe)), ("native", direct)):
            print_gaps(name, fn, torch)
    best = min(v for key, v in rows.items() if key.startswith("peer_") and key.endswith("_ms"))
    rows["full_speedup_vs_best_peer"] = best / rows["lrmoe_full_ms"]
    rows["lrmoe_0.6_speedup_vs_best_peer"] = best / rows["lrmoe_0.6_ms"]
    rows["recompute_speedup_vs_best_peer"] = best / rows["lrmoe_full_recompute_ms"]
    rows["python_boundary_overhead"] = mod_ms / nat_ms - 1
    rows["python_boundary_overhead_back_to_back"] = b2b[0] / b2b[1] - 1
    rows["shape"] = {"experts": E, "hidden": H, "ffn": Fd, "top_k": k, "tokens": T}
    rows["torch"] = torch.__version__
    print("RESULT " + json.dumps(rows))


def print_gaps(name, fn, torch):
    """Where the GPU idles in ``fn``'s calls: each call's span from its
    first CPU event to its last kernel, the kernels' busy time, and the
    largest idle stretches with the CPU events running when each began."""
    from torch.profiler import ProfilerActivity, profile, record_function

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(3):
            with record_function(f"call{i}"):
                fn()
            torch.cuda.synchronize()
    evs = prof.events()
    on_gpu = lambda e: str(getattr(e, "device_type", "")).endswith("CUDA")  # noqa: E731
    calls = sorted((e for e in evs if e.name.startswith("call") and not on_gpu(e)),
                   key=lambda e: e.time_range.start)
    kern = sorted(
        (e.time_range.start, e.time_range.end)
        for e in evs
        if on_gpu(e) and e.time_range.end > e.time_range.start and not e.name.startswith("call")
    )
    cpu = [e for e in evs if not on_gpu(e) and not e.name.startswith("call")]
    for c in calls[1:]:
        t0 = c.time_range.start
        ks = [k for k in kern if k[0] >= t0 and k[0] <= c.time_range.end + 50_000]
        if not ks:
            continue
        busy, gaps, cur_s, cur_e = 0.0, [], ks[0][0], ks[0][1]
        gaps.append((ks[0][0] - t0, t0))
        for s0, e0 in ks[1:]:
            if s0 > cur_e:
                busy += cur_e - cur_s
                gaps.append((s0 - cur_e, cur_e))
                cur_s, cur_e = s0, e0
            else:
                cur_e = max(cur_e, e0)
        busy += cur_e - cur_s
        span = cur_e - t0
        gaps.sort(reverse=True)
        desc = []
        for g, at in gaps[:8]:
            running = sorted((e for e in cpu if e.time_range.start <= at + g and e.time_range.end >= at),
                             key=lambda e: e.time_range.start)
            names = ",".join(dict.fromkeys(e.name[:28] for e in running[-4:]))
            desc.append(f"{g:.0f}us@{at - t0:.0f} [{names}]")
        before = sorted((e for e in cpu if t0 <= e.time_range.start < ks[0][0]
                         and e.time_range.end - e.time_range.start >= 8),
                        key=lambda e: e.time_range.start)
        ops = ", ".join(f"+{e.time_range.start - t0:.0f} {e.name[:24]} {e.time_range.end - e.time_range.start:.0f}us"
                        for e in before[:12])
        print(f"GAPS {name}: span {span / 1e3:.3f} ms, kernels busy {busy / 1e3:.3f} ms, "
              f"idle {(span - busy) / 1e3:.3f} ms in {len(gaps)} gaps; largest: " + "; ".join(desc)
              + f"; before the first kernel: {ops}")


if __name__ == "__main__":
    main()
