"""A NumPy reference of the MoE layer (float64): routing, SwiGLU experts,
and the exact backward — or the backward over a given kept set of pairs,
the LRMoE rule's definition (a dropped pair loses its expert-weight and
input gradients through its expert; the router gradient keeps every pair)."""

import numpy as np


def silu(a):
    return a / (1.0 + np.exp(-a))


def forward(w, x, top_k, renormalize=True):
    router, gate, up, down = (np.asarray(t, dtype=np.float64) for t in w)
    x = np.asarray(x, dtype=np.float64)
    logits = x @ router
    logits -= logits.max(axis=1, keepdims=True)
    probs = np.exp(logits)
    probs /= probs.sum(axis=1, keepdims=True)
    # Top-k, ties to the lower expert index.
    order = np.argsort(-probs, axis=1, kind="stable")[:, :top_k]
    p_top = np.take_along_axis(probs, order, axis=1)
    g = p_top / p_top.sum(axis=1, keepdims=True) if renormalize else p_top
    n, h = x.shape
    y = np.zeros((n, h))
    out = np.zeros((n, top_k, h))
    hsq = np.zeros((n, top_k))
    for t in range(n):
        for k in range(top_k):
            e = order[t, k]
            a, b = x[t] @ gate[e], x[t] @ up[e]
            hh = silu(a) * b
            out[t, k] = hh @ down[e]
            hsq[t, k] = hh @ hh
            y[t] += g[t, k] * out[t, k]
    return y, dict(probs=probs, order=order, p_top=p_top, g=g, out=out, hsq=hsq, x=x)


def scores(st, dy):
    """The LRM score g²·‖δ‖²·‖h‖² of every pair (tokens × top_k)."""
    dsq = (np.asarray(dy, dtype=np.float64) ** 2).sum(axis=1)
    return st["g"] ** 2 * dsq[:, None] * st["hsq"]


def backward(w, st, dy, renormalize=True, kept=None):
    router, gate, up, down = (np.asarray(t, dtype=np.float64) for t in w)
    dy = np.asarray(dy, dtype=np.float64)
    x, g, order, out = st["x"], st["g"], st["order"], st["out"]
    n, top_k = order.shape
    kept = np.ones((n, top_k), dtype=bool) if kept is None else kept
    dx = np.zeros_like(x)
    dgate, dup, ddown = np.zeros_like(gate), np.zeros_like(up), np.zeros_like(down)
    # Router: every pair's output (dL/dg = δ·o), through top-k and softmax.
    dg = np.einsum("th,tkh->tk", dy, out)
    if renormalize:
        s = st["p_top"].sum(axis=1, keepdims=True)
        dp_top = (dg - (dg * g).sum(axis=1, keepdims=True)) / s
    else:
        dp_top = dg
    dp = np.zeros_like(st["probs"])
    np.put_along_axis(dp, order, dp_top, axis=1)
    p = st["probs"]
    dlogits = p * (dp - (dp * p).sum(axis=1, keepdims=True))
    drouter = x.T @ dlogits
    dx += dlogits @ router.T
    for t in range(n):
        for k in range(top_k):
            if not kept[t, k]:
                continue
            e = order[t, k]
            a, b = x[t] @ gate[e], x[t] @ up[e]
            sig = 1.0 / (1.0 + np.exp(-a))
            hh = a * sig * b
            do = g[t, k] * dy[t]
            ddown[e] += np.outer(hh, do)
            dh = down[e] @ do
            da = dh * b * sig * (1.0 + a * (1.0 - sig))
            db = dh * a * sig
            dgate[e] += np.outer(x[t], da)
            dup[e] += np.outer(x[t], db)
            dx[t] += gate[e] @ da + up[e] @ db
    return dx, dict(router=drouter, gate=dgate, up=dup, down=ddown)


def random_layer(rng, hidden=16, ffn=24, experts=6, tokens=40):
    w = (
        rng.standard_normal((hidden, experts)) * 0.5,
        rng.standard_normal((experts, hidden, ffn)) / np.sqrt(hidden),
        rng.standard_normal((experts, hidden, ffn)) / np.sqrt(hidden),
        rng.standard_normal((experts, ffn, hidden)) / np.sqrt(ffn),
    )
    x = rng.standard_normal((tokens, hidden))
    dy = rng.standard_normal((tokens, hidden))
    return tuple(t.astype(np.float32) for t in w), x.astype(np.float32), dy.astype(np.float32)
